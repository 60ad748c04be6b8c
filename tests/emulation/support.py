"""What the kernel emulation's tests share: the module under test, a device-array stand-in
(host memory posing as device memory) and pages that fault when touched."""
from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import numpy as np

_EMULATION_ROOT = Path(__file__).resolve().parents[1] / "cuda_emulation"


def _import_kernels():
    # Only for this import: the folder also holds the `cupy` stand-in, which must not
    # shadow (or pose as) CuPy for the rest of the test session.
    sys.path.insert(0, str(_EMULATION_ROOT))
    try:
        from cudaemu import kernels as module
    finally:
        sys.path.remove(str(_EMULATION_ROOT))
    return module


kernels = _import_kernels()


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class DeviceArray:
    """A NumPy array passed to kernels as a device array: `.data.ptr` is its address."""

    buffer = None

    def __init__(self, host: np.ndarray):
        self.host = host
        self.data = _Pointer(host.ctypes.data)
        self.size = host.size
        self.dtype = host.dtype
        self.shape = host.shape


kernels.register_array_type(DeviceArray)


PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class GuardedBuffer:
    """`nbytes` of memory that end where a PROT_NONE page begins: touching the byte after
    the last one faults, as past a guarded device allocation."""

    def __init__(self, nbytes: int):
        pages = -(-nbytes // PAGE)
        self._map = mmap.mmap(-1, (pages + 1) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.guard = base + pages * PAGE
        if _libc.mprotect(self.guard, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
        self._offset = pages * PAGE - nbytes
        self.start = base + self._offset
        self.nbytes = nbytes

    def array(self, dtype) -> np.ndarray:
        """The buffer as a writable 1-D array of `dtype`."""
        dtype = np.dtype(dtype)
        return np.frombuffer(self._map, dtype, self.nbytes // dtype.itemsize, self._offset)


def device(values, dtype=None) -> DeviceArray:
    """A device array holding a contiguous copy of `values`, ending at a PROT_NONE page
    (a kernel going past its end faults instead of corrupting the test process)."""
    host = np.array(values, dtype=dtype, copy=True, order="C")
    buffer = GuardedBuffer(max(host.nbytes, host.itemsize))
    guarded = buffer.array(host.dtype)[:host.size].reshape(host.shape)
    guarded[...] = host
    array = DeviceArray(guarded)
    array.buffer = buffer  # the mapping lives as long as the array
    return array

"""The CUDA driver library (libcuda) through ctypes, for what CuPy's runtime module lacks:
P2P link attributes and the access a GPU has to a pointer's memory.

Loaded once, on first use; None where it cannot be loaded (no driver, or one without
these functions), and every caller then falls back to what the runtime says.
"""
from __future__ import annotations

import ctypes
import threading

#: `CUdevice_P2PAttribute` values (cuda.h)
CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK = 0x01
CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED = 0x02
CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 0x03
CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED = 0x04
#: `CUpointer_attribute` value: the access the current context's GPU has to the memory
CU_POINTER_ATTRIBUTE_ACCESS_FLAGS = 16
#: `CUDA_POINTER_ATTRIBUTE_ACCESS_FLAGS` value: no access, the memory must be staged
CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE = 0

_NAMES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")
_lock = threading.Lock()
_driver: list = []  # [the loaded driver library, or None], once tried


def cuda_driver():
    """libcuda with the functions used here typed, or None where it cannot be loaded."""
    if _driver:
        return _driver[0]
    with _lock:
        if not _driver:
            _driver.append(_load())
    return _driver[0]


def _load():
    cint_p = ctypes.POINTER(ctypes.c_int)
    for name in _NAMES:
        try:
            lib = ctypes.CDLL(name)
            lib.cuInit.argtypes = [ctypes.c_uint]
            lib.cuDeviceGet.argtypes = [cint_p, ctypes.c_int]
            lib.cuDeviceGetP2PAttribute.argtypes = [cint_p, ctypes.c_int, ctypes.c_int,
                                                    ctypes.c_int]
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                                  ctypes.c_uint64]
            for fn in (lib.cuInit, lib.cuDeviceGet, lib.cuDeviceGetP2PAttribute,
                       lib.cuPointerGetAttribute):
                fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        return lib
    return None


def pointer_access(ptr: int) -> int | None:
    """The access flags (`CUDA_POINTER_ATTRIBUTE_ACCESS_FLAGS`) the current GPU has to the
    memory at device address `ptr`; None without a driver; no access (0) when the driver
    fails to answer, so that the caller stages rather than risk a faulting read.

    Peer access (cudaDeviceEnablePeerAccess) covers plain allocations only: memory from a
    stream-ordered pool (cudaMallocAsync, CuPy's MemoryAsyncPool) is reachable from
    another GPU only once the pool grants it (cudaMemPoolSetAccess), and memory of a
    virtual-memory mapping (PyTorch's expandable segments) only once the mapping does
    (cuMemSetAccess). This asks the driver what holds for this pointer.
    """
    driver = cuda_driver()
    if driver is None:
        return None
    flags = ctypes.c_int()
    status = driver.cuPointerGetAttribute(ctypes.byref(flags),
                                          CU_POINTER_ATTRIBUTE_ACCESS_FLAGS,
                                          ctypes.c_uint64(ptr))
    return flags.value if status == 0 else CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE

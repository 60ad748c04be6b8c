"""DLPack for emulated arrays: real `dltensor` capsules holding a DLManagedTensor, so a
producer or consumer written against the DLPack ABI sees what a CUDA one would.

Device arrays are exported as kDLCUDA (2) with their GPU id; bfloat16 as kDLBfloat
(code 4, 16 bits), which CuPy 14 maps to `ml_dtypes.bfloat16` when importing.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from . import memory

KDL_CPU, KDL_CUDA, KDL_CUDA_MANAGED = 1, 2, 13
_INT, _UINT, _FLOAT, _BFLOAT, _BOOL = 0, 1, 2, 4, 6


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _DELETER)]

# The destructor gets the capsule while it is being freed: as a raw pointer, never as a
# Python object (which would touch its reference count).
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_NAME, _USED = b"dltensor", b"used_dltensor"

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_raw_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))

_lock = threading.RLock()  # capsule destructors may run (GC) while it is held
_exported: dict = {}  # address of a DLManagedTensor -> what keeps it and its array alive


def _dl_dtype(dtype: np.dtype) -> DLDataType:
    if dtype.type.__module__ == "ml_dtypes" and dtype.name == "bfloat16":
        return DLDataType(_BFLOAT, 16, 1)
    code = {"i": _INT, "u": _UINT, "f": _FLOAT, "b": _BOOL}.get(dtype.kind)
    if code is None:
        raise TypeError(f"DLPack cannot carry dtype {dtype}")
    return DLDataType(code, dtype.itemsize * 8, 1)


def _np_dtype(dl: DLDataType) -> np.dtype:
    if dl.lanes != 1:
        raise TypeError(f"DLPack vectors (lanes={dl.lanes}) are not supported")
    if dl.code == _BFLOAT and dl.bits == 16:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    kind = {_INT: "i", _UINT: "u", _FLOAT: "f", _BOOL: "b"}.get(dl.code)
    if kind is None:
        raise TypeError(f"unsupported DLPack dtype code {dl.code}")
    return np.dtype("?" if kind == "b" else f"{kind}{dl.bits // 8}")


@_DELETER
def _delete(managed) -> None:
    with _lock:
        _exported.pop(ctypes.addressof(managed.contents), None)


@_CAPSULE_DESTRUCTOR
def _destroy_capsule(capsule) -> None:
    # A capsule nobody consumed still owns its tensor: release it.
    if _raw_is_valid(capsule, _NAME):
        address = _raw_get_pointer(capsule, _NAME)
        with _lock:
            _exported.pop(address, None)


def to_capsule(array) -> object:
    """A `dltensor` capsule for the emulated device array `array` (no copy)."""
    view = array._view
    ndim = view.ndim
    shape = (ctypes.c_int64 * max(ndim, 1))(*view.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*(s // view.itemsize for s in view.strides))
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(array.data.ptr, DLDevice(KDL_CUDA, array.data.device_id),
                                 ndim, _dl_dtype(view.dtype), shape, strides, 0)
    managed.deleter = _delete
    with _lock:
        _exported[ctypes.addressof(managed)] = (managed, shape, strides, array)
    return _api.PyCapsule_New(ctypes.addressof(managed), _NAME, _destroy_capsule)


def from_capsule(capsule):
    """The emulated device array a `dltensor` capsule describes (consumed, no copy)."""
    from .array import ndarray
    if not _api.PyCapsule_IsValid(capsule, _NAME):
        raise ValueError("A DLPack tensor object cannot be consumed multiple times")
    address = _api.PyCapsule_GetPointer(capsule, _NAME)
    managed = DLManagedTensor.from_address(address)
    t = managed.dl_tensor
    if t.device.device_type not in (KDL_CUDA, KDL_CUDA_MANAGED):
        raise RuntimeError("CuPy only supports CUDA tensors (device type "
                           f"{t.device.device_type})")
    dtype = _np_dtype(t.dtype)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = (tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim))
               if t.strides else None)
    _api.PyCapsule_SetName(capsule, _USED)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    owner = _Owner(managed)
    ptr = (t.data or 0) + t.byte_offset
    if size == 0:
        from .api import empty
        owner.release()
        return empty(shape, dtype)
    mem = memory.UnownedMemory(ptr, size, owner, device_id=t.device.device_id)
    return ndarray(shape, dtype, memptr=memory.MemoryPointer(mem, 0), strides=strides)


class _Owner:
    """Keeps an imported tensor's producer alive; calls its deleter when collected."""

    def __init__(self, managed):
        self._finalizer = weakref.finalize(self, _call_deleter, ctypes.addressof(managed))

    def release(self):
        self._finalizer()


def _call_deleter(address: int) -> None:
    managed = DLManagedTensor.from_address(address)
    if managed.deleter:
        managed.deleter(ctypes.pointer(managed))


def from_dlpack(obj):
    """`cupy.from_dlpack`: an object with `__dlpack__`/`__dlpack_device__` (or a capsule)."""
    if not hasattr(obj, "__dlpack__"):
        return from_capsule(obj)
    device_type, _ = obj.__dlpack_device__()[:2]
    if device_type == KDL_CPU:
        raise TypeError("CPU arrays cannot be directly imported to CuPy. Use "
                        "`cupy.array(numpy.from_dlpack(input))` instead.")
    if device_type not in (KDL_CUDA, KDL_CUDA_MANAGED):
        raise TypeError(f"Unsupported array type: {device_type}")
    return from_capsule(obj.__dlpack__(stream=1))

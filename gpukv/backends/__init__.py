"""Devices and arrays: which array type is this, where does it live, how to adopt it.

Nothing heavy is imported here: CuPy and PyTorch types are recognised through
`sys.modules`, so a process that never made a CuPy array never imports CuPy.
"""
from __future__ import annotations

import sys

import numpy as np

from .._errors import DTypeError
from ._base import Device
from .host import HostDevice, host_device

__all__ = ["Device", "HostDevice", "host_device", "adopt", "is_gpu_array", "device_of",
           "SUPPORTED_DTYPES", "dtype_name"]

# MXNet's dtypes plus bfloat16 (NumPy's via ml_dtypes, when a caller uses it).
SUPPORTED_DTYPES = frozenset(
    ["float16", "bfloat16", "float32", "float64", "uint8", "int8", "int32", "int64"])


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name if not hasattr(dtype, "name") else dtype.name


def _cupy_ndarray():
    cupy = sys.modules.get("cupy")
    return cupy.ndarray if cupy is not None else None


def is_gpu_array(array) -> bool:
    """Whether `array` (already adopted) is a CuPy array."""
    cls = _cupy_ndarray()
    return cls is not None and isinstance(array, cls)


def adopt(obj):
    """`obj` as a NumPy or CuPy array sharing its memory, or None if it is no array.

    NumPy and CuPy arrays come back as they are. PyTorch tensors, JAX arrays and any
    object with `__cuda_array_interface__`, `__dlpack__` or the buffer/array interface
    are wrapped without a copy wherever the protocol allows it.
    """
    if type(obj) is np.ndarray:
        return obj
    cupy_cls = _cupy_ndarray()
    if cupy_cls is not None and isinstance(obj, cupy_cls):
        return obj
    if isinstance(obj, np.ndarray):  # subclasses (np.matrix, memmap)
        return obj
    if isinstance(obj, (list, tuple, dict, str, bytes, int, float, complex)) or obj is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        obj = obj.detach()
        if obj.is_cuda:
            return _cupy().asarray(obj)  # __cuda_array_interface__: zero copy
        return _torch_cpu(torch, obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return _cupy().asarray(obj)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        device_type = obj.__dlpack_device__()[0]
        if device_type in (2, 13):  # kDLCUDA, kDLCUDAManaged
            return _cupy().from_dlpack(obj)
        if device_type == 1:  # kDLCPU
            return np.from_dlpack(obj)
        return None
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        array = np.asarray(obj)
        return array if array.dtype != object else None
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        return None


def _torch_cpu(torch, tensor):
    """A CPU tensor as a NumPy array sharing its memory (bfloat16 through ml_dtypes).

    A tensor with a lazy negation or conjugation bit has no memory holding its values:
    it comes back as a read-only copy, so it can be pushed but never silently pulled into.
    """
    if tensor.is_neg() or tensor.is_conj():
        array = tensor.resolve_neg().resolve_conj()
        array = _torch_cpu(torch, array)
        array.flags.writeable = False
        return array
    if tensor.dtype == torch.bfloat16:
        try:
            from ml_dtypes import bfloat16
        except ImportError:
            raise DTypeError("bfloat16 tensors need ml_dtypes (pip install ml_dtypes)") from None
        return tensor.view(torch.int16).numpy().view(bfloat16)
    return tensor.numpy()  # shares memory, stays writable


def _cupy():
    from .cuda import cupy_module
    return cupy_module()


def device_of(array, slot: int = 0) -> Device:
    """The Device an adopted array lives on; `slot` picks the logical device."""
    if isinstance(array, np.ndarray):
        return host_device(slot)
    from .cuda import cuda_device
    return cuda_device(array.device.id, slot)

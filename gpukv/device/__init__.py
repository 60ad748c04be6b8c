"""Devices and arrays: which array type is this, where does it live, how to adopt it.

Nothing heavy is imported here: CuPy and PyTorch types are recognised through
`sys.modules`, so a process that never made a CuPy array never imports CuPy.
"""
from __future__ import annotations

import sys

import numpy as np

from .._dtypes import SUPPORTED_DTYPES
from .._errors import ArgumentKindError, DeviceError, DTypeError, GpukvError
from .base import Device, virtual_gpus
from .host import HostDevice, host_device
from .outs import announce_writes, write_refusal

__all__ = ["Device", "HostDevice", "host_device", "adopt", "device_of", "SUPPORTED_DTYPES",
           "virtual_gpus", "has_overlapping_elements", "gpu_devices", "write_refusal",
           "announce_writes", "gpu_count", "p2p_ranks", "cpu_model", "gpu_names",
           "device_named"]


def _cupy_ndarray():
    cupy = sys.modules.get("cupy")
    return cupy.ndarray if cupy is not None else None


def adopt(obj):
    """`obj` as a NumPy or CuPy array sharing its memory, or None if it is no array.

    NumPy and CuPy arrays come back as they are, a subclass of NumPy's as a plain view
    of its elements (a masked array is an ArgumentKindError). PyTorch tensors, JAX
    arrays and any object with `__cuda_array_interface__`, `__dlpack__` or the
    buffer/array interface are wrapped without a copy wherever the protocol allows it.
    An array on a device this process cannot use (a GPU it does not see, a PyTorch
    'meta' tensor, a DLPack device other than the CPU and CUDA) is a DeviceError; a
    NumPy scalar, which cannot be written in place, comes back read-only. An array its
    own library will not hand over (JAX's deleted or sharded arrays, a tracer) is an
    ArgumentKindError quoting that library's error.
    """
    if type(obj) is np.ndarray:
        return obj
    cupy_cls = _cupy_ndarray()
    if cupy_cls is not None and isinstance(obj, cupy_cls):
        return obj
    try:
        return _adopt_other(obj)
    except (GpukvError, MemoryError):
        raise
    except Exception as exc:  # the object's own protocol refused
        raise ArgumentKindError(f"cannot be read as an array: {type(exc).__name__}: "
                                f"{exc}{_sharded_hint(obj)}") from exc


def _sharded_hint(obj) -> str:
    """What to do instead with a JAX array laid over several devices, which no array
    protocol hands over whole; '' for anything else."""
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(obj, jax.Array):
        return ""
    try:
        devices = len(obj.sharding.device_set)
    except Exception:  # a deleted array, a tracer: its own error says enough
        return ""
    if devices < 2:
        return ""
    return (f" (a jax.Array over {devices} devices: gpukv.jax's push_tree, pull_tree "
            f"and pushpull_tree take sharded arrays, or pass its shards as a list, "
            f"[s.data for s in a.addressable_shards])")


def _adopt_other(obj):
    """`adopt` of anything but a NumPy or CuPy array."""
    if isinstance(obj, np.ndarray):  # subclasses (np.matrix, memmap): their elements
        masked = sys.modules.get("numpy.ma")
        if masked is not None and isinstance(obj, masked.MaskedArray):
            raise ArgumentKindError("a masked array: gpukv reads and writes every element, "
                                    "masked or not; pass a.filled(fill) or a.data")
        return obj.view(np.ndarray)  # (the sums are NumPy's, whatever the subclass's are)
    if isinstance(obj, np.generic):  # a NumPy scalar (even np.float64): immutable, never an out
        array = np.asarray(obj)
        array.flags.writeable = False
        return array if array.dtype != object else None
    if isinstance(obj, (list, tuple, dict, str, bytes, int, float, complex)) or obj is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        obj = obj.detach()
        if obj.is_cuda:
            # DLPack, not the CUDA array interface, which publishes bfloat16 as raw
            # 2-byte voids (or not at all); zero copy either way.
            return _from_gpu(obj, obj.device.index, lambda cp: cp.from_dlpack(obj))
        if obj.device.type != "cpu":
            raise DeviceError(f"a PyTorch tensor on device {str(obj.device)!r}: gpukv takes "
                              f"CPU and CUDA tensors")
        if obj.layout is not torch.strided:
            raise ArgumentKindError(f"a PyTorch tensor of layout {obj.layout}: gpukv takes "
                                    f"dense (strided) tensors; call .to_dense() first")
        return _one_place_per_element(_torch_cpu(torch, obj))
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_gpu(obj, None, lambda cp: cp.asarray(obj))
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        device_type, device_id = obj.__dlpack_device__()[:2]
        if device_type in (2, 13):  # kDLCUDA, kDLCUDAManaged
            return _from_gpu(obj, device_id, lambda cp: cp.from_dlpack(obj))
        if device_type == 1:  # kDLCPU
            return _from_cpu_dlpack(obj)
        raise DeviceError(f"a {type(obj).__name__} on DLPack device type {device_type} "
                          f"(id {device_id}): gpukv takes CPU (1) and CUDA (2, 13) arrays")
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        array = np.asarray(obj)
        return _one_place_per_element(array) if array.dtype != object else None
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        return None


def _from_cpu_dlpack(obj):
    """A CPU array through DLPack; through its `__array__` when NumPy cannot take its
    dtype over DLPack (bfloat16, as a JAX array's), else a DTypeError saying so."""
    try:
        return _one_place_per_element(np.from_dlpack(obj))
    except (RuntimeError, BufferError, TypeError, ValueError) as exc:
        reason = exc  # NumPy: "Unsupported dtype in DLTensor."
    if hasattr(obj, "__array__"):
        array = np.asarray(obj)
        if array.dtype != object:
            return _one_place_per_element(array)
    raise DTypeError(f"a {type(obj).__name__} whose dtype NumPy cannot take over DLPack "
                     f"({reason}); pass a NumPy array (bfloat16 through ml_dtypes) instead")


def _one_place_per_element(array):
    """`array`, read-only when several of its elements share memory (a broadcast view).

    A PyTorch `expand`ed tensor comes out writable with a zero stride; pulling into it
    would keep only the last row written, so it is a source, never an out.
    """
    if array.flags.writeable and array.size > 1 and any(
            stride == 0 and n > 1 for stride, n in zip(array.strides, array.shape)):
        array = array.view()
        array.flags.writeable = False
    return array


#: Arrays up to this many elements get an exact overlap test when the quick one fails.
_EXACT_OVERLAP_LIMIT = 1 << 20


def has_overlapping_elements(array) -> bool:
    """Whether two elements of `array` (NumPy, CuPy, or any object with `shape`,
    `strides` and `itemsize`) share memory: a zero-stride (expanded, broadcast) or
    otherwise overlapping view, which can be read but never be written elementwise.

    Decided from shape and strides alone (no memory is touched, nothing is imported):
    contiguous arrays at once; otherwise the dimensions, ordered by stride, must each
    step over everything the smaller ones span; failing that, up to
    `_EXACT_OVERLAP_LIMIT` elements are compared address by address, and larger arrays
    count as overlapping.
    """
    flags = getattr(array, "flags", None)
    if flags is None or getattr(flags, "c_contiguous", False) or getattr(
            flags, "f_contiguous", False):
        return False
    shape, strides = getattr(array, "shape", None), getattr(array, "strides", None)
    itemsize = getattr(array, "itemsize", None)
    if shape is None or strides is None or not itemsize:
        return False
    if any(n == 0 for n in shape):
        return False
    dims = sorted((abs(int(st)), int(n)) for st, n in zip(strides, shape) if n > 1)
    reach = itemsize  # bytes spanned by the dimensions seen so far
    for stride, n in dims:
        if stride < reach:
            break
        reach += stride * (n - 1)
    else:
        return False
    size = 1
    for _, n in dims:
        size *= n
    if size > _EXACT_OVERLAP_LIMIT:
        return True
    offsets = np.zeros(1, np.int64)
    for stride, n in dims:
        offsets = (offsets[:, None] + stride * np.arange(n, dtype=np.int64)).reshape(-1)
    offsets.sort()
    return bool(np.any(np.diff(offsets) < itemsize))


_GPU_COUNT: list = []  # [number of visible GPUs], once asked


def _from_gpu(obj, device_id, convert):
    """`convert(cupy)` for a CUDA array; DeviceError when its GPU is not visible here."""
    cupy = _cupy()  # BackendError (how to install CuPy) when it is missing
    if not _GPU_COUNT:
        _GPU_COUNT.append(gpu_count())
    count = _GPU_COUNT[0]
    if count == 0:
        raise DeviceError(f"a CUDA array ({type(obj).__name__}), but this process sees no GPU")
    if device_id is not None and not 0 <= device_id < count:
        raise DeviceError(f"a CUDA array on GPU {device_id}, which does not exist: "
                          f"{count} GPU(s) are visible")
    return convert(cupy)


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
    try:
        return tensor.numpy()  # shares memory, stays writable
    except TypeError as exc:  # a dtype NumPy has not (float8)
        raise DTypeError(f"unsupported dtype {tensor.dtype} (a PyTorch tensor NumPy cannot "
                         f"hold); supported: {', '.join(sorted(SUPPORTED_DTYPES))}") from exc


def _cupy():
    from .cuda.device import cupy_module
    return cupy_module()


def device_of(array, slot: int = 0) -> Device:
    """The Device an adopted array lives on; `slot` picks the logical device."""
    if isinstance(array, np.ndarray):
        return host_device(slot)
    from .cuda.device import cuda_device
    return cuda_device(array.device.id, slot)


def device_named(kind: str, physical: int, slot: int) -> Device | None:
    """The Device of `kind` ('cpu' or 'gpu'), `physical` and `slot` (as its attributes
    name it), or None when this process has no such device."""
    if kind == HostDevice.kind and physical == 0:
        return host_device(slot)
    if kind != "gpu" or not 0 <= physical < gpu_count():
        return None
    from .cuda.device import cuda_device
    return cuda_device(physical, slot)


def gpu_devices() -> list:
    """The logical GPUs of this process (every visible GPU, or `GPUKV_VIRTUAL_GPUS` of
    them); none without CuPy or a GPU."""
    from .cuda.device import gpu_devices as cuda_gpu_devices
    return cuda_gpu_devices()


def gpu_count() -> int:
    """How many GPUs this process sees (0 without CuPy or a GPU)."""
    from .cuda.device import gpu_count as cuda_gpu_count
    return cuda_gpu_count()


def p2p_ranks(ids) -> dict:
    """{(a, b): the driver's P2P performance rank} of the GPU pairs among `ids` (CUDA
    ordinals) with peer access; pairs without it are absent."""
    from .cuda.probe import p2p_ranks as cuda_p2p_ranks
    return cuda_p2p_ranks(ids)


def cpu_model() -> str:
    """This machine's CPU model name, as calibration files record it."""
    from .cuda.probe import cpu_model as probe_cpu_model
    return probe_cpu_model()


def gpu_names() -> list:
    """Names of the GPUs this process sees ([] without CuPy or a GPU)."""
    from .cuda.probe import gpu_names as probe_gpu_names
    return probe_gpu_names()

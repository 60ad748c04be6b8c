"""The functions of the emulated `cupy` module (its namespace comes from here)."""
from __future__ import annotations

import warnings

import numpy as np

from . import dlpack, memory, runtime
from .array import (
    _UFUNCS,
    PerformanceWarning,
    _allocate,
    _call,
    _check_device,
    _dtype,
    _to_device,
    _touch,
    _unsupported,
    check_add_at_dtype,
    function,
    ndarray,
    ufunc,
)
from .names import FUNCTIONS, TYPES, UFUNCS

__all__ = ["ndarray", "ufunc", "PerformanceWarning"]


# ------------------------------------------------------------------- creation
def empty(shape, dtype=float, order="C"):
    return _allocate(shape, dtype, order)


def zeros(shape, dtype=float, order="C"):
    out = _allocate(shape, dtype, order)
    _touch("fill", writes=(out,))
    out._view.fill(0)
    return out


def ones(shape, dtype=float, order="C"):
    out = _allocate(shape, dtype, order)
    _touch("fill", writes=(out,))
    out._view.fill(1)
    return out


def full(shape, fill_value, dtype=None, order="C"):
    if isinstance(fill_value, np.ndarray):
        raise _unsupported(fill_value)
    if isinstance(fill_value, ndarray):
        fill_value = fill_value.item()
    if dtype is None:
        dtype = np.array(fill_value).dtype
    out = _allocate(shape, dtype, order)
    _touch("fill", writes=(out,))
    out._view.fill(fill_value)
    return out


def _like(a, dtype, shape):
    return (a.shape if shape is None else shape), (a.dtype if dtype is None else dtype)


def empty_like(a, dtype=None, order="K", subok=None, shape=None):
    return empty(*_like(a, dtype, shape))


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return zeros(*_like(a, dtype, shape))


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return ones(*_like(a, dtype, shape))


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None):
    shape, dtype = _like(a, dtype, shape)
    return full(shape, fill_value, dtype)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    """A device array of `obj`: a copy of a host array (NumPy, list, scalar), a copy of a
    device array (or itself, when `copy` is False and nothing changes), or a zero-copy view
    of an object exposing `__cuda_array_interface__`."""
    if not isinstance(obj, ndarray) and hasattr(obj, "__cuda_array_interface__"):
        obj = _from_cuda_array_interface(obj)
    if isinstance(obj, ndarray):
        layout = "F" if order == "F" else "C"
        cast = dtype is not None and np.dtype(dtype) != obj.dtype
        if copy is False and cast:
            raise ValueError("Unable to avoid copy while creating an array as requested.")
        out = obj
        moved = obj.data.device_id != runtime.current_device()
        if moved:  # an array of another GPU is copied to the current one (no peer check)
            out = obj.copy(layout)
        if cast:
            out = out.astype(dtype, order=layout)
        elif copy and not moved:
            out = obj.copy(layout)
        while out.ndim < ndmin:
            out = out.reshape((1,) + out.shape)
        return out
    if isinstance(obj, (list, tuple)) and any(isinstance(x, ndarray) for x in obj):
        if any(isinstance(x, np.ndarray) for x in obj):  # NumPy calls __array__ on them
            raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                            "`.get()` to construct a NumPy array explicitly.")
        return _call(np.stack, ([asarray(x) for x in obj],), {})
    host = np.array(obj, dtype=dtype, order="C" if order == "K" else order, ndmin=ndmin)
    return _to_device(host, order=order or "C")


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    """As `array`, copying only where needed (None), never (False) or always (True)."""
    return array(a, dtype=dtype, copy=copy, order=order or "K", blocking=blocking)


def asanyarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    return asarray(a, dtype, order, copy=copy, blocking=blocking)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy._core.core."
                        f"_ndarray_base, got {type(a).__name__})")
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return a.astype(a.dtype if dtype is None else dtype, order="C", copy=True)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if out is None:
        return np.array(a, order=order, copy=False) if isinstance(a, np.ndarray) \
            else np.asarray(a, order=order)
    out[...] = a
    return out


def copyto(dst, src, casting="same_kind", where=None):
    if not isinstance(dst, ndarray):
        raise TypeError(f"dst must be cupy.ndarray, not {type(dst)}")
    # No peer check: CuPy copies across GPUs (a memcpy, or a copy then a cast).
    if isinstance(src, ndarray):
        if not np.can_cast(src.dtype, dst.dtype, casting):
            raise TypeError(f"Cannot cast {src.dtype} to {dst.dtype} in {casting} casting "
                            f"mode")
        src = src._view
    elif isinstance(src, np.ndarray):
        if src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        src = src.reshape(()).item()
    elif isinstance(src, (list, tuple)):
        raise AttributeError(f"'{type(src).__name__}' object has no attribute 'dtype'")
    else:
        np.copyto(np.empty((), dst.dtype), src, casting=casting)  # NumPy's scalar check
    kwargs = {} if where is None else {"where": where._view if isinstance(where, ndarray)
                                       else where}
    _touch("copyto", reads=(src, where), writes=(dst,))
    np.copyto(dst._view, src, casting="unsafe", **kwargs)


def get_array_module(*args):
    import cupy
    return cupy if any(isinstance(a, ndarray) for a in args) else np


def from_dlpack(x, *, device=None, copy=None):
    return dlpack.from_dlpack(x)


def fromDlpack(capsule):  # noqa: N802 - CuPy's name
    return dlpack.from_capsule(capsule)


def _from_cuda_array_interface(obj) -> ndarray:
    """A view of the device memory an object's `__cuda_array_interface__` describes."""
    cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    typestr = cai["typestr"]
    dtype = np.dtype(typestr)
    ptr = cai["data"][0]
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size == 0:
        return empty(shape, dtype)
    mem = memory.UnownedMemory(ptr, size, obj)
    return ndarray(shape, dtype, memptr=memory.MemoryPointer(mem, 0),
                   strides=cai.get("strides"))


# ------------------------------------------------------------------ cupyx parts
def scatter_add(a, slices, value):
    """`cupyx.scatter_add`: a[slices] += value, duplicates accumulated (atomicAdd)."""
    warnings.warn("`ndarray.scatter_add` is deprecated. Please use `cupy.add.at` instead.",
                  DeprecationWarning, stacklevel=2)
    check_add_at_dtype(a)  # CuPy's scatter_add is cupy.add.at
    device = runtime.current_device()
    _check_device(a, device)
    _touch("scatter_add", reads=(value, slices) if not isinstance(slices, tuple)
           else (value,) + slices, writes=(a,))
    np.add.at(a._view, _index(slices, device), _value(value, device, a.dtype))


def _index(slices, device):
    if isinstance(slices, tuple):
        return tuple(_index(s, device) for s in slices)
    if isinstance(slices, ndarray):
        _check_device(slices, device)
        return slices._view
    return slices


def _value(value, device, dtype):
    if isinstance(value, ndarray):
        _check_device(value, device)
        return value._view.astype(dtype, copy=False)
    if isinstance(value, np.ndarray):
        raise _unsupported(value)
    return value


def empty_pinned(shape, dtype=float, order="C") -> np.ndarray:
    """`cupyx.empty_pinned`: a NumPy array in (emulated) pinned memory."""
    dtype = _dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mem = memory.alloc_pinned_memory(nbytes)
    return np.ndarray(shape, dtype, buffer=mem, order=order)


def zeros_pinned(shape, dtype=float, order="C") -> np.ndarray:
    out = empty_pinned(shape, dtype, order)
    out.fill(0)
    return out


# ------------------------------------------------------------------- memory pools
MemoryPool = memory.MemoryPool
_POOL, _PINNED_POOL = MemoryPool(), MemoryPool(pinned=True)


def get_default_memory_pool() -> MemoryPool:
    return _POOL


def get_default_pinned_memory_pool() -> MemoryPool:
    return _PINNED_POOL


def argsort(a, axis=-1, kind=None):
    """CuPy's sort is stable whatever `kind` says (only None and 'stable' are taken)."""
    if kind not in (None, "stable"):
        raise ValueError("kind can only be None or 'stable'")
    return _call(np.argsort, (a,), {"axis": axis, "kind": "stable"})


def sort(a, axis=-1, kind=None):
    if kind not in (None, "stable"):
        raise ValueError("kind can only be None or 'stable'")
    return _call(np.sort, (a,), {"axis": axis, "kind": "stable"})


def searchsorted(a, v, side="left", sorter=None):
    if not isinstance(a, ndarray):
        raise NotImplementedError("Only int or ndarray are supported for a")
    if not isinstance(v, (ndarray, int, float, complex)):
        raise NotImplementedError("Only python scalars or ndarrays are supported for v")
    return _call(np.searchsorted, (a, v), {"side": side, "sorter": sorter})


def namespace_attribute(name: str):
    """`cupy.<name>` for the NumPy-derived part of the namespace (module __getattr__):
    a function written here where CuPy's differs from NumPy's, else NumPy's, wrapped."""
    own = globals().get(name)
    if name in FUNCTIONS and callable(own):
        return own
    if name in _UFUNCS:
        return _UFUNCS[name]
    if name in FUNCTIONS and hasattr(np, name):
        return function(name)
    if name in TYPES or (name in UFUNCS and hasattr(np, name)):
        return getattr(np, name)
    raise AttributeError(f"module 'cupy' has no attribute {name!r}")


def __getattr__(name: str):
    return namespace_attribute(name)


def _wire_kernels() -> None:
    """Kernels take emulated arrays as pointers and describe faulting addresses by the
    allocation they fall in or near."""
    from . import kernels
    kernels.register_array_type(ndarray)
    kernels.set_address_describer(memory.describe)
    kernels.set_launch_guard(memory.kernel_access)


_wire_kernels()

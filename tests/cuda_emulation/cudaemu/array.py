"""`cupy.ndarray` and the array functions of the emulated `cupy` module.

An emulated array is a NumPy view of emulated device memory (see memory.py) plus the
`MemoryPointer` of its first element. It keeps CuPy's rules where code written against
NumPy would slip: it is not a `numpy.ndarray`, it refuses implicit conversion to one
(`numpy.asarray(x)` raises TypeError), operations refuse NumPy arrays as operands,
reductions return 0-d arrays, new arrays land on the current device, and an operation
reading an array of another GPU needs peer access between the two (as CuPy checks).

CuPy's own kernels (every operation here) run at once, on the current stream, after the
work queued there; what they read and write goes to the race checker.

Arithmetic is NumPy's, run on the host over the device memory: results are therefore
NumPy's bit for bit (a real GPU may differ in the last bit of transcendental functions),
but for float32 subnormals, which ufuncs and float32 <-> float64 casts flush to zero as
CuPy's -ftz=true kernels do (ftz.py). Reductions (sum, max, ...) keep them: CuPy may run
them through CUB, whose flags the emulation does not model.
"""
from __future__ import annotations

import numbers
import warnings

import numpy as np

from . import ftz as _ftz
from . import machine, memory, races, runtime, streams
from .errors import CUDARuntimeError
from .memory import MemoryPointer
from .names import FUNCTIONS, UFUNCS


class PerformanceWarning(RuntimeWarning):
    """CuPy's `cupy._util.PerformanceWarning`."""


# --------------------------------------------------------------------- device rules
def _check_device(array: ndarray, device: int) -> None:
    """CuPy's peer-access check for a kernel on `device` reading `array`."""
    owner = array._data.device_id
    if owner == device:
        return
    msg = (f"The device where the array resides ({owner}) is different from the current "
           f"device ({device}).")
    if not machine.MACHINE.can_access_peer(device, owner):
        raise ValueError(f"{msg} Peer access is unavailable between these devices.")
    if not runtime.peer_enabled(device, owner):
        try:
            with runtime.Device(device):
                runtime.runtime.deviceEnablePeerAccess(owner)
        except runtime.CUDARuntimeError:
            pass
    # CuPy warns at every such call, whether it enabled peer access now or before.
    warnings.warn(f"{msg} Peer access has been activated automatically.",
                  PerformanceWarning, stacklevel=4)
    if memory.access_flags(device, array._data.mem) == memory.ACCESS_NONE:
        # pool or mapping memory not granted to this GPU: CuPy's kernel would fault
        raise CUDARuntimeError(700, f"GPU {device} reading {memory.describe(array._data.ptr)}"
                                    f", whose pool or mapping grants it no access")


def _unsupported(x) -> TypeError:
    return TypeError(f"Unsupported type {type(x)}")


def _operand(x, device: int, *, host_ok: bool = False):
    """The NumPy view (or scalar) an operand stands for in a computation on `device`."""
    if isinstance(x, ndarray):
        _check_device(x, device)
        return x._view
    if isinstance(x, (list, tuple)):
        return type(x)(_operand(v, device, host_ok=host_ok) for v in x)
    if isinstance(x, np.ndarray) and not host_ok:
        raise _unsupported(x)
    return x


def _views_only(x):
    """Operands of an operation that only makes views: NumPy views, no device check."""
    if isinstance(x, ndarray):
        return x._view
    if isinstance(x, (list, tuple)):
        return type(x)(_views_only(v) for v in x)
    if isinstance(x, np.ndarray):
        raise _unsupported(x)
    return x


# ---------------------------------------------------------------- stream order
def _span(view: np.ndarray) -> tuple:
    """(first byte, bytes) that `view` spans in memory."""
    if view.size == 0:
        return _address(view), 0
    low = sum(min(0, (n - 1) * s) for n, s in zip(view.shape, view.strides))
    high = sum(max(0, (n - 1) * s) for n, s in zip(view.shape, view.strides))
    return _address(view) + low, high - low + view.itemsize


def _touch(label: str, reads=(), writes=(), *, device: int | None = None,
           stream=None) -> streams.Lane:
    """CuPy's own kernels run at once, on the current stream (of `device`) after the work
    queued there: that work is run first, and what they read and write (emulated arrays
    or NumPy views of device memory) is checked by the race checker."""
    lane = runtime.lane_of(stream, device)
    accesses = []
    for write, group in ((False, reads), (True, writes)):
        for x in group:
            view = x._view if isinstance(x, ndarray) else x
            if isinstance(view, np.ndarray) and view.size:
                ptr, nbytes = _span(view)
                accesses.append((lane, ptr, nbytes, write, memory.find(ptr)))
    streams.eager(lane, label, accesses)
    return lane


# ------------------------------------------------------------- making arrays
def _address(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


def _view_of(memptr: MemoryPointer, shape, dtype, strides=None) -> np.ndarray:
    """A NumPy view of `shape`/`dtype`/`strides` with its first element at `memptr`."""
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if strides is None:
        strides = _c_strides(shape, dtype.itemsize)
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0:
        return np.empty(shape, dtype)
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    high = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) + dtype.itemsize
    buffer = memory.host_bytes(memptr.ptr + low, high - low, memptr.mem)
    return np.ndarray(shape, dtype, buffer=buffer, offset=-low, strides=tuple(strides))


def _c_strides(shape, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def _allocate(shape, dtype, order: str = "C", device: int | None = None) -> ndarray:
    """A new array on `device` (the current one by default), poisoned in guard mode."""
    dtype = _dtype(dtype)
    shape = _shape(shape)
    device = runtime.current_device() if device is None else device
    size = int(np.prod(shape, dtype=np.int64))
    memptr = memory.alloc(size * dtype.itemsize, device)
    info = getattr(memptr.mem, "info", None)
    if info is not None:  # a freed block goes back to the pool of the current stream
        info["lane"] = runtime.lane_of(None, device)
        info["site"] = races.site() if races.ENABLED else ""
    strides = None
    if order == "F":
        strides = tuple(reversed(_c_strides(tuple(reversed(shape)), dtype.itemsize)))
    return ndarray._wrap(_view_of(memptr, shape, dtype, strides), memptr.mem)


def _to_device(host: np.ndarray, device: int | None = None, order: str = "C") -> ndarray:
    """A device copy of the host array `host`."""
    native = _dtype(host.dtype)
    if native != host.dtype:  # big-endian data is stored in the native order
        host = host.astype(native)
    keep_f = host.flags.f_contiguous and not host.flags.c_contiguous
    order = "F" if order == "F" or (order in ("A", "K") and keep_f) else "C"
    out = _allocate(host.shape, host.dtype, order, device)
    _touch("copy to a new array", writes=(out,), device=out._data.device_id)
    np.copyto(out._view, host, casting="no")
    return out


def _result(value, device: int):
    """An operation's NumPy result as emulated arrays: a view of device memory stays a
    view (of the same allocation), anything else is copied to `device`; NumPy scalars
    become 0-d arrays, as CuPy's results are."""
    if isinstance(value, np.ndarray):
        if value.size:
            mem = memory.find(_address(value))
            if mem is not None and mem.device_id is not None:
                return ndarray._wrap(value, mem)
        return _to_device(value, device, "K")
    if isinstance(value, np.generic):
        return _to_device(np.asarray(value), device)
    if isinstance(value, tuple):
        return tuple(_result(v, device) for v in value)
    if isinstance(value, list):
        return [_result(v, device) for v in value]
    return value


def _dtype(dtype):
    """A dtype CuPy can hold (native byte order); ValueError for the others."""
    dtype = np.dtype(float if dtype is None else dtype)
    if dtype.type.__module__ == "ml_dtypes":  # bfloat16 and friends, as CuPy 14 takes them
        return dtype
    if dtype.kind in "OSUVMm" or dtype.itemsize > 8 and dtype.kind == "f" or (
            dtype.kind == "c" and dtype.itemsize > 16):
        raise ValueError(f"Unsupported dtype {dtype}")
    return dtype.newbyteorder("=") if dtype.byteorder == ">" else dtype


def _shape(shape) -> tuple:
    if isinstance(shape, numbers.Integral):
        return (int(shape),)
    return tuple(int(n) for n in shape)


# ------------------------------------------------------------------ the array
class Flags:
    """`ndarray.flags` as CuPy has it (no `writeable`: device arrays are always writable)."""

    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, view: np.ndarray, owndata: bool):
        self.c_contiguous = view.flags.c_contiguous
        self.f_contiguous = view.flags.f_contiguous
        self.owndata = owndata

    def __getitem__(self, name):
        return getattr(self, {"C_CONTIGUOUS": "c_contiguous", "F_CONTIGUOUS":
                              "f_contiguous", "OWNDATA": "owndata"}[name])

    def __repr__(self):
        return (f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : "
                f"{self.f_contiguous}\n  OWNDATA : {self.owndata}")


class ndarray:  # noqa: N801 - CuPy's name
    """An array in emulated device memory."""

    __slots__ = ("_view", "_data", "_base", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        dtype = _dtype(dtype)
        shape = _shape(shape)
        if memptr is None:
            made = _allocate(shape, dtype, order)
            self._view, self._data, self._base = made._view, made._data, None
            return
        if strides is None and order == "F":
            strides = tuple(reversed(_c_strides(tuple(reversed(shape)), dtype.itemsize)))
        self._view = _view_of(memptr, shape, dtype, strides)
        self._data = memptr
        self._base = None

    @classmethod
    def _wrap(cls, view: np.ndarray, mem, base=None) -> ndarray:
        self = cls.__new__(cls)
        self._view = view
        ptr = _address(view) if view.size else mem.ptr
        self._data = MemoryPointer(mem, ptr - mem.ptr)
        self._base = base
        return self

    def _derived(self, view: np.ndarray) -> ndarray:
        """A view of this array's memory (NumPy made `view` from `self._view`)."""
        return ndarray._wrap(view, self._data.mem, self if self._base is None else self._base)

    # ------------------------------------------------------------- attributes
    shape = property(lambda self: self._view.shape)
    dtype = property(lambda self: self._view.dtype)
    strides = property(lambda self: self._view.strides)
    size = property(lambda self: self._view.size)
    ndim = property(lambda self: self._view.ndim)
    itemsize = property(lambda self: self._view.itemsize)
    nbytes = property(lambda self: self._view.nbytes)
    data = property(lambda self: self._data)
    base = property(lambda self: self._base)

    @property
    def flags(self) -> Flags:
        return Flags(self._view, self._base is None)

    @property
    def device(self) -> runtime.Device:
        return runtime.Device(self._data.device_id)

    @property
    def T(self):  # noqa: N802
        return self.transpose()

    @property
    def mT(self):  # noqa: N802
        return self.swapaxes(-1, -2)

    @property
    def real(self):
        return self._derived(self._view.real) if self.dtype.kind == "c" else self

    @property
    def imag(self):
        return _call(np.imag, (self,), {})

    @shape.setter
    def shape(self, value):
        view = self._view.view()
        view.shape = value  # NumPy refuses what would need a copy, as CuPy does
        self._view = view

    @property
    def __cuda_array_interface__(self) -> dict:
        view = self._view
        descr = view.dtype.descr
        typestr = view.dtype.str
        if view.dtype.names is None and view.dtype.type.__module__ == "ml_dtypes":
            typestr, descr = f"<V{view.itemsize}", [("", f"<V{view.itemsize}")]
        return {"shape": view.shape, "typestr": typestr, "descr": descr,
                "data": (self._data.ptr if view.size else 0, False),
                "strides": None if view.flags.c_contiguous else view.strides,
                "version": 3, "stream": 1}

    # ------------------------------------------------------ conversions (refused)
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    # As CuPy's, these go through a host copy and follow NumPy's rules (0-d only for
    # int/float/complex); there is no __index__.
    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __complex__(self):
        return complex(self.get())

    def __bool__(self):
        if self.size == 0:
            warnings.warn("The truth value of an empty array is ambiguous. Returning False, "
                          "but in future this will result in an error. Use `array.size > 0` "
                          "to check that an array is not empty.", DeprecationWarning,
                          stacklevel=2)
            return False
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        return bool(self.get())

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    def tolist(self):
        self._get_now(None)
        return self._view.tolist()

    def tobytes(self, order="C"):
        self._get_now(None)
        return self._view.tobytes(order)

    def __repr__(self):
        self._get_now(None)
        return repr(self._view.copy())

    def __str__(self):
        self._get_now(None)
        return str(self._view.copy())

    def __format__(self, spec):
        self._get_now(None)
        return format(self._view.copy() if self.ndim else self._view[()], spec)

    def __reduce__(self):  # pickled through the host, unpickled on the current GPU
        return (_to_device, (self.get(),))

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # ------------------------------------------------------------ host transfers
    def get(self, stream=None, order="C", out=None, blocking=True):
        """A host copy; into `out` (a NumPy array of the same shape and dtype) if given."""
        if stream is not None and not hasattr(stream, "ptr"):
            raise AttributeError(f"'{type(stream).__name__}' object has no attribute 'ptr'")
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if out.dtype != self.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from "
                                f"{self.dtype} array")
            if out.shape != self.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, "
                                 f"actual shape: {out.shape}")
            if not (out.flags.c_contiguous or out.flags.f_contiguous):
                raise RuntimeError("`out` cannot be specified when copying to "
                                   "non-contiguous ndarray")
            if not blocking and memory.find(out.ctypes.data) is not None and out.size:
                self._get_later(out, stream)
                return out
            self._get_now(stream)
            np.copyto(np.ndarray(out.shape, out.dtype, buffer=memory.host_bytes(
                out.ctypes.data, out.nbytes, out), strides=out.strides), self._view)
            return out
        order = order.upper()
        if order == "A":
            order = "F" if self._view.flags.f_contiguous and not \
                self._view.flags.c_contiguous else "C"
        if order not in ("C", "F"):
            raise ValueError(f"unsupported order: {order}")
        self._get_now(stream)
        return np.array(self._view, order=order, copy=True)

    def _get_now(self, stream) -> None:
        """A copy to pageable memory: queued on `stream` (the current one of this array's
        GPU), and the host waits for it."""
        lane = _touch("copy to the host", reads=(self,), device=self._data.device_id,
                      stream=stream)
        streams.synchronize(lane)

    def _get_later(self, out: np.ndarray, stream) -> None:
        """A copy into pinned `out`, queued on `stream`; it runs when that stream does."""
        lane = runtime.lane_of(stream, self._data.device_id)
        src, dst = self._view, np.ndarray(out.shape, out.dtype, buffer=memory.host_bytes(
            out.ctypes.data, out.nbytes, out), strides=out.strides)
        accesses = [(lane, *_span(src), False, self._data.mem),
                    (lane, *_span(out), True, memory.find(out.ctypes.data))]
        pinned = memory.find(out.ctypes.data)

        def run():
            np.copyto(dst, src)
            memory.device_wrote(pinned)

        streams.issue(lane, run, "copy to pinned host memory", accesses=accesses,
                      keep=(self, out))

    def set(self, arr, stream=None):
        """Copy the host array `arr` (same shape and dtype, C- or F-contiguous) in."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: "
                             f"{arr.shape}")
        if not (self._view.flags.c_contiguous or self._view.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        pinned = memory.find(arr.ctypes.data) if arr.size else None
        if stream is not None and pinned is not None:  # truly asynchronous: queued
            lane = runtime.lane_of(stream, self._data.device_id)
            dst = self._view
            accesses = [(lane, *_span(arr), False, pinned),
                        (lane, *_span(dst), True, self._data.mem)]
            streams.issue(lane, lambda: np.copyto(dst, arr), "copy from pinned host memory",
                          accesses=accesses, keep=(self, arr))
            return
        _touch("copy from the host", writes=(self,), device=self._data.device_id,
               stream=stream)
        np.copyto(self._view, arr)

    # ---------------------------------------------------------------- views
    def view(self, dtype=None, type=None):  # noqa: A002 - NumPy's name
        if dtype is None:
            return self._derived(self._view.view())
        return self._derived(self._view.view(dtype))

    def reshape(self, *shape, order="C"):
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        return _call(np.reshape, (self, shape), {"order": order}, views=True)

    def ravel(self, order="C"):
        return _call(np.ravel, (self,), {"order": order}, views=True)

    def flatten(self, order="C"):
        return _call(np.ravel, (self.copy(order),), {"order": order}, views=True)

    def transpose(self, *axes):
        if len(axes) == 1 and not isinstance(axes[0], numbers.Integral):
            axes = axes[0]
        return self._derived(self._view.transpose(*axes) if axes else self._view.transpose())

    def swapaxes(self, a, b):
        return self._derived(self._view.swapaxes(a, b))

    def squeeze(self, axis=None):
        return self._derived(self._view.squeeze(axis))

    def diagonal(self, offset=0, axis1=0, axis2=1):
        return self._derived(self._view.diagonal(offset, axis1, axis2))

    # ---------------------------------------------------------------- copies
    def copy(self, order="C"):
        """A copy on the current device (no peer check, as CuPy's copy makes none)."""
        device = runtime.current_device()
        if self._data.device_id != device and not (self._view.flags.c_contiguous
                                                   or self._view.flags.f_contiguous):
            raise NotImplementedError("CuPy cannot copy non-contiguous array between "
                                      "devices.")
        out = _allocate(self.shape, self.dtype, "F" if order == "F" else "C", device)
        _touch("copy", reads=(self,), writes=(out,))
        np.copyto(out._view, self._view)
        return out

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if casting is not None:
            raise TypeError("casting is not supported yet")
        if subok is not None:
            raise TypeError("subok is not supported yet")
        dtype = np.dtype(dtype)
        if not copy and dtype == self.dtype:
            return self
        device = runtime.current_device()
        _check_device(self, device)
        keep_f = order == "F" or (order in ("A", "K") and self._view.flags.f_contiguous
                                  and not self._view.flags.c_contiguous)
        out = _allocate(self.shape, dtype, "F" if keep_f else "C", device)
        _touch("astype", reads=(self,), writes=(out,))
        flush = _ftz.cast_flushes(self.dtype, dtype)
        np.copyto(out._view, _ftz.inputs(self._view) if flush else self._view,
                  casting="unsafe")
        if flush:
            _ftz.outputs(out._view)
        return out

    def fill(self, value):
        _check_device(self, runtime.current_device())
        if isinstance(value, np.ndarray):
            raise _unsupported(value)
        _touch("fill", reads=(value,) if isinstance(value, ndarray) else (), writes=(self,))
        self._view.fill(value.item() if isinstance(value, ndarray) else value)

    # --------------------------------------------------------------- indexing
    def _index(self, index, device):
        if isinstance(index, tuple):
            return tuple(self._index(i, device) for i in index)
        if isinstance(index, ndarray):
            _check_device(index, device)
            return index._view
        if isinstance(index, list):
            return np.asarray(index)
        return index

    def __getitem__(self, index):
        device = runtime.current_device()
        index = self._index(index, device)
        if not isinstance(index, tuple):
            index = (index,)
        if not any(i is Ellipsis for i in index):
            index = index + (Ellipsis,)  # an element comes back as a 0-d view, as in CuPy
        result = self._view[index]
        basic = not any(isinstance(i, (np.ndarray, list)) for i in index)
        if isinstance(result, np.ndarray) and (_in(result, self) if result.size else basic):
            return self._derived(result)  # basic indexing: a view, on this array's GPU
        _check_device(self, device)
        _touch("take", reads=(self,) + tuple(i for i in index if isinstance(i, np.ndarray)
                                             and memory.find(_address(i)) is not None))
        return _result(np.asarray(result), device)

    def __setitem__(self, index, value):
        device = runtime.current_device()
        _check_device(self, device)
        if isinstance(value, ndarray):
            _check_device(value, device)
            value = value._view
        elif isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray)
                                                  and value.ndim):
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        _touch("setitem", reads=(value,) if isinstance(value, np.ndarray) else (),
               writes=(self,))
        self._view[self._index(index, device)] = value

    # ---------------------------------------------------------- DLPack
    def __dlpack_device__(self):
        return (2, self._data.device_id)  # kDLCUDA

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        from . import dlpack
        return dlpack.to_capsule(self)

    def toDlpack(self):  # noqa: N802 - CuPy's name
        return self.__dlpack__()

    # -------------------------------------------------------------- scatter
    def scatter_add(self, slices, value):
        from . import api
        api.scatter_add(self, slices, value)


def _in(view: np.ndarray, array: ndarray) -> bool:
    """Whether NumPy returned a view into `array`'s memory (basic indexing)."""
    start = _address(view)
    mem = array._data.mem
    return mem.ptr <= start < mem.ptr + max(mem.size, 1)


# ---------------------------------------------------------------- operations
_VIEW_FUNCTIONS = frozenset("""
    reshape ravel transpose squeeze expand_dims broadcast_to broadcast_arrays swapaxes
    moveaxis rollaxis atleast_1d atleast_2d atleast_3d split array_split hsplit vsplit
    dsplit diagonal flip fliplr flipud real imag
""".split())


def _call(func, args, kwargs, *, views: bool = False, ftz: bool = False):
    """`func` (a NumPy function) over emulated arrays, as the CuPy function would run
    (an elementwise kernel if `ftz`: float32 subnormals read and written are zeros)."""
    device = runtime.current_device()
    out = kwargs.get("out")
    if views:
        np_args = _views_only(args)
        np_kwargs = {k: _views_only(v) for k, v in kwargs.items()}
    else:
        np_args = _operand(args, device)
        np_kwargs = {k: _operand(v, device) for k, v in kwargs.items()}
        if out is not None and not isinstance(out, (ndarray, tuple)):
            raise TypeError(f"Output must be cupy.ndarray, not {type(out).__name__}")
    if not views:
        outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
        _touch(f"cupy.{getattr(func, '__name__', 'op')}",
               reads=tuple(_arrays((args, tuple(kwargs.values())))),
               writes=tuple(o for o in outs if isinstance(o, ndarray)))
    if ftz:
        np_args = _ftz.inputs(np_args)
    with np.errstate(all="ignore"):  # GPU arithmetic raises no floating-point warnings
        result = func(*np_args, **np_kwargs)
    if ftz:
        result = _ftz.outputs(result)
    if out is not None:  # NumPy wrote into the outs' device memory
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out
    if views:
        source = next((x for x in _arrays(args)), None)
        if source is not None:  # a view, even an empty one, stays with its array
            return _view_result(result, source, device)
    return _result(result, device)


def _arrays(x):
    """The emulated arrays among the (nested) arguments `x`."""
    if isinstance(x, ndarray):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _arrays(v)


def _view_result(value, source: ndarray, device: int):
    """A view operation's result: views of `source`'s memory (an empty one included);
    anything NumPy had to copy goes to `device`."""
    if isinstance(value, np.ndarray):
        if value.size == 0 or _in(value, source):
            return source._derived(value)
        return _result(value, device)
    if isinstance(value, (tuple, list)):
        return type(value)(_view_result(v, source, device) for v in value)
    return _result(value, device)


_AT_DTYPES = ("int32", "int64", "uint32", "uint64", "float16", "float32", "float64")


def check_add_at_dtype(a) -> None:
    """cupy.add.at (and scatter_add) take only the dtypes CUDA's atomicAdd has."""
    if isinstance(a, ndarray) and a.dtype.name not in _AT_DTYPES:
        raise TypeError("cupy.add.at only supports int32, int64, float16, float32, "
                        "float64, uint32, uint64 as data type")


class ufunc:  # noqa: N801 - CuPy's name
    """A CuPy ufunc: NumPy's, over emulated arrays."""

    def __init__(self, np_ufunc):
        self._np = np_ufunc
        self.name = np_ufunc.__name__ if isinstance(np_ufunc, np.ufunc) else np_ufunc.__name__
        self.nin = getattr(np_ufunc, "nin", 1)
        self.nout = getattr(np_ufunc, "nout", 1)
        self.__doc__ = np_ufunc.__doc__
        self._ftz = self.name not in _ftz.UNFLUSHED_UFUNCS

    def __call__(self, *args, **kwargs):
        for x in args:
            if isinstance(x, (list, tuple)):
                raise TypeError(f"Unsupported type {type(x)}")
        return _call(self._np, args, kwargs, ftz=self._ftz)

    def reduce(self, *args, **kwargs):
        return _call(self._np.reduce, args, kwargs)

    def accumulate(self, *args, **kwargs):
        return _call(self._np.accumulate, args, kwargs)

    def outer(self, *args, **kwargs):
        return _call(self._np.outer, args, kwargs, ftz=self._ftz)

    def at(self, a, indices, b=None):
        if self.name == "add":
            check_add_at_dtype(a)
        device = runtime.current_device()
        args = (a, indices) if b is None else (a, indices, b)
        _touch(f"cupy.{self.name}.at", reads=tuple(_arrays(args)), writes=(a,))
        self._np.at(*_operand(args, device))

    def __repr__(self):
        return f"<ufunc '{self.name}'>"


def function(name: str):
    """The emulated `cupy.<name>` for a NumPy function of that name."""
    func = getattr(np, name)
    views = name in _VIEW_FUNCTIONS

    def run(*args, **kwargs):
        return _call(func, args, kwargs, views=views)

    run.__name__ = run.__qualname__ = name
    run.__doc__ = func.__doc__
    return run


_UFUNCS = {name: ufunc(getattr(np, name)) for name in UFUNCS if hasattr(np, name)}


def _method(name: str):
    func = getattr(np.ndarray, name)

    def run(self, *args, **kwargs):
        return _call(lambda view, *a, **k: func(view, *a, **k), (self,) + args, kwargs)

    run.__name__ = name
    return run


for _name in ("sum", "prod", "mean", "var", "std", "max", "min", "argmax", "argmin", "all",
              "any", "cumsum", "cumprod", "clip", "round", "dot", "nonzero", "argpartition",
              "repeat", "take", "compress", "trace", "ptp", "conj", "conjugate", "choose",
              "put", "partition"):
    if hasattr(np.ndarray, _name):
        setattr(ndarray, _name, _method(_name))


def _argsort(self, axis=-1, kind=None):
    from . import api
    return api.argsort(self, axis=axis, kind=kind)


def _sort(self, axis=-1, kind=None):
    from . import api
    self[...] = api.sort(self, axis=axis, kind=kind)


def _searchsorted(self, v, side="left", sorter=None):
    from . import api
    return api.searchsorted(self, v, side, sorter)


# Sorting is stable, as CuPy's is whatever `kind` says.
ndarray.argsort, ndarray.sort, ndarray.searchsorted = _argsort, _sort, _searchsorted


def _binary(np_ufunc, reflected: bool = False, inplace: bool = False,
            compare: bool = False):
    def op(self, other):
        if compare and isinstance(other, np.ndarray) and other.ndim == 0:
            other = other.item()  # CuPy compares with a 0-d host array's value
        if isinstance(other, np.ndarray):
            raise _unsupported(other)
        if not isinstance(other, (ndarray, numbers.Number, np.generic)):
            if compare and other is None:  # `a == None` is all False, `a != None` all True
                return _fill_like(self, np_ufunc is np.not_equal)
            raise TypeError(f"operand type(s) all returned NotImplemented from "
                            f"__array_ufunc__({np_ufunc!r}): 'ndarray', "
                            f"'{type(other).__name__}'")
        if inplace:
            return _call(np_ufunc, (self, other), {"out": (self,)}, ftz=True)
        args = (other, self) if reflected else (self, other)
        return _call(np_ufunc, args, {}, ftz=True)
    return op


def _fill_like(array, value: bool):
    out = _allocate(array.shape, bool)
    _touch("fill", writes=(out,))
    out._view.fill(value)
    return out


for _name, _uf in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                   ("truediv", np.true_divide), ("floordiv", np.floor_divide),
                   ("mod", np.remainder), ("pow", np.power), ("lshift", np.left_shift),
                   ("rshift", np.right_shift), ("and", np.bitwise_and),
                   ("or", np.bitwise_or), ("xor", np.bitwise_xor),
                   ("matmul", np.matmul)):
    setattr(ndarray, f"__{_name}__", _binary(_uf))
    setattr(ndarray, f"__r{_name}__", _binary(_uf, reflected=True))
    if _name != "matmul":
        setattr(ndarray, f"__i{_name}__", _binary(_uf, inplace=True))

for _name, _uf in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less),
                   ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal)):
    setattr(ndarray, f"__{_name}__", _binary(_uf, compare=True))

for _name, _uf in (("neg", np.negative), ("pos", np.positive), ("abs", np.absolute),
                   ("invert", np.invert)):
    setattr(ndarray, f"__{_name}__", lambda self, _uf=_uf: _call(_uf, (self,), {}, ftz=True))

ndarray.__hash__ = None  # arrays compare elementwise, so they are not hashable
ndarray.__module__ = "cupy"  # the name code under test sees, as with CuPy's own


def _array_ufunc(self, np_ufunc, method, *inputs, **kwargs):
    """NumPy ufuncs called on emulated arrays run as CuPy's (CuPy dispatches them too)."""
    name = np_ufunc.__name__
    if name not in UFUNCS and name not in ("true_divide", "conjugate"):
        return NotImplemented
    out = kwargs.get("out")
    for x in inputs + tuple(out or ()):
        if isinstance(x, np.ndarray):  # passed on to the CuPy ufunc, which refuses it
            raise _unsupported(x)
        if not isinstance(x, (ndarray, numbers.Number, np.generic)):
            return NotImplemented
    target = getattr(np_ufunc, method)
    if out is not None:
        kwargs = dict(kwargs, out=tuple(out))
    elementwise = method in ("__call__", "outer") and name not in _ftz.UNFLUSHED_UFUNCS
    return _call(target, inputs, kwargs, ftz=elementwise)


def _array_function(self, func, types, args, kwargs):
    name = func.__name__
    if name in UFUNCS or name in FUNCTIONS:
        from . import api
        return getattr(api, name)(*args, **kwargs)
    return NotImplemented


ndarray.__array_ufunc__ = _array_ufunc
ndarray.__array_function__ = _array_function

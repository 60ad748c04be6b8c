"""Row-sparse values: a set of row indices plus those rows, as MXNet's row_sparse NDArray.

`RowSparse(indices, data, shape)` holds host (NumPy) or GPU (CuPy) arrays, both on the
same device. `indices` is 1-D and integral, `data` has shape ``(len(indices),) +
shape[1:]``, and every index lies in ``[0, shape[0])``. Indices need not be sorted or
unique: a repeated index means its rows are summed (`todense`, pushes), which is where
gpukv is more lenient than MXNet (MXNet takes unsorted or repeated indices silently and
gives undefined results).

In the store, a key initialised with a RowSparse is stored dense-backed (a full array on
the key's home device), so dense `pull` into a dense `out` works on it as on any key, and
`row_sparse_pull` works on any key. Pushes of RowSparse values are summed row-wise on
the home device and the updater gets the merged RowSparse (sorted, unique rows), so an
optimizer can touch only the rows present (lazy update).
"""
from __future__ import annotations

import contextlib
import numbers

import numpy as np

from .. import device as _device
from .._errors import ArgumentError, ArgumentKindError, DTypeError, ShapeError

__all__ = ["RowSparse"]


def _xp_of(a):
    if isinstance(a, np.ndarray):
        return np
    return _device.device_of(a).xp


def _as_array(obj, like=None):
    """A NumPy or CuPy array for `obj` (lists become arrays on `like`'s device)."""
    from ..device import adopt
    if isinstance(obj, (list, tuple, numbers.Number)):
        if like is None or isinstance(like, np.ndarray):
            return np.asarray(obj)
        device = _device.device_of(like)
        with device.activate():
            return device.xp.asarray(obj)
    array = adopt(obj)
    if array is None:
        raise ArgumentKindError(f"expected an array, got {type(obj).__name__}")
    return array


def _on_device_of(array):
    """A context running work on `array`'s device (a GPU: it and its current stream).

    CuPy launches kernels and allocates results on the *current* device: every
    computation on a RowSparse runs under the device its arrays live on, so one built
    or used outside `with cupy.cuda.Device(i)` stays on GPU i. A no-op for NumPy arrays.
    """
    if isinstance(array, np.ndarray):
        return contextlib.nullcontext()
    return _device.device_of(array).activate()


def _ids_like(ids, like, what: str):
    """Row ids `ids` on the device of `like`: host ids are copied there; ids on another
    GPU (or GPU ids for host data) are an ArgumentError, as for RowSparse itself."""
    if _xp_of(like) is np:
        if _xp_of(ids) is not np:
            raise ArgumentError(f"{what}: row ids on a GPU for data on the host")
        return ids
    device = _device.device_of(like)
    if isinstance(ids, np.ndarray):
        with device.activate():
            return device.xp.asarray(ids)
    where = _device.device_of(ids)
    if where.physical != device.physical:
        raise ArgumentError(f"{what}: row ids on GPU {where.physical} for data on GPU "
                            f"{device.physical}; copy them to the data's GPU first")
    return ids


def _checked_shape(shape, what: str) -> tuple:
    """`shape` as a tuple of ints; ArgumentKindError unless it is a non-empty tuple (or
    list) of non-negative ints."""
    if not isinstance(shape, (tuple, list)) or not shape or not all(
            isinstance(s, numbers.Integral) and not isinstance(s, (bool, np.bool_))
            and int(s) >= 0 for s in shape):
        raise ArgumentKindError(
            f"{what}: shape must be a non-empty tuple of non-negative ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def _check_rows(data, rows: int, shape: tuple, what: str) -> None:
    """ShapeError unless `data` holds `rows` rows of a value of `shape`."""
    expected = (rows,) + shape[1:]
    if tuple(data.shape) != expected:
        raise ShapeError(f"{what}: RowSparse of shape {shape}: data for {rows} row(s) must "
                         f"have shape {expected}, got {tuple(data.shape)}")


def _same_device(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
    return _device.device_of(a) == _device.device_of(b)


def check_row_ids(ids, nrows: int, what: str):
    """`ids` flattened to int64; ArgumentError unless every id is in [0, nrows)."""
    if ids.dtype.kind not in "iu":
        raise DTypeError(f"{what}: row ids must be integers, got dtype {ids.dtype}")
    with _on_device_of(ids):
        flat = ids.reshape(-1)
        if flat.size:
            lo, hi = int(flat.min()), int(flat.max())  # one device sync on GPU
            if lo < 0 or hi >= nrows:
                bad = lo if lo < 0 else hi
                raise ArgumentError(f"{what}: row id {bad} is out of range for {nrows} rows")
        return flat.astype(_xp_of(flat).int64, copy=False)


def _own(ids):
    """A copy of `ids` made on their device: later edits of the caller's array (or of the
    view `check_row_ids` may return) change nothing held here."""
    with _on_device_of(ids):
        return ids.copy()


class RowSparse:
    """Rows `indices` of a `shape`-shaped array whose other rows are zero.

    `indices`: a 1-D integer array of row numbers, each below `shape[0]` (repeats are
    summed); `data`: the rows themselves, shaped `(len(indices),) + shape[1:]`, on the
    device of `indices`; `shape`: the dense array's shape. The indices are checked and
    copied; `data` is kept as given:

        g = gpukv.RowSparse(np.array([3, 7]), np.ones((2, 16)), (1000, 16))
    """

    __slots__ = ("indices", "data", "shape")

    def __init__(self, indices, data, shape):
        data = _as_array(data)
        indices = _as_array(indices, like=data)
        shape = _checked_shape(shape, "RowSparse")
        if not _same_device(indices, data):
            raise ArgumentError("RowSparse: indices and data live on different devices")
        if indices.ndim != 1:
            raise ShapeError(f"RowSparse: indices must be 1-D, got shape {indices.shape}")
        _check_rows(data, indices.shape[0], shape, "RowSparse")
        self.indices = _own(check_row_ids(indices, shape[0], "RowSparse"))
        self.data = data
        self.shape = shape

    def checked(self, what: str) -> RowSparse:
        """This value with its ids checked again and copied: `indices` may have been
        edited since it was built. ArgumentError (prefixed with `what`) if they no longer
        fit the data and the shape."""
        ids, data = self.indices, self.data
        if not _same_device(ids, data):
            raise ArgumentError(f"{what}: RowSparse indices and data live on different devices")
        if ids.ndim != 1 or ids.shape[0] != data.shape[0]:
            raise ShapeError(f"{what}: RowSparse indices of shape {ids.shape} for "
                             f"{data.shape[0]} rows of data")
        _check_rows(data, ids.shape[0], self.shape, what)  # (others would broadcast)
        ids = _own(check_row_ids(ids, self.shape[0], what))
        return RowSparse.trusted(ids, data, self.shape)

    @classmethod
    def trusted(cls, indices, data, shape):
        """A RowSparse of `indices`, `data` and `shape` already valid as the constructor
        requires (the store's row merge and this class's own operations make them):
        nothing is checked here, and nothing waits for the device."""
        obj = cls.__new__(cls)
        obj.indices, obj.data, obj.shape = indices, data, tuple(shape)
        return obj

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self):
        """The dtype of the rows."""
        return self.data.dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions of the dense value."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the dense value this stands for (what a store keeps for it)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.data.dtype.itemsize

    @property
    def on_host(self) -> bool:
        """Whether the rows are a NumPy array (else on a GPU)."""
        return isinstance(self.data, np.ndarray)

    @property
    def xp(self):
        """The array module of the rows: `numpy` or `cupy`."""
        return _xp_of(self.data)

    # ------------------------------------------------------------------- builders
    @classmethod
    def zeros(cls, shape, dtype=np.float32, xp=np):
        """An all-zero value of `shape` and `dtype` with no rows, on the host (`xp`=numpy)
        or the current GPU (`xp`=cupy): the `out` of a `row_sparse_pull`. `shape`: a
        tuple of ints, or one int (one dimension), as NumPy's `zeros` takes it."""
        shape = (shape,) if isinstance(shape, numbers.Integral) else shape
        shape = _checked_shape(shape, "RowSparse.zeros")
        return cls(xp.zeros(0, xp.int64), xp.zeros((0,) + shape[1:], dtype), shape)

    @classmethod
    def from_dense(cls, dense, row_ids=None):
        """The rows `row_ids` of `dense` (default: its rows with any nonzero element)."""
        dense = _as_array(dense)
        if dense.ndim < 1:
            raise ShapeError(f"RowSparse.from_dense: expected at least 1-D, got {dense.shape}")
        xp = _xp_of(dense)
        if row_ids is not None:
            row_ids = _ids_like(_as_array(row_ids, like=dense), dense, "RowSparse.from_dense")
        with _on_device_of(dense):
            if row_ids is None:
                nonzero = dense.reshape(dense.shape[0], -1) != 0
                ids = xp.nonzero(nonzero.any(axis=1))[0].astype(xp.int64)
            else:
                ids = xp.unique(check_row_ids(row_ids, dense.shape[0], "RowSparse.from_dense"))
            return cls.trusted(ids, dense[ids].copy(), dense.shape)

    # ------------------------------------------------------------------- helpers
    def coalesce(self, dtype=None) -> RowSparse:
        """The same value with sorted, unique indices (repeated rows summed, in `dtype`)."""
        with _on_device_of(self.data):
            return self._coalesce(dtype)

    def _coalesce(self, dtype) -> RowSparse:
        xp = self.xp
        dtype = self.data.dtype if dtype is None else np.dtype(dtype)
        idx = self.indices
        if idx.size == 0:
            return RowSparse.trusted(idx, self.data.astype(dtype), self.shape)
        order = xp.argsort(idx, kind="stable")
        idx = idx[order]
        data = self.data[order].astype(dtype, copy=False)
        starts_mask = xp.empty(idx.size, bool)
        starts_mask[0] = True
        xp.not_equal(idx[1:], idx[:-1], out=starts_mask[1:])
        starts = xp.nonzero(starts_mask)[0]
        if starts.size == idx.size:  # no repeated row
            return RowSparse.trusted(idx, xp.ascontiguousarray(data), self.shape)
        # Repeated rows are summed in the order they came (no atomics: the same result on
        # every run), in float32 for 16-bit floats as dense pushes are.
        bounds = xp.concatenate([starts, xp.asarray([idx.size], dtype=starts.dtype)])
        summed = _device.device_of(data).segment_sum(data, bounds.astype(np.int64, copy=False))
        return RowSparse.trusted(idx[starts], summed.astype(dtype, copy=False), self.shape)

    def todense(self, dtype=None):
        """The dense array (repeated rows summed) on the same device, of `dtype` (None:
        the rows' dtype)."""
        dtype = self.data.dtype if dtype is None else np.dtype(dtype)
        with _on_device_of(self.data):
            return self._todense(self.xp, dtype)

    def _todense(self, xp, dtype):
        out = xp.zeros(self.shape, dtype)
        merged = self.coalesce()
        out[merged.indices] = merged.data
        return out

    def retain(self, row_ids) -> RowSparse:
        """Rows `row_ids` (any shape; deduplicated and sorted) of this value, zero if absent."""
        xp = self.xp
        row_ids = _ids_like(_as_array(row_ids, like=self.data), self.data, "RowSparse.retain")
        with _on_device_of(self.data):
            return self._retain(xp, check_row_ids(row_ids, self.shape[0], "RowSparse.retain"))

    def _retain(self, xp, ids) -> RowSparse:
        ids = xp.unique(ids)
        merged = self.coalesce()
        data = xp.zeros((ids.size,) + self.shape[1:], self.data.dtype)
        if merged.indices.size and ids.size:
            pos = xp.searchsorted(merged.indices, ids)
            pos = xp.minimum(pos, merged.indices.size - 1)
            hit = merged.indices[pos] == ids
            data[hit] = merged.data[pos[hit]]
        return RowSparse.trusted(ids, data, self.shape)

    def copy(self) -> RowSparse:
        """A copy of the indices and the rows, on the same device."""
        with _on_device_of(self.data):  # CuPy copies to the current device
            return RowSparse.trusted(self.indices.copy(), self.data.copy(), self.shape)

    def __array__(self, dtype=None, copy=None):
        if not self.on_host:
            raise ArgumentKindError("a GPU RowSparse has no implicit NumPy form; use "
                                    ".todense().get()")
        if copy is False:  # (NumPy 2's protocol: a dense form is always a new array)
            raise ArgumentError("a RowSparse has no dense array to share: its NumPy form "
                                "is always a copy (np.asarray, or copy=None)")
        dense = self.todense()
        return dense if dtype is None else dense.astype(dtype)

    def __mul__(self, other):
        if not isinstance(other, numbers.Number):
            return NotImplemented
        with _on_device_of(self.data):
            return RowSparse.trusted(self.indices, self.data * other, self.shape)

    __rmul__ = __mul__

    def __neg__(self):
        with _on_device_of(self.data):
            return RowSparse.trusted(self.indices, -self.data, self.shape)

    def __repr__(self):
        where = "host" if self.on_host else f"gpu{self.data.device.id}"
        return (f"RowSparse(shape={self.shape}, rows={int(self.indices.size)}, "
                f"dtype={self.dtype}, on={where})")


def merge(sources, home, dtype, canonical: bool = False):
    """The row-wise sum of RowSparse `sources` on `home`: sorted unique rows, in `dtype`.

    By default a row's copies are added in the order of `sources` (a repeated index of
    one source in its own order), the same for every strategy, which row merges do not
    use. `canonical`: each source's own repeated rows are summed first (its value, as
    `todense` gives it), then each row over the sources in the canonical tree of
    `gpukv.canonical`, a source without the row adding zero: the bits a dense push of
    the sources' dense values gives in a deterministic store."""
    from ..comm.ordering import begin, finish
    devices = [_device.device_of(s.data) for s in sources]
    # Read the sources after the work their devices queued (on other GPUs too),
    # and let those devices overwrite them only once they have been read.
    begin(devices + [home])
    for d in devices:
        home.wait_for(d)
    with home.activate():
        if canonical and len(sources) > 1:
            merged = _canonical_merge(sources, home, home.xp, dtype)
        else:
            merged = _merge(sources, home, home.xp, dtype)
    finish(devices, home)
    return merged


def _canonical_merge(sources, home, xp, dtype):
    """`_merge` with each row summed over the sources in the canonical tree: every source
    coalesced, spread over the union of the rows (zeros elsewhere), and the spreads
    summed by the home's `tree_sum_into`."""
    shape = sources[0].shape
    own = [RowSparse.trusted(home.to_local(s.indices), home.to_local(s.data),
                             shape).coalesce(dtype) for s in sources]
    rows = xp.unique(xp.concatenate([s.indices for s in own]))
    width = int(np.prod(shape[1:], dtype=np.int64))
    spreads = []
    for s in own:
        spread = xp.zeros((rows.size,) + tuple(shape[1:]), dtype)
        spread[xp.searchsorted(rows, s.indices)] = s.data
        spreads.append(spread.reshape(-1))
    total = xp.empty(rows.size * width, dtype)
    home.tree_sum_into([(total, spreads)])
    return RowSparse.trusted(rows, total.reshape((rows.size,) + tuple(shape[1:])), shape)


def _merge(sources, home, xp, dtype):
    shape = sources[0].shape
    if len(sources) == 1:
        idx = home.to_local(sources[0].indices)
        data = home.to_local(sources[0].data)
    else:
        idx = xp.concatenate([home.to_local(s.indices) for s in sources])
        data = xp.concatenate([home.to_local(s.data).astype(dtype, copy=False)
                               for s in sources])
    return RowSparse.trusted(idx, data, shape).coalesce(dtype)

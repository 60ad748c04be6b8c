"""Row-sparse plumbing of the store: pure functions on its keys' values and RowSparse outs.

An entry here is anything with the store's `value` (the dense-backed array) and `home`
(its `Device`).
"""
from __future__ import annotations

import numbers

import numpy as np

from . import check
from .._errors import ArgumentError, ArgumentKindError, GpukvError
from ..device import device_of
from ..update.sparse import RowSparse


def regroup(keys, arrays, originals, key_kind) -> check.Groups:
    """The dense keys a push or pull left after taking out its row-sparse (or other) work."""
    all_host = all(isinstance(a, np.ndarray) for per_key in arrays for a in per_key)
    return check.Groups(keys, arrays, originals, all_host, key_kind)


def densified(groups: check.Groups) -> check.Groups:
    """`groups` with every RowSparse replaced by its dense array (for init)."""
    arrays = [[a.checked(f"key {key!r}: init").todense() if type(a) is RowSparse else a
               for a in per_key]
              for key, per_key in zip(groups.keys, groups.arrays)]
    all_host = all(isinstance(a, np.ndarray) for per_key in arrays for a in per_key)
    return groups._replace(arrays=arrays, all_host=all_host, sparse=False)


def assign_rows(entry, merged: RowSparse) -> None:
    """The stored value becomes `merged` (rows not in it become zero), as MXNet assigns."""
    value, home = entry.value, entry.home
    with home.activate():
        value.fill(0)
        value[merged.indices] = merged.data.astype(value.dtype, copy=False)


def dense_gradient(merged: RowSparse, home):
    """`merged` as a dense array, made on `home`'s stream (where the updater reads it)."""
    with home.activate():
        return merged.todense()


def refuse_sparse_outs(groups: check.Groups, in_place: bool) -> None:
    """ArgumentKindError naming the key if pushpull would have to pull into a RowSparse."""
    for key, arrays in zip(groups.keys, groups.arrays):
        if any(type(a) is RowSparse for a in arrays):
            what = "values (out=None pulls into them)" if in_place else "outs"
            raise ArgumentKindError(
                f"key {key!r}: pushpull cannot pull into RowSparse {what}: which rows they "
                f"should get is not defined (MXNet skips them without an error); pass dense "
                f"`out` arrays, or push then row_sparse_pull(key, out, row_ids)")


def fill_rows(entry, out: RowSparse, ids) -> None:
    """Give `out` the rows `ids` (deduplicated, sorted; None: every row) of the key."""
    home, value = entry.home, entry.value
    xp = home.xp
    # Ids on another device (another GPU, or CuPy's current stream when home is a virtual
    # GPU) are read after the work queued there, and reused there only once home read them.
    source = None if ids is None else device_of(ids)
    if source is not None and source != home:
        home.wait_for(source)
    with home.activate():
        uniq = (xp.arange(value.shape[0], dtype=xp.int64) if ids is None
                else xp.unique(home.to_local(ids)))
        rows = value[uniq]
    if source is not None and source != home:
        source.wait_for(home)
    target = device_of(out.data)
    target.wait_for(home)  # a host target waits for home's stream: it copies on its own
    if target == home and home.host_memory and rows.dtype == out.dtype:
        out.indices, out.data = uniq, rows  # fresh arrays already: no second copy
        return
    indices = target.empty(uniq.shape, np.int64)
    target.copy(indices, uniq)
    data = target.empty(rows.shape, out.dtype)
    target.copy(data, rows)
    if home.asynchronous and target.asynchronous:
        home.wait_for(target)  # `uniq` and `rows` go back to home's pool once read
    out.indices, out.data = indices, data


def row_ids_array(key, ids):
    """The row ids of one out as an array (any integer dtype; `check_row_ids` checks it).

    A list is taken as it is, never cast: [1, 2.7] is a DTypeError, not rows 1 and 2.
    """
    if not isinstance(ids, (list, tuple)):
        try:
            array = check.adopt(ids)
        except GpukvError as exc:  # an array on a device this process cannot use
            raise type(exc)(f"key {key!r}: row_ids: {exc}") from None
    elif not ids:
        array = np.zeros(0, np.int64)
    else:
        try:
            array = np.asarray(ids)
        except ValueError:  # ragged
            array = None
        if array is not None and array.dtype == object:  # ints past 64 bits, or ragged
            array = None
    if array is None:
        raise ArgumentKindError(f"key {key!r}: row_ids must be an integer array or a list "
                                f"of ints, got {ids!r:.80}")
    return array


def row_sparse_pairs(key, out, row_ids) -> list:
    """(key, out, row_ids) triples for every out of a row_sparse_pull call."""
    if out is None:
        raise ArgumentError(f"key {key!r}: row_sparse_pull needs RowSparse `out`s")
    if isinstance(key, (list, tuple)):
        if not isinstance(out, (list, tuple)) or len(out) != len(key):
            raise ArgumentError(f"keys {list(key)!r}: a list of keys needs a list of outs "
                                f"of the same length")
        if not isinstance(row_ids, (list, tuple)) or len(row_ids) != len(key):
            raise ArgumentError(f"keys {list(key)!r}: a list of keys needs a list of row_ids "
                                f"of the same length")
        pairs = []
        for k, o, r in zip(key, out, row_ids):
            pairs.extend(_row_sparse_one(k, o, r))
        return pairs
    return _row_sparse_one(key, out, row_ids)


def _is_id_list(row_ids) -> bool:
    """Whether `row_ids` is a list with one id array per out (not a list of ints)."""
    return (isinstance(row_ids, (list, tuple)) and len(row_ids) > 0
            and not isinstance(row_ids[0], numbers.Integral))


def _row_sparse_one(key, out, row_ids) -> list:
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if _is_id_list(row_ids):
        if len(row_ids) != len(outs):
            raise ArgumentError(f"key {key!r}: {len(outs)} outs but {len(row_ids)} row_ids")
        return [(key, o, r) for o, r in zip(outs, row_ids)]
    return [(key, o, row_ids) for o in outs]

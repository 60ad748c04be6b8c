"""Row-sparse plumbing of the store: pure functions on its keys' values and RowSparse outs.

An entry here is anything with the store's `value` (the dense-backed array) and `home`
(its `Device`).
"""
from __future__ import annotations

import numpy as np

from ..device import device_of
from ..encoding.sparse import RowSparse
from . import check


def regroup(keys, arrays, key_kind) -> check.Groups:
    """The dense keys a pull left after taking out its row-sparse outs."""
    all_host = all(isinstance(a, np.ndarray) for per_key in arrays for a in per_key)
    return check.Groups(keys, arrays, all_host, key_kind)


def densified(groups: check.Groups) -> check.Groups:
    """`groups` with every RowSparse replaced by its dense array (for init)."""
    arrays = [[a.checked(f"key {key!r}: init").todense() if type(a) is RowSparse else a
               for a in per_key]
              for key, per_key in zip(groups.keys, groups.arrays)]
    all_host = all(isinstance(a, np.ndarray) for per_key in arrays for a in per_key)
    return groups._replace(arrays=arrays, all_host=all_host, sparse=False)


def assign_rows(entry, merged: RowSparse) -> None:
    """The stored value becomes `merged` (rows not in it become zero), as MXNet assigns."""
    value, home = entry.stored, entry.home
    with home.activate():
        value.fill(0)
        value[merged.indices] = merged.data.astype(value.dtype, copy=False)


def serve_rows(entry, merged: RowSparse, lazy: bool) -> None:
    """A key whose pulls read a served value kept apart (compressed pulls): after a
    row-sparse push, which is not compressed, the rows it changed cross as they are,
    the rows of `merged` when the update was `lazy`, else every row."""
    home = entry.home
    with home.activate():
        if lazy:
            entry.value[merged.indices] = entry.kept[merged.indices]
        else:
            entry.value[...] = entry.kept
    home.leave()


def dense_gradient(merged: RowSparse, home):
    """`merged` as a dense array, made on `home`'s stream (where the updater reads it)."""
    with home.activate():
        return merged.todense()


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

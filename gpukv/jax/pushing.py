"""Pushed trees into the store's arguments: every tree checked against `init_tree`'s,
each split into rows (one per device it is on: one for a tree of single-device leaves,
one per shard for a tree of sharded leaves), and each row's leaves packed into the
buckets' keys. Everything is checked before the store is called, so a refused push
changes nothing.
"""
from __future__ import annotations

import numpy as np

from .._errors import ArgumentError, ArgumentKindError, DTypeError
from .buckets import pack
from .leaves import as_key_shape, device_values, sharded, store_array
from .trees import TreeLayout, leaves


def rows_of(layout: TreeLayout, trees_per_device, prefix: str, call: str) -> list:
    """One list of rows per tree; a row is (device or None, its value of every leaf)."""
    if not isinstance(trees_per_device, (list, tuple)) or not trees_per_device:
        raise ArgumentKindError(f"trees_per_device: expected a non-empty list of trees "
                                f"(one per device), got {type(trees_per_device).__name__}")
    return [_rows(layout, leaves(layout, tree, prefix, f"trees_per_device[{t}]"), call)
            for t, tree in enumerate(trees_per_device)]


def _rows(layout: TreeLayout, found: list, call: str) -> list:
    per_leaf = [device_values(key, leaf, call) for key, leaf in zip(layout.keys, found)]
    spread = [i for i, values in enumerate(per_leaf) if len(values) > 1]
    if not spread:  # single-device leaves: the tree is one device's
        return [(per_leaf[0][0][0] if per_leaf else None,
                 [_value(layout, i, values[0][1], sharded(found[i]))
                  for i, values in enumerate(per_leaf)])]
    devices = [device for device, _ in per_leaf[spread[0]]]
    by_device = [dict(values) for values in per_leaf]
    for i, mine in enumerate(by_device):
        if set(mine) != set(devices):
            raise ArgumentError(f"leaf {layout.keys[i]!r} is on {_devices(mine)}, leaf "
                                f"{layout.keys[spread[0]]!r} on {_devices(devices)}: a "
                                f"tree's leaves must be on the same devices")
    return [(device, [_value(layout, i, mine[device], True) for i, mine in enumerate(by_device)])
            for device in devices]


def _value(layout: TreeLayout, i: int, value, stacked: bool):
    dtype = np.dtype(value.dtype)
    if dtype != layout.dtypes[i]:  # (one rule, whichever leaves share a key)
        raise DTypeError(f"leaf {layout.keys[i]!r}: dtype {dtype}, the key holds "
                         f"{layout.dtypes[i]} (init_tree's); cast it first")
    return as_key_shape(layout.keys[i], value, layout.shapes[i], stacked)


def columns(layout: TreeLayout, rows: list) -> list:
    """Per bucket key, every row's value of it, as arrays the store takes."""
    out: list = [[] for _ in layout.buckets]
    fused = [b for b, bucket in enumerate(layout.buckets) if bucket.fused]
    for device, row in rows:
        for b, bucket in enumerate(layout.buckets):
            if not bucket.fused:
                (i,) = bucket.leaves
                out[b].append(store_array(layout.keys[i], row[i]))
        groups = [[row[i] for i in layout.buckets[b].leaves] for b in fused]
        for b, flat in zip(fused, pack(groups, device)):
            out[b].append(store_array(layout.buckets[b].key, flat))
    return out


def _devices(devices) -> str:
    return "[" + ", ".join(str(d) for d in devices) + "]"

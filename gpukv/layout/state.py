"""Optimizer state across shards: the exports of every shard merged into the one-process
format (`OptimizerUpdater.export_state`), and such a file cut back into shards.

A checkpoint of a dist store is then the same file a one-process store writes: it loads
into a store with any number of servers or processes, or into a 'local' store.
"""
from __future__ import annotations

import numpy as np

from .pieces import pieces


def merge(exports: list, shapes: dict) -> tuple[dict, dict] | None:
    """One (header, arrays) from each shard's `export_state` (None for shards without an
    optimizer); `shapes`: {key: its full shape}. Pieces of a split key are joined in
    order of their first element, which the engines add to each key's entry as `start`."""
    exports = [e for e in exports if e is not None]
    if not exports:
        return None
    header = dict(exports[0][0])
    parts: dict = {}   # key -> [(start, info, {name: array})]
    counts: dict = {}
    num_update = 0
    for head, arrays in exports:
        num_update = max(num_update, head["num_update"])
        for c in head["counts"]:
            counts[c["key"]] = max(counts.get(c["key"], 0), c["count"])
        for i, info in enumerate(head["keys"]):
            names = list(info["states"]) + (["master"] if info["master"] else [])
            own = {n: arrays[f"state/{i}/{n}"] for n in names}
            parts.setdefault(info["key"], []).append((info.get("start", 0), info, own))
    keys, arrays_out = [], {}
    for i, (key, found) in enumerate(parts.items()):
        found.sort(key=lambda p: p[0])
        info = dict(found[0][1])
        info.pop("start", None)
        info["shape"] = list(shapes[key])
        names = list(info["states"]) + (["master"] if info["master"] else [])
        for name in names:
            joined = np.concatenate([p[2][name].reshape(-1) for p in found])
            arrays_out[f"state/{i}/{name}"] = joined.reshape(shapes[key])
        keys.append(info)
    header["keys"] = keys
    header["num_update"] = num_update
    header["counts"] = [{"key": k, "key_kind": type(k).__name__, "count": c}
                        for k, c in counts.items()]
    return header, arrays_out


def cut(state: tuple, server: int, servers: int, bound: int,
        sizes: dict) -> tuple[dict, dict]:
    """The part of a full optimizer state ((header, arrays): `merge`'s or a one-process
    file's) that
    `server` of `servers` keeps; `sizes`: {key: elements}. Keys the file has but the store
    has not stay in every part, so that the shard's own check names them."""
    header, arrays = state
    keys: list = []
    out: dict = {}
    for i, info in enumerate(header.get("keys", [])):
        key = info.get("key") if isinstance(info, dict) else None
        size = sizes.get(key) if isinstance(key, (int, str)) else None
        if size is None:  # damaged, or not a key of the store: its check will say so
            keys.append(info)
            continue
        layout = pieces(key, size, servers, bound)
        mine = [p for p in layout if p.server == server]
        if not mine:
            continue
        j = len(keys)
        names = list(info.get("states") or []) + (["master"] if info.get("master") else [])
        info = dict(info)
        if len(layout) > 1:
            info["shape"] = [mine[0].stop - mine[0].start]
        for name in names:
            array = arrays.get(f"state/{i}/{name}")
            if array is None:
                continue
            out[f"state/{j}/{name}"] = (np.ascontiguousarray(
                array.reshape(-1)[mine[0].start:mine[0].stop]) if len(layout) > 1 else array)
        keys.append(info)
    part = dict(header)
    part["keys"] = keys
    return part, out


def mark_starts(export, starts: dict):
    """`export` (a shard's `export_state`, or None) with each key's first element, from
    `starts` ({key: start}), recorded for `merge`."""
    if export is None:
        return None
    header, arrays = export
    header = dict(header)
    header["keys"] = [dict(info, start=starts.get(info["key"], 0)) for info in header["keys"]]
    return header, arrays

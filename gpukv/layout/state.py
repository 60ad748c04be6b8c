"""Optimizer state across shards: the exports of every shard merged into the one-process
format (`OptimizerUpdater.export_state`), and such a file cut back into shards; its
update counts read (for a worker's copy of the optimizer), or started over.

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


def restarted(state: tuple, begin_num_update: int) -> tuple:
    """`state` ((header, arrays) of a whole store's optimizer, as a one-process file
    holds it) with its update counts started over: every key at the begin_num_update the
    optimizer will have (the file's, when it holds the options; else
    `begin_num_update`), num_update there too, and no schedule (the optimizer keeps its
    own: one saved mid-way would not start over). A damaged header is left as it is,
    for the checks to name."""
    header, arrays = state
    if not isinstance(header, dict):
        return state
    options = header.get("options")
    saved = options.get("begin_num_update") if isinstance(options, dict) else None
    begin = saved if type(saved) is int and saved >= 0 else begin_num_update
    header = dict(header, counts=[], num_update=begin, lr_scheduler=None)
    if isinstance(header.get("keys"), list):
        header["keys"] = [dict(info, count=begin) if isinstance(info, dict) else info
                          for info in header["keys"]]
    return header, arrays


def update_counts(state: tuple) -> tuple[dict, int, int | None]:
    """The update counts of a whole store's optimizer state that its shards have checked
    ((header, arrays), as `merge` makes it): ({key: count}, num_update, the
    begin_num_update of its options, or None when it holds none)."""
    header = state[0]
    counts = {c["key"]: c["count"] for c in header.get("counts", [])}
    for info in header.get("keys", []):
        counts.setdefault(info["key"], info["count"])
    options = header.get("options")
    begin = options.get("begin_num_update") if isinstance(options, dict) else None
    return counts, header["num_update"], begin

"""Compression state in the snapshots of a dist store, as every engine keeps it.

Each worker's file holds its residuals, one per (key, piece start[, leaf]) slot (records
'residual' with the slot's rest in 'slot'; PowerSGD's per key: an empty 'slot', or per
leaf in a deterministic store: [0, leaf], of the whole key's elements), and
PowerSGD's warm starts (records 'q', the same in every process). Each shard's file holds
what its owner keeps of compressed pulls for the pieces it serves: the residual of a
piece (records 'pull', 'slot' [start]) and the served value of a piece kept apart from
its value by an updater (records 'served', with its 'start'). Every file's section names
the store's compression params. A resume restores them only when the snapshot was
saved with the same params, by as many workers and shards, with the same pieces;
`saved` says why not, the same on every worker, as every worker reads the same files.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from ..._errors import CheckpointError
from ...checkpoints import snapshots
from ...encoding.compressors import Compressor, ErrorFeedback
from ...encoding.compressors.powersgd import PowerSGD

log = logging.getLogger("gpukv")
NOT_RESTORED = "gpukv: compression residuals of the snapshot not restored: %s"


class Saved(NamedTuple):
    """The compression state of a snapshot that fits: this worker's file's, and every
    shard's (in shard order)."""
    worker: snapshots.Compression
    shards: list


def worker_items(compressor: Compressor | None, feedback: ErrorFeedback | None) -> tuple:
    """(params, [(record, live array)]) of a worker's compression state."""
    if compressor is None or feedback is None:
        return None, []
    items = [({"what": "residual", "key": slot[0], "slot": list(slot[1:])}, r)
             for slot, r in feedback.residuals.items()]
    if isinstance(compressor, PowerSGD):
        items += [({"what": "q", "key": key}, q)
                  for key, q in compressor.warm_starts().items()]
    return compressor.params(), items


def saved(found, mine: dict | None, rank: int, workers: int, shards: int,
          layouts: dict) -> tuple:
    """(why the compression state of snapshot `found` cannot be restored into a store
    of `workers` workers (this one `rank`) and `shards` shards with compression `mine`
    and key `layouts`, or '' when there is none to restore, or None; the `Saved` state
    when it can)."""
    try:
        head = snapshots.read_compression(found, snapshots.worker_file(0, found.workers))
        if not head.present:
            return ("" if mine is None else "the snapshot holds none (written before "
                    f"snapshots kept them), resuming with {mine}"), None
        if head.params is None and mine is None:
            return "", None
        if head.params != mine or found.workers != workers or found.shards != shards:
            saved_on, now_on = f"{found.workers} workers", f"{workers}"
            if found.shards != found.workers or shards != workers:  # servers: say so
                saved_on += f" and {found.shards} shards"
                now_on += f" workers and {shards} shards"
            return f"saved with {head.params} on {saved_on}, resuming with {mine} on " \
                f"{now_on}", None
        worker = snapshots.read_compression(found, snapshots.worker_file(rank, workers))
        parts = [snapshots.read_compression(found, snapshots.shard_file(i, shards))
                 for i in range(shards)]
    except CheckpointError as exc:
        return f"its compression state could not be read: {exc}", None
    if not all(s.present and s.params == mine for s in [worker, *parts]):
        return "its files do not agree on the compression (a damaged snapshot)", None
    for shard, state in [(None, worker), *enumerate(parts)]:
        for record, array in zip(state.records, state.arrays):
            why = _unfit(record, array, layouts, shard)
            if why is not None:
                return why, None
    return None, Saved(worker, parts)


def _unfit(record: dict, array, layouts: dict, shard: int | None) -> str | None:
    """Why `record` (with its `array`) of shard `shard`'s file (None: a worker's) does
    not fit the key `layouts`, or None."""
    key, what = record["key"], record["what"]
    layout = layouts.get(key) if type(key) in (int, str) else None
    if layout is None:
        return f"it names key {key!r}, which this store lacks"
    if what == "q":
        return None
    if what == "served":
        start = record.get("start")
    else:
        slot = record.get("slot")
        if not isinstance(slot, list) or not all(type(n) is int for n in slot):
            return f"key {key!r}: its {what} record is damaged"
        if not slot:  # a residual of the whole key (PowerSGD's)
            return None if array.size == layout.size else (
                f"key {key!r} has {layout.size} elements, but its residual {array.size}")
        start = slot[0]
        if shard is None and len(slot) == 2 and start == 0 and array.size == layout.size:
            return None  # a leaf's residual of the whole key (PowerSGD's, deterministic)
    pieces = layout.pieces if shard is None else layout.served_by(shard)
    if not any(p.start == start and p.stop - p.start == array.size for p in pieces):
        where = "" if shard is None else f" of shard {shard}"
        return (f"key {key!r}: its {what} at element {start!r} ({array.size} elements) "
                f"is no piece{where} in this store")
    return None


def restore_worker(state: snapshots.Compression, compressor: Compressor | None,
                   feedback: ErrorFeedback | None) -> None:
    """Put a worker's saved residuals and warm starts back (checked by `saved`)."""
    assert compressor is not None and feedback is not None  # the params matched
    for record, array in zip(state.records, state.arrays):
        if record["what"] == "q":
            assert isinstance(compressor, PowerSGD)
            compressor.keep_q(record["key"], np.array(array, np.float32))
        elif record["what"] == "residual":
            slot = (record["key"], *record["slot"])
            np.copyto(feedback.residual(slot, array.size), array.reshape(-1))

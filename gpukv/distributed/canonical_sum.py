"""Sums between processes that continue the canonical tree (`gpukv._canonical`): the
owner of a chunk gets every rank's node partials of it and merges them where the tree
adds them, so the sum is the same bits whatever the layout that made the partials. And the
checks of what a deterministic engine is given.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._canonical import merge, merge_partial, rank_nodes
from .._errors import ArgumentError
from ..device.host_sum import accumulate_dtype


def node_ranges(ranks: int, count: int) -> list:
    """The nodes of every rank of `ranks` when each pushes `count` values (rank order)."""
    return [rank_nodes(r, count, ranks) for r in range(ranks)]


def merge_into(out: np.ndarray, parts: Sequence, total: int) -> None:
    """`out` becomes the tree's root from `parts` ((leaf range, array) covering
    [0, total) in order): the inner adds go into temporaries, the root's into `out`
    (so a 16-bit `out` is rounded once, from the accumulation dtype)."""
    if len(parts) == 1:
        out[...] = parts[0][1]
        return

    def add(left, right):
        (lo, _), x = left
        (_, hi), y = right
        return (lo, hi), np.add(x, y, out=out if (lo, hi) == (0, total) else None)
    merge([(rng, (rng, array)) for rng, array in parts], total, add)


def own_sum(rows: np.ndarray, nodes: list, total: int) -> np.ndarray:
    """One process's node partials `rows` (its `nodes`) as one array: merged as far as
    the tree allows, the rest added in order (a push applied alone, as in dist_async)."""
    if len(nodes) == 1:
        return rows[0]
    merged = [v for _, v in merge_partial(list(zip(nodes, rows)), total, np.add)]
    out = merged[0]
    for value in merged[1:]:
        out = np.add(out, value)
    return out


def check_partials(keys, grads, specs, rank: int, ranks: int) -> list:
    """The count of values of each key's `engine.Partials` in `grads`, each checked
    against its key's (elements, dtype) in `specs`: ArgumentError naming the key."""
    counts = []
    for key, grad, (size, dtype) in zip(keys, grads, specs):
        sums, count = getattr(grad, "sums", None), getattr(grad, "count", None)
        if not isinstance(sums, np.ndarray) or isinstance(count, bool) or not isinstance(
                count, (int, np.integer)) or count < 1:
            raise ArgumentError(f"key {key!r}: a deterministic engine takes Partials(sums, "
                                f"count >= 1), got {type(grad).__name__}")
        rows = len(rank_nodes(rank, int(count), ranks))
        wire = accumulate_dtype(np.dtype(dtype))
        if sums.shape != (rows, size) or sums.dtype != wire or not sums.flags.c_contiguous:
            raise ArgumentError(
                f"key {key!r}: the partials of {count} value(s) on rank {rank} of {ranks} "
                f"are a C-contiguous {wire.name} array of shape {(rows, size)}, got "
                f"{sums.dtype.name} {sums.shape}"
                f"{'' if sums.flags.c_contiguous else ' (not contiguous)'}")
        counts.append(int(count))
    return counts


def refuse_compression(compressor, deterministic: bool) -> None:
    """ArgumentError for compression on the wire of a deterministic engine: the decoded
    payloads would be summed outside the canonical tree."""
    if compressor is not None and deterministic:
        raise ArgumentError(f"gradient compression {compressor.params()}: a deterministic "
                            f"store sums every key in the canonical order, which the "
                            f"compressed rounds do not follow yet; set no compression, or "
                            f"create the store with deterministic=False")

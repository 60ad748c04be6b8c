"""Sums between processes that continue the canonical tree (`gpukv._canonical`): the
owner of a chunk gets every rank's node partials of it and merges them where the tree
adds them, so the sum is the same bits whatever the layout that made the partials; a key
compressed on the wire comes as each leaf's payload, decoded and summed as one process
does. And the checks of what a deterministic engine is given.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..._canonical import OUT, add_plan, merge_partial, rank_nodes
from ..._errors import ArgumentError
from ...device.host_sum import accumulate_dtype, host_tree_sum
from ...encoding.compressors import Ctx


def node_ranges(ranks: int, count: int) -> list:
    """The nodes of every rank of `ranks` when each pushes `count` values (rank order)."""
    return [rank_nodes(r, count, ranks) for r in range(ranks)]


def merge_into(out: np.ndarray, parts: Sequence, total: int, scratch: list) -> None:
    """`out` becomes the tree's root from `parts` ((leaf range, array) covering
    [0, total) in order), by the adds of `add_plan`: the inner ones into temporaries (the
    out itself first, when it has the parts' dtype), the root's into `out` (so a 16-bit
    `out` is rounded once, from the accumulation dtype). `scratch`: the caller's list of
    temporaries, grown here as needed and kept for its next merges."""
    if len(parts) == 1:
        out[...] = parts[0][1]
        return
    ranges = tuple(rng for rng, _ in parts)
    plan = _PLANS.get((ranges, total))
    if plan is None:
        plan = _PLANS[ranges, total] = add_plan(ranges, total)
    ops, temps = plan
    values = [array for _, array in parts]
    dtype, n = values[0].dtype, out.size
    in_out = out.dtype == dtype and not any(np.may_share_memory(out, v) for v in values)
    need = temps - in_out
    if len(scratch) < need or any(t.size < n or t.dtype != dtype for t in scratch[:need]):
        scratch[:] = [np.empty(n, dtype) for _ in range(need)]  # made for this size
    slots = ([out] if in_out else []) + [t[:n].reshape(out.shape) for t in scratch[:need]]
    for target, x, y in ops:
        np.add(values[x] if x >= 0 else slots[-2 - x], values[y] if y >= 0 else slots[-2 - y],
               out=out if target == OUT else slots[-2 - target])


_PLANS: dict = {}  # (node ranges, leaves) -> add_plan


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


def check_partials(keys, grads, specs, rank: int, ranks: int, leaves=None) -> list:
    """The count of values of each key's `engine.Partials` in `grads` (`engine.Leaves`
    where `leaves[i]` is true: a key compressed on the wire), each checked against its
    key's (elements, dtype) in `specs`: ArgumentError naming the key."""
    counts = []
    for i, (key, grad, (size, dtype)) in enumerate(zip(keys, grads, specs)):
        if leaves is not None and leaves[i]:
            counts.append(_leaves_count(key, grad, size))
            continue
        sums, count = getattr(grad, "sums", None), _count(grad)
        if not isinstance(sums, np.ndarray) or count is None:
            raise ArgumentError(f"key {key!r}: a deterministic engine takes Partials(sums, "
                                f"pushed >= 1), got {type(grad).__name__}")
        rows = len(rank_nodes(rank, count, ranks))
        wire = accumulate_dtype(np.dtype(dtype))
        if sums.shape != (rows, size) or sums.dtype != wire or not sums.flags.c_contiguous:
            raise ArgumentError(
                f"key {key!r}: the partials of {count} value(s) on rank {rank} of {ranks} "
                f"are a C-contiguous {wire.name} array of shape {(rows, size)}, got "
                f"{sums.dtype.name} {sums.shape}"
                f"{'' if sums.flags.c_contiguous else ' (not contiguous)'}")
        counts.append(count)
    return counts


def _count(grad) -> int | None:
    """`grad.pushed` as an int when it is one >= 1 (not a bool), else None."""
    count = getattr(grad, "pushed", None)
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        return None
    return int(count)


def _leaves_count(key, grad, size: int) -> int:
    """The count of a compressed key's `engine.Leaves`, checked (ArgumentError naming it)."""
    values, count = getattr(grad, "values", None), _count(grad)
    if not isinstance(values, np.ndarray) or count is None:
        raise ArgumentError(f"key {key!r}: a deterministic engine compressing it takes "
                            f"Leaves(values, pushed >= 1), got {type(grad).__name__}")
    if (values.shape != (count, size) or values.dtype != np.float32
            or not values.flags.c_contiguous):
        raise ArgumentError(
            f"key {key!r}: the leaves of {count} value(s) are a C-contiguous float32 array "
            f"of shape {(count, size)}, got {values.dtype.name} {values.shape}"
            f"{'' if values.flags.c_contiguous else ' (not contiguous)'}")
    return count


def decode_leaves(comp, payloads, n: int, terms: np.ndarray) -> None:
    """terms[i] = the term one process sums for leaf payload i (`n` elements): its
    decoded float32 value, or, for a compressor that sums payloads, the payload itself
    in float32 (a 16-bit float is a float32 exactly)."""
    for payload, row in zip(payloads, terms):
        if comp.sums_payload:
            row[...] = payload
        else:
            comp.decompress(payload, Ctx(n, (n,)), row)


def sum_leaves(comp, terms: np.ndarray, out: np.ndarray) -> None:
    """`out` (float32) becomes one process's sum of the decoded leaves `terms` (a row
    per leaf, every leaf of the key in order): their canonical tree sum, then the
    compressor's `finish` (the pre_divide scale of summed fp16 payloads)."""
    host_tree_sum(out, list(terms))
    comp.finish(out)

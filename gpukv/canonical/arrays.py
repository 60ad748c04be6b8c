"""The canonical tree's sums on NumPy arrays: one runner of `tree.add_plan` that the
host tree sum (`device.host_sum.host_tree_sum`) and the merges of node partials across
processes (`merge_into`, `own_sum`) share, so every host sum in the canonical order adds
the same pairs in the same order."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .tree import OUT, add_plan, merge_partial, rank_nodes


def run_adds(ops: list, values: Sequence, slots: list, out: np.ndarray, **kwargs) -> None:
    """The adds `ops` of an `add_plan`: operand i >= 0 is `values[i]`, one below OUT is
    `slots[-2 - i]`, and the target OUT is `out` (the root, written once). `kwargs` go
    to every `np.add` (a dtype to accumulate in)."""
    add = np.add
    for target, x, y in ops:
        add(values[x] if x >= 0 else slots[-2 - x], values[y] if y >= 0 else slots[-2 - y],
            out if target == OUT else slots[-2 - target], **kwargs)


def leaf_plan(k: int) -> tuple[list, int]:
    """`add_plan` of k leaves: the adds of their canonical tree (kept: plans repeat)."""
    plan = _LEAF_PLANS.get(k)
    if plan is None:
        plan = _LEAF_PLANS[k] = add_plan([(i, i + 1) for i in range(k)], k)
    return plan


_LEAF_PLANS: dict = {}  # leaves -> leaf_plan(leaves)


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
    run_adds(ops, values, slots, out)


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

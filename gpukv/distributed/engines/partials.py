"""What a deterministic engine is given, checked (`engine.Partials`: a worker's node
partials of the canonical tree; `engine.Leaves`: its values of a key compressed on the
wire), and the leaves' sum where a compressed key is served: every leaf's payload decoded
and summed as one process sums its sources, so the bits do not depend on the layout.
The merges of node partials are `gpukv.canonical.arrays`'.
"""
from __future__ import annotations

import numpy as np

from ..._errors import ArgumentError
from ...canonical.tree import rank_nodes
from ...device.host_sum import accumulate_dtype, host_tree_sum
from ...encoding.compressors import Ctx


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

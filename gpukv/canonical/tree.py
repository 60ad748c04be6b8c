"""The canonical reduction order: one fixed binary tree over a key's values.

The values of a key are numbered by their global index: rank-major, then the order of the
process's values in its call. Their sum is the tree over indices [0, n) whose nodes at
level k are the aligned blocks [i * 2**k, min((i + 1) * 2**k, n)): level by level, each
node is its left child plus its right one, like a stride-doubling loop
(`x[i] += x[i + s]` for s = 1, 2, 4, ...). A node's own leaves start at a multiple of its
size, so inside a node the tree is the same shape as the tree over its leaves alone.

So any layout can follow it: a process that holds the values [lo, hi) sums the largest
nodes inside its range (`nodes`), passes those partial sums on, and whoever receives
every node of [0, n) merges them as the tree does (`merge`). Floating-point addition is
commutative, so only which pairs are added matters, never which operand comes first.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

V = TypeVar("V")


def nodes(lo: int, hi: int, total: int) -> list[tuple[int, int]]:
    """The largest nodes of the tree over `total` leaves that cover [lo, hi), in order."""
    if not 0 <= lo <= hi <= total:
        raise ValueError(f"[{lo}, {hi}) is not a range of {total} leaves")
    out = []
    x = lo
    while x < hi:
        size = 1
        # grow while x stays aligned and the (clipped) block stays inside [lo, hi)
        while x % (2 * size) == 0 and min(x + 2 * size, total) <= hi and 2 * size < 2 * total:
            if min(x + 2 * size, total) == min(x + size, total):
                break  # the parent covers no more leaves: the same node
            size *= 2
        stop = min(x + size, total)
        out.append((x, stop))
        x = stop
    return out


def rank_nodes(rank: int, count: int, ranks: int) -> list[tuple[int, int]]:
    """The nodes a process sums when each of `ranks` processes holds `count` values."""
    return nodes(rank * count, (rank + 1) * count, ranks * count)


def _siblings(left: tuple[int, int], right: tuple[int, int], total: int) -> bool:
    """Whether `left` and `right` are the two children of one node."""
    a, b = left
    size = b - a
    if size & (size - 1) or a % (2 * size) or right[0] != b:
        return False
    return right[1] == min(a + 2 * size, total)


def merge(parts: Sequence[tuple[tuple[int, int], V]], total: int,
          add: Callable[[V, V], V]) -> V:
    """The root of the tree from its nodes `parts` ((range, value) covering [0, total)
    in order): pairs are merged with `add(left, right)` exactly where the tree adds them."""
    return merge_partial(parts, total, add)[0][1]


def merge_partial(parts: Sequence[tuple[tuple[int, int], V]], total: int,
                  add: Callable[[V, V], V]) -> list[tuple[tuple[int, int], V]]:
    """`parts` merged as far as the tree allows: the largest nodes they cover, in order
    (one, the root, when they cover [0, total))."""
    stack: list = []
    for rng, value in parts:
        stack.append((rng, value))
        while len(stack) > 1 and _siblings(stack[-2][0], stack[-1][0], total):
            (a, _), left = stack[-2]
            (_, c), right = stack.pop()
            stack[-1] = ((a, c), add(left, right))
    return stack


def leaves_sum(values: Sequence[V], add: Callable[[V, V], V]) -> V:
    """The tree's sum of `values`, leaves 0 .. len - 1 (a node's own sum)."""
    n = len(values)
    if n == 0:
        raise ValueError("the sum of no values")
    return merge([((i, i + 1), v) for i, v in enumerate(values)], n, add)


#: `add_plan`'s name for the out
OUT = -1


def add_plan(ranges: Sequence[tuple[int, int]], total: int) -> tuple[list, int]:
    """([(target, left, right)], temporaries): the adds that merge the nodes `ranges`
    (covering [0, total) in order) into the root, in the order they run. An operand
    i >= 0 is the i-th node's value, one below OUT is temporary -2 - t; the last add's
    target is OUT, so the root is written (and rounded) once. A temporary is reused as
    soon as it is read: at most log2 of the nodes are live."""
    ops: list = []
    free: list = []
    count = [0]

    def add(x: int, y: int) -> int:
        for v in (x, y):
            if v < OUT:
                free.append(v)
        if free:
            target = free.pop()
        else:
            target = -2 - count[0]
            count[0] += 1
        ops.append((target, x, y))
        return target

    merge([(rng, i) for i, rng in enumerate(ranges)], total, add)
    if ops:
        ops[-1] = (OUT,) + ops[-1][1:]
    return ops, count[0]

"""GPU topology: link matrices, reduction trees and rings, as pure functions.

A *link matrix* is an n x n symmetric array of link weights between devices: 0 means
no direct peer-to-peer link (a copy is staged through the host), and a higher weight
means a faster link. The built-in machines follow MXNet's convention (1: PCIe,
2: one NVLink, 3: two NVLinks); `link_matrix_from_ranks` derives weights from the CUDA
P2P performance ranks the device layer probes (`gpukv.device.p2p_ranks`).
Nothing here needs a GPU, and nothing here asks one: the planners are functions of a
matrix, so machines we do not have (DGX-1, NVSwitch boxes, PCIe-only boxes) are
planned and simulated (see `simulate.py`) in CI.

Trees follow the scheme of MXNet's `gpu_topology.h`: for every root, a binary
reduction tree built by recursive balanced bisection of the devices (an exact search
up to 8 devices; beyond, splits scored by spanning-tree cost, enumerated for sets of
up to 12 and improved by Kernighan-Lin swaps above), with links already used by earlier
trees penalised so that the per-root trees spread over all links. Unlike MXNet's, planning
never fails: a pair without a direct link is still usable as a *staged* edge (through
the host), only at a very low weight, so every matrix gets a valid tree of depth
ceil(log2 n).

Tuning (environment, read by `tree_options`; MXNet's names are honoured too):
``GPUKV_TREE_LINK_USAGE_PENALTY`` (0.7), ``GPUKV_TREE_BACKTRACK`` (0) and
``GPUKV_TREE_ARRAY_BOUND`` (unset). With no array bound set, whether and into how many
slices a key is cut across the per-root trees is decided per key by the cost model
(`simulate.tree_slice_plan`); a bound set there restores MXNet's fixed rule (whole up to
the bound, sliced over every tree above it).
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..._errors import ArgumentError

__all__ = [
    "Tree", "plan_trees", "plan_ring", "validate_tree", "is_valid_tree",
    "tree_depth", "link_usage", "usage_summary", "slice_plan", "ring_bottleneck",
    "as_link_matrix", "effective_weights", "link_matrix_from_ranks",
    "tree_options", "dgx1_v100", "nvswitch_h100", "pcie_two_socket", "random_link_matrix",
    "slice_roots", "SAME_DEVICE_WEIGHT", "DEFAULT_PENALTY", "DEFAULT_ARRAY_BOUND",
    "MXNET_ARRAY_BOUND",
]

#: Weight of a "link" between two logical devices on one physical GPU (a device copy):
#: faster than any real link.
SAME_DEVICE_WEIGHT = 64.0
#: Factor applied to a link's planning weight each time a tree uses it (MXNet: 0.7).
DEFAULT_PENALTY = 0.7
#: No fixed array bound by default: the cost model decides per key whether to slice it
#: across the per-root trees (`simulate.tree_slice_plan`).
DEFAULT_ARRAY_BOUND = None
#: MXNet's default ``MXNET_KVSTORE_TREE_ARRAY_BOUND`` (elements): the bound `slice_plan`
#: applies when it is given neither a bound nor roots and none is set in the environment.
MXNET_ARRAY_BOUND = 10_000_000
#: A staged edge (no direct link) weighs this fraction of the weakest real link, so the
#: planner takes one only where no direct link can do the job.
STAGED_FRACTION = 1e-3
#: Largest set whose balanced bisections are all enumerated (C(11, 5) = 462 splits).
_EXHAUSTIVE_LIMIT = 12
#: Largest device count whose trees are always searched exactly (it takes milliseconds).
_EXACT_LIMIT = 8
#: Largest device count for which `backtrack=True` searches all trees exactly.
_BACKTRACK_LIMIT = 10
#: Largest device count for which `plan_ring` tries every ring.
_RING_EXACT_LIMIT = 8


# ------------------------------------------------------------------- link matrices
def as_link_matrix(matrix) -> np.ndarray:
    """`matrix` as a float64 symmetric link matrix with a zero diagonal (validated).

    An asymmetric input is made symmetric by keeping the slower direction of each pair,
    because a reduction uses a link one way and the broadcast the other way.
    """
    w = np.array(matrix, dtype=np.float64, copy=True)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
        raise ArgumentError(f"link matrix: expected a non-empty square 2-D array, got shape "
                            f"{w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ArgumentError("link matrix: expected finite non-negative weights")
    w = np.minimum(w, w.T)
    np.fill_diagonal(w, 0.0)
    return w


def effective_weights(matrix) -> np.ndarray:
    """The planning weights: `matrix` with every missing link replaced by a staged edge.

    A staged edge weighs `STAGED_FRACTION` of the weakest real link (or of 1 when there
    is none), so the graph is complete and planning always succeeds.
    """
    w = as_link_matrix(matrix)
    positive = w[w > 0]
    staged = STAGED_FRACTION * (positive.min() if positive.size else 1.0)
    eff = np.where(w > 0, w, staged)
    np.fill_diagonal(eff, 0.0)
    return eff


def dgx1_v100() -> np.ndarray:
    """The DGX-1 (V100) hybrid cube-mesh, exactly the weight matrix MXNet's tests use.

    3: two NVLinks, 2: one NVLink, 1: no NVLink (PCIe / through the host). GPUs 0-3 and
    4-7 are fully connected quads, and GPU i is linked to GPU i+4.
    """
    return np.array([
        [0, 2, 2, 3, 3, 1, 1, 1],
        [2, 0, 3, 2, 1, 3, 1, 1],
        [2, 3, 0, 3, 1, 1, 2, 1],
        [3, 2, 3, 0, 1, 1, 1, 2],
        [3, 1, 1, 1, 0, 2, 2, 3],
        [1, 3, 1, 1, 2, 0, 3, 2],
        [1, 1, 2, 1, 2, 3, 0, 3],
        [1, 1, 1, 2, 3, 2, 3, 0],
    ], dtype=np.float64)


def nvswitch_h100(n: int = 8) -> np.ndarray:
    """An NVSwitch box (HGX/DGX H100): every pair linked equally (weight 19 = 18 NVLinks+1)."""
    if n < 1:
        raise ArgumentError(f"nvswitch_h100: n must be >= 1, got {n}")
    w = np.full((n, n), 19.0)
    np.fill_diagonal(w, 0.0)
    return w


def pcie_two_socket(n: int = 8) -> np.ndarray:
    """A PCIe-only two-socket box: 2 under one PCIe switch, 1 within a socket, 0 across.

    GPUs are split evenly over the two sockets (first half on socket 0), and paired
    under PCIe switches in order: (0, 1), (2, 3), ... Cross-socket copies have no P2P
    path and are staged through host memory over QPI/UPI.
    """
    if n < 1:
        raise ArgumentError(f"pcie_two_socket: n must be >= 1, got {n}")
    half = (n + 1) // 2
    socket = np.array([0 if i < half else 1 for i in range(n)])
    switch = np.array([(i // 2) if i < half else 1000 + (i - half) // 2 for i in range(n)])
    w = np.where(socket[:, None] == socket[None, :], 1.0, 0.0)
    w[switch[:, None] == switch[None, :]] = 2.0
    np.fill_diagonal(w, 0.0)
    return w


def random_link_matrix(n: int, seed: int | None = None, *, density: float = 0.5,
                       max_weight: int = 3) -> np.ndarray:
    """A random symmetric integer link matrix (each pair linked with prob. `density`)."""
    rng = np.random.default_rng(seed)
    weights = rng.integers(1, max_weight + 1, size=(n, n)).astype(np.float64)
    present = rng.random((n, n)) < density
    w = np.triu(np.where(present, weights, 0.0), 1)
    return w + w.T


# ------------------------------------------------------------- measured links
def link_matrix_from_ranks(device_ids, ranks) -> np.ndarray:
    """The link matrix of devices on the given GPUs, from their P2P performance ranks.

    `device_ids` are GPU ordinals (or objects with `.physical` or `.id`); one ordinal
    may appear several times (virtual GPUs on one physical GPU), and such pairs get
    `SAME_DEVICE_WEIGHT`. `ranks` maps ordered pairs (a, b) of distinct ordinals with
    peer access to CUDA's P2P performance rank (lower rank = faster link), as the
    device layer reports them; a pair of distinct GPUs missing from it gets 0. The
    slowest rank seen gets weight 1, each faster rank one more.
    """
    ids = [_ordinal(d) for d in device_ids]
    n = len(ids)
    worst = max(ranks.values(), default=0)
    w = np.zeros((n, n))
    for i, j in itertools.permutations(range(n), 2):
        a, b = ids[i], ids[j]
        if a == b:
            w[i, j] = SAME_DEVICE_WEIGHT
        elif (a, b) in ranks:
            w[i, j] = float(worst - ranks[a, b] + 1)
    return as_link_matrix(w)


def _ordinal(device) -> int:
    for attr in ("physical", "id"):
        if hasattr(device, attr):
            return int(getattr(device, attr))
    return int(device)


# --------------------------------------------------------------------------- trees
@dataclass(frozen=True)
class Tree:
    """A reduction tree over devices 0..n-1 rooted at `root`.

    `parent[i]` is the device that i sends its partial sum to (-1 for the root).
    `levels[k]` lists the (child, parent) edges of reduction step k, leaves first: in
    one step a device takes part in at most one edge, and a child sends only after all
    of its own children have sent to it in earlier steps. The broadcast runs the levels
    in reverse with every edge reversed (`broadcast_levels`). `staged` holds the edges
    without a direct link (copied through the host).
    """

    root: int
    parent: list
    levels: list
    staged: frozenset = field(default_factory=frozenset)

    @property
    def n(self) -> int:
        """Number of devices."""
        return len(self.parent)

    @property
    def depth(self) -> int:
        """Number of reduction steps."""
        return len(self.levels)

    def edges(self) -> list:
        """Every (child, parent) edge in reduction order."""
        return [e for level in self.levels for e in level]

    def broadcast_levels(self) -> list:
        """The broadcast steps: (source, destination) edges, root first."""
        return [[(p, c) for c, p in level] for level in reversed(self.levels)]


def tree_depth(n: int) -> int:
    """The number of steps of a balanced binary reduction over n devices: ceil(log2 n)."""
    return max(0, math.ceil(math.log2(n))) if n > 0 else 0


def tree_options(*names: str) -> dict:
    """Planner settings from the environment (GPUKV_TREE_*, else MXNET_KVSTORE_TREE_*):
    `names` among 'penalty', 'backtrack' and 'array_bound' (none: all of them), each
    checked with the variable it came from named in the error (a setting not asked for is
    not read: an option given in its place wins even over a malformed variable).

    ``array_bound`` is None unless a bound is set: the cost model then decides slicing.
    """
    def env(name, default, parse, expected):
        for prefix in ("GPUKV_TREE_", "MXNET_KVSTORE_TREE_"):
            raw = os.environ.get(prefix + name, "").strip()
            if raw:
                try:
                    return parse(raw)
                except ValueError:
                    raise ArgumentError(f"{prefix + name}={raw!r}: expected {expected}"
                                        ) from None
        return default

    def penalty_of(raw: str) -> float:
        value = float(raw)
        if not 0 < value <= 1:
            raise ValueError
        return value

    def bound_of(raw: str) -> int:
        value = int(raw)
        if value < 1:
            raise ValueError
        return value

    readers = {
        "penalty": lambda: env("LINK_USAGE_PENALTY", DEFAULT_PENALTY, penalty_of,
                               "a number with 0 < penalty <= 1"),
        "backtrack": lambda: env("BACKTRACK", False, lambda raw: int(raw) != 0,
                                 "an integer (0: off, else on)"),
        "array_bound": lambda: env("ARRAY_BOUND", DEFAULT_ARRAY_BOUND, bound_of,
                                   "a positive integer (elements)")}
    return {name: readers[name]() for name in (names or readers)}


def plan_trees(matrix, *, penalty: float | None = None,
               backtrack: bool | None = None) -> list:
    """One reduction `Tree` per root (`trees[r].root == r`), balanced over the links.

    Trees are planned in root order; every link a tree uses has its planning weight
    multiplied by `penalty` for the trees after it (MXNet's link usage penalty), so the
    trees spread over different links when the topology allows. Never fails: missing
    links become staged edges. `penalty`/`backtrack` default to `tree_options()`.
    """
    penalty = tree_options("penalty")["penalty"] if penalty is None else float(penalty)
    backtrack = (tree_options("backtrack")["backtrack"] if backtrack is None
                 else bool(backtrack))
    w = as_link_matrix(matrix)
    return list(_plan_trees_cached(w.tobytes(), w.shape[0], penalty, backtrack))


def _planning_weights(w: np.ndarray) -> np.ndarray:
    """`effective_weights`, with the slowest link class demoted when every pair is linked
    and every device also has a faster link: there the slowest class is the fallback
    path (PCIe beside NVLink), and MXNet too plans DGX-1 trees on NVLink only.

    A demoted link weighs 10x a staged edge: used only where nothing faster fits.
    """
    eff = effective_weights(w)
    positive = w[w > 0]
    n = w.shape[0]
    if n > 2 and positive.size == n * (n - 1):  # every pair linked
        slowest = positive.min()
        if np.all(w.max(axis=1) > slowest):
            eff[w == slowest] = 10 * STAGED_FRACTION * slowest
    return eff


@lru_cache(maxsize=64)
def _plan_trees_cached(raw: bytes, n: int, penalty: float, backtrack: bool) -> tuple:
    w = np.frombuffer(raw, dtype=np.float64).reshape(n, n)
    eff = _planning_weights(w)
    trees = []
    for root in range(n):
        tree = _plan_one(w, eff, root, backtrack)
        trees.append(tree)
        for c, p in tree.edges():
            eff[c, p] *= penalty
            eff[p, c] *= penalty
    return tuple(trees)


def _plan_one(w: np.ndarray, eff: np.ndarray, root: int, backtrack: bool) -> Tree:
    n = w.shape[0]
    depth = tree_depth(n)
    by_depth: list = [[] for _ in range(depth)]  # edges by bisection depth, top first
    if n <= _EXACT_LIMIT or (backtrack and n <= _BACKTRACK_LIMIT):
        _exact_split(eff, frozenset(range(n)), root, 0, by_depth)
    else:
        _greedy_split(eff, list(range(n)), root, 0, by_depth)
    levels = [sorted(level) for level in reversed(by_depth)]
    parent = [-1] * n
    for c, p in (e for level in levels for e in level):
        parent[c] = p
    staged = frozenset((c, p) for level in levels for c, p in level if w[c, p] <= 0)
    return Tree(root=root, parent=parent, levels=levels, staged=staged)


def _greedy_split(eff, nodes: list, root: int, k: int, out: list) -> None:
    """Bisect `nodes` (containing `root`) and recurse; record edges by depth `k`."""
    if len(nodes) <= 1:
        return
    a_side, b_side, child = _best_bisection(eff, nodes, root)
    out[k].append((child, root))
    _greedy_split(eff, a_side, root, k + 1, out)
    _greedy_split(eff, b_side, child, k + 1, out)


def _best_bisection(eff, nodes: list, root: int):
    """Split `nodes` into A (with `root`, ceil half) and B, and pick B's root.

    Cost (lower is better, see `_split_cost`): the root's link into B plus the cheapest
    spanning trees of the halves, all in 1/weight units; the first best split wins.
    """
    m = len(nodes)
    size_a = (m + 1) // 2
    sub = eff[np.ix_(nodes, nodes)]
    r = nodes.index(root)
    if m <= _EXHAUSTIVE_LIMIT:
        picks = list(itertools.combinations(range(m - 1), size_a - 1))
        combos = np.array(picks, dtype=np.intp).reshape(len(picks), size_a - 1)
        other_idx = np.array([i for i in range(m) if i != r], dtype=np.intp)
        member = np.zeros((len(combos), m))
        member[:, r] = 1.0
        if combos.size:
            rows = np.repeat(np.arange(len(combos)), combos.shape[1])
            member[rows, other_idx[combos.ravel()]] = 1.0
        costs, children = _split_cost(sub, member, r)
        best = int(np.argmin(costs))  # first minimum: deterministic
        mask = member[best]
        child_local = int(children[best])
    else:
        mask, child_local = _kernighan_lin(sub, r, size_a)
    a_side = [nodes[i] for i in range(m) if mask[i]]
    b_side = [nodes[i] for i in range(m) if not mask[i]]
    return a_side, b_side, nodes[child_local]


def _split_cost(sub, member, r):
    """Costs and B-roots of the candidate splits given as 0/1 rows of `member`.

    In 1/weight units: the root's link into B plus the minimum spanning tree of each
    half, a lower bound on the links the halves' own trees will need.
    """
    top = sub[r][None, :] * (1.0 - member)  # root's links into B
    children = np.argmax(top, axis=1)
    top_w = top[np.arange(len(member)), children]
    with np.errstate(divide="ignore"):
        cost = np.where(sub > 0, 1.0 / np.where(sub > 0, sub, 1.0), np.inf)
    half_a = member > 0.5
    return 1.0 / top_w + _mst_cost(cost, half_a) + _mst_cost(cost, ~half_a), children


def _mst_cost(cost, member):
    """Total cost of a minimum spanning tree of each row's devices (batched Prim)."""
    k, m = member.shape
    rows = np.arange(k)
    start = np.argmax(member, axis=1)
    in_tree = np.zeros((k, m), dtype=bool)
    in_tree[rows, start] = True
    total = np.zeros(k)
    dist = cost[start].copy()
    for _ in range(m - 1):
        dist[~member | in_tree] = np.inf
        j = np.argmin(dist, axis=1)
        d = dist[rows, j]
        ok = np.isfinite(d)
        if not ok.any():
            break
        total[ok] += d[ok]
        in_tree[rows[ok], j[ok]] = True
        dist = np.minimum(dist, cost[j])
    return total


def _kernighan_lin(sub, r, size_a):
    """A good split for large sets: Kernighan-Lin pair swaps from a greedy start."""
    m = sub.shape[0]
    in_a = [r]
    while len(in_a) < size_a:  # greedy start: grow A around the root
        rest = [i for i in range(m) if i not in in_a]
        in_a.append(max(rest, key=lambda i: sub[i, in_a].sum()))
    member = np.zeros(m)
    member[in_a] = 1.0
    cost, child = (x[0] for x in _split_cost(sub, member[None, :], r))
    for _ in range(4 * m):
        swaps = [(a, b) for a in range(m) if member[a] and a != r
                 for b in range(m) if not member[b]]
        trials = np.repeat(member[None, :], len(swaps), axis=0)
        for k, (a, b) in enumerate(swaps):
            trials[k, a], trials[k, b] = 0.0, 1.0
        costs, children = _split_cost(sub, trials, r)
        k = int(np.argmin(costs))
        if costs[k] >= cost - 1e-12:
            break
        member, cost, child = trials[k], costs[k], children[k]
    return member, int(child)


def _exact_split(eff, nodes: frozenset, root: int, k: int, out: list) -> None:
    """Backtracking: the bisection tree minimising the critical path of 1/weight."""
    plan = _exact_plan(_key(eff), len(eff), nodes, root)[2]
    for depth, edge in plan:
        out[k + depth].append(edge)


def _key(eff):
    return eff.tobytes()


@lru_cache(maxsize=200_000)
def _exact_plan(raw: bytes, n: int, nodes: frozenset, root: int):
    """(critical path, total cost, edges by relative depth) of the best subtree."""
    if len(nodes) == 1:
        return 0.0, 0.0, ()
    eff = np.frombuffer(raw, dtype=np.float64).reshape(n, n)
    others = sorted(nodes - {root})
    size_a = (len(nodes) + 1) // 2
    best = None
    for picked in itertools.combinations(others, size_a - 1):
        a_side = frozenset(picked) | {root}
        b_side = nodes - a_side
        a_plan = _exact_plan(raw, n, a_side, root)
        for child in sorted(b_side):
            b_plan = _exact_plan(raw, n, b_side, child)
            cost = 1.0 / eff[root, child]
            crit = max(a_plan[0], b_plan[0]) + cost
            total = a_plan[1] + b_plan[1] + cost
            if best is None or crit < best[0] - 1e-12 or (
                    crit <= best[0] + 1e-12 and total < best[1] - 1e-12):
                edges = ((0, (child, root)),) + tuple((d + 1, e) for d, e in a_plan[2]) \
                    + tuple((d + 1, e) for d, e in b_plan[2])
                best = (crit, total, edges)
    return best


# ----------------------------------------------------------------------- checking
def validate_tree(tree: Tree, n: int | None = None, *, max_depth: int | None = None) -> None:
    """Raise ArgumentError (a ValueError) unless `tree` reaches every device exactly once,
    in valid steps.

    Checks: parents in range and acyclic with every device leading to the root; each
    non-root device sends exactly once; levels agree with `parent`; no device is in two
    edges of one level; a device sends only after all its children sent to it; depth at
    most `max_depth` when given.
    """
    n = tree.n if n is None else n
    parent = list(tree.parent)
    if len(parent) != n:
        raise ArgumentError(f"tree rooted at {tree.root}: {len(parent)} parents for {n} devices")
    if not 0 <= tree.root < n or parent[tree.root] != -1:
        raise ArgumentError(f"tree root {tree.root}: must be a device with parent -1")
    for node, p in enumerate(parent):
        if node != tree.root and not (0 <= p < n and p != node):
            raise ArgumentError(f"tree rooted at {tree.root}: device {node} has parent {p}")
        seen, cur = set(), node
        while cur != tree.root:
            if cur in seen:
                raise ArgumentError(f"tree rooted at {tree.root}: cycle through device {node}")
            seen.add(cur)
            cur = parent[cur]
    sent_at: dict = {}
    for step, level in enumerate(tree.levels):
        busy: set = set()
        for child, par in level:
            if parent[child] != par:
                raise ArgumentError(f"edge ({child}, {par}) at step {step}: parent of {child} "
                                    f"is {parent[child]}")
            if child in sent_at:
                raise ArgumentError(f"device {child} sends twice (steps {sent_at[child]}, {step})")
            if child in busy or par in busy:
                raise ArgumentError(f"step {step}: a device is in two edges")
            busy.update((child, par))
            sent_at[child] = step
    missing = [i for i in range(n) if i != tree.root and i not in sent_at]
    if missing:
        raise ArgumentError(f"tree rooted at {tree.root}: devices {missing} never send")
    for child, step in sent_at.items():
        par = parent[child]
        if par != tree.root and sent_at[par] <= step:
            raise ArgumentError(f"device {par} sends at step {sent_at[par]} before its child "
                                f"{child} (step {step})")
    if max_depth is not None and tree.depth > max_depth:
        raise ArgumentError(f"tree rooted at {tree.root}: depth {tree.depth} > {max_depth}")


def is_valid_tree(tree: Tree, n: int | None = None, *, max_depth: int | None = None) -> bool:
    """Whether `validate_tree` accepts `tree`."""
    try:
        validate_tree(tree, n, max_depth=max_depth)
    except ValueError:
        return False
    return True


def link_usage(trees, n: int | None = None) -> np.ndarray:
    """Symmetric n x n counts of how many of `trees` use each (undirected) link."""
    trees = list(trees)
    n = trees[0].n if n is None else n
    use = np.zeros((n, n), dtype=np.int64)
    for tree in trees:
        for c, p in tree.edges():
            use[c, p] += 1
            use[p, c] += 1
    return use


def usage_summary(trees, matrix) -> dict:
    """How evenly `trees` load the links of `matrix`.

    Keys: ``links`` (direct links in the matrix), ``used`` (direct links used by some
    tree), ``min``/``max`` (uses of the least/most used link among the used ones),
    ``ratio`` (max/min), ``staged_edges`` (tree edges without a direct link), and
    ``by_weight`` (total uses per link weight).
    """
    w = as_link_matrix(matrix)
    use = link_usage(trees, w.shape[0])
    iu = np.triu_indices(w.shape[0], 1)
    direct = w[iu] > 0
    counts = use[iu]
    used = counts[direct & (counts > 0)]
    by_weight: dict = {}
    for weight, count in zip(w[iu], counts):
        if count:
            by_weight[float(weight)] = by_weight.get(float(weight), 0) + int(count)
    return {
        "links": int(direct.sum()),
        "used": int(used.size),
        "min": int(used.min()) if used.size else 0,
        "max": int(used.max()) if used.size else 0,
        "ratio": float(used.max() / used.min()) if used.size else 1.0,
        "staged_edges": int(counts[~direct].sum()),
        "by_weight": dict(sorted(by_weight.items())),
    }


def slice_plan(nelems: int, n_trees: int, home: int, *, array_bound: int | None = None,
               roots=None) -> list:
    """How to run one key over the per-root trees: [(root, start, stop), ...].

    With `roots` (e.g. from `slice_roots`), the key is cut into ``len(roots)`` contiguous
    slices (the first ones one element longer when it does not divide; empty ones
    dropped), one per root in ascending root order: slice i travels on the tree rooted
    at the i-th root. Otherwise MXNet's fixed rule (``MXNET_KVSTORE_TREE_ARRAY_BOUND``):
    a key of at most `array_bound` elements travels whole on the tree rooted at its home
    device, a bigger one is cut over all `n_trees` trees, so all links carry data at once.
    `array_bound` defaults to `tree_options()`'s, else `MXNET_ARRAY_BOUND`.
    """
    if n_trees < 1 or not 0 <= home < n_trees:
        raise ArgumentError(f"slice_plan: home {home} outside 0..{n_trees - 1}")
    if roots is not None:
        roots = sorted({int(r) for r in roots})
        if not roots or not all(0 <= r < n_trees for r in roots):
            raise ArgumentError(f"slice_plan: roots {roots} must be non-empty, within "
                                f"0..{n_trees - 1}")
        if nelems == 0:
            return [(home, 0, 0)]
    else:
        bound = (tree_options("array_bound")["array_bound"] if array_bound is None
                 else array_bound)
        bound = MXNET_ARRAY_BOUND if bound is None else bound
        if nelems <= bound or n_trees == 1:
            return [(home, 0, nelems)]
        roots = list(range(n_trees))
    if roots == [home]:
        return [(home, 0, nelems)]
    base, extra = divmod(nelems, len(roots))
    out, start = [], 0
    for i, root in enumerate(roots):
        stop = start + base + (1 if i < extra else 0)
        if stop > start:
            out.append((root, start, stop))
        start = stop
    return out


def slice_roots(matrix, home: int, count: int) -> list:
    """The `count` trees (by root) a key homed on `home` is sliced over, ascending.

    The home's own tree first, then the trees rooted at the devices with the fastest
    links to the home (ties: lower device first): slices reduced on another root are
    gathered on the home (and scattered from it for the broadcast) over those links.
    """
    w = as_link_matrix(matrix)
    n = w.shape[0]
    if not 0 <= home < n:
        raise ArgumentError(f"slice_roots: home {home} outside 0..{n - 1}")
    if not 1 <= count <= n:
        raise ArgumentError(f"slice_roots: count {count}: expected 1..{n}")
    others = sorted((j for j in range(n) if j != home), key=lambda j: (-w[home, j], j))
    return sorted([home] + others[:count - 1])


# ---------------------------------------------------------------------------- rings
def plan_ring(matrix) -> list:
    """A ring (device order, starting at 0) maximising its slowest link, then the total.

    Exact for up to 8 devices (every ring is tried); beyond, a greedy ring improved by
    2-opt moves. Pairs without a link count as staged edges, so there is always a ring.
    """
    eff = effective_weights(matrix)
    n = eff.shape[0]
    if n <= 3:
        return list(range(n))
    if n <= _RING_EXACT_LIMIT:
        return _ring_exact(eff)
    return _ring_heuristic(eff)


def ring_bottleneck(matrix, ring) -> float:
    """The weight of the slowest link of `ring` in `matrix` (0 when one is staged)."""
    w = as_link_matrix(matrix)
    if len(ring) < 2:
        return math.inf
    return float(min(w[a, b] for a, b in zip(ring, ring[1:] + ring[:1])))


def _ring_value(eff, ring) -> tuple:
    weights = [eff[a, b] for a, b in zip(ring, ring[1:] + ring[:1])]
    return (min(weights), sum(weights))


def _ring_exact(eff) -> list:
    n = eff.shape[0]
    perms = np.array(list(itertools.permutations(range(1, n))), dtype=np.intp)
    rings = np.concatenate([np.zeros((len(perms), 1), dtype=np.intp), perms], axis=1)
    hops = eff[rings, np.roll(rings, -1, axis=1)]
    low, total = hops.min(axis=1), hops.sum(axis=1)
    order = np.lexsort((-total, -low))  # best bottleneck, then best total; stable
    return [int(x) for x in rings[order[0]]]


def _ring_heuristic(eff) -> list:
    n = eff.shape[0]
    best = None
    for start in range(n):
        ring, left = [start], set(range(n)) - {start}
        while left:
            ring.append(max(sorted(left), key=lambda j: eff[ring[-1], j]))
            left.remove(ring[-1])
        ring = _two_opt(eff, ring)
        value = _ring_value(eff, ring)
        if best is None or value > best[0]:
            best = (value, ring)
    assert best is not None  # n >= 1: the loop ran
    ring = best[1]
    zero = ring.index(0)
    return ring[zero:] + ring[:zero]


def _two_opt(eff, ring) -> list:
    n = len(ring)
    value = _ring_value(eff, ring)
    improved = True
    while improved:
        improved = False
        for i in range(1, n - 1):
            for j in range(i + 1, n):
                trial = ring[:i] + ring[i:j + 1][::-1] + ring[j + 1:]
                tv = _ring_value(eff, trial)
                if tv[0] > value[0] + 1e-12 or (tv[0] >= value[0] - 1e-12
                                                and tv[1] > value[1] + 1e-12):
                    ring, value, improved = trial, tv, True
    return ring

"""Topology-aware tree reduction over peer links (MXNet's `comm_tree`).

The devices of a key get one binary tree per root (`topology.plan_trees` on the link
matrix from CUDA's P2P attributes, with MXNet's link-usage penalty). A key travels whole
on the tree rooted at its home, or is cut into slices over several trees, each slice
reduced up the tree rooted at its own root (a reduce-scatter) and then gathered on the
home; the broadcast scatters the slices to the roots and sends each down its tree (an
all-gather). Every tree level is one fused kernel per parent for all keys and slices of
the call, reading the children's partial sums through peer access.

Whether and how finely a key is sliced is `simulate.tree_slice_plan`'s decision, the one
the simulator's 'tree' prediction (and so the 'auto' strategy) uses. Precedence: the
`array_bound=` option, else ``GPUKV_TREE_ARRAY_BOUND``, else
``MXNET_KVSTORE_TREE_ARRAY_BOUND`` (MXNet's fixed rule: whole up to that many elements,
sliced over every tree above); with none set, the cost model picks the number of slices
with the lowest predicted time, never slicing below `simulate.MIN_SLICE_BYTES` per slice.
On GPUs whose link matrix is read from CUDA, that model is `simulate.calibrated_machine`
with `simulate.calibrated_costs` (this machine's measured constants when
`python -m gpukv bench --calibrate` wrote a usable calibration file), as for 'auto'.
"""
from __future__ import annotations

import numbers

from .._errors import ArgumentError, ArgumentKindError
from ..device.base import Term
from . import ordering
from ._base import BroadcastJob, ReduceJob, Strategy
from .flat import FlatOut, flat_in
from .home import HomeStrategy
from .jobs import group_jobs, is_uniform_job, node_order, split_plain_broadcasts
from .plan import links


class _Plan:
    """The nodes of a group of keys, their trees, and the cost model's machine."""

    def __init__(self, nodes, matrix, machine=None, calibrated: bool = False):
        from .plan import topology
        self.nodes = nodes
        self.index = {d: i for i, d in enumerate(nodes)}
        self.matrix = matrix
        self.trees = topology.plan_trees(matrix)
        self._machine = machine
        self.calibrated = calibrated  # model the measured GPUs with the calibration
        self.slices: dict = {}  # (elements, itemsize, home index, bound) -> slice plan

    @property
    def machine(self):
        """The machine the slicing decision is modelled on (default: the generic profile
        of the link matrix, calibrated when the matrix is this machine's GPUs')."""
        if self._machine is None:
            from .plan import simulate
            self._machine = (simulate.calibrated_machine(self.matrix) if self.calibrated
                             else simulate.machine(self.matrix))
        return self._machine

    @property
    def costs(self):
        """The model's constants: calibrated ones for this machine's GPUs, else defaults."""
        from .plan import simulate
        return simulate.calibrated_costs() if self.calibrated else simulate.COSTS


def _positive_int_or_none(option: str, value):
    """`value` when None or a positive int; else a typed error naming the option (a bad
    bound would otherwise fail in the middle of a push)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentKindError(f"tree option {option}={value!r}: expected a positive int, "
                                f"got {type(value).__name__}")
    if value < 1:
        raise ArgumentError(f"tree option {option}={value!r}: expected a positive int")
    return int(value)


class TreeStrategy(Strategy):
    """Binary trees over the link topology; large keys sliced across one tree per root.

    `matrix`: a link matrix (or a callable `nodes -> matrix`) used instead of the one
    read from CUDA, e.g. to run a DGX-1 plan on host devices in tests. `array_bound`:
    elements above which a key is sliced over every tree, MXNet's fixed rule (default:
    `topology.tree_options()`'s; None there too: the cost model decides per key, see
    `simulate.tree_slice_plan`). `machine`: the `simulate` machine (a `Machine`, profile
    name, or callable `nodes -> Machine`) the decision is modelled on; by default the
    generic profile of the link matrix (for GPUs with neither `matrix` nor `machine`
    given: `simulate.calibrated_machine`, this machine's measured speeds when calibrated);
    when given without `matrix`, its first devices' matrix is also the one planned on.
    `costs` and `min_slice_bytes`: the model's constants and smallest slice (default
    `simulate.calibrated_costs()` for this machine's GPUs, else `simulate.COSTS`, and
    `simulate.MIN_SLICE_BYTES`).
    """

    name = "tree"
    store_options = ("matrix", "array_bound", "machine", "costs", "min_slice_bytes")

    def __init__(self, matrix=None, array_bound: int | None = None, *, machine=None,
                 costs=None, min_slice_bytes: int | None = None):
        self._matrix = matrix
        self._bound = _positive_int_or_none("array_bound", array_bound)
        self._machine = machine
        self._costs = costs
        self._min_slice = _positive_int_or_none("min_slice_bytes", min_slice_bytes)
        self._plans: dict = {}
        self._fallback = HomeStrategy()
        # the variables it reads on its first plan, refused now if malformed (the bound's
        # only when it is not given)
        from .plan import topology
        topology.tree_options("penalty", "backtrack",
                              *(["array_bound"] if self._bound is None else []))

    # --------------------------------------------------------------- planning
    def _plan(self, nodes) -> _Plan:
        key = tuple(nodes)
        plan = self._plans.get(key)
        if plan is None:
            model = None
            if self._machine is not None:
                from .plan import simulate
                spec = self._machine(nodes) if callable(self._machine) else self._machine
                model = simulate.machine(spec, len(nodes))
            if self._matrix is None and model is not None:
                matrix = model.matrix
            else:
                matrix = links.link_matrix_for(nodes, self._matrix)
            measured = (model is None and self._matrix is None
                        and links.measured_links(nodes))
            plan = self._plans[key] = _Plan(list(nodes), matrix, model, calibrated=measured)
        return plan

    def _bound_now(self) -> int | None:
        from .plan import topology
        if self._bound is not None:
            return self._bound
        return topology.tree_options("array_bound")["array_bound"]

    def _groups(self, jobs):
        """Jobs by their node set; jobs the tree cannot take go to the fallback list."""
        def nodes_of(job):
            devices = job.devices
            nodes = sorted(ordering.unique(list(devices) + [job.home]), key=node_order)
            ok = (len(nodes) >= 2 and len(set(devices)) == len(devices)
                  and is_uniform_job(devices, job.home))
            return tuple(nodes) if ok else None

        return group_jobs(jobs, nodes_of)

    def _segments(self, plan, job, size, itemsize):
        """[(root index, start, stop)]: how this key is cut over the plan's trees."""
        home = plan.index[job.home]
        bound = self._bound_now()
        key = (size, itemsize, home, bound)
        segments = plan.slices.get(key)
        if segments is None:
            from .plan import simulate
            costs = self._costs if self._costs is not None else plan.costs
            segments = simulate.tree_slice_plan(
                size, plan.machine, home, itemsize=itemsize, array_bound=bound,
                min_slice_bytes=self._min_slice, costs=costs)
            if len(plan.slices) > 4096:
                plan.slices.clear()
            plan.slices[key] = segments
        return segments

    # ----------------------------------------------------------------- reduce
    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many([job])

    def reduce_many(self, jobs: list) -> None:
        groups, fallback = self._groups(jobs)
        self._fallback.reduce_many(fallback)
        for nodes, group in groups.items():
            self._reduce_group(self._plan(nodes), group)

    def _reduce_group(self, plan: _Plan, jobs) -> None:
        nodes = plan.nodes
        ordering.begin(nodes)
        outs: list = []
        by_root: dict = {}
        for job in jobs:
            home = job.home
            out = FlatOut(job.out, home)
            outs.append(out)
            sources = {plan.index[d]: flat_in(s, d)
                       for s, d in zip(job.sources, job.devices)}
            h = plan.index[home]
            for root, start, stop in self._segments(plan, job, out.flat.size,
                                                    out.flat.dtype.itemsize):
                by_root.setdefault(root, []).append((h, out.flat, sources, start, stop))
        gathers: dict = {}  # home index -> [(out slice, final partial)], roots
        # Partial-sum buffers live until `finish`: CuPy's pool hands a freed block to the
        # next allocation on its stream, which is not ordered after the other GPUs' reads.
        keep: list = []
        for root, segs in by_root.items():
            finals = self._reduce_tree(plan, plan.trees[root], segs, keep)
            for (h, out, _, start, stop), final in zip(segs, finals):
                if root != h:
                    gathers.setdefault(h, ([], set()))
                    gathers[h][0].append((out[start:stop], final))
                    gathers[h][1].add(root)
        for h, (pairs, roots) in gathers.items():
            home = nodes[h]
            ordering.wait_all(home, [nodes[r] for r in roots])
            home.copy_many(pairs)
        for out in outs:
            out.done()
        homes = ordering.unique([job.home for job in jobs])
        for home in homes:
            ordering.finish(nodes, home)

    def _reduce_tree(self, plan: _Plan, tree, segs, keep: list) -> list:
        """Reduce every segment up `tree`; the final partial of each (on the root).

        The buffers it allocates are appended to `keep` (the caller frees them after
        every device is ordered after their readers)."""
        nodes = plan.nodes
        root = tree.root
        # partial[s][node]: Term of segment s's running sum on node (None: nothing yet)
        partial = []
        for h, out, sources, start, stop in segs:
            partial.append({i: Term(src[start:stop], False) for i, src in sources.items()})
        owned: list[dict] = [{} for _ in segs]  # node -> buffer this call allocated for segment s
        for level in tree.levels:
            children_of: dict = {}
            for child, parent in level:
                if child != parent:
                    children_of.setdefault(parent, []).append(child)
            for parent, children in children_of.items():
                device = nodes[parent]
                ordering.wait_all(device, [nodes[c] for c in children])
                work = []
                for s, (h, out, sources, start, stop) in enumerate(segs):
                    terms = [partial[s].get(i) for i in [parent] + children]
                    terms = [t for t in terms if t is not None]
                    if not terms:
                        continue
                    target = owned[s].get(parent)
                    if target is None:
                        if parent == root and root == h:
                            target = out[start:stop]
                        else:
                            target = device.empty(stop - start, out.dtype)
                            keep.append(target)
                        owned[s][parent] = target
                    work.append((target, terms))
                    partial[s][parent] = Term(target, True)
                device.sum_into(work)
        finals = []
        for s, (h, out, sources, start, stop) in enumerate(segs):
            final = partial[s].get(root)
            if root == h and owned[s].get(root) is None:
                # The root never received anything (cannot happen with >= 2 nodes).
                nodes[root].sum_into([(out[start:stop], [final] if final else [])])
                final = Term(out[start:stop], True)
            assert final is not None  # every root summed into its slice at least once
            finals.append(final.array)
        return finals

    # -------------------------------------------------------------- broadcast
    def broadcast(self, job: BroadcastJob) -> None:
        self.broadcast_many([job])

    def broadcast_many(self, jobs: list) -> None:
        simple, other = split_plain_broadcasts(jobs)
        groups, fallback = self._groups(simple)
        self._fallback.broadcast_many(fallback + other)
        for nodes, group in groups.items():
            self._broadcast_group(self._plan(nodes), group)

    def _broadcast_group(self, plan: _Plan, jobs) -> None:
        nodes = plan.nodes
        ordering.begin(nodes)
        by_root: dict = {}
        home_copies: dict = {}
        for job in jobs:
            h = plan.index[job.home]
            src = job.src.reshape(-1)
            value = {plan.index[d]: o.reshape(-1) for o, d in zip(job.outs, job.devices)}
            if h in value:  # the home's own out: a local copy at the end
                home_copies.setdefault(h, []).append((value[h], src))
            value[h] = src
            for root, start, stop in self._segments(plan, job, src.size, src.dtype.itemsize):
                by_root.setdefault(root, []).append((h, value, start, stop))
        for root, segs in by_root.items():
            scatter = [(v[root][a:b], v[h][a:b]) for h, v, a, b in segs if root != h]
            if scatter:
                device = nodes[root]
                ordering.wait_all(device, [nodes[h] for h, _, _, _ in segs if h != root])
                device.copy_many(scatter)
            for level in plan.trees[root].broadcast_levels():
                by_dst: dict = {}
                for src_node, dst_node in level:
                    by_dst.setdefault(dst_node, set()).add(src_node)
                for dst, srcs in by_dst.items():
                    device = nodes[dst]
                    ordering.wait_all(device, [nodes[i] for i in srcs])
                    pairs = []
                    for h, v, a, b in segs:
                        for src_node, dst_node in level:
                            if dst_node == dst and dst != h:
                                pairs.append((v[dst][a:b], v[src_node][a:b]))
                    device.copy_many(pairs)
        for h, pairs in home_copies.items():
            nodes[h].copy_many(pairs)
        for home in ordering.unique([job.home for job in jobs]):
            ordering.finish(nodes, home)

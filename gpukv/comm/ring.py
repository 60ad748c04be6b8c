"""Ring reduction: chunked reduce-scatter, then the chunks gathered (or all-gathered).

The k devices of a key form a ring (`topology.plan_ring`, the order whose slowest link
is fastest). Each key is cut into k chunks. Reduce-scatter: in step s (0..k-2) device
j adds its own chunk (j-1-s) mod k to the running sum of that chunk it reads from its
ring predecessor, so after k-1 steps device j holds the complete chunk (j+1) mod k,
which it hands to the home. Every device reads one chunk per step from one neighbour,
so all links carry 1/k of the data at once. The broadcast scatters chunk j from the
home to ring position j and passes the chunks around the ring (an all-gather) straight
into the `out` arrays. Each step is one fused kernel per device for all keys.
"""
from __future__ import annotations

from ..device.base import Term
from . import ordering
from ._base import BroadcastJob, ReduceJob, Strategy
from .flat import FlatOut, flat_in
from .home import HomeStrategy
from .jobs import group_jobs, is_uniform_job, node_order, split_plain_broadcasts
from .plan import links


def chunk_bounds(n: int, k: int) -> list:
    """[start, stop) of the k chunks of n elements (the first n % k one longer)."""
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reduce_schedule(k: int) -> list:
    """Step s of the reduce-scatter: [(position j, chunk c, predecessor j-1)], s < k-1."""
    return [[(j, (j - 1 - s) % k, (j - 1) % k) for j in range(k)] for s in range(k - 1)]


def gather_schedule(k: int) -> list:
    """Step s (1..k-1) of the all-gather: [(position j, chunk c, predecessor)]."""
    return [[(j, (j - s) % k, (j - 1) % k) for j in range(k)] for s in range(1, k)]


def _ring_nodes(job):
    """The sorted devices of `job` when the ring can take it (one source per device,
    at least two, all host or all GPU), else None."""
    devices = list(job.devices)
    nodes = sorted(ordering.unique(devices), key=node_order)
    ok = (len(nodes) >= 2 and len(nodes) == len(devices)
          and is_uniform_job(devices, job.home))
    return tuple(nodes) if ok else None


class RingStrategy(Strategy):
    """Chunked ring reduce-scatter / all-gather over peer copies.

    `matrix`: a link matrix or callable `nodes -> matrix` replacing the CUDA one (tests).
    """

    name = "ring"
    store_options = ("matrix",)

    def __init__(self, matrix=None):
        self._matrix = matrix
        self._rings: dict = {}
        self._fallback = HomeStrategy()

    def _ring(self, nodes) -> list:
        """The ring order of `nodes` (a list of devices)."""
        key = tuple(nodes)
        ring = self._rings.get(key)
        if ring is None:
            from .plan import topology
            matrix = links.link_matrix_for(nodes, self._matrix)
            order = topology.plan_ring(matrix) if len(nodes) > 1 else [0]
            ring = self._rings[key] = [nodes[i] for i in order]
        return ring

    def _groups(self, jobs):
        return group_jobs(jobs, _ring_nodes)

    # ----------------------------------------------------------------- reduce
    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many([job])

    def reduce_many(self, jobs: list) -> None:
        groups, fallback = self._groups(jobs)
        self._fallback.reduce_many(fallback)
        for nodes, group in groups.items():
            self._reduce_group(self._ring(list(nodes)), group)

    def _reduce_group(self, ring: list, jobs) -> None:
        k = len(ring)
        position = {d: j for j, d in enumerate(ring)}
        homes = ordering.unique([job.home for job in jobs])
        ordering.begin(ring + homes)
        work = []  # (out FlatOut, sources by position, chunk bounds, partial buffers)
        for job in jobs:
            out = FlatOut(job.out, job.home)
            src = [None] * k
            for s, d in zip(job.sources, job.devices):
                src[position[d]] = flat_in(s, d)
            bounds = chunk_bounds(out.flat.size, k)
            acc: list = [None] * k  # acc[j]: device j's running sums (a buffer of the out's size)
            work.append((job, out, src, bounds, acc))
        for s, step in enumerate(reduce_schedule(k)):
            marks = [d.record() for d in ring]  # what each device had done before the step
            for j, c, pred in step:
                device = ring[j]
                device.wait_event(marks[pred])
                items = []
                for job, out, src, bounds, acc in work:
                    a, b = bounds[c]
                    if b == a:
                        continue
                    if acc[j] is None:
                        acc[j] = (out.flat if device == job.home
                                  else device.empty(out.flat.size, out.flat.dtype))
                    terms = [] if src[j] is None else [Term(src[j][a:b], False)]
                    if s == 0:
                        if src[pred] is not None:
                            terms.append(Term(src[pred][a:b], False))
                    else:
                        terms.append(Term(acc[pred][a:b], True))
                    items.append((acc[j][a:b], terms))
                device.sum_into(items)
        # Device j now holds the complete chunk (j+1) % k; the home gathers them.
        for home in homes:
            ordering.wait_all(home, ring)
            pairs = []
            for job, out, src, bounds, acc in work:
                if job.home != home:
                    continue
                for j in range(k):
                    c = (j + 1) % k
                    a, b = bounds[c]
                    if b > a and ring[j] != home:
                        pairs.append((out.flat[a:b], acc[j][a:b]))
            home.copy_many(pairs)
        for job, out, src, bounds, acc in work:
            out.done()
        for home in homes:
            ordering.finish(ring, home)

    # -------------------------------------------------------------- broadcast
    def broadcast(self, job: BroadcastJob) -> None:
        self.broadcast_many([job])

    def broadcast_many(self, jobs: list) -> None:
        simple, other = split_plain_broadcasts(jobs)
        groups, fallback = self._groups(simple)
        self._fallback.broadcast_many(fallback + other)
        for nodes, group in groups.items():
            self._broadcast_group(self._ring(list(nodes)), group)

    def _broadcast_group(self, ring: list, jobs) -> None:
        k = len(ring)
        position = {d: j for j, d in enumerate(ring)}
        homes = ordering.unique([job.home for job in jobs])
        ordering.begin(ring + homes)
        work = []
        for job in jobs:
            outs: list = [None] * k
            for o, d in zip(job.outs, job.devices):
                outs[position[d]] = o.reshape(-1)
            work.append((job, job.src.reshape(-1), outs, chunk_bounds(job.src.size, k)))
        for j, device in enumerate(ring):  # scatter: chunk j to ring position j
            ordering.wait_all(device, homes)
            device.copy_many([(outs[j][a:b], src[a:b])
                              for job, src, outs, bounds in work
                              for a, b in [bounds[j]] if b > a])
        for step in gather_schedule(k):
            marks = [d.record() for d in ring]
            for j, c, pred in step:
                device = ring[j]
                device.wait_event(marks[pred])
                device.copy_many([(outs[j][a:b], outs[pred][a:b])
                                  for job, src, outs, bounds in work
                                  for a, b in [bounds[c]] if b > a])
        for home in homes:
            ordering.finish(ring, home)

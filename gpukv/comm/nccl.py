"""NCCL collectives among the GPUs of this process.

One communicator per set of physical GPUs (`NcclCommunicator.initAll`), built on first
use. A list push issues every key's `reduce` (and a pull every key's `bcast`) inside
one `groupStart()`/`groupEnd()`, so NCCL runs them as one grouped operation. Virtual
GPUs sharing a physical one are first summed locally (NCCL takes one rank per GPU);
16-bit floats are summed in float32 (a narrow NCCL sum would overflow). Jobs on the
host, or on a single physical GPU, need no NCCL and run the 'home' algorithm.
"""
from __future__ import annotations

from ..device import nccl as _nccl
from ..device.base import Term
from ..device.nccl import INSTALL_HINT, nccl_available, nccl_dtype, nccl_module
from . import ordering
from ._base import BroadcastJob, ReduceJob, Strategy
from .flat import FlatOut, flat_in
from .home import HomeStrategy

__all__ = ["NcclStrategy", "INSTALL_HINT", "nccl_available", "nccl_dtype", "nccl_module"]


class NcclStrategy(Strategy):
    """Grouped NCCL reduce/broadcast, one rank per physical GPU of the job."""

    name = "nccl"

    def __init__(self):
        self._comms: dict = {}
        self._home = HomeStrategy()

    def _communicators(self, nccl, physical: tuple) -> list:
        comms = self._comms.get(physical)
        if comms is None:
            comms = self._comms[physical] = _nccl.communicators(nccl, physical)
        return comms

    def _split(self, jobs, outs_of, dtype_of):
        """(NCCL jobs, other jobs); raises BackendError if NCCL is needed but missing."""
        mine, other = [], []
        nccl = None
        for job in jobs:
            devices = list(job.devices) + [job.home]
            multi = (all(d.supports_nccl for d in devices)
                     and len({d.physical for d in devices}) > 1)
            if not multi:
                other.append(job)
                continue
            if nccl is None:
                nccl = nccl_module()
            ok = nccl_dtype(nccl, dtype_of(job)) is not None and all(
                o.flags.c_contiguous for o in outs_of(job))
            (mine if ok else other).append(job)
        return nccl, mine, other

    # ----------------------------------------------------------------- reduce
    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many([job])

    def reduce_many(self, jobs: list) -> None:
        nccl, mine, other = self._split(jobs, lambda j: [j.out], lambda j: j.out.dtype)
        # One value has nothing to sum: the home copies its bits (NCCL's 0 + -0.0 is +0.0)
        other += [j for j in mine if len(j.sources) == 1]
        mine = [j for j in mine if len(j.sources) != 1]
        self._home.reduce_many(other)
        if not mine:
            return
        ranks, everyone = _begin(mine)
        calls, outs = [], []
        alive = []  # flat copies of strided sources: freed only after `finish`
        for job in mine:
            home = job.home
            out = FlatOut(job.out, home)
            outs.append(out)
            by_gpu, physical, root = _by_gpu(
                ((flat_in(s, d), d) for s, d in zip(job.sources, job.devices)), home)
            alive.append(by_gpu)
            for rank, p in enumerate(physical):
                local = by_gpu[p]
                if p == home.physical:  # the root reduces in place into the out
                    leader, buf = home, out.flat
                    ordering.wait_all(home, [d for _, d in local])
                    home.sum_into([(buf, [Term(a, False) for a, _ in local])])
                elif len(local) == 1 and local[0][0].dtype == out.flat.dtype:
                    leader, buf = local[0][1], local[0][0]
                else:  # virtual GPUs on one GPU, or 16-bit floats: a local fp32 sum first
                    leader = local[0][1]
                    buf = leader.empty(out.flat.size, out.flat.dtype)
                    ordering.wait_all(leader, [d for _, d in local])
                    leader.sum_into([(buf, [Term(a, False) for a, _ in local])])
                calls.append((physical, rank, leader, buf, out.flat, root))
        # One stream per GPU for the grouped call: its slot-0 device's (CuPy's current).
        for physical, rank, leader, buf, out, root in calls:
            ordering.wait_all(ranks[physical[rank]], [leader])
        # Communicators are made before the group: one created inside it is initialised
        # only at groupEnd, too late for the collectives queued on it in the same group.
        comms = [self._communicators(nccl, c[0])[c[1]] for c in calls]
        with _nccl.group(nccl):
            for comm, (physical, rank, leader, buf, out, root) in zip(comms, calls):
                recv = out if rank == root else buf
                _nccl.reduce(nccl, comm, ranks[physical[rank]], buf, recv, root)
        for job in mine:
            ordering.wait_all(job.home, [ranks[job.home.physical]])
        for out in outs:
            out.done()
        for home in ordering.unique([j.home for j in mine]):
            ordering.finish(everyone, home)

    # -------------------------------------------------------------- broadcast
    def broadcast(self, job: BroadcastJob) -> None:
        self.broadcast_many([job])

    def broadcast_many(self, jobs: list) -> None:
        simple = [j for j in jobs if j.src.flags.c_contiguous
                  and all(o.dtype == j.src.dtype for o in j.outs)]
        rest = [j for j in jobs if not any(j is x for x in simple)]
        nccl, mine, other = self._split(simple, lambda j: [j.src], lambda j: j.src.dtype)
        self._home.broadcast_many(other + rest)
        if not mine:
            return
        ranks, everyone = _begin(mine)
        calls, after = [], []
        for job in mine:
            home = job.home
            src = job.src.reshape(-1)
            by_gpu, physical, root = _by_gpu(zip(job.outs, job.devices), home)
            for rank, p in enumerate(physical):
                local = by_gpu[p]
                device = ranks[p]
                if p == home.physical:
                    buf = src
                    ordering.wait_all(device, [home])
                else:
                    first = next((o for o, _ in local if o.flags.c_contiguous), None)
                    buf = (device.empty(src.size, src.dtype) if first is None
                           else first.reshape(-1))
                    ordering.wait_all(device, [d for _, d in local])  # outs free to overwrite
                calls.append((physical, rank, device, buf, root))
                for o, d in local:
                    if o.reshape(-1) is not buf and not (
                            o.flags.c_contiguous and o.data.ptr == buf.data.ptr):
                        after.append((d, device, o, buf))
        comms = [self._communicators(nccl, c[0])[c[1]] for c in calls]
        with _nccl.group(nccl):
            for comm, (physical, rank, device, buf, root) in zip(comms, calls):
                _nccl.bcast(nccl, comm, device, buf, root)
        for device, rank_device, o, buf in after:  # more outs on a GPU: local copies
            ordering.wait_all(device, [rank_device])
            target = FlatOut(o, device)
            device.copy_many([(target.flat, buf)])
            target.done()
        for home in ordering.unique([j.home for j in mine]):
            ordering.finish(everyone, home)


def _begin(jobs):
    """(rank devices, every device of `jobs`), the latter ordered after the caller's work."""
    ranks = _rank_devices(jobs)
    everyone = ordering.unique([d for j in jobs for d in j.devices] + [j.home for j in jobs]
                               + list(ranks.values()))
    ordering.begin(everyone)
    return ranks, everyone


def _by_gpu(pairs, home):
    """(physical GPU -> [(array, device)], the GPUs sorted, the home's rank among them)
    for one job's `pairs`; the home's GPU is always a rank."""
    by_gpu: dict = {}
    for a, d in pairs:
        by_gpu.setdefault(d.physical, []).append((a, d))
    by_gpu.setdefault(home.physical, [])
    physical = tuple(sorted(by_gpu))
    return by_gpu, physical, physical.index(home.physical)


def _rank_devices(jobs) -> dict:
    """physical GPU -> the device whose stream carries its NCCL calls (slot 0)."""
    ranks = {}
    for j in jobs:
        for d in list(j.devices) + [j.home]:
            if d.physical not in ranks:
                ranks[d.physical] = d.primary
    return dict(sorted(ranks.items()))

"""NCCL collectives among the GPUs of this process.

One communicator per set of physical GPUs (`NcclCommunicator.initAll`), built on first
use. A list push issues every key's `reduce` (and a pull every key's `bcast`) inside
one `groupStart()`/`groupEnd()`, so NCCL runs them as one grouped operation. Virtual
GPUs sharing a physical one are first summed locally (NCCL takes one rank per GPU);
16-bit floats are summed in float32 (a narrow NCCL sum would overflow). Jobs on the
host, or on a single physical GPU, need no NCCL and run the 'home' algorithm.
"""
from __future__ import annotations

import warnings

import numpy as np

from .._errors import BackendError
from . import execute
from ._base import BroadcastJob, ReduceJob, Strategy
from .execute import FlatOut, Term
from .home import HomeStrategy

INSTALL_HINT = ("the 'nccl' strategy needs NCCL for CuPy: pip install 'nvidia-nccl-cu12>=2.18' "
                "(or nvidia-nccl-cu13 with cupy-cuda13x), or install CuPy from conda-forge, "
                "which brings NCCL")


def nccl_module():
    """`cupy.cuda.nccl`, loaded; a BackendError saying how to install NCCL otherwise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendError(f"NCCL is not available ({exc}); {INSTALL_HINT}") from exc
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise BackendError(f"NCCL is not available (libnccl could not be loaded); "
                           f"{INSTALL_HINT}")
    return nccl


def nccl_available() -> bool:
    try:
        nccl_module()
    except Exception:
        return False
    return True


_NCCL_TYPES = {"float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16",
               "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "int8": "NCCL_INT8",
               "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "int64": "NCCL_INT64"}


def nccl_dtype(nccl, dtype):
    """NCCL's code for `dtype`, or None when NCCL has none."""
    name = _NCCL_TYPES.get(np.dtype(dtype).name)
    return getattr(nccl, name, None) if name else None


class NcclStrategy(Strategy):
    """Grouped NCCL reduce/broadcast, one rank per physical GPU of the job."""

    name = "nccl"

    def __init__(self):
        self._comms: dict = {}
        self._home = HomeStrategy()

    def _communicators(self, nccl, physical: tuple) -> list:
        comms = self._comms.get(physical)
        if comms is None:
            comms = self._comms[physical] = nccl.NcclCommunicator.initAll(list(physical))
        return comms

    def _split(self, jobs, outs_of, dtype_of):
        """(NCCL jobs, other jobs); raises BackendError if NCCL is needed but missing."""
        mine, other = [], []
        nccl = None
        for job in jobs:
            devices = list(job.devices)
            multi = (execute.is_gpu_job(devices, job.home)
                     and len({d.physical for d in devices} | {job.home.physical}) > 1)
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
                ((execute.flat_in(s, d), d) for s, d in zip(job.sources, job.devices)), home)
            alive.append(by_gpu)
            for rank, p in enumerate(physical):
                local = by_gpu[p]
                if p == home.physical:  # the root reduces in place into the out
                    leader, buf = home, out.flat
                    execute.wait_all(home, [d for _, d in local])
                    execute.gather_sum(home, [(buf, [Term(a, False) for a, _ in local])])
                elif len(local) == 1 and local[0][0].dtype == out.flat.dtype:
                    leader, buf = local[0][1], local[0][0]
                else:  # virtual GPUs on one GPU, or 16-bit floats: a local fp32 sum first
                    leader = local[0][1]
                    buf = leader.empty(out.flat.size, out.flat.dtype)
                    execute.wait_all(leader, [d for _, d in local])
                    execute.gather_sum(leader, [(buf, [Term(a, False) for a, _ in local])])
                calls.append((physical, rank, leader, buf, out.flat, root))
        # One stream per GPU for the grouped call: its slot-0 device's (CuPy's current).
        for physical, rank, leader, buf, out, root in calls:
            execute.wait_all(ranks[physical[rank]], [leader])
        # Communicators are made before the group: one created inside it is initialised
        # only at groupEnd, too late for the collectives queued on it in the same group.
        comms = [self._communicators(nccl, c[0])[c[1]] for c in calls]
        nccl.groupStart()
        try:
            for comm, (physical, rank, leader, buf, out, root) in zip(comms, calls):
                device = ranks[physical[rank]]
                recv = out if rank == root else buf
                with device.cuda_device:
                    comm.reduce(buf.data.ptr, recv.data.ptr, out.size,
                                nccl_dtype(nccl, out.dtype), nccl.NCCL_SUM, root,
                                device.stream.ptr)
        finally:
            nccl.groupEnd()
        for job in mine:
            execute.wait_all(job.home, [ranks[job.home.physical]])
        for out in outs:
            out.done()
        for home in execute.unique([j.home for j in mine]):
            execute.finish(everyone, home)

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
                    execute.wait_all(device, [home])
                else:
                    first = next((o for o, _ in local if o.flags.c_contiguous), None)
                    buf = (device.empty(src.size, src.dtype) if first is None
                           else first.reshape(-1))
                    execute.wait_all(device, [d for _, d in local])  # outs free to overwrite
                calls.append((physical, rank, device, buf, root))
                for o, d in local:
                    if o.reshape(-1) is not buf and not (
                            o.flags.c_contiguous and o.data.ptr == buf.data.ptr):
                        after.append((d, device, o, buf))
        comms = [self._communicators(nccl, c[0])[c[1]] for c in calls]
        nccl.groupStart()
        try:
            for comm, (physical, rank, device, buf, root) in zip(comms, calls):
                with device.cuda_device:
                    comm.bcast(buf.data.ptr, buf.size, nccl_dtype(nccl, buf.dtype), root,
                               device.stream.ptr)
        finally:
            nccl.groupEnd()
        for device, rank_device, o, buf in after:  # more outs on a GPU: local copies
            execute.wait_all(device, [rank_device])
            target = FlatOut(o, device)
            execute.copy_many(device, [(target.flat, buf)])
            target.done()
        for home in execute.unique([j.home for j in mine]):
            execute.finish(everyone, home)


def _begin(jobs):
    """(rank devices, every device of `jobs`), the latter ordered after the caller's work."""
    ranks = _rank_devices(jobs)
    everyone = execute.unique([d for j in jobs for d in j.devices] + [j.home for j in jobs]
                           + list(ranks.values()))
    execute.begin(everyone)
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
    from ..device.cuda.device import cuda_device
    gpus = {d.physical for j in jobs for d in list(j.devices) + [j.home]}
    return {p: cuda_device(p, 0) for p in sorted(gpus)}

"""The 'cpu' strategy on GPUs: stage through pinned host memory and sum on the host.

This is MXNet's `local` store with GPU arrays: every GPU source is copied (async, on
its own device's stream) into page-locked host memory, the host sums them with the
blocked NumPy `host_sum`, and the result goes back to the home GPU with an async copy
from pinned memory. The host must wait for the device-to-host copies before summing;
that wait is this strategy's nature and the reason 'auto' rarely picks it.
"""
from __future__ import annotations

import numpy as np

from . import execute
from ._base import BroadcastJob, ReduceJob, Strategy
from .host import HostStrategy, host_sum


def _pinned(shape, dtype):
    from ..device.cuda.device import empty_pinned
    return empty_pinned(shape, dtype)


def _to_pinned(array, device):
    """Start an async copy of GPU `array` into pinned memory on `device`'s stream."""
    host = _pinned(array.shape, array.dtype)
    src = array if array.flags.c_contiguous else None
    with device.cuda_device, device.stream:
        if src is None:
            src = array.copy()
        src.get(stream=device.stream, out=host, blocking=False)
    return host


def _from_pinned(dst, host, device) -> None:
    """Async copy of pinned `host` into GPU `dst` on `device`'s stream (kept alive)."""
    from ..device.cuda.device import keep_alive
    with device.cuda_device:
        if dst.flags.c_contiguous and dst.dtype == host.dtype:
            dst.set(host, stream=device.stream)
        else:
            device.copy(dst, host)
    keep_alive(host, device.record())


def _release_finished_copies() -> None:
    """Pinned buffers of earlier calls whose copies have completed are let go now."""
    from ..device.cuda.device import release_done
    release_done()


class CpuStrategy(Strategy):
    """Through main memory: GPU sources copied to pinned buffers, summed by NumPy."""

    name = "cpu"

    def __init__(self):
        self._host = HostStrategy()

    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many([job])

    def broadcast(self, job: BroadcastJob) -> None:
        self.broadcast_many([job])

    def reduce_many(self, jobs: list) -> None:
        host_jobs, jobs = execute.split_host_jobs(jobs)
        self._host.reduce_many(host_jobs)
        if not jobs:
            return
        _release_finished_copies()
        execute.begin([d for j in jobs for d in j.devices] + [j.home for j in jobs])
        staged = []
        for job in jobs:  # every device-to-host copy is queued before the host waits
            staged.append([s if isinstance(s, np.ndarray) else _to_pinned(s, d)
                           for s, d in zip(job.sources, job.devices)])
        waited = set()
        for job in jobs:
            for d in job.devices:
                if execute.is_gpu(d) and d not in waited:
                    waited.add(d)
                    d.synchronize()
        for job, sources in zip(jobs, staged):
            if execute.is_gpu(job.home):
                result = _pinned(job.out.shape, job.out.dtype)
                host_sum(result, sources)
                _from_pinned(job.out, result, job.home)
            else:
                host_sum(job.out, sources)
        for home in execute.unique([j.home for j in jobs]):
            execute.finish([d for j in jobs if j.home == home for d in j.devices], home)

    def broadcast_many(self, jobs: list) -> None:
        host_jobs, jobs = execute.split_host_jobs(jobs)
        self._host.broadcast_many(host_jobs)
        if not jobs:
            return
        _release_finished_copies()
        execute.begin([d for j in jobs for d in j.devices] + [j.home for j in jobs])
        staged = [j.src if isinstance(j.src, np.ndarray) else _to_pinned(j.src, j.home)
                  for j in jobs]
        for home in execute.unique([j.home for j in jobs]):
            if execute.is_gpu(home):
                home.synchronize()
        for job, host in zip(jobs, staged):
            for out, device in zip(job.outs, job.devices):
                if isinstance(out, np.ndarray):
                    np.copyto(out, host, casting="unsafe")
                else:
                    _from_pinned(out, host, device)
        for home in execute.unique([j.home for j in jobs]):
            execute.finish([d for j in jobs if j.home == home for d in j.devices], home)

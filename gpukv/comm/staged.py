"""The 'cpu' strategy on GPUs: stage through pinned host memory and sum on the host.

This is MXNet's `local` store with GPU arrays: every GPU source is copied (async, on
its own device's stream) into page-locked host memory, the host sums them with the
blocked NumPy `host_sum`, and the result goes back to the home GPU with an async copy
from pinned memory. The host must wait for the device-to-host copies before summing;
that wait is this strategy's nature and the reason 'auto' rarely picks it.
"""
from __future__ import annotations

from ..device.host_sum import host_sum
from . import ordering
from ._base import BroadcastJob, ReduceJob, Strategy
from .host import HostStrategy
from .jobs import split_host_jobs


class StagedStrategy(Strategy):
    """Through main memory: GPU sources copied to pinned buffers, summed by NumPy."""

    name = "cpu"

    def __init__(self):
        self._host = HostStrategy()

    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many([job])

    def broadcast(self, job: BroadcastJob) -> None:
        self.broadcast_many([job])

    def reduce_many(self, jobs: list) -> None:
        host_jobs, jobs = split_host_jobs(jobs)
        self._host.reduce_many(host_jobs)
        if not jobs:
            return
        everyone = ordering.unique([d for j in jobs for d in j.devices] + [j.home for j in jobs])
        ordering.begin(everyone)
        # Every device-to-host copy is queued before the host waits for any.
        staged = [[d.to_host_async(s) for s, d in zip(job.sources, job.devices)]
                  for job in jobs]
        for d in ordering.unique([d for j in jobs for d in j.devices]):
            d.synchronize()
        for job, sources in zip(jobs, staged):
            home = job.home
            if home.host_memory:
                host_sum(job.out, sources)
            else:
                result = home.host_buffer(job.out.shape, job.out.dtype)
                host_sum(result, sources)
                home.from_host_async(job.out, result)
        for home in ordering.unique([j.home for j in jobs]):
            ordering.finish([d for j in jobs if j.home == home for d in j.devices], home)

    def broadcast_many(self, jobs: list) -> None:
        host_jobs, jobs = split_host_jobs(jobs)
        self._host.broadcast_many(host_jobs)
        if not jobs:
            return
        homes = ordering.unique([j.home for j in jobs])
        ordering.begin([d for j in jobs for d in j.devices] + homes)
        staged = [j.home.to_host_async(j.src) for j in jobs]
        for home in homes:
            home.synchronize()
        for job, host in zip(jobs, staged):
            for out, device in zip(job.outs, job.devices):
                device.from_host_async(out, host)
        for home in homes:
            ordering.finish([d for j in jobs if j.home == home for d in j.devices], home)

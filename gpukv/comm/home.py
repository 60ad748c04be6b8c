"""Reduction on the key's home device: one fused kernel reads every source in place.

The home GPU sums all sources of all keys homed there in one launch (pointer tables),
reading sources on other GPUs directly through peer access (enabled once per pair);
no full-size copy of a source is made. Sources it cannot read (no peer access, host
memory) are copied chunk by chunk through a staging buffer on the home GPU's stream.
The broadcast is the mirror image: every destination GPU copies all its keys with
one kernel reading the home GPUs' memory. Events order the devices; the host never
waits.
"""
from __future__ import annotations

from ..device.base import Term
from . import ordering
from ._base import BroadcastJob, ReduceJob, Strategy
from .flat import FlatOut, flat_in


class HomeStrategy(Strategy):
    """Sources meet on the home device; events order the copies, never a host sync."""

    name = "home"

    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many([job])

    def broadcast(self, job: BroadcastJob) -> None:
        self.broadcast_many([job])

    def reduce_many(self, jobs: list) -> None:
        reduce_at_homes(jobs, lambda home, work: home.sum_into(
            [(out, [Term(a, False) for a in arrays]) for out, arrays in work]))

    def broadcast_many(self, jobs: list) -> None:
        if not jobs:
            return
        by_device: dict = {}
        for job in jobs:
            for out, device in zip(job.outs, job.devices):
                by_device.setdefault(device, []).append((out, job))
        homes = ordering.unique([job.home for job in jobs])
        ordering.begin(list(by_device) + homes)
        alive = []  # flat copies of strided values, kept until `finish` (see reduce_many)
        for device, pairs in by_device.items():
            flat_pairs, outs = [], []
            for out, job in pairs:
                target = FlatOut(out, device)
                flat_pairs.append((target.flat, flat_in(job.src, job.home)))
                outs.append(target)
            alive.append(flat_pairs)
            ordering.wait_all(device, [job.home for _, job in pairs])
            device.copy_many(flat_pairs)
            for target in outs:
                target.done()
        for home in homes:  # the stored value may change only after every read of it
            ordering.finish([d for job in jobs if job.home == home for d in job.devices], home)


def reduce_at_homes(jobs, add, home_of=None) -> None:
    """Every job's sources summed into its out at its home, ordered by events:
    `add(home, work)` sums each home's keys (one launch for all of them), `work` being
    [(1-D out, [1-D sources])]; `home_of(job)` picks a job's home (default: job.home)."""
    if not jobs:
        return
    by_home: dict = {}
    for job in jobs:
        by_home.setdefault(job.home if home_of is None else home_of(job), []).append(job)
    everyone = [d for job in jobs for d in job.devices] + list(by_home)
    ordering.begin(everyone)
    # Flat copies of strided sources are made on their own devices first (the home
    # then waits for them) and kept until `finish`: CuPy's pool would hand a freed
    # copy to the next allocation on its stream while another home still reads it.
    alive = []
    for home, group in by_home.items():
        outs, work = [], []
        for job in group:
            out = FlatOut(job.out, home)
            work.append((out.flat, [flat_in(s, d) for s, d in zip(job.sources, job.devices)]))
            outs.append(out)
        ordering.wait_all(home, [d for job in group for d in job.devices])
        add(home, work)
        for out in outs:
            out.done()
        alive.append(work)
    for home, group in by_home.items():
        ordering.finish([d for job in group for d in job.devices], home)

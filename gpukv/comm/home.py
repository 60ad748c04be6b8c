"""Reduction on the key's home GPU: every source copied there and summed."""
from __future__ import annotations

from ._base import BroadcastJob, ReduceJob, Strategy


class HomeStrategy(Strategy):
    """Sources meet on the home device; events order the copies, never a host sync."""

    name = "home"

    def reduce(self, job: ReduceJob) -> None:
        home = job.home
        xp = home.xp
        with home.cuda_device, home.stream:
            for device in job.devices:
                home.wait_for(device)
            local = [home.to_local(s) for s in job.sources]
            xp.copyto(job.out, local[0], casting="unsafe")
            for s in local[1:]:
                xp.add(job.out, s, out=job.out)
        for device in job.devices:  # a source may be overwritten only after it was read
            device.wait_for(home)

    def broadcast(self, job: BroadcastJob) -> None:
        home = job.home
        for out, device in zip(job.outs, job.devices):
            device.wait_for(home)
            device.copy(out, job.src)
            home.wait_for(device)  # the stored value may change only after it was read

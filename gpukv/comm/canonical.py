"""The canonical order: every key summed in one fixed tree, whatever the strategy.

`Canonical(inner)` is the strategy a deterministic store runs: its reductions give every
job the tree sum of `gpukv.canonical` over the job's sources (leaf i = the i-th source),
in the accumulation dtype of the out (float32 for 16-bit floats), rounded once. The home
device sums all the sources of its keys with `tree_sum_into`, reading them where it can
and copying the others there whole first, so the result is the same bits for every
strategy, every placement of the sources (GPUs or host) and every home. Broadcasts are
copies, exact whatever the path, so they stay the inner strategy's.
"""
from __future__ import annotations

from ..device.host import host_device
from ..device.host_sum import host_tree_sum
from ._base import BroadcastJob, ReduceJob, Strategy
from .home import reduce_at_homes

__all__ = ["Canonical"]

_HOST = host_device(0)


class Canonical(Strategy):
    """The inner strategy's broadcasts, and every sum in the canonical tree order."""

    def __init__(self, inner: Strategy):
        self.inner = inner
        self.name = inner.name
        self.explicit = getattr(inner, "explicit", False)
        self.store_options = inner.store_options

    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many([job])

    def broadcast(self, job: BroadcastJob) -> None:
        self.inner.broadcast(job)

    def broadcast_many(self, jobs: list) -> None:
        self.inner.broadcast_many(jobs)

    def reduce_many(self, jobs) -> None:
        # Host slots share one memory: the host device sums for all of them.
        reduce_at_homes(list(jobs), lambda home, work: home.tree_sum_into(work),
                        lambda job: _HOST if job.home.host_memory else job.home)

    # The batch form of a host store's all-NumPy calls (see `HostStrategy`).
    def reduce_columns(self, outs, sources) -> None:
        """outs[i] = the canonical sum of the NumPy arrays sources[i], for every i."""
        for out, arrays in zip(outs, sources):
            host_tree_sum(out, arrays)

    def broadcast_columns(self, srcs, outs) -> None:
        """Every NumPy array of outs[i] = srcs[i], for every i (the inner strategy's)."""
        self.inner.broadcast_columns(srcs, outs)  # type: ignore[attr-defined]

    def __repr__(self):
        return f"<Canonical {self.inner!r}>"

"""What a step pushes to sum the replicas' gradients: the buckets it steps, less the part
the early reductions (`overlap.EarlyReduction`) already pushed."""
from __future__ import annotations

from ..store.base import KVStore
from .buckets import Bucket
from .overlap import EarlyReduction


class Reduction:
    """The gradient sums one step still has to start.

    `live`: the buckets the step updates. `early`: the Trainer's early reductions (None
    without overlap); `started` / `current`: the indices of the buckets whose early
    reduction started, and of those of them that reduced the gradients as they are now.
    """

    def __init__(self, buckets: list[Bucket], live: list[Bucket],
                 early: EarlyReduction | None = None,
                 started: frozenset[int] | set[int] = frozenset(),
                 current: frozenset[int] | set[int] = frozenset()) -> None:
        self.buckets = buckets
        self.live = live
        self._early = early
        self._started = started
        self._current = current

    @property
    def keys(self) -> list:
        """The keys of the live buckets."""
        return [b.key for b in self.live]

    def push(self, store: KVStore) -> None:
        """Push to `store` (the one the early reductions push to) every live bucket's
        gradients that no current early reduction has pushed."""
        if self._early is None:
            if self.live:
                store.push(self.keys, [b.grads for b in self.live])
            return
        alive = {id(b) for b in self.live}
        order = [i for i in self._early.order if id(self.buckets[i]) in alive]
        if store.num_workers == 1:
            rest = [self.buckets[i] for i in order if i not in self._current]
            if rest:
                store.push([b.key for b in rest], [b.grads for b in rest])
            return
        # Every process pushes every bucket once, in one order: the early reductions
        # did the start of it, this process's own share of which varies. Then a bucket
        # stale on any process is pushed again by all (sums of current gradients).
        stale = [int(i in self._started and i not in self._current)
                 for i in range(len(self.buckets))]
        again = store.workers_max(stale, "Trainer.step: the gradients to reduce again")
        for i in [i for i in order if i not in self._started] + [i for i in order if again[i]]:
            store.push(self.buckets[i].key, self.buckets[i].grads)

"""What a step pushes to sum the replicas' gradients: the buckets it steps, less the part
the early reductions (`overlap.EarlyReduction`) already pushed."""
from __future__ import annotations

from collections.abc import Callable

from ..store.base import KVStore
from .buckets import Bucket
from .overlap import EarlyReduction


class Reduction:
    """The gradient sums one step still has to start.

    `live`: the buckets the step updates (this process's, until `agree`). `early`: the
    Trainer's early reductions (None without overlap); `started` / `current`: the indices
    of the buckets whose early reduction started, and of those of them that reduced the
    gradients as they are now. `agree`: a collective call that makes `live` the buckets
    some worker steps (with ignore_stale_grad on a store of several workers), or None.
    """

    def __init__(self, buckets: list[Bucket], live: list[Bucket],
                 early: EarlyReduction | None = None,
                 started: frozenset[int] | set[int] = frozenset(),
                 current: frozenset[int] | set[int] = frozenset(),
                 agree: Callable[[list[Bucket]], list[Bucket]] | None = None) -> None:
        self.buckets = buckets
        self.live = live
        self._early = early
        self._started = started
        self._current = current
        self._agree = agree

    @property
    def keys(self) -> list:
        """The keys of the live buckets."""
        return [b.key for b in self.live]

    def agree(self) -> None:
        """Make `live` the buckets some worker steps (the first call only). Every worker
        makes it at the same point of its step: after the pushes that end the early
        reductions' share (`push`), where those push to the store agreed on."""
        if self._agree is not None:
            agree, self._agree = self._agree, None
            self.live = agree(self.live)

    def push(self, store: KVStore) -> None:
        """Push to `store` (the one the early reductions push to) every live bucket's
        gradients that no current early reduction has pushed; `agree` first, or (early
        reductions to a store of several workers) once the buckets none started are
        pushed."""
        if self._early is None:
            self.agree()
            if self.live:
                store.push(self.keys, [b.grads for b in self.live])
            return
        if store.num_workers == 1:
            self.agree()
            alive = {id(b) for b in self.live}
            rest = [self.buckets[i] for i in self._early.order
                    if id(self.buckets[i]) in alive and i not in self._current]
            if rest:
                store.push([b.key for b in rest], [b.grads for b in rest])
            return
        # Every process pushes every bucket once, in one order: the early reductions
        # pushed the start of it, a share that varies from process to process (a
        # bucket holding a parameter one process's forward pass left out never starts
        # there), so each pushes the rest before any other collective call, whether
        # it steps those buckets or not (a stale gradient is zero by now). Then a bucket
        # stale on any process and stepped is pushed again by all (sums of current
        # gradients).
        order = self._early.order
        for i in order:
            if i not in self._started:
                store.push(self.buckets[i].key, self.buckets[i].grads)
        self.agree()
        stale = [int(i in self._started and i not in self._current)
                 for i in range(len(self.buckets))]
        again = store.workers_max(stale, "Trainer.step: the gradients to reduce again")
        alive = {id(b) for b in self.live}
        for i in order:
            if again[i] and id(self.buckets[i]) in alive:
                store.push(self.buckets[i].key, self.buckets[i].grads)

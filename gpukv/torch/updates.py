"""The two ways a Trainer applies its optimizer (its `update_on_kvstore`).

`StoreUpdate`: the store sums the gradients and runs the optimizer; the replicas pull the
weights. `ReplicaUpdate`: the store only sums the gradients, which every replica pulls
into its `.grad`; then each replica runs its own copy of the optimizer, on a store of its
own. Both start the store from replica 0's weights and every replica from the store.
"""
from __future__ import annotations

import copy
from typing import Protocol

import torch

from .._errors import DuplicateKeyError
from ..api.factory import create
from ..device import adopt
from ..optim import Optimizer
from ..store.base import KVStore
from ..store.local import LocalStore
from .buckets import Bucket
from .checkpoints import Checkpoints
from .reduction import Reduction
from .rows import TouchedRows
from .scaling import unscale
from .writes import ReplicaWrites, WeightWrites


class Update(Protocol):
    """What the Trainer asks of either way of updating."""

    #: the copies of the Trainer's optimizer that run the updates (none where the store
    #: runs the Trainer's own): each takes every setting the Trainer's takes (learning
    #: rate, rescale, multipliers)
    replica_optimizers: list[Optimizer]

    @property
    def overlap_allowed(self) -> bool:
        """Whether early reductions leave the sums the store makes as they would be."""

    def overlap_pays(self, replicas: int) -> bool:
        """Whether early reductions can start work the step would otherwise wait for,
        with `replicas` replicas in this process."""

    @property
    def state_stores(self) -> list[KVStore]:
        """The stores whose optimizers hold the state (the first one is saved)."""

    def early_store(self) -> KVStore:
        """The store, running no optimizer, that the early reductions push to."""

    def step(self, reduction: Reduction) -> None:
        """Sum the live buckets' gradients, update, and bring the weights to every replica."""

    def checkpoints(self, directory, every, keep, resume="auto") -> Checkpoints:
        """The snapshots of the stores that hold the weights and the optimizer's state."""

    def pull_weights(self) -> None:
        """Every replica's weights from the stores (after a resume)."""


class StoreUpdate:
    """update_on_kvstore=True: a step pushes the gradients, the store sums them and runs
    the Trainer's optimizer, and every replica pulls the weights. The store's weights are
    the truth: a write to the parameters between steps is replaced by the next step's
    pull, with a warning the first time (`WeightWrites`)."""

    def __init__(self, store: KVStore, optimizer: Optimizer, buckets: list[Bucket],
                 rows: TouchedRows) -> None:
        self.store = store
        self.replica_optimizers: list[Optimizer] = []  # the store runs the Trainer's own
        #: with overlap: the store of this process that sums the early reductions
        self.sums: KVStore | None = None
        self._buckets = buckets
        self._optimizer = optimizer
        self._rows = rows  # the buckets whose gradients go as the rows backward touched
        _start_from_replica_0(store, buckets)
        store.set_optimizer(optimizer)
        self._writes = WeightWrites(buckets)

    @property
    def overlap_allowed(self) -> bool:
        # An early reduction pushes this process's sum, one value where the canonical
        # order, and a compressor's residual per replica, need each replica's own (a lone
        # replica's sum is its own gradient, bit for bit). It is made in the gradients'
        # dtype: a 16-bit sum would be rounded (or overflow) where the store sums in float32.
        several = bool(self._buckets) and len(self._buckets[0].grads) > 1
        narrow = any(b.narrow for b in self._buckets)
        return not (self.store.deterministic
                    or (several and (self._compressed or narrow)))

    @property
    def _compressed(self) -> bool:
        return self.store.gradient_compression is not None

    def overlap_pays(self, replicas: int) -> bool:
        # The early reductions sum this process's replicas only (the store's own round
        # runs the optimizer, so it waits for the step): one replica has nothing to sum.
        return replicas > 1

    @property
    def state_stores(self) -> list[KVStore]:
        return [self.store]

    def early_store(self) -> KVStore:
        """One more store of this process, without optimizer: it sums the replicas'
        gradients during backward, and the step pushes its sums to the store."""
        self.sums = create("local" if self.store.type == "local" else "device",
                           deterministic=self.store.deterministic)
        for bucket in self._buckets:
            bucket.summed = torch.zeros_like(bucket.grads[0])
        self.sums.init([b.key for b in self._buckets], [b.summed for b in self._buckets])
        return self.sums

    def step(self, reduction: Reduction, inverse: float | None = None) -> None:
        """`Update.step`; `inverse`: the factor that takes a loss scale off the gradients
        before they leave this process (`scaling`)."""
        self._writes.check()
        reduction.agree()  # (the early reductions push to a store of this process)
        keys, live = reduction.keys, reduction.live
        if not keys:
            return
        touched = self._rows
        as_rows = {id(b) for b in live if touched.pushes_rows(b)}
        if self.sums is None or self._compressed:
            # (compression set on the store after the Trainer was made: each replica's
            # gradient goes to the store, and the early reductions' sums go unused)
            unscale([g for b in live for g in b.grads], inverse)
            self.store.push(keys, [touched.values(b) if id(b) in as_rows else b.grads
                                   for b in live])
        else:  # (the early reductions summed the scaled gradients: unscale their sums)
            reduction.push(self.sums)
            summed: list = [b.summed for b in live]  # (early_store made every one)
            self.sums.pull(keys, out=summed)
            unscale(summed, inverse)
            self.store.push(keys, [touched.value_of_sum(b, s) if id(b) in as_rows else s
                                   for b, s in zip(live, summed)])
        # A lazy update changed the rows pushed only, which are all a replica needs
        # unless the program wrote its weights since the last step.
        written = {id(b) for b in live if id(b) in as_rows
                   and touched.written_since_last_step(b)}
        lazy = self._optimizer.lazy_rows_for
        by_rows = [b for b in live if id(b) in as_rows and id(b) not in written
                   and lazy(b.dtype_name)]
        whole = [b for b in live if b not in by_rows]
        if whole:
            self.store.pull([b.key for b in whole], out=[b.weights for b in whole])
        for b in by_rows:
            touched.pull(self.store, b)

    def checkpoints(self, directory, every, keep, resume="auto") -> Checkpoints:
        return Checkpoints(directory, every, keep, self.store, layout_of(self._buckets),
                           resume=resume)

    def pull_weights(self) -> None:
        keys = [b.key for b in self._buckets]
        if keys:
            self.store.pull(keys, out=[b.weights for b in self._buckets])


class ReplicaUpdate:
    """update_on_kvstore=False: the store sums the gradients into every replica's
    `.grad`, and each replica runs its own copy of the optimizer on a store of its own
    (the same arithmetic on the same sums keeps the replicas equal).

    A replica's store holds no copy of its weights: it updates the parameters in place
    (`LocalStore.adopt`), as a PyTorch optimizer does, so what the program writes into
    them between steps (clamping, a `load_state_dict`, a layer set afresh) is what the
    next step updates."""

    def __init__(self, store: KVStore, optimizer: Optimizer, buckets: list[Bucket],
                 replicas: int) -> None:
        self.store = store
        self._buckets = buckets
        _start_from_replica_0(store, buckets)
        keys = [b.key for b in buckets]
        kind = "local" if store.type == "local" else "device"
        self.replica_stores: list[KVStore] = []
        self.replica_optimizers: list[Optimizer] = []
        for r in range(replicas):
            local = create(kind, deterministic=store.deterministic)
            assert isinstance(local, LocalStore)  # a store of this process alone
            if keys:
                local.adopt(keys, [adopt(b.weights[r]) for b in buckets])
            opt = copy.deepcopy(optimizer)
            local.set_optimizer(opt)
            self.replica_stores.append(local)
            self.replica_optimizers.append(opt)
        self._writes = ReplicaWrites(buckets)

    @property
    def overlap_allowed(self) -> bool:
        return True  # the early reductions push each replica's gradients to the store

    def overlap_pays(self, replicas: int) -> bool:
        return True  # the store's sums themselves start early

    @property
    def state_stores(self) -> list[KVStore]:
        return self.replica_stores

    def early_store(self) -> KVStore:
        return self.store

    def step(self, reduction: Reduction) -> None:
        self.allreduce(reduction)
        self.apply(reduction.live)

    def allreduce(self, reduction: Reduction) -> None:
        """Sum every live bucket's gradients on the store, into every replica's (the
        live buckets agreed on by the push)."""
        reduction.push(self.store)
        if reduction.keys:
            self.store.pull(reduction.keys, out=[b.grads for b in reduction.live])

    def apply(self, live: list[Bucket]) -> None:
        """Run every replica's optimizer with the gradients its buckets hold."""
        keys = [b.key for b in live]
        if not keys:
            return
        written = self._writes.written()
        if written:  # 16-bit weights the program wrote: their master copies follow
            if written[0][0].weights[0].is_cuda:
                torch.cuda.synchronize()  # (the writes, on PyTorch's streams, come first)
            for bucket, r in written:
                local = self.replica_stores[r]
                assert isinstance(local, LocalStore)  # (made so above)
                local.values_written([bucket.key])
        for r, local in enumerate(self.replica_stores):
            local.push(keys, [b.grads[r] for b in live])
            # (the weights are the store's values: the pull orders the caller's stream
            # after the update and tells PyTorch of the write, and copies nothing)
            local.pull(keys, out=[b.weights[r] for b in live])
        self._writes.seen()

    def checkpoints(self, directory, every, keep, resume="auto") -> Checkpoints:
        # Replica 0's store holds the state (alike on every worker); a dist store has
        # each of its workers write a share of it.
        store = self.replica_stores[0] if self.store.num_workers == 1 else self.store
        return Checkpoints(directory, every, keep, store, layout_of(self._buckets),
                           self.replica_stores, resume,
                           residuals_kept=self.store.gradient_compression is None)

    def pull_weights(self) -> None:
        keys = [b.key for b in self._buckets]
        if not keys:
            return
        for r, local in enumerate(self.replica_stores):
            local.pull(keys, out=[b.weights[r] for b in self._buckets])
        self._writes.seen()  # (the stores' own weights, master copies and all)


def layout_of(buckets: list[Bucket]) -> dict:
    """{key: [(parameter name, shape)]}: what each bucket's key holds, flat, in order."""
    return {b.key: [(name, tuple(p.shape)) for name, p in zip(b.names, b.params[0])]
            for b in buckets}


def _start_from_replica_0(store: KVStore, buckets: list[Bucket]) -> None:
    """The store starts from replica 0's weights, and every replica from the store."""
    keys = [b.key for b in buckets]
    if not keys:
        return
    held = [k for k in keys if k in store]
    if held:  # (a second Trainer on one store: a GAN's generator and discriminator)
        raise DuplicateKeyError(
            f"key {held[0]!r}: the store already holds it, from another Trainer or the "
            f"program: give each Trainer a store of its own (gpukv.create(...) for each; "
            f"on a dist store, made in the same order on every worker)")
    store.init(keys, [b.weights[0] for b in buckets])
    store.pull(keys, out=[b.weights for b in buckets])

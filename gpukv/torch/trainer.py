"""`Trainer`: apply an optimizer to the parameters of several replicas through a store."""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import warnings
import weakref
from collections.abc import Iterator

import numpy as np
import torch

from .. import timeline
from .._errors import ArgumentError, ArgumentKindError, CheckpointError
from ..api.factory import create
from ..checkpoints import snapshots
from ..checkpoints.snapshots import Snapshot
from ..distributed.store import DistKVStore
from ..encoding.compressors import low_rank_compressor
from ..optim import LAMB, Optimizer
from ..optim import claims as optimizer_claims
from ..optim import create as create_optimizer
from ..store.base import KVStore
from . import scaling
from .buckets import BUCKET_BYTES, Bucket, flatten, frozen, make_buckets, trainable
from .buffers import tied_parameters
from .checkpoints import Checkpoints
from .frozen import replica_buffers, start_alike
from .gradients import GradientCollector
from .overlap import OWNER, EarlyReduction
from .reduction import Reduction
from .rows import TouchedRows, sparse_gradient_names, warn_made_dense
from .same_model import check_same_model
from .torch_optimizer import TorchOptimizer, optimizer_values
from .updates import ReplicaUpdate, StoreUpdate, Update, layout_of

#: the attribute naming, by weak reference, the Trainer that holds a parameter
_TRAINER = "_gpukv_trainer"
#: how many Trainers have taken parameters over in this process: a Trainer whose count
#: seen is current holds all of its own without looking at each
_TAKEOVERS = [0]

#: the float32 limits the optimizers' rescale must keep to (as Python floats: compared
#: with a NumPy float32, a float beyond its range would be cast first, with a warning)
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


class Trainer:
    """Apply an optimizer to the parameters of several replicas through a gpukv store.

    A step sums every replica's gradients on the store, updates the weights and brings
    them back into every replica, in place. The guide, docs/trainer.md, says the rest:
    buckets and multipliers, stale and frozen parameters, changing the optimizer,
    overlap, deterministic sums, checkpoints.

    modules: a `torch.nn.Module`, or a list of them (one per device, same architecture;
        with a dist store, this process's replicas, and `step(batch_size)` takes the batch
        of every worker together; `step()` with mean losses averages over every replica,
        as DDP does).
    optimizer, optimizer_params: a name for `gpukv.optim.create` and its options, or a
        `gpukv.optim.Optimizer`. kvstore: a store name for `gpukv.create`, or a `KVStore`.
    compression_params: gradient compression (see `KVStore.set_gradient_compression`).
    update_on_kvstore: True runs the optimizer on the store; False sums the gradients on
        the store, pulls them into every replica's `.grad` and runs the optimizer on each
        replica (`allreduce_grads` and `update` then split the step in two).
    bucket_bytes: capacity of a fused key; 0 gives every parameter its own key. With
        PowerSGD (`compression_params={'type': 'powersgd', ...}`) every parameter of two
        or more dimensions has a key of its own, which it compresses as a matrix.
    overlap: start each bucket's gradient reduction from backward; None: on for replicas
        on GPUs, unless the store runs the optimizer and this process has one replica.
    checkpoint_dir: a folder for numbered snapshots, taken after every `checkpoint_every`
        steps (None: only by `snapshot()`), the newest `checkpoint_keep` kept. resume:
        'auto' starts from the folder's newest complete snapshot, if any; 'never' starts
        afresh and removes none of an earlier run's snapshots; a snapshot's path starts
        from that one.
    deterministic: sum every gradient in the canonical order, the same bits for any
        layout; None: the store's default (GPUKV_DETERMINISTIC).

    With a `torch.amp.GradScaler`, `scaler.step(trainer)` takes the step (see
    `gpukv.torch.scaling`): skipped on every worker when one found an inf or NaN.
    """

    #: `torch.amp.GradScaler.step(trainer)` calls `step` with `grad_scale` and `found_inf`
    #: set on the Trainer (the protocol of torch's fused optimizers), instead of skipping
    #: the step on this worker alone
    _step_supports_amp_scaling = True

    #: What the program keeps current for a resume (a data loader's position, RNG
    #: states): saved in every snapshot, each worker's own, and given back by a resume
    #: (empty for a worker the snapshot did not have). Plain values: numbers, strings,
    #: lists, dicts, NumPy arrays and tensors.
    user_state: dict

    def __init__(self, modules, optimizer, optimizer_params=None, kvstore="device",
                 compression_params=None, update_on_kvstore=True, *,
                 bucket_bytes: int = BUCKET_BYTES, overlap: bool | None = None,
                 checkpoint_dir=None, checkpoint_every: int | None = None,
                 checkpoint_keep: int = 2, deterministic: bool | None = None,
                 resume="auto"):
        self._kv = _make_store(kvstore, deterministic)
        # A worker refusing its arguments alone makes the others raise at once, naming
        # it, where they would wait for it in the first collective call below
        with self._kv.refusals_agreed("Trainer", collective=True):
            self._modules = _module_list(modules)
            self._optimizer = _make_optimizer(optimizer, optimizer_params)
            on_store = _check_flag("update_on_kvstore", update_on_kvstore)
            if overlap is not None:
                _check_flag("overlap", overlap)
            if isinstance(bucket_bytes, bool) \
                    or not isinstance(bucket_bytes, numbers.Integral) or bucket_bytes < 0:
                raise ArgumentError(f"bucket_bytes={bucket_bytes!r}: expected an int >= 0 "
                                    f"(0: a key per parameter; default {BUCKET_BYTES})")
            checkpoints = self._checkpoint_options(checkpoint_dir, checkpoint_every,
                                                   checkpoint_keep, resume)
            if checkpoints is not None:
                _refuse_shared_snapshots(self._kv)
            names, params = trainable(self._modules)
            if not names:
                raise ArgumentError("the modules have no trainable parameter (requires_grad "
                                    "is False for every one): the Trainer would update "
                                    "nothing (as DDP, it refuses)")
            # the stores of the Trainers these modules had: they step them no more, and
            # hand their optimizer and checkpoint folder over to this one
            taken_over = _snapshot_stores(getattr(p, _TRAINER, None)
                                          for replica in params for p in replica)
            _refuse_shared_optimizer(self._optimizer, self._kv, taken_over)
            # PowerSGD (given, or already set on the store given) compresses a
            # parameter's own matrix
            low_rank = low_rank_compressor(compression_params if compression_params is not None
                                           else self._kv.gradient_compression)
        self._scale: float = self._optimizer.rescale_grad
        if isinstance(self._optimizer, LAMB):
            bucket_bytes = 0
        check_same_model(self._kv, names, params[0])  # (before any key names a bucket)
        # the parameters with sparse gradients (a key each, whichever way they go), and
        # those whose steps push the rows touched
        trainable_names = set(names)
        sparse = [n for n in sparse_gradient_names(self._modules[0]) if n in trainable_names]
        rows = self._pushed_as_rows(sparse, on_store)
        alone = set(self._optimizer.lr_mult) | set(self._optimizer.wd_mult) | set(sparse)
        if low_rank:
            alone |= {n for n, p in zip(names, params[0]) if p.dim() >= 2}
        self._buckets: list[Bucket] = make_buckets(names, params, int(bucket_bytes), alone)
        #: parameter name -> the key it shares with others
        self._fused: dict = {n: b.key for b in self._buckets if b.fused for n in b.names}
        #: (name, replica, tensor) of the parameters frozen now: left out for good
        self._frozen: list = frozen(self._modules)
        #: the optimizer's settings() its replica copies last took (update_on_kvstore=False)
        self._replica_settings: tuple | None = None
        #: `torch_optimizer`, once asked for, and the options last taken from its group
        self._torch_view: TorchOptimizer | None = None
        self._viewed: dict = {}
        #: every parameter's name and every key: what a multiplier may name
        self._names: set = {n for b in self._buckets for n in b.names} | set(self.keys) | {
            name for name, _, _ in self._frozen}
        self._grads: GradientCollector = GradientCollector(
            self._buckets, self._frozen, self._modules)
        #: the buckets allreduce_grads() summed, for the update() that follows it
        self._reduced: list | None = None
        self._warned_unsummed: bool = False  # (update() without allreduce_grads(): once)
        # what every parameter was: put back should the Trainer fail to start, so that a
        # Trainer already running on these modules keeps them (a refusal changes nothing)
        before = [(p, p.data, p.grad, getattr(p, OWNER, None), getattr(p, _TRAINER, None))
                  for bucket in self._buckets for params in bucket.params for p in params]
        #: what held the optimizer before this Trainer's store (`optimizer_claims.claim`'s
        #: answer); False: not held (not yet, or let go by `close`)
        self._optimizer_held_from: object = False
        try:
            for bucket in self._buckets:
                flatten(bucket, len(self._modules))
            self._grads.note_weights()
            self._rows: TouchedRows = TouchedRows(
                [b for b in self._buckets if b.names[0] in rows])
            self._start(checkpoints, compression_params, on_store, overlap, taken_over)
        except BaseException:
            with torch.no_grad():
                for p, data, grad, early, trainer in before:
                    p.data, p.grad = data, grad
                    setattr(p, OWNER, early)
                    setattr(p, _TRAINER, trainer)
            if getattr(self, "_checkpoints", None) is not None:
                self._checkpoints.let_go(failed=True)  # (to the Trainer that had it)
            if self._optimizer_held_from is not False:  # (to the store that had it)
                optimizer_claims.give_back(self._optimizer, self._kv,
                                           self._optimizer_held_from)
            raise
        me = weakref.ref(self)
        self._rows.take_over([p for p, *_ in before])
        for p, *_ in before:  # an earlier Trainer on these modules steps them no more
            setattr(p, _TRAINER, me)
        _TAKEOVERS[0] += 1
        self._takeovers_seen: int = -1  # (`_check_owner` looks at every parameter once)

    def _start(self, checkpoints: tuple | None, compression_params, on_store: bool,
               overlap: bool | None, taken_over: list) -> None:
        """The rest of `__init__`, once the buckets hold the parameters. `taken_over`:
        the stores of the Trainers these modules had, whose checkpoint folder and
        optimizer this one may take over (they step them no more)."""
        if checkpoints is not None:  # (before the store is touched)
            _finish_writes_of(taken_over)  # (their newest snapshot is the one to resume)
            directory, every, keep, resume = checkpoints
            ahead = Checkpoints(directory, every, keep, self._kv, layout_of(self._buckets),
                                resume=resume)
            ahead.modules, ahead.frozen = self._modules, self._frozen
            ahead.check_ahead(taken_over)
        if compression_params is not None:
            self._kv.set_gradient_compression(compression_params)
        # this Trainer's store holds the optimizer (it runs it, or, with
        # update_on_kvstore=False, the replicas run copies that follow it)
        self._optimizer_held_from = optimizer_claims.claim(self._optimizer, self._kv,
                                                           taken_over)
        self._update: Update
        if on_store:
            self._update = StoreUpdate(self._kv, self._optimizer, self._buckets, self._rows)
        else:
            self._update = ReplicaUpdate(self._kv, self._optimizer, self._buckets,
                                         len(self._modules))
        # as the store starts trainable ones
        start_alike(self._kv, self._frozen + replica_buffers(self._modules))
        #: steps (and updates) done, counted on from a snapshot resumed from
        self._steps: int = 0
        #: what the user keeps current for a resume (a data loader's position, RNG
        #: states): saved in every snapshot, given back by a resume
        self.user_state: dict = {}
        self._checkpoints: Checkpoints | None = None
        if checkpoints is not None:
            self._start_checkpoints(*checkpoints, passing=[self._kv, *taken_over])
        #: the fewest and the most replicas of a worker: asked of every worker here, where
        #: all of them are (a step's early reductions may be under way on a dist store)
        self._replicas_per_worker: tuple[int, int] = self._count_replicas()
        self._early: EarlyReduction | None = None
        if self._wants_overlap(overlap):
            target = self._update.early_store()
            self._early = EarlyReduction(
                self._buckets, lambda bucket, grads: target.push(bucket.key, grads))
            # the program's own calls on the store (a barrier after backward, a
            # snapshot) come after the reductions backward started, on every worker
            target.settle_before_calls(self._early.wait, self._early.reducing)
        else:
            for bucket in self._buckets:
                for params in bucket.params:
                    for p in params:
                        setattr(p, OWNER, None)  # an earlier Trainer's hooks stop here

    def _pushed_as_rows(self, sparse: list, on_store: bool) -> set:
        """The parameters of `sparse` (sparse gradients: `rows.SPARSE_MODULES`) whose
        steps push the rows backward touched: with the optimizer on a one-process store
        that does not promise the bits of every layout; the others are warned of, pushed
        dense."""
        if not sparse:
            return set()
        if not on_store:
            warn_made_dense(sparse, "with update_on_kvstore=False (each replica's "
                                    "optimizer updates the summed gradients)")
            return set()
        if isinstance(self._kv, DistKVStore):
            warn_made_dense(sparse, "to a dist store, which takes dense pushes only")
            return set()
        if self._kv.deterministic:
            warn_made_dense(sparse, "to a deterministic store, so that every layout (a "
                                    "dist store takes dense pushes) gives the same bits")
            return set()
        return set(sparse)

    # ------------------------------------------------------------------ properties
    @property
    def kvstore(self) -> KVStore:
        """The store the trainer pushes to and pulls from."""
        return self._kv

    @property
    def optimizer(self) -> Optimizer:
        """The `gpukv.optim.Optimizer` the trainer runs."""
        return self._optimizer

    @property
    def keys(self) -> list:
        """The store keys, one per bucket, in parameter order."""
        return [b.key for b in self._buckets]

    @property
    def buckets(self) -> dict:
        """Every store key and the names of the parameters it holds."""
        return {b.key: list(b.names) for b in self._buckets}

    @property
    def overlap(self) -> bool:
        """Whether gradient reductions start from backward (see docs/trainer.md)."""
        return self._early is not None

    @property
    def steps(self) -> int:
        """Steps (and updates) done, counted from the snapshot the Trainer resumed from."""
        return self._steps

    @property
    def resumed_from(self) -> Snapshot | None:
        """The snapshot the Trainer started from (its `path`, `step`, `workers`), or None."""
        return None if self._checkpoints is None else self._checkpoints.resumed

    def saved_user_state(self, worker: int = 0) -> dict:
        """The `user_state` worker `worker` saved in the snapshot this Trainer resumed
        from: for state every worker keeps alike (a torch scheduler's), which a worker
        the snapshot did not have (a resume on more workers) takes from worker 0's.
        ArgumentError without a resume, or for a worker the snapshot does not have."""
        found = self.resumed_from
        if found is None:
            raise ArgumentError("saved_user_state: this Trainer resumed from no snapshot")
        if isinstance(worker, bool) or not isinstance(worker, numbers.Integral) \
                or not 0 <= worker < found.workers:
            raise ArgumentError(f"saved_user_state: worker={worker!r}; the snapshot has "
                                f"workers 0 to {found.workers - 1}")
        return found.user_state(int(worker)).get("user", {})

    @property
    def learning_rate(self) -> float:
        """The optimizer's learning rate. With a gpukv lr_scheduler, the schedule's at the
        updates counted so far, as MXNet's `learning_rate`: the last step's (the next
        one's differs where the schedule moves at it), counted by the Trainer's steps,
        the same on every worker whichever keys its optimizer updates (or replicas'
        copies of it, with update_on_kvstore=False, after `load_states` too). With
        `torch_optimizer`, its group's: the next step's."""
        if self._torch_view is not None:  # what the scheduler wrote, else the optimizer's
            lr = self._torch_view.scheduled()["learning_rate"]
            return lr if lr != self._viewed["learning_rate"] else self._optimizer.lr
        if self._optimizer.lr_scheduler is None:
            return self._optimizer.lr
        # the copy that counts the updates (a replica's, whose counts load_states restores)
        opt = (self._update.replica_optimizers or [self._optimizer])[0]
        return opt.lr_scheduler(max(opt.num_update, opt.begin_num_update + self._steps))

    def set_learning_rate(self, lr) -> None:
        """Set the optimizer's learning rate to `lr` (not with an lr_scheduler, as in
        MXNet)."""
        self._optimizer.set_learning_rate(lr)
        for opt in self._update.replica_optimizers:
            opt.set_learning_rate(lr)
        if self._torch_view is not None:
            self._torch_view.show("learning_rate", self._optimizer.lr)
            self._viewed["learning_rate"] = self._optimizer.lr

    @property
    def torch_optimizer(self) -> TorchOptimizer:
        """This Trainer as a `torch.optim.Optimizer`, for torch's learning-rate
        schedulers: `torch.optim.lr_scheduler.OneCycleLR(trainer.torch_optimizer, ...)`.
        Its one parameter group's 'lr' (and 'momentum' or 'betas', where the optimizer
        has them) set the next step's; its `step()` and `zero_grad()` are the Trainer's.
        ArgumentError when the optimizer follows a gpukv lr_scheduler (two schedules
        would fight over the rate)."""
        if self._torch_view is None:
            if self._optimizer.lr_scheduler is not None:
                raise ArgumentError(
                    "torch_optimizer: the optimizer follows a gpukv lr_scheduler already; "
                    "make the Trainer without one to drive the rate from torch")
            self._torch_view = TorchOptimizer(self, self.param_groups[0]["params"],
                                              self._optimizer)
            self._viewed = self._torch_view.scheduled()
        else:  # (a scheduler made now starts from what the optimizer has)
            self._sync_view(take=False)
        return self._torch_view

    @property
    def param_groups(self) -> list[dict]:
        """Every replica's trainable parameters, as one torch optimizer group: where a
        `torch.amp.GradScaler` looks for infinities and NaN, and takes the scale off."""
        return [{"params": [p for bucket in self._buckets for params in bucket.params
                            for p in params]}]

    # ------------------------------------------------------------------- training
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside start no reduction (with overlap; else nothing to do).

        For gradient accumulation, as DDP's: run every backward pass but the last of a
        step inside, so that only the last one starts the reductions.
        """
        if self._early is None:
            yield
            return
        with self._early.paused():
            yield

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every replica's gradients in place (the views stay the `.grad` tensors),
        and drop the sums of an `allreduce_grads` that no update applied. `set_to_none`
        (torch.optim's option): leave every `.grad` None instead, as
        `model.zero_grad()` does; backward's new gradients go into the buckets at the
        step."""
        _check_flag("set_to_none", set_to_none)
        self._reduced = None
        self._rows.clear()
        self._grads.stepped()  # the gradients backward made are gone: none is fresh
        try:
            if self._early is not None:
                self._early.finish()  # they read the gradients: wait for them
        finally:
            self._zero_grads()
        if set_to_none:
            for bucket in self._buckets:
                for params in bucket.params:
                    for p in params:
                        p.grad = None

    def _zero_grads(self) -> None:
        with torch.no_grad():
            for bucket in self._buckets:
                if self._rows.tracks(bucket):
                    self._rows.zero(bucket)  # the rows backward wrote, where it alone did
                else:
                    for grad in bucket.grads:
                        grad.zero_()
                for r in range(len(bucket.grads)):
                    for p, view in zip(bucket.params[r], bucket.views[r]):
                        if p.grad is not view:  # set to None or replaced since
                            p.grad = view

    def step(self, batch_size=None, ignore_stale_grad: bool = False) -> None:
        """Push every replica's gradients, update, pull weights.

        `batch_size`: gluon's convention, each replica's loss the sum over its samples and
        the gradients' sum rescaled by 1/batch_size (the batch of every replica of every
        worker together). None: DDP's, each replica's loss a mean, and the gradients
        averaged over every replica of every worker (`num_replicas`).

        A gradient backward has not written since the last step (`.grad` None, or left
        as it was: a step without backward, backward on only some replicas, a parameter
        the forward pass did not use) is stale: an ArgumentError naming the parameters
        and the replica, before anything changes, unless `ignore_stale_grad`. Then a stale
        gradient is zeroed and contributes nothing, and a parameter stale in every replica
        is left out of the step when it has its own key (in a fused key it gets a zero
        gradient); on a dist store every worker passes the same flag.
        """
        scaled = scaling.set_on(self)
        if scaled is not None:
            try:
                self._start_step(ignore_stale_grad)
                self._scaled_step(scaled, batch_size, ignore_stale_grad)
            except BaseException:
                scaling.forget(self)
                raise
            return
        self._start_step(ignore_stale_grad)
        self._refuse_summed("step()", "a step")
        self._check_user_state()
        with timeline.span("Trainer.step", "trainer", step=self._steps):
            with self._kv.refusals_agreed("Trainer.step"):  # (told to the others' pushes)
                scale = self._scale_for(batch_size)
                self._check_multipliers()
            with timeline.span("gather gradients", "trainer"):
                reduction = self._gather(ignore_stale_grad)
            self._set_scale(scale)
            with timeline.span("reduce and update", "trainer"):
                self._update.step(reduction)
            self._stepped()
            if isinstance(self._update, ReplicaUpdate):
                self._grads.hold_sums(reduction.live)

    def allreduce_grads(self, ignore_stale_grad: bool = False) -> None:
        """Sum the gradients of every replica on the store and pull the sum into each
        replica's `.grad` (with update_on_kvstore=False only, as in gluon). Stale
        gradients are refused, or with `ignore_stale_grad` left out, as by `step`; the
        `update` that follows takes the sums as they are."""
        self._check_owner()
        _check_flag("ignore_stale_grad", ignore_stale_grad)
        self._check_low_rank_keys()
        replicas = self._replica_update("allreduce_grads")
        self._refuse_summed("allreduce_grads() again", "another allreduce")
        reduction = self._gather(ignore_stale_grad, "Trainer.allreduce_grads")
        replicas.allreduce(reduction)
        self._reduced = reduction.live

    def update(self, batch_size=None, ignore_stale_grad: bool = False) -> None:
        """Run the optimizer on every replica with its (already summed) gradients,
        rescaled by 1/batch_size, or averaged over `num_replicas` when it is None (as
        `step`; with update_on_kvstore=False only, as in gluon). After
        `allreduce_grads` it updates what that summed; else stale gradients are checked
        as by `step` (`ignore_stale_grad`: as `step`'s)."""
        replicas = self._replica_update("update")
        self._start_step(ignore_stale_grad)
        self._check_user_state()
        scale = self._scale_for(batch_size)
        self._grads.check_trainable()
        self._check_multipliers()
        live = self._reduced
        if live is None:
            live = self._grads.collect(ignore_stale_grad)
            self._warn_unsummed()
        else:  # a .grad replaced since (clipping out of place) is what gets applied
            self._grads.adopt_replaced()
        self._set_scale(scale)
        replicas.apply(live)
        summed = self._reduced is not None
        self._stepped()
        if summed:
            self._grads.hold_sums(live)

    def _warn_unsummed(self) -> None:
        """An update of gradients no allreduce_grads() summed, where there are several
        replicas: each applies its own, and they drift apart. gluon allows it (local SGD
        does it on purpose), so it is said once, not refused."""
        if self.num_replicas > 1 and not self._warned_unsummed:
            self._warned_unsummed = True
            warnings.warn(f"Trainer.update() without allreduce_grads(): each of the "
                          f"{self.num_replicas} replicas applies its own gradient, not "
                          f"their sum, and their weights drift apart; call "
                          f"allreduce_grads() before update() (or step(), which does "
                          f"both)", UserWarning, stacklevel=3)

    def _scaled_step(self, scaled: scaling.Scaled, batch_size,
                     ignore_stale_grad: bool) -> None:
        """`step` called by `GradScaler.step`: every worker skips it when one found an
        inf or NaN; else it takes the scale off before the optimizer (`scaling`)."""
        self._check_user_state()
        with timeline.span("Trainer.step", "trainer", step=self._steps, scaled=True):
            scale = self._scale_for(batch_size)
            self._check_multipliers()
            if isinstance(self._update, ReplicaUpdate):
                self._scaled_replica_step(self._update, scaled, scale, ignore_stale_grad)
                return
            assert isinstance(self._update, StoreUpdate)  # (the two ways there are)
            reduction = self._gather(ignore_stale_grad)
            if scaling.found_anywhere(self._kv, scaled.found_inf):
                self._gradients_used()
                return
            self._set_scale(scale)
            with timeline.span("reduce and update", "trainer"):
                self._update.step(reduction, scaled.inverse)
            self._stepped()

    def _scaled_replica_step(self, replicas: ReplicaUpdate, scaled: scaling.Scaled,
                             scale: float, ignore_stale_grad: bool) -> None:
        """A scaled step with update_on_kvstore=False: the sums (made now, or by
        `allreduce_grads`) lose the scale, and the replicas update them unless GradScaler
        found an inf or NaN (in the sums, the same on every worker, or with one worker in
        its replicas' gradients)."""
        float16_sums = self.num_replicas > 1 and any(
            b.grads[0].dtype == torch.float16 for b in self._buckets)
        scaling.check_replica_scaling(self._kv, self._reduced is not None, float16_sums)
        live = self._reduced
        if live is None:
            reduction = self._gather(ignore_stale_grad)
            if not scaled.found_inf:
                replicas.allreduce(reduction)
            live = reduction.live
        else:
            self._grads.check_trainable()
        if scaled.found_inf:
            self._gradients_used()
            return
        if self._reduced is not None:  # a .grad replaced since (clipping out of place)
            self._grads.adopt_replaced()
        scaling.unscale([g for b in live for g in b.grads], scaled.inverse)
        self._set_scale(scale)
        replicas.apply(live)
        self._stepped()
        self._grads.hold_sums(live)  # (summed here, or by allreduce_grads)

    def _refuse_summed(self, call: str, what: str) -> None:
        """ArgumentError for `call` while the gradients hold the sums of an
        `allreduce_grads` that no update applied: `what` would sum them again."""
        if self._reduced is not None:
            raise ArgumentError(
                f"{call} after allreduce_grads(): the gradients hold their sums already, "
                f"and {what} would sum them again; call update() to apply them (under "
                f"GradScaler, scaler.step(trainer)), or zero_grad() to drop them")

    def _gradients_used(self) -> None:
        """A step, an update or a scaled step skipped for an inf or NaN used the
        gradients: none is fresh any more, and no sums wait for an update."""
        self._grads.stepped()
        self._rows.clear()
        self._reduced = None

    # ---------------------------------------------------------------- checkpoints
    def snapshot(self) -> str:
        """Take a snapshot of this step now (see `checkpoint_dir`); its folder. On a dist
        store every worker calls it at the same step."""
        if self._checkpoints is None:
            raise ArgumentError("snapshot(): make the Trainer with a checkpoint_dir")
        return self._checkpoints.take(self._steps, self.user_state)

    def finish_snapshots(self) -> None:
        """Wait until the snapshots taken are written (CheckpointError if one failed);
        at a normal exit the program waits for them by itself."""
        if self._checkpoints is not None:
            self._checkpoints.store.finish_snapshots()
            self._checkpoints.finished()

    def close(self) -> None:
        """The end of training: with a checkpoint_dir, a snapshot of the last step (unless
        one of it was taken already), then every snapshot written. On a dist store every
        worker calls it. `with Trainer(...) as trainer:` calls it at the end of the block;
        after an exception, the block's end only waits for this process's snapshot
        writes (a failed step's state is not snapshotted, and nothing is asked of the
        other workers, who may be in a step: the exception goes on as it was raised).
        Either way the optimizer is free for another store or Trainer of the process
        (a step taken after holds it again)."""
        self._let_go_of_optimizer()
        if self._checkpoints is None:
            return
        if self._checkpoints.last_step != self._steps:
            self.snapshot()
        self.finish_snapshots()
        self._checkpoints.let_go()  # (another store of this process may snapshot there)

    def _let_go_of_optimizer(self) -> None:
        """The optimizer is free for another store of this process (`optimizer_claims`)."""
        if self._optimizer_held_from is not False:
            optimizer_claims.release(self._optimizer, self._kv)
            self._optimizer_held_from = False

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
            return
        self._let_go_of_optimizer()
        if self._checkpoints is not None:
            # the earlier snapshots' files, whole, before the error goes on; not
            # finish_snapshots(), a collective call on a dist store, whose mismatch with
            # the others' step (or a write's error) would take the exception's place
            snapshots.finish_writes()
            self._checkpoints.let_go()  # (a Trainer made again there resumes them)

    def save_states(self, path) -> None:
        """Write the optimizer's state (atomically) to `path`."""
        self._update.state_stores[0].save_optimizer_states(path)

    def load_states(self, path, update_counts: str = "saved") -> None:
        """Restore the optimizer's state `save_states` wrote to `path` (CheckpointError if
        it does not fit; nothing changes then). `update_counts`: 'saved' goes on with the
        file's update counts, 'restart' starts them over (fine-tuning under a schedule of
        one's own), as `KVStore.load_optimizer_states`'s."""
        # The first load checks the file and the argument whole: if it fails, nothing
        # has changed.
        for store in self._update.state_stores:
            store.load_optimizer_states(path, update_counts=update_counts)

    # ------------------------------------------------------------------ internals
    def _checkpoint_options(self, directory, every, keep, resume) -> tuple | None:
        """The snapshot options, checked before anything changes."""
        if directory is None:
            if every is not None:
                raise ArgumentError("checkpoint_every needs a checkpoint_dir")
            if resume != "auto":
                raise ArgumentError(f"resume={resume!r} needs a checkpoint_dir")
            return None
        Checkpoints.check(directory, every, keep)
        return directory, every, keep, Checkpoints.check_resume(resume)

    def _start_checkpoints(self, directory, every, keep, resume, *, passing: list) -> None:
        """Hold `directory` for the store that snapshots (`passing`: the stores that
        hand it over), then resume from the newest complete snapshot there ('auto'), or
        from the one `resume` names, or from none ('never')."""
        self._checkpoints = self._update.checkpoints(directory, every, keep, resume)
        self._checkpoints.modules = self._modules
        self._checkpoints.frozen = self._frozen
        self._checkpoints.hold(passing)
        resumed = self._checkpoints.resume()
        if resumed is None:
            return
        self._steps, self.user_state = resumed
        self._update.pull_weights()

    def _check_owner(self) -> None:
        """ArgumentError when a newer Trainer made on these modules holds their
        parameters: this one's buffers are no longer the parameters', and its steps would
        move nothing."""
        if self._takeovers_seen == _TAKEOVERS[0]:
            return  # (no Trainer made since the last look: every parameter is still ours)
        for bucket in self._buckets:
            for r, params in enumerate(bucket.params):
                for name, p in zip(bucket.names, params):
                    owner = getattr(p, _TRAINER, None)
                    if owner is None or owner() is not self:
                        raise ArgumentError(
                            f"this Trainer's parameter {name!r} of replica {r} (key "
                            f"{bucket.key!r}) was taken over by a newer Trainer made on "
                            f"the same modules, or on a module of theirs: step that one")
        self._takeovers_seen = _TAKEOVERS[0]

    def _replica_update(self, op: str) -> ReplicaUpdate:
        if not isinstance(self._update, ReplicaUpdate):
            raise ArgumentError(f"{op}() runs the optimizer on each replica; create the "
                                f"Trainer with update_on_kvstore=False to use it")
        return self._update

    def _check_multipliers(self) -> None:
        """ArgumentError if a multiplier names no parameter of the modules, or one that
        shares its key (it would apply to no key, silently); else the replicas'
        optimizers take them, and every option changed on `optimizer`, too."""
        opt = self._optimizer
        for table, setter in ((opt.lr_mult, "set_lr_mult"), (opt.wd_mult, "set_wd_mult")):
            for name in table:
                if name not in self._names:
                    tied = tied_parameters(self._modules[0]).get(name)
                    if tied is not None:
                        raise ArgumentError(
                            f"{setter}: {name!r} is parameter {tied!r} under a second "
                            f"name (tied to it); name it {tied!r}, as "
                            f"model.named_parameters() does")
                    raise ArgumentError(
                        f"{setter}: {name!r} names no parameter of the Trainer's modules "
                        f"(named as model.named_parameters() names them, e.g. "
                        f"{self._buckets[0].names[0]!r})")
                key = self._fused.get(name)
                if key is not None:
                    raise ArgumentError(
                        f"{setter}: parameter {name!r} shares the store key {key!r} with "
                        f"others, and a multiplier applies to whole keys: set multipliers "
                        f"before making the Trainer (their parameters then get keys of "
                        f"their own), or make it with bucket_bytes=0")
        if self._update.replica_optimizers:
            settings = opt.settings()
            if settings != self._replica_settings:
                for local in self._update.replica_optimizers:
                    local.apply_settings(settings)
                self._replica_settings = settings

    @property
    def num_replicas(self) -> int:
        """The replicas of every worker together: what `step()` averages over, and the
        `num_replicas` of a `torch.utils.data.DistributedSampler` that gives each replica
        its own share of the data (with `rank=replica_index(r)`). Every worker must have
        as many replicas (a Trainer on a dist store asks every worker when it is made)."""
        fewest, most = self._replicas_per_worker
        if fewest != most:
            raise ArgumentError(
                f"num_replicas: the workers have between {fewest} and {most} replicas "
                f"each; averaging over every replica (step() without a batch size) needs "
                f"as many on every worker: pass step(batch_size)")
        return most * self._kv.num_workers

    def _count_replicas(self) -> tuple[int, int]:
        """The fewest and the most replicas a worker has (one collective call)."""
        mine = len(self._modules)
        if self._kv.num_workers == 1:
            return mine, mine
        most, fewest = self._kv.workers_max(np.array([mine, -mine]),
                                            "Trainer: replicas per worker")
        return int(-fewest), int(most)

    def replica_index(self, replica: int) -> int:
        """The index among `num_replicas` of this process's replica `replica` (workers in
        rank order, each one's replicas in the order the Trainer was given them)."""
        mine = len(self._modules)
        if isinstance(replica, bool) or not isinstance(replica, numbers.Integral) or not (
                0 <= replica < mine):
            raise ArgumentError(f"replica={replica!r}: expected an int in [0, {mine})")
        return self._kv.rank * mine + int(replica)

    def _scale_for(self, batch_size) -> float:
        """The optimizer's rescale_grad for `batch_size` (gluon's: given / batch_size), or
        for the mean over every replica when it is None: ArgumentError unless it and
        1/batch_size are finite normal numbers."""
        if batch_size is None:
            return self._scale / self.num_replicas
        if isinstance(batch_size, torch.Tensor) and batch_size.numel() == 1 \
                and not batch_size.dtype.is_complex and batch_size.dtype != torch.bool:
            batch_size = batch_size.item()  # (`len(labels)` as a tensor: one number)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real):
            raise ArgumentKindError(f"batch_size={batch_size!r}: expected a number > 0, "
                                    f"got {type(batch_size).__name__}")
        try:
            size = float(batch_size)
        except OverflowError:
            size = math.inf
        if not size > 0:
            raise ArgumentError(f"batch_size={batch_size!r}: expected a number > 0")
        # The optimizers' kernels take the rescale as a float32: a float64 normal can be a
        # float32 subnormal (flushed to zero on a GPU) or infinity there.
        for what, value in (("1/batch_size", 1.0 / size),
                            ("rescale_grad/batch_size", self._scale / size)):
            if not (math.isfinite(value) and _F32_TINY <= abs(value) <= _F32_MAX):
                raise ArgumentError(f"batch_size={batch_size!r}: {what} is {value!r}, not a "
                                    f"finite normal number; it would turn the weights into "
                                    f"NaN, infinities or leave them unchanged")
        return self._scale / size

    def _set_scale(self, scale: float) -> None:
        self._optimizer.rescale_grad = scale
        for opt in self._update.replica_optimizers:
            opt.rescale_grad = scale

    def _gather(self, ignore_stale_grad: bool, op: str = "Trainer.step") -> Reduction:
        """The gradients to sum: the buckets to step, checked (see
        `GradientCollector.collect`), less what the early reductions pushed. The checks
        count as a push's (`op` names it): a worker refusing its gradients alone (a
        parameter its forward pass left out, without ignore_stale_grad) makes the others
        raise a PeerMismatchError naming the refusal in their push at once (their early
        reductions' included) where pushes are collective (num_servers=0)."""
        with self._kv.refusals_agreed(op):
            self._grads.check_trainable()
            self._rows.check_assigned()  # (before the collector takes them into the buckets)
            live = self._grads.collect(ignore_stale_grad)
        started, current = (set(), set()) if self._early is None else self._early.finish()
        # (agreed where the reduction says: after the pushes the early reductions began)
        return Reduction(self._buckets, live, self._early, started, current,
                         self._agreed if ignore_stale_grad else None)

    def _agreed(self, live: list) -> list:
        """The buckets that some worker steps: on a store of several workers every one
        pushes the same keys (a worker without gradients for one pushes zeros)."""
        if self._kv.num_workers == 1:
            return live
        mine = {id(b) for b in live}
        steps = self._kv.workers_max([int(id(b) in mine) for b in self._buckets],
                                     "Trainer.step: the buckets with gradients")
        return [b for b, yes in zip(self._buckets, steps) if yes]

    def _stepped(self) -> None:
        """A step or an update is done (`_gradients_used`), one step more: a snapshot
        when one is due."""
        self._gradients_used()
        self._steps += 1
        if self._torch_view is not None:
            self._torch_view.stepped()
        if self._checkpoints is not None and self._checkpoints.due(self._steps):
            self._take_due_snapshot(self._checkpoints)

    def _take_due_snapshot(self, checkpoints: Checkpoints) -> None:
        """The snapshot due after the step just taken. Where an earlier snapshot failed
        to be written, its CheckpointError comes once this step's snapshot has started
        all the same (every worker meets that error at once, so every one starts it
        again), and says that the step was taken: taking it again would apply it twice."""
        try:
            checkpoints.take(self._steps, self.user_state)
            return
        except CheckpointError as exc:
            earlier = exc
        try:
            checkpoints.take(self._steps, self.user_state)
        except CheckpointError as exc:
            raise CheckpointError(f"step {self._steps} was taken (do not take it again), "
                                  f"but its snapshot could not be: {exc}") from exc
        raise CheckpointError(f"step {self._steps} was taken (do not take it again) and "
                              f"its snapshot started, but an earlier one failed: "
                              f"{earlier}") from earlier

    def _start_step(self, ignore_stale_grad) -> None:
        """What every step checks and takes first: the modules are still this Trainer's,
        the flag is a bool, and a torch scheduler's rate."""
        self._check_owner()
        if self._optimizer_held_from is False:  # (closed, then stepped again)
            with self._kv.refusals_agreed("Trainer.step"):
                self._optimizer_held_from = optimizer_claims.claim(self._optimizer,
                                                                   self._kv)
        _check_flag("ignore_stale_grad", ignore_stale_grad)
        self._check_low_rank_keys()
        self._take_scheduled()

    def _check_low_rank_keys(self) -> None:
        """ArgumentError where PowerSGD, set on the store after the Trainer was made,
        would find its matrices flattened into buckets, which it sends uncompressed."""
        comp = self._kv.gradient_compression
        if comp is None or not low_rank_compressor(comp):
            return
        fused = [n for b in self._buckets if b.fused
                 for n, p in zip(b.names, b.params[0]) if p.dim() >= 2]
        if fused:
            raise ArgumentError(
                f"the store compresses with PowerSGD, set after this Trainer was made: "
                f"its buckets hold parameter {fused[0]!r} flattened with others, which "
                f"PowerSGD would send uncompressed ({len(fused)} such matrices); make the "
                f"Trainer with compression_params={comp!r}, which gives every matrix a "
                f"key of its own")

    def _take_scheduled(self) -> None:
        """The options a torch scheduler wrote into `torch_optimizer`'s group since the
        last step, all checked before this step changes anything; an option set on
        `trainer.optimizer` itself since then shows in the group instead (each option
        apart: the last change wins)."""
        if self._torch_view is not None:
            self._sync_view(take=True)

    def _sync_view(self, take: bool) -> None:
        """`_take_scheduled`'s work; without `take`, only the group's catching up with
        options set on the optimizer (nothing a scheduler wrote is taken)."""
        view = self._torch_view
        assert view is not None
        options = view.scheduled()
        current = optimizer_values(self._optimizer, options)
        if options == self._viewed == current:
            return
        for name, value in options.items():
            if value != self._viewed[name]:  # a scheduler wrote it
                if not take:
                    continue
                if name == "learning_rate":
                    self.set_learning_rate(value)
                else:  # (the replicas' copies take it at the update, with every setting)
                    setattr(self._optimizer, name, value)
            elif current[name] != value:  # set on the optimizer itself
                view.show(name, current[name])
                self._viewed[name] = current[name]
        if take:
            self._viewed = view.scheduled()

    def _check_user_state(self) -> None:
        """ArgumentError before a step changes anything, where the snapshot due after it
        could not save `user_state` (a step done and counted, but not saved, could not be
        taken again)."""
        if self._checkpoints is None or not self._checkpoints.due(self._steps + 1):
            return
        self._checkpoints.check_user_state(self._steps + 1, self.user_state)

    def _wants_overlap(self, overlap: bool | None) -> bool:
        if overlap and not self._update.overlap_allowed:
            raise ArgumentError("overlap=True with update_on_kvstore=True on a "
                                "deterministic store, or with several replicas in a "
                                "process and compression or float16/bfloat16 parameters: "
                                "the early reduction would sum the replicas before the "
                                "store, which needs each replica's gradient (or, for "
                                "16-bit ones, sums them in float32); use "
                                "update_on_kvstore=False")
        if overlap is not None:
            return overlap
        return (self._update.overlap_allowed
                and self._update.overlap_pays(len(self._modules))
                and _on_gpus(self._buckets))


# ------------------------------------------------------------------------ helpers
def _snapshot_stores(trainers) -> list:
    """The stores that snapshot for the Trainers `trainers` (weak references, or None)
    refer to: the store each was given or made, and its snapshots' own."""
    stores: list = []
    for ref in trainers:
        trainer = None if ref is None else ref()
        if trainer is None:
            continue
        for store in (getattr(trainer, "_kv", None),
                      getattr(getattr(trainer, "_checkpoints", None), "store", None)):
            if store is not None and not any(store is s for s in stores):
                stores.append(store)
    return stores


def _finish_writes_of(stores: list) -> None:
    """Wait until the snapshot writes of this process are done when `stores` (those of
    the Trainers taken over) may have started some: the newest snapshot is then whole,
    and is the one resumed (on a dist store, every worker waits for its own parts, and
    the checks that follow, collective, come before any looks). Only this process's
    writes: which Trainers are still alive to take over may differ between workers. A
    write that failed was theirs to raise; the resume starts from the newest complete
    snapshot."""
    if stores:
        snapshots.finish_writes()


def _refuse_shared_optimizer(optimizer: Optimizer, kv: KVStore, passing: list) -> None:
    """ArgumentError when another live store of this process runs `optimizer` (its
    update counts and per-step options would be shared: `gpukv.optim.claims`), unless
    it is `kv` or one of `passing`, the stores of the Trainers taken over."""
    held = optimizer_claims.holder(optimizer, kv, passing)
    if held is not None:
        raise optimizer_claims.refusal(optimizer, held)


def _on_gpus(buckets: list[Bucket]) -> bool:
    """Whether the replicas are on GPUs, where a reduction runs beside backward's kernels."""
    return any(p.is_cuda for b in buckets for p in b.params[0])


#: the environment variables that give a job's process count: MPICH's and Open MPI's
#: mpiexec (`gpukv run` included) and torchrun
_JOB_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")


def _refuse_shared_snapshots(kv: KVStore) -> None:
    """ArgumentError for a one-process store with snapshots inside a job of several
    processes: each would train a model of its own and write (and prune) the others'
    snapshots in the one folder."""
    if kv.num_workers > 1:
        return
    for name in _JOB_SIZE_VARS:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            raise ArgumentError(
                f"checkpoint_dir with a one-process {kv.type!r} store, in a job of {value} "
                f"processes ({name}={value}): each process would train a model of its own "
                f"and overwrite the others' snapshots; make the Trainer on a dist store "
                f"(gpukv.create('dist_sync'), or 'dist_device_sync' on GPUs) so that the "
                f"processes train one model")


def _check_flag(name, value) -> bool:
    if not isinstance(value, bool):
        raise ArgumentKindError(f"{name}: expected True or False, got {type(value).__name__}")
    return value


def _module_list(modules) -> list:
    if isinstance(modules, torch.nn.Module):
        return [modules]
    if not isinstance(modules, (list, tuple)) or not modules:
        raise ArgumentKindError(f"modules: expected a torch.nn.Module or a non-empty list "
                                f"of them, got {type(modules).__name__}")
    for i, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise ArgumentKindError(f"modules[{i}]: expected a torch.nn.Module, got "
                                    f"{type(m).__name__}")
    if len({id(m) for m in modules}) != len(modules):
        raise ArgumentError("modules: the same module is given twice; give one replica "
                            "per device")
    return list(modules)


def _make_optimizer(optimizer, optimizer_params) -> Optimizer:
    if isinstance(optimizer, Optimizer):
        if optimizer_params:
            raise ArgumentError("optimizer_params must be None when optimizer is a "
                                "gpukv.optim.Optimizer (set its options on it)")
        return optimizer
    if not isinstance(optimizer, str):
        raise ArgumentKindError(f"optimizer: expected a name or a gpukv.optim.Optimizer, "
                                f"got {type(optimizer).__name__}")
    if optimizer_params is not None and not isinstance(optimizer_params, dict):
        raise ArgumentKindError(f"optimizer_params: expected a dict, got "
                                f"{type(optimizer_params).__name__}")
    return create_optimizer(optimizer, **(optimizer_params or {}))


def _make_store(kvstore, deterministic: bool | None) -> KVStore:
    if isinstance(kvstore, KVStore):
        if deterministic is not None and deterministic != kvstore.deterministic:
            raise ArgumentError(f"deterministic={deterministic!r}: the store given as kvstore "
                                f"was made with deterministic={kvstore.deterministic}; make "
                                f"it with the option, or pass the store's name")
        return kvstore
    if not isinstance(kvstore, str):
        raise ArgumentKindError(f"kvstore: expected a store name or a gpukv.KVStore, got "
                                f"{type(kvstore).__name__}")
    return create(kvstore, deterministic=deterministic)

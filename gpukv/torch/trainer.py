"""`Trainer`: apply an optimizer to the parameters of several replicas through a store."""
from __future__ import annotations

import contextlib
import copy
import math
import numbers
from collections.abc import Iterator

import numpy as np
import torch

from .._errors import ArgumentError, ArgumentKindError
from ..api.factory import create
from ..checkpoints.snapshots import Snapshot
from ..optim import LAMB, Optimizer
from ..optim import create as create_optimizer
from ..store.base import KVStore
from .buckets import BUCKET_BYTES, Bucket, flatten, frozen, make_buckets, trainable
from .checkpoints import Checkpoints
from .fresh import FreshGrads
from .overlap import OWNER, EarlyReduction

#: the float32 limits the optimizers' rescale must keep to
_F32 = np.finfo(np.float32)


class Trainer:
    """Apply an optimizer to the parameters of several replicas through a gpukv store.

    modules: a `torch.nn.Module`, or a list of them (one per device, same architecture;
    with a dist store, this process's replicas: every process passes its own, and
    `step(batch_size)` takes the batch of every worker together).
    optimizer: a name for `gpukv.optim.create` (with `optimizer_params`) or a
    `gpukv.optim.Optimizer`. kvstore: a store name for `gpukv.create` or a `KVStore`.
    compression_params: gradient compression for the store (see
    `KVStore.set_gradient_compression`). update_on_kvstore: True runs the optimizer on the
    store; False sums the gradients on the store, pulls them into every replica's `.grad`
    and runs the optimizer on each replica (on a local store per replica).
    bucket_bytes: capacity of a fused key; 0 gives every parameter its own key. LAMB,
    whose trust ratio is per key, always gets one key per parameter; so does every
    parameter named in the optimizer's multipliers (`set_lr_mult`, `set_wd_mult`) when
    the Trainer is made. A multiplier set later on a parameter that shares a key is an
    ArgumentError at the next step (set multipliers first, or use bucket_bytes=0).

    The parameters with requires_grad=False when the Trainer is made are left out for
    good: one made trainable later is an ArgumentError at the next step (make a new
    Trainer after unfreezing). Every replica must have the same parameters, each
    trainable in all of them or in none. A gradient backward has not written since the
    last step is stale: an error at the step unless `ignore_stale_grad` (see `step`); a
    post-accumulate-grad hook on every parameter of every replica marks the gradients
    backward writes (measured: about 1 microsecond each per backward pass).
    To change the optimizer: `set_learning_rate`, or `optimizer.set_lr_mult` /
    `set_wd_mult` as above; for anything else (another kind, momentum, wd), make a new
    Trainer on the same modules and a new store: it starts from their weights as they
    are, with a fresh optimizer state.

    overlap: start each bucket's gradient reduction from backward, as soon as every
    replica has produced the bucket's gradients (post-accumulate-grad hooks and one
    background thread), so that it overlaps the rest of backward; the update and the pull
    of the weights stay in `step`, which waits for those reductions and does the rest.
    None (the default) turns it on for replicas on GPUs, where the reduction runs on the
    devices beside backward's kernels. With CPU replicas backward and the reduction (sums,
    or MPI's copies and polling) share the same cores, and on a machine with none to spare
    it costs more than it saves (benchmarks/bench_trainer_dist.py); pass True to have it
    anyway. The hooks cost backward a few microseconds of Python per parameter and
    replica (measured: about 5, so 20 ms a step for 1000 small parameters on 4 replicas):
    for a model of very many tiny parameters, time it with and without. On a dist store it
    pays most with update_on_kvstore=False (the optimizer then runs in every process, as
    with DDP). With update_on_kvstore=True the early reduction goes to a second,
    optimizer-less store of this process (one more gradient-sized buffer per bucket), and
    the update runs on the store at the step. A reduction pushes a snapshot of the
    bucket's gradients (one more gradient-sized buffer per replica); a gradient changed
    after its bucket's reduction started (by a second backward pass, clipping, a new
    `.grad` tensor, any write) differs from it at the step, which then reduces that bucket
    again (on a dist store, on every process): the result is right, but the early work is
    lost. For gradient accumulation, wrap every backward pass of a step but the last in
    `no_sync()`.

    deterministic: sum every gradient in the canonical order (see `gpukv.create`), so the
    weights are the same bits for any strategy, devices per process, servers or
    bucket_bytes; None: the store's default (GPUKV_DETERMINISTIC). With a store given as
    kvstore it must match the store's. With update_on_kvstore=True, overlap stays off
    (True is an ArgumentError): it would sum the replicas' gradients before the store.

    checkpoint_dir: a folder (shared by every process of a dist store) for numbered
    snapshots of the weights, the optimizer's state, `steps` and `user_state` (see
    `KVStore.snapshot`). A Trainer made with a folder that holds a complete snapshot
    starts from it, on any number of workers, processes or servers, and says so on one
    line. checkpoint_every: take one after every that many steps (None: only when
    `snapshot()` is called); a step only copies the state into host buffers, and a
    background thread writes it. checkpoint_keep: how many complete snapshots to keep.
    A snapshot due at a step is taken at its end, with `user_state` as it is then: set
    `user_state` before `step()` to what the next step needs (the data position after
    this step's batch, the RNG states after drawing it).
    """

    def __init__(self, modules, optimizer, optimizer_params=None, kvstore="device",
                 compression_params=None, update_on_kvstore=True, *,
                 bucket_bytes: int = BUCKET_BYTES, overlap: bool | None = None,
                 checkpoint_dir=None, checkpoint_every: int | None = None,
                 checkpoint_keep: int = 2, deterministic: bool | None = None):
        self._modules = _module_list(modules)
        self._optimizer = _make_optimizer(optimizer, optimizer_params)
        self._scale = self._optimizer.rescale_grad
        self._kv = _make_store(kvstore, deterministic)
        self._update_on_kvstore = _check_flag("update_on_kvstore", update_on_kvstore)
        if overlap is not None:
            _check_flag("overlap", overlap)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) \
                or bucket_bytes < 0:
            raise ArgumentError(f"bucket_bytes={bucket_bytes!r}: expected an int >= 0")
        if isinstance(self._optimizer, LAMB):
            bucket_bytes = 0
        checkpoints = self._checkpoint_options(checkpoint_dir, checkpoint_every,
                                               checkpoint_keep)
        names, params = trainable(self._modules)
        #: (name, replica, tensor) of the parameters frozen now, which the Trainer leaves out
        self._frozen: list = frozen(self._modules)
        alone = set(self._optimizer.lr_mult) | set(self._optimizer.wd_mult)
        self._buckets: list[Bucket] = make_buckets(names, params, int(bucket_bytes), alone)
        #: parameter name -> the key it shares with others
        self._fused: dict = {n: b.key for b in self._buckets if b.fused for n in b.names}
        self._fresh: FreshGrads = FreshGrads(self._buckets)
        #: the buckets allreduce_grads() summed, for the update() that follows it
        self._reduced: list | None = None
        for bucket in self._buckets:
            flatten(bucket, len(self._modules))
        if compression_params is not None:
            self._kv.set_gradient_compression(compression_params)
        self._local: list = []  # with update_on_kvstore=False: one store per replica
        self._local_opts: list = []  # and its optimizer
        self._init_store()
        #: steps (and updates) done, counted on from a snapshot resumed from
        self._steps: int = 0
        #: what the user keeps current for a resume (a data loader's position, RNG
        #: states): saved in every snapshot, given back by a resume
        self.user_state: dict = {}
        self._checkpoints: Checkpoints | None = None
        if checkpoints is not None:
            self._start_checkpoints(*checkpoints)
        self._early: EarlyReduction | None = None
        self._sums: KVStore | None = None  # the early reductions' store, when not _kv
        if self._wants_overlap(overlap):
            self._start_overlap()
        else:
            for bucket in self._buckets:
                for params in bucket.params:
                    for p in params:
                        setattr(p, OWNER, None)  # an earlier Trainer's hooks stop here

    # ------------------------------------------------------------------ properties
    @property
    def kvstore(self) -> KVStore:
        return self._kv

    @property
    def optimizer(self) -> Optimizer:
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
        """Whether gradient reductions start from backward (see the class's help)."""
        return self._early is not None

    @property
    def steps(self) -> int:
        """Steps (and updates) done, counted from the snapshot the Trainer resumed from."""
        return self._steps

    @property
    def resumed_from(self) -> Snapshot | None:
        """The snapshot the Trainer started from (its `path`, `step`, `workers`), or None."""
        return None if self._checkpoints is None else self._checkpoints.resumed

    @property
    def learning_rate(self) -> float:
        return self._optimizer.learning_rate

    def set_learning_rate(self, lr) -> None:
        """Set the optimizer's learning rate (not with an lr_scheduler, as in MXNet)."""
        self._optimizer.set_learning_rate(lr)
        for opt in self._local_opts:
            opt.set_learning_rate(lr)

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

    def zero_grad(self) -> None:
        """Zero every replica's gradients in place (the views stay the `.grad` tensors)."""
        try:
            if self._early is not None:
                self._early.finish()  # they read the gradients: wait for them
        finally:
            self._zero_grads()

    def _zero_grads(self) -> None:
        with torch.no_grad():
            for bucket in self._buckets:
                for r, grad in enumerate(bucket.grads):
                    grad.zero_()
                    for p, view in zip(bucket.params[r], bucket.views[r]):
                        if p.grad is not view:  # set to None or replaced since
                            p.grad = view

    def step(self, batch_size, ignore_stale_grad: bool = False) -> None:
        """Push every replica's gradients (rescaled by 1/batch_size), update, pull weights.

        A gradient backward has not written since the last step (`.grad` None, or left
        as it was: a step without backward, backward on only some replicas, a parameter
        the forward pass did not use) is stale: an ArgumentError naming the parameters
        and the replica, before anything changes, unless `ignore_stale_grad`. Then a stale
        gradient is zeroed and contributes nothing, and a parameter stale in every replica
        is left out of the step when it has its own key (in a fused key it gets a zero
        gradient); on a dist store every worker passes the same flag.
        """
        scale = self._scale_for(batch_size)
        self._check_multipliers()
        live, early = self._gather(ignore_stale_grad)
        self._set_scale(scale)
        keys = [b.key for b in live]
        if not self._update_on_kvstore:
            self._allreduce(live, early)
            self._local_update(live)
        elif self._sums is None:
            if keys:
                self._kv.push(keys, [b.grads for b in live])
                self._kv.pull(keys, out=[b.weights for b in live])
        elif keys:
            self._reduce(self._sums, live, early)
            summed = [b.summed for b in live]
            self._sums.pull(keys, out=summed)
            self._kv.push(keys, summed)
            self._kv.pull(keys, out=[b.weights for b in live])
        self._stepped()

    def allreduce_grads(self, ignore_stale_grad: bool = False) -> None:
        """Sum the gradients of every replica on the store and pull the sum into each
        replica's `.grad` (with update_on_kvstore=False only, as in gluon). Stale
        gradients are refused, or with `ignore_stale_grad` left out, as by `step`; the
        `update` that follows takes the sums as they are."""
        self._need_local_update("allreduce_grads")
        self._reduced = None  # a failed call leaves no earlier sums for update() to take
        live, early = self._gather(ignore_stale_grad)
        self._allreduce(live, early)
        self._reduced = live

    def update(self, batch_size, ignore_stale_grad: bool = False) -> None:
        """Run the optimizer on every replica with its (already summed) gradients,
        rescaled by 1/batch_size (with update_on_kvstore=False only, as in gluon). After
        `allreduce_grads` it updates what that summed; else stale gradients are checked
        as by `step`."""
        self._need_local_update("update")
        scale = self._scale_for(batch_size)
        self._check_trainable()
        self._check_multipliers()
        live = self._reduced
        if live is None:
            live = self._collect_grads(ignore_stale_grad)
        else:  # a .grad replaced since (clipping out of place) is what gets applied
            with torch.no_grad():
                for p, view, grad in self._replaced_grads():
                    _adopt(p, view, grad)
        self._set_scale(scale)
        self._local_update(live)
        self._stepped()

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

    def save_states(self, path) -> None:
        """Write the optimizer's state (atomically) to `path`."""
        store = self._kv if self._update_on_kvstore else self._local[0]
        store.save_optimizer_states(path)

    def load_states(self, path) -> None:
        """Restore the optimizer's state `save_states` wrote (CheckpointError if it does
        not fit; nothing changes then)."""
        # The first load checks the file whole: if it fails, nothing has changed.
        for store in [self._kv] if self._update_on_kvstore else self._local:
            store.load_optimizer_states(path)

    # ------------------------------------------------------------------ internals
    def _checkpoint_options(self, directory, every, keep) -> tuple | None:
        """The snapshot options, checked before anything changes."""
        if directory is None:
            if every is not None:
                raise ArgumentError("checkpoint_every needs a checkpoint_dir")
            return None
        Checkpoints.check(directory, every, keep)
        return directory, every, keep

    def _start_checkpoints(self, directory, every, keep) -> None:
        """Resume from the newest complete snapshot in `directory`, if there is one."""
        keys = [b.key for b in self._buckets]
        replicas = None if self._update_on_kvstore else self._local
        # With update_on_kvstore=False, replica 0's store holds the state (alike on every
        # worker); a dist store has each of its workers write a share of it.
        store = self._local[0] if replicas and self._kv.num_workers == 1 else self._kv
        self._checkpoints = Checkpoints(directory, every, keep, store, keys, replicas)
        resumed = self._checkpoints.resume()
        if resumed is None:
            return
        self._steps, self.user_state = resumed
        if not keys:
            return
        if replicas is None:
            self._kv.pull(keys, out=[b.weights for b in self._buckets])
            return
        for r, local in enumerate(self._local):
            local.pull(keys, out=[b.weights[r] for b in self._buckets])

    def _init_store(self) -> None:
        """The store starts from replica 0's weights, and every replica from the store."""
        keys = [b.key for b in self._buckets]
        if keys:
            self._kv.init(keys, [b.weights[0] for b in self._buckets])
            self._kv.pull(keys, out=[b.weights for b in self._buckets])
        if self._update_on_kvstore:
            self._kv.set_optimizer(self._optimizer)
            return
        # One store per replica, each with its own copy of the optimizer (the same
        # arithmetic on the same summed gradients keeps the replicas equal).
        kind = "local" if self._kv.type == "local" else "device"
        for r in range(len(self._modules)):
            store = create(kind)
            if keys:
                store.init(keys, [b.weights[r] for b in self._buckets])
            opt = copy.deepcopy(self._optimizer)
            store.set_optimizer(opt)
            self._local.append(store)
            self._local_opts.append(opt)

    def _check_multipliers(self) -> None:
        """ArgumentError if a multiplier names a parameter that shares its key (it would
        apply to no key, silently); else the replicas' optimizers take them too."""
        opt = self._optimizer
        for table, setter in ((opt.lr_mult, "set_lr_mult"), (opt.wd_mult, "set_wd_mult")):
            for name in table:
                key = self._fused.get(name)
                if key is not None:
                    raise ArgumentError(
                        f"{setter}: parameter {name!r} shares the store key {key!r} with "
                        f"others, and a multiplier applies to whole keys: set multipliers "
                        f"before making the Trainer (their parameters then get keys of "
                        f"their own), or make it with bucket_bytes=0")
        for local in self._local_opts:
            local.lr_mult, local.wd_mult = dict(opt.lr_mult), dict(opt.wd_mult)

    def _scale_for(self, batch_size) -> float:
        """The optimizer's rescale_grad for `batch_size` (gluon's: given / batch_size):
        ArgumentError unless it and 1/batch_size are finite normal numbers."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real):
            raise ArgumentError(f"batch_size={batch_size!r}: expected a number > 0")
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
            if not (math.isfinite(value) and _F32.tiny <= abs(value) <= _F32.max):
                raise ArgumentError(f"batch_size={batch_size!r}: {what} is {value!r}, not a "
                                    f"finite normal number; it would turn the weights into "
                                    f"NaN, infinities or leave them unchanged")
        return self._scale / size

    def _set_scale(self, scale: float) -> None:
        self._optimizer.rescale_grad = scale
        for opt in self._local_opts:
            opt.rescale_grad = scale

    def _check_trainable(self) -> None:
        """ArgumentError naming the parameters frozen when the Trainer was made and
        trainable now: they have no key, and would get gradients that nothing applies."""
        thawed = [(name, r) for name, r, p in self._frozen if p.requires_grad]
        if thawed:
            name, r = thawed[0]
            raise ArgumentError(
                f"parameter {name!r} of replica {r} had requires_grad=False when the Trainer "
                f"was made and is trainable now: the Trainer leaves out the parameters "
                f"frozen when it is made; make a new Trainer after unfreezing it "
                f"({len(thawed)} such parameter(s) in all)")

    def _gather(self, ignore_stale_grad: bool) -> tuple[list, tuple]:
        """The buckets to reduce, checked (see `_collect_grads`), and the early reductions
        finished: (live buckets, as `_finish_early` gives them)."""
        self._check_trainable()
        live = self._collect_grads(ignore_stale_grad)
        early = self._finish_early()
        if ignore_stale_grad:
            live = self._agreed(live)
        return live, early

    def _collect_grads(self, ignore_stale_grad: bool) -> list:
        """Put every replica's gradient into its bucket view; return the buckets to step.

        Checks every parameter before anything changes.
        """
        stale: list = []  # (bucket, replica, index) of each gradient backward left alone
        adopted: list = []  # (param, view, grad): a new tensor since set_to_none
        for b, bucket in enumerate(self._buckets):
            for r, (params, views) in enumerate(zip(bucket.params, bucket.views)):
                fresh = self._fresh.marks(b, r)
                for i, (p, view) in enumerate(zip(params, views)):
                    grad = p.grad  # one read: a Parameter's .grad is not a cheap attribute
                    if grad is view:
                        if not fresh[i]:
                            stale.append((bucket, r, i))
                    elif grad is None:
                        stale.append((bucket, r, i))
                    else:
                        adopted.append((p, view, grad))
        if stale:
            self._refuse_frozen(stale)  # backward skips a frozen parameter: say why
            if not ignore_stale_grad:
                raise ArgumentError(_stale_message(stale))
        missing: dict = {}
        with torch.no_grad():
            for bucket, r, i in stale:
                bucket.views[r][i].zero_()
                missing[id(bucket)] = missing.get(id(bucket), 0) + 1
            for p, view, grad in adopted:
                _adopt(p, view, grad)
        replicas = len(self._modules)
        return [b for b in self._buckets if b.fused or missing.get(id(b), 0) < replicas]

    def _replaced_grads(self) -> list:
        """(param, view, grad) of each gradient that is a new tensor, not its view."""
        return [(p, view, p.grad) for bucket in self._buckets
                for params, views in zip(bucket.params, bucket.views)
                for p, view in zip(params, views)
                if p.grad is not None and p.grad is not view]

    def _refuse_frozen(self, stale: list) -> None:
        """ArgumentError naming a stale parameter that is frozen now (it was trainable when
        the Trainer was made): its key would still move it (weight decay, momentum)."""
        for bucket, r, i in stale:
            if not bucket.params[r][i].requires_grad:
                raise ArgumentError(
                    f"parameter {bucket.names[i]!r} of replica {r} was trainable when the "
                    f"Trainer was made and is frozen now: its key would still move it "
                    f"(weight decay, momentum); make a new Trainer after freezing it")

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
        """A step or an update used the gradients: none is fresh any more. One step
        more is done: a snapshot when one is due."""
        self._fresh.clear()
        self._reduced = None
        self._steps += 1
        if self._checkpoints is not None and self._checkpoints.due(self._steps):
            self._checkpoints.take(self._steps, self.user_state)

    def _allreduce(self, live, early: tuple) -> None:
        """Sum every live bucket's gradients on the store, into every replica's."""
        self._reduce(self._kv, live, early)
        keys = [b.key for b in live]
        if keys:
            self._kv.pull(keys, out=[b.grads for b in live])

    def _reduce(self, store: KVStore, live: list, early: tuple) -> None:
        """Push to `store` the gradients of the live buckets that `early` (the bucket
        indices whose early reduction started, and those of them still current) leaves
        to do."""
        if self._early is None:
            if live:
                store.push([b.key for b in live], [b.grads for b in live])
            return
        started, current = early
        alive = {id(b) for b in live}
        order = [i for i in self._early.order if id(self._buckets[i]) in alive]
        if store.num_workers == 1:
            rest = [self._buckets[i] for i in order if i not in current]
            if rest:
                store.push([b.key for b in rest], [b.grads for b in rest])
            return
        # Every process pushes every bucket once, in one order: the early reductions
        # did the start of it, this process's own share of which varies. Then a bucket
        # stale on any process is pushed again by all (sums of current gradients).
        stale = [int(i in started and i not in current) for i in range(len(self._buckets))]
        again = store.workers_max(stale, "Trainer.step: the gradients to reduce again")
        for i in [i for i in order if i not in started] + [i for i in order if again[i]]:
            store.push(self._buckets[i].key, self._buckets[i].grads)

    # ---------------------------------------------------------------- overlap
    def _wants_overlap(self, overlap: bool | None) -> bool:
        # With the optimizer on the store, an early reduction pushes this process's sum,
        # one value where the canonical order needs each replica's own.
        presums = self._update_on_kvstore and self._kv.deterministic
        if overlap and presums:
            raise ArgumentError("overlap=True with a deterministic store and "
                                "update_on_kvstore=True: the early reduction would sum the "
                                "replicas before the store; use update_on_kvstore=False")
        if overlap is not None:
            return overlap
        return not presums and any(p.is_cuda for b in self._buckets for p in b.params[0])

    def _start_overlap(self) -> None:
        """Hooks that start the reductions early, into the store that runs no optimizer:
        the store itself with update_on_kvstore=False, else one more of this process."""
        if self._update_on_kvstore:
            self._sums = create("local" if self._kv.type == "local" else "device")
            for bucket in self._buckets:
                bucket.summed = torch.zeros_like(bucket.grads[0])
            self._sums.init([b.key for b in self._buckets],
                            [b.summed for b in self._buckets])
        target = self._kv if self._sums is None else self._sums
        self._early = EarlyReduction(
            self._buckets, lambda bucket, grads: target.push(bucket.key, grads))

    def _finish_early(self) -> tuple[set, set]:
        """Wait for the early reductions: the indices of the buckets whose reduction
        started, and of those whose reduction holds their gradients as they are now."""
        if self._early is None:
            return set(), set()
        return self._early.finish()

    def _need_local_update(self, op: str) -> None:
        if self._update_on_kvstore:
            raise ArgumentError(f"{op}() runs the optimizer on each replica; create the "
                                f"Trainer with update_on_kvstore=False to use it")

    def _local_update(self, live) -> None:
        keys = [b.key for b in live]
        if not keys:
            return
        for r, store in enumerate(self._local):
            store.push(keys, [b.grads[r] for b in live])
            store.pull(keys, out=[b.weights[r] for b in live])


# ------------------------------------------------------------------------ helpers
def _adopt(p, view, grad) -> None:
    """A .grad replaced by a new tensor goes into its bucket view, the .grad again."""
    view.copy_(grad)
    p.grad = view


def _stale_message(stale: list) -> str:
    """The stale gradients of the lowest-numbered replica that has some, named."""
    r = min(rr for _, rr, _ in stale)
    names = [bucket.names[i] for bucket, rr, i in stale if rr == r]
    shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
    return (f"parameter{'s' if len(names) > 1 else ''} {shown} of replica {r}: stale "
            f"gradient ({len(names)} in this replica, {len(stale)} in all): backward has "
            f"not written it since the last step (.grad is None or as it was; a step "
            f"without backward, backward on some replicas only, or a parameter the forward "
            f"pass did not use); call step(..., ignore_stale_grad=True) to leave it out")


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

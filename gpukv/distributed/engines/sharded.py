"""`num_servers=0`: every process is a worker and serves a shard of the keys.

A sync round is a reduce-scatter of the round's gradients to their owners, the update
there (on the owner's shard only: optimizer state is sharded, never replicated), and an
all-gather of the new values into every process's copy. This engine does what every
round needs whatever moves the data: keys made anywhere agreed on before the next
collective call, every round agreed on first (`agree.Agreement`), so processes that call
different things fail with a PeerMismatchError instead of mixing data, the update of the
pieces served here, and the checkpoints of the shards. The data moves through its
rounds: `mpi_rounds.MpiRounds` for host arrays, `nccl_rounds.NcclRounds` for a store on
GPUs.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..._errors import ArgumentError, CheckpointError, GpukvError, PeerError
from ...encoding.compressors import (
    Compressor,
    ErrorFeedback,
    compresses_key,
    compressible,
    make_compressor,
)
from ...encoding.pulls import PullCodec
from ...layout.state import cut, mark_starts, merge
from ..mpi.agree import Agreement, optimizer_named, refuse_split, to_rank0
from ..mpi.transport import Transport
from . import residuals
from .control import WorkerControl
from .layout import KeyLayout
from .mpi_rounds import MpiRounds
from .nccl_rounds import NcclRounds
from .partials import check_partials
from .protocol import Shard
from .update_order import UpdateOrder


class ShardedRounds:
    """The S = 0 engine of a dist store (see the module's docstring).

    `shard` is this process's part of the store (see `engine.Shard`): it adopts the pieces
    this process serves, inside its copies, and updates them. Pieces of split keys are
    stored flat. `device`: the GPU every key lives on, whose rounds run through NCCL
    (None: host arrays, over MPI). Implements `engine.Engine`.
    """

    #: a round leaves every process's copy of its keys current
    round_updates_replicas = True
    control: WorkerControl
    # what its data paths read (`protocol.RoundState`)
    t: Transport
    agree: Agreement
    shard: Shard
    layouts: dict
    assigns: bool
    compressor: Compressor | None
    feedback: ErrorFeedback | None
    pulls: PullCodec | None

    def __init__(self, transport: Transport, shard: Shard, bound: int,
                 deterministic: bool = False, device=None):
        if deterministic and device is not None:
            raise ArgumentError("NCCL's sums have no fixed order: a deterministic engine "
                                "sums host arrays")
        self.t = transport
        self.control = WorkerControl(transport, self.flush)
        self.agree = self.control.agree
        self.deterministic = deterministic  # push gets Partials, summed as the tree does
        self.compressor = None
        self.feedback = None        # ErrorFeedback: residuals per (key, piece start)
        self.pulls = None           # PullCodec of a compressor that compresses pulls
        self.shard = shard
        self.bound = bound
        self.layouts: dict = {}
        self.assigns = True         # no updater yet: a round assigns the sum
        self._pending: list = []    # (key, replica) made here, not agreed on yet
        self._refused: list = []    # (kind, words) of calls making keys refused here, too
        self._rule = ""             # the updater, as the agreement of a round names it
        self._settings = None       # the options of the optimizer that `_rule` names
        self._optimizer = None      # the optimizer the shard runs (None: none)
        self._order = UpdateOrder()  # the keys made, for the optimizer's counts
        self.rounds: MpiRounds | NcclRounds
        if device is None:
            self.rounds = MpiRounds(self)
        else:
            self.rounds = NcclRounds(self, device)

    @property
    def pending(self) -> bool:
        """Whether keys made here (or refused here: `refused_keys`) wait for the next
        collective call to be agreed on."""
        return bool(self._pending or self._refused)

    # ------------------------------------------------------------------- init
    def init(self, keys, replicas) -> None:
        """Queue new keys (`replicas`: this process's copies, holding its init value):
        they are agreed on, and take rank 0's value, before the next collective call,
        so processes may create keys in any order between two calls."""
        self.t.check()
        self._pending.extend(zip(keys, replicas))
        self._order.made(keys)

    def check_new_keys(self, keys: list, values: list) -> None:
        """What the optimizer set refuses of keys about to be made (`refuse_split`)."""
        refuse_split(self._optimizer, {k: KeyLayout.of(k, v.shape, v.dtype, self.t.size,
                                                       self.bound)
                                       for k, v in zip(keys, values)}, "processes")

    def refused_keys(self, op: str, error: Exception) -> bool:
        """This process refused a call that makes keys (`op`: an init, a broadcast) where
        the others may have made them: told where their keys are agreed on, at the next
        collective call (`flush`), rather than by a collective call of its own (an init
        is none). Refused alike everywhere, the same refusals agree and the store goes
        on; refused here alone, every process raises a PeerMismatchError there naming
        the refusal and its words (which need not match, as the kind must). True: told
        at that call."""
        self.t.check()
        self._refused.append((f"{op} refused ({type(error).__name__})", str(error)))
        return True

    def flush(self, during: str) -> None:
        """Agree on the queued keys: same shapes and dtypes everywhere, rank 0's values;
        the first step of the collective call `during` names (and its errors name it).
        Calls making keys that were refused here are agreed on first, in their place."""
        if not self._pending and not self._refused:
            return
        pending = sorted(self._pending, key=lambda p: p[0])
        refused = sorted(self._refused)  # (by kind: their order may differ by process)
        self._pending, self._refused = [], []
        if refused:
            kinds = ", ".join(kind for kind, _ in refused)
            self.agree.check((kinds, ()), f"{during}: first the calls refused before it "
                                          f"({kinds})",
                             note="; ".join(words for _, words in refused))
            if not pending:
                return
        signature = ("init", tuple((k, r.shape, r.dtype.name) for k, r in pending))
        what = f"{during}: first the keys made before it (init of key {pending[0][0]!r})"
        self.agree.check(signature, what)
        self.rounds.share_values(pending, f"{what}: rank 0's values")
        keys, views = [], []
        for key, replica in pending:
            layout = KeyLayout.of(key, replica.shape, replica.dtype, self.t.size,
                                  self.bound)
            self.layouts[key] = layout
            for piece in layout.served_by(self.t.rank):  # served in place, in this copy
                keys.append(key)
                views.append(replica.reshape(-1)[piece.start:piece.stop] if layout.split
                             else replica)
        self.shard.adopt(keys, views)
        self.rounds.forget()

    # ------------------------------------------------------------------- push
    def push(self, keys, grads, replicas) -> None:
        """One sync round: the sum over processes of each key's `grads` updates the key at
        its owner(s); every process's `replicas` then hold the new values."""
        if not keys:
            self.flush("push")
            return
        if len(keys) > 1:
            order = sorted(range(len(keys)), key=keys.__getitem__)
            keys = tuple(keys[i] for i in order)
            grads = [grads[i] for i in order]
            replicas = [replicas[i] for i in order]
        else:
            keys = tuple(keys)
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        what = f"push of key {keys[0]!r}{more}"
        comp = self.compressor
        counts = (check_partials(keys, grads, [(r.size, r.dtype) for r in replicas],
                                 self.t.rank, self.t.size,
                                 [compresses_key(comp, r.dtype, r.shape) for r in replicas])
                  if self.deterministic else None)
        self.flush(what)
        wire = None if comp is None else tuple(sorted(comp.params().items()))
        # Every process must round alike: the same compression, updater or not, and the
        # same optimizer options (each process runs its own on its shard).
        op = ("push" + ("" if wire is None else f" compressed with {dict(wire)}")
              + (" assigning the sum" if self.assigns else f" updating with {self._rule}"))
        if self.pulls is not None and not self.assigns:  # updated apart from the copies
            rank = self.t.rank
            self.shard.keep_apart([k for k, r in zip(keys, replicas) if compressible(r.dtype)
                                   and self.layouts[k].served_by(rank)])
        if counts is None:
            by_key = dict(zip(keys, zip(grads, replicas)))
            alongside, fused = self.rounds.openers(keys, by_key)
            started = self.agree.check((op, keys), what, alongside=alongside, fused=fused)
            with self._counted(keys):
                self.rounds.round(keys, by_key, what, started)
            return
        # the count of values each process pushes shapes the tree: every one must agree
        self.agree.check((op + " in the canonical order", tuple(zip(keys, counts))), what)
        assert isinstance(self.rounds, MpiRounds)  # a deterministic engine sums host arrays
        with self._counted(keys):
            self.rounds.canonical_round(keys, tuple(counts),
                                        dict(zip(keys, zip(grads, replicas))), what)

    def _counted(self, keys) -> contextlib.AbstractContextManager:
        """Around a round of `keys`: the optimizer counts every key of it, as one process
        does, where the shard updates those it serves (see `update_order`)."""
        if self._optimizer is None:
            return contextlib.nullcontext()
        return self._optimizer.counting_round(self._order.of(keys))

    def refused(self, op: str, error: Exception) -> None:
        """Every process agrees on the refusal as on a push: all refusing alike changes
        nothing; one alone is a PeerMismatchError on every rank naming it and what its
        error says (the push's collectives never start). The refusal's kind is what must
        match; its words (which may differ a little from process to process refusing
        alike: a shape of its own) are said beside it, not compared."""
        what = f"{op}, refused by rank {self.t.job_rank(self.t.rank)}"
        with self.t.caused_by(error):
            self.flush(what)
            self.agree.check((f"{op} refused ({type(error).__name__})", ()), what,
                             note=str(error))

    def update(self, merged: list, what: str) -> None:
        """Run the updater (or assign) on the pieces served here: (key, summed piece)."""
        if not merged:
            return
        try:
            self.shard.update([k for k, _ in merged], [m for _, m in merged])
        except Exception as exc:  # the updater's: word of it to the others, waiting here
            self.t.lost(PeerError(f"rank {self.t.rank}: the update of {what} failed: "
                                  f"{type(exc).__name__}: {exc}"))
            raise

    def set_compression(self, compressor) -> None:
        """Compress on the wire from now on (every process sets the same, together: the
        store agrees on it first)."""
        self.rounds.refuse(compressor)
        self.compressor = compressor
        self.feedback = ErrorFeedback(compressor) if compressor is not None else None
        self.pulls = (PullCodec(compressor) if compressor is not None
                      and compressor.compresses_pulls else None)
        self.shard.rejoin()  # the values are what every process holds: residuals afresh
        self.rounds.forget()

    # --------------------------------------------------------------- settings
    def set_optimizer(self, optimizer) -> None:
        """Every process runs its own `optimizer` on its shard (they must agree), so that
        changes made to it on every process (the learning rate, ...) count; each counts
        every key of a round, served here or not, as one process does (`_counted`)."""
        self.flush("set_optimizer")
        self.agree.check((f"set_optimizer({optimizer_named(optimizer.name, optimizer.settings())})",
                          ()), "set_optimizer")
        refuse_split(optimizer, self.layouts, "processes")
        self.shard.set_optimizer(optimizer)
        self.assigns = False
        self._optimizer = optimizer
        self.rounds.forget()
        self.follow(optimizer)

    def follow(self, optimizer) -> None:
        """Nothing to send: each process's own optimizer runs its shard; what it is now
        goes into the next round's agreement, so processes whose options differ (a
        learning rate, a batch size) fail instead of updating their shards unlike."""
        settings = optimizer.settings()
        if settings != self._settings:
            self._settings = settings
            self._rule = optimizer_named(optimizer.name, settings)

    def set_updater(self, updater) -> None:
        """Each process runs its own `updater` on the pieces it owns (every process sets
        one: the rounds differ with and without)."""
        self.flush("set_updater")
        self.agree.check(("set_updater", ()), "set_updater")
        self.shard.set_updater(updater)
        self.assigns = False
        self._optimizer = None
        self._rule = "a function"
        self._settings = None  # a later optimizer, even of the same options, is named again
        self.rounds.forget()

    def pull(self, keys, replicas) -> None:
        """The replicas are current after every round: only queued inits need a round."""
        self.flush(f"pull of key {keys[0]!r}" if keys else "pull")

    # ------------------------------------------------------------- checkpoints
    def optimizer_state(self, dump: bool):
        """Every shard's optimizer state merged, on rank 0 (None elsewhere, and without
        an optimizer)."""
        self.flush("saving the optimizer state")
        self.agree.check(("optimizer_state", ()), "saving the optimizer state")
        starts = {k: p.start for k, layout in self.layouts.items()
                  for p in layout.served_by(self.t.rank)}
        export = mark_starts(self.shard.export_state(dump), starts)
        exports = to_rank0(self.t, export, "saving the optimizer state")
        if exports is None:
            return None
        return merge(exports, {k: layout.shape for k, layout in self.layouts.items()})

    def restore(self, values: dict, state) -> None:
        """Load `values` ({key: full array}, on every rank) and the optimizer `state`
        ((header, arrays) of the whole store, or None): each shard checks its part
        first; any failure changes nothing and raises CheckpointError on every rank."""
        self.flush("load")
        self.agree.check(("restore", tuple(sorted(values))), "load")
        t = self.t
        checked, error = None, None
        if state is not None:
            sizes = {k: layout.size for k, layout in self.layouts.items()}
            try:
                checked = self.shard.check_state(cut(state, t.rank, t.size, self.bound,
                                                     sizes))
            except GpukvError as exc:
                error = str(exc) if isinstance(exc, CheckpointError) else (
                    f"{type(exc).__name__}: {exc}")
        failed = self.control.alike(error, "load")
        if failed is not None:
            raise CheckpointError(failed)
        for key, value in values.items():
            for p in self.layouts[key].served_by(t.rank):
                self.shard.assign(key, value.reshape(-1)[p.start:p.stop])
        if checked is not None:
            self.shard.apply_state(checked)

    # --------------------------------------------------------------- snapshots
    def write_snapshot(self, request: dict) -> str | None:
        """Every rank writes the pieces its shard serves (shard `rank` of `size`)."""
        self.flush("snapshot")
        rank = self.t.rank
        pieces = {key: (p.start, p.stop, layout.shape) for key, layout in self.layouts.items()
                  for p in layout.served_by(rank)}
        comp, pulls = self.compressor, self.pulls
        owned = [] if pulls is None else [
            ({"what": "pull", "key": slot[0], "slot": list(slot[1:])}, r)
            for slot, r in pulls.feedback.residuals.items()]
        return self.control.alike(self.shard.write_part(
            dict(request, index=rank, count=self.t.size, pieces=pieces,
                 compression=(None if comp is None else comp.params(), owned))),
            "snapshot")

    # ------------------------------------------------------ compression state
    # (see `residuals`): each worker's residuals and PowerSGD's warm starts go in its
    # worker file; each owner's pull residuals and served values in its shard file.
    def worker_compression(self) -> tuple | None:
        """(params, [(record, live array)]) of this worker's compression state."""
        return residuals.worker_items(self.compressor, self.feedback)

    def restore_compression(self, found, replica) -> list:
        """After a resume loaded the snapshot `found`: put back every worker's and every
        owner's compression state when it fits (see `residuals.saved`), else start it
        afresh and say why at INFO, alike on every worker. `replica(key)`: this
        process's copy of `key` (the served values are written there). The keys whose
        copies changed."""
        self.flush("resume")
        comp = self.compressor
        mine = None if comp is None else comp.params()
        if comp is not None:  # afresh, whatever follows
            fresh = make_compressor(mine)
            assert fresh is not None  # made from a compressor's params
            self.set_compression(fresh)
        size = self.t.size
        reason, state = residuals.saved(found, mine, self.t.rank, size, size, self.layouts)
        agreed = self.control.alike(reason, "resume: the compression state")
        if agreed is not None:
            if agreed:
                residuals.log.info(residuals.NOT_RESTORED, agreed)
            return []
        assert state is not None  # it fits
        residuals.restore_worker(state.worker, self.compressor, self.feedback)
        own = state.shards[self.t.rank]
        pulls = self.pulls
        for record, array in zip(own.records, own.arrays):
            if record["what"] == "pull" and pulls is not None:
                slot = (record["key"], *record["slot"])
                np.copyto(pulls.feedback.residual(slot, array.size), array.reshape(-1))
        self.shard.keep_apart(list(dict.fromkeys(
            r["key"] for r in own.records if r["what"] == "served")))
        changed: dict = {}
        for shard in state.shards:  # every owner's served pieces into this process's copies
            for record, array in zip(shard.records, shard.arrays):
                if record["what"] == "served":
                    start, key = record["start"], record["key"]
                    flat = replica(key).reshape(-1)
                    flat[start:start + array.size] = array.reshape(-1)
                    changed[key] = None
        return list(changed)

    def finish_snapshots(self) -> str | None:
        return self.control.alike(self.shard.finish_part(), "finishing the snapshots")

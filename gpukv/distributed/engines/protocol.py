"""The surfaces between a dist store and the engine that carries its keys across
processes: `Engine`, what the store calls (`ShardedRounds` and `ServerClient` implement
it), made of three smaller protocols (`Rounds`: init, push, pull; `Settings`: updater,
optimizer, compression; `Snapshots`: the checkpoint surface) and its `control`
(`Control`: the calls every worker makes together, which `control.WorkerControl` does
once for every engine); `Shard`, what an engine calls back on the one-process store that
holds the keys (or pieces of keys) its process serves; and `RoundState`, what the
sharded engine's data paths (MPI or NCCL) read of it. The store makes the shard and hands
it to the engine's constructor, so nothing here imports the store's layer.

All are `typing.Protocol`s rather than base classes: the engines share their common code
by composition (a `WorkerControl`, a `KeyLayout` per key), and the shard wraps a
`LocalStore`, which this layer must not import. mypy checks each engine against `Engine`
where the store keeps it, and the store's shard against `Shard` where an engine is made;
a test checks every member of both by name and signature.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from ...encoding.compressors import Compressor, ErrorFeedback
    from ...encoding.pulls import PullCodec
    from ...optim import Optimizer
    from ..mpi.agree import Agreement
    from ..mpi.transport import Transport
    from .control import WorkerControl


class Partials(NamedTuple):
    """A worker's part of a key's sum in the canonical order (gpukv.canonical)."""
    sums: np.ndarray  # (len(rank_nodes(rank, pushed, workers)), elements of the key) in its
    #                   wire dtype, C-contiguous
    pushed: int       # the values this worker pushed for the key


class Leaves(NamedTuple):
    """A worker's values of a key compressed on the wire, in a deterministic store: each
    value is its own leaf of the canonical tree, compressed on its own (with its own
    residual) and decoded where the key is served, as one process decodes each source."""
    values: np.ndarray  # (pushed, elements of the key) float32, C-contiguous: row j is the
    #                     worker's j-th value, cast to the key's dtype, then to float32
    pushed: int         # the values this worker pushed for the key


@runtime_checkable
class Control(Protocol):
    """What every engine does alike for the store: who this worker is, and the calls every
    worker makes together (barrier, agreements, maxima, rank 0's objects), each bounded."""

    @property
    def rank(self) -> int:
        """This worker's index among the workers (servers excluded)."""
        ...

    @property
    def num_workers(self) -> int:
        """How many workers the job has (servers excluded)."""
        ...

    def check(self) -> None:
        """Raise the failure an earlier call met (or a peer reported), if any."""
        ...

    def barrier(self) -> None:
        """Return once every worker's earlier calls are done and every worker came."""
        ...

    def collective(self, op: str, note: str | None = None) -> None:
        """Agree that every worker makes call `op` now (a checkpoint call), before any of
        it moves; a worker on another call makes every one raise PeerMismatchError, which
        says `note` beside this worker's call."""
        ...

    def workers_max(self, values: np.ndarray, what: str) -> np.ndarray:
        """The elementwise maximum of `values` over every worker (a PeerError names `what`)."""
        ...

    def share(self, obj: Any, what: str) -> Any:
        """Rank 0's `obj` on every worker."""
        ...


@runtime_checkable
class Rounds(Protocol):
    """The data rounds: keys made, pushed and pulled. `keys` are in the store's order;
    `replicas` are this process's copies of the keys' values, which the engine reads and
    writes."""

    @property
    def pending(self) -> bool:
        """Whether keys made here wait for the next collective call to be agreed on."""
        ...

    @property
    def round_updates_replicas(self) -> bool:
        """Whether a push leaves every worker's replicas current (else a pull fetches)."""
        ...

    def init(self, keys: list, replicas: list) -> None:
        """Make new keys, whose `replicas` hold this worker's init value (rank 0's wins)."""
        ...

    def push(self, keys: list, grads: list, replicas: list) -> None:
        """Send this worker's summed `grads` of `keys`; their sum over workers updates them.
        An engine made deterministic gets a `Partials` per key instead, and continues
        the canonical tree from them; with a compressor, `Leaves` for each key it
        compresses (`compresses_key`: floating point, and for PowerSGD a matrix)."""
        ...

    def pull(self, keys: list, replicas: list) -> None:
        """Bring the current values of `keys` into `replicas`."""
        ...

    def check_new_keys(self, keys: list, values: list) -> None:
        """Raise what the engine's settings refuse of `keys` about to be made with
        `values` (an optimizer that needs keys whole, LAMB, and a key split over the
        processes or servers: ArgumentError), before any is made. It depends on the
        keys' sizes and the agreed settings only, so every worker refuses alike."""
        ...

    def refused_keys(self, op: str, error: Exception) -> bool:
        """This worker refused a call that makes keys (`op`: an init, a broadcast) before
        it reached the engine (`error`). Where keys are agreed on at the next collective
        call (num_servers=0), the refusal is agreed on there too, and this returns True;
        where the servers agree on them (and name a worker's init that never came once
        the timeout has passed), nothing is told, and this returns False."""
        ...

    def refused(self, op: str, error: Exception) -> None:
        """This worker refused a push (`op`) before it reached the engine (`error`): where
        pushes are collective, every worker learns it, so that one worker refusing alone
        fails on every rank rather than matching its next push with the others' refused
        one; where they are not (servers), nothing."""
        ...


@runtime_checkable
class Settings(Protocol):
    """How the keys are updated where they are served, and compressed on the way."""

    @property
    def compressor(self) -> Compressor | None:
        """The compression on the wire, or None."""
        ...

    def set_compression(self, compressor: Compressor | None) -> None:
        """Compress what crosses processes with `compressor` from now on (None: not)."""
        ...

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Run `optimizer` where the keys are served (every worker gives an alike one)."""
        ...

    def follow(self, optimizer: Optimizer) -> None:
        """Carry changes of `optimizer`'s options to where it runs, before the next push."""
        ...

    def set_updater(self, updater: Any) -> None:
        """Run `updater(key, merged, stored)` where the keys are served."""
        ...


@runtime_checkable
class Snapshots(Protocol):
    """The engine's part of checkpoints: the optimizer's state of every shard, values
    and state loaded back, and each shard's files of a snapshot."""

    def optimizer_state(self, dump: bool) -> Any:
        """Every shard's optimizer state merged, on rank 0 (None elsewhere, or without)."""
        ...

    def restore(self, values: dict, state: Any) -> None:
        """Load `values` ({key: array}) and optimizer `state`, checked whole everywhere first."""
        ...

    def write_snapshot(self, request: dict) -> str | None:
        """Have every shard stage its pieces for a snapshot and write them in the
        background (`request`: "folder", "step", "store_type", "keys" {key: (home kind,
        init index)}); the error of an earlier write that failed, alike on every worker."""
        ...

    def finish_snapshots(self) -> str | None:
        """Wait until every shard's snapshots are written; a failure's error, alike on
        every worker."""
        ...

    def worker_compression(self) -> tuple | None:
        """(params, [(record, live array)]) of this worker's compression state, for its
        snapshot file (params None: no compression); None: the engine keeps none there."""
        ...

    def restore_compression(self, found: Any, replica: Any) -> list:
        """After a resume loaded snapshot `found`: its compression state back where it
        fits (else afresh, said at INFO), alike on every worker; the keys whose copies
        (`replica(key)`) changed."""
        ...


@runtime_checkable
class Engine(Rounds, Settings, Snapshots, Protocol):
    """What a dist store calls on its engine: the data rounds, their settings and the
    checkpoints, and its `control` (every engine's is a `control.WorkerControl`)."""

    control: WorkerControl


class RoundState(Protocol):
    """What the sharded engine's data paths (`mpi_rounds`, `nccl_rounds`) read of it: the
    keys, how they are updated and compressed, and the update of the pieces served here."""
    t: Transport
    agree: Agreement          # of `t`: every round is agreed on first
    shard: Shard
    layouts: dict             # key -> layout.KeyLayout
    assigns: bool             # no updater: a round assigns the sum
    compressor: Compressor | None
    feedback: ErrorFeedback | None
    pulls: PullCodec | None   # compressed pulls (None: the new values cross as they are)

    def update(self, merged: list, what: str) -> None:
        """Run the updater (or assign) on the pieces served here: (key, summed piece)."""
        ...


@runtime_checkable
class Shard(Protocol):
    """What an engine calls on the one-process store of the keys its process serves (whole
    keys, or pieces of split keys stored flat)."""

    def init(self, key: Any, value: Any) -> None:
        """Make key(s) with a copy of `value` (a server's keys, once every worker sent them)."""
        ...

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Sum `value` (a list of gradients) into `key` with the updater, or assign it."""
        ...

    def stored(self, key: Any) -> Any:
        """The array that holds `key`'s value (read it; the shard writes it)."""
        ...

    def served(self, key: Any) -> Any:
        """The array that holds what workers hold of `key`: `stored(key)` itself, unless
        `keep_apart` put the value apart from it (compressed pulls)."""
        ...

    def keep_apart(self, keys: list) -> None:
        """From now on the updater updates a copy of each key's value, apart from what
        workers hold (`served`), until `rejoin`."""
        ...

    def rejoin(self, keys: list | None = None) -> None:
        """The value of `keys` (None: every key) becomes what workers hold again (the
        copies kept apart are dropped)."""
        ...

    def settles_pulls(self) -> bool:
        """Whether its updater is an optimizer whose compressed pulls settle the value
        (`Optimizer.settles_compressed_pulls`, `gpukv.encoding.pulls`)."""
        ...

    def adopt(self, keys: list, arrays: list) -> None:
        """Serve `arrays` themselves (views of a worker's copies) as new `keys`' values."""
        ...

    def update(self, keys: list, merged: list) -> None:
        """Apply the updater (or assign) to `keys` with their summed gradients `merged`."""
        ...

    def assign(self, key: Any, value: Any) -> None:
        """Set `key`'s value to `value`, without the updater (a checkpoint's value)."""
        ...

    def counted_as(self, num_updates: dict) -> AbstractContextManager:
        """Inside the block, the optimizer's update of each key of `num_updates` ({key:
        num_update}: a sync round's, which the workers counted over every key of their
        push) takes that num_update; nothing changes for an empty one, or without an
        optimizer."""
        ...

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Update the served keys with `optimizer` from now on."""
        ...

    def set_updater(self, updater: Any) -> None:
        """Update the served keys with `updater(key, merged, stored)` from now on."""
        ...

    def apply_settings(self, settings: tuple) -> None:
        """Give the optimizer a worker's `Optimizer.settings()`."""
        ...

    def export_state(self, dump: bool) -> Any:
        """The optimizer's state of the served keys, as `save_optimizer_states` writes it."""
        ...

    def check_state(self, state: Any) -> Any:
        """Check an optimizer state (header, arrays) against the served keys: its plan."""
        ...

    def apply_state(self, plan: Any) -> None:
        """Install the optimizer state `check_state` planned."""
        ...

    def write_part(self, request: dict) -> str | None:
        """Stage the served pieces for a snapshot and write shard "index" of "count" in
        the background (`request`: `Engine.write_snapshot`'s, plus those two and
        "pieces" {key: (start, stop, full shape)}); an earlier failed write's error."""
        ...

    def finish_part(self) -> str | None:
        """Wait for this shard's snapshot writes; a failed one's error."""
        ...

"""`KVStore`: what every gpukv store is, whatever runs it (MXNet's `KVStoreBase`).

`gpukv.create` returns one: a one-process store (`store.LocalStore`: 'local', 'device',
'nccl') or a store shared by the processes of an MPI job (`dist_store.DistKVStore`:
'dist_sync', 'dist_async', 'dist_device_sync'). This class holds the public calls and
their documented contract; each store implements them its own way, and neither store
derives from the other.
"""
from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import check

if TYPE_CHECKING:
    from ..checkpoints.snapshots import Snapshot
    from ..optim import Optimizer

# The argument forms of the store's calls (see `KVStore.push`).
Key = int | str
#: one key, or a list of keys (one int kind or one str kind per store)
Keys = Key | Sequence[Key]
#: any array: NumPy, CuPy, a PyTorch tensor, a JAX array, a RowSparse, or any object with
#: DLPack, the CUDA array interface or the buffer protocol
Array = Any
#: for one key: an array, or a list with one array per device
Value = Array | Sequence[Array]
#: for a list of keys: a list with one `Value` per key
Values = Value | Sequence[Value]
Updater = Callable[[Key, Any, Any], None]


class KVStore(ABC):
    """A key-value store of tensors shared by several devices (see `gpukv.create`).

    Every call checks all its arguments before it changes anything: a call that raises
    on its input (a typed gpukv error naming the key) leaves the store as it was.
    """

    _type: str  # the name the store was made with, lower case

    #: the capabilities `is_capable` takes, by MXNet's names (`kv.is_capable(KVStore.OPTIMIZER)`)
    OPTIMIZER = "optimizer"
    GRADIENT_COMPRESSION = "gradient_compression"

    # ----------------------------------------------------------------- properties
    @property
    def type(self) -> str:
        """The name the store was made with ('local', 'device', 'dist_sync', ...)."""
        return self._type

    @property
    @abstractmethod
    def rank(self) -> int:
        """This worker's rank among the workers (0 in one process)."""

    @property
    @abstractmethod
    def num_workers(self) -> int:
        """How many workers push and pull (1 in one process)."""

    @property
    @abstractmethod
    def num_servers(self) -> int:
        """Dedicated server processes (dist stores with num_servers >= 1; else 0)."""

    @property
    @abstractmethod
    def strategy(self) -> str:
        """The reduction strategy's name ('auto', 'home', 'tree', ...)."""

    @property
    @abstractmethod
    def deterministic(self) -> bool:
        """Whether every sum follows the canonical order (`create(deterministic=...)`)."""

    @abstractmethod
    def is_capable(self, capability: str) -> bool:
        """Whether this store supports `capability` ('optimizer', 'gradient_compression');
        another name is an ArgumentError, as in MXNet."""

    @abstractmethod
    def keys(self) -> list[Key]:
        """The keys of the store, in the order they were initialised."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys the store holds."""

    @abstractmethod
    def __contains__(self, key) -> bool:
        """Whether `key` was initialised (any other object, even unhashable: False)."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every worker (one process: returns at once)."""

    def _barrier(self) -> None:
        """MXNet's name of `barrier`."""
        self.barrier()

    @abstractmethod
    def workers_max(self, values, what: str) -> np.ndarray:
        """The elementwise maximum over every worker of `values` (ints or bools, any one
        shape), as an int64 array. Every worker calls it at the same point: `what` names
        that point in the PeerError of a dist store whose workers do not. One process:
        the values themselves (ArgumentKindError if they are not integers)."""

    def refusals_agreed(self, op: str, collective: bool = False
                        ) -> contextlib.AbstractContextManager[None]:
        """`with kv.refusals_agreed('push'): ...checks...`: for a layer above the store
        that checks a push (or pushpull) of its own before making it, `op` naming that
        call in the others' PeerMismatchError. On a dist store, a
        gpukv error raised inside is made known to the other workers before it goes on,
        as the store's own refusals are: a worker refusing alone makes the others raise
        a PeerMismatchError naming it, rather than sum its next push with theirs.
        `collective=True`: the checks come before a collective call of every layout
        (servers too: a Trainer's making), where the others are told at once. One
        process: nothing to tell."""
        return contextlib.nullcontext()

    def settle_before_calls(self, wait, background) -> None:
        """For a layer above that pushes from a thread of its own (the Trainer's
        reductions started from backward): on a dist store, every call from another
        thread (for which `background()` is False) first runs `wait()`, so that the
        pushes started before it come first in every process alike; `wait` and
        `background` are bound methods, held weakly. One process: its calls are no
        collective, nothing to wait for (the two are checked alike)."""
        check.bound_methods("settle_before_calls", wait=wait, background=background)

    # ------------------------------------------------------------------ the calls
    @abstractmethod
    def init(self, key: Keys, value: Values) -> None:
        """Create key(s) with a copy of `value`.

        `key`: an int or a str, or a list of them, each key once; `value`: per key, an
        array, or a list of arrays (one per device) that agree in shape and dtype, the
        first one being copied. A store's keys are all ints or all strs (the first key
        decides; another kind is a KeyKindError), and a key already in the store, or
        given twice in one call, is a DuplicateKeyError. The store keeps its own copy on
        the key's home device:

            kv.init('w', np.zeros((2, 3)))
            kv.init(['b', 'c'], [np.zeros(4), np.ones(4)])
        """

    @abstractmethod
    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        """Sum the value(s) of each key and apply the updater (default: assign) at home.

        `key`: one key, or a list of keys; `value`: for one key an array or a list of arrays
        (one per device, summed), for a list of keys a list with one of those per key (a key
        repeated in the list counts as more devices). Arrays of another dtype are converted
        to the key's; RowSparse values are summed row-wise. The whole call is checked before
        anything changes; updaters then run with int keys ascending, str keys in init
        order. `priority` is accepted for MXNet's sake (calls run in order):

            kv.push('w', grad)                          # one device
            kv.push('w', [grad_gpu0, grad_gpu1])        # summed
            kv.push(['w', 'b'], [[gw0, gw1], [gb0, gb1]])

        In a dist store every worker's values are summed too (dist_sync: all workers push
        each key, and the updater runs once all have).
        """

    @abstractmethod
    def pull(self, key: Keys, out: Values | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Copy the value of each key into every array of `out` (written in place).

        `out` is required (None is an ArgumentError, as MXNet asserts it). It takes the
        forms of `push`'s `value`: for one key an array or a list of arrays (one per
        device), for a list of keys one of those per key. Another dtype is converted;
        RowSparse outs are skipped (`ignore_sparse=True`, as MXNet; use
        `row_sparse_pull`); with `ignore_sparse=False` they get every row of the value.
        `ignore_sparse` is a bool. `priority` is accepted for MXNet's sake (calls run in
        order). An out is written as `out.copy_(value)` would write it: a PyTorch tensor that
        requires grad only under `torch.no_grad()`, its version counter moved; an out that
        cannot be written in place (read-only, or an object whose `__array__` returns a
        copy) is a ReadOnlyError:

            kv.pull('w', out=w_host)
            kv.pull(['w', 'b'], out=[[w0, w1], [b0, b1]])
        """

    @abstractmethod
    def pushpull(self, key: Keys, value: Values, out: Values | None = None,
                 priority: int = 0) -> None:
        """Push `value` then pull into `out` (or back into `value` when out is None).

        `key`, `value`, `out` and `priority` take the forms of `push` and `pull`; both
        halves are checked before either runs.
        """

    @abstractmethod
    def broadcast(self, key: Keys, value: Values, out: Values, priority: int = 0) -> None:
        """Initialise `key` (one or a list) with `value`, then pull into `out` (`init`'s
        and `pull`'s argument forms; `priority` is accepted for MXNet's sake)."""

    @abstractmethod
    def row_sparse_pull(self, key: Keys, out: Values | None = None, row_ids: Any = None,
                        priority: int = 0) -> None:
        """Write the rows `row_ids` of each key into RowSparse `out`(s), as MXNet does.

        `out` and `row_ids` are both required (None is an ArgumentError). The order of
        the arguments is not MXNet's, whose third is `priority`: pass `row_ids` by name
        (``kv.row_sparse_pull(k, out=rs, row_ids=ids)``); a lone int third is refused
        rather than taken as rows. `row_ids`: an integer array (any shape) or list of
        ints, shared by every out of the key, or a list with one such array per out. Each
        out receives exactly the requested rows, deduplicated and sorted (its other rows
        are zero), on the device its arrays are on. Works for any key: every key is stored
        dense-backed. `priority` is accepted for MXNet's sake (calls run in order).
        """

    # ------------------------------------------------- updaters and compression
    @abstractmethod
    def set_updater(self, updater: Updater) -> None:
        """Use `updater(key, merged, stored)` on every push; it changes `stored` in place.

        Rebinding `stored` (``stored = merged * 2``) changes nothing, as in MXNet. An
        exception raised by the updater reaches the caller of push/pushpull and the store
        stays usable, but the call is not undone: the keys updated before it (int keys
        ascending, str keys in init order) keep their new values, the key it raised on
        keeps whatever the updater wrote before raising, and the later keys are unchanged.
        """

    def _set_updater(self, updater: Updater) -> None:
        """MXNet's name of `set_updater`."""
        self.set_updater(updater)

    @property
    @abstractmethod
    def has_updater(self) -> bool:
        """Whether a push runs an updater or an optimizer (`set_updater`, `set_optimizer`);
        False: a push stores the sum."""

    @abstractmethod
    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Run `optimizer` (a `gpukv.optim.Optimizer`) on every push, at each key's home.

        Its state (momentum, moments, float32 master copies of 16-bit weights) lives with
        each key on its home device; replaces any updater set before. An optimizer object
        runs on one store: one that another live store of this process runs is an
        ArgumentError that changes nothing (the update counts and per-step options it
        keeps are one store's; give each store its own, `gpukv.optim.create(...)` again
        or `copy.deepcopy(optimizer)`), and it is free again once that store is dropped
        or set another optimizer or an updater (see `gpukv.optim.claims`).
        """

    @abstractmethod
    def set_gradient_compression(self, compression_params: dict | None) -> None:
        """Compress every pushed source on its way home (see `gpukv.encoding.compressors`).

        `compression_params`: MXNet's ``{'type': '2bit', 'threshold': t}``, ``{'type':
        '1bit', 'threshold': t}`` and ``{'type': 'fp16' or 'bf16', 'pre_divide': f}``;
        gpukv's ``{'type': 'sign'}`` and ``{'type': 'ternary'}``, which compress pulls
        too, and ``{'type': 'powersgd', 'rank': r}``, whose pulls cross as float32 with an
        updater (each compressor's options are in `gpukv.encoding.compressors`); or None /
        ``{'type': 'none'}`` to turn it off.
        Setting it again starts fresh residuals. The 'device', 'nccl' and dist stores
        take it; a 'local' store refuses it with an ArgumentError, as MXNet's does.
        """

    @property
    @abstractmethod
    def gradient_compression(self) -> dict | None:
        """The compression in use, as a dict of its options, or None."""

    # --------------------------------------------------------- files and snapshots
    @abstractmethod
    def save_optimizer_states(self, fname: str | os.PathLike,
                              dump_optimizer: bool = False) -> None:
        """Write the optimizer's state (and its options if `dump_optimizer`) to `fname`.

        A versioned archive (JSON header, one array per state tensor, no pickle), written
        to a temporary file and renamed over `fname`: a crash leaves the old file whole.
        A bad path, a folder, a folder that cannot be written or a full disk raise
        CheckpointError and leave the old file whole, with no temporary file behind; a
        store without an optimizer raises ArgumentError.
        """

    @abstractmethod
    def load_optimizer_states(self, fname: str | os.PathLike,
                              update_counts: str = "saved") -> None:
        """Restore the state `save_optimizer_states` wrote to `fname`; CheckpointError if
        it does not fit, ArgumentError if the store has no optimizer.

        `update_counts`: 'saved' (the default) takes the file's update counts, of every
        key and `num_update`, so that a resumed job goes on with its schedule and
        Adam's bias correction where it was (unlike MXNet, which keeps the loading
        optimizer's counts for a file saved without `dump_optimizer`). 'restart' starts
        them over, every key at the optimizer's `begin_num_update`, as a new optimizer's
        (fine-tuning from saved state under a schedule of one's own): the optimizer
        keeps its own `lr_scheduler` then, and the file's other options (saved with
        `dump_optimizer=True`) load as they do with 'saved'. Any other value is an
        ArgumentError (ArgumentKindError if not a str), before the file is read.

        The file, every key's state, and the options, multipliers and schedule it may
        hold are all checked before anything changes: a failed load changes nothing.
        """

    @abstractmethod
    def save(self, path: str | os.PathLike) -> None:
        """Write every key's value (and the optimizer's state, if one is set) to `path`.

        The file is a versioned `.npz` archive with a JSON header (no pickle), written to a
        temporary file and renamed over `path`, so a crash mid-save leaves the previous
        file whole. GPU values are copied to the host for saving. A bad path, a folder, a
        folder that cannot be written or a full disk raise CheckpointError and leave the
        previous file whole, with no temporary file behind.
        """

    @abstractmethod
    def load(self, path: str | os.PathLike) -> None:
        """Read a file written by `save` (or a snapshot's folder) into this store.

        Keys missing from the store are created (each on a home device chosen as by
        `init`: GPU-homed keys go back to GPUs when this store reduces on GPUs and has
        some); keys already in the store get the saved value, which must match their
        shape and dtype; keys of the store absent from the file are left as they are.
        The optimizer's state is restored when the file has some and an optimizer is set.
        Everything is checked before anything changes: a bad path, a missing, damaged or
        foreign file, another key kind, a key whose shape or dtype differ, or optimizer
        state that does not fit raise CheckpointError and leave the store untouched.
        """

    @abstractmethod
    def snapshot(self, root: str | os.PathLike, step: int | None = None,
                 user_state: dict | None = None, keep: int | None = 2) -> str:
        """Start a numbered snapshot of every key and the optimizer's state under `root`,
        as step `step` (None: the one after this store's last snapshot, or after the one
        it resumed from; 1 for the first).

        The values and state are copied into host buffers now; a background thread
        writes them (see `gpukv.checkpoints.snapshots`), at most one snapshot at a time, into
        `root/step-<step>-<tag>-r<run>/`, which is complete once every file is on disk,
        and then keeps the `keep` newest complete snapshots (None: removes none). The
        newest is the last step of the last run that wrote under `root` (a store's first
        snapshot there counts one run more than the folder holds). `user_state`: a
        dict of JSON values, tuples and arrays saved beside it (see
        `gpukv.latest_snapshot`). The folder's path is returned; `finish_snapshots()`
        waits for it. A failed write (a full disk) is
        raised as CheckpointError by the first `snapshot` called after it failed, or by
        `finish_snapshots`. In a dist store every worker calls it at the same point.
        One store of a process snapshots into a root at a time: a root another live
        store of the process snapshots into is an ArgumentError naming it (see
        `gpukv.checkpoints.claims`). Several threads may call it at once; each call
        holds every push issued before it, whichever thread or CUDA stream calls it.
        """

    @abstractmethod
    def resume(self, root: str | os.PathLike, check=None,
               into: list | None = None) -> Snapshot | None:
        """Load the newest complete snapshot under `root` (see `snapshot`) and return it
        (its `step`, and `user_state(rank)`), or None when there is none. It loads as
        `load` does, into a store of any number of devices, processes or servers (into
        the stores `into` instead of this one, if given). `check(snapshot)`, if given,
        may refuse it first (raising CheckpointError).

        Gradient compression's state (residuals, what workers hold of compressed pulls,
        PowerSGD's warm starts) comes back too when this store has the compression the
        snapshot was saved with (set it before resuming) and the same layout (the same
        devices; as many workers with the same pieces); otherwise it starts afresh, and
        an INFO line on logger 'gpukv' says why."""

    @abstractmethod
    def finish_snapshots(self) -> None:
        """Wait until every snapshot started is written; CheckpointError if one failed."""

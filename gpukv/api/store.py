"""`KVStore`, the one-process store: orchestration only, never imports CuPy.

Each call runs the phases in turn, each in its own place: `check.py` checks the arguments
whole, `pipeline.py` plans a push as jobs and runs them (the strategies of `gpukv.comm`
execute them), then the updater or optimizer (`gpukv.optim`) updates the keys.
"""
from __future__ import annotations

import itertools
import logging
import operator
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._env import flag
from .._errors import (
    ArgumentError,
    ArgumentKindError,
    CheckpointError,
    GpukvError,
    OutOfMemoryError,
)
from ..comm import BroadcastJob, Strategy
from ..comm.canonical import Canonical
from ..comm.registry import make_strategy
from ..device import Device, announce_writes, gpu_devices, host_device, virtual_gpus
from ..device.host_sum import accumulate_dtype
from ..encoding.compression import GradientCompression
from ..encoding.compressors import make_compressor
from ..encoding.sparse import RowSparse
from . import check, pipeline, rows, snapshots

if TYPE_CHECKING:
    from ..optim import Optimizer

log = logging.getLogger("gpukv")

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

# name -> whether the store reduces on GPUs (True) or on the host (False).
_TYPES = {
    "local": False,
    "local_update_cpu": False,
    "local_allreduce_cpu": False,
    "device": True,
    "local_allreduce_device": True,
    "nccl": True,
}
_CAPABILITIES = frozenset(["optimizer", "gradient_compression"])
_HOST = host_device(0)


def deterministic_option(value) -> bool:
    """`create`'s `deterministic`: a bool, or None for `$GPUKV_DETERMINISTIC` ('1' or '0';
    unset or blank: False). ArgumentKindError for another kind, ArgumentError naming the
    variable when it is malformed."""
    if value is None:
        return bool(flag("GPUKV_DETERMINISTIC"))
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentKindError(f"store option 'deterministic': expected True, False or "
                                f"None, got {type(value).__name__}")
    return bool(value)


_ENTRY_SEQ = itertools.count()
_value_of = operator.attrgetter("value")


class _Entry:
    """One key: its value on its home device, and a scratch buffer for merged pushes."""

    __slots__ = ("value", "home", "narrow", "_merge", "seq")

    def __init__(self, value, home: Device):
        self.value = value
        self.home = home
        self.narrow = accumulate_dtype(value.dtype) != value.dtype
        self._merge = None
        self.seq = next(_ENTRY_SEQ)  # creation order: str keys are updated in this order

    def merge_buffer(self):
        """Where pushes are summed before the updater sees them (float32 for fp16/bf16).

        Reused across pushes, as MXNet reuses its merge buffer: an updater must not keep
        a reference to `merged` beyond its call.
        """
        if self._merge is None:
            self._merge = self.home.empty(self.value.shape, accumulate_dtype(self.value.dtype))
        return self._merge


class KVStore:
    """A key-value store of tensors shared by several devices (see `create`)."""

    def __init__(self, name: str, *, strategy: str | Strategy | None = None,
                 deterministic: bool | None = None, **strategy_options):
        self._type = name
        self._on_gpu = _TYPES[name]
        self._deterministic = deterministic_option(deterministic)
        if self._on_gpu:
            virtual_gpus()  # a malformed GPUKV_VIRTUAL_GPUS is a DeviceError here, GPU or not
        asked = strategy is not None
        if name == "nccl" and strategy is None:
            strategy = "nccl"
        self._strategy = make_strategy(strategy, on_gpu=self._on_gpu, **strategy_options)
        host: Strategy = pipeline.HOST_STRATEGY
        if self._deterministic:  # every sum in the canonical order, whatever the strategy
            self._strategy = Canonical(self._strategy)
            host = Canonical(host)
        # A strategy the user gave (a name, GPUKV_STRATEGY or an object) also runs host arrays,
        # over host "devices"; otherwise host arrays take the plain host sum.
        self._route_host = (getattr(self._strategy, "explicit", False)
                            and (asked or name != "nccl")
                            and self._strategy.name not in ("auto", "cpu"))
        # Every key lives on the host and takes the host strategy.
        self._route = pipeline.Route(self._strategy, self._route_host,
                                     host_only=not self._on_gpu and not self._route_host,
                                     host=host, canonical=self._deterministic)
        self._entries: dict = {}
        self._key_kind: type | None = None
        self._updater: Any = None  # a pipeline.FunctionUpdater or an OptimizerUpdater, once set
        self._optimizer: Any = None  # the Optimizer set_optimizer installed (None otherwise)
        self._load: dict = {}  # home device -> bytes of the keys it holds
        self._lock = threading.RLock()
        self._said_host = False
        self._compression: GradientCompression | None = None
        self._said_sparse = False
        self._snapshots: snapshots.PartWriter | None = None  # made by the first snapshot
        self._tag: str | None = None  # the folder tag of this store's snapshots
        self._last_step = 0  # the step of its last snapshot, or of the one it resumed from

    # ----------------------------------------------------------------- properties
    @property
    def type(self) -> str:
        return self._type

    @property
    def rank(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def num_servers(self) -> int:
        """Dedicated server processes (dist stores; none in one process)."""
        return 0

    @property
    def strategy(self) -> str:
        return self._strategy.name

    @property
    def deterministic(self) -> bool:
        """Whether every sum follows the canonical order (`create(deterministic=...)`)."""
        return self._deterministic

    def is_capable(self, capability: str) -> bool:
        """Whether this store supports `capability` ('optimizer', 'gradient_compression')."""
        if not isinstance(capability, str):
            raise ArgumentKindError(
                f"capability: expected a str, got {type(capability).__name__}")
        lowered = capability.lower()
        if lowered == "gradient_compression":
            return self._compression_allowed()
        if lowered in _CAPABILITIES:
            return True
        raise ArgumentError(
            f"capability {capability!r}: unknown; known are {', '.join(sorted(_CAPABILITIES))}")

    def keys(self) -> list[Key]:
        """The keys of the store, in the order they were initialised."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        """Whether `key` was initialised (any other object, even unhashable: False)."""
        try:
            key, _ = check.check_key(key)
        except GpukvError:  # not a key at all
            return False
        return key in self._entries

    def barrier(self) -> None:
        """Wait for every worker (one process: returns at once)."""

    _barrier = barrier

    def workers_max(self, values, what: str) -> np.ndarray:
        """The elementwise maximum over every worker of `values` (ints or bools, any one
        shape), as an int64 array. Every worker calls it at the same point: `what` names
        that point in the PeerError of a dist store whose workers do not. One process:
        the values themselves (ArgumentKindError if they are not integers)."""
        try:
            array = np.asarray(values)
        except ValueError:  # ragged
            array = np.asarray(values, dtype=object)
        if array.size and not np.can_cast(array.dtype, np.int64):
            raise ArgumentKindError(f"workers_max ({what}): expected integers of one "
                                    f"shape, got {array.dtype}")
        return array.astype(np.int64)

    def _lookup(self, groups: check.Groups, op: str) -> list:
        """The entries of a call's keys (every key known, of the store's kind)."""
        return check.lookup(self._entries, self._key_kind, groups, op)

    # --------------------------------------------------------------- home devices
    def _candidates(self, arrays) -> list:
        """The devices a new key may live on."""
        if not self._on_gpu or all(isinstance(a, np.ndarray) for a in arrays):
            if self._on_gpu and not self._said_host:
                self._said_host = True
                log.warning("gpukv %r store: only host arrays, so keys are reduced on the host",
                            self._type)
            return [_HOST]
        return gpu_devices()

    def _assign_homes(self, groups: check.Groups) -> tuple[list, dict]:
        """Home devices for new keys (the largest first, each to the least-loaded device),
        and the bytes each device would then hold; `self._load` is left as it is."""
        load = dict(self._load)
        homes = [None] * len(groups.keys)
        order = sorted(range(len(groups.keys)), key=lambda i: -groups.arrays[i][0].nbytes)
        for i in order:
            candidates = self._candidates(groups.arrays[i])
            home = min(candidates, key=lambda d: load.get(d, 0))
            load[home] = load.get(home, 0) + groups.arrays[i][0].nbytes
            homes[i] = home
        return homes, load

    # ------------------------------------------------------------------ the API
    def init(self, key: Keys, value: Values) -> None:
        """Create key(s) with a copy of `value`.

        `key`: an int or a str, or a list of them; `value`: per key, an array, or a list of
        arrays (one per device) that agree in shape and dtype, the first one being copied.
        The store keeps its own copy on the key's home device::

            kv.init('w', np.zeros((2, 3)))
            kv.init([1, 2], [np.zeros(4), np.ones(4)])
        """
        groups = check.group(key, value, "value")
        with self._lock:
            self._init_groups(groups)

    def _init_groups(self, groups: check.Groups) -> None:
        check.init_values(groups, self._entries, self._key_kind)
        if not groups.keys:  # an empty list of keys
            return
        key = groups.keys[0]
        try:  # every allocation first: a key that cannot get its memory creates no key
            if groups.sparse:  # row-sparse values are stored dense-backed
                groups = rows.densified(groups)
            homes, load = self._assign_homes(groups)
            stored = []
            for key, arrays, home in zip(groups.keys, groups.arrays, homes):
                dtype = arrays[0].dtype  # stored in native byte order: '>f4' is kept as float32
                stored.append(home.empty(arrays[0].shape, dtype if dtype.isnative
                                         else dtype.newbyteorder("=")))
        except MemoryError as exc:
            raise pipeline.out_of_memory(key, "init", exc) from exc
        for key, arrays, home, value in zip(groups.keys, groups.arrays, homes, stored):
            source = arrays[0]
            where = pipeline.devices_of([source])[0]
            home.wait_for(where)
            home.copy(value, source)
            where.wait_for(home)  # the caller may overwrite `source` once init returns
            self._entries[key] = _Entry(value, home)
        self._load = load
        if groups.key_kind is not None:
            self._key_kind = groups.key_kind

    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        """Sum the value(s) of each key and apply the updater (default: assign) at home.

        `key`: one key, or a list of keys; `value`: for one key an array or a list of arrays
        (one per device, summed), for a list of keys a list with one of those per key (a key
        repeated in the list counts as more devices). Arrays of another dtype are converted
        to the key's; RowSparse values are summed row-wise. The whole call is checked before
        anything changes; updaters then run with int keys ascending, str keys in init
        order. `priority` is accepted for MXNet's sake (calls run in order)::

            kv.push('w', grad)                          # one device
            kv.push('w', [grad_gpu0, grad_gpu1])        # summed
            kv.push(['w', 'b'], [[gw0, gw1], [gb0, gb1]])
        """
        if type(priority) is not int:
            check.check_priority(key, priority)
        groups = check.group(key, value, "value")
        with self._lock:
            entries = check.lookup(self._entries, self._key_kind, groups, "push")
            exact = check.all_sources(groups, entries, "push")
            self._run_push(self._plan_push(groups, entries, cast=not exact))

    # The push pipeline (`pipeline.py`): the plan checks what `check.all_sources` could not
    # and makes every allocation; the run reduces, then updates.
    def _plan_push(self, groups: check.Groups, entries: list,
                   cast: bool = True) -> pipeline.PushPlan:
        """The checked jobs of a push; raises (changing nothing) on any bad part of it."""
        return pipeline.plan_push(groups, entries, self._updater, self._compression,
                                  self._route, cast)

    def _run_push(self, plan: pipeline.PushPlan) -> None:
        """Reduce every job of a checked push, then run the updater (or assign)."""
        pipeline.run_push(plan, self._updater, self._compression, self._route)

    def pull(self, key: Keys, out: Values | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Copy the value of each key into every array of `out` (written in place).

        `out` takes the forms of `push`'s `value`: for one key an array or a list of arrays
        (one per device), for a list of keys one of those per key. Another dtype is
        converted; RowSparse outs are skipped (`ignore_sparse`, as MXNet; use
        `row_sparse_pull`). An out is written as `out.copy_(value)` would write it: a
        PyTorch tensor that requires grad only under `torch.no_grad()`, its version
        counter moved; an out that cannot be written in place (read-only, or an object
        whose `__array__` returns a copy) is a ReadOnlyError::

            kv.pull('w', out=w_host)
            kv.pull(['w', 'b'], out=[[w0, w1], [b0, b1]])
        """
        if out is None:
            raise ArgumentError(f"key {key!r}: pull needs `out` arrays to write into")
        if type(priority) is not int:
            check.check_priority(key, priority)
        groups = check.group(key, out, "out", written=True)
        with self._lock:
            entries = self._lookup(groups, "pull")
            check.all_outs(groups, entries)
            self._pull_groups(groups, entries, ignore_sparse)

    def _pull_groups(self, groups: check.Groups, entries: list, ignore_sparse=True) -> None:
        """Write each key's value into its outs; then tell the outs' libraries of it."""
        try:
            self._write_outs(groups, entries, ignore_sparse)
        finally:  # a write that stopped halfway still changed some outs
            if groups.foreign:
                announce_writes(groups.foreign)

    def _write_outs(self, groups: check.Groups, entries: list, ignore_sparse) -> None:
        if groups.sparse:
            groups, entries = self._pull_sparse_outs(groups, entries, ignore_sparse)
        if groups.all_host and self._route.host_only:  # as columns: no job per key
            self._route.host.broadcast_columns(map(_value_of, entries), groups.arrays)
            return
        jobs = [BroadcastJob(key, entry.value, entry.home, outs, pipeline.host_slots(len(outs))
                             if groups.all_host else pipeline.devices_of(outs))
                for key, entry, outs in zip(groups.keys, entries, groups.arrays)]
        if jobs:
            self._route.strategy_for(jobs).broadcast_many(jobs)

    def pushpull(self, key: Keys, value: Values, out: Values | None = None,
                 priority: int = 0) -> None:
        """Push `value` then pull into `out` (or back into `value` when out is None).

        The argument forms of `push` and `pull`; both halves are checked before either runs.
        """
        if type(priority) is not int:
            check.check_priority(key, priority)
        groups = check.group(key, value, "value", written=out is None)
        out_groups = groups if out is None else check.group(key, out, "out", written=True)
        with self._lock:
            entries = self._lookup(groups, "pushpull")
            out_entries = entries if out is None else self._lookup(out_groups, "pushpull")
            exact = check.all_sources(groups, entries, "pushpull")
            check.all_outs(out_groups, out_entries)
            if out_groups.sparse:
                check.refuse_sparse_outs(out_groups, out is None)
            self._run_push(self._plan_push(groups, entries, cast=not exact))
            self._pull_groups(out_groups, out_entries)

    def broadcast(self, key: Keys, value: Values, out: Values, priority: int = 0) -> None:
        """Initialise key(s) with `value`, then pull into `out` (`init`'s and `pull`'s
        argument forms)."""
        if type(priority) is not int:
            check.check_priority(key, priority)
        groups = check.group(key, value, "value")
        out_groups = check.group(key, out, "out", written=True)
        with self._lock:
            check.init_values(groups, self._entries, self._key_kind)
            check.key_kind(out_groups.key_kind, self._key_kind, out_groups.keys)
            shapes = dict(zip(groups.keys, (a[0].shape for a in groups.arrays)))
            for k, arrays in zip(out_groups.keys, out_groups.arrays):
                if k not in shapes:
                    raise ArgumentError(f"key {k!r}: broadcast has an out but no value for it")
                check.outs(k, shapes[k], arrays)
            self._init_groups(groups)
            self._pull_groups(out_groups, self._lookup(out_groups, "broadcast"))

    def set_updater(self, updater: Updater) -> None:
        """Use `updater(key, merged, stored)` on every push; it changes `stored` in place.

        Rebinding `stored` (``stored = merged * 2``) changes nothing, as in MXNet. An
        exception raised by the updater reaches the caller of push/pushpull and the store
        stays usable, but the call is not undone: the keys updated before it (int keys
        ascending, str keys in init order) keep their new values, the key it raised on
        keeps whatever the updater wrote before raising, and the later keys are unchanged.
        """
        if not callable(updater):
            raise ArgumentKindError(
                f"updater: expected a callable, got {type(updater).__name__}")
        with self._lock:
            self._updater = pipeline.FunctionUpdater(updater)
            self._optimizer = None

    _set_updater = set_updater

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Run `optimizer` (a `gpukv.optim.Optimizer`) on every push, at each key's home.

        Its state (momentum, moments, float32 master copies of 16-bit weights) lives with
        each key on its home device; replaces any updater set before.
        """
        from ..optim import Optimizer, OptimizerUpdater
        if not isinstance(optimizer, Optimizer):
            raise ArgumentKindError(f"optimizer: expected a gpukv.optim.Optimizer (e.g. "
                                    f"gpukv.optim.create('sgd')), got {type(optimizer).__name__}")
        with self._lock:
            self._updater = OptimizerUpdater(optimizer)
            self._optimizer = optimizer

    def _optimizer_updater(self, op: str):
        if self._optimizer is None:
            raise ArgumentError(f"{op}: this store has no optimizer; call set_optimizer first")
        return self._updater

    def save_optimizer_states(self, fname: str | os.PathLike,
                              dump_optimizer: bool = False) -> None:
        """Write the optimizer's state (and its options if `dump_optimizer`) to `fname`.

        A versioned archive (JSON header, one array per state tensor, no pickle), written
        to a temporary file and renamed over `fname`: a crash leaves the old file whole.
        A bad path, a folder, a folder that cannot be written or a full disk raise
        CheckpointError and leave the old file whole, with no temporary file behind.
        """
        from .checkpoint import checkpoint_path, write_archive
        path = checkpoint_path(fname)
        with self._lock:
            header, arrays = self._optimizer_updater(
                "save_optimizer_states").export_state(bool(dump_optimizer))
            write_archive(path, header, arrays)

    def load_optimizer_states(self, fname: str | os.PathLike) -> None:
        """Restore the state `save_optimizer_states` wrote; CheckpointError if it does not fit.

        The file, every key's state, and the options, multipliers and schedule it may
        hold are all checked before anything changes: a failed load changes nothing.
        """
        from .checkpoint import checkpoint_path, read_archive
        self._optimizer_updater("load_optimizer_states")
        path = checkpoint_path(fname)
        header, arrays = read_archive(path)
        with self._lock:
            self._optimizer_updater("load_optimizer_states").import_state(
                header, arrays, self._entry_map(), path=path)

    def _entry_map(self) -> dict:
        return {k: (e.value, e.home) for k, e in self._entries.items()}

    def save(self, path: str | os.PathLike) -> None:
        """Write every key's value (and the optimizer's state, if one is set) to `path`.

        The file is a versioned `.npz` archive with a JSON header (no pickle), written to a
        temporary file and renamed over `path`, so a crash mid-save leaves the previous
        file whole. GPU values are copied to the host for saving. A bad path, a folder, a
        folder that cannot be written or a full disk raise CheckpointError and leave the
        previous file whole, with no temporary file behind.
        """
        from . import checkpoint
        with self._lock:  # the values stay as they are while the file is written
            checkpoint.save_store(self._snapshot(to_host=True), path)

    def snapshot(self, root: str | os.PathLike, step: int | None = None,
                 user_state: dict | None = None, keep: int = 2) -> str:
        """Start a numbered snapshot of every key and the optimizer's state under `root`,
        as step `step` (None: the one after this store's last snapshot, or after the one
        it resumed from; 1 for the first).

        The values and state are copied into host buffers now; a background thread
        writes them (see `gpukv.api.snapshots`), at most one snapshot at a time, into
        `root/step-<step>-<tag>/`, which is complete once every file is on disk, and then
        keeps the `keep` newest complete snapshots. `user_state`: a dict of JSON values,
        tuples and arrays saved beside it (see `gpukv.latest_snapshot`). The folder's path
        is returned; `finish_snapshots()` waits for it. A failed write (a full disk) is
        raised as CheckpointError by the first `snapshot` called after it failed, or by
        `finish_snapshots`.
        """
        root, step, keep = snapshots.checked(root, step, keep, self._last_step)
        with self._lock:
            folder = os.path.join(root, snapshots.folder_name(step, self._snapshot_tag()))
            worker = snapshots.worker_files(folder, step, 0, 1, user_state)
            shard = os.path.join(folder, snapshots.shard_file(0, 1))
            self._write_part(shard, step, None, [worker], then=lambda: snapshots.prune(
                root, keep))
            self._last_step = step
        return folder

    def resume(self, root: str | os.PathLike, check=None,
               into: list | None = None) -> snapshots.Snapshot | None:
        """Load the newest complete snapshot under `root` (see `snapshot`) and return it
        (its `step`, and `user_state(rank)`), or None when there is none. It loads as
        `load` does, into a store of any number of devices, processes or servers (into
        the stores `into` instead of this one, if given). `check(snapshot)`, if given,
        may refuse it first (raising CheckpointError)."""
        found = snapshots.latest_snapshot(root)
        if found is not None:
            if check is not None:
                check(found)
            for store in [self] if into is None else into:
                store.load(found)
            self._last_step = found.step
        return found

    def finish_snapshots(self) -> None:
        """Wait until every snapshot started is written; CheckpointError if one failed."""
        if self._snapshots is not None:
            self._snapshots.finish()

    def snapshot_share(self, folder: str, step: int, index: int, count: int) -> str | None:
        """Write every count-th key from the index-th, whole, as shard `index` of `count`
        of the snapshot in `folder`, in the background: one worker's share of a store every
        worker of a dist store holds alike (its `snapshot(replicated=)` calls this). The
        error of an earlier write that failed, else None."""
        with self._lock:
            pieces = {key: (0, e.value.size, e.value.shape, e.home.kind, i)
                      for i, (key, e) in enumerate(self._entries.items())
                      if i % count == index}
        try:
            self._write_part(os.path.join(folder, snapshots.shard_file(index, count)), step,
                             pieces, [])
        except CheckpointError as exc:
            return str(exc)
        return None

    def _snapshot_tag(self) -> str:
        if self._tag is None:
            self._tag = secrets.token_hex(4)
        return self._tag

    def _write_part(self, path: str, step: int, pieces: dict | None, others: list,
                    then=None, store_type: str | None = None) -> None:
        """Stage this store's keys (`pieces`: {key: (start, stop, shape, home kind, init
        index)} of the pieces it holds, of a store of `store_type`; None: every key whole)
        and write them to `path` in the background, then `others` ((path, header,
        arrays)), then call `then()`."""
        if self._snapshots is None:
            self._snapshots = snapshots.PartWriter()
        turn, staging = self._snapshots.stage()
        try:
            with self._lock:
                infos, values = [], []
                for index, (key, entry) in enumerate(self._entries.items()):
                    value = entry.value
                    if pieces is None:
                        place = (0, value.size, value.shape, entry.home.kind, index)
                    elif key in pieces:
                        place = pieces[key]
                    else:
                        continue
                    start, stop, shape, home, order = place
                    infos.append({"key": key, "index": order, "home": home,
                                  "shape": list(shape), "start": start, "stop": stop})
                    values.append(staging.take(value.reshape(-1)))
                export = None if self._optimizer is None else self._updater.export_state(
                    True, staging.fetch, None if pieces is None else set(pieces))
                staging.copy()
            header = snapshots.shard_header(step, store_type or self._type, self._key_kind,
                                            infos, export)
            files = [(path, header, snapshots.shard_arrays(values, export)), *others]
        except BaseException:
            self._snapshots.release(turn)
            raise
        self._snapshots.submit(turn, files, then)

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
        from . import checkpoint
        contents = snapshots.read_any(path)  # the file alone, outside the lock
        with self._lock:  # checked against the store and applied in one hold of the lock
            self._apply_load(checkpoint.plan_load(contents, self._snapshot()))

    def _snapshot(self, to_host: bool = False):
        """The store as `gpukv.api.checkpoint` sees it; with `_apply_load`, the only door
        between a store and its checkpoints.

        A `checkpoint.StoreSnapshot`: the store's type and key kind, (key, value, home
        kind) of every key in init order, and the optimizer's updater (None without
        `set_optimizer`). `to_host`: values as NumPy arrays (GPU values copied over);
        otherwise the stored arrays, for their shapes and dtypes. Host values are the
        store's own arrays: hold the store's lock for as long as the snapshot is used.
        """
        from .checkpoint import StoreSnapshot
        with self._lock:
            if to_host:
                entries = [(k, e.home.to_host(e.value), e.home.kind)
                           for k, e in self._entries.items()]
            else:
                entries = [(k, e.value, e.home.kind) for k, e in self._entries.items()]
            updater = self._updater if self._optimizer is not None else None
            return StoreSnapshot(self._type, self._key_kind, entries, updater)

    def _apply_load(self, plan) -> None:
        """Apply a `checkpoint.LoadPlan`: with `_snapshot`, the only door between a store
        and its checkpoints, and the only way a checkpoint changes a store.

        `plan` must come from `checkpoint.plan_load` on a `_snapshot()` taken in the same
        hold of the store's lock (as `load` does): it was checked against the store as it
        is, so nothing here fails on the file's content. The new keys' memory and the
        optimizer's state are allocated before any value changes; running out of memory
        there changes nothing.
        """
        with self._lock:
            load = dict(self._load)
            gpus = []
            if self._on_gpu and any(saved_on == "gpu" for _, _, saved_on in plan.creates):
                gpus = gpu_devices()
            created = []  # (key, its new entry, the file's value)
            try:
                for key, value, saved_on in plan.creates:  # the file's record of the home
                    home = (min(gpus, key=lambda d: load.get(d, 0))
                            if gpus and saved_on == "gpu" else _HOST)
                    load[home] = load.get(home, 0) + value.nbytes
                    created.append((key, _Entry(home.empty(value.shape, value.dtype), home),
                                    value))
                if plan.optimizer is not None:
                    homes = {k: e.home for k, e in self._entries.items()}
                    homes.update((k, e.home) for k, e, _ in created)
                    self._updater.apply_state(plan.optimizer, homes)
            except MemoryError as exc:
                raise OutOfMemoryError(f"load: the checkpoint's keys and optimizer state need "
                                       f"more memory than their devices have free; nothing "
                                       f"was changed ({exc})") from exc
            touched = set()
            entries = self._entries
            for key, value in plan.updates:
                entry = entries[key]
                entry.home.copy(entry.value, value)
                touched.add(entry.home)
            for key, entry, value in created:
                entry.home.copy(entry.value, value)
                entries[key] = entry
                touched.add(entry.home)
            for home in touched:  # the file's host arrays go away after this call
                home.synchronize()
            self._load = load
            if plan.key_kind is not None:
                self._key_kind = plan.key_kind

    # ------------------------------------------------- compression and row-sparse
    def _compression_allowed(self) -> bool:
        """MXNet's rule: gradient compression for 'device' and 'dist' stores only."""
        return "device" in self._type or "dist" in self._type

    def set_gradient_compression(self, compression_params: dict | None) -> None:
        """Compress every pushed source on its way home (see `gpukv.encoding.compressors`).

        `compression_params`: ``{'type': '2bit', 'threshold': t}``, ``{'type': '1bit',
        'threshold': t}``, ``{'type': 'fp16' or 'bf16', 'pre_divide': f}``, or None /
        ``{'type': 'none'}`` to turn it off. Setting it again starts fresh residuals.
        """
        if not self._compression_allowed():
            raise ArgumentError(
                f"gradient compression is not supported for a {self._type!r} store "
                f"(as in MXNet); use 'device' or a 'dist' store")
        compressor = make_compressor(compression_params)
        with self._lock:
            self._compression = (None if compressor is None
                                 else GradientCompression(compressor))

    @property
    def gradient_compression(self) -> dict | None:
        """The compression in use, as a dict of its options, or None."""
        comp = self._compression
        return None if comp is None else comp.params()

    def _pull_sparse_outs(self, groups: check.Groups, entries: list, ignore_sparse: bool):
        """Fill (or, with ignore_sparse, skip) the RowSparse outs; return the dense rest."""
        rest_keys: list = []
        rest_arrays: list = []
        rest_entries: list = []
        skipped = False
        for key, entry, outs in zip(groups.keys, entries, groups.arrays):
            dense = [o for o in outs if type(o) is not RowSparse]
            for o in outs:
                if type(o) is RowSparse:
                    if ignore_sparse:
                        skipped = True
                    else:
                        rows.fill_rows(entry, o, None)
            if dense:
                rest_keys.append(key)
                rest_arrays.append(dense)
                rest_entries.append(entry)
        if skipped and not self._said_sparse:
            self._said_sparse = True
            log.warning("gpukv: pull(ignore_sparse=True) left RowSparse outs unchanged; "
                        "use row_sparse_pull(key, out, row_ids) for them")
        rest = rows.regroup(rest_keys, rest_arrays, groups.key_kind)
        return rest, rest_entries

    def row_sparse_pull(self, key: Keys, out: Values | None = None, row_ids: Any = None,
                        priority: int = 0) -> None:
        """Write the rows `row_ids` of each key into RowSparse `out`(s), as MXNet does.

        `row_ids`: an integer array (any shape) or list of ints, shared by every out of
        the key, or a list with one such array per out. Each out receives exactly the
        requested rows, deduplicated and sorted (its other rows are zero), on the device
        its arrays are on. Works for any key: every key is stored dense-backed.
        """
        if type(priority) is not int:
            check.check_priority(key, priority)
        pairs = check.row_sparse_pairs(key, out, row_ids)
        with self._lock:
            for entry, o, ids in check.row_sparse_pulls(pairs, self._entries, self._key_kind):
                rows.fill_rows(entry, o, ids)

    def __repr__(self):
        return (f"<gpukv.KVStore type={self._type!r} strategy={self._strategy.name!r} "
                f"deterministic={self._deterministic} keys={len(self._entries)}>")

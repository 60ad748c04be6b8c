"""`LocalStore`, the one-process store ('local', 'device', 'nccl'): orchestration only,
never imports CuPy.

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
import weakref
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import timeline
from .._env import flag
from .._errors import (
    ArgumentError,
    ArgumentKindError,
    GpukvError,
    OutOfMemoryError,
)
from ..checkpoints import claims, snapshots
from ..comm import BroadcastJob, Strategy
from ..comm.canonical import Canonical
from ..comm.registry import make_strategy
from ..device import (
    Device,
    announce_writes,
    device_named,
    device_of,
    gpu_devices,
    host_device,
    virtual_gpus,
)
from ..device.host_sum import accumulate_dtype
from ..encoding.compression import GradientCompression
from ..encoding.compressors import make_compressor
from ..encoding.sparse import RowSparse
from ..layout.state import restarted
from . import check, pipeline, rows
from .base import Key, Keys, KVStore, Updater, Values

if TYPE_CHECKING:
    from ..optim import Optimizer

log = logging.getLogger("gpukv")

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
    """One key: its value on its home device, and a scratch buffer for merged pushes.

    With compressed pulls (`gpukv.encoding.pulls`) and an updater, `value` is the served
    value, what pulls read, and `kept` the value the updater updates (with an optimizer
    that settles compressed pulls, the served value again after each push:
    `PullCodec.settle`);
    otherwise `kept` is None and `value` is both.
    """

    __slots__ = ("value", "home", "narrow", "_merge", "seq", "kept")

    def __init__(self, value, home: Device):
        self.value = value
        self.home = home
        self.narrow = accumulate_dtype(value.dtype) != value.dtype
        self._merge = None
        self.seq = next(_ENTRY_SEQ)  # creation order: str keys are updated in this order
        self.kept = None

    @property
    def stored(self):
        """The key's value proper: what the updater updates and snapshots hold."""
        return self.value if self.kept is None else self.kept

    def keep(self) -> None:
        """Keep the value apart from the served value, from now on (the same bits at
        first)."""
        if self.kept is None:
            kept = self.home.empty(self.value.shape, self.value.dtype)
            self.home.copy(kept, self.value)
            self.kept = kept

    def merge_buffer(self):
        """Where pushes are summed before the updater sees them (float32 for fp16/bf16).

        Reused across pushes, as MXNet reuses its merge buffer: an updater must not keep
        a reference to `merged` beyond its call.
        """
        if self._merge is None:
            self._merge = self.home.empty(self.value.shape, accumulate_dtype(self.value.dtype))
        return self._merge


def _without_values(groups: check.Groups, entries: list) -> tuple:
    """(groups, entries) less every out that is its key's value itself (a store that
    adopted the caller's array: see `adopt`), which holds the value already; the caller's
    stream is ordered after the work that wrote it, as a copy into it would be."""
    if not any(_same_memory(out, entry.value)
               for entry, outs in zip(entries, groups.arrays) for out in outs):
        return groups, entries
    keys, arrays, kept = [], [], []
    for key, entry, outs in zip(groups.keys, entries, groups.arrays):
        others = [out for out in outs if not _same_memory(out, entry.value)]
        if len(others) < len(outs):
            entry.home.leave()
        if others:
            keys.append(key)
            arrays.append(others)
            kept.append(entry)
    return groups._replace(keys=keys, arrays=arrays), kept


def _same_memory(out, value) -> bool:
    """Whether `out` is `value`'s memory, element for element (NumPy or CuPy)."""
    return type(out) is type(value) and check.memory_of(out) == check.memory_of(value)


class LocalStore(KVStore):
    """The store of one process: its keys live on its devices (see `gpukv.create`).

    Besides the public calls of `KVStore`, it offers the multi-process store (which keeps
    its keys in one-process stores) a small documented surface, at the end of the class:
    it reads and drives a LocalStore through it, never through its privates.
    """

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
        #: whether some value is a caller's array (`adopt`): a pull looks for outs that
        #: are values themselves
        self._adopted = False
        self._key_kind: type | None = None
        self._updater: Any = None  # a pipeline.FunctionUpdater or an OptimizerUpdater, once set
        self._optimizer: Any = None  # the Optimizer set_optimizer installed (None otherwise)
        #: the store this one runs optimizers for, weakly (`run_optimizers_for`); None: itself
        self._runs_for: weakref.ref | None = None
        self._load: dict = {}  # home device -> bytes of the keys it holds
        self._pinned: Device | None = None  # where every new key lives, if set (`pin`)
        self._lock = threading.RLock()
        self._said_host = False
        self._speaks_as: str | None = name  # the store its notices name (`speak_as`)
        self._compression: GradientCompression | None = None
        self._said_sparse = False
        self._snapshots: snapshots.PartWriter | None = None  # made by the first snapshot
        self._tag: str | None = None  # the folder tag of this store's snapshots
        self._runs: dict = {}  # root -> the run this store's snapshots there count as
        self._last_step = 0  # the step of its last snapshot, or of the one it resumed from

    # ----------------------------------------------------------------- properties
    @property
    def rank(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def num_servers(self) -> int:
        return 0

    @property
    def strategy(self) -> str:
        return self._strategy.name

    @property
    def deterministic(self) -> bool:
        return self._deterministic

    def is_capable(self, capability: str) -> bool:
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
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        try:
            key, _ = check.check_key(key)
        except GpukvError:  # not a key at all
            return False
        return key in self._entries

    def barrier(self) -> None:
        """One process: returns at once."""

    def workers_max(self, values, what: str) -> np.ndarray:
        return check.worker_values(values, what)

    # --------------------------------------------------------------- home devices
    def _candidates(self, arrays) -> list:
        """The devices a new key may live on."""
        if self._pinned is not None:
            return [self._pinned]
        if not self._on_gpu or all(isinstance(a, np.ndarray) for a in arrays):
            if self._on_gpu and not self._said_host and self._speaks_as is not None:
                self._said_host = True
                log.info("gpukv %r store: only host arrays, so keys are reduced on the host",
                         self._speaks_as)
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
    @timeline.traced("init")
    def init(self, key: Keys, value: Values) -> None:
        groups = check.init_group(key, value)
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

    @timeline.traced("push")
    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        if type(priority) is not int:
            check.check_priority(key, priority)
        with timeline.span("check"):
            groups = check.group(key, value, "value")
        with self._lock:
            with timeline.span("check"):
                entries = self.lookup(groups, "push")
                exact = check.all_sources(groups, entries, "push")
            with timeline.span("plan"):
                plan = self._plan_push(groups, entries, cast=not exact)
            self._run_push(plan)

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

    @timeline.traced("pull")
    def pull(self, key: Keys, out: Values | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        with timeline.span("check"):
            groups = check.pull_outs(key, out, priority, ignore_sparse)
        with self._lock:
            with timeline.span("check"):
                entries = self.lookup(groups, "pull")
                check.all_outs(groups, entries)
                if not groups.all_host:
                    groups = check.distinct_outs(groups)
            with timeline.span("broadcast"):
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
        if self._adopted:
            groups, entries = _without_values(groups, entries)
            if not groups.keys:
                return
        if groups.all_host and self._route.host_only:  # as columns: no job per key
            self._route.host.broadcast_columns(map(_value_of, entries), groups.arrays)
            return
        jobs = [BroadcastJob(key, entry.value, entry.home, outs, pipeline.host_slots(len(outs))
                             if groups.all_host else pipeline.devices_of(outs))
                for key, entry, outs in zip(groups.keys, entries, groups.arrays)]
        if jobs:
            self._route.strategy_for(jobs).broadcast_many(jobs)

    @timeline.traced("pushpull")
    def pushpull(self, key: Keys, value: Values, out: Values | None = None,
                 priority: int = 0) -> None:
        with timeline.span("check"):
            groups, out_groups = check.pushpull_groups(key, value, out, priority)
        with self._lock:
            with timeline.span("check"):
                entries = self.lookup(groups, "pushpull")
                out_entries = entries if out is None else self.lookup(out_groups, "pushpull")
                exact = check.all_sources(groups, entries, "pushpull")
                check.all_outs(out_groups, out_entries)
                if out_groups.sparse:
                    check.refuse_sparse_outs(out_groups, out is None)
                if not out_groups.all_host:
                    out_groups = check.distinct_outs(out_groups)
            with timeline.span("plan"):
                plan = self._plan_push(groups, entries, cast=not exact)
            self._run_push(plan)
            with timeline.span("broadcast"):
                self._pull_groups(out_groups, out_entries)

    @timeline.traced("broadcast")
    def broadcast(self, key: Keys, value: Values, out: Values, priority: int = 0) -> None:
        if type(priority) is not int:
            check.check_priority(key, priority)
        groups = check.init_group(key, value)
        out_groups = check.group(key, out, "out", written=True)
        with self._lock:
            check.broadcast_args(groups, out_groups, self._entries, self._key_kind)
            self._init_groups(groups)
            self._pull_groups(out_groups, self.lookup(out_groups, "broadcast"))

    def set_updater(self, updater: Updater) -> None:
        if not callable(updater):
            raise ArgumentKindError(
                f"updater: expected a callable, got {type(updater).__name__}")
        with self._lock:
            self._updater = pipeline.FunctionUpdater(updater)
            self._let_go_of_optimizer(None)
            self._optimizer = None

    @property
    def has_updater(self) -> bool:
        return self._updater is not None

    def set_optimizer(self, optimizer: Optimizer) -> None:
        from ..optim import Optimizer, OptimizerUpdater
        if not isinstance(optimizer, Optimizer):
            raise ArgumentKindError(f"optimizer: expected a gpukv.optim.Optimizer (e.g. "
                                    f"gpukv.optim.create('sgd')), got {type(optimizer).__name__}")
        from ..optim import claims as optimizer_claims
        with self._lock:
            updater = OptimizerUpdater(optimizer)
            # one store runs an optimizer object (its counts are of one store's pushes)
            optimizer_claims.claim(optimizer, self._optimizer_holder())
            self._updater = updater
            self._let_go_of_optimizer(optimizer)
            self._optimizer = optimizer

    def run_optimizers_for(self, store: KVStore) -> None:
        """The optimizers this store is given are `store`'s (it is kept inside `store`,
        a dist store's shard): `gpukv.optim.claims` holds them for `store` (weakly)."""
        self._runs_for = weakref.ref(store)

    def _optimizer_holder(self) -> KVStore:
        """The store that holds the optimizers this one runs (`run_optimizers_for`)."""
        outer = None if self._runs_for is None else self._runs_for()
        return self if outer is None else outer

    def _let_go_of_optimizer(self, successor) -> None:
        """The optimizer set before, unless it is `successor`, is free for other stores."""
        if self._optimizer is not None and self._optimizer is not successor:
            from ..optim import claims as optimizer_claims
            optimizer_claims.release(self._optimizer, self._optimizer_holder())

    def optimizer_updater(self, op: str):
        """The OptimizerUpdater `set_optimizer` installed (the optimizer's per-key state);
        ArgumentError naming `op` when no optimizer is set."""
        if self._optimizer is None:
            raise ArgumentError(f"{op}: this store has no optimizer; call set_optimizer first")
        return self._updater

    def save_optimizer_states(self, fname: str | os.PathLike,
                              dump_optimizer: bool = False) -> None:
        from ..checkpoints.checkpoint import checkpoint_path, write_archive
        path = checkpoint_path(fname)
        with self._lock:
            header, arrays = self.optimizer_updater(
                "save_optimizer_states").export_state(bool(dump_optimizer))
            write_archive(path, header, arrays)

    def load_optimizer_states(self, fname: str | os.PathLike,
                              update_counts: str = "saved") -> None:
        from ..checkpoints.checkpoint import checkpoint_path, read_archive
        check.update_counts(update_counts)
        self.optimizer_updater("load_optimizer_states")
        path = checkpoint_path(fname)
        header, arrays = read_archive(path)
        with self._lock:
            updater = self.optimizer_updater("load_optimizer_states")
            if update_counts == "restart":
                header, arrays = restarted((header, arrays),
                                           updater.optimizer.begin_num_update)
            updater.import_state(header, arrays, self._entry_map(), path=path)

    def _entry_map(self) -> dict:
        return {k: (e.value, e.home) for k, e in self._entries.items()}

    @timeline.traced("save")
    def save(self, path: str | os.PathLike) -> None:
        from ..checkpoints import checkpoint
        with self._lock:  # the values stay as they are while the file is written
            checkpoint.save_store(self._snapshot(to_host=True), path)

    @timeline.traced("snapshot")
    def snapshot(self, root: str | os.PathLike, step: int | None = None,
                 user_state: dict | None = None, keep: int | None = 2) -> str:
        with self._lock:  # the step after the last snapshot's, whichever thread took it
            root, step, keep = snapshots.checked(root, step, keep, self._last_step)
            run = self._runs.get(root)
            if run is None:
                run = snapshots.next_run(root)
            folder = os.path.join(root, snapshots.folder_name(step, self._snapshot_tag(), run))
            worker = snapshots.worker_files(folder, step, 0, 1, user_state)
            claims.claim(root, self)  # (once the call is known good: a refusal takes nothing)
            self._runs[root] = run
            shard = os.path.join(folder, snapshots.shard_file(0, 1))
            then = None if keep is None else (lambda: snapshots.prune(root, keep))
            comp = self._compression
            state = (None, []) if comp is None else (comp.params(), comp.state())
            self.write_part(shard, step, None, [worker], then=then, compression=state)
            self._last_step = step
        return folder

    def resume(self, root: str | os.PathLike, check=None,
               into: list | None = None) -> snapshots.Snapshot | None:
        found = snapshots.latest_snapshot(root)
        if found is not None:
            if check is not None:
                check(found)
            saved = snapshots.read_compression(found, snapshots.shard_file(0, found.shards))
            for store in [self] if into is None else into:
                store.load(found)
            self._restore_compression(found, saved)
            self._last_step = found.step
            log.info("gpukv: resumed from snapshot %s (step %d)", found.path, found.step)
        else:
            log.info("gpukv: no complete snapshot under %s to resume from", os.fspath(root))
        return found

    def finish_snapshots(self) -> None:
        if self._snapshots is not None:
            self._snapshots.finish()

    def _snapshot_tag(self) -> str:
        if self._tag is None:
            self._tag = secrets.token_hex(4)
        return self._tag

    def write_part(self, path: str, step: int, pieces: dict | None, others: Sequence = (),
                   then=None, store_type: str | None = None,
                   compression: tuple | None = None) -> None:
        """Stage this store's keys (`pieces`: {key: (start, stop, shape, home kind, init
        index)} of the pieces it holds, of a store of `store_type`; None: every key whole)
        and write them to `path` in the background, then `others` ((path, header,
        arrays)), then call `then()`. `compression`: (params, [(record, live array)]) of
        the compression state to stage and write with them (params None: none was set),
        to which the values of the keys kept apart are added (what workers hold of them:
        records 'served' with their piece's 'start'); None: no compression section."""
        if self._snapshots is None:
            self._snapshots = snapshots.PartWriter()
        turn, staging = self._snapshots.stage()
        try:
            with self._lock:
                infos, values, served = [], [], []
                for index, (key, entry) in enumerate(self._entries.items()):
                    value = entry.stored
                    if pieces is None:
                        place = (0, value.size, value.shape, entry.home.kind, index)
                    elif key in pieces:
                        place = pieces[key]
                    else:
                        continue
                    start, stop, shape, home, order = place
                    infos.append({"key": key, "index": order, "home": home,
                                  "shape": list(shape), "start": start, "stop": stop})
                    values.append(staging.take(value.reshape(-1), entry.home))
                    if entry.kept is not None:
                        served.append(({"what": "served", "key": key, "start": start},
                                       entry.value.reshape(-1)))
                export = None if self._optimizer is None else self._updater.export_state(
                    True, staging.fetch, None if pieces is None else set(pieces))
                if compression is not None:
                    params, items = compression
                    section, comp_arrays = snapshots.compression_section(
                        params, items + served, staging, self._state_writer)
                staging.copy()
            header = snapshots.shard_header(step, store_type or self._type, self._key_kind,
                                            infos, export)
            arrays = snapshots.shard_arrays(values, export)
            if compression is not None:
                header["compression"] = section
                arrays.update(comp_arrays)
            files = [(path, header, arrays), *others]
        except BaseException:
            self._snapshots.release(turn)
            raise
        self._snapshots.submit(turn, files, then)

    def _state_writer(self, record: dict):
        """The device whose stream writes the compression state `record` names: a
        residual's source device; a pull residual's or served value's key's home (None:
        not known here)."""
        if record["what"] == "residual":
            named = record.get("device")
            return None if named is None else device_named(*named)
        entry = self._entries.get(record["key"])
        return None if entry is None else entry.home

    @timeline.traced("load")
    def load(self, path: str | os.PathLike) -> None:
        from ..checkpoints import checkpoint
        contents = snapshots.read_any(path)  # the file alone, outside the lock
        with self._lock:  # checked against the store and applied in one hold of the lock
            self._apply_load(checkpoint.plan_load(contents, self._snapshot()))

    def _snapshot(self, to_host: bool = False):
        """The store as `gpukv.checkpoints.checkpoint` sees it; with `_apply_load`, the only door
        between a store and its checkpoints.

        A `checkpoint.StoreSnapshot`: the store's type and key kind, (key, value, home
        kind) of every key in init order, and the optimizer's updater (None without
        `set_optimizer`). `to_host`: values as NumPy arrays (GPU values copied over);
        otherwise the stored arrays, for their shapes and dtypes. Host values are the
        store's own arrays: hold the store's lock for as long as the snapshot is used.
        """
        from ..checkpoints.checkpoint import StoreSnapshot
        with self._lock:
            if to_host:
                entries = [(k, e.home.to_host(e.stored), e.home.kind)
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
            # an optimizer's master copies follow (a state the file brought is its own)
            replaced = (getattr(self._updater, "value_replaced", None)
                        if plan.optimizer is None else None)
            for key, value in plan.updates:
                entry = entries[key]
                entry.home.copy(entry.value, value)
                entry.kept = None  # what workers hold is the file's value
                if replaced is not None:
                    replaced(key, entry.value, entry.home)
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

    def _restore_compression(self, found: snapshots.Snapshot,
                             saved: snapshots.Compression) -> None:
        """After a resume loaded `found`: put back the compression state `saved` (its
        shard's) when it fits this store, else start it afresh, saying why at INFO.

        It fits when the snapshot is a one-process store's, saved with the compression
        set here (the same params), every device it names a residual of is in this
        process, every key it names is here with the size it had, and served values
        (kept apart from the value by an updater) have an updater here to keep apart."""
        with self._lock:
            comp = self._compression
            if comp is None and saved.params is None:
                return
            mine = None if comp is None else comp.params()
            if comp is not None:  # afresh, whatever follows
                self._compress_afresh(make_compressor(mine))
                comp = self._compression
            reason: str | None
            if not saved.present:
                reason = ("the snapshot holds none (written before snapshots kept them), "
                          f"resuming with {mine}")
            elif found.shards != 1 or found.workers != 1:
                reason = (f"saved by a store of {found.workers} worker(s) and "
                          f"{found.shards} shard(s), resuming with {mine} in one process")
            elif saved.params != mine:
                reason = f"saved with {saved.params}, resuming with {mine}"
            else:
                reason = self._unfit_compression(saved)
            if reason is not None:
                log.info("gpukv: compression residuals of the snapshot not restored: %s",
                         reason)
                return
            assert comp is not None  # the params matched
            touched = set()
            for record, array in zip(saved.records, saved.arrays):
                key, what = record["key"], record["what"]
                entry = self._entries[key]
                if what == "residual":
                    device = device_named(*record["device"])
                    assert device is not None  # `_unfit_compression` found it
                    comp.restore_residual(key, device, array.reshape(-1))
                    touched.add(device)
                elif what == "pull":
                    comp.restore_pull(key, entry.home, array.reshape(-1))
                elif what == "served":
                    entry.keep()
                    entry.home.copy(entry.value, array.reshape(entry.value.shape))
                else:
                    comp.restore_q(key, array)
                touched.add(entry.home)
            for device in touched:  # the file's host arrays go away after this call
                device.synchronize()
            log.debug("gpukv: restored the snapshot's compression state (%s): %d "
                      "array(s)", mine, len(saved.arrays))

    def _unfit_compression(self, saved: snapshots.Compression) -> str | None:
        """Why the compression state `saved` does not fit this store, or None."""
        for record, array in zip(saved.records, saved.arrays):
            key, what = record["key"], record["what"]
            entry = (self._entries.get(key) if type(key) in (int, str) else None)
            if entry is None:
                return f"it names key {key!r}, which this store lacks"
            if what != "q" and array.size != entry.value.size:
                return (f"key {key!r} has {entry.value.size} elements, but its saved "
                        f"{what} has {array.size}")
            if what == "residual":
                named = record.get("device")
                if not (isinstance(named, list) and len(named) == 3
                        and isinstance(named[0], str)
                        and all(type(n) is int for n in named[1:])
                        and device_named(*named) is not None):
                    return f"it holds a residual of key {key!r} on {named}, not in this process"
            if what == "served" and self._updater is None:
                return (f"it holds the served value of key {key!r}, kept apart by an "
                        f"updater, and this store has none")
        return None

    # ------------------------------------------------- compression and row-sparse
    def _compression_allowed(self) -> bool:
        """MXNet's rule: gradient compression for 'device' and 'dist' stores only."""
        return "device" in self._type or "dist" in self._type

    def set_gradient_compression(self, compression_params: dict | None) -> None:
        if not self._compression_allowed():
            raise ArgumentError(
                f"gradient compression is not supported for a {self._type!r} store "
                f"(as in MXNet); use 'device' or a 'dist' store")
        compressor = make_compressor(compression_params)
        with self._lock:
            self._compress_afresh(compressor)

    def _compress_afresh(self, compressor) -> None:
        """Compress with `compressor` (None: not at all), every residual afresh, the
        served values' too: they become the values. The caller holds the lock."""
        self._compression = (None if compressor is None
                             else GradientCompression(compressor, self._deterministic))
        self.rejoin()

    @property
    def gradient_compression(self) -> dict | None:
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
            log.warning("gpukv: RowSparse outs left unchanged (pull with "
                        "ignore_sparse=True, and broadcast, skip them as MXNet's do); use "
                        "row_sparse_pull(key, out, row_ids) for them")
        rest = rows.regroup(rest_keys, rest_arrays, groups.key_kind)
        return rest, rest_entries

    @timeline.traced("row_sparse_pull")
    def row_sparse_pull(self, key: Keys, out: Values | None = None, row_ids: Any = None,
                        priority: int = 0) -> None:
        if type(priority) is not int:
            check.check_priority(key, priority, check.ROW_SPARSE_ORDER)
        pairs = check.row_sparse_pairs(key, out, row_ids)
        with self._lock:
            for entry, o, ids in check.row_sparse_pulls(pairs, self._entries, self._key_kind):
                rows.fill_rows(entry, o, ids)

    def __repr__(self):
        return (f"<gpukv.KVStore type={self._type!r} strategy={self._strategy.name!r} "
                f"deterministic={self._deterministic} keys={len(self._entries)}>")

    # ------------------------------------------------- what a dist store uses of it
    # A DistKVStore keeps its keys in LocalStores (its copies of the values, its local
    # sums, the shard its engine serves) and drives them through the methods below (and
    # `optimizer_updater`, `write_part`) only: it checks each call itself, with `check`,
    # then has them run it on the checked groups, so nothing is checked twice.
    def pin(self, device: Device) -> None:
        """Make every key from now on on `device` (a dist store's NCCL GPU)."""
        self._pinned = device

    def speak_as(self, name: str | None) -> None:
        """Name the store the notices this one logs are of: a store kept inside another
        speaks as that one, once (`name`), or not at all (None)."""
        self._speaks_as = name

    @property
    def key_kind(self) -> type | None:
        """The kind of key the store holds: int or str (None before its first key)."""
        return self._key_kind

    @property
    def optimizer(self) -> Optimizer | None:
        """The optimizer `set_optimizer` installed, or None."""
        return self._optimizer

    def entries(self) -> Mapping[Key, Any]:
        """The store's keys, in init order, read-only: key -> entry, whose `value` is the
        array pulls read, `stored` the key's value proper (the same array unless
        `keep_apart`) and `home` the Device it lives on."""
        return MappingProxyType(self._entries)

    def lookup(self, groups: check.Groups, op: str) -> list:
        """The entries of a call's keys, in order; KeyKindError or UnknownKeyError naming
        the key, for the call `op`."""
        return check.lookup(self._entries, self._key_kind, groups, op)

    def init_checked(self, groups: check.Groups) -> None:
        """`init` of `check.group`'s groups (each key's first array is copied)."""
        with self._lock:
            self._init_groups(groups)

    def push_checked(self, groups: check.Groups, entries: list) -> None:
        """`push` of `check.group`'s groups into their `entries` (from `lookup`), whose
        sources passed `check.all_sources`."""
        with self._lock:
            self._run_push(self._plan_push(groups, entries))

    def pull_checked(self, groups: check.Groups, entries: list,
                     ignore_sparse: bool = True) -> None:
        """`pull` of `entries` (from `lookup`) into `check.group`'s groups of outs, which
        passed `check.all_outs`."""
        with self._lock:
            self._pull_groups(groups, entries, ignore_sparse)

    def adopt(self, keys, arrays) -> None:
        """Serve `arrays` themselves (views of a worker's copies of the keys, on the host
        or a GPU) as the values of new `keys`: updates land in the worker's copy, with no
        copy between."""
        self.init(keys, [device_of(a).to_host(a) for a in arrays])
        for key, array in zip(keys, arrays):
            entry = self._entries[key]
            entry.value, entry.home = array, device_of(array)
        self._adopted = True

    def values_written(self, keys) -> None:
        """The program wrote `keys`' adopted values in place (between two updates): an
        optimizer's float32 master copies of 16-bit values take the elements written
        (else the next update would start from the old weights and write them over the
        new). The caller orders its writes before this call."""
        written = getattr(self._updater, "value_written", None)
        if written is None:
            return
        with self._lock:
            for key in keys:
                entry = self._entries[key]
                with entry.home.activate():
                    written(key, entry.value, entry.home)
                entry.home.synchronize()

    def keep_apart(self, keys) -> None:
        """From now on the updater updates a copy of each of `keys`' values, and the
        values themselves are what workers hold (compressed pulls; see `_Entry`)."""
        with self._lock:
            for key in keys:
                self._entries[key].keep()

    def settles_pulls(self) -> bool:
        """Whether the updater is an optimizer whose compressed pulls settle each value
        (`Optimizer.settles_compressed_pulls`, `gpukv.encoding.pulls`)."""
        return pipeline.settles_pulls(self._updater)

    def rejoin(self, keys=None) -> None:
        """The value of `keys` (None: every key) is what workers hold again: the copies
        kept apart go."""
        with self._lock:
            for key in self._entries if keys is None else keys:
                self._entries[key].kept = None

    def update_merged(self, keys, merged) -> None:
        """Apply the updater (or assign) to `keys` with their summed gradients `merged`,
        in the store's order; a `merged` that is the stored array itself is assigned.
        (What the optimizer takes was checked by every worker before it pushed.)"""
        entries = [self._entries[k] for k in keys]
        updater = self._updater
        updates = [(k, e, m) for k, e, m in zip(keys, entries, merged)
                   if updater is not None or m is not e.value]
        if updates:
            self._run_push(pipeline.PushPlan([], [], [], updates, [], []))

"""The front end: `create()` and `KVStore`. Orchestration only, never imports CuPy."""
from __future__ import annotations

import logging
import threading

import numpy as np

from . import _args
from ._errors import (ArgumentError, ArgumentKindError, DTypeError, DuplicateKeyError,
                      KeyKindError, ReadOnlyError, ShapeError, UnknownKeyError)
from .backends import SUPPORTED_DTYPES, Device, device_of, host_device
from .comm import BroadcastJob, HostStrategy, ReduceJob, accumulate_dtype, host_sum
from .comm.registry import make_strategy

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
_HOST_STRATEGY = HostStrategy()


class _SplitStrategy:
    """Sends GPU-homed jobs to the GPU strategy and host-homed ones to the host strategy."""

    def __init__(self, gpu_strategy):
        self._gpu = gpu_strategy

    def _split(self, jobs):
        return ([j for j in jobs if j.home.kind == "gpu"],
                [j for j in jobs if j.home.kind != "gpu"])

    def reduce_many(self, jobs):
        on_gpu, on_host = self._split(jobs)
        self._gpu.reduce_many(on_gpu)
        _HOST_STRATEGY.reduce_many(on_host)

    def broadcast_many(self, jobs):
        on_gpu, on_host = self._split(jobs)
        self._gpu.broadcast_many(on_gpu)
        _HOST_STRATEGY.broadcast_many(on_host)


class _Entry:
    """One key: its value on its home device, and a scratch buffer for merged pushes."""

    __slots__ = ("value", "home", "narrow", "_merge")

    def __init__(self, value, home: Device):
        self.value = value
        self.home = home
        self.narrow = accumulate_dtype(value.dtype) != value.dtype
        self._merge = None

    def merge_buffer(self):
        """Where pushes are summed before the updater sees them (float32 for fp16/bf16).

        Reused across pushes, as MXNet reuses its merge buffer: an updater must not keep
        a reference to `merged` beyond its call.
        """
        if self._merge is None:
            self._merge = self.home.empty(self.value.shape, accumulate_dtype(self.value.dtype))
        return self._merge


class _FunctionUpdater:
    """Adapts `fn(key, merged, stored)` to the batch protocol optimizers implement."""

    def __init__(self, fn):
        self.fn = fn

    def update(self, keys, merged, stored, homes):
        for key, m, s, home in zip(keys, merged, stored, homes):
            if home.kind == "gpu":
                with home.cuda_device, home.stream:
                    self.fn(key, m, s)
            else:
                self.fn(key, m, s)


def create(name: str = "local", **options) -> "KVStore":
    """A new store. `name`: 'local', 'device', 'nccl' or one of MXNet's aliases.

    Options of GPU stores: `strategy` ('auto', 'home', 'tree', 'ring', 'cpu', 'nccl'; the
    environment variable GPUKV_STRATEGY gives the default).
    """
    if not isinstance(name, str):
        raise ArgumentKindError(f"store name: expected a str, got {type(name).__name__}")
    lowered = name.lower()
    if lowered not in _TYPES:
        raise ArgumentError(
            f"store name {name!r}: unknown; valid names are {', '.join(sorted(_TYPES))}")
    return KVStore(lowered, **options)


class KVStore:
    """A key-value store of tensors shared by several devices (see `create`)."""

    def __init__(self, name: str, *, strategy: str | None = None):
        self._type = name
        self._on_gpu = _TYPES[name]
        if name == "nccl" and strategy is None:
            strategy = "nccl"
        self._strategy = make_strategy(strategy, on_gpu=self._on_gpu)
        self._entries: dict = {}
        self._key_kind: type | None = None
        self._updater = None
        self._load: dict = {}  # home device -> bytes of the keys it holds
        self._lock = threading.RLock()
        self._said_host = False

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
    def strategy(self) -> str:
        return self._strategy.name

    def is_capable(self, capability: str) -> bool:
        """Whether this store supports `capability` ('optimizer', 'gradient_compression')."""
        if not isinstance(capability, str):
            raise ArgumentKindError(
                f"capability: expected a str, got {type(capability).__name__}")
        lowered = capability.lower()
        if lowered == "gradient_compression":
            return self._on_gpu
        if lowered in _CAPABILITIES:
            return True
        raise ArgumentError(
            f"capability {capability!r}: unknown; known are {', '.join(sorted(_CAPABILITIES))}")

    def barrier(self) -> None:
        """Wait for every worker (one process: returns at once)."""

    _barrier = barrier

    # ---------------------------------------------------------------- validation
    def _check_kind(self, kind) -> None:
        if kind is not None and self._key_kind is not None and kind is not self._key_kind:
            raise KeyKindError(
                f"this store holds {self._key_kind.__name__} keys; got a {kind.__name__} key")

    def _lookup(self, groups: _args.Groups, op: str) -> list:
        self._check_kind(groups.key_kind)
        entries = []
        for key in groups.keys:
            entry = self._entries.get(key)
            if entry is None:
                raise UnknownKeyError(f"key {key!r}: {op} of a key that was never initialised")
            entries.append(entry)
        return entries

    @staticmethod
    def _check_sources(key, entry: _Entry, arrays, op: str) -> None:
        value = entry.value
        for a in arrays:
            if a.shape != value.shape:
                raise ShapeError(
                    f"key {key!r}: {op} expects shape {value.shape}, got {a.shape}")
            if a.dtype != value.dtype:
                raise DTypeError(
                    f"key {key!r}: {op} expects dtype {value.dtype}, got {a.dtype}")

    @staticmethod
    def _check_outs(key, shape, arrays) -> None:
        for a in arrays:
            if a.shape != shape:
                raise ShapeError(f"key {key!r}: pull expects out of shape {shape}, got {a.shape}")
            if a.dtype.name not in SUPPORTED_DTYPES:
                raise DTypeError(f"key {key!r}: out has unsupported dtype {a.dtype}; "
                                 f"supported: {', '.join(sorted(SUPPORTED_DTYPES))}")
            if isinstance(a, np.ndarray) and not a.flags.writeable:
                raise ReadOnlyError(f"key {key!r}: out array is read-only")

    def _check_init(self, groups: _args.Groups) -> None:
        self._check_kind(groups.key_kind)
        for key, arrays in zip(groups.keys, groups.arrays):
            if key in self._entries:
                raise DuplicateKeyError(f"key {key!r}: already initialised")
            first = arrays[0]
            if first.dtype.name not in SUPPORTED_DTYPES:
                raise DTypeError(f"key {key!r}: unsupported dtype {first.dtype}; "
                                 f"supported: {', '.join(sorted(SUPPORTED_DTYPES))}")
            for a in arrays[1:]:
                if a.shape != first.shape:
                    raise ShapeError(f"key {key!r}: init values disagree in shape: "
                                     f"{first.shape} and {a.shape}")
                if a.dtype != first.dtype:
                    raise DTypeError(f"key {key!r}: init values disagree in dtype: "
                                     f"{first.dtype} and {a.dtype}")

    # --------------------------------------------------------------- home devices
    def _candidates(self, arrays) -> list:
        """The devices a new key may live on."""
        if not self._on_gpu or all(isinstance(a, np.ndarray) for a in arrays):
            if self._on_gpu and not self._said_host:
                self._said_host = True
                log.warning("gpukv %r store: only host arrays, so keys are reduced on the host",
                            self._type)
            return [_HOST]
        from .backends.cuda import gpu_devices
        return gpu_devices()

    def _assign_homes(self, groups: _args.Groups) -> list:
        """Home devices for new keys: the largest keys first, each to the least-loaded device."""
        homes = [None] * len(groups.keys)
        order = sorted(range(len(groups.keys)), key=lambda i: -groups.arrays[i][0].nbytes)
        for i in order:
            candidates = self._candidates(groups.arrays[i])
            home = min(candidates, key=lambda d: self._load.get(d, 0))
            self._load[home] = self._load.get(home, 0) + groups.arrays[i][0].nbytes
            homes[i] = home
        return homes

    @staticmethod
    def _devices(arrays) -> list:
        """The logical device of each array: the n-th array on one memory is its n-th slot."""
        seen: dict = {}
        devices = []
        for a in arrays:
            where = None if isinstance(a, np.ndarray) else a.device.id
            slot = seen.get(where, 0)
            seen[where] = slot + 1
            devices.append(device_of(a, slot))
        return devices

    # ------------------------------------------------------------------ the API
    def init(self, key, value) -> None:
        """Create key(s) with a copy of `value` (per key: an array, or a list that agree)."""
        groups = _args.group(key, value, "value")
        with self._lock:
            self._init_groups(groups)

    def _init_groups(self, groups: _args.Groups) -> None:
        self._check_init(groups)
        homes = self._assign_homes(groups)
        for key, arrays, home in zip(groups.keys, groups.arrays, homes):
            source = arrays[0]
            stored = home.empty(source.shape, source.dtype)
            if home.kind == "gpu":
                home.wait_for(self._devices([source])[0])
            home.copy(stored, source)
            self._entries[key] = _Entry(stored, home)
        if groups.key_kind is not None:
            self._key_kind = groups.key_kind

    def push(self, key, value, priority: int = 0) -> None:
        """Sum the value(s) of each key and apply the updater (default: assign) at home."""
        groups = _args.group(key, value, "value")
        with self._lock:
            entries = self._lookup(groups, "push")
            for k, entry, arrays in zip(groups.keys, entries, groups.arrays):
                self._check_sources(k, entry, arrays, "push")
            self._push_groups(groups, entries)

    def _push_groups(self, groups: _args.Groups, entries: list) -> None:
        updater = self._updater
        jobs, merged = [], []
        for key, entry, sources in zip(groups.keys, entries, groups.arrays):
            assign_direct = updater is None and not entry.narrow
            if entry.home is _HOST and groups.all_host:
                if assign_direct:
                    host_sum(entry.value, sources)
                    continue
                if len(sources) == 1 and not entry.narrow:
                    view = sources[0].view()  # the updater may read but never change it
                    view.flags.writeable = False
                    merged.append(view)
                    continue
                out = entry.merge_buffer()
                host_sum(out, sources)
                merged.append(out)
                continue
            out = entry.value if assign_direct else entry.merge_buffer()
            jobs.append(ReduceJob(key, sources, self._devices(sources), entry.home, out))
            if not assign_direct:
                merged.append(out)
        if jobs:
            self._strategy_for(jobs).reduce_many(jobs)
        if not merged:
            return
        pending = [(k, e) for k, e in zip(groups.keys, entries)
                   if not (updater is None and not e.narrow)]
        keys = [k for k, _ in pending]
        stored = [e.value for _, e in pending]
        homes = [e.home for _, e in pending]
        if updater is None:  # narrow floats: summed in fp32, assigned with one cast
            for m, s, home in zip(merged, stored, homes):
                home.copy(s, m)
        else:
            updater.update(keys, merged, stored, homes)

    def pull(self, key, out=None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Copy the value of each key into every array of `out` (written in place)."""
        if out is None:
            raise ArgumentError(f"key {key!r}: pull needs `out` arrays to write into")
        groups = _args.group(key, out, "out")
        with self._lock:
            entries = self._lookup(groups, "pull")
            for k, entry, arrays in zip(groups.keys, entries, groups.arrays):
                self._check_outs(k, entry.value.shape, arrays)
            self._pull_groups(groups, entries)

    def _pull_groups(self, groups: _args.Groups, entries: list) -> None:
        jobs = []
        for key, entry, outs in zip(groups.keys, entries, groups.arrays):
            if entry.home is _HOST and groups.all_host:
                src = entry.value
                for o in outs:
                    np.copyto(o, src, casting="unsafe")
                continue
            jobs.append(BroadcastJob(key, entry.value, entry.home, outs, self._devices(outs)))
        if jobs:
            self._strategy_for(jobs).broadcast_many(jobs)

    def _strategy_for(self, jobs):
        """The store's strategy, or the host one for keys whose home is the host."""
        if all(job.home.kind == "gpu" for job in jobs):
            return self._strategy
        if any(job.home.kind == "gpu" for job in jobs):
            return _SplitStrategy(self._strategy)
        return _HOST_STRATEGY

    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """Push `value` then pull into `out` (or back into `value` when out is None)."""
        groups = _args.group(key, value, "value")
        out_groups = groups if out is None else _args.group(key, out, "out")
        with self._lock:
            entries = self._lookup(groups, "pushpull")
            out_entries = entries if out is None else self._lookup(out_groups, "pushpull")
            for k, entry, arrays in zip(groups.keys, entries, groups.arrays):
                self._check_sources(k, entry, arrays, "pushpull")
            for k, entry, arrays in zip(out_groups.keys, out_entries, out_groups.arrays):
                self._check_outs(k, entry.value.shape, arrays)
            self._push_groups(groups, entries)
            self._pull_groups(out_groups, out_entries)

    def broadcast(self, key, value, out) -> None:
        """Initialise key(s) with `value`, then pull into `out`."""
        groups = _args.group(key, value, "value")
        out_groups = _args.group(key, out, "out")
        with self._lock:
            self._check_init(groups)
            self._check_kind(out_groups.key_kind)
            shapes = dict(zip(groups.keys, (a[0].shape for a in groups.arrays)))
            for k, arrays in zip(out_groups.keys, out_groups.arrays):
                if k not in shapes:
                    raise ArgumentError(f"key {k!r}: broadcast has an out but no value for it")
                self._check_outs(k, shapes[k], arrays)
            self._init_groups(groups)
            self._pull_groups(out_groups, self._lookup(out_groups, "broadcast"))

    def set_updater(self, updater) -> None:
        """Use `updater(key, merged, stored)` on every push; it changes `stored` in place."""
        if not callable(updater):
            raise ArgumentKindError(
                f"updater: expected a callable, got {type(updater).__name__}")
        with self._lock:
            self._updater = _FunctionUpdater(updater)

    _set_updater = set_updater

    def __repr__(self):
        return (f"<gpukv.KVStore type={self._type!r} strategy={self._strategy.name!r} "
                f"keys={len(self._entries)}>")

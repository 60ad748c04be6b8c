"""The one-process stores a dist store is made of: the shard a process serves, the
stores that keep its copies and sums, and the gathered optimizer state a checkpoint
writes. KVStore's own machinery (checks, updaters, the push pipeline) does the work."""
from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from .._errors import CheckpointError
from ..comm import ReduceJob
from ..comm.canonical import Canonical
from ..comm.host import HostStrategy
from ..device import device_of, host_device
from . import check, snapshots
from .pipeline import PushPlan, devices_of, host_slots
from .store import Key, KVStore

#: the kind of a store's keys: int or str
KeyKind = type


class Shard(KVStore):
    """The keys (or pieces of keys) this process serves: a host store the engines of
    `gpukv.distributed` sum into and read back."""

    def __init__(self):
        super().__init__("local")

    def stored(self, key) -> np.ndarray:
        return self._entries[key].value

    def adopt(self, keys, arrays) -> None:
        """Serve `arrays` themselves (views of a worker's copies of the keys, on the host
        or a GPU) as the values of new `keys`: updates land in the worker's copy, with no
        copy between."""
        self.init(keys, [device_of(a).to_host(a) for a in arrays])
        for key, array in zip(keys, arrays):
            entry = self._entries[key]
            entry.value, entry.home = array, device_of(array)

    def update(self, keys, merged) -> None:
        """Apply the updater (or assign) to `keys` with their summed gradients `merged`,
        in the store's order; a `merged` that is the stored array itself is assigned.
        (What the optimizer takes was checked by every worker before it pushed.)"""
        entries = [self._entries[k] for k in keys]
        updater = self._updater
        updates = [(k, e, m) for k, e, m in zip(keys, entries, merged)
                   if updater is not None or m is not e.value]
        if updates:
            self._run_push(PushPlan([], [], [], updates, [], []))

    def assign(self, key, value) -> None:
        """Set a key's value, without the updater (a checkpoint's value)."""
        entry = self._entries[key]
        entry.home.copy(entry.value, value.reshape(entry.value.shape))

    def export_state(self, dump: bool):
        """The optimizer's state, as `save_optimizer_states` writes it; None without one."""
        return None if self._optimizer is None else self._updater.export_state(dump)

    def check_state(self, state):
        """Check (header, arrays) of an optimizer state against these keys (see
        `OptimizerUpdater.check_state`); the plan `apply_state` installs."""
        header, arrays = state
        updater = self._optimizer_updater("load_optimizer_states")
        return updater.check_state(header, arrays,
                                   {k: e.value for k, e in self._entries.items()})

    def apply_state(self, plan) -> None:
        self._updater.apply_state(plan, {k: e.home for k, e in self._entries.items()})

    def apply_settings(self, settings: tuple) -> None:
        """The optimizer takes over a worker's `Optimizer.settings()`."""
        self._optimizer.apply_settings(settings)

    def write_part(self, request: dict) -> str | None:
        """Stage the pieces this shard serves and write them as shard "index" of "count"
        of the snapshot in "folder" (see `Engine.write_snapshot`); the error of an
        earlier write that failed (nothing is staged then), else None."""
        keys = request["keys"]
        pieces = {key: (start, stop, shape, *keys[key])
                  for key, (start, stop, shape) in request["pieces"].items()}
        path = os.path.join(request["folder"],
                            snapshots.shard_file(request["index"], request["count"]))
        try:
            self._write_part(path, request["step"], pieces, [],
                             store_type=request["store_type"])
        except CheckpointError as exc:
            return str(exc)
        return None

    def finish_part(self) -> str | None:
        try:
            self.finish_snapshots()
        except CheckpointError as exc:
            return str(exc)
        return None


class PinnedStore(KVStore):
    """A one-process store a dist store keeps keys in (its values, its local sums): its
    keys all live on `pinned` (the NCCL GPU), or where KVStore places them (`pinned` None).

    The dist store checks each call itself (with `check`, against `entries()`), then has
    the methods below run it on the checked `check.Groups`: nothing is checked twice, and
    the dist store reads nothing private of this store.
    """

    def __init__(self, name: str, pinned, **options):
        super().__init__(name, **options)
        self._pinned = pinned

    def _candidates(self, arrays) -> list:
        return [self._pinned] if self._pinned is not None else super()._candidates(arrays)

    @property
    def key_kind(self) -> KeyKind | None:
        """The kind of key the store holds: int or str (None before its first key)."""
        return self._key_kind

    def entries(self) -> Mapping[Key, Any]:
        """The store's keys, in init order, read-only: key -> entry, whose `value` is the
        stored array and `home` the Device it lives on."""
        return MappingProxyType(self._entries)

    def lookup(self, groups: check.Groups, op: str) -> list:
        """The entries of a call's keys, in order; KeyKindError or UnknownKeyError naming
        the key, for the call `op`."""
        return self._lookup(groups, op)

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


_NODES = Canonical(HostStrategy())


def node_sums(key, arrays: list, all_host: bool, ranges: list, first: int,
              out: np.ndarray, shape: tuple) -> None:
    """out[i] = the canonical sum of the values of node `ranges[i]` ([a, b) of the key's
    leaves; `arrays` are leaves first, first + 1, ...), in out's dtype, on the host. A
    node of several GPU values is summed on the GPU of its first (which reads the others
    where it can) and crosses to the host once."""
    devices = host_slots(len(arrays)) if all_host else devices_of(arrays)
    host = host_device(0)
    jobs, copies = [], []
    for (a, b), row in zip(ranges, out):
        values, where = list(arrays[a - first:b - first]), list(devices[a - first:b - first])
        home = where[0]
        if home.host_memory or len(values) == 1:
            jobs.append(ReduceJob(key, values, where, host, row.reshape(shape)))
            continue
        total = home.empty(shape, out.dtype)
        jobs.append(ReduceJob(key, values, where, home, total))
        copies.append((row, home, total))
    _NODES.reduce_many(jobs)
    for row, home, total in copies:
        row[...] = home.to_host(total).reshape(-1)


def leaf_values(arrays: list, dtype, out: np.ndarray) -> None:
    """out[j] = `arrays[j]` as a compressor reads a pushed value: on the host, cast to
    the key's `dtype` (as a push converts it), then to float32."""
    for array, row in zip(arrays, out):
        host = device_of(array).to_host(array)
        row[...] = host.astype(dtype, copy=False).reshape(-1)


class SavedState:
    """The optimizer state a dist store gathered, for `checkpoint.save_store`."""

    def __init__(self, state):
        self.state = state

    def export_state(self, dump_optimizer: bool = False):
        return self.state

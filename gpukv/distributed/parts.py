"""The one-process stores a dist store is made of: the shard a process serves, the
stores that keep its copies and sums, and the gathered optimizer state a checkpoint
writes. LocalStore's own machinery (checks, updaters, the push pipeline) does the work,
driven through its public surface."""
from __future__ import annotations

import contextlib
import os

import numpy as np

from .._errors import CheckpointError
from ..checkpoints import snapshots
from ..comm import ReduceJob
from ..comm.canonical import Canonical
from ..comm.host import HostStrategy
from ..device import device_of, host_device
from ..store.local import LocalStore
from ..store.pipeline import devices_of, host_slots


class Shard:
    """The keys (or pieces of keys) this process serves, for the engines of
    `gpukv.distributed` (their `Shard` protocol): a host `LocalStore` they sum into and
    read back, driven through its public surface."""

    def __init__(self, deterministic: bool = False):
        # (its sums in the canonical order as the dist store's: never the environment's
        # GPUKV_DETERMINISTIC, which the dist store's option wins over)
        self.store = LocalStore("local", deterministic=deterministic)

    def init(self, key, value) -> None:
        self.store.init(key, value)

    def push(self, key, value, priority: int = 0) -> None:
        self.store.push(key, value, priority)

    def run_optimizers_for(self, store) -> None:
        """The optimizers the shard runs are `store`'s, the dist store it serves
        (`LocalStore.run_optimizers_for`)."""
        self.store.run_optimizers_for(store)

    def set_optimizer(self, optimizer) -> None:
        self.store.set_optimizer(optimizer)

    def set_updater(self, updater) -> None:
        self.store.set_updater(updater)

    def stored(self, key) -> np.ndarray:
        return self.store.entries()[key].stored

    def served(self, key) -> np.ndarray:
        return self.store.entries()[key].value

    def keep_apart(self, keys) -> None:
        self.store.keep_apart(keys)

    def settles_pulls(self) -> bool:
        return self.store.settles_pulls()

    def rejoin(self, keys=None) -> None:
        self.store.rejoin(keys)

    def adopt(self, keys, arrays) -> None:
        self.store.adopt(keys, arrays)

    def update(self, keys, merged) -> None:
        self.store.update_merged(keys, merged)

    def counted_as(self, num_updates: dict) -> contextlib.AbstractContextManager:
        """The optimizer's updates inside take the num_updates ({key: it}) the workers
        counted (see `Optimizer.counting_round`)."""
        optimizer = self.store.optimizer
        if not num_updates or optimizer is None:
            return contextlib.nullcontext()
        return optimizer.counting_round(list(num_updates), num_updates)

    def assign(self, key, value) -> None:
        """Set a key's value, without the updater (a checkpoint's value)."""
        entry = self.store.entries()[key]
        entry.home.copy(entry.value, value.reshape(entry.value.shape))
        self.store.rejoin([key])  # what workers hold is that value too
        if self.store.optimizer is not None:  # its master copy follows (a state loaded
            # with the value replaces it after)
            self.store.optimizer_updater("load").value_replaced(key, entry.value, entry.home)

    def export_state(self, dump: bool):
        """The optimizer's state, as `save_optimizer_states` writes it; None without one."""
        if self.store.optimizer is None:
            return None
        return self.store.optimizer_updater("save_optimizer_states").export_state(dump)

    def check_state(self, state):
        """Check (header, arrays) of an optimizer state against these keys (see
        `OptimizerUpdater.check_state`); the plan `apply_state` installs."""
        header, arrays = state
        updater = self.store.optimizer_updater("load_optimizer_states")
        return updater.check_state(header, arrays,
                                   {k: e.value for k, e in self.store.entries().items()})

    def apply_state(self, plan) -> None:
        self.store.optimizer_updater("load_optimizer_states").apply_state(
            plan, {k: e.home for k, e in self.store.entries().items()})

    def apply_settings(self, settings: tuple) -> None:
        """The optimizer takes over a worker's `Optimizer.settings()`."""
        optimizer = self.store.optimizer
        assert optimizer is not None  # the workers set one before they send its settings
        optimizer.apply_settings(settings)

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
            self.store.write_part(path, request["step"], pieces, [],
                                  store_type=request["store_type"],
                                  compression=request.get("compression"))
        except CheckpointError as exc:
            return str(exc)
        return None

    def finish_part(self) -> str | None:
        try:
            self.store.finish_snapshots()
        except CheckpointError as exc:
            return str(exc)
        return None


def pinned_store(name: str, pinned, **options) -> LocalStore:
    """A one-process store a dist store keeps keys in (its values, its local sums): its
    keys all live on `pinned` (the NCCL GPU), or where LocalStore places them (`pinned`
    None). The dist store checks each call itself and drives it through LocalStore's
    surface for it (`lookup`, `init_checked`, `push_checked`, `pull_checked`, ...)."""
    store = LocalStore(name, **options)
    if pinned is not None:
        store.pin(pinned)
    return store


def share_of(store: LocalStore, folder: str, step: int, index: int,
             count: int) -> str | None:
    """Write every count-th key of `store` from the index-th, whole, as shard `index` of
    `count` of the snapshot in `folder`, in the background: one worker's share of a store
    every worker of a dist store holds alike (`DistKVStore.snapshot(replicated=)`). The
    error of an earlier write that failed, else None."""
    pieces = {key: (0, e.value.size, e.value.shape, e.home.kind, i)
              for i, (key, e) in enumerate(store.entries().items()) if i % count == index}
    try:
        store.write_part(os.path.join(folder, snapshots.shard_file(index, count)), step,
                         pieces, [])
    except CheckpointError as exc:
        return str(exc)
    return None


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

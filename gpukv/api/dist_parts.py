"""The one-process stores a dist store is made of: the shard a process serves, the
stores that keep its copies and sums, and the gathered optimizer state a checkpoint
writes. KVStore's own machinery (checks, updaters, the push pipeline) does the work."""
from __future__ import annotations

import numpy as np

from ..device import device_of
from .store import KVStore, _PushPlan


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
            self._run_push(_PushPlan([], [], [], updates, [], []))

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


class PinnedStore(KVStore):
    """A one-process store whose keys all live on `pinned` (the NCCL GPU), or one that
    places them as KVStore does (`pinned` None)."""

    def __init__(self, name: str, pinned, **options):
        super().__init__(name, **options)
        self._pinned = pinned

    def _candidates(self, arrays) -> list:
        return [self._pinned] if self._pinned is not None else super()._candidates(arrays)


class SavedState:
    """The optimizer state a dist store gathered, for `checkpoint.save_store`."""

    def __init__(self, state):
        self.state = state

    def export_state(self, dump_optimizer: bool = False):
        return self.state

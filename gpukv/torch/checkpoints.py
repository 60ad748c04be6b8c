"""A Trainer's snapshots: taken every few steps, and resumed from when it is made."""
from __future__ import annotations

import numbers
import sys
import time

from .._errors import ArgumentError, CheckpointError
from ..checkpoints import snapshots
from ..distributed.store import DistKVStore
from ..store.base import KVStore

#: the layout of what the Trainer keeps beside the user's state in a snapshot
_TRAINER = "gpukv.torch.Trainer"


def _count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ArgumentError(f"{name}={value!r}: expected an int >= {low}")
    return int(value)


class Checkpoints:
    """Where and how often a Trainer snapshots its state, and its resume.

    `store` takes the snapshots: the store that holds the weights and the optimizer's
    state, or, with update_on_kvstore=False on a dist store, the dist store, which has
    each worker write a share of `replicas[0]` (every worker's replica stores are alike).
    A resume loads into `store`, or into every store of `replicas` when given.
    """

    def __init__(self, directory, every, keep, store: KVStore, keys: list,
                 replicas: list | None = None):
        self.directory, self.every, self.keep = self.check(directory, every, keep)
        self.store = store
        self.keys = list(keys)
        self.replicas = replicas
        self.resumed: snapshots.Snapshot | None = None

    @staticmethod
    def check(directory, every, keep) -> tuple:
        """(folder, every, keep), or ArgumentError / CheckpointError."""
        folder = snapshots.checked(directory, 0, 1)[0]
        return (folder, None if every is None else _count("checkpoint_every", every, 1),
                _count("checkpoint_keep", keep, 1))

    def due(self, steps: int) -> bool:
        return self.every is not None and steps % self.every == 0

    def take(self, steps: int, user_state: dict) -> str:
        """Start the snapshot of step `steps`; its folder."""
        saved = {"trainer": {"layout": _TRAINER, "keys": self.keys}, "user": user_state}
        if self.replicas is not None and isinstance(self.store, DistKVStore):
            return self.store.snapshot(self.directory, steps, user_state=saved,
                                       keep=self.keep, replicated=self.replicas[0])
        return self.store.snapshot(self.directory, steps, user_state=saved, keep=self.keep)

    def resume(self) -> tuple[int, dict] | None:
        """Load the newest complete snapshot into the store, if there is one: (its step,
        this worker's user_state, {} for a worker the snapshot did not have); worker 0
        says so on one line."""
        start = time.perf_counter()
        found = self.store.resume(self.directory, check=self._fits, into=self.replicas)
        if found is None:
            return None
        self.resumed = found
        rank = self.store.rank
        user = found.user_state(rank).get("user", {}) if rank < found.workers else {}
        if rank == 0:
            sys.stderr.write(
                f"gpukv: resumed from {found.path} (step {found.step}, saved by "
                f"{found.workers} worker(s), now {self.store.num_workers}) in "
                f"{time.perf_counter() - start:.2f} s\n")
            sys.stderr.flush()
        return found.step, user

    def _fits(self, found: snapshots.Snapshot) -> None:
        """CheckpointError unless `found` is a snapshot of a Trainer with these keys."""
        saved = found.user_state(0)
        trainer = saved.get("trainer")
        if not isinstance(trainer, dict) or trainer.get("layout") != _TRAINER:
            raise CheckpointError(f"{found.path}: not a Trainer's snapshot (a bare store's "
                                  f"snapshot() made it: load it with kv.resume)")
        if trainer.get("keys") != self.keys:
            raise CheckpointError(
                f"{found.path}: its keys ({_few(trainer.get('keys'))}) are not this "
                f"Trainer's ({_few(self.keys)}): another model, or other bucket_bytes or "
                f"multipliers")


def _few(keys) -> str:
    keys = list(keys or [])
    return ", ".join(repr(k) for k in keys[:4]) + (", ..." if len(keys) > 4 else "")

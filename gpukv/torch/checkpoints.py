"""A Trainer's snapshots: taken every few steps, and resumed from when it is made."""
from __future__ import annotations

import contextlib
import logging
import numbers
import os
import shutil
import sys
import time

from .._errors import ArgumentError, ArgumentKindError, CheckpointError
from ..checkpoints import claims, snapshots
from ..checkpoints.user_state import encode as encode_user_state
from ..distributed.store import DistKVStore
from ..store.base import KVStore
from . import buffers

log = logging.getLogger("gpukv")

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

    def __init__(self, directory, every, keep, store: KVStore, layout: dict,
                 replicas: list | None = None, resume="auto", residuals_kept: bool = True):
        self.directory, self.every, self.keep = self.check(directory, every, keep)
        #: 'auto': the newest snapshot in the folder; 'never': none, and only this run's
        #: snapshots are removed; else the path of the one to start from
        self.resume_from = resume
        self.taken: list = []  # this run's snapshot folders not yet pruned, oldest first (worker 0)
        self.store = store
        #: {key: [(parameter name, shape)]}: the parameters each key holds, flat, in order
        self.layout = {key: [(name, tuple(shape)) for name, shape in params]
                       for key, params in layout.items()}
        self.keys = list(layout)
        self.last_step: int | None = None  # the step of the last snapshot taken or resumed
        self.replicas = replicas
        #: whether the snapshots keep the compression residuals (not those of a store
        #: that sums gradients beside the stores saved)
        self.residuals_kept = residuals_kept
        self.resumed: snapshots.Snapshot | None = None
        #: the replicas' modules, whose buffers (`buffers.module_buffers`) a snapshot
        #: keeps (worker 0's replica 0's) and a resume gives to every replica; and
        #: (name, replica, tensor) of their parameters frozen when the Trainer was made,
        #: kept and given back alike
        self.modules: list = []
        self.frozen: list = []
        #: what held the folder before `hold` (`claims.claim`'s answer); False: not held
        self._held_from: object = False

    @staticmethod
    def check_resume(resume):
        """'auto', 'never', or a snapshot's folder (as a str): else ArgumentError."""
        if resume in ("auto", "never"):
            return resume
        if not isinstance(resume, (str, os.PathLike)):
            raise ArgumentError(f"resume={resume!r}: expected 'auto', 'never' or the path "
                                f"of a snapshot's folder")
        path = os.fspath(resume)
        if not snapshots.is_snapshot(path):
            raise CheckpointError(f"resume={path!r}: not a snapshot's folder (named "
                                  f"step-<step>-<tag>-r<run>)")
        return path

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
        self.last_step = steps
        saved = {"trainer": {"layout": _TRAINER, "keys": self.keys,
                             "params": [[key, [[name, list(shape)] for name, shape in params]]
                                        for key, params in self.layout.items()]},
                 "user": user_state}
        if self.modules and self.store.rank == 0:
            saved["trainer"]["buffers"] = buffers.module_buffers(self.modules[0])
            saved["trainer"]["frozen"] = buffers.frozen_parameters(self.frozen)
            # the names after the first of a tied parameter, which the layout leaves out,
            # for an export that holds every name state_dict has
            saved["trainer"]["tied"] = buffers.tied_parameters(self.modules[0])
        if self.resume_from == "never":  # an earlier run's snapshots are not this one's
            folder = self._snapshot(steps, saved, None)
            if self.store.rank == 0:  # (the worker that prunes them)
                self.taken.append(folder)
            self._prune_own()
            return folder
        return self._snapshot(steps, saved, self.keep)

    def _snapshot(self, steps: int, saved: dict, keep) -> str:
        if self.replicas is not None and isinstance(self.store, DistKVStore):
            return self.store.snapshot(self.directory, steps, user_state=saved,
                                       keep=keep, replicated=self.replicas[0])
        return self.store.snapshot(self.directory, steps, user_state=saved, keep=keep)

    def _prune_own(self) -> None:
        """Keep the `keep` newest complete snapshots of this run (worker 0 removes the
        others that are complete: no process writes into those any more)."""
        if self.store.rank != 0:
            return
        complete = {os.path.normpath(s.path)
                    for s in snapshots.complete_snapshots(self.directory)}
        done = [f for f in self.taken if os.path.normpath(f) in complete]
        for folder in done[:-self.keep]:
            shutil.rmtree(folder, ignore_errors=True)
            self.taken.remove(folder)

    def finished(self) -> None:
        """Every snapshot is written: prune this run's again, now that all are complete."""
        if self.resume_from == "never":
            self._prune_own()

    def resume(self) -> tuple[int, dict] | None:
        """Load the newest complete snapshot into the store, if there is one: (its step,
        this worker's user_state, {} for a worker the snapshot did not have); worker 0
        says so on one line on stderr, and every worker logs it at INFO."""
        start = time.perf_counter()
        if self.resume_from == "never":
            return None
        if self.resume_from == "auto":
            with self._newest_refused():
                found = self.store.resume(self.directory, check=self._fits,
                                          into=self.replicas)
        else:
            found = self._chosen(self.resume_from)
        if found is None:
            return None
        if not self.residuals_kept:
            log.info("gpukv: worker %d: compression residuals start afresh: a Trainer with "
                     "update_on_kvstore=False keeps its replicas' optimizers in snapshots, "
                     "not the residuals of the store that sums its gradients",
                     self.store.rank)
        self.resumed = found
        self.last_step = found.step
        trainer = found.user_state(0)["trainer"]
        if trainer.get("buffers") is not None:
            buffers.restore(trainer["buffers"], self.modules)
        if trainer.get("frozen") is not None:  # (a snapshot of before frozen ones: None)
            buffers.restore_frozen(trainer["frozen"], self.frozen)
        rank = self.store.rank
        user = found.user_state(rank).get("user", {}) if rank < found.workers else {}
        said = (f"resumed from {found.path} (step {found.step}, saved by {found.workers} "
                f"worker(s), now {self.store.num_workers}) in "
                f"{time.perf_counter() - start:.2f} s")
        log.info("gpukv: worker %d %s", rank, said)
        if rank == 0:
            sys.stderr.write(f"gpukv: {said}\n")
            sys.stderr.flush()
        return found.step, user

    def _check_writable(self) -> None:
        """CheckpointError on every worker at once when one cannot write snapshots into
        the folder (or make it): found when the Trainer is made, rather than at its first
        snapshot, hours later."""
        problem = snapshots.unwritable(self.directory)
        if self.store.workers_max([problem is not None],
                                  "Trainer: whether checkpoint_dir can be written")[0]:
            raise CheckpointError(problem or f"{self.directory}: another worker cannot "
                                             f"write snapshots there")

    def _check_free(self, passing: list) -> None:
        """ArgumentError on every worker at once when another live store of this process
        snapshots into the folder (`claims`; the stores of `passing` hand it over):
        found when the Trainer is made, before it would resume from that store's
        snapshots."""
        held = claims.holder(self.directory, self.store, passing)
        problem = None if held is None else claims.refusal(self.directory, held)
        del held
        if self.store.workers_max([problem is not None],
                                  "Trainer: whether another store uses checkpoint_dir")[0]:
            raise problem or ArgumentError(
                f"{self.directory}: another worker's process has a store that snapshots "
                f"into this folder already; give each model its own checkpoint_dir")

    def hold(self, passing: list) -> None:
        """Hold the folder for this Trainer's store (see `claims`): the stores of
        `passing` (a Trainer's taken over) hand it over; another live one refuses it."""
        self._held_from = claims.claim(self.directory, self.store, passing)

    def let_go(self, failed: bool = False) -> None:
        """The folder is free for another store of this process again; `failed`: the
        Trainer could not be made, and what held it before `hold` holds it again. (A
        step after `close` takes the folder again at its snapshot: a later close frees
        it again.)"""
        if not failed:
            claims.release(self.directory, self.store)
        elif self._held_from is not False:
            claims.give_back(self.directory, self.store, self._held_from)
        self._held_from = False

    def check_ahead(self, passing: list | tuple = ()) -> None:
        """The snapshot the resume would start from, checked to be this Trainer's before
        the store is touched, so that a Trainer refused for it leaves the store as it was
        (the resume checks the one it loads again); that the folder can be written; and
        that no other store of this process (but those of `passing`) snapshots there."""
        self._check_writable()
        self._check_free(list(passing))
        if self.resume_from == "never":
            return
        if self.resume_from != "auto":
            self._fits(_complete(self.resume_from))
            return
        found = snapshots.latest_snapshot(self.directory)
        if found is not None:
            with self._newest_refused():  # a damaged file, as the resume would say it
                saved = found.user_state(0)
            self._fits(found, saved)

    @contextlib.contextmanager
    def _newest_refused(self):
        """A CheckpointError raised inside, about the newest snapshot, says how to start
        from an older one instead."""
        try:
            yield
        except CheckpointError as exc:
            raise CheckpointError(
                f"{exc} (to start from an older snapshot, make the Trainer with "
                f"resume=<its folder>, or move this one out of {self.directory})"
            ) from exc

    def check_user_state(self, steps: int, user_state: dict) -> None:
        """ArgumentError, before a step changes anything, where the snapshot due after it
        (at `steps`) could not save `user_state`: on every worker of a dist store at
        once, when any one's cannot be saved (agreed, so that none waits in the step
        for the one that stopped)."""
        if not self.due(steps):
            return
        try:
            encode_user_state(user_state, "trainer.user_state")
            problem = None
        except (ArgumentError, ArgumentKindError) as exc:
            problem = exc
        if self.store.workers_max([problem is not None], "Trainer.step: checking user_state")[0]:
            raise problem or ArgumentError(
                f"trainer.user_state: another worker's cannot be saved by the snapshot due "
                f"after step {steps}; no worker took the step")

    def _chosen(self, path: str) -> snapshots.Snapshot:
        """Load the snapshot at `path` (checked to be complete and this Trainer's)."""
        found = _complete(path)
        self._fits(found)
        for store in [self.store] if self.replicas is None else self.replicas:
            store.load(found)
        return found

    def _fits(self, found: snapshots.Snapshot, saved: dict | None = None) -> None:
        """CheckpointError unless `found` is a snapshot of a Trainer with these keys: one
        naming every parameter, buffer and frozen parameter that differs, as PyTorch's
        load_state_dict names them all at once. `saved`: its worker 0's user_state, when
        read already."""
        saved = found.user_state(0) if saved is None else saved
        trainer = saved.get("trainer")
        if not isinstance(trainer, dict) or trainer.get("layout") != _TRAINER:
            raise CheckpointError(f"{found.path}: not a Trainer's snapshot (a bare store's "
                                  f"snapshot() made it: load it with kv.resume)")
        problems: list[str] = []
        layout = parameter_layout(saved, found.path) if "params" in trainer else None
        if layout is not None and layout != self.layout:  # named per parameter
            saved_params = {name: shape for params in layout.values()
                            for name, shape in params}
            mine = {name: shape for params in self.layout.values() for name, shape in params}
            problems += _mismatches(saved_params, mine)
        if self.modules:  # what the snapshot keeps beside the store, by the model's names
            for kept, tensors, what in (
                    ("buffers", buffers.module_buffers(self.modules[0]), "buffer"),
                    ("frozen", buffers.frozen_parameters(self.frozen), "frozen parameter")):
                if trainer.get(kept) is not None:
                    problems += _mismatches(
                        buffers.saved_shapes(trainer[kept], found.path, f"{what}s"),
                        {name: tuple(t.shape) for name, t in tensors.items()}, f"{what} ")
        _refuse_another_model(found.path, problems)
        if layout is not None:
            same = layout == self.layout
        else:  # (a snapshot of before parameters were named: its keys)
            same = trainer.get("keys") == self.keys
        if not same:
            raise CheckpointError(
                f"{found.path}: its keys ({_few(trainer.get('keys'))}) are not this "
                f"Trainer's ({_few(self.keys)}): another model, or other bucket_bytes, "
                f"multipliers or embeddings' sparse=True")


def _complete(path: str) -> snapshots.Snapshot:
    """The complete snapshot at `path`; CheckpointError when a part is missing."""
    parent = os.path.dirname(os.path.normpath(path))
    found = next((s for s in snapshots.complete_snapshots(parent)
                  if os.path.normpath(s.path) == os.path.normpath(path)), None)
    if found is None:
        raise CheckpointError(f"resume={path!r}: not a complete snapshot (a part is "
                              f"missing)")
    return found


def _mismatches(saved: dict, mine: dict, kind: str = "") -> list[str]:
    """What differs between the {name: shape} of a snapshot and of the model, named as
    PyTorch's `load_state_dict` names it (`kind`: a word before a missing name)."""
    problems = [f"size mismatch for {name}: {list(saved[name])} in the snapshot, "
                f"{list(shape)} in the model"
                for name, shape in mine.items() if name in saved and saved[name] != shape]
    problems += [f"{kind}missing in the snapshot: {name}" for name in mine
                 if name not in saved]
    problems += [f"{kind}not in the model: {name}" for name in saved if name not in mine]
    return problems


def _refuse_another_model(path, problems: list[str]) -> None:
    """CheckpointError naming every one of `problems`, if any (as load_state_dict does:
    a model changed in several places is mended once, not once a place)."""
    if problems:
        raise CheckpointError(f"{path}: another model's snapshot: {'; '.join(problems)}")


def parameter_layout(saved: dict, path) -> dict:
    """{key: [(parameter name, shape)]} a Trainer's snapshot records (`saved`: its worker
    0's user_state); CheckpointError when there is none or it is malformed."""
    trainer = saved.get("trainer") if isinstance(saved, dict) else None
    if not isinstance(trainer, dict) or trainer.get("layout") != _TRAINER:
        raise CheckpointError(f"{path}: not a Trainer's snapshot (a bare store's "
                              f"snapshot() made it)")
    params = trainer.get("params")
    if params is None:
        raise CheckpointError(f"{path}: the snapshot does not record its parameters' "
                              f"names (a Trainer of an earlier gpukv wrote it)")
    try:
        return {key: [(str(name), tuple(int(d) for d in shape)) for name, shape in entry]
                for key, entry in params}
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: the Trainer's parameter layout is damaged: "
                              f"{exc}") from None


def _few(keys) -> str:
    keys = list(keys or [])
    return ", ".join(repr(k) for k in keys[:4]) + (", ..." if len(keys) > 4 else "")

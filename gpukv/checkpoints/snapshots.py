"""Numbered snapshots of a store, written in the background; complete once every part is.

A snapshot is a folder `ROOT/step-<step>-<tag>/` holding
- `shard-<i>-of-<n>.npz`: the keys (or pieces of keys) shard i of n serves, their values
  and optimizer state: a one-process store is one shard; a dist store has one per process
  with num_servers=0, one per server otherwise (or one per worker, each with every n-th
  key of a store all workers hold alike: `snapshot(replicated=)`);
- `worker-<r>-of-<m>.npz`: worker r's step and `user_state`.
Each file is a checkpoint archive written with `atomic_write`, so it exists only whole;
the snapshot is complete when every file its names promise is there. A process killed
while writing leaves a snapshot that is not complete, never one that passes for complete.
`tag` is random, picked once per store, so that a job restarted after a failure never
mixes its files with those an earlier attempt left at the same step.

Writing: the caller's step copies the state into host buffers (`PartWriter.stage`, two
sets used in turn), and one background thread per process writes the files, so at most
one snapshot is being written while the next one is staged. A failed write is raised by
the next `stage` or by `finish`.

Reading: `latest_snapshot(root)` finds the newest complete snapshot; `read_store` joins
its shards into the `StoreFile` a one-file checkpoint gives, so it loads into a store of
any number of processes, servers or devices; `read_worker` gives a worker's user state.
"""
from __future__ import annotations

import atexit
import collections
import os
import re
import shutil
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from .._errors import ArgumentError, CheckpointError
from ..device import host_device
from . import user_state
from .checkpoint import StoreFile, checkpoint_path, read_archive, write_archive
from .checkpoint import read_store as checkpoint_read_store

__all__ = ["Snapshot", "latest_snapshot", "complete_snapshots", "prune", "is_snapshot",
           "read_store", "read_any", "read_worker", "PartWriter", "Staging", "checked",
           "folder_name", "shard_file", "worker_file", "SHARD_KIND", "WORKER_KIND"]

SHARD_KIND = "gpukv.snapshot.shard"
WORKER_KIND = "gpukv.snapshot.worker"
VERSION = 1

_FOLDER = re.compile(r"step-(\d{9,})-([0-9a-f]{8})")
_FILE = re.compile(r"(shard|worker)-(\d{5,})-of-(\d{5,})\.npz")


def folder_name(step: int, tag: str) -> str:
    return f"step-{step:09d}-{tag}"


def shard_file(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.npz"


def worker_file(rank: int, count: int) -> str:
    return f"worker-{rank:05d}-of-{count:05d}.npz"


# ---------------------------------------------------------------------------- finding
@dataclass(frozen=True)
class Snapshot:
    """A complete snapshot: its folder, step, and how many shards and workers wrote it.
    It is a path (`os.fspath`), so `kv.load(snapshot)` loads it."""
    path: str
    step: int
    shards: int
    workers: int

    def __fspath__(self) -> str:
        return self.path

    def user_state(self, rank: int = 0) -> dict:
        """The `user_state` worker `rank` saved (see `read_worker`)."""
        return read_worker(self.path, rank)[1]


def _completeness(folder: str) -> tuple[int, int] | None:
    """(shards, workers) when every file the names in `folder` promise is there."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found: dict = {"shard": collections.defaultdict(set),
                   "worker": collections.defaultdict(set)}
    for name in names:
        match = _FILE.fullmatch(name)
        if match:
            found[match[1]][int(match[3])].add(int(match[2]))
    counts = []
    for kind in ("shard", "worker"):
        groups = found[kind]
        if len(groups) != 1:
            return None
        (count, present), = groups.items()
        if present != set(range(count)):
            return None
        counts.append(count)
    return counts[0], counts[1]


def _folders(root: str) -> list[tuple[int, str]]:
    """(step, path) of every snapshot folder under `root`, complete or not, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"{root}: cannot list snapshots: {exc.strerror}") from exc
    found = []
    for name in names:
        match = _FOLDER.fullmatch(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path):
            found.append((int(match[1]), path))
    return sorted(found, key=lambda f: (f[0], _mtime(f[1])))


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def complete_snapshots(root) -> list[Snapshot]:
    """Every complete snapshot under `root`, oldest first (none if `root` is missing)."""
    root = checkpoint_path(root)
    out = []
    for step, path in _folders(root):
        counts = _completeness(path)
        if counts is not None:
            out.append(Snapshot(path, step, *counts))
    return out


def latest_snapshot(root) -> Snapshot | None:
    """The newest complete snapshot under `root`, or None."""
    found = complete_snapshots(root)
    return found[-1] if found else None


def prune(root: str, keep: int) -> None:
    """Remove all but the `keep` newest complete snapshots, and the incomplete ones older
    than the newest complete one (their writers have all moved past them)."""
    folders = _folders(root)
    complete = [(step, path) for step, path in folders if _completeness(path) is not None]
    if not complete:
        return
    kept = {path for _, path in complete[-keep:]}
    newest = complete[-1][0]
    # judged by what was complete above: a newer folder another process completes
    # meanwhile is the newest snapshot now, not one to remove
    was_complete = {path for _, path in complete}
    for step, path in folders:
        if path not in kept and (step < newest or path in was_complete):
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- reading
def is_snapshot(path) -> bool:
    """Whether `path` names a snapshot's folder (known by its name, `step-<step>-<tag>`)."""
    try:
        path = checkpoint_path(path)
    except CheckpointError:
        return False
    return os.path.isdir(path) and bool(
        _FOLDER.fullmatch(os.path.basename(os.path.normpath(path))))


def read_any(path) -> StoreFile:
    """A checkpoint file (`checkpoint.read_store`) or a snapshot's folder (`read_store`)."""
    return read_store(path) if is_snapshot(path) else checkpoint_read_store(path)


def read_store(path) -> StoreFile:
    """Every shard of the snapshot at `path` joined into one `StoreFile` (what
    `checkpoint.read_store` gives for a one-file checkpoint); CheckpointError if the
    snapshot is not complete, or a shard is damaged or does not fit with the others."""
    from ..layout.state import merge
    path = checkpoint_path(path)
    counts = _completeness(path)
    if counts is None:
        raise CheckpointError(f"{path}: not a complete snapshot (a part is missing)")
    shards, _ = counts
    kinds: set = set()
    types: set = set()
    keys: dict = {}
    exports: list = []
    for i in range(shards):
        name = os.path.join(path, shard_file(i, shards))
        header, arrays = read_archive(name)
        if header.get("kind") != SHARD_KIND or header.get("version") != VERSION:
            raise CheckpointError(f"{name}: not a gpukv snapshot shard of version {VERSION}")
        if header.get("keys"):  # a shard without keys has no key kind
            kinds.add(header.get("key_kind"))
        types.add(header.get("store_type"))
        try:
            for j, info in enumerate(header["keys"]):
                keys.setdefault(info["key"], []).append(
                    (info["start"], info["stop"], info, arrays[f"value/{j}"]))
            exports.append(_optimizer_part(header, arrays))
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{name}: damaged snapshot shard ({exc!r})") from exc
    if len(kinds) > 1 or len(types) > 1:
        raise CheckpointError(f"{path}: its shards come from different stores")
    kind = {"int": int, "str": str, None: None}.get(next(iter(kinds), None), None)
    order = sorted(keys.items(), key=lambda item: item[1][0][2]["index"])
    out_keys, homes, values, shapes = [], [], [], {}
    for key, pieces in order:
        info = pieces[0][2]
        value = _joined(path, key, pieces)
        out_keys.append(key)
        homes.append(info["home"])
        values.append(value)
        shapes[key] = value.shape
    try:
        state = merge(exports, shapes)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: the optimizer state of its shards does not fit "
                              f"together (a damaged snapshot: {exc})") from exc
    return StoreFile(path, kind, out_keys, homes, values, state)


def _optimizer_part(header: dict, arrays: dict):
    section = header.get("optimizer")
    if section is None:
        return None
    return section["header"], {n: arrays[f"optimizer/{n}"] for n in section["arrays"]}


def _joined(path: str, key, pieces: list) -> np.ndarray:
    """A key's pieces put back together, checked to cover it exactly once."""
    pieces.sort(key=lambda p: p[0])
    info = pieces[0][2]
    shape = tuple(info["shape"])
    size = int(np.prod(shape, dtype=np.int64))
    at = 0
    for start, stop, _, array in pieces:
        if start != at or stop - start != array.size:
            break
        at = stop
    if at != size:
        raise CheckpointError(f"{path}: key {key!r}: its pieces in the shards do not "
                              f"cover it exactly (a damaged snapshot)")
    if len(pieces) == 1:
        return pieces[0][3].reshape(shape)
    return np.concatenate([p[3].reshape(-1) for p in pieces]).reshape(shape)


def read_worker(path, rank: int) -> tuple[int, dict]:
    """(step, user_state) worker `rank` saved in the snapshot at `path`."""
    path = checkpoint_path(path)
    counts = _completeness(path)
    if counts is None:
        raise CheckpointError(f"{path}: not a complete snapshot (a part is missing)")
    if not 0 <= rank < counts[1]:
        raise CheckpointError(f"{path}: worker {rank}: the snapshot was written by "
                              f"{counts[1]} worker(s)")
    name = os.path.join(path, worker_file(rank, counts[1]))
    header, arrays = read_archive(name)
    if header.get("kind") != WORKER_KIND:
        raise CheckpointError(f"{name}: not a gpukv snapshot worker file")
    try:
        return int(header["step"]), user_state.decode(header["user_state"], arrays)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{name}: damaged worker file ({exc!r})") from exc


# ---------------------------------------------------------------------------- writing
class Staging:
    """Host buffers a snapshot's arrays are copied into: `take(array)` gives the next
    buffer (reused from the last snapshot staged into this set when it fits), and
    `copy()` fills them all at once."""

    def __init__(self, buffers: list):
        self._buffers = buffers
        self._used = 0
        self._pairs: list = []

    def take(self, array) -> np.ndarray:
        k = self._used
        self._used += 1
        buffer = self._buffers[k] if k < len(self._buffers) else None
        if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
            buffer = np.empty(array.shape, array.dtype)
            if k < len(self._buffers):
                self._buffers[k] = buffer
            else:
                self._buffers.append(buffer)
        self._pairs.append((buffer, array))
        return buffer

    def fetch(self, home, array) -> np.ndarray:
        """`take`, for the optimizer's export (which names the array's home device)."""
        return self.take(array)

    def copy(self) -> None:
        host_device().copy_many(self._pairs)
        self._pairs = []


class PartWriter:
    """The files of one process's snapshots, written by one background thread: one
    snapshot being written and one staged behind it, each in its own set of buffers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._sets: list = [[], []]
        self._busy = [False, False]
        self._turn = 0
        self._queue: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        _WRITERS.add(self)

    def stage(self) -> tuple[int, Staging]:
        """A free set of buffers (waiting for the write that used it to end); raises the
        error of a write that failed since the last call."""
        with self._cond:
            self._raise_failure()
            turn = self._turn
            while self._busy[turn]:
                self._cond.wait()
            self._raise_failure()
            self._busy[turn] = True
            self._turn = 1 - turn
        return turn, Staging(self._sets[turn])

    def release(self, turn: int) -> None:
        """Give back a set `stage` gave that will not be written after all."""
        with self._cond:
            self._busy[turn] = False
            self._cond.notify_all()

    def submit(self, turn: int, files: list, then=None) -> None:
        """Write `files` ((path, header, arrays), the arrays staged in set `turn`) in the
        background, in order, then call `then()`; the set is free again after."""
        with self._cond:
            self._queue.append((turn, files, then))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gpukv-snapshots",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def finish(self) -> None:
        """Wait until every submitted snapshot is written; raise a failed write's error."""
        with self._cond:
            while self._queue or any(self._busy):
                self._cond.wait()
            self._raise_failure()

    def _raise_failure(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"a snapshot could not be written: {error}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                turn, files, then = self._queue[0]
            try:
                os.makedirs(os.path.dirname(files[0][0]), exist_ok=True)
                for path, header, arrays in files:
                    write_archive(path, header, arrays)
                if then is not None:
                    then()
            except BaseException as exc:  # kept for the caller's next call
                with self._cond:
                    self._error = self._error or exc
            with self._cond:
                self._queue.popleft()
                self._busy[turn] = False
                self._cond.notify_all()


_WRITERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _finish_all() -> None:
    """A program that ends normally leaves its last snapshot written."""
    for writer in list(_WRITERS):
        try:
            writer.finish()
        except CheckpointError:
            pass  # already said by the write's own caller, or nobody is left to tell


# ----------------------------------------------------------------------- the files
def checked(root, step, keep, last: int = 0) -> tuple[str, int, int]:
    """`snapshot`'s arguments checked: (root as a str, step, keep), else ArgumentError
    (CheckpointError for a root that is no path or is a file). A step of None is the one
    after `last` (the store's last snapshot's, or the one it resumed from)."""
    root = checkpoint_path(root)
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"{root}: is a file; snapshots need a folder")
    if step is None:
        step = last + 1
    for name, value, low in (("step", step, 0), ("keep", keep, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or value < low:
            raise ArgumentError(f"{name}={value!r}: expected an int >= {low}")
    return root, int(step), int(keep)


def shard_header(step: int, store_type: str, key_kind, pieces: list, export) -> dict:
    """The header of a shard file; `pieces`: {"key", "index", "home", "shape", "start",
    "stop"} of each piece in the file, whose values are `value/<j>`; `export`: the
    optimizer's (header, arrays) for these pieces, or None."""
    optimizer = None
    if export is not None:
        starts = {p["key"]: p["start"] for p in pieces}
        head = dict(export[0])
        head["keys"] = [dict(info, start=starts.get(info["key"], 0))
                        for info in head["keys"]]
        optimizer = {"header": head, "arrays": list(export[1])}
    return {"kind": SHARD_KIND, "version": VERSION, "step": step,
            "store_type": store_type,
            "key_kind": None if key_kind is None else key_kind.__name__,
            "keys": pieces, "optimizer": optimizer}


def shard_arrays(values: list, export) -> dict:
    arrays = {f"value/{j}": v for j, v in enumerate(values)}
    if export is not None:
        arrays.update((f"optimizer/{n}", a) for n, a in export[1].items())
    return arrays


def worker_files(folder: str, step: int, rank: int, workers: int, state) -> tuple:
    """The (path, header, arrays) of worker `rank`'s file; ArgumentError for a
    user_state that cannot be saved."""
    encoded, arrays = user_state.encode({} if state is None else state)
    header = {"kind": WORKER_KIND, "version": VERSION, "step": step, "rank": rank,
              "workers": workers, "user_state": encoded}
    return os.path.join(folder, worker_file(rank, workers)), header, arrays

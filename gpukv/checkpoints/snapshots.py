"""Numbered snapshots of a store, written in the background; complete once every part is.

A snapshot is a folder `ROOT/step-<step>-<tag>-r<run>/` holding
- `shard-<i>-of-<n>.npz`: the keys (or pieces of keys) shard i of n serves, their values
  and optimizer state: a one-process store is one shard; a dist store has one per process
  with num_servers=0, one per server otherwise (or one per worker, each with every n-th
  key of a store all workers hold alike: `snapshot(replicated=)`);
- `worker-<r>-of-<m>.npz`: worker r's step and `user_state`.
Each file is a checkpoint archive written with `atomic_write`, so it exists only whole;
the snapshot is complete when every file its names promise is there. A process killed
while writing leaves a snapshot that is not complete, never one that passes for complete.
A shard may also hold its store's compression state (`compression_section`): what the
residuals of error feedback, the served values of compressed pulls and PowerSGD's warm
starts were, as named arrays `compression/<j>` and a header field `compression`
(absent from snapshots written before they held it, which still load).
`tag` is random, picked once per store, so that a job restarted after a failure never
mixes its files with those an earlier attempt left at the same step. `run` counts the
runs that wrote into ROOT: a store's first snapshot there takes one more than any folder
holds (`next_run`), and keeps it (a `resume` in the same store too). Snapshots are
ordered by run, then step: the newest is the last run's last step, whatever steps an
earlier run reached (a run started afresh, or from an older snapshot). So two live
stores of one process never snapshot into one ROOT (`claims`): the later's run would
pass for the newer, whichever model it holds. Folders written
before runs were counted are run 0. So a store's steps never go back (`checked` refuses
one below its last snapshot's, or the one it resumed from): within a run, a lower step
would be older than the snapshots before it. The same step taken again (a Trainer's
`checkpoint_every` and its `snapshot()` at one step) writes the same folder again: a
writer first removes the last file of what it writes there, so the folder is not
complete from before its first file is replaced until its last is written, and a
one-process store killed meanwhile leaves no snapshot mixing the two. (In a dist store
each process does so for its own files only, written on their own.)

Writing: the caller's step copies the state into host buffers (`PartWriter.stage`, two
sets used in turn; each GPU array on the stream of the device that writes it, so that
the copy follows the pushes before it whichever thread or CUDA stream takes the
snapshot), and a background thread writes the files (one per store, started at its
first snapshot and waiting between snapshots until the store goes), so at most
one snapshot is being written while the next one is staged. A failed write is raised by
the next `stage` or by `finish`.

Reading: `latest_snapshot(root)` finds the newest complete snapshot; `read_store` joins
its shards into the `StoreFile` a one-file checkpoint gives, so it loads into a store of
any number of processes, servers or devices; `read_worker` gives a worker's user state.
"""
from __future__ import annotations

import atexit
import collections
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import timeline
from .._dtypes import SUPPORTED_DTYPES
from .._errors import ArgumentError, ArgumentKindError, CheckpointError
from ..device import device_of, host_device
from . import user_state
from .checkpoint import StoreFile, _fsync_dir, _show, checkpoint_path, read_archive, write_archive
from .checkpoint import read_store as checkpoint_read_store

__all__ = ["Snapshot", "latest_snapshot", "complete_snapshots", "next_run", "prune",
           "is_snapshot",
           "read_store", "read_any", "read_worker", "PartWriter", "Staging", "checked",
           "folder_name", "shard_file", "worker_file", "SHARD_KIND", "WORKER_KIND",
           "Compression", "compression_section", "read_compression"]

SHARD_KIND = "gpukv.snapshot.shard"
WORKER_KIND = "gpukv.snapshot.worker"
VERSION = 1

_FOLDER = re.compile(r"step-(\d{9,})-([0-9a-f]{8})(?:-r(\d+))?")
_FILE = re.compile(r"(shard|worker)-(\d{5,})-of-(\d{5,})\.npz")


def folder_name(step: int, tag: str, run: int) -> str:
    return f"step-{step:09d}-{tag}-r{run}"


def shard_file(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.npz"


def worker_file(rank: int, count: int) -> str:
    return f"worker-{rank:05d}-of-{count:05d}.npz"


# ---------------------------------------------------------------------------- finding
@dataclass(frozen=True)
class Snapshot:
    """A complete snapshot: its folder, step, how many shards and workers wrote it, and
    the run they were part of. It is a path (`os.fspath`), so `kv.load(snapshot)` loads
    it."""
    path: str
    step: int
    shards: int
    workers: int
    #: the run that wrote it (see the module's docstring): 0 for an older gpukv's
    run: int = 0

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


def _folders(root: str) -> list[tuple[int, int, str]]:
    """(run, step, path) of every snapshot folder under `root`, complete or not, oldest
    first: by run, then step (then time, for a step two attempts of a run wrote)."""
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
            found.append((int(match[3] or 0), int(match[1]), path))
    return sorted(found, key=lambda f: (f[0], f[1], _mtime(f[2])))


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def complete_snapshots(root) -> list[Snapshot]:
    """Every complete snapshot under `root`, oldest first (none if `root` is missing)."""
    root = checkpoint_path(root)
    out = []
    for run, step, path in _folders(root):
        counts = _completeness(path)
        if counts is not None:
            out.append(Snapshot(path, step, *counts, run=run))
    return out


def latest_snapshot(root) -> Snapshot | None:
    """The newest complete snapshot under `root`, or None."""
    found = complete_snapshots(root)
    return found[-1] if found else None


def next_run(root: str) -> int:
    """The run a store's first snapshot under `root` counts as: one more than any folder
    there (complete or not) holds, so that its snapshots are the newest."""
    return 1 + max((run for run, _, _ in _folders(checkpoint_path(root))), default=0)


def prune(root: str, keep: int) -> None:
    """Remove all but the `keep` newest complete snapshots, and the incomplete ones older
    than the newest complete one (their writers have all moved past them)."""
    folders = _folders(root)
    complete = [(run, step, path) for run, step, path in folders
                if _completeness(path) is not None]
    if not complete:
        return
    kept = {path for _, _, path in complete[-keep:]}
    newest = complete[-1][:2]
    # judged by what was complete above: a newer folder another process completes
    # meanwhile is the newest snapshot now, not one to remove
    was_complete = {path for _, _, path in complete}
    for run, step, path in folders:
        if path not in kept and ((run, step) < newest or path in was_complete):
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- reading
def is_snapshot(path) -> bool:
    """Whether `path` names a snapshot's folder (known by its name,
    `step-<step>-<tag>-r<run>`, or `step-<step>-<tag>` from an older gpukv)."""
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
    `checkpoint.read_store` gives for a one-file checkpoint); CheckpointError, naming the
    file and the problem, if the snapshot is not complete, or a file is damaged, holds
    another step than the snapshot's, or does not fit with the others. Every file is
    checked (every field of every header) before a store is touched."""
    from ..layout.state import merge
    path = checkpoint_path(path)
    counts = _completeness(path)
    if counts is None:
        raise CheckpointError(f"{path}: not a complete snapshot (a part is missing)")
    shards, workers = counts
    parts = []
    for i in range(shards):
        name = os.path.join(path, shard_file(i, shards))
        header, arrays = read_archive(name)
        parts.append(_Shard(name, header, arrays))
    step = _step_of(path, parts[0].step)
    for part in parts:
        _same_step(part.name, "shard", part.step, step)
    for rank in range(workers):  # user_state is read after the load: checked before it
        _worker_header(path, rank, workers, step)
    first = next((p for p in parts if p.keys), parts[0])
    keys: dict = {}
    for part in parts:
        if part.store_type != first.store_type:
            raise CheckpointError(f"{part.name}: a shard of a {part.store_type!r} store, but "
                                  f"{first.name} is of a {first.store_type!r} store")
        if part.keys and part.key_kind != first.key_kind:
            raise CheckpointError(f"{part.name}: holds {part.key_kind} keys, but "
                                  f"{first.name} holds {first.key_kind} keys")
        for piece in part.keys:
            keys.setdefault(piece.key, []).append(piece)
    indexes: dict = {}
    for key, pieces in keys.items():
        _agreeing(key, pieces)
        other = indexes.setdefault(pieces[0].order, key)
        if other != key:
            raise CheckpointError(f"{pieces[0].name}: key {_show(key)}: field 'index' is "
                                  f"{pieces[0].order}, as key {_show(other)}'s is (a damaged "
                                  f"snapshot shard)")
    kind = {"int": int, "str": str, None: None}[first.key_kind if keys else None]
    out_keys, homes, values, shapes = [], [], [], {}
    for key, pieces in sorted(keys.items(), key=lambda item: item[1][0].order):
        value = _joined(path, key, pieces)
        out_keys.append(key)
        homes.append(pieces[0].home)
        values.append(value)
        shapes[key] = value.shape
    try:
        state = merge([p.optimizer for p in parts], shapes)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: the optimizer state of its shards does not fit "
                              f"together (a damaged snapshot: {exc})") from exc
    return StoreFile(path, kind, out_keys, homes, values, state)


class _Piece(NamedTuple):
    """A piece of a key, as a shard's header describes it, with its value."""
    name: str          # the shard's file
    key: int | str
    order: int         # the key's place in the store's init order (its 'index')
    home: str          # the kind of its home device when saved
    shape: tuple       # the whole key's
    start: int         # the piece's first element in the flat key
    stop: int
    value: np.ndarray  # flat, stop - start elements


def _natural(value) -> bool:
    return type(value) is int and value >= 0


def _field(name: str, where: str, record: dict, field: str, fits, expected: str):
    """`record[field]`, else CheckpointError naming the file (`name`), where in it
    (`where`, e.g. "key 2: "), the field and what is wrong with it."""
    if field not in record:
        raise CheckpointError(f"{name}: {where}field {field!r} is missing (a damaged "
                              f"snapshot shard)")
    value = record[field]
    if not fits(value):
        raise CheckpointError(f"{name}: {where}field {field!r} is {_show(value)}, expected "
                              f"{expected} (a damaged snapshot shard)")
    return value


class _Shard:
    """A shard file's header checked whole (every field's presence and type, its keys'
    kind, each value's size and dtype); CheckpointError naming the file, the key and the
    field otherwise."""

    def __init__(self, name: str, header: dict, arrays: dict):
        if header.get("kind") != SHARD_KIND or header.get("version") != VERSION:
            raise CheckpointError(f"{name}: not a gpukv snapshot shard of version {VERSION}")
        self.name = name
        self.step: int = _field(name, "", header, "step", _natural, "an int >= 0")
        self.store_type: str = _field(name, "", header, "store_type",
                                      lambda v: isinstance(v, str), "a str")
        self.key_kind: str | None = _field(name, "", header, "key_kind",
                                           lambda v: v in ("int", "str", None),
                                           "'int', 'str' or null")
        entries = _field(name, "", header, "keys", lambda v: isinstance(v, list), "a list")
        if entries and self.key_kind is None:
            raise CheckpointError(f"{name}: field 'key_kind' is null but the shard holds "
                                  f"keys (a damaged snapshot shard)")
        self.keys = [self._piece(j, entry, arrays) for j, entry in enumerate(entries)]
        self.optimizer = self._optimizer(header, arrays)

    def _piece(self, j: int, entry, arrays: dict) -> _Piece:
        name = self.name
        if not isinstance(entry, dict):
            raise CheckpointError(f"{name}: field 'keys': entry {j} is {_show(entry)}, "
                                  f"expected an object (a damaged snapshot shard)")
        key = _field(name, f"field 'keys': entry {j}: ", entry, "key", lambda v: True, "")
        found = type(key).__name__
        if found != self.key_kind:  # an int key is never a bool, nor a str key an int
            a = "an" if found[:1] in "aeiou" else "a"
            raise CheckpointError(f"{name}: key {_show(key)} is {a} {found} key in a "
                                  f"snapshot of {self.key_kind} keys (a damaged snapshot "
                                  f"shard)")
        where = f"key {_show(key)}: "
        index = _field(name, where, entry, "index", _natural, "an int >= 0")
        home = _field(name, where, entry, "home", lambda v: isinstance(v, str), "a str")
        shape = _field(name, where, entry, "shape",
                       lambda v: isinstance(v, list) and all(_natural(n) for n in v),
                       "a list of ints >= 0")
        start = _field(name, where, entry, "start", _natural, "an int >= 0")
        stop = _field(name, where, entry, "stop", lambda v: _natural(v) and v >= start,
                      f"an int >= its 'start' ({start})")
        value = arrays.get(f"value/{j}")
        if value is None:
            raise CheckpointError(f"{name}: {where}its value (array 'value/{j}') is missing")
        if value.dtype.name not in SUPPORTED_DTYPES:
            raise CheckpointError(f"{name}: {where}its value has unsupported dtype "
                                  f"{value.dtype}")
        if value.size != stop - start:
            raise CheckpointError(f"{name}: {where}its value holds {value.size} elements, "
                                  f"but its 'start' and 'stop' say {stop - start}")
        return _Piece(name, key, index, home, tuple(shape), start, stop, value.reshape(-1))

    def _optimizer(self, header: dict, arrays: dict):
        """This shard's part of the optimizer's state, (header, arrays), or None."""
        name = self.name
        section = _field(name, "", header, "optimizer",
                         lambda v: v is None or isinstance(v, dict), "an object or null")
        if section is None:
            return None
        where = "field 'optimizer': "
        head = _field(name, where, section, "header", lambda v: isinstance(v, dict),
                      "an object")
        names = _field(name, where, section, "arrays",
                       lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
                       "a list of str")
        missing = [n for n in names if f"optimizer/{n}" not in arrays]
        if missing:
            raise CheckpointError(f"{name}: {where}array {_show(missing[0])} is missing")
        return head, {n: arrays[f"optimizer/{n}"] for n in names}


def _step_of(path: str, fallback: int) -> int:
    """The step a snapshot's folder name says (`fallback` for a folder named otherwise)."""
    match = _FOLDER.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(match[1]) if match else fallback


def _same_step(name: str, what: str, step, expected: int) -> None:
    if step != expected:
        raise CheckpointError(f"{name}: a {what} file of step {step}, in the snapshot of "
                              f"step {expected} (copied in from another snapshot?); "
                              f"every file of a snapshot records its step")


def _agreeing(key, pieces: list) -> None:
    """The pieces of one key agree on its place, home, shape and dtype."""
    first = pieces[0]
    for piece in pieces[1:]:
        for field, attribute in (("index", "order"), ("home", "home"), ("shape", "shape")):
            mine, theirs = getattr(piece, attribute), getattr(first, attribute)
            if mine != theirs:
                raise CheckpointError(
                    f"{piece.name}: key {_show(key)}: field {field!r} is {_show(mine)}, "
                    f"but {_show(theirs)} in {first.name} (a damaged snapshot)")
        if piece.value.dtype != first.value.dtype:
            raise CheckpointError(f"{piece.name}: key {_show(key)}: its value is "
                                  f"{piece.value.dtype}, but {first.value.dtype} in "
                                  f"{first.name} (a damaged snapshot)")


def _joined(path: str, key, pieces: list) -> np.ndarray:
    """A key's pieces put back together, checked to cover it exactly once."""
    pieces = sorted(pieces, key=lambda p: p.start)
    shape = pieces[0].shape
    at = 0
    for piece in pieces:
        if piece.start != at:
            break
        at = piece.stop
    if at != math.prod(shape):
        raise CheckpointError(f"{path}: key {_show(key)}: its pieces in the shards do not "
                              f"cover it exactly (a damaged snapshot)")
    if len(pieces) == 1:
        return pieces[0].value.reshape(shape)
    return np.concatenate([p.value for p in pieces]).reshape(shape)


def read_worker(path, rank: int) -> tuple[int, dict]:
    """(step, user_state) worker `rank` saved in the snapshot at `path`."""
    path = checkpoint_path(path)
    counts = _completeness(path)
    if counts is None:
        raise CheckpointError(f"{path}: not a complete snapshot (a part is missing)")
    if not 0 <= rank < counts[1]:
        raise CheckpointError(f"{path}: worker {rank}: the snapshot was written by "
                              f"{counts[1]} worker(s)")
    name, header, arrays = _worker_header(path, rank, counts[1], None)
    try:
        return header["step"], user_state.decode(header["user_state"], arrays)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{name}: damaged worker file ({exc!r})") from exc


def _worker_header(path: str, rank: int, workers: int, step: int | None) -> tuple:
    """(name, header, arrays) of worker `rank`'s file, its header checked: its kind, rank,
    worker count and step (`step`, or the one the folder's name says)."""
    name = os.path.join(path, worker_file(rank, workers))
    header, arrays = read_archive(name)
    if header.get("kind") != WORKER_KIND:
        raise CheckpointError(f"{name}: not a gpukv snapshot worker file")
    found = _field(name, "", header, "step", _natural, "an int >= 0")
    for field, expected in (("rank", rank), ("workers", workers)):
        _field(name, "", header, field, lambda v, e=expected: type(v) is int and v == e,
               f"{expected}, as its name says")
    _field(name, "", header, "user_state", lambda v: True, "")
    _same_step(name, "worker", found, _step_of(path, found) if step is None else step)
    return name, header, arrays


class Compression(NamedTuple):
    """A file's compression state: the compression's `params` when saved (None: none
    was set), and its `records` (dicts with at least 'what' and 'key'), each with its
    array in `arrays`. `present` is False for a file written before snapshots held
    compression state."""
    present: bool
    params: dict | None
    records: list
    arrays: list


#: what a compression record may be (see `GradientCompression.state`)
COMPRESSION_RECORDS = ("residual", "pull", "served", "q")


def compression_section(params: dict | None, items: list, staging: Staging,
                        written_by=None) -> tuple:
    """(header field, arrays) of a compression state: `items` are (record, live array),
    each array staged in `staging` (copied with the values); `written_by(record)`: the
    device whose stream writes that array (None: see `Staging.take`)."""
    if params is None:
        return None, {}
    records, arrays = [], {}
    for j, (record, array) in enumerate(items):
        records.append(record)
        device = None if written_by is None else written_by(record)
        arrays[f"compression/{j}"] = staging.take(array, device)
    return {"params": params, "records": records}, arrays


def read_compression(path, file: str) -> Compression:
    """The compression state of `file` (a shard or worker file) of the snapshot at
    `path`; CheckpointError naming the file when the section is damaged."""
    name = os.path.join(checkpoint_path(path), file)
    header, arrays = read_archive(name, lambda array: array.startswith("compression/"))
    if "compression" not in header:
        return Compression(False, None, [], [])
    section = _field(name, "", header, "compression",
                     lambda v: v is None or isinstance(v, dict), "an object or null")
    if section is None:
        return Compression(True, None, [], [])
    where = "field 'compression': "
    params = _field(name, where, section, "params", lambda v: isinstance(v, dict),
                    "an object")
    records = _field(name, where, section, "records",
                     lambda v: isinstance(v, list) and all(
                         isinstance(r, dict) and r.get("what") in COMPRESSION_RECORDS
                         and "key" in r for r in v),
                     f"a list of records of {', '.join(COMPRESSION_RECORDS)}")
    found = []
    for j in range(len(records)):
        array = arrays.get(f"compression/{j}")
        if array is None:
            raise CheckpointError(f"{name}: {where}array 'compression/{j}' is missing")
        found.append(array)
    return Compression(True, params, records, found)


# ---------------------------------------------------------------------------- writing
class Staging:
    """Host buffers a snapshot's arrays are copied into: `take(array)` gives the next
    buffer (reused from the last snapshot staged into this set when it fits), and
    `copy()` fills them all at once."""

    def __init__(self, buffers: list):
        self._buffers = buffers
        self._used = 0
        self._pairs: list = []  # (buffer, array, the device whose stream writes it)

    def take(self, array, device=None) -> np.ndarray:
        """The buffer `copy()` fills with `array`. `device`: the logical device whose
        stream writes `array` (its key's home): the copy waits for the work queued
        there, whichever stream the caller is on (another thread's, say); None, or a
        device `array` is not on: the first logical device of the array's GPU."""
        k = self._used
        self._used += 1
        buffer = self._buffers[k] if k < len(self._buffers) else None
        if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
            buffer = np.empty(array.shape, array.dtype)
            if k < len(self._buffers):
                self._buffers[k] = buffer
            else:
                self._buffers.append(buffer)
        self._pairs.append((buffer, array, device))
        return buffer

    def fetch(self, home, array) -> np.ndarray:
        """`take`, for the optimizer's export (which names the array's home device)."""
        return self.take(array, home)

    def copy(self) -> None:
        on_host = []
        for buffer, array, device in self._pairs:
            if isinstance(array, np.ndarray):
                on_host.append((buffer, array))
                continue
            # by its own GPU, on the stream of the device that writes it: CuPy's current
            # stream may be another thread's, which no event orders after that work
            if device is None or not device.owns(array):
                device = device_of(array)
            np.copyto(buffer, device.to_host(array))
        host_device().copy_many(on_host)
        self._pairs = []


class PartWriter:
    """The files of one process's snapshots, written by a background thread (`_Writes`):
    one snapshot being written and one staged behind it, each in its own set of buffers.
    The thread starts at the first `submit` and waits between snapshots: one for the
    writer's life, where a thread for each snapshot would leave, with MPI initialised,
    some of the MPI library's memory behind for good (and a row in the timeline)."""

    def __init__(self) -> None:
        self._sets: list = [[], []]
        self._turn = 0
        self._writes = _Writes()
        # a writer dropped (its store's) ends the thread once its writes are done: the
        # thread holds the writes alone, never this writer nor its buffers
        weakref.finalize(self, self._writes.stop).atexit = False

    def stage(self) -> tuple[int, Staging]:
        """A free set of buffers (waiting for the write that used it to end); raises the
        error of a write that failed since the last call."""
        writes = self._writes
        with writes.cond:
            writes.raise_failure()
            turn = self._turn
            while writes.busy[turn]:
                writes.cond.wait()
            writes.raise_failure()
            writes.busy[turn] = True
            self._turn = 1 - turn
        return turn, Staging(self._sets[turn])

    def release(self, turn: int) -> None:
        """Give back a set `stage` gave that will not be written after all."""
        with self._writes.cond:
            self._writes.busy[turn] = False
            self._writes.cond.notify_all()

    def submit(self, turn: int, files: list, then=None) -> None:
        """Write `files` ((path, header, arrays), the arrays staged in set `turn`) in the
        background, in order, then call `then()`; the set is free again after."""
        self._writes.submit((turn, files, then))

    def finish(self) -> None:
        """Wait until every submitted snapshot is written; raise a failed write's error.
        In a forked child there is nothing to wait for: the writes, and the thread that
        makes them, are its parent's (and its lock may have been held at the fork)."""
        self._writes.finish()


class _Writes:
    """A `PartWriter`'s queue of snapshots to write and the thread that writes them, in
    order; the thread waits for the next one while there is none, until `stop`."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: collections.deque = collections.deque()  # (turn, files, then)
        self.busy = [False, False]  # each set of buffers: staged, or being written
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.pid = os.getpid()
        _WRITERS.add(self)

    def submit(self, item: tuple) -> None:
        with self.cond:
            self.queue.append(item)
            # (none yet, or the last one stopped; in a forked child, the parent's is not
            # there)
            if self.thread is None or not self.thread.is_alive():
                self.stopping = False
                self.thread = threading.Thread(target=self._run, name="gpukv-snapshots",
                                               daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def finish(self) -> None:
        if os.getpid() != self.pid:
            return
        with self.cond:
            while self.queue or any(self.busy):
                self.cond.wait()
            self.raise_failure()

    def stop(self, wait: bool = False) -> None:
        """End the thread once the snapshots queued are written (`wait`: wait for it);
        a later `submit` starts another."""
        if os.getpid() != self.pid:  # (a forked child: the thread is its parent's)
            return
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            thread = self.thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def raise_failure(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise CheckpointError(f"a snapshot could not be written: {error}") from error

    def _run(self) -> None:
        while self._write_next():
            pass

    def _write_next(self) -> bool:
        """Write the first snapshot queued, waiting for one; False once stopped with none
        queued. (The snapshot is let go on return: the thread, waiting for the next one,
        holds nothing of it, nor of whatever its `then` holds.)"""
        with self.cond:
            while not self.queue and not self.stopping:
                self.cond.wait()
            if not self.queue:
                self.thread = None
                return False
            turn, files, then = self.queue[0]
        try:
            os.makedirs(os.path.dirname(files[0][0]), exist_ok=True)
            _unmark(files[-1][0])
            for path, header, arrays in files:
                name = os.path.basename(path)
                with timeline.span("snapshot write", "snapshot", file=name):
                    write_archive(path, header, arrays)
            if then is not None:
                then()
        except BaseException as exc:  # kept for the caller's next call
            with self.cond:
                self.error = self.error or exc
        with self.cond:
            self.queue.popleft()
            self.busy[turn] = False
            self.cond.notify_all()
        return True


def _unmark(path: str) -> None:
    """Remove `path`, the file written last, if a snapshot taken earlier at the same step
    left it: its folder is then not complete until the new one is written, rather than
    complete with the files of two snapshots while they are replaced one by one."""
    if os.path.isdir(path):  # (its write says so)
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot replace this file of the snapshot taken "
                              f"earlier at the same step: {exc.strerror or exc}") from exc
    _fsync_dir(os.path.dirname(path))  # gone before any other file is replaced


#: the writes of every writer alive, or whose thread has not ended yet
_WRITERS: weakref.WeakSet = weakref.WeakSet()


def finish_writes() -> None:
    """Wait for every snapshot write of this process (a failed one's error was raised, or
    had nobody left to tell): a program that ends normally leaves its snapshots written."""
    for writes in list(_WRITERS):
        try:
            writes.finish()
        except CheckpointError:
            pass  # already said by the write's own caller, or nobody is left to tell


@atexit.register
def end_writes() -> None:
    """At exit: every snapshot written (`finish_writes`), then every writer thread ended,
    rather than left waiting while the interpreter ends."""
    finish_writes()
    for writes in list(_WRITERS):
        writes.stop(wait=True)


# ----------------------------------------------------------------------- the files
def checked(root, step, keep, last: int = 0) -> tuple[str, int, int | None]:
    """`snapshot`'s arguments checked: (root as a str, step, keep; None: no pruning),
    else ArgumentKindError for a step or keep that is no int, ArgumentError for one out
    of range (CheckpointError for a root that is no path or is a file). `last` is the
    step of the store's last snapshot, or of the one it resumed from: a step of None is
    the one after it, and a step below it is refused. A store's snapshots under a root
    are one run (`next_run`), ordered by step, so one below would not be the newest: it
    would be the first that `prune` removes, and `resume` would pass it over. The same
    step again is taken (the folder is written again, see `PartWriter`)."""
    root = checkpoint_path(root)
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"{root}: is a file; snapshots need a folder")
    for name, value, low in (("step", step, 0), ("keep", keep, 1)):
        if value is None:  # step: the next one; keep: the caller prunes itself
            continue
        expected = f"an int >= {low}" + (" (or None)" if name == "keep" else "")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ArgumentKindError(f"{name}={value!r}: expected {expected}, got "
                                    f"{type(value).__name__}")
        if value < low:
            raise ArgumentError(f"{name}={value!r}: expected {expected}")
    if step is None:
        step = last + 1
    elif step < last:
        raise ArgumentError(
            f"step={step!r}: below {last}, the step of this store's last snapshot (or of "
            f"the one it resumed from); its steps never go back, as its snapshots under a "
            f"root are one run, ordered by step, where step {step} would not be the "
            f"newest. To go back to an earlier step, load that snapshot into a new store: "
            f"its first snapshot starts a new run")
    return root, int(step), None if keep is None else int(keep)


def unwritable(root: str) -> str | None:
    """Why snapshots cannot be written into folder `root` (or into the folder that would
    make it, when it does not exist yet), or None when they can."""
    folder = os.path.abspath(root)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{root}: cannot write snapshots there: {folder} is a file"
    if not os.access(folder, os.W_OK | os.X_OK):
        return (f"{root}: cannot write snapshots there: {folder} is not writable "
                f"(a read-only file system, or permissions)")
    try:  # a file made and removed: what permissions allow root, a file system may not
        with tempfile.TemporaryFile(dir=folder, prefix=".gpukv-write-check-"):
            pass
    except OSError as exc:
        return f"{root}: cannot write snapshots there: {folder}: {exc.strerror or exc}"
    return None


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
    """The (path, header, arrays) of worker `rank`'s file; ArgumentKindError for a
    user_state that is no dict, ArgumentError for one that cannot be saved."""
    encoded, arrays = user_state.encode({} if state is None else state)
    header = {"kind": WORKER_KIND, "version": VERSION, "step": step, "rank": rank,
              "workers": workers, "user_state": encoded}
    return os.path.join(folder, worker_file(rank, workers)), header, arrays

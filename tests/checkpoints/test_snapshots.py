"""Numbered snapshots of one-process stores (`kv.snapshot`, `kv.resume`,
`gpukv.latest_snapshot`): they resume bit for bit, only complete ones are found, the
newest are kept, a failed write is raised later and spoils nothing, and `user_state`
round-trips exactly or is refused naming where."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import re
import shutil
import struct
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukv
from gpukv import optim
from gpukv.checkpoints import checkpoint, snapshots
from gpukv.checkpoints import user_state as user_state_format
from gpukv.checkpoints.checkpoint import read_archive

from ..bfloat16 import ml_dtypes, needs_bfloat16  # without it, its dtypes' tests expect a refusal
from .held_writes import hold_snapshot_writes

torch = pytest.importorskip("torch")

#: key -> (dtype, shape); Adam with float32 master copies trains every key
KEYS = {1: ("float32", (5, 7)), 2: ("float16", (33,)), 3: ("float64", (300,))}


def _adam():
    return optim.Adam(learning_rate=0.01, wd=1e-3, multi_precision=True)


def _arrays(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * scale).astype(d) for d, s in KEYS.values()]


def _store(kind, seed=0):
    """A store of `kind` ('local', or 'device' with every key on another GPU) holding
    KEYS, with Adam set."""
    kv = gpukv.create(kind)
    values = _arrays(seed)
    if kind == "device":
        import cupy

        from gpukv.device.cuda.device import gpu_devices
        devices = gpu_devices()
        on_gpus = []
        for i, v in enumerate(values):
            with cupy.cuda.Device(devices[i % len(devices)].physical):
                on_gpus.append(cupy.asarray(v))
        values = on_gpus
    kv.init(list(KEYS), values)
    kv.set_optimizer(_adam())
    return kv


def _train(kv, first, steps):
    for step in range(first, first + steps):
        kv.push(list(KEYS), _arrays(100 + step))


def _values(kv):
    outs = [np.full(s, 7, d) for d, s in KEYS.values()]
    kv.pull(list(KEYS), out=outs)
    return outs


def _fingerprint(kv, path):
    """The bytes of every value and the whole optimizer state (through
    save_optimizer_states to `path`)."""
    kv.save_optimizer_states(path)
    header, arrays = read_archive(path)
    return ([(v.dtype, v.shape, v.tobytes()) for v in _values(kv)], header,
            {n: a.tobytes() for n, a in sorted(arrays.items())})


def _folders(root):
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


STORE_KINDS = [
    pytest.param("local", "local", id="local-to-local"),
    pytest.param("device", "device", id="device-to-device", marks=pytest.mark.gpu),
    pytest.param("device", "local", id="device-to-local", marks=pytest.mark.gpu),
    pytest.param("local", "device", id="local-to-device", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("saver,loader", STORE_KINDS)
def test_a_snapshot_resumes_bit_for_bit(tmp_path, saver, loader):
    """A fresh store resumed from a snapshot holds the saved values and optimizer state
    to the bit, and the next pushes give both stores the same values."""
    kv = _store(saver)
    _train(kv, 0, 3)
    folder = kv.snapshot(tmp_path / "snaps", 3, user_state={"epoch": 1})
    kv.finish_snapshots()
    before = _fingerprint(kv, tmp_path / "a.states")

    fresh = _store(loader, seed=9)
    found = fresh.resume(tmp_path / "snaps")
    assert (found.path, found.step, found.shards, found.workers) == (folder, 3, 1, 1)
    assert found.user_state() == {"epoch": 1}
    assert _fingerprint(fresh, tmp_path / "b.states") == before
    _train(kv, 3, 2)
    _train(fresh, 3, 2)
    assert _fingerprint(fresh, tmp_path / "b.states") == _fingerprint(kv, tmp_path / "a.states")


@contextlib.contextmanager
def _streams_of_its_own():
    """A non-blocking CUDA stream of its own made current on every GPU, for this thread."""
    import cupy
    with contextlib.ExitStack() as streams:
        for gpu in range(cupy.cuda.runtime.getDeviceCount()):
            with cupy.cuda.Device(gpu):
                streams.enter_context(cupy.cuda.Stream(non_blocking=True))
        yield


def _in_threads(*bodies) -> None:
    """Run every body in a thread of its own; raise the first one's error."""
    failures: list = []

    def run(body):
        try:
            body()
        except BaseException as exc:  # raised here, in the test's thread
            failures.append(exc)
    threads = [threading.Thread(target=run, args=(body,)) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


@pytest.mark.gpu
@pytest.mark.parametrize("compression", [None, {"type": "sign"}],
                         ids=lambda c: "plain" if c is None else c["type"])
def test_a_snapshot_on_another_threads_streams_holds_the_pushes_before_it(
        tmp_path, compression):
    """A snapshot taken by one thread, on CUDA streams of its own, after another thread's
    pushes on its own streams returned, holds the values and optimizer state those
    pushes left, as the store does: the copies to the host wait for the keys' work (the
    compression's residuals and served values too, which the race checker watches)."""
    kv = _store("device")
    if compression is not None:
        kv.set_gradient_compression(compression)
    _train(kv, 0, 1)
    pushed = threading.Event()

    def pushes():
        with _streams_of_its_own():
            _train(kv, 1, 2)
        pushed.set()

    def snapshot():
        pushed.wait()
        with _streams_of_its_own():
            kv.snapshot(tmp_path / "snaps", 3)
        kv.finish_snapshots()
    _in_threads(pushes, snapshot)
    fresh = _store("device", seed=9)  # (what it pulls: the served values it resumes)
    if compression is not None:
        fresh.set_gradient_compression(compression)
    assert fresh.resume(tmp_path / "snaps").step == 3
    assert _fingerprint(fresh, tmp_path / "b.states") == _fingerprint(kv, tmp_path / "a.states")


def test_resume_without_a_snapshot_changes_nothing(tmp_path):
    """resume() of a missing or empty root returns None and leaves the store as it was;
    a `check` that refuses the snapshot leaves it as it was too."""
    kv = _store("local")
    before = _fingerprint(kv, tmp_path / "a.states")
    assert kv.resume(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert kv.resume(tmp_path / "empty") is None
    other = _store("local", seed=5)
    other.snapshot(tmp_path / "snaps", 1)
    other.finish_snapshots()

    def refuse(found):
        raise gpukv.CheckpointError(f"{found.path}: not mine")
    with pytest.raises(gpukv.CheckpointError, match="not mine"):
        kv.resume(tmp_path / "snaps", check=refuse)
    assert _fingerprint(kv, tmp_path / "a.states") == before


def test_resume_logs_the_snapshot_or_that_there_is_none(tmp_path, caplog):
    """kv.resume logs at INFO the path and step of the snapshot it resumed from, or that
    the root holds none."""
    kv = _store("local")
    folder = kv.snapshot(tmp_path / "snaps", 4)
    kv.finish_snapshots()
    with caplog.at_level(logging.INFO, logger="gpukv"):
        _store("local", seed=3).resume(tmp_path / "snaps")
        _store("local", seed=3).resume(tmp_path / "missing")
    said = [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and "snapshot" in r.getMessage()]
    assert said == [f"gpukv: resumed from snapshot {folder} (step 4)",
                    f"gpukv: no complete snapshot under {tmp_path / 'missing'} to resume from"]


def test_a_dropped_store_leaves_no_writer_thread_nor_buffers(tmp_path):
    """A store's writer thread ends once the store is dropped and its snapshots are
    written, so that a store made and dropped (a new Trainer after a change, many times
    in a long job) leaves no thread behind, and its staging buffers go with it."""
    import gc
    import threading
    import weakref

    def writers() -> list:
        return [t for t in threading.enumerate() if t.name == "gpukv-snapshots"]
    gc.collect()  # (an earlier test's store, and its writer, go now: not in the middle)
    writing = len(snapshots._WRITERS)
    before = set(writers())

    def new_writers() -> list:
        return [t for t in writers() if t not in before]
    kept = []
    for i in range(3):
        kv = gpukv.create("local")
        kv.init("w", np.arange(1 << 16, dtype=np.float32))
        kv.snapshot(tmp_path / f"run{i}", keep=2)
        kv.finish_snapshots()
        kept.append(weakref.ref(kv))
        del kv
    gc.collect()
    for _ in range(100):  # (a thread's end after its last write is a moment away)
        if not new_writers():
            break
        threading.Event().wait(0.01)
    assert not new_writers()
    assert all(ref() is None for ref in kept)
    assert len(snapshots._WRITERS) <= writing  # (each writer, with its buffers, freed)


def test_one_thread_writes_a_stores_snapshots_idle_between_them(tmp_path, monkeypatch):
    """A store's snapshots are all written by one thread, started at the first and
    waiting between them, however often it has nothing to write (in a long job, most of
    the time): a thread started for each (with MPI initialised, each leaves some of the
    MPI library's memory behind for good) would grow the process snapshot by snapshot."""
    started = []
    start = threading.Thread.start

    def counted(thread):
        if thread.name == "gpukv-snapshots":
            started.append(thread)
        start(thread)
    monkeypatch.setattr(threading.Thread, "start", counted)
    kv = gpukv.create("local")
    kv.init("w", np.arange(64, dtype=np.float32))
    for _ in range(5):
        kv.snapshot(tmp_path, keep=2)
        kv.finish_snapshots()
        threading.Event().wait(0.01)  # (the steps between two snapshots)
    assert len(started) == 1 and started[0].is_alive()


EXITING = """
import atexit, sys, threading
# registered before gpukv's exit handlers: runs after them
atexit.register(lambda: print("writer threads at exit:", sum(
    t.name == "gpukv-snapshots" for t in threading.enumerate())))
import numpy as np
import gpukv
kv = gpukv.create("local")
kv.init("w", np.zeros(1 << 20, np.float32))
kv.snapshot(sys.argv[1], 1)
kv.finish_snapshots()  # (its thread waits for the next one)
kv.push("w", np.ones(1 << 20, np.float32))
kv.snapshot(sys.argv[1], 2)  # still being written as the program ends
"""


def test_a_program_that_ends_leaves_its_snapshots_written_and_no_writer_thread(tmp_path):
    """A program that ends normally, a snapshot still being written, leaves it written
    (its exit waits for it), and the writer thread, idle or not, ended then."""
    import subprocess
    import sys

    from .. import gpu_env
    done = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path)], text=True,
                          capture_output=True, env=gpu_env.subprocess_env(gpus=False),
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "writer threads at exit: 0\n"), done.stderr
    latest = gpukv.latest_snapshot(tmp_path)
    assert latest is not None and latest.step == 2
    kv = gpukv.create("local")
    kv.load(latest)
    out = np.zeros(1 << 20, np.float32)
    kv.pull("w", out=out)
    assert (out == 1).all()


def test_a_snapshot_without_a_step_takes_the_next_one(tmp_path):
    """snapshot(root) numbers its snapshots 1, 2, ... on from the last one the store took
    (an explicit step included), and a store that resumed goes on from the step it
    resumed from."""
    kv = _store("local")
    assert Path(kv.snapshot(tmp_path)).name.startswith("step-000000001-")
    assert Path(kv.snapshot(tmp_path, 7)).name.startswith("step-000000007-")
    assert Path(kv.snapshot(tmp_path)).name.startswith("step-000000008-")
    kv.finish_snapshots()
    del kv  # (its folder, free for the next store)
    again = _store("local", seed=3)
    assert again.resume(tmp_path).step == 8
    assert Path(again.snapshot(tmp_path)).name.startswith("step-000000009-")
    again.finish_snapshots()


def test_snapshots_several_threads_take_at_once_each_have_a_step_of_their_own(tmp_path):
    """snapshot(root) called by several threads at once numbers each call the step after
    the store's last snapshot, whichever thread took that: no two share a step (and so
    a folder, which the later one would write over)."""
    kv = _store("local")
    taken: list = []

    def snapshots_of_one_thread():
        for _ in range(5):
            taken.append(kv.snapshot(tmp_path, keep=None))
    _in_threads(*[snapshots_of_one_thread] * 3)
    kv.finish_snapshots()
    steps = sorted(int(Path(folder).name.split("-")[1]) for folder in taken)
    assert steps == list(range(1, 16))
    assert len(snapshots.complete_snapshots(tmp_path)) == 15


def test_a_folder_another_live_store_snapshots_into_is_refused(tmp_path):
    """A store of the process that would snapshot into a folder another live one
    snapshots into (by any path to it) is an ArgumentError naming the folder, and nothing
    is written there: its snapshots would be taken for the other's. Once that store is
    dropped, the folder is free: the second resumes from it and goes on there."""
    root = tmp_path / "snaps"
    first = _store("local")
    first.snapshot(root, 1)
    first.finish_snapshots()
    (tmp_path / "link").symlink_to(root)
    second = _store("local", seed=3)
    before = _listing(root)
    for path in (root, tmp_path / "link"):
        said = re.escape(f"{path}: a 'local' store of this process")
        with pytest.raises(gpukv.ArgumentError, match=said + ".*its own checkpoint_dir"):
            second.snapshot(path)
    assert _listing(root) == before
    first.snapshot(root)  # (the first goes on)
    first.finish_snapshots()
    del first
    assert second.resume(root).step == 2
    assert Path(second.snapshot(root)).name.startswith("step-000000003-")
    second.finish_snapshots()


def test_a_refused_snapshot_leaves_its_folder_to_other_stores(tmp_path):
    """A snapshot refused for its user_state writes nothing and holds no folder: another
    store of the process snapshots there after it."""
    root = tmp_path / "snaps"
    first, second = _store("local"), _store("local", seed=3)
    with pytest.raises(gpukv.ArgumentError, match=r"user_state\['x'\]"):
        first.snapshot(root, user_state={"x": object()})
    assert not root.exists() or not os.listdir(root)
    assert Path(second.snapshot(root)).name.startswith("step-000000001-")
    second.finish_snapshots()
    assert first is not None  # (still live)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_leaves_the_newest_complete_snapshots(tmp_path, keep):
    """After snapshots of steps 1..5 with keep=K, the K newest are what remains."""
    kv = _store("local")
    for step in range(1, 6):
        _train(kv, step, 1)
        kv.snapshot(tmp_path, step, keep=keep)
    kv.finish_snapshots()
    assert [s.step for s in snapshots.complete_snapshots(tmp_path)] == \
        list(range(6 - keep, 6))
    assert len(_folders(tmp_path)) == keep
    assert gpukv.latest_snapshot(tmp_path).step == 5


def _drop_shard(folder):
    os.remove(os.path.join(folder, snapshots.shard_file(0, 1)))


def _drop_worker(folder):
    os.remove(os.path.join(folder, snapshots.worker_file(0, 1)))


def _half_written_shard(folder):
    """What a writer killed mid-file leaves: the temporary file, not the shard."""
    shard = os.path.join(folder, snapshots.shard_file(0, 1))
    with open(shard, "rb") as f:
        head = f.read(1000)
    os.remove(shard)
    with open(os.path.join(folder, ".shard-00000-of-00001.npz.x1y2z3.tmp"), "wb") as f:
        f.write(head)


def _second_worker_missing(folder):
    os.rename(os.path.join(folder, snapshots.worker_file(0, 1)),
              os.path.join(folder, snapshots.worker_file(0, 2)))


def _second_shard_missing(folder):
    os.rename(os.path.join(folder, snapshots.shard_file(0, 1)),
              os.path.join(folder, snapshots.shard_file(0, 2)))


INCOMPLETE = [_drop_shard, _drop_worker, _half_written_shard, _second_worker_missing,
              _second_shard_missing]


@pytest.mark.parametrize("spoil", INCOMPLETE, ids=lambda f: f.__name__.strip("_"))
def test_an_incomplete_snapshot_is_never_found_or_loaded(tmp_path, spoil):
    """A snapshot folder with a file missing is passed over by latest_snapshot (the
    older complete one is found), and loading or reading it is a CheckpointError that
    leaves the store unchanged."""
    kv = _store("local")
    kv.snapshot(tmp_path, 1, keep=5)
    _train(kv, 1, 1)
    newest = kv.snapshot(tmp_path, 2, keep=5)
    kv.finish_snapshots()
    spoil(newest)
    assert gpukv.latest_snapshot(tmp_path).step == 1
    assert [s.step for s in snapshots.complete_snapshots(tmp_path)] == [1]
    fresh = _store("local", seed=3)
    before = _fingerprint(fresh, tmp_path / "a.states")
    with pytest.raises(gpukv.CheckpointError, match="not a complete snapshot"):
        fresh.load(newest)
    with pytest.raises(gpukv.CheckpointError, match="not a complete snapshot"):
        snapshots.read_worker(newest, 0)
    assert _fingerprint(fresh, tmp_path / "a.states") == before
    assert fresh.resume(tmp_path).step == 1


def test_incomplete_snapshots_older_than_the_newest_complete_are_pruned(tmp_path):
    """Pruning removes incomplete folders older than the newest complete snapshot (an
    earlier attempt's leftovers) and keeps newer ones (still being written elsewhere)."""
    kv = _store("local")
    first = kv.snapshot(tmp_path, 1, keep=2)
    kv.finish_snapshots()
    stale = tmp_path / snapshots.folder_name(2, "0badc0de", 1)  # kv's run, 1
    shutil.copytree(first, stale)
    _drop_worker(stale)
    pending = tmp_path / snapshots.folder_name(9, "0badc0de", 1)
    shutil.copytree(first, pending)
    _drop_shard(pending)
    kept = [kv.snapshot(tmp_path, step, keep=2) for step in (3, 4)]
    kv.finish_snapshots()
    assert _folders(tmp_path) == sorted(os.path.basename(p) for p in [*kept, pending])
    assert gpukv.latest_snapshot(tmp_path).step == 4


def test_a_later_runs_snapshots_are_newer_than_an_earlier_runs_higher_steps(tmp_path):
    """A store's first snapshot under a root counts one more run than the root holds and
    keeps it: its snapshots are the newest, whatever steps an earlier run reached, and
    pruning keeps them."""
    first = _store("local")
    for step in (5, 6):
        first.snapshot(tmp_path, step, keep=2)
    first.finish_snapshots()
    del first  # (its folder, free for the next store)
    assert snapshots.next_run(tmp_path) == 2
    later = _store("local", seed=1)
    names = [os.path.basename(later.snapshot(tmp_path, step, keep=2)) for step in (1, 2)]
    later.finish_snapshots()
    assert all(name.endswith("-r2") for name in names)
    assert [(s.run, s.step) for s in snapshots.complete_snapshots(tmp_path)] == [(2, 1), (2, 2)]
    newest = gpukv.latest_snapshot(tmp_path)
    assert (newest.run, newest.step, os.path.basename(newest.path)) == (2, 2, names[-1])


def _listing(root) -> dict:
    """{folder: {file: its bytes}} of every snapshot folder under `root`."""
    return {name: {f: (root / name / f).read_bytes() for f in os.listdir(root / name)}
            for name in os.listdir(root)}


@pytest.mark.parametrize("keep", [2, 5, None])
def test_a_step_below_the_stores_last_is_refused_before_anything_is_written(tmp_path, keep):
    """A step below the store's last snapshot's (in its run, it would be older than the
    snapshots before it: pruned at once, or passed over by resume) is an ArgumentError
    naming both steps; nothing is written or pruned, and the next step goes on."""
    kv = _store("local")
    for step in (5, 6):
        kv.snapshot(tmp_path, step)
    kv.finish_snapshots()
    before = _listing(tmp_path)
    with pytest.raises(gpukv.ArgumentError, match=r"step=3: below 6, .* new store") as raised:
        kv.snapshot(tmp_path, 3, user_state={"note": "after rollback"}, keep=keep)
    assert not isinstance(raised.value, TypeError)
    kv.finish_snapshots()
    assert _listing(tmp_path) == before
    path = kv.snapshot(tmp_path, user_state={"note": "next"})
    kv.finish_snapshots()
    assert os.path.basename(path).startswith("step-000000007-")
    assert gpukv.latest_snapshot(tmp_path).path == path


def test_a_resume_in_the_same_store_keeps_its_run_and_its_steps_order(tmp_path):
    """A store that resumes under a root it snapshotted into stays in its run: a step
    below the one it resumed from is refused, the same step and later ones are taken."""
    kv = _store("local")
    for step in (5, 6):
        kv.snapshot(tmp_path, step)
    kv.finish_snapshots()
    assert kv.resume(tmp_path).step == 6
    with pytest.raises(gpukv.ArgumentError, match="step=3: below 6"):
        kv.snapshot(tmp_path, 3)
    kv.finish_snapshots()
    taken = [kv.snapshot(tmp_path, step) for step in (6, 8)]
    kv.finish_snapshots()
    assert [(s.run, s.step, s.path) for s in snapshots.complete_snapshots(tmp_path)] == [
        (1, 6, taken[0]), (1, 8, taken[1])]


def test_an_earlier_step_goes_on_in_a_new_store_as_a_new_run(tmp_path):
    """Going back to an earlier snapshot: a new store loads it and snapshots on from its
    step, in a run of its own, whose snapshots are the newest and the ones kept."""
    kv = _store("local")
    older = kv.snapshot(tmp_path, 5, user_state={"at": 5})
    kv.snapshot(tmp_path, 6, user_state={"at": 6})
    kv.finish_snapshots()
    del kv  # (its folder, free for the next store)
    again = _store("local", seed=1)
    again.load(older)
    path = again.snapshot(tmp_path, 5, user_state={"note": "after rollback"})
    again.finish_snapshots()
    newest = gpukv.latest_snapshot(tmp_path)
    assert (newest.path, newest.run, newest.step) == (path, 2, 5)
    assert newest.user_state(0) == {"note": "after rollback"}


def test_folders_of_an_older_gpukv_are_run_0(tmp_path):
    """`step-<step>-<tag>` without a run: a snapshot of run 0, older than any counted run
    however high its step, and still read."""
    kv = _store("local")
    old = kv.snapshot(tmp_path, 9, keep=None)
    kv.finish_snapshots()
    legacy = os.path.join(tmp_path, os.path.basename(old).rsplit("-", 1)[0])
    os.rename(old, legacy)
    assert snapshots.is_snapshot(legacy)
    (found,) = snapshots.complete_snapshots(tmp_path)
    assert (found.run, found.step, found.path) == (0, 9, legacy)
    assert snapshots.next_run(tmp_path) == 1
    del kv  # (its folder, free for the next store)
    fresh = _store("local", seed=1)
    fresh.snapshot(tmp_path, 1, keep=None)
    fresh.finish_snapshots()
    assert [(s.run, s.step) for s in snapshots.complete_snapshots(tmp_path)] == [(0, 9), (1, 1)]


def test_a_mutation_after_snapshot_returns_is_not_written(tmp_path, monkeypatch):
    """What snapshot() saves is the state when it returned: pushes (values and optimizer
    state) and changes to user_state's arrays made while the file is being written are
    not in it."""
    release = hold_snapshot_writes(monkeypatch)
    kv = _store("local")
    _train(kv, 0, 2)
    kv.save(tmp_path / "then.npz")
    position = np.arange(4)
    kv.snapshot(tmp_path / "snaps", 2, user_state={"position": position})
    _train(kv, 2, 1)
    position += 10
    release.set()
    kv.finish_snapshots()
    found = gpukv.latest_snapshot(tmp_path / "snaps")
    then = checkpoint.read_store(tmp_path / "then.npz")
    saved = snapshots.read_store(found)
    assert [v.tobytes() for v in saved.values] == [v.tobytes() for v in then.values]
    # (a snapshot also keeps the optimizer's options, which save() leaves out)
    assert {k: saved.optimizer[0][k] for k in then.optimizer[0]} == then.optimizer[0]
    assert {n: a.tobytes() for n, a in saved.optimizer[1].items()} == \
        {n: a.tobytes() for n, a in then.optimizer[1].items()}
    assert found.user_state()["position"].tolist() == [0, 1, 2, 3]


def _block_folder(root, folder, step):
    """A file where the folder of `step` will go (the same tag and run as `folder`)."""
    _, _, tag, run = os.path.basename(folder).split("-")
    with open(os.path.join(root, snapshots.folder_name(step, tag, int(run[1:]))), "w") as f:
        f.write("in the way")


def _raised_by_snapshot(kv, root):
    """The next snapshots (blocked too): the one that finds the write failed raises; by
    the second at the latest, which needs the failed write's buffers."""
    for step in (3, 4):
        kv.snapshot(root, step)


RAISED_BY = {
    "snapshot": _raised_by_snapshot,
    "finish_snapshots": lambda kv, root: kv.finish_snapshots(),
}


@pytest.mark.parametrize("raised_by", list(RAISED_BY))
def test_a_failed_write_is_raised_later_and_spoils_nothing(tmp_path, raised_by):
    """A snapshot whose folder cannot be made (a file is in the way) is raised as
    CheckpointError by a later snapshot() or by finish_snapshots(); the older snapshot
    stays the newest complete one and loads, and the next snapshot is written."""
    kv = _store("local")
    _train(kv, 0, 1)
    first = kv.snapshot(tmp_path, 1)
    kv.finish_snapshots()
    saved = _values(kv)
    for step in (2, 3, 4):
        _block_folder(tmp_path, first, step)
    _train(kv, 1, 1)
    kv.snapshot(tmp_path, 2)  # staged; the write fails in the background
    with pytest.raises(gpukv.CheckpointError, match="could not be written"):
        RAISED_BY[raised_by](kv, tmp_path)
    try:
        kv.finish_snapshots()  # a blocked snapshot 3 may have been staged meanwhile
    except gpukv.CheckpointError:
        pass
    found = gpukv.latest_snapshot(tmp_path)
    assert found.path == first
    fresh = _store("local", seed=4)
    fresh.load(found)
    assert [v.tobytes() for v in _values(fresh)] == [v.tobytes() for v in saved]
    kv.snapshot(tmp_path, 5)
    kv.finish_snapshots()
    assert gpukv.latest_snapshot(tmp_path).step == 5


BAD_ARGUMENTS = [
    ({"step": -1}, gpukv.ArgumentError, "step=-1"),
    ({"step": 0}, gpukv.ArgumentError, "step=0: below 1, the step of this store's last"),
    ({"step": True}, gpukv.ArgumentKindError, "step=True: expected an int >= 0, got bool"),
    ({"step": 1.0}, gpukv.ArgumentKindError, "step=1.0"),
    ({"step": 1.5}, gpukv.ArgumentKindError, "step=1.5: .* got float"),
    ({"step": "3"}, gpukv.ArgumentKindError, "step='3'"),
    ({"step": "a"}, gpukv.ArgumentKindError, "step='a': .* got str"),
    ({"keep": 0}, gpukv.ArgumentError, "keep=0"),
    ({"keep": True}, gpukv.ArgumentKindError, "keep=True"),
    ({"keep": "2"}, gpukv.ArgumentKindError, r"keep='2': expected an int >= 1 \(or None\)"),
    ({"root": "a-file"}, gpukv.CheckpointError, "is a file"),
    ({"root": None}, gpukv.CheckpointPathKindError, "checkpoint path None"),
    ({"user_state": [1]}, gpukv.ArgumentKindError, "user_state: expected a dict, got list"),
    ({"user_state": object()}, gpukv.ArgumentKindError,
     "user_state: expected a dict, got object"),
    ({"user_state": {"seen": {1}}}, gpukv.ArgumentError, r"user_state\['seen'\]"),
]


@pytest.mark.parametrize("change,error,message", BAD_ARGUMENTS,
                         ids=[repr(c) for c, _, _ in BAD_ARGUMENTS])
def test_bad_arguments_change_nothing(tmp_path, change, error, message):
    """snapshot() with a bad step, keep, root or user_state raises a typed error naming
    it (a TypeError too for one of the wrong kind, e.g. ArgumentKindError; ArgumentError,
    a ValueError only, for a bad value of the right kind) and writes nothing, and the
    earlier snapshots stay as they were."""
    root = tmp_path / "snaps"
    (tmp_path / "a-file").write_text("not a folder")
    kv = _store("local")
    kv.snapshot(root, 1)
    kv.finish_snapshots()
    listing = _folders(root)
    args = {"root": root, "step": 2, "user_state": None, "keep": 1}
    args.update(change)
    if args["root"] == "a-file":
        args["root"] = tmp_path / "a-file"
    with pytest.raises(error, match=message) as raised:
        kv.snapshot(args["root"], args["step"], user_state=args["user_state"],
                    keep=args["keep"])
    assert isinstance(raised.value, TypeError) == issubclass(error, TypeError)
    kv.finish_snapshots()
    assert _folders(root) == listing
    assert (tmp_path / "a-file").read_text() == "not a folder"


def _same(a, b) -> bool:
    """Equal values of the same types all the way down; arrays to the bit, dtype and
    shape included; floats to the bit (nan equals a nan of the same bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):  # to the bit: -0.0, a nan's sign and payload
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _bits(t) -> bytes:
    """The bytes of a tensor's values (any dtype, 0-d too), in order."""
    if t.numel() == 0:
        return b""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


_SHARED = [1, {"x": 2}]  # one list in several places: saved in each, no cycle

USER_STATES = {
    "nested": {"loader": {"epoch": 3, "batches": [1, 2, {"deep": (4, "five", None)}]},
               "flags": [True, False], "name": "run-é", "empty": ({}, [], ())},
    "random_state": {"random": random.Random(7).getstate()},
    "numpy": {"rng": np.random.default_rng(3).bit_generator.state,
              "a": np.arange(12, dtype=np.int64).reshape(3, 4),
              "half": np.array([1.5, -0.0, np.inf], np.float16),
              "scalar": np.array(2.5), "mask": np.array([True, False]),
              "strided": np.arange(10.0)[::3]},
    "torch": {"generator": torch.Generator().manual_seed(5).get_state(),
              "t": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
    "big_ints": {"big": 2**80, "small": -(2**70), "zero": 0},
    "floats": {"inf": math.inf, "ninf": -math.inf, "nan": math.nan, "nzero": -0.0,
               "tiny": 5e-324, "in_a_tuple": (math.nan, 1.25), "negative_nan": -math.nan,
               "nan_payload": struct.unpack("<d", struct.pack("<Q", 0x7FF0_0000_0000_0123))[0]},
    "narrow_tensors": {  # dtypes torch has no NumPy twin for: through ml_dtypes
        "bf16": torch.tensor([1.5, -0.0, math.inf, math.nan, 3e38], dtype=torch.bfloat16),
        "bf16_strided": torch.arange(12.0).to(torch.bfloat16).reshape(3, 4).t(),
        "bf16_0d": torch.tensor(-2.25, dtype=torch.bfloat16),
        "bf16_grad": torch.ones(2, dtype=torch.bfloat16, requires_grad=True),
        "e4m3": torch.tensor([0.5, -448.0], dtype=torch.float8_e4m3fn),
        "e5m2": (torch.tensor([1.0, -57344.0], dtype=torch.float8_e5m2),)},
    "long_double": {"a": np.array([1, 2, 3], np.longdouble) / 3,
                    "c": np.array([1 + 1j], np.clongdouble) / 3,
                    "zero_d": np.asarray(np.longdouble(1) / 7)},
    "longest_int": {"big": int("9" * 4300), "neg": -int("9" * 4300), "hex": hex(7 ** 9000)},
    "shared_not_cyclic": {"a": _SHARED, "b": [_SHARED, (_SHARED,)]},
}


@pytest.mark.parametrize("state", [
    pytest.param(v, marks=needs_bfloat16) if k == "narrow_tensors" else v
    for k, v in USER_STATES.items()], ids=list(USER_STATES))
def test_user_state_round_trips(tmp_path, state):
    """A user_state of nested dicts, lists, tuples, str, big ints, floats (inf, nan, -0),
    NumPy arrays and torch tensors comes back with the same types and bits."""
    kv = _store("local")
    kv.snapshot(tmp_path, 1, user_state=state)
    kv.finish_snapshots()
    back = gpukv.latest_snapshot(tmp_path).user_state(0)
    assert _same(back, state), (back, state)


def test_numpy_scalars_come_back_as_python_numbers(tmp_path):
    """NumPy scalars (a nan among them) are saved as the Python numbers they hold."""
    kv = _store("local")
    kv.snapshot(tmp_path, 1, user_state={"n": np.int64(3), "x": np.float32(np.nan)})
    kv.finish_snapshots()
    back = gpukv.latest_snapshot(tmp_path).user_state(0)
    assert back["n"] == 3 and type(back["n"]) is int
    assert type(back["x"]) is float and math.isnan(back["x"])


def _cycle_in_a_list():
    a = [0, 1]
    a.append(a)
    return {"a": a}


def _cycle_in_a_dict():
    d: dict = {"x": {}}
    d["x"]["up"] = d
    return {"d": d}


def _cycle_through_a_tuple():
    inner: list = []
    t = (inner,)
    inner.append(t)
    return {"t": t}


def _cycle_at_the_top():
    state: dict = {}
    state["me"] = state
    return state


def _quietly(make):
    """make(), without the warnings torch gives for its beta and deprecated kinds."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def _sparse(layout):
    dense = torch.eye(4)
    if layout in ("bsr", "bsc"):
        return _quietly(lambda: getattr(dense, f"to_sparse_{layout}")((2, 2)))
    if layout == "coo":
        return dense.to_sparse()
    return _quietly(getattr(dense, f"to_sparse_{layout}"))


UNSAVABLE = [
    pytest.param({"seen": {1, 2}}, r"user_state\['seen'\]: a set cannot be saved", id="set"),
    pytest.param({"a": [0, {1: "one"}]}, r"user_state\['a'\]\[1\]: key 1 is a int", id="int-key"),
    pytest.param({"a": (np.array([object()]),)},
                 r"user_state\['a'\]\[0\]: an array of Python objects", id="object-array"),
    pytest.param({"a": {"__gpukv_tuple__": 1}},
                 r"user_state\['a'\]: key '__gpukv_tuple__' is reserved", id="reserved-key"),
    pytest.param({"c": 1j}, r"user_state\['c'\]: a complex cannot be saved", id="complex"),
    pytest.param({"c": np.complex64(1j)}, r"user_state\['c'\]: a complex cannot be saved",
                 id="np-complex"),
    # NumPy scalars that hold no Python number
    pytest.param({"x": [np.longdouble(1) / 3]},
                 r"user_state\['x'\]\[0\]: a numpy\.longdouble scalar .*np\.asarray",
                 id="longdouble"),
    pytest.param({"x": {"y": np.clongdouble(1j) / 3}},
                 r"user_state\['x'\]\['y'\]: a numpy\.clongdouble scalar", id="clongdouble"),
    pytest.param({"v": np.zeros(1, [("a", "i4")])[0]},
                 r"user_state\['v'\]: a numpy\.void scalar", id="structured-scalar"),
    pytest.param({"d": [np.datetime64("2024-01-02T03:04:05.123456789", "ns")]},
                 r"user_state\['d'\]\[0\]: a numpy\.datetime64 scalar", id="datetime-scalar"),
    pytest.param({"d": np.timedelta64("NaT")}, r"user_state\['d'\]: a numpy\.timedelta64 scalar",
                 id="timedelta-scalar"),
    # cycles, and a nesting past the limit
    pytest.param(_cycle_in_a_list(), r"user_state\['a'\]\[2\]: refers back .*cycle",
                 id="cycle-list"),
    pytest.param(_cycle_in_a_dict(), r"user_state\['d'\]\['x'\]\['up'\]: refers back",
                 id="cycle-dict"),
    pytest.param(_cycle_through_a_tuple(), r"user_state\['t'\]\[0\]\[0\]: refers back",
                 id="cycle-tuple"),
    pytest.param(_cycle_at_the_top(), r"user_state\['me'\]: refers back", id="cycle-top"),
    # arrays the archive cannot hold
    pytest.param({"a": [0, np.array(["text"])]}, r"user_state\['a'\]\[1\]: .*dtype <U4",
                 id="str-array"),
    pytest.param({"a": np.array([b"raw"])}, r"user_state\['a'\]: .*dtype \|S3", id="bytes-array"),
    pytest.param({"a": np.array(["2024-01-02"], "datetime64[D]")},
                 r"user_state\['a'\]: .*dtype datetime64\[D\].*astype", id="datetime-array"),
    pytest.param({"a": np.array([5], "timedelta64[s]")},
                 r"user_state\['a'\]: .*dtype timedelta64\[s\]", id="timedelta-array"),
    pytest.param({"a": np.zeros(2, [("x", "i4"), ("y", "f8")])},
                 r"user_state\['a'\]: .*dtype \[\('x', '<i4'\), \('y', '<f8'\)\].*field",
                 id="structured-array"),
    pytest.param({"a": np.zeros(2, [("x", "O")])}, r"user_state\['a'\]: an array of Python objects",
                 id="object-field-array"),
    pytest.param({"a": np.zeros(2, "V2")}, r"user_state\['a'\]: .*dtype \|V2", id="void-array"),
    pytest.param({"a": np.ma.masked_array([1, 2], mask=[0, 1])},
                 r"user_state\['a'\]: a masked array .*mask", id="masked-array"),
    # ints whose decimal digits are past Python's int/str limit (JSON writes them as digits)
    pytest.param({"a": [1, 10 ** 4300]}, r"user_state\['a'\]\[1\]: an int of more than 4300 digits",
                 id="huge-int"),
    pytest.param({"a": (-(10 ** 5000),)}, r"user_state\['a'\]\[0\]: an int of more than 4300",
                 id="huge-negative-int"),
    # torch tensors without NumPy values
    *[pytest.param({"t": [_sparse(layout)]}, r"user_state\['t'\]\[0\]: .*sparse.*to_dense\(\)",
                   id=f"sparse-{layout}") for layout in ("coo", "csr", "csc", "bsr", "bsc")],
    pytest.param({"t": torch.ones(2, device="meta")}, r"user_state\['t'\]: .*meta",
                 id="meta-tensor"),
    pytest.param({"t": _quietly(lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0,
                                                                  torch.qint8))},
                 r"user_state\['t'\]: a quantized .*dequantize\(\)", id="quantized-tensor"),
    pytest.param({"t": _quietly(lambda: torch.nested.nested_tensor([torch.ones(2),
                                                                   torch.ones(3)]))},
                 r"user_state\['t'\]: a nested .*unbind\(\)", id="nested-tensor"),
    pytest.param({"t": _quietly(lambda: torch.ones(2, dtype=torch.complex32))},
                 r"user_state\['t'\]: a torch tensor of dtype torch\.complex32 .*\.to\(",
                 id="complex32-tensor"),
]


@pytest.mark.parametrize("state,message", UNSAVABLE)
def test_unsavable_user_state_is_refused_naming_where(tmp_path, state, message):
    """A value user_state cannot hold is an ArgumentError naming where it is, raised by
    snapshot() itself, and nothing is written."""
    kv = _store("local")
    with pytest.raises(gpukv.ArgumentError, match=message):
        kv.snapshot(tmp_path / "snaps", 1, user_state=state)
    kv.finish_snapshots()
    assert not (tmp_path / "snaps").exists()


@pytest.mark.parametrize("state,message", UNSAVABLE)
def test_a_refused_user_state_changes_nothing(tmp_path, state, message):
    """After a refused snapshot() the earlier snapshots are as they were, no write fails
    later, and the next snapshot takes the step the refused one would have had."""
    kv = _store("local")
    root = tmp_path / "snaps"
    kv.snapshot(root, user_state={"kept": [1, 2]})
    kv.finish_snapshots()
    listing = _folders(root)
    with pytest.raises(gpukv.ArgumentError, match=message):
        kv.snapshot(root, user_state=state, keep=1)
    kv.finish_snapshots()  # nothing was left to fail in the background
    assert _folders(root) == listing
    assert gpukv.latest_snapshot(root).user_state(0) == {"kept": [1, 2]}
    assert Path(kv.snapshot(root)).name.startswith("step-000000002-")
    kv.finish_snapshots()


def _nested(levels: int):
    """A user_state `levels` containers deep, the dict itself counted, cycling through
    lists, tuples and dicts."""
    value: object = "leaf"
    for level in range(levels - 1, 0, -1):
        value = [value] if level % 3 == 1 else (value,) if level % 3 == 2 else {"k": value}
    return {"top": value}


def _where(levels: int) -> str:
    """The path `_nested` gives the container at depth `levels`, as a pattern."""
    parts = ["user_state", "['top']"] + [
        "[0]" if level % 3 in (1, 2) else "['k']" for level in range(1, levels - 1)]
    return "".join(parts).replace("[", r"\[").replace("]", r"\]")


def test_a_state_as_deep_as_the_limit_round_trips(tmp_path):
    """A user_state exactly MAX_DEPTH containers deep is saved and comes back equal."""
    state = _nested(user_state_format.MAX_DEPTH)
    kv = _store("local")
    kv.snapshot(tmp_path, 1, user_state=state)
    kv.finish_snapshots()
    assert _same(gpukv.latest_snapshot(tmp_path).user_state(0), state)


@pytest.mark.parametrize("levels", [1, 5, 900, 5000])
def test_a_state_deeper_than_the_limit_is_refused_naming_where(tmp_path, levels):
    """A user_state deeper than MAX_DEPTH (thousands of levels included) is an
    ArgumentError naming the first container past the limit, never a RecursionError,
    and nothing is written."""
    depth = user_state_format.MAX_DEPTH + levels
    kv = _store("local")
    with pytest.raises(gpukv.ArgumentError,
                       match=f"^{_where(user_state_format.MAX_DEPTH + 1)}: nested deeper than "
                             f"{user_state_format.MAX_DEPTH} "):
        kv.snapshot(tmp_path / "snaps", 1, user_state=_nested(depth))
    kv.finish_snapshots()
    assert not (tmp_path / "snaps").exists()


@settings(max_examples=30, deadline=None)
@given(digits=st.integers(4290, 4310), negative=st.booleans(), tail=st.integers(0, 10 ** 30))
def test_ints_round_trip_up_to_4300_digits_and_are_refused_past(digits, negative, tail):
    """An int of at most 4300 decimal digits round-trips exactly; a longer one is an
    ArgumentError at the call naming where, and nothing is written."""
    value = (10 ** (digits - 1) + tail) * (-1 if negative else 1)
    kv = _store("local")
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "snaps")
        if digits > 4300:
            with pytest.raises(gpukv.ArgumentError, match=r"user_state\['n'\]\[1\]: an int"):
                kv.snapshot(root, 1, user_state={"n": [0, value]})
            kv.finish_snapshots()
            assert not os.path.exists(root)
            return
        kv.snapshot(root, 1, user_state={"n": [0, value]})
        kv.finish_snapshots()
        assert gpukv.latest_snapshot(root).user_state(0)["n"][1] == value


def _numpy_dtypes() -> list:
    """Every dtype NumPy names, byte-swapped ones, ml_dtypes' ones and the odd kinds."""
    found = {np.dtype(t) for t in np.sctypeDict.values()}
    found |= {np.dtype(d) for d in (">i4", ">f8", ">c16", "<U3", "|S3", "M8[D]", "m8[s]",
                                    "V2", "V3", [("a", "<i4"), ("b", "<f8")])}
    if ml_dtypes is not None:
        found |= {np.dtype(t) for t in vars(ml_dtypes).values()
                  if isinstance(t, type) and issubclass(t, np.generic)}
    return sorted(found, key=str)


def _sample(dtype: np.dtype) -> np.ndarray:
    """A 2x3 array of `dtype` of varied bits (true and false for bool)."""
    if dtype.hasobject or dtype.itemsize == 0:
        return np.zeros((2, 3), dtype)
    if dtype.kind == "b":
        return np.array([[True, False, True], [False, False, True]])
    rng = np.random.default_rng(dtype.itemsize)
    return np.frombuffer(rng.bytes(6 * dtype.itemsize), dtype).reshape(2, 3)


def _ml_dtype(dtype: np.dtype) -> bool:
    return (ml_dtypes is not None and dtype.kind == "V"
            and getattr(ml_dtypes, dtype.name, None) is dtype.type)


@pytest.mark.parametrize("dtype", _numpy_dtypes(), ids=str)
def test_every_numpy_dtype_round_trips_or_is_refused_at_the_call(tmp_path, dtype):
    """An array of numbers, bool or an ml_dtypes type comes back with its values to the
    bit (byte-swapped ones in native order); an array of any other dtype is an
    ArgumentError at the call naming where, never a write that fails later."""
    array = _sample(dtype)
    kv = _store("local")
    root = tmp_path / "snaps"
    if not (dtype.kind in "biufc" or _ml_dtype(dtype)):
        with pytest.raises(gpukv.ArgumentError, match=r"^user_state\['a'\]\[1\]: "):
            kv.snapshot(root, 1, user_state={"a": [0, array]})
        kv.finish_snapshots()
        assert not root.exists()
        return
    kv.snapshot(root, 1, user_state={"a": [0, array]})
    kv.finish_snapshots()
    back = gpukv.latest_snapshot(root).user_state(0)["a"][1]
    native = dtype if dtype.isnative else dtype.newbyteorder("=")
    assert type(back) is np.ndarray and back.dtype == native and back.shape == array.shape
    assert back.tobytes() == array.astype(native).tobytes()


def _torch_dtypes() -> list:
    return sorted({getattr(torch, n) for n in dir(torch)
                   if isinstance(getattr(torch, n), torch.dtype)}, key=str)


#: torch dtypes without a NumPy twin that are saved through ml_dtypes' one
THROUGH_ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                     "float8_e5m2fnuz", "float8_e8m0fnu"}


def _tensor(dtype):
    """A 2x3 tensor of `dtype` of varied bits, or None where torch cannot make one."""
    try:
        if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
            return torch.quantize_per_tensor(torch.arange(6.0).reshape(2, 3), 0.5, 1, dtype)
        if dtype == torch.bool:
            return torch.tensor([[True, False, True], [False, False, True]])
        raw = np.random.default_rng(7).integers(0, 256, 6 * dtype.itemsize, np.uint8)
        return torch.from_numpy(raw).view(dtype).reshape(2, 3)
    except (RuntimeError, TypeError):
        try:
            return torch.zeros(2, 3, dtype=dtype)
        except (RuntimeError, TypeError):
            return None


@pytest.mark.parametrize("dtype", _torch_dtypes(), ids=str)
def test_every_torch_dtype_round_trips_or_is_refused_at_the_call(tmp_path, dtype):
    """A tensor of a dtype with a NumPy or ml_dtypes twin comes back as a CPU tensor of
    that dtype with its values to the bit (nan payloads included); any other dtype is an
    ArgumentError at the call naming where and what to do, never a TypeError or a write
    that fails later."""
    tensor = _quietly(lambda: _tensor(dtype))
    if tensor is None:
        pytest.skip(f"torch makes no tensor of {dtype}")
    name = str(dtype).removeprefix("torch.")
    try:
        tensor.numpy()
        savable = True
    except (TypeError, RuntimeError):
        savable = ml_dtypes is not None and name in THROUGH_ML_DTYPES
    kv = _store("local")
    root = tmp_path / "snaps"
    if not savable:
        with pytest.raises(gpukv.ArgumentError,
                           match=rf"^user_state\['t'\]\[0\]: a .*tensor .*{dtype}"):
            kv.snapshot(root, 1, user_state={"t": (tensor,)})
        kv.finish_snapshots()
        assert not root.exists()
        return
    kv.snapshot(root, 1, user_state={"t": (tensor,)})
    kv.finish_snapshots()
    back = gpukv.latest_snapshot(root).user_state(0)["t"][0]
    assert type(back) is torch.Tensor and back.device.type == "cpu"
    assert back.dtype == dtype and back.shape == tensor.shape and _bits(back) == _bits(tensor)


def test_tensors_with_a_conjugate_or_negative_bit_are_saved_as_their_values(tmp_path):
    """A lazily conjugated or negated tensor (torch's conj/neg bits) is saved as the
    values it stands for."""
    z = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": z.conj().imag}
    kv = _store("local")
    kv.snapshot(tmp_path, 1, user_state=state)
    kv.finish_snapshots()
    back = gpukv.latest_snapshot(tmp_path).user_state(0)
    assert torch.equal(back["conj"], z.conj().resolve_conj())
    assert torch.equal(back["neg"], z.conj().imag.resolve_neg())
    assert back["conj"].dtype == torch.complex64 and back["neg"].dtype == torch.float32


#: bfloat16 tensors among the leaves: saved through ml_dtypes, so only with it
_BF16_LEAVES = [] if ml_dtypes is None else [st.lists(st.floats(width=32), max_size=4).map(
    lambda v: torch.tensor(v, dtype=torch.float32).to(torch.bfloat16))]
_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
    st.builds(lambda digits, negative, tail: (10 ** (digits - 1) + tail) * (-1) ** negative,
              st.integers(20, 4300), st.booleans(), st.integers(0, 10 ** 18)),
    st.sampled_from([np.float16, np.float32, np.float64, np.longdouble, np.complex128,
                     np.int8, np.uint64, np.bool_]).flatmap(
        lambda t: st.lists(st.integers(0, 100), max_size=4).map(lambda v: np.array(v, t))),
    *_BF16_LEAVES)
_STATES = st.dictionaries(st.text(max_size=4).filter(lambda k: not k.startswith("__gpukv")),
                          st.recursive(_LEAVES, lambda inner: st.one_of(
                              st.lists(inner, max_size=3),
                              st.lists(inner, max_size=3).map(tuple),
                              st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                              max_leaves=12),
                          max_size=4)


@settings(max_examples=40, deadline=None)
@given(state=_STATES)
def test_any_savable_state_round_trips(state):
    """Random nestings of the savable kinds (big ints, nan, long doubles, bfloat16
    tensors among them) come back with the same types and bits."""
    kv = _store("local")
    with tempfile.TemporaryDirectory() as tmp:
        kv.snapshot(tmp, 1, user_state=state)
        kv.finish_snapshots()
        assert _same(gpukv.latest_snapshot(tmp).user_state(0), state)


def test_loading_a_plain_folder_keeps_its_error(tmp_path):
    """kv.load of a folder that is not a snapshot's raises the CheckpointError a
    one-file checkpoint's reader gives for a folder."""
    kv = _store("local")
    with pytest.raises(gpukv.CheckpointError) as expected:
        checkpoint.read_store(tmp_path)
    with pytest.raises(gpukv.CheckpointError) as got:
        kv.load(tmp_path)
    assert str(got.value) == str(expected.value)


def test_prune_keeps_a_snapshot_another_process_completes_meanwhile(tmp_path, monkeypatch):
    """A newer snapshot that another process completes while prune runs (it was
    incomplete when prune looked first) is the newest one then, and prune keeps it."""
    kv = _store("local")
    kv.snapshot(tmp_path, 3, keep=5)
    kv.finish_snapshots()
    newer = kv.snapshot(tmp_path, 4, keep=5)
    kv.finish_snapshots()
    worker = os.path.join(newer, snapshots.worker_file(0, 1))
    os.rename(worker, tmp_path / "aside.npz")
    completeness = snapshots._completeness

    def completed_after_a_look(folder):
        found = completeness(folder)
        if folder == newer and found is None:  # the other process's last file lands
            os.rename(tmp_path / "aside.npz", worker)
        return found
    monkeypatch.setattr(snapshots, "_completeness", completed_after_a_look)
    snapshots.prune(str(tmp_path), 1)
    monkeypatch.undo()
    assert [s.path for s in snapshots.complete_snapshots(tmp_path)][-1] == newer

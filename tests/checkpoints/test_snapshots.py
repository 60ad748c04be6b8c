"""Numbered snapshots of one-process stores (`kv.snapshot`, `kv.resume`,
`gpukv.latest_snapshot`): they resume bit for bit, only complete ones are found, the
newest are kept, a failed write is raised later and spoils nothing, and `user_state`
round-trips exactly or is refused naming where."""
from __future__ import annotations

import math
import os
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv import optim
from gpukv.checkpoints import checkpoint, snapshots
from gpukv.checkpoints.checkpoint import read_archive

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


def test_a_snapshot_without_a_step_takes_the_next_one(tmp_path):
    """snapshot(root) numbers its snapshots 1, 2, ... on from the last one the store took
    (an explicit step included), and a store that resumed goes on from the step it
    resumed from."""
    kv = _store("local")
    assert Path(kv.snapshot(tmp_path)).name.startswith("step-000000001-")
    assert Path(kv.snapshot(tmp_path, 7)).name.startswith("step-000000007-")
    assert Path(kv.snapshot(tmp_path)).name.startswith("step-000000008-")
    kv.finish_snapshots()
    again = _store("local", seed=3)
    assert again.resume(tmp_path).step == 8
    assert Path(again.snapshot(tmp_path)).name.startswith("step-000000009-")
    again.finish_snapshots()


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
    stale = tmp_path / snapshots.folder_name(2, "0badc0de")
    shutil.copytree(first, stale)
    _drop_worker(stale)
    pending = tmp_path / snapshots.folder_name(9, "0badc0de")
    shutil.copytree(first, pending)
    _drop_shard(pending)
    kept = [kv.snapshot(tmp_path, step, keep=2) for step in (3, 4)]
    kv.finish_snapshots()
    assert _folders(tmp_path) == sorted(os.path.basename(p) for p in [*kept, pending])
    assert gpukv.latest_snapshot(tmp_path).step == 4


def test_a_mutation_after_snapshot_returns_is_not_written(tmp_path, monkeypatch):
    """What snapshot() saves is the state when it returned: pushes (values and optimizer
    state) and changes to user_state's arrays made while the file is being written are
    not in it."""
    release = threading.Event()
    write = snapshots.write_archive

    def held_write(*args, **kwargs):
        assert release.wait(30), "the test never let the write go"
        write(*args, **kwargs)
    monkeypatch.setattr(snapshots, "write_archive", held_write)
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
    """A file where the folder of `step` will go (the same tag as `folder`)."""
    tag = os.path.basename(folder).rsplit("-", 1)[1]
    with open(os.path.join(root, snapshots.folder_name(step, tag)), "w") as f:
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
    ({"step": True}, gpukv.ArgumentError, "step=True"),
    ({"step": 1.0}, gpukv.ArgumentError, "step=1.0"),
    ({"step": "3"}, gpukv.ArgumentError, "step='3'"),
    ({"keep": 0}, gpukv.ArgumentError, "keep=0"),
    ({"keep": True}, gpukv.ArgumentError, "keep=True"),
    ({"root": "a-file"}, gpukv.CheckpointError, "is a file"),
    ({"root": None}, gpukv.CheckpointError, "checkpoint path None"),
    ({"user_state": [1]}, gpukv.ArgumentError, "user_state: expected a dict"),
    ({"user_state": {"seen": {1}}}, gpukv.ArgumentError, r"user_state\['seen'\]"),
]


@pytest.mark.parametrize("change,error,message", BAD_ARGUMENTS,
                         ids=[repr(c) for c, _, _ in BAD_ARGUMENTS])
def test_bad_arguments_change_nothing(tmp_path, change, error, message):
    """snapshot() with a bad step, keep, root or user_state raises a typed error naming
    it and writes nothing, and the earlier snapshots stay as they were."""
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
    with pytest.raises(error, match=message):
        kv.snapshot(args["root"], args["step"], user_state=args["user_state"],
                    keep=args["keep"])
    kv.finish_snapshots()
    assert _folders(root) == listing
    assert (tmp_path / "a-file").read_text() == "not a folder"


def _same(a, b) -> bool:
    """Equal values of the same types all the way down; arrays to the bit, dtype and
    shape included; nan equals nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        a, b = a.numpy(), b.numpy()
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b) and (
            a == b or math.isnan(a) and math.isnan(b))
    return a == b


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
               "tiny": 5e-324, "in_a_tuple": (math.nan, 1.25)},
}


@pytest.mark.parametrize("state", list(USER_STATES.values()), ids=list(USER_STATES))
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


UNSAVABLE = [
    ({"seen": {1, 2}}, r"user_state\['seen'\]: a set cannot be saved"),
    ({"a": [0, {1: "one"}]}, r"user_state\['a'\]\[1\]: key 1 is a int"),
    ({"a": (np.array([object()]),)}, r"user_state\['a'\]\[0\]: an array of Python objects"),
    ({"a": {"__gpukv_tuple__": 1}}, r"user_state\['a'\]: key '__gpukv_tuple__' is reserved"),
    ({"c": 1j}, r"user_state\['c'\]: a complex cannot be saved"),
    ({"c": np.complex64(1j)}, r"user_state\['c'\]: a complex cannot be saved"),
]


@pytest.mark.parametrize("state,message", UNSAVABLE, ids=[m.split(":")[0] for _, m in UNSAVABLE])
def test_unsavable_user_state_is_refused_naming_where(tmp_path, state, message):
    """A value user_state cannot hold is an ArgumentError naming where it is, raised by
    snapshot() itself, and nothing is written."""
    kv = _store("local")
    with pytest.raises(gpukv.ArgumentError, match=message):
        kv.snapshot(tmp_path / "snaps", 1, user_state=state)
    kv.finish_snapshots()
    assert not (tmp_path / "snaps").exists()


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

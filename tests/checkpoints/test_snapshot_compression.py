"""Snapshots of one-process stores keep every piece of compression state (the residuals
of each source, the served values and residuals of compressed pulls, PowerSGD's warm
starts): a store that resumes continues with the bits of the job that never stopped;
a snapshot that does not fit starts them afresh and says why; old snapshots still load,
and a damaged compression section is refused before anything loads."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukv
from gpukv import optim
from gpukv.checkpoints import snapshots
from gpukv.checkpoints.checkpoint import read_archive, write_archive

from .held_writes import hold_snapshot_writes

#: key -> shape: a matrix PowerSGD compresses, a vector every compressor sends
SHAPES = {"w": (16, 40), "b": (70,)}
SOURCES = 2
STEPS = 5
COMPRESSIONS = [{"type": "sign"}, {"type": "ternary"}, {"type": "2bit", "threshold": 0.5},
                {"type": "1bit", "threshold": 0.0}, {"type": "powersgd", "rank": 2}]
NOT_RESTORED = "compression residuals of the snapshot not restored"


def _sgd(key, merged, stored):
    stored -= np.float32(0.05) * merged


UPDATERS = {"assign": None, "updater": lambda kv: kv.set_updater(_sgd),
            "optimizer": lambda kv: kv.set_optimizer(optim.SGD(learning_rate=0.05,
                                                               momentum=0.9))}


def _store(compression, updater="assign", gpus=None):
    """A 'device' store of SHAPES (on host arrays, or on the Devices `gpus`) made the
    usual way: init, the updater, then the compression."""
    kv = gpukv.create("device")
    rng = np.random.default_rng(7)
    for key, shape in SHAPES.items():
        kv.init(key, _on(rng.standard_normal(shape).astype(np.float32), gpus, 0))
    if UPDATERS[updater] is not None:
        UPDATERS[updater](kv)
    kv.set_gradient_compression(compression)
    return kv


def _on(array, gpus, j):
    if gpus is None:
        return array
    import cupy
    with gpus[j % len(gpus)].cuda_device:
        return cupy.asarray(array)


def _steps(kv, start, stop, gpus=None) -> list:
    """Push SOURCES gradients of every key at each step in [start, stop) (the same for a
    step wherever it runs), pull after each; the bytes pulled and stored."""
    seen = []
    for step in range(start, stop):
        rng = np.random.default_rng(100 + step)
        grads = [[_on(rng.standard_normal(s).astype(np.float32) * 0.3, gpus, j)
                  for j in range(SOURCES)] for s in SHAPES.values()]
        kv.push(list(SHAPES), grads)
        outs = [np.empty(s, np.float32) for s in SHAPES.values()]
        kv.pull(list(SHAPES), out=outs)
        stored = [np.asarray(_host(kv.entries()[k].stored)) for k in SHAPES]
        seen.append([o.tobytes() for o in outs] + [v.tobytes() for v in stored])
    return seen


def _host(array):
    return array if isinstance(array, np.ndarray) else array.get()


def _uninterrupted_and_snapshot(root, compression, updater, k, monkeypatch, gpus=None):
    """Steps 0..STEPS of one store, with a snapshot at step k whose write is held until
    the store has pushed on to the end (so what it writes is what was staged)."""
    write = snapshots.write_archive
    release = hold_snapshot_writes(monkeypatch)
    kv = _store(compression, updater, gpus)
    _steps(kv, 0, k, gpus)
    kv.snapshot(root, k)
    rest = _steps(kv, k, STEPS, gpus)
    release.set()
    kv.finish_snapshots()
    monkeypatch.setattr(snapshots, "write_archive", write)
    return rest


@pytest.mark.parametrize("updater", list(UPDATERS))
@pytest.mark.parametrize("compression", COMPRESSIONS, ids=lambda c: c["type"])
@settings(max_examples=3, deadline=None)
@given(k=st.integers(1, STEPS - 1))
def test_a_resumed_store_continues_with_the_same_bits(tmp_path_factory, compression,
                                                      updater, k):
    """Snapshot at step k, a new store resumes and pushes on: every pull and every stored
    value is the uninterrupted store's, bit for bit, whatever the compressor, with or
    without an updater or optimizer on the store; pushes after the snapshot do not
    change what it holds."""
    root = tmp_path_factory.mktemp("snaps")
    with pytest.MonkeyPatch.context() as monkeypatch:
        want = _uninterrupted_and_snapshot(root, compression, updater, k, monkeypatch)
    kv = _store(compression, updater)
    assert kv.resume(root).step == k
    assert _steps(kv, k, STEPS) == want


def test_the_same_run_without_the_residuals_differs(tmp_path, monkeypatch):
    """What the test above checks is there to lose: compression set again after the
    resume starts every residual afresh, and the pulls then differ."""
    compression = {"type": "sign"}
    want = _uninterrupted_and_snapshot(tmp_path, compression, "updater", 2, monkeypatch)
    kv = _store(compression, "updater")
    kv.resume(tmp_path)
    kv.set_gradient_compression(compression)
    got = _steps(kv, 2, STEPS)
    assert got[0][0] != want[0][0]


def _fresh(root, compression, updater, k):
    """The steps after k of a store that resumed, then started its compression afresh."""
    kv = _store(compression, updater)
    kv.resume(root)
    kv.set_gradient_compression(compression)
    return _steps(kv, k, STEPS)


@pytest.mark.parametrize("saved,resumed,updater,why", [
    ({"type": "sign"}, {"type": "2bit", "threshold": 0.5}, "updater",
     "saved with {'type': 'sign'}, resuming with {'type': '2bit', 'threshold': 0.5}"),
    ({"type": "2bit", "threshold": 0.5}, {"type": "2bit", "threshold": 0.25}, "assign",
     "saved with {'type': '2bit', 'threshold': 0.5}, resuming with {'type': '2bit', "
     "'threshold': 0.25}"),
    (None, {"type": "sign"}, "updater", "saved with None, resuming with {'type': 'sign'}"),
    ({"type": "sign"}, None, "updater", "saved with {'type': 'sign'}, resuming with None"),
], ids=["other-type", "other-threshold", "none-saved", "none-resumed"])
def test_another_compression_starts_afresh_and_says_why(tmp_path, monkeypatch, caplog,
                                                        saved, resumed, updater, why):
    """A store resuming with other compression params than the snapshot's starts every
    residual afresh (as setting the compression does) and logs one INFO line saying
    what was saved and what it resumes with."""
    _uninterrupted_and_snapshot(tmp_path, saved, updater, 2, monkeypatch)
    kv = _store(resumed, updater)
    with caplog.at_level(logging.INFO, logger="gpukv"):
        kv.resume(tmp_path)
    said = [r.getMessage() for r in caplog.records if NOT_RESTORED in r.getMessage()]
    assert said == [f"gpukv: {NOT_RESTORED}: {why}"]
    if resumed is not None:
        assert _steps(kv, 2, STEPS) == _fresh(tmp_path, resumed, updater, 2)


def _rewrite_shard(root, change):
    """Rewrite the snapshot's one shard with `change(header, arrays)` applied."""
    found = gpukv.latest_snapshot(root)
    path = os.path.join(found.path, snapshots.shard_file(0, 1))
    header, arrays = read_archive(path)
    change(header, arrays)
    write_archive(path, header, arrays)


def _without_compression(header, arrays):
    del header["compression"]
    for name in [n for n in arrays if n.startswith("compression/")]:
        del arrays[name]


def _on_a_missing_gpu(header, arrays):
    for record in header["compression"]["records"]:
        if record["what"] == "residual":
            record["device"] = ["gpu", 4096, 0]


def _served_saved(header, arrays):
    assert any(r["what"] == "served" for r in header["compression"]["records"])


@pytest.mark.parametrize("change,updater,why", [
    (_without_compression, "updater",
     "the snapshot holds none (written before snapshots kept them), resuming with "
     "{'type': 'sign'}"),
    (_on_a_missing_gpu, "updater",
     "it holds a residual of key 'w' on ['gpu', 4096, 0], not in this process"),
    (_served_saved, "assign",
     "it holds the served value of key 'w', kept apart by an updater, and this store "
     "has none"),
], ids=["old-format", "missing-device", "served-without-updater"])
def test_a_snapshot_whose_state_does_not_fit_loads_and_starts_afresh(
        tmp_path, monkeypatch, caplog, change, updater, why):
    """An old-format snapshot (no compression state), or one whose state names a device
    this process lacks, or served values a store without an updater cannot keep apart:
    the values load as ever, the compression starts afresh, and one INFO line says why."""
    compression = {"type": "sign"}
    _uninterrupted_and_snapshot(tmp_path, compression, "updater", 2, monkeypatch)
    _rewrite_shard(tmp_path, change)
    loaded = snapshots.read_store(gpukv.latest_snapshot(tmp_path))  # the values' reader
    kv = _store(compression, updater)
    with caplog.at_level(logging.INFO, logger="gpukv"):
        kv.resume(tmp_path)
    said = [r.getMessage() for r in caplog.records if NOT_RESTORED in r.getMessage()]
    assert said == [f"gpukv: {NOT_RESTORED}: {why}"]
    assert [np.asarray(kv.entries()[k].value).tobytes() for k in SHAPES] == \
        [v.tobytes() for v in loaded.values]
    assert _steps(kv, 2, STEPS) == _fresh(tmp_path, compression, updater, 2)


@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("compression", [{"type": "sign"}, {"type": "2bit"},
                                         {"type": "powersgd", "rank": 2}],
                         ids=lambda c: c["type"])
def test_residuals_on_gpus_resume_bit_for_bit(tmp_path, monkeypatch, compression):
    """Residuals, served values and pull residuals that live on GPUs are staged and
    written like the values, and resume onto the GPUs, bit for bit (PowerSGD's, of GPU
    values, live on the host, where its sums run, and resume there)."""
    from gpukv.device import gpu_devices
    gpus = gpu_devices()[:2]
    want = _uninterrupted_and_snapshot(tmp_path, compression, "updater", 2, monkeypatch,
                                       gpus)
    kv = _store(compression, "updater", gpus)
    kv.resume(tmp_path)
    assert _steps(kv, 2, STEPS, gpus) == want


@pytest.mark.parametrize("change,message", [
    (lambda header, arrays: header["compression"].update(records=[{"what": "other"}]),
     "field 'records'"),
    (lambda header, arrays: arrays.pop("compression/0"), "array 'compression/0' is missing"),
], ids=["bad-record", "missing-array"])
def test_a_damaged_compression_section_is_refused_before_anything_loads(
        tmp_path, monkeypatch, change, message):
    """A shard whose compression section is damaged is a CheckpointError naming the file
    and what is wrong, raised before the store changes."""
    _uninterrupted_and_snapshot(tmp_path, {"type": "sign"}, "updater", 2, monkeypatch)
    _rewrite_shard(tmp_path, change)
    kv = _store({"type": "sign"}, "updater")
    before = [np.asarray(kv.entries()[k].value).tobytes() for k in SHAPES]
    with pytest.raises(gpukv.CheckpointError, match=message) as caught:
        kv.resume(tmp_path)
    assert snapshots.shard_file(0, 1) in str(caught.value)
    assert [np.asarray(kv.entries()[k].value).tobytes() for k in SHAPES] == before

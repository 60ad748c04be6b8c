"""GPUKV_TIMELINE: a Chrome trace per process of the store's calls and their phases, nested
as they ran; nothing when off."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gpukv
from gpukv import timeline


@pytest.fixture
def recording(tmp_path):
    timeline.start(tmp_path)
    yield tmp_path
    timeline.stop()


def _events(path) -> list:
    with open(path) as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _inside(inner: dict, outer: dict) -> bool:
    return (inner["tid"] == outer["tid"] and outer["ts"] <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3)


def test_store_calls_and_their_phases_are_nested_spans(recording):
    kv = gpukv.create("device")
    kv.init("w", np.zeros(1000, np.float32))
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.1))
    kv.push("w", [np.ones(1000, np.float32), np.ones(1000, np.float32)])
    kv.pull("w", out=np.zeros(1000, np.float32))
    path = timeline.stop()
    assert path is not None and os.path.basename(path).startswith("gpukv-timeline-rank0-")
    events = _events(path)
    names = [e["name"] for e in events]
    assert {"init", "push", "pull", "check", "plan", "reduce", "update"} <= set(names)
    push = next(e for e in events if e["name"] == "push")
    for phase in ("plan", "reduce", "update"):
        assert any(_inside(e, push) for e in events if e["name"] == phase), phase
    assert all(e["dur"] >= 0 and e["pid"] == os.getpid() for e in events)


def test_off_records_nothing_and_a_span_is_a_shared_null(tmp_path):
    assert not timeline.enabled()
    assert timeline.span("x") is timeline.span("y")
    assert timeline.stop() is None and timeline.flush() is None
    kv = gpukv.create("local")
    kv.init(1, np.zeros(3))
    kv.push(1, np.ones(3))
    assert os.listdir(tmp_path) == []


def test_the_environment_variable_records_a_process_and_its_trainer(tmp_path):
    """GPUKV_TIMELINE=DIR in a fresh process: at exit, its Chrome trace holds the
    Trainer's steps, each with the store's push inside."""
    pytest.importorskip("torch")
    program = (
        "import torch, gpukv.torch\n"
        "models = [torch.nn.Linear(4, 2) for _ in range(2)]\n"
        "t = gpukv.torch.Trainer(models, 'sgd', {'learning_rate': 0.1}, kvstore='local')\n"
        "for _ in range(3):\n"
        "    t.zero_grad()\n"
        "    for m in models:\n"
        "        m(torch.ones(3, 4)).sum().backward()\n"
        "    t.step()\n")
    env = dict(os.environ, GPUKV_TIMELINE=str(tmp_path))
    subprocess.run([sys.executable, "-c", program], check=True, env=env, timeout=120)
    (path,) = tmp_path.glob("gpukv-timeline-rank0-pid*.json")
    events = _events(path)
    steps = [e for e in events if e["name"] == "Trainer.step"]
    assert [e["args"]["step"] for e in steps] == [0, 1, 2]
    pushes = [e for e in events if e["name"] == "push"]
    assert all(any(_inside(p, s) for p in pushes) for s in steps)


def test_snapshot_writes_are_spans_of_their_own_thread(recording):
    kv = gpukv.create("local")
    kv.init("w", np.zeros(8, np.float32))
    kv.snapshot(recording / "snaps", step=1)
    kv.finish_snapshots()
    events = _events(timeline.stop())
    writes = [e for e in events if e["name"] == "snapshot write"]
    snapshot = next(e for e in events if e["name"] == "snapshot")
    assert writes and all(w["tid"] != snapshot["tid"] for w in writes)
    assert any(w["args"]["file"].startswith("shard") for w in writes), writes


def test_spans_show_in_torch_profiler(recording):
    torch = pytest.importorskip("torch")
    kv = gpukv.create("local")
    kv.init("w", np.zeros(8, np.float32))
    with torch.profiler.profile() as prof:
        kv.push("w", np.ones(8, np.float32))
    names = {e.key for e in prof.key_averages()}
    assert {"gpukv.push", "gpukv.reduce"} <= names, names

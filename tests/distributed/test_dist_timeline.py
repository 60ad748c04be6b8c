"""GPUKV_TIMELINE across processes: one Chrome trace per rank, with the store's calls, the
agreements before them and every wait on the other processes, a server's work, and what
each rank keeps when the job's end kills it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .. import gpu_env
from ..launcher.test_launch import _finish
from .mpirun import PROGRAMS, dies_with_us, ok, require_mpi, run

pytestmark = pytest.mark.mpi


def _trace(path) -> list:
    """The complete events ("ph": "X") of a rank's file (which must be valid JSON)."""
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def _rank_files(folder) -> dict:
    """rank -> its timeline file, one per rank."""
    files = sorted(folder.glob("gpukv-timeline-rank*-pid*.json"))
    ranks = [int(f.name.split("rank")[1].split("-")[0]) for f in files]
    assert len(set(ranks)) == len(ranks), files
    return dict(zip(ranks, files))


def _inside(inner: dict, outer: dict) -> bool:
    return (inner["tid"] == outer["tid"] and outer["ts"] <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3)


@pytest.mark.parametrize("servers", [0, 1])
def test_every_rank_writes_its_timeline(tmp_path, servers):
    """Every rank writes its trace: a worker its calls, their agreements, rounds and waits;
    a server its work on each key's rounds (`serve`, naming the key), the worker-order
    sum and the update inside."""
    pytest.importorskip("torch")
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT="30", STORE="dist_sync",
               GPUKV_TIMELINE=str(tmp_path))
    ok(run("scenarios.py", 2 + servers, "trainer", "sgd", "1", env=env, timeout=120))
    files = _rank_files(tmp_path)
    assert sorted(files) == list(range(2 + servers)), files
    for rank, f in files.items():
        events = _trace(f)
        names = {e["name"] for e in events}
        if rank < servers:  # a server: its shard's rounds
            assert {"serve", "sum", "update"} <= names, (f.name, names)
            serves = [e for e in events if e["name"] == "serve"]
            assert all("key" in e["args"] for e in serves), serves[:3]
            for phase in ("sum", "update"):
                assert all(any(_inside(e, s) for s in serves)
                           for e in events if e["name"] == phase), phase
            continue
        assert {"Trainer.step", "push", "sum here", "round", "agree", "wait"} <= names, (
            f.name, names)
        waits = [e for e in events if e["name"] == "wait"]
        assert all(e["args"]["on"] for e in waits)


def test_a_rank_killed_after_a_stall_keeps_what_it_recorded(tmp_path):
    """Worker 1 makes 5 pushpulls, then stalls; worker 0's next one times out after 8 s and
    aborts the job, and MPICH's mpiexec kills worker 1 (SIGKILL: no handler runs). The
    writer thread wrote its events meanwhile (FLUSH_SECONDS after they were recorded):
    its file holds the 5 pushpulls, not the empty trace of the start."""
    env = {"GPUKV_TIMELINE": str(tmp_path), "GPUKV_DIST_TIMEOUT": "8"}
    result = run("timeline_ends.py", 2, "stall", env=env, timeout=120)
    assert result.returncode != 0 and "PeerError" in result.stderr, result.stderr
    files = _rank_files(tmp_path)
    stalled = [e["name"] for e in _trace(files[1])]
    assert stalled.count("pushpull") == 5, stalled
    aborted = [e["name"] for e in _trace(files[0])]  # (written before its abort)
    assert aborted.count("pushpull") == 6, aborted


def test_sigterm_writes_each_ranks_timeline(tmp_path):
    """SIGTERM to `gpukv run` reaches every rank (mpiexec passes it on); each writes its
    timeline before SIGTERM ends it, though nothing else would have written it (the
    ranks made FLUSH_SECONDS endless)."""
    require_mpi()
    folder, marks = tmp_path / "tl", tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, GPUKV_TIMELINE=str(folder), GPUKV_DIST_TIMEOUT="30")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpukv", "run", "-n", "2",
         str(PROGRAMS / "timeline_ends.py"), "sigterm", str(marks)],
        env=env, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=dies_with_us())
    deadline = time.monotonic() + 90
    while len(list(marks.iterdir())) < 2 and launcher.poll() is None:
        assert time.monotonic() < deadline, "the ranks never began ticking"
        time.sleep(0.05)
    time.sleep(0.3)
    launcher.send_signal(signal.SIGTERM)
    status, _, err, _ = _finish(launcher, 60)
    assert status == 128 + signal.SIGTERM, err
    files = _rank_files(folder)
    assert sorted(files) == [0, 1], files
    for f in files.values():
        names = [e["name"] for e in _trace(f)]
        assert names.count("pushpull") == 3 and names.count("tick") >= 2, (f.name, names)

"""GPUKV_TIMELINE across processes: one Chrome trace per rank, with the store's calls, the
agreements before them and every wait on the other processes."""
from __future__ import annotations

import json

import pytest

from .. import gpu_env
from .mpirun import ok, run

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("servers", [0, 1])
def test_every_rank_writes_its_timeline(tmp_path, servers):
    pytest.importorskip("torch")
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT="30", STORE="dist_sync",
               GPUKV_TIMELINE=str(tmp_path))
    ok(run("scenarios.py", 2 + servers, "trainer", "sgd", "1", env=env, timeout=120))
    files = sorted(tmp_path.glob("gpukv-timeline-rank*-pid*.json"))
    ranks = sorted(int(f.name.split("rank")[1].split("-")[0]) for f in files)
    assert ranks == list(range(2 + servers)), files
    for f in files:
        trace = json.loads(f.read_text())
        names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
        rank = int(f.name.split("rank")[1].split("-")[0])
        if rank < servers:  # a server: its shard's updates
            assert "update" in names, (f.name, names)
            continue
        assert {"Trainer.step", "push", "sum here", "round", "agree", "wait"} <= names, (
            f.name, names)
        waits = [e for e in trace["traceEvents"] if e["name"] == "wait"]
        assert all(e["args"]["on"] for e in waits)

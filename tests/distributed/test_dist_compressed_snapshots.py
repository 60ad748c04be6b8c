"""Compression state in snapshots of dist stores: a store resuming on as many workers
(and servers) with the same compression pulls and stores the bits of the job that never
stopped (every compressor, with and without an updater or optimizer, with the engine's
sums or the deterministic ones, with num_servers=0 or servers); on another number of
workers or with other compression it starts afresh and every worker says why."""
from __future__ import annotations

import json
import re

import pytest

from .. import gpu_env
from .mpirun import ok, run

pytestmark = pytest.mark.mpi

SIGN = {"type": "sign"}
NOT_RESTORED = "gpukv: compression residuals of the snapshot not restored"


def _job(n: int, *args: str, deterministic: bool = False, servers: int = 0) -> str:
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT="30",
               GPUKV_DETERMINISTIC="1" if deterministic else "0")
    out = ok(run("compressed_snapshots.py", n, *args, env=env))
    for w in range(n - servers):
        assert f"PASS worker {w} of {n - servers}" in out, out
    return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["sums", "deterministic"])
def test_a_resumed_dist_store_continues_with_the_same_bits(tmp_path, deterministic):
    """Every worker's residuals, every owner's served values and pull residuals, and
    PowerSGD's warm starts come back: pulls and stored values equal the uninterrupted
    store's, bit for bit, and differ when the residuals start afresh instead."""
    _job(2, "same_bits", str(tmp_path), "2", deterministic=deterministic)


@pytest.mark.parametrize("n,compression,why", [
    (2, SIGN, "saved with {'type': 'sign'} on 3 workers, resuming with {'type': 'sign'} "
              "on 2"),
    (3, {"type": "2bit", "threshold": 0.5},
     "saved with {'type': 'sign'} on 3 workers, resuming with {'type': '2bit', "
     "'threshold': 0.5} on 3"),
], ids=["fewer-workers", "other-compression"])
def test_another_layout_or_compression_starts_afresh_and_says_why(
        tmp_path, n, compression, why):
    """A snapshot saved on 3 workers with 'sign', resumed on 2, or with other params:
    every worker logs one INFO line saying why, and continues as a store that set its
    compression afresh after the resume."""
    _job(3, "save", str(tmp_path), json.dumps(SIGN))
    out = _job(n, "resume", str(tmp_path), json.dumps(compression))
    for w in range(n):
        assert out.count(f"LOG worker {w}: {NOT_RESTORED}: {why}") == 1, out
    assert out.count("LOG worker") == n, out


def _digests(out: str) -> set:
    return set(re.findall(r"DIGEST worker \d+ ([0-9a-f]{64} [0-9a-f]{64})", out))


@pytest.mark.parametrize("compression,updater,deterministic", [
    (SIGN, "optimizer", False), (SIGN, "assign", False),
    ({"type": "2bit", "threshold": 0.5}, "updater", False), (SIGN, "optimizer", True),
    ({"type": "powersgd", "rank": 2}, "optimizer", False),
    ({"type": "powersgd", "rank": 2}, "assign", False),
    ({"type": "powersgd", "rank": 2}, "optimizer", True),
], ids=["sign-optimizer", "sign-assign", "2bit-updater", "sign-optimizer-deterministic",
        "powersgd-optimizer", "powersgd-assign", "powersgd-optimizer-deterministic"])
def test_with_servers_a_resumed_job_continues_with_the_same_bits(
        tmp_path, compression, updater, deterministic):
    """With 2 workers and 2 servers: a job resumed from another's snapshot gets back the
    workers' residuals (and PowerSGD's warm starts) and the servers' served values and
    pull residuals: its pulls and stored values are the bits of the job that never
    stopped."""
    args = (str(tmp_path), json.dumps(compression), updater)
    through = _digests(_job(4, "one_store", *args, "through", servers=2,
                            deterministic=deterministic))
    resumed = _digests(_job(4, "one_store", *args, "resumed", servers=2,
                            deterministic=deterministic))
    assert len(through) == 1 and resumed == through


@pytest.mark.parametrize("compression", [SIGN, {"type": "powersgd", "rank": 2}],
                         ids=["sign", "powersgd"])
def test_with_servers_the_residuals_make_the_difference(tmp_path, compression):
    """What the test above checks is there to lose: a job that sets its compression
    again after the resume (every residual afresh) pulls other bits."""
    args = (str(tmp_path), json.dumps(compression), "optimizer")
    through = _digests(_job(4, "one_store", *args, "through", servers=2))
    fresh = _digests(_job(4, "one_store", *args, "fresh", servers=2))
    assert len(fresh) == 1 and fresh != through


def test_a_snapshot_without_servers_resumed_with_them_says_why(tmp_path):
    """A snapshot of 2 workers serving their own shards, resumed by 2 workers and 1
    server: every worker says so, and the job continues afresh."""
    _job(2, "save", str(tmp_path), json.dumps(SIGN))
    out = _job(3, "resume_once", str(tmp_path), json.dumps(SIGN), servers=1)
    why = ("saved with {'type': 'sign'} on 2 workers and 2 shards, resuming with "
           "{'type': 'sign'} on 2 workers and 1 shards")
    for w in range(2):
        assert out.count(f"LOG worker {w}: {NOT_RESTORED}: {why}") == 1, out


def test_compression_set_again_starts_the_servers_pull_residuals_afresh_too():
    """'sign' set again mid-run starts every residual afresh, on workers and servers
    alike: the pulls of 2 workers with a server are those without one, before and after
    the second set, with and without SGD on the store (a server kept its pull residuals
    when the compression set was the one it already served)."""
    pulls = {}
    for servers in (0, 1):
        out = ok(run("compression_again.py", 2 + servers,
                     env={"GPUKV_NUM_SERVERS": str(servers)}, timeout=120))
        pulls[servers] = re.findall(r"PULL (w\d \d) ([0-9a-f]+)", out)
        assert len(pulls[servers]) == 12, out
    assert pulls[1] == pulls[0]

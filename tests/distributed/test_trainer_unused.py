"""The Trainer with overlap=True on a dist store, where one worker's forward pass leaves a
parameter out (DDP's `find_unused_parameters`): a bucket that never starts its early
reduction there, while it does on the others
(tests/distributed/programs/trainer_unused.py under `mpiexec`)."""
from __future__ import annotations

import re

import pytest

from .. import gpu_env
from .mpirun import ok, run

pytestmark = pytest.mark.mpi

TIMEOUT = 6


def _job(n: int, servers: int, *args: str):
    pytest.importorskip("torch")
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT=str(TIMEOUT))
    return run("trainer_unused.py", n, *args, env=env, timeout=120)


def _weights(n: int, servers: int, on_store: str, bucket_bytes: str, overlap: str) -> str:
    out = ok(_job(n, servers, "unused", on_store, bucket_bytes, overlap))
    for w in range(n - servers):
        assert f"PASS worker {w} of {n - servers}" in out, out
    found = re.findall(r"WEIGHTS ([0-9a-f]{12})", out)
    assert len(found) == 1, out
    return found[0]


# bucket_bytes -1: the default buckets (every parameter in one key); 200: one key for c,
# one for b, two for a; 0: a key each. Processes with and without servers, where the
# update runs, and the bucket sizes, in 4 layouts (6 jobs: with the update on the store
# the overlap pushes nothing early, so its bits are held to plain torch's alone).
@pytest.mark.parametrize("n,servers,on_store,bucket_bytes", [
    (2, 0, "0", "-1"), (3, 0, "1", "0"), (3, 1, "0", "200"), (3, 1, "1", "0")])
def test_a_parameter_one_worker_leaves_out_trains_as_without_the_overlap(
        n, servers, on_store, bucket_bytes):
    """Worker 1 skips layer b in some steps (with both replicas, or one) and uses it in
    the others, ignore_stale_grad: every worker ends with plain torch's weights, and,
    where the overlap reduces early, with the bits of overlap=False."""
    overlapped = _weights(n, servers, on_store, bucket_bytes, "on")
    if on_store == "0":
        assert overlapped == _weights(n, servers, on_store, bucket_bytes, "off")


def _caught(out: str, error: str) -> list:
    """(seconds, message) of each `CAUGHT error` line (lines may run into each other)."""
    return [(float(s), m) for s, m in re.findall(
        rf"CAUGHT {error} on worker \d+ after ([\d.]+) s: (.*?)(?=CAUGHT|gpukv: rank|$)",
        out, re.M | re.S)]


@pytest.mark.parametrize("n,servers,on_store,bucket_bytes", [
    (2, 0, "0", "-1"), (3, 1, "1", "0")])
def test_without_ignore_stale_grad_the_others_do_not_wait_for_the_worker_that_refuses(
        n, servers, on_store, bucket_bytes):
    """Worker 1 leaves b out and steps without ignore_stale_grad: its own ArgumentError
    naming b; every other worker (inside its early reductions' pushes or the step's) a
    PeerMismatchError naming the refusal at once with num_servers=0, and with a server
    a PeerError naming worker 1 once its program has ended (or the timeout passed)."""
    result = _job(n, servers, "refused", on_store, bucket_bytes)
    out = result.stdout + result.stderr
    mine = _caught(result.stdout, "ArgumentError")
    assert len(mine) == 1 and "'b.weight', 'b.bias'" in mine[0][1], out
    assert "stale gradient" in mine[0][1] and mine[0][0] < 1, out
    if servers == 0:
        others = _caught(result.stdout, "PeerMismatchError")
        assert len(others) == n - 1, out
        for seconds, message in others:
            assert "calls Trainer.step refused (ArgumentError)" in message, message
            assert seconds < TIMEOUT / 2, out
    else:
        others = _caught(result.stdout, "PeerError")
        assert len(others) == n - servers - 1, out
        for seconds, message in others:
            assert re.search(r"(rank|worker)\(s\) [12] ended", message), message
            assert seconds < TIMEOUT + 4, out

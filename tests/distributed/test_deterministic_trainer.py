"""The Trainer on deterministic stores: 50 Adam steps end with the same weights, bit for
bit, on 1 process x 4 replicas, on 2 x 2 (without and with a server), and whatever the
bucket size; with PowerSGD too."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .. import gpu_env
from .mpirun import PROGRAMS, ok, run

pytestmark = pytest.mark.mpi


def _weights(out: str) -> str:
    found = re.findall(r"DIGEST weights ([0-9a-f]{12})", out)
    assert len(found) == 1, out
    return found[0]


def _one_process(bucket_bytes: int, on_store: str = "1", **env: str) -> str:
    pytest.importorskip("torch")
    full = gpu_env.subprocess_env(gpus=False)
    full.update(env)
    result = subprocess.run(
        [sys.executable, str(PROGRAMS / "adam_digest.py"), "4", str(bucket_bytes), "device",
         on_store], capture_output=True, text=True, timeout=300, env=full)
    assert result.returncode == 0, result.stderr
    return _weights(result.stdout)


@pytest.fixture(scope="module")
def reference() -> str:
    """1 x 4 with one key per parameter."""
    return _one_process(0)


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_bucket_sizes_give_the_same_weights(reference, bucket_bytes):
    """Fused keys of 4 KB or 1 MiB (every parameter in one): the bits of a key each."""
    assert _one_process(bucket_bytes) == reference


def test_the_optimizer_on_each_replica_gives_the_same_weights(reference):
    """update_on_kvstore=False (Adam on each replica, on the summed gradients)."""
    assert _one_process(4096, "0") == reference


@pytest.mark.parametrize("servers", [0, 1])
def test_two_processes_of_two_replicas_give_one_process_weights(reference, servers):
    """2 x 2, every worker serving or one server: 1 x 4's weights."""
    pytest.importorskip("torch")
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers))
    out = ok(run("adam_digest.py", 2 + servers, "2", "4096", "dist_sync", env=env,
                 timeout=300))
    assert _weights(out) == reference, out


def test_without_it_one_and_two_processes_differ():
    """In the stores' default order, 1 x 4 and 2 x 2 end with other weights (so the tests
    above can fail)."""
    pytest.importorskip("torch")
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="0", DIGEST_DEFAULT="1")
    out = ok(run("adam_digest.py", 2, "2", "4096", "dist_sync", env=env, timeout=300))
    assert _weights(out) != _one_process(4096, DIGEST_DEFAULT="1"), out


@pytest.mark.parametrize("servers", [0, 1])
def test_powersgd_gives_one_process_weights_on_two_processes(reference, servers):
    """With PowerSGD (rank 2) compressing every weight matrix, 2 x 2 ends with 1 x 4's
    weights, which differ from uncompressed training's."""
    pytest.importorskip("torch")
    alone = _one_process(0, DIGEST_POWERSGD="1")
    assert alone != reference
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), DIGEST_POWERSGD="1")
    out = ok(run("adam_digest.py", 2 + servers, "2", "0", "dist_sync", env=env,
                 timeout=300))
    assert _weights(out) == alone, out

"""deterministic=True across emulated hosts: the eight gradients of the digest program,
one process per host, every byte over a shaped link, give one process's bits, also
compressed (fp16, 2-bit, sign, ternary and PowerSGD, with and without SGD)."""
from __future__ import annotations

import pytest

from ..distributed import digests
from .hosts import cluster, finish, host_list, job_env, passes, program_command, start

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

# (hosts, processes, dedicated servers): one process per host
LAYOUTS = [(2, 2, 0), (4, 4, 0), (3, 3, 1)]


@pytest.fixture(scope="module")
def hosts():
    """Four hosts on 1 Gb/s links, shared by this module's tests."""
    with cluster(4, "1gbit") as made:
        yield made


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The digests of the one-process 'local' store given all 8 leaves."""
    return digests.one_process()


@pytest.fixture(scope="module")
def one_process_compressed() -> dict:
    """The same with the digest program's compressed phases (a 'device' store)."""
    return digests.one_process("device", DIGEST_COMPRESS="1")


def _digests_on_hosts(hosts, used: int, n: int, servers: int, **env: str) -> dict:
    """The digests of one job of n processes, one per host, with `servers` servers."""
    workers = n - servers
    env = job_env(hosts, GPUKV_NUM_SERVERS=str(servers), STORE="dist_sync", **env)
    job = start(hosts, n, host_list(hosts, list(range(used)), slots=1),
                program_command("digest.py", str(8 // workers)), env)
    return digests.digests(passes(*finish(job, 180)[:3], workers=workers))


@pytest.mark.parametrize("used,n,servers", LAYOUTS)
def test_hosts_give_one_process_bits(hosts, one_process, used, n, servers):
    """Each worker on its own host pushes 8 / workers of the gradients: the sum and the
    SGD rounds have the bits one process gets with all eight."""
    assert _digests_on_hosts(hosts, used, n, servers) == one_process


@pytest.mark.parametrize("used,n,servers", [(4, 4, 0), (3, 3, 1)])
def test_compressed_rounds_on_hosts_give_one_process_bits(hosts, one_process_compressed,
                                                          used, n, servers):
    """Compressed, every phase (PowerSGD's sums in the canonical tree included) has the
    bits one process gets with all eight gradients."""
    found = _digests_on_hosts(hosts, used, n, servers, DIGEST_COMPRESS="1")
    assert len(one_process_compressed) == 10 and found == one_process_compressed

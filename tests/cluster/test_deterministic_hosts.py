"""deterministic=True across emulated hosts: the eight gradients of the digest program,
one process per host, every byte over a shaped link, give one process's bits."""
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


@pytest.mark.parametrize("used,n,servers", LAYOUTS)
def test_hosts_give_one_process_bits(hosts, one_process, used, n, servers):
    """Each worker on its own host pushes 8 / workers of the gradients: the sum and the
    SGD rounds have the bits one process gets with all eight."""
    workers = n - servers
    env = job_env(hosts, GPUKV_NUM_SERVERS=str(servers), STORE="dist_sync")
    job = start(hosts, n, host_list(hosts, list(range(used)), slots=1),
                program_command("digest.py", str(8 // workers)), env)
    out = passes(*finish(job, 180)[:3], workers=workers)
    assert digests.digests(out) == one_process, out

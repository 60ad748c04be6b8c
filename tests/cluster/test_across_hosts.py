"""The dist stores across emulated hosts, every byte over a shaped link: each dist type and
placement gives what one process gives (the scenarios' own checks), and the Trainer gives
DDP's weights."""
from __future__ import annotations

import pytest

from .hosts import cluster, finish, host_list, job_env, passes, program_command, start

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

# name -> (hosts, processes, dedicated servers, ranks placed one per host in turn)
PLACEMENTS = {
    "2 hosts, every worker serves": (2, 2, 0),
    "4 hosts, every worker serves": (4, 4, 0),
    "2 hosts, one server per host": (2, 4, 2),
    "3 hosts, a server host": (3, 3, 1),
}


@pytest.fixture(scope="module")
def hosts():
    """Four hosts on 10 Gb/s links, shared by this module's tests."""
    with cluster(4, "10gbit") as made:
        yield made


def _run(made, placement: str, *args: str, store: str = "dist_sync",
         program: str = "scenarios.py") -> str:
    used, n, servers = PLACEMENTS[placement]
    env = job_env(made, GPUKV_NUM_SERVERS=str(servers), STORE=store)
    job = start(made, n, host_list(made, list(range(used)), slots=1),
                program_command(program, *args), env)
    return passes(*finish(job, 120)[:3], workers=n - servers)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("scenario", [["sync_sgd"], ["sync_sgd", "float16"], ["calls"],
                                      ["compression", "2bit"]])
def test_dist_sync_across_hosts(hosts, placement, scenario):
    """MXNet's dist_sync expectations, every call, and compression, on every placement."""
    _run(hosts, placement, *scenario)


@pytest.mark.parametrize("placement", ["2 hosts, one server per host",
                                       "3 hosts, a server host"])
def test_dist_async_across_hosts(hosts, placement):
    """dist_async: every push applied, whatever order the servers saw them in."""
    _run(hosts, placement, "async_sgd", store="dist_async")


@pytest.mark.parametrize("placement", ["2 hosts, every worker serves",
                                       "2 hosts, one server per host"])
def test_the_trainer_across_hosts_gives_ddps_weights(hosts, placement):
    """gpukv.torch.Trainer on a dist store across two hosts against DDP over gloo."""
    pytest.importorskip("torch")
    _run(hosts, placement, "4", program="trainer_ddp.py")

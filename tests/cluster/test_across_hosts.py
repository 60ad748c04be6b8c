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


_TWO_ALL, _FOUR_ALL, _TWO_SERVERS, _SERVER_HOST = PLACEMENTS
# MXNet's dist_sync on every placement; the other scenarios (each also run on one
# machine's processes) on one placement with servers and one without.
_SYNC_CASES = [*((["sync_sgd"], p) for p in PLACEMENTS),
               (["sync_sgd", "float16"], _FOUR_ALL), (["sync_sgd", "float16"], _TWO_SERVERS),
               (["calls"], _TWO_ALL), (["calls"], _SERVER_HOST),
               (["compression", "2bit"], _FOUR_ALL), (["compression", "2bit"], _TWO_SERVERS)]


@pytest.mark.parametrize("scenario,placement", _SYNC_CASES,
                         ids=[f"{' '.join(s)}-{p}" for s, p in _SYNC_CASES])
def test_dist_sync_across_hosts(hosts, placement, scenario):
    """MXNet's dist_sync expectations, every call, and compression, across hosts."""
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

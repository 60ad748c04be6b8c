"""A rank whose program ended before a call the others make is named as ended, within
the timeout, whichever rank it is: rank 0 too, which otherwise names the others
(tests/distributed/programs/ended_ranks.py under `mpiexec`)."""
from __future__ import annotations

import re

import pytest

from .mpirun import ok, run

pytestmark = pytest.mark.mpi

TIMEOUT = 3
ENDED = "ended (reached the program's end or sys.exit) without making this call"


def _job(n: int, servers: int, *args: str):
    return run("ended_ranks.py", n, *args, timeout=90,
               env={"GPUKV_NUM_SERVERS": str(servers), "GPUKV_DIST_TIMEOUT": str(TIMEOUT)})


def _caught(out: str) -> list:
    """(seconds, message) of each worker's PeerError (lines may run into each other)."""
    return [(float(s), m) for s, m in re.findall(
        r"CAUGHT PeerError on worker \d+ after ([\d.]+) s: (.*?)(?=CAUGHT|PASS|$)", out,
        re.M | re.S)]


@pytest.mark.parametrize("how", ["return", "exit"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_0_that_ended_is_named_as_ended_within_the_timeout(n, how):
    """Rank 0 returned (or called sys.exit) before a push the others make: they raise
    PeerError naming it as ended, not as out of reach, within the timeout."""
    result = _job(n, 0, "ends", how, "0", "push")
    caught = _caught(result.stdout)
    assert len(caught) == n - 1, result.stdout + result.stderr
    did = ", ".join(map(str, range(1, n)))
    for seconds, message in caught:
        assert f"rank(s) 0 {ENDED}; rank(s) {did} did" in message, message
        assert seconds < TIMEOUT, caught


@pytest.mark.parametrize("n,servers", [(3, 1), (4, 1)])
def test_a_worker_0_that_ended_is_named_as_ended_with_servers(n, servers):
    """With dedicated servers, worker 0 (rank `servers` of the job) ended before a
    barrier the other workers make: they name it as ended, within the timeout."""
    result = _job(n, servers, "ends", "return", "0", "barrier")
    caught = _caught(result.stdout)
    assert len(caught) == n - servers - 1, result.stdout + result.stderr
    did = ", ".join(map(str, range(servers + 1, n)))
    for seconds, message in caught:
        assert f"rank(s) {servers} {ENDED}; rank(s) {did} did" in message, message
        assert seconds < TIMEOUT, caught


@pytest.mark.parametrize("victim", ["0", "1"])
@pytest.mark.parametrize("n,servers", [(3, 1), (4, 1)])
def test_a_worker_that_ended_before_a_push_is_named_by_the_servers(n, servers, victim):
    """With dedicated servers, a worker ended before a push the others make: the servers
    name it as ended without making the push, on every other worker, within the
    timeout (not as a push not made within it, once it has passed)."""
    result = _job(n, servers, "ends", "return", victim, "push")
    caught = _caught(result.stdout)
    assert len(caught) == n - servers - 1, result.stdout + result.stderr
    for seconds, message in caught:
        assert f"push of key 0: worker(s) {victim} ended (reached the program's end or " \
               f"sys.exit) without making it" in message, message
        assert seconds < TIMEOUT, caught


@pytest.mark.parametrize("call", ["barrier", "push"])
@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)])
def test_a_late_rank_0_that_ends_after_its_calls_is_not_named(n, servers, call):
    """Rank 0 comes late (within the timeout) and ends as soon as its last call is done,
    its word at exit maybe ahead of its part of that call: every worker passes."""
    out = ok(_job(n, servers, "late_then_ends", "1", "20", call))
    for w in range(n - servers):
        assert f"PASS worker {w} of {n - servers}" in out, out


def test_a_rank_0_that_ended_is_named_by_a_later_create():
    """Rank 0 ended after the first store; a second create (its agreement on
    COMM_WORLD, where rank 0 gives the verdict) names it as ended, within the timeout."""
    result = _job(3, 0, "creates_after_it_ended", "0")
    caught = _caught(result.stdout)
    assert len(caught) == 2, result.stdout + result.stderr
    for seconds, message in caught:
        assert f"rank(s) 0 {ENDED}" in message, message
        assert seconds < TIMEOUT, caught

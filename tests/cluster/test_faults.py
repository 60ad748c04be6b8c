"""Faults across emulated hosts, jobs started with `gpukv run`: a link cut mid-round ends
the job on every rank within a bound, a short cut is ridden out, a dead host ends the
job, and a straggler is slow but right. No checkpoint is damaged. The cut is also tried
with sign compression (compressed pulls) in both placements, and the cut and the dead
host under PowerSGD with a server, whose rounds add two allreduces among the workers to
the servers' pushes and pulls."""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

import gpukv

from .hosts import Watched, cluster, host_list, job_env, passes, program_command, start

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

TIMEOUT = 5.0  # GPUKV_DIST_TIMEOUT of these jobs
GRACE = 3.0  # gpukv run's default
ELEMENTS = 1 << 20  # 4 MiB of float32 a round: about 60 ms at 1 Gb/s
LR = 0.01

# placement -> (processes, dedicated servers), on 3 hosts, one rank per host in turn
PLACEMENTS = {"every worker serves": (3, 0), "a server host": (3, 1)}
# (placement, gradient compression) of the tests of a cut link and a dead host
FAILING = [(placement, "none") for placement in PLACEMENTS] + [("a server host", "powersgd")]
CUT = FAILING + [(placement, "sign") for placement in PLACEMENTS]


def _start(made, placement: str, rounds: int, checkpoint, launcher: str = "gpukv",
           timeout: float = TIMEOUT, compression: str = "none") -> Watched:
    n, servers = PLACEMENTS[placement]
    env = job_env(made, timeout=timeout, GPUKV_NUM_SERVERS=str(servers))
    job = start(made, n, host_list(made, slots=1),
                program_command("rounds.py", str(rounds), str(ELEMENTS), str(checkpoint),
                                compression),
                env, launcher=launcher)
    return Watched(job)


def _value_after(rounds: int, workers: int) -> float:
    return float(np.float32(1 - LR * workers * (workers + 1) / 2 * rounds))


def _check_checkpoint(path, workers: int, compression: str = "none") -> None:
    """The file worker 0 saved after round 1 loads whole, with that round's value."""
    store = gpukv.create("local")
    store.load(path)
    shape = (ELEMENTS // 1024, 1024) if compression == "powersgd" else (ELEMENTS,)  # rounds.py's
    out = np.zeros(shape, np.float32)
    store.pull("w", out=out)
    assert np.allclose(out, _value_after(2, workers), atol=1e-4), out[:3]


@pytest.mark.parametrize("placement, compression", CUT)
def test_a_link_cut_mid_round_ends_the_job_in_bounded_time(placement, compression, tmp_path):
    """Host 2's link goes down in the middle of the rounds: every worker still reachable
    raises PeerError naming the ranks it lost within twice the timeout, and `gpukv run`
    ends the whole job, non-zero, within twice the timeout plus its grace and a few
    seconds (mpiexec alone cannot reach the cut host and never ends)."""
    n, servers = PLACEMENTS[placement]
    checkpoint = tmp_path / "store.gkv"
    with cluster(3, "1gbit") as made:
        job = _start(made, placement, 10_000, checkpoint, compression=compression)
        job.wait_for("ROUND 5", count=n - servers)
        made.cut(2)
        cut = time.monotonic()
        status, ended = job.end(limit=2 * TIMEOUT + GRACE + 30)
    out = job.text()
    assert status != 0, out
    assert ended - cut <= 2 * TIMEOUT + GRACE + 5, (ended - cut, out)
    cut_rank = 2  # the rank placed on host 2
    survivors = [w for w in range(n - servers) if w + servers != cut_rank]
    for worker in survivors:
        caught = job.matching(f"CAUGHT PeerError on worker {worker} ")
        assert caught, f"worker {worker} got no PeerError:\n{out}"
        when, line = caught[0]
        assert when - cut <= 2 * TIMEOUT, (when - cut, line)
        # named as a rank, or as a worker by the servers (worker w is rank w + servers)
        assert (re.search(rf"rank\(s\) [\d, ]*\b{cut_rank}\b", line) or
                re.search(rf"worker\(s\) [\d, ]*\b{cut_rank - servers}\b", line)), line
    assert "gpukv run: rank" in out, out
    _check_checkpoint(checkpoint, n - servers, compression)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_link_cut_shorter_than_the_timeout_is_ridden_out(placement, tmp_path):
    """A link down for 1.5 s (the timeout is 10 s) and back: the rounds go on and every
    value is right (each pull is checked)."""
    n, servers = PLACEMENTS[placement]
    with cluster(3, "1gbit") as made:
        job = _start(made, placement, 40, tmp_path / "store.gkv", timeout=10)
        job.wait_for("ROUND 5", count=n - servers)
        made.cut(2)
        time.sleep(1.5)
        made.restore(2)
        status, _ = job.end(limit=120)
    passes(status, job.text(), "", n - servers)
    _check_checkpoint(tmp_path / "store.gkv", n - servers)


@pytest.mark.parametrize("placement, compression", FAILING)
def test_a_host_that_dies_ends_the_job(placement, compression, tmp_path):
    """Every process of host 2 killed mid-round, as when the machine dies: the job ends,
    non-zero, within the timeout plus the grace and a few seconds."""
    n, servers = PLACEMENTS[placement]
    with cluster(3, "1gbit") as made:
        job = _start(made, placement, 10_000, tmp_path / "store.gkv", compression=compression)
        job.wait_for("ROUND 5", count=n - servers)
        assert made.kill(2)
        killed = time.monotonic()
        status, ended = job.end(limit=2 * TIMEOUT + GRACE + 30)
    assert status != 0, job.text()
    assert ended - killed <= 2 * TIMEOUT + GRACE + 5, (ended - killed, job.text())
    _check_checkpoint(tmp_path / "store.gkv", n - servers, compression)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_straggler_is_slow_not_failed(placement, tmp_path):
    """Host 2 on a link 10x slower than the others': every round is right, and nobody
    times out while each round stays under the timeout."""
    n, servers = PLACEMENTS[placement]
    with cluster(3, "1gbit", h2="100mbit") as made:
        job = _start(made, placement, 6, tmp_path / "store.gkv")
        status, _ = job.end(limit=120)
    passes(status, job.text(), "", n - servers)
    assert not job.matching("CAUGHT"), job.text()


def _ranks_left(made, host: int) -> list[int]:
    """The processes of the rounds program still running on host."""
    left = []
    for pid in made.pids(host):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"rounds.py" in cmdline.read() and b"hydra" not in cmdline.read():
                    left.append(pid)
        except OSError:
            pass
    return left


def test_a_cut_off_host_ends_its_own_processes(tmp_path):
    """Under a bare mpiexec (no gpukv run to end it), the rank on a host whose link is cut
    times out, and its abort, which can never reach mpiexec, does not keep it alive: it
    ends within the timeout, the abort's grace and bound, and a few seconds."""
    from gpukv.distributed.mpi import job_exit
    with cluster(3, "1gbit") as made:
        env = job_env(made, timeout=TIMEOUT)
        job = Watched(start(made, 3, host_list(made, slots=1),
                            program_command("rounds.py", "10000", str(ELEMENTS),
                                            str(tmp_path / "store.gkv"), bare=True), env))
        job.wait_for("ROUND 5", count=3)
        assert _ranks_left(made, 2)
        made.cut(2)
        cut = time.monotonic()
        bound = 2 * TIMEOUT + job_exit.ABORT_GRACE + getattr(job_exit, "ABORT_BOUND", 5) + 5
        while _ranks_left(made, 2) and time.monotonic() - cut < bound + 10:
            time.sleep(0.2)
        gone = time.monotonic() - cut
        job.kill()
        assert not _ranks_left(made, 2), f"the cut host's rank still runs {gone:.0f} s on"
        assert gone <= bound, gone

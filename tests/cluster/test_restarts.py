"""`gpukv run --max-restarts` across emulated hosts: a host that dies or is cut off mid-run
is left out of the restart, which runs with as many processes per host on the hosts that
answer and completes; a host that does not answer at the start is left out too, unless
fewer than --min-workers processes would be left, where the launcher gives up; a job given
a host file instead of --hosts restarts on the hosts of the file that answer."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from .hosts import Watched, cluster, host_list, job_env, passes, program_command, start

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

TIMEOUT = 3.0  # GPUKV_DIST_TIMEOUT of these jobs
GRACE = 1.0


def _start(made, n: int, ppn: int | None, first_rounds: int, *options: str,
           hostfile: Path | None = None) -> Watched:
    env = job_env(made, timeout=TIMEOUT)
    per_host = ("--ppn", str(ppn)) if ppn else ()
    return Watched(start(made, n, host_list(made),
                         program_command("restarted.py", str(first_rounds), "20"), env,
                         launcher="gpukv", hostfile=hostfile,
                         options=(*per_host, "--grace", str(GRACE), *options)))


def _attempt_lines(job: Watched) -> list[str]:
    return [line for _, line in job.matching("gpukv run: attempt ")]


@pytest.mark.parametrize("fault,ppn", [("power_off", 2), ("cut", 1)])
def test_a_host_lost_mid_run_is_left_out_of_the_restart(fault, ppn):
    """Host 1 powered off (or its link cut) while 3 hosts run `ppn` ranks each: the job is
    restarted on hosts 0 and 2 with `ppn` ranks each, soon after the loss is seen (within
    the timeout, the grace and a few seconds), and that attempt completes."""
    with cluster(3, "1gbit") as made:
        job = _start(made, 3 * ppn, ppn, 1_000_000, "--max-restarts", "2",
                     "--min-workers", "2")
        job.wait_for("ROUND 3 attempt 0", count=3 * ppn)
        getattr(made, fault)(1)
        lost = time.monotonic()
        restarted = job.wait_for("ROUND 0 attempt 1", count=2 * ppn, limit=2 * TIMEOUT + 30)
        status, _ = job.end(limit=60)
    out = job.text()
    passes(status, out, "", 2 * ppn)
    assert out.count("in attempt 1") == 2 * ppn, out
    survivors = f"{made.addresses[0]},{made.addresses[2]}"
    first, last = _attempt_lines(job)
    assert first.startswith(f"gpukv run: attempt 0 ({3 * ppn} processes on "
                            f"{host_list(made)}) ended after "), first
    assert first.endswith(f"; restarting with {2 * ppn} processes on {survivors} "
                          "(restart 1 of at most 2)"), first
    assert "PeerError" in first or "ended badly" in first, first
    assert last.startswith(f"gpukv run: attempt 1 ({2 * ppn} processes on {survivors}) "), last
    assert last.endswith("every process ended well; done"), last
    print(f"{fault}: host lost -> restarted ranks running after {restarted - lost:.1f} s "
          f"(timeout {TIMEOUT:g} s, grace {GRACE:g} s)")
    assert restarted - lost <= 2 * TIMEOUT + GRACE + 10, (restarted - lost, out)


@pytest.mark.parametrize("min_workers,status", [(2, 0), (3, 255)])
def test_a_host_cut_off_at_the_start_is_left_out_down_to_min_workers(min_workers, status):
    """Host 1 cut off before the job starts: mpiexec cannot reach it (status 255). With
    --min-workers 2 the job is restarted on the 2 hosts that answer and completes; with
    --min-workers 3 the launcher gives up on one line, with mpiexec's status."""
    with cluster(3, "1gbit") as made:
        made.cut(1)
        job = _start(made, 3, 1, 3, "--max-restarts", "2", "--min-workers", str(min_workers))
        code, _ = job.end(limit=60)
    lines = _attempt_lines(job)
    assert code == status, job.text()
    survivors = f"{made.addresses[0]},{made.addresses[2]}"
    assert "mpiexec ended with status 255" in lines[0], lines
    if status:
        assert len(lines) == 1 and lines[0].endswith(
            f"; giving up: the hosts that answer ({survivors}) take 2 processes, fewer "
            "than --min-workers 3"), lines
    else:
        passes(code, job.text(), "", 2)
        assert len(lines) == 2 and lines[0].endswith(
            f"restarting with 2 processes on {survivors} (restart 1 of at most 2)"), lines


def test_a_job_given_a_host_file_restarts_on_its_hosts_that_answer(tmp_path):
    """A job given `-f FILE` (3 hosts, 2 slots each, a comment and a blank line) whose host
    1 is powered off mid-run: the restart runs with -hosts of hosts 0 and 2, their slots
    kept, 2 ranks on each, and completes."""
    with cluster(3, "1gbit") as made:
        hostfile = tmp_path / "hosts"
        hostfile.write_text("# the job's hosts\n" + "\n\n".join(
            f"{address}:2" for address in made.addresses) + "\n")
        job = _start(made, 6, None, 1_000_000, "--max-restarts", "1", "--min-workers", "4",
                     hostfile=hostfile)
        job.wait_for("ROUND 3 attempt 0", count=6)
        made.power_off(1)
        job.wait_for("ROUND 0 attempt 1", count=4, limit=2 * TIMEOUT + 30)
        status, _ = job.end(limit=60)
    passes(status, job.text(), "", 4)
    survivors = f"{made.addresses[0]}:2,{made.addresses[2]}:2"
    first, last = _attempt_lines(job)
    assert first.startswith(f"gpukv run: attempt 0 (6 processes on "
                            f"{host_list(made, slots=2)}) ended after "), first
    assert first.endswith(f"; restarting with 4 processes on {survivors} "
                          "(restart 1 of at most 1)"), first
    assert last.startswith(f"gpukv run: attempt 1 (4 processes on {survivors}) "), last
    assert last.endswith("every process ended well; done"), last

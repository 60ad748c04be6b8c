"""The tests' MPI launcher (mpirun.py): a job never outlives the test process that
started it, even one killed outright."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .. import gpu_env
from . import mpirun

RANK = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    Path(sys.argv[1], str(os.getpid())).write_text("")
    time.sleep(120)
""")

TEST_PROCESS = textwrap.dedent("""
    import sys
    from tests.distributed import mpirun
    mpirun.run(sys.argv[1], 2, sys.argv[2], timeout=100, bare=True)
""")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie no one has reaped yet has ended)."""
    if Path("/proc/self").exists():
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.mpi
def test_a_job_dies_with_the_test_process_that_started_it(tmp_path):
    """mpiexec runs in a session of its own, out of reach of a signal to the test
    process's group: when that process is killed (gpucheck ending a pytest process at
    its deadline), mpiexec is killed with it and its proxy ends the ranks."""
    mpirun.require_mpi()
    rank, pids = tmp_path / "rank.py", tmp_path / "pids"
    rank.write_text(RANK)
    pids.mkdir()
    test_process = subprocess.Popen([sys.executable, "-c", TEST_PROCESS, str(rank), str(pids)],
                                    cwd=gpu_env.ROOT, env=gpu_env.subprocess_env(gpus=False))
    ranks: list = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(ranks) < 2:
            time.sleep(0.1)
            ranks = [int(p.name) for p in pids.iterdir()]
        assert len(ranks) == 2, "the job did not start"
        test_process.kill()
        test_process.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(map(_alive, ranks)):
            time.sleep(0.1)
        assert not any(map(_alive, ranks))
    finally:
        test_process.kill()
        for pid in filter(_alive, ranks):
            os.kill(pid, signal.SIGKILL)

"""A training job that loses a host, a process or a link on the emulated hosts: `gpukv run
--max-restarts` starts it again on what is left, the Trainer resumes from its newest
complete snapshot, and the final weights equal, bit for bit, those of the same snapshot
restarted by hand on the same workers."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ..distributed.mpirun import dies_with_us
from .hosts import Watched, cluster, finish, host_list, job_env, passes, program_command

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

TIMEOUT = 6.0  # GPUKV_DIST_TIMEOUT of these jobs
STEPS, EVERY = 36, 4
STEP_SECONDS = "0.15"  # each step stretched, so that the fault lands mid-run
_RESUMED = re.compile(r"gpukv: resumed from (\S+) \(step (\d+), saved by (\d+) worker")

# fault -> (hosts the job restarts on, what the test does to the job)
FAULTS = {"a host dies": [0, 1], "a process is killed": [0, 1, 2], "a link is cut": [0, 1]}


def _program_ranks(made, host: int) -> list[int]:
    """The training processes running on host (not hydra's proxy, nor the watcher each
    rank forks to report its end, a child of the rank with its command line)."""
    found = {}
    for pid in made.pids(host):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"resume_train.py" in cmdline and b"hydra" not in cmdline:
            found[pid] = parent
    return [pid for pid, parent in found.items() if parent not in found]


def _strike(made, fault: str) -> None:
    if fault == "a host dies":
        made.power_off(2)
    elif fault == "a process is killed":
        ranks = _program_ranks(made, 1)
        assert ranks, "no training process on host 1"
        os.kill(max(ranks), signal.SIGKILL)  # the rank itself, not a wrapper above it
    else:
        made.cut(2)


def _launch(made, hosts: list[int], folder: Path, out: Path, env: dict,
            restarts: bool) -> subprocess.Popen:
    command = program_command("resume_train.py", str(folder), str(STEPS), str(EVERY),
                              str(out), bare=True)[1:]
    head = [sys.executable, "-m", "gpukv", "run", "-n", str(len(hosts)), "--hosts",
            host_list(made, hosts), "--ppn", "1"]
    if restarts:
        head += ["--max-restarts", "1", "--min-workers", "2"]
    return made.popen(0, [*head, *command], env=env, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                      start_new_session=True, preexec_fn=dies_with_us())


@pytest.mark.parametrize("fault", FAULTS)
def test_training_resumes_on_what_is_left_bit_for_bit(fault, tmp_path):
    """Mid-training, a host is powered off, one process is killed, or a host's link is
    cut: the launcher restarts the job on the hosts that answer, training resumes from
    the newest complete snapshot and ends; its weights equal those of that snapshot
    restarted by hand on the same hosts."""
    pytest.importorskip("torch")
    survivors = FAULTS[fault]
    with cluster(3, "1gbit") as made:
        env = job_env(made, timeout=TIMEOUT, GPUKV_TEST_STEP_SECONDS=STEP_SECONDS)
        job = Watched(_launch(made, [0, 1, 2], tmp_path / "ck", tmp_path / "out.npz", env,
                              restarts=True))
        job.wait_for("step 10 of 3 workers")
        _strike(made, fault)
        struck = time.monotonic()
        status, _ = job.end(limit=3 * TIMEOUT + 90)
        passes(status, job.text(), "", len(survivors))
        resumed = job.matching("gpukv: resumed from")
        assert len(resumed) == 1, job.text()
        when, line = resumed[0]
        path, step, saved = _RESUMED.search(line).groups()
        assert int(saved) == 3 and int(step) >= 8, line
        # bounded, not timed: the failure is seen within the timeout, then the restart
        assert when - struck <= TIMEOUT + 30, (when - struck, job.text())
        print(f"{fault}: resumed {when - struck:.1f} s after the fault, from step {step}")
        # The reference: that snapshot alone, restarted by hand on the same hosts.
        reference = tmp_path / "reference"
        shutil.copytree(path, reference / Path(path).name)
        if fault == "a link is cut":
            made.restore(2)  # the survivors are hosts 0 and 1 all the same
        by_hand = _launch(made, survivors, reference, tmp_path / "reference.npz", env,
                          restarts=False)
        status, stdout, stderr, _ = finish(by_hand, 120)
        passes(status, stdout, stderr, len(survivors))
        assert f"(step {step}, saved by 3 worker(s)" in stderr, stderr
    got, want = np.load(tmp_path / "out.npz"), np.load(tmp_path / "reference.npz")
    assert list(got) == list(want)
    for name in got:
        assert got[name].tobytes() == want[name].tobytes(), name

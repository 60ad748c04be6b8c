"""The GPU tests pass whatever order the emulated streams' work runs in, with the race
checker on: under the adversarial schedule (a run of every `gpu` and `multi_gpu` test in
a child process) and two seeded ones (each a run of every other test file, so that each
file runs under one seed: the CI's 2 cores afford no more). The three child runs go side
by side."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .. import gpu_env

pytestmark = [
    pytest.mark.skipif(not gpu_env.EMULATED, reason="schedules of the CUDA emulation"),
    pytest.mark.slow,
]

#: the schedules CI runs the GPU tests under, besides the default issue order, and which
#: share of the test files each runs (index, of how many)
SCHEDULES = {"seed:1": (0, 2), "seed:2": (1, 2), "adversarial": (0, 1)}


def _test_files(share: tuple) -> list[str]:
    """Every `share[1]`-th test file (from the `share[0]`-th) outside tests/distributed,
    whose GPU tests run under the default schedule (they need MPI)."""
    tests = gpu_env.ROOT / "tests"
    files = sorted(str(f) for f in tests.rglob("test_*.py")
                   if (tests / "distributed") not in f.parents)
    first, every = share
    return files[first::every]


@pytest.fixture(scope="module")
def schedule_runs():
    """The child run of every schedule, all started at once: each is one process, most
    of the time on one core, so side by side they take about half the time in turn on
    the CI's 2 cores. {schedule: Popen}, each writing into a file of its own."""
    import tempfile
    root = gpu_env.ROOT
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for schedule, share in SCHEDULES.items():
            env = dict(gpu_env.subprocess_env(), GPUKV_EMU_SCHEDULE=schedule,
                       GPUKV_TEST_GPU="1", GPUKV_EMU_RACES="1", GPUKV_CUDA_EMULATION="1")
            out = open(f"{folder}/{schedule.replace(':', '-')}.log", "w+")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                 "-m", "gpu or multi_gpu", *_test_files(share)],
                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
            runs[schedule] = (proc, out)
        try:
            yield runs
        finally:
            for proc, out in runs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                out.close()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gpu_tests_pass_under_the_schedule(schedule, schedule_runs):
    """The GPU tests of the schedule's share of the files (but the MPI ones) pass with
    the emulated streams' work run in the order `schedule` picks."""
    proc, out = schedule_runs[schedule]
    try:
        code = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    out.seek(0)
    tail = "\n".join(out.read().splitlines()[-40:])
    assert code == 0, f"GPUKV_EMU_SCHEDULE={schedule}:\n{tail}"
    assert " passed" in tail

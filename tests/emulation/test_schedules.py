"""The GPU tests pass whatever order the emulated streams' work runs in, with the race
checker on: under the adversarial schedule (a run of every `gpu` and `multi_gpu` test in
a child process) and two seeded ones (each a run of every other test file, so that each
file runs under one seed: the CI's 2 cores afford no more)."""
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


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gpu_tests_pass_under_the_schedule(schedule):
    """The GPU tests of the schedule's share of the files (but the MPI ones) pass with
    the emulated streams' work run in the order `schedule` picks."""
    env = dict(gpu_env.subprocess_env(), GPUKV_EMU_SCHEDULE=schedule, GPUKV_TEST_GPU="1",
               GPUKV_EMU_RACES="1", GPUKV_CUDA_EMULATION="1")
    root = gpu_env.ROOT
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "-m", "gpu or multi_gpu", *_test_files(SCHEDULES[schedule])],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(proc.stdout.splitlines()[-40:])
    assert proc.returncode == 0, f"GPUKV_EMU_SCHEDULE={schedule}:\n{tail}\n{proc.stderr[-2000:]}"
    assert " passed" in tail

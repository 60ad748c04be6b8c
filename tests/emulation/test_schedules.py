"""The GPU tests pass whatever order the emulated streams' work runs in, with the race
checker on: under two seeded schedules and the adversarial one (each a run of every
`gpu` and `multi_gpu` test in a child process)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .. import gpu_env

pytestmark = [
    pytest.mark.skipif(not gpu_env.EMULATED, reason="schedules of the CUDA emulation"),
    pytest.mark.slow,
]

#: the schedules CI runs the GPU tests under, besides the default issue order
SCHEDULES = ("seed:1", "seed:2", "adversarial")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_tests_pass_under_the_schedule(schedule):
    """Every GPU test (but the MPI ones, which run under the default schedule) passes
    with the emulated streams' work run in the order `schedule` picks."""
    env = dict(gpu_env.subprocess_env(), GPUKV_EMU_SCHEDULE=schedule, GPUKV_TEST_GPU="1",
               GPUKV_EMU_RACES="1", GPUKV_CUDA_EMULATION="1")
    root = gpu_env.ROOT
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "-m", "gpu or multi_gpu", "--ignore", str(root / "tests" / "distributed"),
         str(root / "tests")],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(proc.stdout.splitlines()[-40:])
    assert proc.returncode == 0, f"GPUKV_EMU_SCHEDULE={schedule}:\n{tail}\n{proc.stderr[-2000:]}"
    assert " passed" in tail

"""The one gate of GPU tests: skip when no GPU (real or emulated) can run them, fail instead
when one is expected (GPUKV_TEST_GPU=1, as CI sets it)."""
from __future__ import annotations

import os

import pytest

GPU_EXPECTED = os.environ.get("GPUKV_TEST_GPU", "") == "1"


def gpu_unavailable(reason: str):
    """Skip the running test for `reason`, or fail it when a GPU is expected."""
    if GPU_EXPECTED:
        pytest.fail(f"GPUKV_TEST_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def physical_gpus(n: int, reason: str) -> None:
    """`hardware_missing(reason)` where fewer than `n` physical GPUs are visible."""
    from gpukv.device.cuda.device import gpu_count
    if gpu_count() < n:
        hardware_missing(reason)


def hardware_missing(reason: str):
    """For a test that needs more of the machine than a GPU (several physical GPUs, peer
    access, NCCL): the CUDA emulation always provides it, so there its absence fails the
    test; a real machine may simply not have it, so there the test skips."""
    from . import gpu_env
    if gpu_env.EMULATED:
        pytest.fail(f"the CUDA emulation should provide this, but {reason}", pytrace=False)
    pytest.skip(reason)

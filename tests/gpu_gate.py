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

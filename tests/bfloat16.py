"""NumPy's bfloat16 for the tests, when ml_dtypes is installed.

The `test` extra installs ml_dtypes, but a GPU machine running `gpukv gpucheck` from a
checkout may lack it: there every test module still imports, and only the bfloat16 cases
skip (`needs_bfloat16`, on a test or on one `pytest.param`).
"""
from __future__ import annotations

import numpy as np
import pytest

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

#: np.dtype of ml_dtypes.bfloat16, or None without ml_dtypes
BF16 = None if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)

needs_bfloat16 = pytest.mark.skipif(ml_dtypes is None,
                                    reason="bfloat16 needs ml_dtypes, which is not installed")


def dtype_named(name: str):
    """np.dtype(name), ml_dtypes' bfloat16 for 'bfloat16' (None without ml_dtypes)."""
    return BF16 if name == "bfloat16" else np.dtype(name)


def marked(names) -> list:
    """`names` as test cases, 'bfloat16' marked `needs_bfloat16`."""
    return [pytest.param(n, marks=needs_bfloat16) if n == "bfloat16" else n for n in names]

"""Pulls that travel compressed serve the same bits with dedicated servers as without:
the owner of a key compresses the float32 sum of the round, in worker order, whatever
the key's dtype (programs/pull_layouts.py). A float16 key's stored value is rounded, and
inf where the sum passes float16's range: compressed from it, the servers' pulls drifted
from the others' and turned NaN for good."""
from __future__ import annotations

import numpy as np
import pytest

from .mpirun import ok, run

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("dtype", ["float16", "float64"])
@pytest.mark.parametrize("kind", ["sign", "ternary"])
def test_compressed_pulls_are_the_same_bits_with_servers(tmp_path, kind, dtype):
    pulled = {}
    for servers in (0, 1):
        out = tmp_path / f"s{servers}.npy"
        ok(run("pull_layouts.py", 2 + servers, kind, dtype, str(out),
               env={"GPUKV_NUM_SERVERS": str(servers)}))
        pulled[servers] = np.load(out)
    assert not np.isnan(pulled[1]).any(), "a pull of the servers' turned NaN"
    assert np.array_equal(pulled[0], pulled[1], equal_nan=True), \
        np.flatnonzero(pulled[0] != pulled[1])[:10]

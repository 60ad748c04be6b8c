"""Reduction on the host: NumPy sums in cache-sized blocks."""
from __future__ import annotations

import numpy as np

from ._base import BroadcastJob, ReduceJob, Strategy

# Elements per block: the running sum of one block stays in L2 while every source
# is added to it, so the output is written to memory once, not once per source.
BLOCK = 1 << 15
_NARROW = frozenset(["float16", "bfloat16"])


def accumulate_dtype(dtype):
    """The dtype sums of `dtype` are accumulated in: float32 for 16-bit floats."""
    return np.dtype(np.float32) if np.dtype(dtype).name in _NARROW else np.dtype(dtype)


def host_sum(out: np.ndarray, sources: list) -> None:
    """Write the sum of `sources` (same shape) into the contiguous array `out`.

    Narrow floats are summed in float32 when `out` is float32; the result is cast to
    `out`'s dtype. `out` must not be one of `sources`.
    """
    if len(sources) == 1:
        np.copyto(out, sources[0], casting="unsafe")
        return
    acc = out.dtype if out.dtype.name not in _NARROW else np.dtype(np.float32)
    flat_out = out.reshape(-1)
    flat = [np.ravel(s) for s in sources]
    n = flat_out.size
    first, second, rest = flat[0], flat[1], flat[2:]
    if n <= BLOCK:
        np.add(first, second, out=flat_out, dtype=acc, casting="unsafe")
        for s in rest:
            np.add(flat_out, s, out=flat_out, dtype=acc, casting="unsafe")
        return
    add = np.add
    for start in range(0, n, BLOCK):
        stop = start + BLOCK
        block = flat_out[start:stop]
        add(first[start:stop], second[start:stop], out=block, dtype=acc, casting="unsafe")
        for s in rest:
            add(block, s[start:stop], out=block, dtype=acc, casting="unsafe")


class HostStrategy(Strategy):
    """Everything through main memory: GPU sources are copied to the host first.

    This is MXNet's `local` store (and the `'cpu'` strategy on GPUs).
    """

    name = "cpu"

    def reduce(self, job: ReduceJob) -> None:
        sources = [s if isinstance(s, np.ndarray) else s.get() for s in job.sources]
        host_sum(job.out, sources)

    def broadcast(self, job: BroadcastJob) -> None:
        for out, device in zip(job.outs, job.devices):
            device.copy(out, job.src)

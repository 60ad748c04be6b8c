"""The NumPy twins of the CUDA reduction kernels (`gpukv/device/cuda/kernels.py`).

Each twin has its kernel's contract: the same terms added in the same order, in the same
accumulation dtype (float32 for 16-bit floats), so the host device runs the GPU
algorithm and tests compare the two bit for bit.
"""
from __future__ import annotations

import numpy as np

from .base import SumItem
from .host_sum import accumulate_dtype


def multi_sum_host(items) -> None:
    """Every `SumItem` of `items` (NumPy arrays): out = sum(a) + sum(b), the terms added
    from the first, accumulated in `accumulate_dtype(out.dtype)`; items writing one out
    run in the order given."""
    for item in items:
        out = item.out
        if out.size == 0:
            continue
        acc = accumulate_dtype(out.dtype)
        terms = list(item.a) + list(item.b)
        if len(terms) == 1:
            np.copyto(out, terms[0], casting="unsafe")
            continue
        if any(t is out or np.shares_memory(t, out) for t in terms) or acc != out.dtype:
            total = np.add(terms[0], terms[1], dtype=acc, casting="unsafe")
            for t in terms[2:]:
                np.add(total, t, out=total, dtype=acc, casting="unsafe")
            np.copyto(out, total, casting="unsafe")
        else:
            np.add(terms[0], terms[1], out=out, dtype=acc, casting="unsafe")
            for t in terms[2:]:
                np.add(out, t, out=out, dtype=acc, casting="unsafe")


def multi_copy_host(pairs) -> None:
    """dst[...] = src for every (dst, src) pair of NumPy arrays, casting as the copy
    kernel does (a sum of one term)."""
    multi_sum_host([SumItem(dst, (src,), ()) for dst, src in pairs])


def segment_sum_host(data, bounds):
    """Rows of `data` summed per run [bounds[s], bounds[s+1]) (`bounds`: int64, runs + 1
    entries), each run's rows added one after the other from its first (np.add.at adds
    in index order), in the accumulation dtype of data's dtype."""
    acc = accumulate_dtype(data.dtype)
    starts = bounds[:-1]
    sums = data[starts].astype(acc)
    run_of = np.repeat(np.arange(starts.size), np.diff(bounds))
    later = np.ones(data.shape[0], bool)
    later[starts] = False
    np.add.at(sums, run_of[later], data[later].astype(acc, copy=False))
    return sums

"""A GPU's fused sums and copies of many keys: `CudaDevice.sum_into`, `tree_sum_into` and
`copy_many`.

Terms the GPU can read where they lie (its own memory, a peer's with peer access) are
summed by one fused kernel for all keys together (pointer tables); the others are copied
chunk by chunk through a staging buffer (at most `STAGE_BYTES` per source) on the
device's stream and added in. Everything is queued on the device's stream.
"""
from __future__ import annotations

import numpy as np

from ..base import SumItem, sum_items
from . import kernels as _kernels

# Bytes of the staging buffer, per source, for sources a device cannot read directly.
STAGE_BYTES = 8 << 20
# Same-dtype copies at least this large use a memcpy instead of the copy kernel.
BIG_COPY = 4 << 20


def sum_into(device, jobs) -> None:
    """On `device` (a CudaDevice): out = sum(terms) for every (out, terms) of `jobs`."""
    direct_items, staged_jobs = [], []
    for out, terms in jobs:
        direct: list = []
        staged: list = []
        for t in terms:
            (direct if device.readable(t.array) else staged).append(t)
        if direct:
            direct_items.extend(sum_items(out, direct))
        elif not staged:  # no terms at all: the sum is zero
            device.fill0(out)
        if staged:
            staged_jobs.append((out, staged, bool(direct)))
    if direct_items:
        with device.cuda_device:
            _kernels.multi_sum_gpu(direct_items, device.stream)
    for out, staged, have in staged_jobs:
        _staged_sum(device, out, staged, have)


def _staged_sum(device, out, staged, have: bool) -> None:
    """Add terms `device` cannot read directly into `out`, through a chunked stage."""
    stream = device.stream
    for t in staged:
        src = t.array
        chunk = max(1, STAGE_BYTES // src.itemsize)
        stage = device.empty(min(chunk, src.size), src.dtype)
        for start in range(0, src.size, chunk):
            stop = min(src.size, start + chunk)
            part = stage[:stop - start]
            piece = src[start:stop]
            with device.cuda_device:
                if isinstance(piece, np.ndarray):
                    part.set(np.ascontiguousarray(piece), stream=stream)
                else:
                    part.data.copy_from_device_async(piece.data, piece.nbytes, stream)
            dst = out[start:stop]
            prev = (dst,) if have else ()
            if t.same:
                item = SumItem(dst, (), (part,) + prev)
            else:
                item = SumItem(dst, (part,), prev)
            with device.cuda_device:
                _kernels.multi_sum_gpu([item], stream)
        have = True


def tree_sum_into(device, jobs) -> None:
    """On `device` (a CudaDevice): out = the canonical tree sum of `arrays` for every
    (out, arrays) of `jobs`, one launch per pair of dtypes.

    The staged sum above adds its terms after the direct ones, which would change the
    tree; so an array the GPU cannot read where it lies (host memory, a GPU without peer
    access) is first copied whole to a temporary here, and one of a dtype that differs
    from the job's other leaves is converted to the accumulation dtype (the value the
    kernel would load), so every item's leaves share one dtype."""
    # Temporaries are allocated on this device's stream: CuPy's pool hands them out again
    # only to later work on that stream, after the launch has read them.
    items: list = []
    for out, arrays in jobs:
        if not arrays:
            device.fill0(out)
            continue
        leaves = [a if device.readable(a) else device.to_local(a) for a in arrays]
        if len({a.dtype for a in leaves}) > 1:
            acc = np.dtype(_kernels.accumulate_name(out.dtype))
            leaves = [a if a.dtype == acc else _cast(device, a, acc) for a in leaves]
        items.append((out, leaves))
    if items:
        with device.cuda_device:
            _kernels.multi_tree_sum_gpu(items, device.stream)


def _cast(device, array, dtype):
    """`array` (readable here) converted to `dtype` by this device's copy kernel."""
    out = device.empty(array.size, dtype)
    with device.cuda_device:
        _kernels.multi_copy_gpu([(out, array)], device.stream)
    return out


def copy_many(device, pairs) -> None:
    """On `device`: dst[...] = src for every (dst, src) pair of 1-D contiguous arrays.

    Sources the device can read directly are copied (with a cast) by one kernel for all
    pairs, large same-dtype ones by the copy engine; the rest go through `device.copy`.
    """
    direct: list = []
    other: list = []
    for dst, src in pairs:
        (direct if device.readable(src) else other).append((dst, src))
    if direct:
        big: list = []
        rest: list = []
        for d, s in direct:
            (big if d.dtype == s.dtype and d.nbytes >= BIG_COPY else rest).append((d, s))
        stream = device.stream
        with device.cuda_device:
            for d, s in big:  # large plain copies: the copy engine, no SMs
                d.data.copy_from_device_async(s.data, s.nbytes, stream)
            if rest:
                _kernels.multi_copy_gpu(rest, stream)
    for dst, src in other:
        device.copy(dst, src)

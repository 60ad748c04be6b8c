"""Device-generic steps the multi-device strategies are built from.

Each step takes `Device` objects and runs on host devices (NumPy, in CI) and on
GPUs (CuPy, stream-ordered) alike:

- `flat_in` / `FlatOut`: 1-D contiguous views (or copies) of a job's arrays;
- `readable`: whether a device can read an array where it lies (peer access);
- `gather_sum`: the fused k-way sum on one device, reading peer memory directly
  and staging the rest chunk by chunk (at most `STAGE_BYTES` of buffer per source);
- `begin` / `finish`: the events that order a call after the caller's work and
  the caller's later work after the call, with no host synchronisation.
"""
from __future__ import annotations

import numpy as np

from ..device.cuda import kernels as _kernels
from ..device.cuda.kernels import SumItem

# Bytes of the staging buffer, per source, for sources a device cannot read directly.
STAGE_BYTES = 8 << 20
# Same-dtype copies at least this large use a memcpy instead of the copy kernel.
BIG_COPY = 4 << 20


def is_gpu(device) -> bool:
    return device.kind == "gpu"


def node_order(device) -> tuple:
    """The sort key that puts a job's devices in one canonical order."""
    return (device.kind, device.physical, device.slot)


def unique(devices) -> list:
    """`devices` without repeats, in first-seen order."""
    seen, out = set(), []
    for d in devices:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def is_host_job(devices, home) -> bool:
    return not is_gpu(home) and not any(is_gpu(d) for d in devices)


def is_gpu_job(devices, home) -> bool:
    return is_gpu(home) and all(is_gpu(d) for d in devices)


def is_uniform_job(devices, home) -> bool:
    """Whether a job's devices and home are all host devices or all GPUs."""
    return is_host_job(devices, home) or is_gpu_job(devices, home)


def group_jobs(jobs, nodes_of):
    """({node tuple: [jobs]}, [fallback jobs]): jobs by `nodes_of(job)`; None: fallback."""
    groups: dict = {}
    fallback = []
    for job in jobs:
        nodes = nodes_of(job)
        if nodes is not None:
            groups.setdefault(nodes, []).append(job)
        else:
            fallback.append(job)
    return groups, fallback


def split_plain_broadcasts(jobs):
    """(plain, other): broadcast jobs whose source and outs are C-contiguous of one dtype
    first, the rest second."""
    plain, other = [], []
    for job in jobs:
        same = all(o.dtype == job.src.dtype and o.flags.c_contiguous for o in job.outs)
        (plain if same and job.src.flags.c_contiguous else other).append(job)
    return plain, other


def split_host_jobs(jobs):
    """(host, other): jobs whose devices and home are all host devices first, the rest
    second."""
    host, other = [], []
    for job in jobs:
        (host if is_host_job(job.devices, job.home) else other).append(job)
    return host, other


# ------------------------------------------------------------------ events
def begin(devices) -> None:
    """Order every device's stream after the caller's work on CuPy's current stream."""
    for d in unique(devices):
        if is_gpu(d):
            d.enter()


def wait_all(device, others) -> None:
    """Order `device`'s later work after the work queued so far on each of `others`.

    A host device has no stream: it waits (host synchronisation) for GPU work it reads.
    """
    if not is_gpu(device):
        for other in unique(others):
            if is_gpu(other):
                other.synchronize()
        return
    for other in unique(others):
        if other is not device and is_gpu(other):
            device.wait_for(other)


def mark(device):
    """An event marking the work queued on `device` so far (None on the host)."""
    return device.record() if is_gpu(device) else None


def wait_mark(device, event) -> None:
    """Order `device`'s later work after `event` (from `mark`)."""
    if event is None:
        return
    if is_gpu(device):
        device.wait_event(event)
    else:
        event.synchronize()


def finish(devices, home) -> None:
    """Join: `home` waits for every device, every device waits for `home`.

    Afterwards a source may be overwritten, a temporary freed to the stream it was
    allocated on, and the caller's current stream of every GPU sees the result.
    """
    devices = unique(list(devices) + [home])
    gpus = [d for d in devices if is_gpu(d)]
    if not gpus:
        return
    hub = home if is_gpu(home) else gpus[0]
    wait_all(hub, gpus)
    for d in gpus:
        if d is not hub:
            d.wait_for(hub)
    for d in gpus:
        d.leave()


# ---------------------------------------------------------------- arrays
def flat_in(array, device):
    """A 1-D contiguous view of `array`, or a contiguous copy made on `device`."""
    if array.flags.c_contiguous:
        return array.reshape(-1)
    if not is_gpu(device):
        return np.ascontiguousarray(array).reshape(-1)
    tmp = device.empty(array.shape, array.dtype)
    device.copy(tmp, array)
    return tmp.reshape(-1)


class FlatOut:
    """A 1-D contiguous target for `out`; `done()` copies back when it had to be a copy."""

    __slots__ = ("out", "flat", "device", "copied")

    def __init__(self, out, device):
        self.out = out
        self.device = device
        self.copied = not out.flags.c_contiguous
        self.flat = device.empty(out.size, out.dtype) if self.copied else out.reshape(-1)

    def done(self) -> None:
        if self.copied:
            self.device.copy(self.out, self.flat.reshape(self.out.shape))


def readable(reader, array) -> bool:
    """Whether a kernel on `reader` can read `array` where it lies."""
    if not is_gpu(reader):
        return isinstance(array, np.ndarray)
    if isinstance(array, np.ndarray):
        return False
    from ..device.cuda.device import peer_readable
    return peer_readable(reader.physical, array)


def to_host(array, device=None):
    """A NumPy array of `array`: a GPU array is copied synchronously by its own GPU, on
    `device`'s stream when that is the array's logical device, else on CuPy's current
    stream of the array's GPU."""
    if isinstance(array, np.ndarray):
        return array
    from ..device.cuda.device import to_numpy
    return to_numpy(array, device)


# ------------------------------------------------------------- fused sums
class Term:
    """One addend of a gathered sum: a 1-D array and whether it has the out's dtype."""

    __slots__ = ("array", "same")

    def __init__(self, array, same: bool):
        self.array = array
        self.same = same  # True: dtype U of the out (a partial sum); False: dtype T


def gather_sum(device, jobs) -> None:
    """On `device`: out = sum(terms) for every (out, terms) in `jobs`, in few launches.

    `out` is 1-D contiguous on `device`; each term is a `Term`. Terms the device can
    read directly are summed by one fused kernel for all jobs together (pointer
    tables); the others are copied chunk by chunk through a staging buffer (at most
    `STAGE_BYTES`) on the device's stream and added in. A term may be `out` itself
    (accumulate in place). The caller has already ordered `device` after the devices
    the terms live on.
    """
    stream = device.stream if is_gpu(device) else None
    direct_items, staged_jobs = [], []
    for out, terms in jobs:
        direct, staged = [], []
        for t in terms:
            if readable(device, t.array):
                direct.append(t)
            elif not is_gpu(device):
                direct.append(Term(to_host(t.array), t.same))
            else:
                staged.append(t)
        if direct:
            direct_items.extend(_items(out, direct))
        elif not staged:  # no terms at all: the sum is zero
            out.fill(0) if not is_gpu(device) else _fill0(device, out)
        if staged:
            staged_jobs.append((out, staged, bool(direct)))
    if direct_items:
        if is_gpu(device):
            with device.cuda_device:
                _kernels.multi_sum_gpu(direct_items, stream)
        else:
            _kernels.multi_sum_host(direct_items)
    for out, staged, have in staged_jobs:
        _staged_sum(device, out, staged, have)


def _items(out, terms) -> list:
    """SumItems for out = sum(terms); terms of two input dtypes become two passes."""
    a = [t.array for t in terms if not t.same]
    b = [t.array for t in terms if t.same]
    dtypes = {x.dtype for x in a}
    if len(dtypes) <= 1:
        return [SumItem(out, tuple(a), tuple(b))]
    # Mixed input dtypes (not produced by the store): sum dtype by dtype, in order.
    items, first = [], True
    for dt in dtypes:
        group = tuple(x for x in a if x.dtype == dt)
        items.append(SumItem(out, group, tuple(b) if first else (out,)))
        first = False
    return items


def _fill0(device, out) -> None:
    with device.cuda_device, device.stream:
        out.fill(0)


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


def copy_many(device, pairs) -> None:
    """On `device`: dst[...] = src for every (dst, src) pair of 1-D contiguous arrays.

    Sources the device can read directly are copied (with a cast) by one kernel for
    all pairs; the rest go through the device's copy engine.
    """
    direct, other = [], []
    for dst, src in pairs:
        (direct if readable(device, src) else other).append((dst, src))
    if direct:
        if is_gpu(device):
            big = [(d, s) for d, s in direct if d.dtype == s.dtype and d.nbytes >= BIG_COPY]
            rest = [(d, s) for d, s in direct if not (d.dtype == s.dtype and d.nbytes >= BIG_COPY)]
            with device.cuda_device:
                for d, s in big:  # large plain copies: the copy engine, no SMs
                    d.data.copy_from_device_async(s.data, s.nbytes, device.stream)
                if rest:
                    _kernels.multi_copy(rest, device.stream)
        else:
            _kernels.multi_copy(direct)
    for dst, src in other:
        device.copy(dst, src)


# ----------------------------------------------------------------- topology
def link_matrix(nodes) -> np.ndarray:
    """The link matrix of logical devices `nodes` (host slots: all equal links)."""
    from .plan import topology
    if all(is_gpu(d) for d in nodes):
        return topology.link_matrix_from_cuda(nodes)
    n = len(nodes)
    w = np.full((n, n), topology.SAME_DEVICE_WEIGHT)
    np.fill_diagonal(w, 0.0)
    return w


def link_matrix_for(nodes, matrix=None) -> np.ndarray:
    """The link matrix of `nodes`: `link_matrix`'s without `matrix`; else `matrix(nodes)`
    for a callable, or the rows and columns of `nodes` (host slot or physical GPU) of a
    full matrix."""
    if matrix is None:
        return link_matrix(nodes)
    if callable(matrix):
        return matrix(nodes)
    full = np.asarray(matrix, dtype=float)
    ids = [d.slot if d.kind != "gpu" else d.physical for d in nodes]
    return full[np.ix_(ids, ids)]

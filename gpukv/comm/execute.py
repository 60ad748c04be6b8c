"""Orchestration shared by the multi-device strategies, written against device verbs.

Nothing here does work on arrays: the devices do (`Device.sum_into`, `copy_many`, ...).
What is here decides who waits for whom and how jobs are grouped:

- `begin` / `wait_all` / `finish`: the events that order a call after the caller's work,
  each device after the devices it reads, and the caller's later work after the call,
  with no host synchronisation between devices that queue their work;
- `flat_in` / `FlatOut`: 1-D contiguous views (or copies) of a job's arrays;
- job grouping (`group_jobs`, `split_*`, `is_*_job`) and the link matrix of a job's
  devices (`link_matrix`).
"""
from __future__ import annotations

import numpy as np


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
    """Whether a job's devices and home all keep their arrays in main memory."""
    return home.host_memory and all(d.host_memory for d in devices)


def is_gpu_job(devices, home) -> bool:
    """Whether a job's devices and home all keep their arrays outside main memory."""
    return not home.host_memory and not any(d.host_memory for d in devices)


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
    """Order every device's later work after the caller's work on its current stream."""
    for d in unique(devices):
        d.enter()


def wait_all(device, others) -> None:
    """Order `device`'s later work after the work queued so far on each of `others`.

    A device that queues no work waits on the host (it synchronises the others)."""
    for other in unique(others):
        if other is not device:
            device.wait_for(other)


def finish(devices, home) -> None:
    """Join: `home` waits for every device, every device waits for `home`.

    Afterwards a source may be overwritten, a temporary freed to the stream it was
    allocated on, and the caller's current stream of every GPU sees the result. Only
    devices that queue their work take part: the others are done already.
    """
    queued = [d for d in unique(list(devices) + [home]) if d.asynchronous]
    if not queued:
        return
    hub = home if home.asynchronous else queued[0]
    wait_all(hub, queued)
    for d in queued:
        if d is not hub:
            d.wait_for(hub)
    for d in queued:
        d.leave()


# ---------------------------------------------------------------- arrays
def flat_in(array, device):
    """A 1-D contiguous view of `array`, or a contiguous copy made on `device`."""
    if array.flags.c_contiguous:
        return array.reshape(-1)
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


# ----------------------------------------------------------------- topology
def measured_links(nodes) -> bool:
    """Whether the links between `nodes` are read from the hardware (all GPUs)."""
    return all(d.peer_links for d in nodes)


def link_matrix(nodes) -> np.ndarray:
    """The link matrix of logical devices `nodes` (host slots: all equal links)."""
    from .plan import topology
    if measured_links(nodes):  # GPUs: the ranks the CUDA device layer reads from the driver
        from ..device.cuda.probe import p2p_ranks
        ids = [d.link_index for d in nodes]
        return topology.link_matrix_from_ranks(ids, p2p_ranks(ids))
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
    ids = [d.link_index for d in nodes]
    return full[np.ix_(ids, ids)]

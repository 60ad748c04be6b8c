"""Grouping a strategy's jobs: by their devices, by where those keep their arrays, and
by whether a broadcast's arrays are plain."""
from __future__ import annotations


def node_order(device) -> tuple:
    """The sort key that puts a job's devices in one canonical order."""
    return (device.kind, device.physical, device.slot)


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

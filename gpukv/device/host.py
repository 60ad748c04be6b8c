"""The host backend: NumPy arrays in main memory, summed by the NumPy twins of the CUDA
kernels (`host_kernels`) and, for whole keys, by the blocked threaded `host_sum` (the
canonical order: `host_tree_sum`)."""
from __future__ import annotations

import numpy as np

from .base import Device, Term, sum_items
from .host_kernels import multi_copy_host, multi_sum_host, segment_sum_host
from .host_sum import host_broadcast, host_sum, host_tree_sum


def _gpu_to_numpy(array) -> np.ndarray:
    """A GPU array copied to the host by its own GPU, on CuPy's current stream there."""
    from .cuda.device import to_numpy
    return to_numpy(array)


class HostDevice(Device):
    """Main memory. Several slots stand for several CPU "devices" sharing it.

    Work is done when a call returns, so the ordering verbs have nothing to do; waiting
    for another device synchronises it.
    """

    kind = "cpu"
    host_memory = True

    #: `sum(out, sources)`: the blocked threaded sum of whole arrays (any strides)
    sum = staticmethod(host_sum)
    #: `broadcast(src, outs)`: `src` copied into every out, blocked and threaded
    broadcast = staticmethod(host_broadcast)

    @property
    def xp(self):
        return np

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def copy(self, dst, src) -> None:
        if not isinstance(src, np.ndarray):  # a GPU array: brought over by its own GPU
            src = _gpu_to_numpy(src)
        if dst.dtype == src.dtype:
            np.copyto(dst, src)
            return
        with np.errstate(over="ignore"):  # (a float16 key past its range stores inf)
            np.copyto(dst, src, casting="unsafe")

    def owns(self, array) -> bool:
        return isinstance(array, np.ndarray)

    readable = owns

    def to_host(self, array) -> np.ndarray:
        """`array` itself, or a GPU array copied over by its own GPU (synchronously, on
        CuPy's current stream of that GPU)."""
        return array if isinstance(array, np.ndarray) else _gpu_to_numpy(array)

    @property
    def link_index(self) -> int:
        return self.slot

    @property
    def primary(self) -> HostDevice:
        return host_device(0)

    def sum_into(self, jobs) -> None:
        items = []
        for out, terms in jobs:
            if not terms:
                out.fill(0)
                continue
            for t in terms:
                if not isinstance(t.array, np.ndarray):
                    terms = [t if isinstance(t.array, np.ndarray)
                             else Term(self.to_host(t.array), t.same) for t in terms]
                    break
            items.extend(sum_items(out, terms))
        if items:
            multi_sum_host(items)

    def tree_sum_into(self, jobs) -> None:
        for out, arrays in jobs:
            if not arrays:
                out.fill(0)
            else:  # GPU arrays are brought over by their own GPUs first
                host_tree_sum(out, [self.to_host(a) for a in arrays])

    def copy_many(self, pairs) -> None:
        direct = []
        for dst, src in pairs:
            if isinstance(src, np.ndarray):
                direct.append((dst, src))
            else:
                self.copy(dst, src)
        if direct:
            multi_copy_host(direct)

    def segment_sum(self, data, bounds):
        return segment_sum_host(data, bounds)


_HOSTS: list[HostDevice] = []


def host_device(slot: int = 0) -> HostDevice:
    """The shared HostDevice for `slot` (devices are compared by value; this avoids churn)."""
    while len(_HOSTS) <= slot:
        _HOSTS.append(HostDevice(0, len(_HOSTS)))
    return _HOSTS[slot]

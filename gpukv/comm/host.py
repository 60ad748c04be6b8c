"""The host strategy: every key summed and copied in main memory by the host device.

The sums themselves (blocked, threaded NumPy) are the host device's
(`gpukv.device.host_sum`).
"""
from __future__ import annotations

import numpy as np

from ..device.host import host_device
from ._base import BroadcastJob, ReduceJob, Strategy

__all__ = ["HostStrategy"]

_NDARRAY = np.ndarray
_HOST = host_device(0)
_SUM = _HOST.sum
_BROADCAST = _HOST.broadcast


class HostStrategy(Strategy):
    """Everything through main memory: GPU sources are copied to the host first.

    This is MXNet's `local` store (and the `'cpu'` strategy on GPUs). The loops over a
    call's keys are written out here: with many small keys they are the host's hot path.
    """

    name = "cpu"

    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many((job,))

    def broadcast(self, job: BroadcastJob) -> None:
        self.broadcast_many((job,))

    def reduce_many(self, jobs) -> None:
        for _, sources, devices, _, out in jobs:
            for s in sources:
                if type(s) is not _NDARRAY and not isinstance(s, _NDARRAY):
                    # a GPU array: read by the host, synchronously, on its device's
                    # stream, after what was queued there for it (a virtual GPU's
                    # decoding of a compressed push runs on that GPU's own stream)
                    sources = [d.to_host(s) for s, d in zip(sources, devices)]
                    break
            _SUM(out, sources)

    def broadcast_many(self, jobs) -> None:
        for _, src, _, outs, devices in jobs:
            if _on_host(src) and all(map(_on_host, outs)):
                _BROADCAST(src, outs)
                continue
            for out, device in zip(outs, devices):
                # A virtual GPU's own stream: after the caller's work on the out, and the
                # caller's later work after the copy.
                device.enter()
                device.copy(out, src)
                device.leave()

    # The batch form of the store's all-host calls: jobs as parallel lists, with nothing
    # built per key (with many small keys, a job object is a good part of a key's cost).
    def reduce_columns(self, outs, sources) -> None:
        """outs[i] = the sum of the NumPy arrays sources[i], for every i."""
        for out, arrays in zip(outs, sources):
            _SUM(out, arrays)

    def broadcast_columns(self, srcs, outs) -> None:
        """Every NumPy array of outs[i] = srcs[i], for every i."""
        for src, arrays in zip(srcs, outs):
            _BROADCAST(src, arrays)


def _on_host(array) -> bool:
    return type(array) is _NDARRAY or isinstance(array, _NDARRAY)

"""The host backend: NumPy arrays in main memory."""
from __future__ import annotations

import numpy as np

from .base import Device


class HostDevice(Device):
    """Main memory. Several slots stand for several CPU "devices" sharing it."""

    kind = "cpu"

    @property
    def xp(self):
        return np

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def copy(self, dst, src) -> None:
        if not isinstance(src, np.ndarray):  # a GPU array: brought over by its own GPU
            from .cuda.device import to_numpy
            src = to_numpy(src)
        np.copyto(dst, src, casting="unsafe")

    def owns(self, array) -> bool:
        return isinstance(array, np.ndarray)


_HOSTS: list[HostDevice] = []


def host_device(slot: int = 0) -> HostDevice:
    """The shared HostDevice for `slot` (devices are compared by value; this avoids churn)."""
    while len(_HOSTS) <= slot:
        _HOSTS.append(HostDevice(0, len(_HOSTS)))
    return _HOSTS[slot]

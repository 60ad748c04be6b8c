"""A logging stand-in for a GPU `Device` whose arrays are NumPy arrays.

It lets the stream and event discipline of GPU code paths be checked on the host: which
stream is current when an array is filled, and the order of waits, enters, leaves and
synchronisations, all appended to one shared `log`.
"""
from __future__ import annotations

import contextlib

import numpy as np

import gpukv


class _Context:
    """`with` makes `name` the current one of `kind` ('device' or 'stream') in `state`."""

    def __init__(self, state: dict, kind: str, name: str):
        self.state, self.kind, self.name = state, kind, name
        self.saved: list = []

    def __enter__(self):
        self.saved.append(self.state.get(self.kind))
        self.state[self.kind] = self.name
        return self

    def __exit__(self, *exc):
        self.state[self.kind] = self.saved.pop()
        return False


class StreamCheckedArray(np.ndarray):
    """A NumPy array whose `fill` logs the stream current at the time."""

    def fill(self, value):
        dev = self.fake_device
        dev.log.append(("fill", dev.name, dev.current.get("stream")))
        super().fill(value)


class FakeGpu(gpukv.device.Device):
    """A "GPU" holding NumPy arrays, logging every ordering call into `log`."""

    kind = "gpu"
    asynchronous = True
    peer_links = True
    supports_nccl = True

    def __init__(self, physical: int, log: list, current: dict, slot: int = 0):
        super().__init__(physical, slot)
        self.log, self.current = log, current
        self.name = f"gpu{physical}.{slot}"
        self.cuda_device = _Context(current, "device", self.name)
        self.stream = _Context(current, "stream", self.name)

    xp = property(lambda self: np)

    @contextlib.contextmanager
    def activate(self):
        with self.cuda_device, self.stream:
            yield

    def empty(self, shape, dtype):
        with self.cuda_device, self.stream:
            array = np.empty(shape, dtype).view(StreamCheckedArray)
        array.fake_device = self
        return array

    def copy(self, dst, src) -> None:
        self.log.append(("copy", self.name))
        np.copyto(dst, np.asarray(src), casting="unsafe")

    def owns(self, array) -> bool:
        return isinstance(array, np.ndarray)

    def wait_for(self, other) -> None:
        if other.kind == "gpu" and other is not self:
            self.log.append(("wait_for", self.name, other.name))

    def enter(self, marks=None) -> None:
        self.log.append(("enter", self.name))

    def record(self):
        self.log.append(("record", self.name))
        return self.name  # (the event: which device's work it marks)

    def wait_event(self, event) -> None:
        if event is not None:
            self.log.append(("wait_event", self.name, event))

    def leave(self) -> None:
        self.log.append(("leave", self.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))

"""The device abstraction every strategy is written against."""
from __future__ import annotations

from abc import ABC, abstractmethod


class Device(ABC):
    """One place arrays live: the host, or one (possibly virtual) GPU.

    `physical` is the id of the memory the arrays live in (0 for the host, the CUDA
    ordinal for a GPU); `slot` tells apart several logical devices that share it
    (host "devices" in tests, virtual GPUs on one physical GPU). Two devices with the
    same `physical` share memory, so copies between them are plain device copies.
    """

    kind: str = ""

    def __init__(self, physical: int = 0, slot: int = 0):
        self.physical = physical
        self.slot = slot

    @property
    @abstractmethod
    def xp(self):
        """The array module (numpy or cupy) of this device."""

    @abstractmethod
    def empty(self, shape, dtype):
        """A new uninitialised array on this device."""

    @abstractmethod
    def copy(self, dst, src) -> None:
        """Copy `src` (on any device) into `dst` (on this device), casting if needed."""

    @abstractmethod
    def owns(self, array) -> bool:
        """Whether `array` lives in this device's memory."""

    def zeros(self, shape, dtype):
        out = self.empty(shape, dtype)
        out.fill(0)
        return out

    def cast(self, array, dtype):
        """A copy of `array` (which lives here) converted to `dtype`."""
        out = self.empty(array.shape, dtype)
        self.copy(out, array)
        return out

    def to_local(self, array):
        """`array` itself if it lives here, else a copy on this device."""
        if self.owns(array):
            return array
        out = self.empty(array.shape, array.dtype)
        self.copy(out, array)
        return out

    def synchronize(self) -> None:
        """Wait until all work queued on this device is done (host: nothing to wait for)."""

    def wait_for(self, other: "Device") -> None:
        """Order later work here after the work queued so far on `other` (host: no-op)."""

    def __eq__(self, other):
        return (type(self) is type(other) and self.physical == other.physical
                and self.slot == other.slot)

    def __hash__(self):
        return hash((self.kind, self.physical, self.slot))

    def __repr__(self):
        slot = f".{self.slot}" if self.slot else ""
        return f"{self.kind}({self.physical}{slot})"

"""The interface every reduction strategy implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from ..device import Device


class ReduceJob(NamedTuple):
    """Sum `sources` (arrays on `devices`) into `out`, an array on `home`."""
    key: object
    sources: list
    devices: Sequence[Device]
    home: Device
    out: object


class BroadcastJob(NamedTuple):
    """Copy `src` (on `home`) into every array of `outs` (on `devices`)."""
    key: object
    src: object
    home: Device
    outs: list
    devices: Sequence[Device]


class Strategy(ABC):
    """How the values of a key travel to its home device and back.

    A strategy sees only the device layer, so the same object runs on host devices in
    CI and on GPUs. `reduce_many`/`broadcast_many` take every key of one call, so a
    strategy may batch them (one grouped NCCL call, one multi-tensor kernel).
    """

    name: str = ""
    #: the constructor's keyword options a store passes on (`create(..., array_bound=...)`)
    store_options: tuple[str, ...] = ()
    #: named by the caller (argument or GPUKV_STRATEGY): the store sends host arrays
    #: through it too, instead of the plain host sum
    explicit: bool = False

    @abstractmethod
    def reduce(self, job: ReduceJob) -> None:
        """Write the sum of `job.sources` into `job.out` (accumulating narrow floats in fp32)."""

    @abstractmethod
    def broadcast(self, job: BroadcastJob) -> None:
        """Write `job.src` into every array of `job.outs`."""

    def reduce_many(self, jobs: list[ReduceJob]) -> None:
        for job in jobs:
            self.reduce(job)

    def broadcast_many(self, jobs: list[BroadcastJob]) -> None:
        for job in jobs:
            self.broadcast(job)

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"

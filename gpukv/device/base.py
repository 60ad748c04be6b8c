"""The device abstraction every strategy, sparse value and optimizer is written against.

Callers use a device's verbs and never ask which kind of device it is:

- memory: `empty`, `zeros`, `copy`, `cast`, `to_local`, `to_host`, `fill0`, `owns`,
  `readable`;
- work: `sum_into` (the fused k-way sum of many keys), `tree_sum_into` (the same in the
  canonical order of `gpukv.canonical`), `copy_many`, `segment_sum`;
- order: `activate`, `enter` / `leave`, `record` / `wait_event`, `wait_for`,
  `synchronize`;
- staging through main memory: `host_buffer`, `to_host_async`, `from_host_async`;
- capabilities: `host_memory`, `asynchronous`, `peer_links`, `supports_nccl`,
  `link_index`, `primary`.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from .._env import positive_int
from .._errors import DeviceError


class Term:
    """One addend of a fused sum: a 1-D array and whether it has the out's dtype."""

    __slots__ = ("array", "same")

    def __init__(self, array, same: bool):
        self.array = array
        self.same = same  # True: dtype U of the out (a partial sum); False: dtype T


class SumItem(NamedTuple):
    """`out = sum(a) + sum(b)`, elementwise, accumulated in float32 for 16-bit outs.

    `a`: arrays of one dtype T (any supported dtype); `b`: arrays of `out`'s dtype,
    which may include `out` itself (accumulate in place). All 1-D, contiguous and of
    `out`'s length. With one entry in `a` and none in `b` this is a copy with a cast.
    """
    out: object
    a: tuple
    b: tuple


def sum_items(out, terms) -> list:
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


class Device(ABC):
    """One place arrays live: the host, or one (possibly virtual) GPU.

    `physical` is the id of the memory the arrays live in (0 for the host, the CUDA
    ordinal for a GPU); `slot` tells apart several logical devices that share it
    (host "devices" in tests, virtual GPUs on one physical GPU). Two devices with the
    same `physical` share memory, so copies between them are plain device copies.

    The defaults below are those of a device whose work is done when a call returns:
    nothing to order, nothing to make current.
    """

    kind: str = ""
    #: arrays are NumPy arrays in main memory: the host reads them without a copy
    host_memory: bool = False
    #: work is queued (on a stream) and completes later; events order it
    asynchronous: bool = False
    #: devices of this kind are joined by links the hardware can be asked about
    peer_links: bool = False
    #: NCCL collectives can run between devices of this kind on different memories
    supports_nccl: bool = False

    def __init__(self, physical: int = 0, slot: int = 0):
        self.physical = physical
        self.slot = slot
        self._hash = hash((self.kind, physical, slot))  # devices key the calls' dicts

    # ---------------------------------------------------------------- memory
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

    def readable(self, array) -> bool:
        """Whether this device's kernels can read `array` where it lies."""
        return self.owns(array)

    def zeros(self, shape, dtype):
        out = self.empty(shape, dtype)
        out.fill(0)
        return out

    def fill0(self, out) -> None:
        """Set every element of `out` (an array of this device) to zero, in order here."""
        out.fill(0)

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

    def to_host(self, array) -> np.ndarray:
        """`array` as a NumPy array, copied synchronously when it is not one already."""
        return array if isinstance(array, np.ndarray) else np.asarray(array)

    @property
    def link_index(self) -> int:
        """This device's row in a full link matrix of devices of its kind."""
        return self.physical

    @property
    def primary(self) -> Device:
        """The logical device of slot 0 on this device's memory."""
        return self

    # ------------------------------------------------------------------ work
    def sum_into(self, jobs) -> None:
        """On this device: out = sum(terms) for every (out, terms) of `jobs`, in few
        launches. `out` is 1-D contiguous here; each term is a `Term`, which may be `out`
        itself (accumulate in place); no terms: zeros. The caller has already ordered
        this device after the devices the terms live on."""
        raise NotImplementedError(f"{self!r} has no fused sum")

    def tree_sum_into(self, jobs) -> None:
        """On this device: out = the canonical tree sum (`gpukv.canonical`) of `arrays`
        for every (out, arrays) of `jobs`, the arrays its leaves in the order given.

        `out` is 1-D contiguous here; the arrays are 1-D contiguous of out's length, on
        any device, of any dtype (e.g. float16 arrays into a float32 out). Every pair is
        added in the accumulation dtype of out (float32 for 16-bit floats) and the result
        rounded into `out` once, so the bits depend only on the arrays and their order.
        One array: a copy with a cast (a bit copy when the dtypes agree); none: zeros.
        The caller has already ordered this device after the devices the arrays live on.
        """
        raise NotImplementedError(f"{self!r} has no canonical sum")

    def copy_many(self, pairs) -> None:
        """On this device: dst[...] = src for every (dst, src) pair of 1-D contiguous
        arrays (dst here, src anywhere), casting to dst's dtype."""
        for dst, src in pairs:
            self.copy(dst, src)

    def segment_sum(self, data, bounds):
        """Rows of `data` (here, rows first) summed per run [bounds[s], bounds[s+1]),
        each run's rows added in order from its first, in the accumulation dtype of
        data's dtype (float32 for 16-bit floats)."""
        raise NotImplementedError(f"{self!r} has no segment sum")

    # ----------------------------------------------------------------- order
    def activate(self):
        """A context manager making this device and its stream current for the work
        queued inside it (a device without streams: nothing to make current)."""
        return contextlib.nullcontext()

    @property
    def on_current_stream(self) -> bool:
        """Whether the caller's later work follows the work queued here without `leave`
        (it is queued on the caller's current stream)."""
        return False

    def enter(self, marks: dict | None = None) -> None:  # noqa: B027 (nothing to order)
        """Order this device's later work after the caller's work on its current stream.
        `marks`: what one call's `enter`s recorded so far, which they may share."""

    def leave(self) -> None:  # noqa: B027
        """Order the caller's later work on its current stream after the work queued here."""

    def record(self):
        """An event marking the work queued here so far (None: nothing is queued)."""
        return None

    def wait_event(self, event) -> None:
        """Order this device's later work after `event` (from `record`; None: nothing)."""
        if event is not None:
            event.synchronize()

    def wait_for(self, other: Device) -> None:
        """Order later work here after the work queued so far on `other`.

        A device without streams has nothing to order: it waits (host synchronisation)
        for the work queued on `other`."""
        if other is not self:
            other.synchronize()

    def synchronize(self) -> None:  # noqa: B027
        """Wait until all work queued on this device is done (host: nothing to wait for)."""

    # --------------------------------------------------- staging in main memory
    def host_buffer(self, shape, dtype) -> np.ndarray:
        """A NumPy array this device can copy to and from asynchronously."""
        return np.empty(shape, dtype)

    def to_host_async(self, array) -> np.ndarray:
        """`array` (on this device) in main memory; the copy may still be queued here,
        so the host reads it only after `synchronize()`."""
        return self.to_host(array)

    def from_host_async(self, dst, host) -> None:
        """Copy NumPy `host` into `dst` (on this device) in order here; `host` is kept
        until the copy has run."""
        self.copy(dst, host)

    # ----------------------------------------------------------------- identity
    def __eq__(self, other):
        return (type(self) is type(other) and self.physical == other.physical
                and self.slot == other.slot)

    def __hash__(self):
        return self._hash

    def __repr__(self):
        slot = f".{self.slot}" if self.slot else ""
        return f"{self.kind}({self.physical}{slot})"


def virtual_gpus() -> int | None:
    """`GPUKV_VIRTUAL_GPUS` as a positive int (None when unset); DeviceError when malformed."""
    return positive_int("GPUKV_VIRTUAL_GPUS", DeviceError)

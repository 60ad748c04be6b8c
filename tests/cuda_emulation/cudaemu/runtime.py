"""Devices, streams and events of the emulated GPUs (`cupy.cuda.Device`, `Stream`, `Event`,
`cupy.cuda.runtime`).

Work issued to a stream is queued in stream order (streams.py) and runs when forced or
when the schedule picks it: an event completes when its stream reaches it, a wait orders
the waiting stream after the event, a synchronisation makes the host wait. Kept too is
CuPy's bookkeeping: the current device of each host thread, the current stream of each
device, and which device a stream or an event belongs to (an event recorded on a stream
of another GPU, a stream entered under another GPU, a kernel launched on one, fail as in
CUDA). Counters of streams and events made let tests see what the code under test creates.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
import types

from numpy import integer as np_integer

from . import machine, memory, streams
from .errors import (
    INVALID_DEVICE,
    INVALID_VALUE,
    PEER_ALREADY_ENABLED,
    PEER_UNSUPPORTED,
    CUDARuntimeError,
)

_thread = threading.local()
_handles = itertools.count(0x7000)
_counts_lock = threading.Lock()
#: what has been created so far: "stream", "event", "timed_event"
created: collections.Counter = collections.Counter()


def _count(what: str) -> None:
    with _counts_lock:
        created[what] += 1


def _check_device(device_id: int) -> int:
    if not 0 <= device_id < machine.MACHINE.gpus:
        raise CUDARuntimeError(INVALID_DEVICE, f"device {device_id}")
    return device_id


def current_device() -> int:
    """The current device of this host thread (CUDA's is per thread; 0 at first)."""
    return getattr(_thread, "device", 0)


def _set_current_device(device_id: int) -> None:
    _thread.device = _check_device(device_id)


# ------------------------------------------------------------------------ devices
class Device:
    """A GPU: `with Device(i):` makes it the current device of this thread."""

    def __init__(self, device=None):
        if device is None:
            device = current_device()
        self.id = int(device)
        self._saved: list = []

    def __enter__(self):
        _check_device(self.id)
        self._saved.append(current_device())
        _set_current_device(self.id)
        return self

    def __exit__(self, *exc):
        _thread.device = self._saved.pop()
        return False

    def use(self):
        _set_current_device(self.id)
        return self

    def synchronize(self):
        _check_device(self.id)
        streams.synchronize_device(self.id)

    @property
    def compute_capability(self) -> str:
        return "90"

    @property
    def pci_bus_id(self) -> str:
        return f"0000:{self.id + 1:02x}:00.0"

    def __int__(self):
        return self.id

    def __index__(self):
        return self.id

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    __hash__ = None  # CuPy's Device is not hashable

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def get_device_id() -> int:
    return current_device()


# ------------------------------------------------------------------------ streams
class _BaseStream:
    """What CuPy's Stream and ExternalStream share; `device_id` -1: the current device's."""

    ptr: int
    device_id: int

    def _device(self) -> int:
        return current_device() if self.device_id == -1 else self.device_id

    def _check_device_match(self) -> None:
        if self.device_id not in (-1, current_device()):
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) "
                               f"does not match with the current device "
                               f"({current_device()})")

    def __enter__(self):
        self._check_device_match()
        device = self._device()
        stacks = _stream_stacks()
        stacks.setdefault(device, []).append(_current_streams().get(device))
        _current_streams()[device] = self
        return self

    def __exit__(self, *exc):
        device = self._device()
        previous = _stream_stacks()[device].pop()
        if previous is None:
            _current_streams().pop(device, None)
        else:
            _current_streams()[device] = previous
        return False

    def use(self):
        self._check_device_match()
        _current_streams()[self._device()] = self
        return self

    def record(self, event=None):
        """Record `event` (a new one when None) on this stream; it completes when the
        stream reaches it."""
        if event is None:
            event = Event()
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        if not isinstance(event, Event):
            raise AttributeError(f"'{type(event).__name__}' object has no attribute 'ptr'")
        if event.mark is None:
            return  # waiting for an event never recorded waits for nothing, as in CUDA
        streams.wait(lane_of(self), event.mark)

    def synchronize(self) -> None:
        streams.synchronize(lane_of(self))

    @property
    def done(self) -> bool:
        return streams.lane_done(lane_of(self))

    def __eq__(self, other):
        return isinstance(other, _BaseStream) and (self.ptr, self.device_id) == (
            other.ptr, other.device_id)

    def __hash__(self):
        return hash((self.ptr, self.device_id))

    def __repr__(self):
        return f"<Stream {self.ptr:#x} (device {self.device_id})>"


class Stream(_BaseStream):
    """A stream of the current device (`null=True`: the legacy default stream)."""

    null: Stream
    ptds: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        if null or ptds:
            self.ptr, self.device_id = (0 if null else 2), -1
        else:
            self.ptr, self.device_id = next(_handles), current_device()
            _stream_devices[self.ptr] = self.device_id
            _count("stream")
        self.non_blocking = non_blocking


class ExternalStream(_BaseStream):
    """A stream made elsewhere, known by its handle."""

    def __init__(self, ptr: int, device_id: int = -1):
        self.ptr, self.device_id = int(ptr), int(device_id)


_stream_devices: dict = {}  # handle -> GPU of every stream made by Stream()


def stream_device(handle: int) -> int:
    """The GPU a stream handle belongs to (the default streams: the current GPU's)."""
    return _stream_devices.get(int(handle), current_device())


def lane_of(stream=None, device: int | None = None) -> streams.Lane:
    """The queue of `stream` (None: the current stream of `device`, by default the
    current GPU); a default stream is the one of `device`."""
    if device is None:
        device = current_device()
    if stream is None:
        stream = get_current_stream(device)
    owner = stream.device_id if getattr(stream, "device_id", -1) != -1 else device
    ptr = int(stream.ptr)
    return streams.lane(owner, ptr, blocking=ptr in (0, 2) or not getattr(
        stream, "non_blocking", True))


Stream.null = Stream(null=True)
Stream.ptds = Stream(ptds=True)


def _current_streams() -> dict:
    streams = getattr(_thread, "streams", None)
    if streams is None:
        streams = _thread.streams = {}
    return streams


def _stream_stacks() -> dict:
    stacks = getattr(_thread, "stream_stacks", None)
    if stacks is None:
        stacks = _thread.stream_stacks = {}
    return stacks


def get_current_stream(device_id: int = -1):
    """The current stream of `device_id` (-1: the current device) in this thread."""
    if not isinstance(device_id, (int, np_integer)):
        raise TypeError("an integer is required")
    device = current_device() if device_id == -1 else int(device_id)
    return _current_streams().get(device, Stream.null)


# ------------------------------------------------------------------------- events
class Event:
    """A CUDA event. Recording stamps the host clock (work is done when it is issued)."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self.disable_timing = disable_timing
        self.device = current_device()  # an event belongs to the GPU current when made
        self.ptr = next(_handles)
        self.recorded_on = None
        self.mark = None
        self.time = None
        _count("event")
        if not disable_timing:
            _count("timed_event")

    def record(self, stream=None) -> None:
        if stream is None:
            stream = get_current_stream()
        on = stream._device()
        if on != self.device:  # cudaEventRecord: the event and stream of one GPU
            raise CUDARuntimeError(400, f"an event of GPU {self.device} recorded on a stream "
                                        f"of GPU {on}")
        self.recorded_on = stream
        self.mark = streams.record(lane_of(stream))
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        if self.mark is not None:
            streams.wait_host(self.mark)

    @property
    def done(self) -> bool:
        return self.mark is None or streams.query(self.mark)


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded, timing-enabled events."""
    if start.disable_timing or end.disable_timing or start.time is None or end.time is None:
        raise CUDARuntimeError(400, "an event without timing, or never recorded")
    return (end.time - start.time) * 1e3


# ------------------------------------------------------------------------ runtime
_peer_lock = threading.Lock()
_peer_enabled: set = set()  # (reader, owner) pairs enabled so far


def peer_enabled(reader: int, owner: int) -> bool:
    return reader == owner or (reader, owner) in _peer_enabled


def _get_device_count() -> int:
    return machine.MACHINE.gpus


def _get_device_properties(device_id: int) -> dict:
    _check_device(device_id)
    m = machine.MACHINE
    return {"name": m.name.encode(), "totalGlobalMem": m.memory_bytes, "major": 9,
            "minor": 0, "multiProcessorCount": 4, "clockRate": 1_000_000,
            "memoryClockRate": 1_000_000, "memoryBusWidth": 256, "pciBusID": device_id + 1,
            "pciDeviceID": 0, "pciDomainID": 0, "warpSize": 32,
            "maxThreadsPerBlock": 1024, "sharedMemPerBlock": 48 << 10}


def _device_can_access_peer(device: int, peer: int) -> int:
    _check_device(device)
    _check_device(peer)
    return int(device != peer and machine.MACHINE.can_access_peer(device, peer))


def _device_enable_peer_access(peer: int, flags: int = 0) -> None:
    reader = current_device()
    if not _device_can_access_peer(reader, peer):
        raise CUDARuntimeError(PEER_UNSUPPORTED, f"GPU {reader} -> GPU {peer}")
    with _peer_lock:
        if (reader, peer) in _peer_enabled:
            raise CUDARuntimeError(PEER_ALREADY_ENABLED)
        _peer_enabled.add((reader, peer))


def _device_disable_peer_access(peer: int) -> None:
    with _peer_lock:
        if (current_device(), peer) not in _peer_enabled:
            raise CUDARuntimeError(705)
        _peer_enabled.discard((current_device(), peer))


def _mem_get_info() -> tuple:
    total = machine.MACHINE.memory_bytes
    return total - memory.used_bytes(current_device()), total


class _PointerAttributes:
    def __init__(self, type_, device, device_pointer, host_pointer):
        self.type, self.device = type_, device
        self.devicePointer, self.hostPointer = device_pointer, host_pointer


def _pointer_get_attributes(ptr: int) -> _PointerAttributes:
    mem = memory.find(int(ptr))
    if mem is None:
        return _PointerAttributes(0, -2, 0, int(ptr))   # cudaMemoryTypeUnregistered
    if mem.device_id is None:
        return _PointerAttributes(1, current_device(), int(ptr), int(ptr))  # pinned host
    return _PointerAttributes(2, mem.device_id, int(ptr), 0)  # device


def _set_device(device_id: int) -> None:
    _set_current_device(int(device_id))


runtime = types.SimpleNamespace(
    CUDARuntimeError=CUDARuntimeError,
    getDeviceCount=_get_device_count,
    getDevice=current_device,
    setDevice=_set_device,
    getDeviceProperties=_get_device_properties,
    deviceCanAccessPeer=_device_can_access_peer,
    deviceEnablePeerAccess=_device_enable_peer_access,
    deviceDisablePeerAccess=_device_disable_peer_access,
    deviceSynchronize=lambda: streams.synchronize_device(current_device()),
    memGetInfo=_mem_get_info,
    runtimeGetVersion=lambda: 12090,
    driverGetVersion=lambda: 12090,
    pointerGetAttributes=_pointer_get_attributes,
    memoryTypeUnregistered=0, memoryTypeHost=1, memoryTypeDevice=2, memoryTypeManaged=3,
    errorInvalidValue=INVALID_VALUE, errorPeerAccessAlreadyEnabled=PEER_ALREADY_ENABLED,
    is_hip=False,
)

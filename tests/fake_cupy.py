"""A stand-in for the parts of CuPy (and its NCCL module) that the calibration uses.

Nothing is computed: each stream keeps a simulated device clock that every kernel, copy
and NCCL call advances by a known cost (latency + bytes / bandwidth), events read that
clock, and waits merge clocks. A measurement run against it must recover those costs.
"""
from __future__ import annotations

import itertools
import types

import numpy as np

_PTRS = itertools.count(1 << 20, 1 << 12)


class Costs:
    """The simulated machine, in seconds and bytes per second."""

    def __init__(self, *, kernel_s=3e-6, hbm=2e12, same=(2e-6, 1e12), host=(8e-6, 20e9),
                 links=None, nccl_s=20e-6):
        self.kernel_s, self.hbm, self.same, self.host = kernel_s, hbm, same, host
        self.links = links or {}   # link weight -> (latency s, bytes/s)
        self.nccl_s = nccl_s


class FakeCupy:
    """`FakeCupy(matrix, costs)`: len(matrix) GPUs whose peer copies cost by link weight."""

    float32 = np.float32
    __version__ = "0.0-fake"

    def __init__(self, matrix, costs: Costs | None = None, name: str = "Fake GPU"):
        self.matrix = np.asarray(matrix, dtype=float)
        self.costs = costs or Costs()
        self.count = len(self.matrix)
        self.current_device = 0
        self.current_stream: dict = {}
        self.null = {}
        self.streams: dict = {}
        fake = self
        self.null = {d: Stream(fake, d, ptr=0) for d in range(self.count)}

        class Device:
            def __init__(self, d=None):
                self.id = fake.current_device if d is None else d
                self._saved = []

            def __enter__(self):
                self._saved.append(fake.current_device)
                fake.current_device = self.id
                return self

            def __exit__(self, *exc):
                fake.current_device = self._saved.pop()
                return False

            def synchronize(self):
                pass

        class Runtime:
            @staticmethod
            def getDeviceCount():
                return fake.count

            @staticmethod
            def getDeviceProperties(i):
                return {"name": name.encode(), "totalGlobalMem": 80 << 30, "major": 9,
                        "minor": 0}

            @staticmethod
            def deviceCanAccessPeer(a, b):
                return int(fake.matrix[a, b] > 0)

            runtimeGetVersion = staticmethod(lambda: 12090)
            driverGetVersion = staticmethod(lambda: 12090)

        def get_elapsed_time(a, b):
            return (b.t - a.t) * 1e3

        def alloc_pinned_memory(nbytes):
            return types.SimpleNamespace(ptr=next(_PTRS), size=nbytes)

        self.cuda = types.SimpleNamespace(
            Device=Device, runtime=Runtime, Event=Event, get_elapsed_time=get_elapsed_time,
            alloc_pinned_memory=alloc_pinned_memory,
            Stream=lambda non_blocking=False: Stream(fake, fake.current_device),
            get_current_stream=lambda d=None: fake.stream_now(
                fake.current_device if d is None else d))
        self.nccl = FakeNccl(self)

    def stream_now(self, d: int):
        return self.current_stream.get(d) or self.null[d]

    def empty(self, n, dtype=np.float32):
        return FakeArray(self, self.current_device, int(n), np.dtype(dtype))

    def add(self, a, b, out):
        stream = self.stream_now(self.current_device)
        stream.t += self.costs.kernel_s + 3 * out.nbytes / self.costs.hbm

    def copy_cost(self, src, dst, nbytes: int) -> float:
        """Seconds of a copy of nbytes from src to dst (device ids, or 'host')."""
        if "host" in (src, dst):
            lat, bw = self.costs.host
        elif src == dst:
            lat, bw = self.costs.same
        else:
            lat, bw = self.costs.links[float(self.matrix[src, dst])]
        return lat + nbytes / bw


class Stream:
    def __init__(self, fake, device: int, ptr: int | None = None):
        self.fake, self.device = fake, device
        self.ptr = next(_PTRS) if ptr is None else ptr
        self.t = 0.0
        self._saved = []
        fake.streams[self.ptr, device] = self

    def __enter__(self):
        self._saved.append(self.fake.current_stream.get(self.device))
        self.fake.current_stream[self.device] = self
        return self

    def __exit__(self, *exc):
        self.fake.current_stream[self.device] = self._saved.pop()
        return False

    def wait_event(self, event):
        self.t = max(self.t, event.t)


class Event:
    def __init__(self, disable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = stream.t

    def synchronize(self):
        pass


class MemPtr:
    def __init__(self, array):
        self.array = array
        self.ptr = next(_PTRS)
        self.device_id = array.device.id

    def _go(self, stream, seconds):
        stream.t += seconds

    def copy_from_device_async(self, src, nbytes, stream):
        self._go(stream, self.array.fake.copy_cost(src.device_id, self.device_id, nbytes))

    def copy_to_host_async(self, ptr, nbytes, stream):
        self._go(stream, self.array.fake.copy_cost(self.device_id, "host", nbytes))

    def copy_from_host_async(self, ptr, nbytes, stream):
        self._go(stream, self.array.fake.copy_cost("host", self.device_id, nbytes))


class FakeArray:
    def __init__(self, fake, device: int, size: int, dtype):
        self.fake = fake
        self.device = types.SimpleNamespace(id=device)
        self.size, self.dtype = size, dtype
        self.nbytes = size * dtype.itemsize
        self.data = MemPtr(self)

    def fill(self, value):
        pass


class FakeNccl:
    NCCL_FLOAT32 = 7
    NCCL_SUM = 0
    available = True

    def __init__(self, fake):
        self.fake = fake
        fake_nccl = self

        class Comm:
            def __init__(self, device):
                self.device = device

            def allReduce(self, send, recv, count, dtype, op, stream_ptr):
                stream = fake.streams[stream_ptr, self.device]
                stream.t += fake.costs.nccl_s

        class NcclCommunicator:
            @staticmethod
            def initAll(devices):
                fake_nccl.ranks = list(devices)
                return [Comm(d) for d in devices]

        self.NcclCommunicator = NcclCommunicator
        self.groups = 0

    def groupStart(self):
        self.groups += 1

    def groupEnd(self):
        pass

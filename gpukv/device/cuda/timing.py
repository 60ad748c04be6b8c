"""GPU time measured with CUDA events, for the benchmark and the calibration.

A clock's `start()` and `stop()` return opaque marks; `elapsed(pairs)` turns a list of
(start, stop) marks into seconds, once the GPUs have reached the last one.
"""
from __future__ import annotations

from . import device as _device

__all__ = ["CudaClock", "clock_for_devices", "clock_for_stream_handles"]


class CudaClock:
    """CUDA-event time of work queued on several streams, possibly on several GPUs.

    `streams` is a list of (device id, stream); `cp` is CuPy (or a stand-in; default the
    CuPy gpukv uses). `start` records an event on the first stream and makes every other
    stream wait for it; `stop` makes the first stream wait for every other one and
    records there, so each interval spans all of their work.
    """

    def __init__(self, streams, cp=None):
        self.cp = _device.cupy_module() if cp is None else cp
        seen, self.streams = set(), []
        for dev, stream in streams:  # the null stream is 0 on every GPU: key by both
            if (dev, stream.ptr) not in seen:
                seen.add((dev, stream.ptr))
                self.streams.append((dev, stream))

    def start(self):
        cp = self.cp
        dev0, s0 = self.streams[0]
        with cp.cuda.Device(dev0):
            event = cp.cuda.Event()
            event.record(s0)
        for dev, stream in self.streams[1:]:
            with cp.cuda.Device(dev):
                stream.wait_event(event)
        return event

    def stop(self):
        cp = self.cp
        dev0, s0 = self.streams[0]
        for dev, stream in self.streams[1:]:
            with cp.cuda.Device(dev):
                done = cp.cuda.Event(disable_timing=True)
                done.record(stream)
            with cp.cuda.Device(dev0):
                s0.wait_event(done)
        with cp.cuda.Device(dev0):
            event = cp.cuda.Event()
            event.record(s0)
        return event

    def elapsed(self, pairs) -> list[float]:
        """Seconds of each (start, stop) pair, waiting for the last stop first."""
        if pairs:
            pairs[-1][1].synchronize()
        return [self.cp.cuda.get_elapsed_time(a, b) / 1e3 for a, b in pairs]


def clock_for_devices(devices) -> CudaClock:
    """A clock spanning the streams of the logical GPUs `devices` (CudaDevice objects)
    and CuPy's current stream of each of their physical GPUs, where callers queue work
    outside gpukv."""
    cp = _device.cupy_module()
    streams = [(d.physical, d.stream) for d in devices]
    streams += [(p, cp.cuda.get_current_stream(p))
                for p in sorted({d.physical for d in devices})]
    return CudaClock(streams, cp)


def clock_for_stream_handles(handles) -> CudaClock:
    """A clock spanning streams another library owns, given as (GPU id, cudaStream_t
    handle) pairs, e.g. PyTorch's `torch.cuda.current_stream(p).cuda_stream`."""
    cp = _device.cupy_module()
    streams = []
    for p, handle in handles:
        with cp.cuda.Device(p):
            streams.append((p, cp.cuda.ExternalStream(handle, p)))
    return CudaClock(streams, cp)

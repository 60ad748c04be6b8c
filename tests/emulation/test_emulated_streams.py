"""The emulated streams queue their work and run it in any order their events allow, and
the race checker reports every pair of unordered accesses to device memory."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from .. import gpu_env

pytestmark = pytest.mark.skipif(not gpu_env.EMULATED, reason="tests of the CUDA emulation")


@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.fixture
def schedule():
    """Switch the schedule for one test (`schedule("adversarial")`); put back after, and
    forget the races the test provoked on purpose."""
    from cudaemu import races, streams
    before = f"seed:{streams.SEED}" if streams.MODE == "seed" else streams.MODE
    yield streams.set_schedule
    for _ in range(2):  # the frees of a test's racy memory are races too
        with contextlib.suppress(races.StreamRaceError):
            streams.drain_all()
    del races.found[:]
    streams.set_schedule(before)


def _stream(cp, device=0):
    with cp.cuda.Device(device):
        return cp.cuda.Stream(non_blocking=True)


# ------------------------------------------------------------------ stream order
def test_queued_work_waits_until_forced(cp, schedule):
    """Under the adversarial schedule a kernel's result is not there until something
    forces its stream: an event reports not done once, then done when asked again."""
    schedule("adversarial")
    s = _stream(cp)
    a = cp.zeros(4, cp.float32)
    s.wait_event(cp.cuda.get_current_stream().record())
    a.data.memset_async(0, 16, s)
    event = s.record()
    assert not event.done
    assert event.done  # asked a second time: the GPU got on with it


def test_an_event_wait_orders_another_stream(cp, schedule):
    """A copy on stream B after `wait_event` of an event recorded behind a fill on stream A
    reads the filled values, in every schedule."""
    schedule("adversarial")
    a_stream, b_stream = _stream(cp), _stream(cp)
    src, dst = cp.zeros(8, cp.float32), cp.zeros(8, cp.float32)
    cp.cuda.Device(0).synchronize()
    host = np.arange(8, dtype=np.float32)
    pinned = _pinned(cp, host)
    src.data.copy_from_host_async(pinned.ctypes.data, src.nbytes, a_stream)
    b_stream.wait_event(a_stream.record())
    dst.data.copy_from_device_async(src.data, src.nbytes, b_stream)
    b_stream.synchronize()
    np.testing.assert_array_equal(dst.get(stream=b_stream), host)


def _pinned(cp, values):
    import cupyx
    out = cupyx.empty_pinned(values.shape, values.dtype)
    out[...] = values
    return out


def test_an_async_copy_reads_pinned_memory_when_it_runs(cp, schedule):
    """A queued copy from pinned memory reads the bytes there when it runs: the host
    overwriting the buffer before then changes what arrives (as on a GPU), and the
    checker says so."""
    from cudaemu.races import StreamRaceError
    schedule("adversarial")
    s = _stream(cp)
    dst = cp.zeros(4, cp.float32)
    cp.cuda.Device(0).synchronize()
    pinned = _pinned(cp, np.ones(4, np.float32))
    dst.data.copy_from_host_async(pinned.ctypes.data, dst.nbytes, s)
    pinned[...] = 7
    with pytest.raises(StreamRaceError, match="the host wrote .* while a copy from it"):
        s.synchronize()
    np.testing.assert_array_equal(dst.get(stream=s), np.full(4, 7, np.float32))


def test_a_seed_reproduces_its_schedule(cp, schedule):
    """The same seed runs the same queued work in the same order; another seed may not."""
    from cudaemu import streams

    def order(seed):
        schedule(f"seed:{seed}")
        ran = []
        lanes = [_stream(cp) for _ in range(3)]
        for i in range(12):
            streams.issue(streams.lane(0, lanes[i % 3].ptr, False),
                          lambda i=i: ran.append(i), f"step {i}")
        streams.drain_all()
        return ran

    first = order(5)
    assert order(5) == first
    assert sorted(first) == list(range(12))


def test_the_legacy_default_stream_orders_blocking_streams(cp, schedule):
    """Work on a blocking stream waits for the default stream's earlier work (CUDA's
    legacy default stream); a non-blocking stream's work does not."""
    from cudaemu import runtime, streams
    schedule("adversarial")
    blocking = cp.cuda.Stream()
    null = runtime.lane_of(cp.cuda.Stream.null, 0)
    first = streams.issue(null, None, "on the default stream")
    streams.issue(runtime.lane_of(blocking, 0), None, "on a blocking stream")
    streams.synchronize(runtime.lane_of(blocking, 0))
    assert first.done
    second = streams.issue(null, None, "on the default stream again")
    streams.synchronize(runtime.lane_of(_stream(cp), 0))
    assert not second.done


@pytest.mark.parametrize("name", ["adversarial", "issue"])
def test_a_kernel_run_at_once_on_a_blocking_stream_orders_the_default_streams_work(
        cp, schedule, name):
    """A CuPy kernel on a blocking stream (which the emulation runs at once, queueing
    nothing) writes an array the default stream then reads: CUDA's legacy default stream
    orders them, and the checker finds no race."""
    schedule(name)
    with cp.cuda.Stream():  # blocking
        x = cp.zeros(64, cp.float32)
        x += 1
    assert float((x * 2).get()[0]) == 2.0


# ------------------------------------------------------------------ the checker
def test_unordered_write_and_read_are_a_race_naming_both(cp, schedule):
    """A read on stream B of memory stream A wrote, with no event between them, is a
    StreamRaceError naming both operations, both streams, the allocation and the lines."""
    from cudaemu.races import StreamRaceError
    a_stream, b_stream = _stream(cp), _stream(cp)
    src, dst = cp.zeros(8, cp.float32), cp.zeros(8, cp.float32)
    cp.cuda.Device(0).synchronize()
    src.data.memset_async(0, src.nbytes, a_stream)
    with pytest.raises(StreamRaceError) as raised:
        dst.data.copy_from_device_async(src.data, src.nbytes, b_stream)
    message = str(raised.value)
    assert "write by memset" in message and "read by memcpy device to device" in message
    assert f"stream {a_stream.ptr:#x} of GPU 0" in message
    assert f"stream {b_stream.ptr:#x} of GPU 0" in message
    assert "32-byte allocation" in message and "test_emulated_streams.py" in message


def test_an_event_makes_the_same_accesses_ordered(cp):
    """The same two accesses with an event recorded after the write and waited for before
    the read are no race."""
    a_stream, b_stream = _stream(cp), _stream(cp)
    src, dst = cp.zeros(8, cp.float32), cp.zeros(8, cp.float32)
    cp.cuda.Device(0).synchronize()
    src.data.memset_async(0, src.nbytes, a_stream)
    b_stream.wait_event(a_stream.record())
    dst.data.copy_from_device_async(src.data, src.nbytes, b_stream)
    b_stream.synchronize()


def test_reads_on_two_streams_are_no_race(cp):
    """Two streams reading the same memory need no order between them."""
    a_stream, b_stream = _stream(cp), _stream(cp)
    src = cp.ones(8, cp.float32)
    x, y = cp.zeros(8, cp.float32), cp.zeros(8, cp.float32)
    cp.cuda.Device(0).synchronize()
    x.data.copy_from_device_async(src.data, src.nbytes, a_stream)
    y.data.copy_from_device_async(src.data, src.nbytes, b_stream)
    cp.cuda.Device(0).synchronize()


def test_a_host_read_of_unfinished_writes_is_a_race(cp, schedule):
    """Reading on the default stream what another stream writes, without waiting for it,
    is a race (the host would read memory the stream has not finished writing)."""
    from cudaemu.races import StreamRaceError
    s = _stream(cp)
    a = cp.zeros(8, cp.float32)
    cp.cuda.Device(0).synchronize()
    a.data.memset_async(0, a.nbytes, s)
    with pytest.raises(StreamRaceError, match="read by copy to the host"):
        a.get()


def test_freeing_memory_another_stream_still_reads_is_a_race(cp, schedule):
    """An array freed while a stream other than its own may still read it goes back to
    its stream's pool too early: a StreamRaceError naming the free and the reader."""
    import gc

    from cudaemu import races, streams
    schedule("issue")  # else the queued copy keeps `src` alive until it has run
    s = _stream(cp)
    src, dst = cp.ones(8, cp.float32), cp.zeros(8, cp.float32)
    cp.cuda.Device(0).synchronize()
    dst.data.copy_from_device_async(src.data, src.nbytes, s)
    del src
    gc.collect()
    with pytest.raises(races.StreamRaceError, match="freed on the default stream"):
        streams.settle_frees()


def test_a_kernel_reads_and_writes_through_its_pointer_table(cp, schedule):
    """gpukv's multi-key sum declares what it reads and writes through its pointer table:
    a term another stream is still writing is a race of that kernel."""
    from cudaemu.races import StreamRaceError

    from gpukv.device.base import SumItem as Item
    from gpukv.device.cuda.kernels import multi_sum_gpu
    s = _stream(cp)
    a, out = cp.ones(8, cp.float32), cp.zeros(8, cp.float32)
    cp.cuda.Device(0).synchronize()
    a.data.memset_async(0, a.nbytes, s)
    with pytest.raises(StreamRaceError, match="kernel gpukv_multi_sum_float32_float32"):
        multi_sum_gpu([Item(out, (a,), ())], cp.cuda.get_current_stream())


def test_an_nccl_collective_waits_for_every_ranks_stream(cp, schedule):
    """An all-reduce queued on two GPUs' streams runs once both have reached it: the
    values each rank wrote before it (queued, not run) are the ones summed."""
    from cupy.cuda import nccl
    schedule("adversarial")
    comms = nccl.NcclCommunicator.initAll([0, 1])
    bufs, lanes = [], []
    for d in (0, 1):
        with cp.cuda.Device(d):
            buf = cp.zeros(4, cp.float32)
            cp.cuda.Device(d).synchronize()
            s = cp.cuda.Stream(non_blocking=True)
            buf.data.copy_from_host_async(_pinned(cp, np.full(4, d + 1, np.float32))
                                          .ctypes.data, buf.nbytes, s)
            bufs.append(buf)
            lanes.append(s)
    nccl.groupStart()
    for d, (comm, buf, s) in enumerate(zip(comms, bufs, lanes)):
        with cp.cuda.Device(d):
            comm.allReduce(buf.data.ptr, buf.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           s.ptr)
    nccl.groupEnd()
    for d, (buf, s) in enumerate(zip(bufs, lanes)):
        with cp.cuda.Device(d):
            np.testing.assert_array_equal(buf.get(stream=s), np.full(4, 3, np.float32))


# ------------------------------------------------------- gpukv's work in flight
def test_a_pinned_table_is_not_reused_while_its_copy_is_in_flight(cp, schedule):
    """gpukv's pinned staging buffers for pointer tables: one whose copy has not run is
    not handed out again; once the copy has run, it is."""
    from gpukv.device.cuda import kernels
    from gpukv.device.cuda.runtime import ordering_event
    schedule("adversarial")
    tables = kernels._PinnedTables()
    s = _stream(cp)
    dev = cp.empty(16, cp.int64)
    cp.cuda.Device(0).synchronize()
    first = tables.take(cp, 16)
    first[:] = 1
    dev.data.copy_from_host_async(first.ctypes.data, dev.nbytes, s)
    tables.give(first, ordering_event(s))
    assert tables.take(cp, 16) is not first  # its copy is still queued
    s.synchronize()
    assert tables.take(cp, 16) is first
    np.testing.assert_array_equal(dev.get(stream=s), np.ones(16, np.int64))


def test_past_the_pinned_cap_the_host_waits_for_the_oldest_copies(cp, schedule,
                                                                  monkeypatch):
    """Host buffers kept for copies in flight past PINNED_CAP bytes make the host wait
    for the oldest copies: their events have completed when keep_alive returns."""
    import cupyx
    from cudaemu import streams

    from gpukv.device.cuda import device as cuda_device
    from gpukv.device.cuda.runtime import ordering_event
    schedule("adversarial")
    monkeypatch.setattr(cuda_device, "PINNED_CAP", 6 << 10)
    s = _stream(cp)
    dev = cp.empty(1 << 10, cp.float32)
    cp.cuda.Device(0).synchronize()
    events = []
    with streams.busy():  # the copies stay in flight until the host waits for them
        for _ in range(2):
            host = cupyx.empty_pinned(1 << 10, np.float32)  # 4 KiB each
            dev.data.copy_to_host_async(host.ctypes.data, dev.nbytes, s)
            events.append(ordering_event(s))
            cuda_device.keep_alive(host, events[-1])
    assert streams.has_run(events[0]) and not streams.has_run(events[1])
    s.synchronize()

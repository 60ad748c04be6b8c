"""Host reduction and broadcast (gpukv.device.host_sum): exact sums across blocks and threads.

Most tests shrink the block, blocking and threading thresholds (the `tiny` fixture) so
that arrays of a few hundred elements run through every path the large ones take:
several blocks, a ragged last block, chunks on several threads.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukv
from gpukv.device import host_sum as host

from ..bfloat16 import BF16, marked
from ..bfloat16 import dtype_named as narrow

EXACT_DTYPES = [np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8]


@pytest.fixture
def tiny(monkeypatch):
    """Blocks of 16 bytes, blocking from 64 bytes, a thread per 128 bytes, 3 threads."""
    monkeypatch.setattr(host, "BLOCK_BYTES", 16)
    monkeypatch.setattr(host, "BLOCKED_BYTES", 64)
    monkeypatch.setattr(host, "THREAD_BYTES", 128)
    monkeypatch.setattr(host, "THREADS", 3)


def sources_of(n, k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(-50, 50, n).astype(dtype) for _ in range(k)]


def reference_sum(sources, dtype):
    """Left-to-right sum in `dtype`'s accumulation type, as host_sum adds per element."""
    acc = host.accumulate_dtype(dtype)
    total = sources[0].astype(acc)
    for s in sources[1:]:
        total = (total + s.astype(acc)).astype(acc)
    return total


# ------------------------------------------------------------------------ host_sum
@pytest.mark.parametrize("dtype", EXACT_DTYPES)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_sum_matches_reference_in_every_path(tiny, dtype, k):
    """Sums are exact for every dtype and source count, blocked and threaded."""
    for n in [1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 200, 257]:
        sources = sources_of(n, k, dtype, seed=n)
        out = np.empty(n, dtype)
        host.host_sum(out, sources)
        np.testing.assert_array_equal(out, reference_sum(sources, dtype), err_msg=f"n={n}")


@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("blocks", [0, 1, 5])
def test_sum_at_block_boundaries_with_shipped_sizes(blocks, extra):
    """With the shipped sizes, arrays at the blocking threshold and whole blocks (and one
    element over or under) sum exactly."""
    block = host.BLOCK_BYTES // 4
    smallest = -(-host.BLOCKED_BYTES // host.BLOCK_BYTES)  # blocks in the first blocked size
    n = (smallest + blocks) * block + extra
    sources = sources_of(n, 4, np.float32)
    out = np.empty(n, np.float32)
    host.host_sum(out, sources)
    np.testing.assert_array_equal(out, reference_sum(sources, np.float32))
    outs = [np.empty(n, np.float32) for _ in range(3)]
    host.host_broadcast(out, outs)
    for o in outs:
        np.testing.assert_array_equal(o, out)


def test_chunks_cover_the_range_once_in_whole_blocks(monkeypatch):
    """Thread chunks are disjoint, ordered, cover [0, n) and start on block edges."""
    monkeypatch.setattr(host, "THREAD_BYTES", 8)
    for threads in [1, 2, 3, 4]:
        monkeypatch.setattr(host, "THREADS", threads)
        for n in [1, 2, 7, 64, 65, 1000]:
            for block in [1, 3, 16]:
                chunks = host._chunks(n, 4, block)
                assert chunks[0][0] == 0 and chunks[-1][1] == n
                assert len(chunks) <= threads
                for (lo, hi), (lo2, _) in zip(chunks, chunks[1:]):
                    assert lo < hi == lo2 and lo2 % block == 0


# Per dtype: sources whose sum overflows (fp16) or loses bits (bf16) in 16 bits, and
# the exact float32 sum.
NARROW_CASES = {"float16": ([60000, 60000, -60000, 1], 60001.0),
                "bfloat16": ([256, 1, 1], 258.0)}
#: the dtypes of NARROW_CASES as cases: bfloat16's skips without ml_dtypes
NARROW_NAMES = marked(sorted(NARROW_CASES))


@pytest.mark.parametrize("dtype", NARROW_NAMES)
def test_narrow_sources_accumulate_in_float32(tiny, dtype):
    """fp16/bf16 sources summed into a float32 buffer neither overflow nor round early."""
    values, expected = NARROW_CASES[dtype]
    sources = [np.full(100, v, narrow(dtype)) for v in values]
    out = np.empty(100, np.float32)
    host.host_sum(out, sources)
    np.testing.assert_array_equal(out, np.float32(expected))


@pytest.mark.parametrize("dtype", NARROW_NAMES)
def test_narrow_out_rounds_once(tiny, dtype):
    """A 16-bit out gets the float32 sum rounded once, not a 16-bit running sum."""
    values, expected = NARROW_CASES[dtype]
    sources = [np.full(50, v, narrow(dtype)) for v in values]
    out = np.empty(50, narrow(dtype))
    host.host_sum(out, sources)
    np.testing.assert_array_equal(out.astype(np.float32),
                                  np.float32(expected).astype(narrow(dtype)).astype(np.float32))
    assert np.isfinite(out.astype(np.float32)).all()


@pytest.mark.parametrize("layout", ["strided", "transposed", "fortran", "out_strided"])
def test_non_contiguous_arrays(tiny, layout):
    """Strided, transposed and Fortran-ordered sources (or out) give the same sums."""
    rng = np.random.default_rng(1)
    base = [rng.integers(-9, 9, (24, 20)).astype(np.float32) for _ in range(4)]
    if layout == "strided":
        sources = [b[::2, 1::3] for b in base]
    elif layout == "transposed":
        sources = [b.T for b in base]
    elif layout == "fortran":
        sources = [np.asfortranarray(b) for b in base]
    else:
        sources = base
    expected = reference_sum([np.ascontiguousarray(s) for s in sources], np.float32)
    if layout == "out_strided":
        holder = np.zeros((48, 20), np.float32)
        out = holder[::2]
        host.host_sum(out, sources)
        np.testing.assert_array_equal(holder[1::2], 0)  # nothing written between rows
    else:
        out = np.empty(expected.shape, np.float32)
        host.host_sum(out, sources)
    np.testing.assert_array_equal(out, expected)


def test_sources_are_left_unchanged(tiny):
    """The reduction only reads its sources."""
    sources = sources_of(300, 4, np.float32)
    before = [s.copy() for s in sources]
    host.host_sum(np.empty(300, np.float32), sources)
    for s, b in zip(sources, before):
        np.testing.assert_array_equal(s, b)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 6),
       dtype=st.sampled_from(["float32", "float64", "int32", "int8", "float16"]
                             + ([] if BF16 is None else ["bfloat16"])),  # needs ml_dtypes
       block=st.integers(1, 64), threads=st.integers(1, 4), thread_bytes=st.integers(1, 512),
       seed=st.integers(0, 2 ** 16))
def test_property_sum_equals_sequential_reference(n, k, dtype, block, threads, thread_bytes,
                                                  seed):
    """For any size, source count, dtype and cutting, host_sum == the per-element sum."""
    dt = narrow(dtype)
    acc = host.accumulate_dtype(dt)
    sources = sources_of(n, k, dt, seed)
    saved = (host.BLOCK_BYTES, host.BLOCKED_BYTES, host.THREAD_BYTES, host.THREADS)
    host.BLOCK_BYTES, host.BLOCKED_BYTES = block, 1
    host.THREAD_BYTES, host.THREADS = thread_bytes, threads
    try:
        out = np.empty(n, acc)
        host.host_sum(out, sources)
    finally:
        host.BLOCK_BYTES, host.BLOCKED_BYTES, host.THREAD_BYTES, host.THREADS = saved
    np.testing.assert_array_equal(out, reference_sum(sources, dt))


# ------------------------------------------------------------------ host_broadcast
@pytest.mark.parametrize("n", [1, 16, 17, 100, 257])
def test_broadcast_writes_every_out(tiny, n):
    """Every out receives the source, cast to its own dtype."""
    src = np.arange(n, dtype=np.float32) - 5
    outs = [np.empty(n, np.float32), np.empty(n, np.float64), np.empty(n, np.int32),
            np.empty(n, np.float32)]
    host.host_broadcast(src, outs)
    for o in outs:
        np.testing.assert_array_equal(o, src.astype(o.dtype))


def test_broadcast_into_strided_and_subclass_outs(tiny):
    """Strided outs write only their elements; ndarray subclasses are written too."""
    class Sub(np.ndarray):
        pass

    src = np.arange(60, dtype=np.float32).reshape(6, 10)
    holder = np.zeros((12, 10), np.float32)
    sub = np.zeros((6, 10), np.float32).view(Sub)
    host.host_broadcast(src, [holder[::2], sub])
    np.testing.assert_array_equal(holder[::2], src)
    np.testing.assert_array_equal(holder[1::2], 0)
    np.testing.assert_array_equal(np.asarray(sub), src)


def test_broadcast_into_overlapping_outs_is_sequential(tiny):
    """Outs that overlap end as if copied one after the other, as plain copies would."""
    src = np.arange(200, dtype=np.float32)
    buf = np.zeros(203, np.float32)
    host.host_broadcast(src, [buf[:200], buf[3:]])
    expected = np.zeros(203, np.float32)
    expected[:200] = src
    expected[3:] = src
    np.testing.assert_array_equal(buf, expected)


# ------------------------------------------------------------------------- the pool
def test_pool_reraises_a_worker_error_and_keeps_working(tiny):
    """An error in any chunk reaches the caller after every chunk finished; the pool lives on."""
    done = []

    def work(i):
        done.append(i)
        if i == 2:
            raise ZeroDivisionError("chunk 2")

    with pytest.raises(ZeroDivisionError, match="chunk 2"):
        host._POOL.run(work, [(0,), (1,), (2,)])
    assert sorted(done) == [0, 1, 2]
    host._POOL.run(done.append, [(3,), (4,)])
    assert sorted(done) == [0, 1, 2, 3, 4]


def test_pool_runs_chunks_inline_once_shut_down(tiny):
    """A pool whose executor was shut down still runs every chunk (on the caller's thread)."""
    pool = host._Pool()
    pool.run(lambda i: None, [(0,), (1,)])
    pool._executor.shutdown(wait=True)
    done = []
    pool.run(done.append, [(0,), (1,)])
    assert sorted(done) == [0, 1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* fork:DeprecationWarning")
def test_pool_works_in_a_forked_child(tiny):
    """A child forked after the pool started gets a fresh pool instead of hanging."""
    host._POOL.run(lambda i: None, [(0,), (1,), (2,)])
    pid = os.fork()
    if pid == 0:  # child: must finish a threaded sum, then leave without cleanup
        try:
            sources = sources_of(300, 3, np.float32)
            out = np.empty(300, np.float32)
            host.host_sum(out, sources)
            ok = np.array_equal(out, reference_sum(sources, np.float32))
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_concurrent_callers_get_their_own_sums(tiny):
    """Several threads reducing at once through the shared pool each get exact results."""
    errors = []

    def worker(seed):
        for i in range(20):
            sources = sources_of(250, 4, np.float32, seed * 100 + i)
            out = np.empty(250, np.float32)
            host.host_sum(out, sources)
            if not np.array_equal(out, reference_sum(sources, np.float32)):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -------------------------------------------------------------------- through the store
@pytest.mark.parametrize("updater", [False, True])
def test_store_push_pull_large_keys_on_every_path(tiny, updater):
    """A store's host push+pull is exact through blocks and threads, with or without updater."""
    kv = gpukv.create("local")
    kv.init(0, np.zeros((30, 11), np.float32))
    if updater:
        kv.set_updater(lambda key, merged, stored: stored.__iadd__(merged))
    values = [np.full((30, 11), i + 1, np.float32) for i in range(4)]
    outs = [np.empty((30, 11), np.float32) for _ in range(4)]
    kv.push(0, values)
    kv.pull(0, out=outs)
    for o in outs:
        np.testing.assert_array_equal(o, 10)
    values[0][...] = 100  # the store kept no reference to the pushed arrays
    kv.pull(0, out=outs)
    np.testing.assert_array_equal(outs[3], 10)


def test_store_fp16_push_does_not_overflow(tiny):
    """Two fp16 pushes of 60000 and one of -60000 leave 60000 (MXNet gives inf)."""
    kv = gpukv.create("local")
    kv.init("w", np.zeros(100, np.float16))
    kv.push("w", [np.full(100, 60000, np.float16), np.full(100, 60000, np.float16),
                  np.full(100, -60000, np.float16)])
    out = np.empty(100, np.float16)
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.float16(60000))


@pytest.mark.parametrize("value", ["four", "2.5", "0", "-3"])
def test_malformed_host_threads_env_is_an_error(monkeypatch, value):
    """A GPUKV_HOST_THREADS that is not a positive integer is an ArgumentError naming the
    variable and the value, when a store is made and at first use, never ignored."""
    monkeypatch.setenv("GPUKV_HOST_THREADS", value)
    monkeypatch.setitem(host.__dict__, "THREADS", None)  # not read yet
    with pytest.raises(gpukv.ArgumentError, match=f"GPUKV_HOST_THREADS='{value}'"):
        gpukv.create("local")
    with pytest.raises(gpukv.ArgumentError, match="GPUKV_HOST_THREADS"):
        host.host_sum(np.empty(1 << 20, np.float32), [np.ones(1 << 20, np.float32)] * 2)


def test_host_threads_env_read_at_first_use(monkeypatch):
    """A well-formed GPUKV_HOST_THREADS sets the pool size, read once on first use."""
    monkeypatch.setenv("GPUKV_HOST_THREADS", " 3 ")
    monkeypatch.setitem(host.__dict__, "THREADS", None)  # not read yet
    assert host.thread_count() == 3 and host.THREADS == 3
    monkeypatch.setenv("GPUKV_HOST_THREADS", "5")
    assert host.thread_count() == 3

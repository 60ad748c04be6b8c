"""The kernels of gpukv/device/cuda/kernels.py, their NumPy twins (gpukv/device/
host_kernels.py), pointer tables, and the CUDA sources (compiled with NVRTC, for every
dtype pair, in tests/device/cuda/test_cuda_compile.py)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukv.device import host_kernels as HK
from gpukv.device.cuda import kernels as K

from ...bfloat16 import dtype_named as _dtype
from ...bfloat16 import marked, needs_bfloat16
from ...gpu_gate import hardware_missing

DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]


def _rand(rng, n, dtype):
    return rng.integers(-20 if dtype.kind != "u" else 0, 20, size=n).astype(dtype)


def _reference(a, b, out_dtype):
    acc = np.dtype(K.accumulate_name(out_dtype))
    total = np.zeros(len(a[0]) if a else len(b[0]), acc)
    for x in list(a) + list(b):
        total = total + x.astype(acc)
    return total.astype(out_dtype)


@pytest.mark.parametrize("t", marked(DTYPES + ["bfloat16"]))
def test_multi_sum_host_matches_reference(t):
    """The host twin sums sources of T into U, accumulating 16-bit floats in float32."""
    rng = np.random.default_rng(1)
    t = _dtype(t)
    u = np.dtype(K.accumulate_name(t))
    items, refs = [], []
    for n in (0, 1, 7, 300):
        a = tuple(_rand(rng, n, t) for _ in range(3))
        b = (_rand(rng, n, u),)
        out = np.zeros(n, u)
        items.append(K.SumItem(out, a, b))
        refs.append(_reference(a, b, u))
    HK.multi_sum_host(items)
    for item, ref in zip(items, refs):
        np.testing.assert_array_equal(item.out, ref)


def test_fp16_sum_does_not_overflow():
    """Two fp16 pushes of 60000 sum to 120000 in a float32 output (not inf)."""
    a = (np.full(4, 60000, np.float16),) * 2
    out = np.zeros(4, np.float32)
    HK.multi_sum_host([K.SumItem(out, a, ())])
    np.testing.assert_array_equal(out, 120000)


def test_in_place_accumulate():
    """`out` may be one of the `b` terms: out += sum(a)."""
    out = np.arange(5, dtype=np.float32)
    HK.multi_sum_host([K.SumItem(out, (np.ones(5, np.float16),), (out,))])
    np.testing.assert_array_equal(out, np.arange(5) + 1)


def test_multi_copy_casts():
    """multi_copy_host copies every pair, casting to the destination's dtype."""
    src = [np.arange(6, dtype=np.float32), np.arange(3, dtype=np.int64)]
    dst = [np.zeros(6, np.float16), np.zeros(3, np.float64)]
    HK.multi_copy_host(list(zip(dst, src)))
    for d, s in zip(dst, src):
        np.testing.assert_array_equal(d, s.astype(d.dtype))


def _emulate_table(table: np.ndarray, nkeys: int, memory: list, t_dtype, u_dtype,
                   blocks: int, threads: int = K.THREADS) -> None:
    """Run the sum kernel's index arithmetic on the host, block by block.

    Addresses in `table` are indices into `memory` (1-D NumPy arrays); this checks the
    table layout and the block/stride mapping of `K.sum_source` without a GPU.
    """
    starts = table[:nkeys + 1]
    meta = table[nkeys + 1:nkeys + 1 + K.META * nkeys].reshape(nkeys, K.META)
    ptrs = table[nkeys + 1 + K.META * nkeys:]
    acc = np.dtype(K.accumulate_name(u_dtype))
    for b in range(blocks):
        k = int(np.searchsorted(starts[:nkeys], b, side="right") - 1)
        out_i, n, a_off, na, b_off, nb = (int(x) for x in meta[k])
        out = memory[out_i]
        stride = (int(starts[k + 1]) - int(starts[k])) * threads
        first = (b - int(starts[k])) * threads
        idx = np.concatenate([np.arange(i, min(i + threads, n))
                              for i in range(first, n, stride)] or [np.zeros(0, np.int64)])
        terms = ([memory[int(ptrs[a_off + j])] for j in range(na)]
                 + [memory[int(ptrs[b_off + j])] for j in range(nb)])
        total = terms[0][idx].astype(acc)  # from the first term, as the kernel sums
        for term in terms[1:]:
            total += term[idx].astype(acc)
        out[idx] = total.astype(out.dtype)


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(0, 70), min_size=1, max_size=8),
       threads=st.sampled_from([1, 4, 32]), per_thread=st.integers(1, 3),
       max_blocks=st.integers(1, 5), na=st.integers(0, 3), nb=st.integers(0, 2),
       t=st.sampled_from(["float16", "int32", "float64"]))
def test_pointer_table_emulated_like_the_kernel(sizes, threads, per_thread, max_blocks,
                                                na, nb, t):
    """The table layout and block/stride mapping of the kernel cover every element once."""
    if na + nb == 0:
        na = 1
    t = np.dtype(t)
    u = np.dtype(K.accumulate_name(t))
    rng = np.random.default_rng(len(sizes))
    memory, outs, a_lists, b_lists, refs = [], [], [], [], []

    def put(x):
        memory.append(x)
        return len(memory) - 1

    for n in sizes:
        a = [_rand(rng, n, t) for _ in range(na)]
        b = [_rand(rng, n, u) for _ in range(nb)]
        outs.append(put(np.full(n, 77, u)))
        a_lists.append([put(x) for x in a])
        b_lists.append([put(x) for x in b])
        refs.append(_reference(a, b, u) if n else np.zeros(0, u))
    table, blocks = K.build_table(outs, sizes, a_lists, b_lists, threads=threads,
                                  per_thread=per_thread, max_blocks=max_blocks)
    _emulate_table(table, len(sizes), memory, t, u, blocks, threads=threads)
    for o, ref in zip(outs, refs):
        np.testing.assert_array_equal(memory[o], ref)


def test_plan_blocks_caps_blocks_per_key():
    """Every non-empty key gets at least one block and at most MAX_BLOCKS."""
    starts = K.plan_blocks([0, 1, 10 ** 9, 1024, 1025])
    counts = np.diff(starts)
    assert counts.tolist() == [0, 1, K.MAX_BLOCKS, 1, 2]


@needs_bfloat16
def test_sources_are_distinct_per_dtype_pair():
    """Each (T, U) pair gets its own kernel name and typedefs."""
    seen = set()
    for t in DTYPES + ["bfloat16"]:
        for u in {t, K.accumulate_name(t)}:
            name, src = K.sum_source(t, u)
            assert name not in seen
            seen.add(name)
            assert f"typedef {K.ctype(_dtype(t))} T;" in src


@pytest.mark.parametrize("make", [K.sum_source, K.tree_sum_source])
@pytest.mark.parametrize(("t", "u"), [("float64", "float16"),
                                      pytest.param("float64", "bfloat16", marks=needs_bfloat16),
                                      ("float64", "float32"), ("float32", "float64")])
def test_float64_float32_conversions_are_explicit_ptx(make, t, u):
    """Between float64 and float32 the kernels convert with PTX without .ftz (a C cast
    compiles to cvt.rn.ftz.f32.f64 or cvt.ftz.f64.f32 under CuPy's -ftz=true, flushing
    float32 subnormals), and one float64 term into float16 is rounded once."""
    _, src = make(_dtype(t), _dtype(u))
    assert not re.search(r"\((?:float|double|A)\)a\[", src)  # no C cast of a term
    helper = "gpukv_d2f(a[j][i])" if t == "float64" else "gpukv_f2d(a[j][i])"
    assert helper in src
    assert ("gpukv_d2h(a[0][i0])" in src) == (u == "float16")


# ----------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("t", DTYPES)
def test_multi_sum_gpu_matches_twin(t):
    """The CUDA kernel and the NumPy twin agree on many keys in one launch."""
    import cupy
    rng = np.random.default_rng(5)
    t = np.dtype(t)
    u = np.dtype(K.accumulate_name(t))
    host_items, gpu_items = [], []
    for n in (1, 5, 1000, 3 << 16):
        a = [_rand(rng, n, t) for _ in range(3)]
        b = [_rand(rng, n, u)]
        host_items.append(K.SumItem(np.zeros(n, u), tuple(a), tuple(b)))
        gpu_items.append(K.SumItem(cupy.zeros(n, u), tuple(map(cupy.asarray, a)),
                                   tuple(map(cupy.asarray, b))))
    HK.multi_sum_host(host_items)
    stream = cupy.cuda.get_current_stream()
    K.multi_sum_gpu(gpu_items, stream)
    for h, g in zip(host_items, gpu_items):
        np.testing.assert_array_equal(cupy.asnumpy(g.out), h.out)


@pytest.mark.gpu
def test_fp16_rounding_on_gpu():
    """The kernel's fp16 conversion rounds like NumPy's cast."""
    import cupy
    x = np.linspace(-70000, 70000, 4099).astype(np.float32)
    out = cupy.zeros(x.size, cupy.float16)
    K.multi_sum_gpu([K.SumItem(out, (cupy.asarray(x),), ())], cupy.cuda.get_current_stream())
    with np.errstate(over="ignore"):  # beyond float16: inf, as the kernel gives
        np.testing.assert_array_equal(cupy.asnumpy(out), x.astype(np.float16))


@pytest.mark.multi_gpu(2)
def test_multi_sum_reads_peer_memory():
    """One launch on GPU 0 sums sources living on another GPU when peer access allows."""
    import cupy

    from gpukv.device.cuda.device import can_access_peer, gpu_count
    if gpu_count() < 2 or not can_access_peer(0, 1):
        hardware_missing("needs two physical GPUs with peer access")
    with cupy.cuda.Device(1):
        remote = cupy.arange(1000, dtype=cupy.float32)
        cupy.cuda.get_current_stream().synchronize()
    with cupy.cuda.Device(0):
        local = cupy.ones(1000, dtype=cupy.float32)
        out = cupy.zeros(1000, dtype=cupy.float32)
        K.multi_sum_gpu([K.SumItem(out, (local, remote), ())], cupy.cuda.get_current_stream())
        np.testing.assert_array_equal(cupy.asnumpy(out), np.arange(1000) + 1)


class _TableEvent:
    done = False


class _TableStream:
    """A CuPy stream stand-in: `record()` hands out events the test completes by hand."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record(self, event=None):
        self.events.append(_TableEvent())
        return self.events[-1]


class _TableCupy:
    """The bits of CuPy upload_table uses: pinned allocations, and device arrays whose
    async host-to-device copies are logged with the bytes they would read."""

    def __init__(self):
        import types
        self.pinned, self.copies = [], []
        self.cuda = types.SimpleNamespace(alloc_pinned_memory=self._pinned,
                                          Event=lambda disable_timing=False: None)

    def _pinned(self, nbytes):
        self.pinned.append(bytearray(nbytes))
        return self.pinned[-1]

    def pinned_at(self, ptr) -> bool:
        return any(np.frombuffer(m, np.uint8).ctypes.data <= ptr
                   < np.frombuffer(m, np.uint8).ctypes.data + len(m) for m in self.pinned)

    def empty(self, shape, dtype):
        import ctypes
        import types
        fake = self

        def copy(ptr, nbytes, stream):
            fake.copies.append((ptr, nbytes, stream))
            return ctypes.string_at(ptr, nbytes)

        return types.SimpleNamespace(shape=shape, data=types.SimpleNamespace(
            copy_from_host_async=copy))


def test_tables_upload_from_pinned_buffers_kept_until_the_copy_ran(monkeypatch):
    """Pointer tables are copied from pinned memory; a buffer is not written again until
    the event recorded after its copy has completed, and is reused after that."""
    import ctypes
    monkeypatch.setattr(K, "_TABLES", K._PinnedTables())
    cp, stream = _TableCupy(), _TableStream()
    first = np.arange(10, dtype=np.int64)
    K.upload_table(cp, first, stream)
    ptr1, n1, s1 = cp.copies[0]
    assert cp.pinned_at(ptr1) and n1 == first.nbytes and s1 is stream
    K.upload_table(cp, first + 100, stream)  # first copy still pending: another buffer
    ptr2 = cp.copies[1][0]
    assert cp.pinned_at(ptr2) and ptr2 != ptr1 and len(cp.pinned) == 2
    assert np.array_equal(np.frombuffer(ctypes.string_at(ptr1, n1), np.int64), first)
    stream.events[0].done = True  # the first copy has run: its buffer may be reused
    K.upload_table(cp, first + 200, stream)
    assert cp.copies[2][0] == ptr1 and len(cp.pinned) == 2
    assert np.array_equal(np.frombuffer(ctypes.string_at(ptr1, n1), np.int64), first + 200)
    assert len(stream.events) == 3  # one event behind every copy


def test_pinned_table_pool_keeps_few_idle_buffers():
    """Completed buffers beyond `keep` are let go (the smallest first); busy ones never."""
    pool = K._PinnedTables(keep=2)
    cp = _TableCupy()
    bufs = [pool.take(cp, words) for words in (10, 2000, 5000)]
    events = [_TableEvent() for _ in bufs]
    for buf, event in zip(bufs, events):
        pool.give(buf, event)
    events[0].done = events[1].done = events[2].done = True
    assert pool.take(cp, 3000) is bufs[2]
    assert [b.size for b in pool.idle] == [2048]  # the 512-word one was dropped


# ------------------------------------------------------------- copies are bit copies
def _awkward_bits(dtype, n):
    """n values of `dtype` with -0.0, subnormals, infinities and NaNs of several payloads
    among them (integers: the whole bit range)."""
    width = np.dtype(dtype).itemsize
    rng = np.random.default_rng(n)
    raw = rng.integers(0, 256, n * width, dtype=np.uint8).view(f"u{width}")
    if np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16":
        sign = 1 << (8 * width - 1)
        special = np.array([sign, 1, sign | 1, sign - 1, sign | (sign - 1)],
                           raw.dtype)  # -0.0, smallest subnormals, NaNs with payloads
        raw[:min(n, special.size)] = special[:n]
    return raw.view(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", marked(DTYPES + ["bfloat16"]))
@pytest.mark.parametrize("n", [4, 1000, (4 << 20) // 2 + 3])
def test_multi_copy_is_a_bit_copy(dtype, n):
    """A copy (a sum of one term) keeps every bit, -0.0 and NaN payloads included, at
    every size: the kernel starts from the term, never from zero."""
    import cupy
    dtype = _dtype(dtype)
    src = _awkward_bits(dtype, n)
    dst = cupy.zeros(n, dtype)
    K.multi_copy_gpu([(dst, cupy.asarray(src))], cupy.cuda.get_current_stream())
    assert cupy.asnumpy(dst).tobytes() == src.tobytes()


@pytest.mark.gpu
def test_one_term_cast_keeps_negative_zero():
    """A one-term sum into another dtype is a cast: -0.0 stays -0.0."""
    import cupy
    src = np.array([-0.0, 0.0, -1.5], np.float16)
    dst = cupy.ones(3, cupy.float32)
    K.multi_sum_gpu([K.SumItem(dst, (cupy.asarray(src),), ())],
                    cupy.cuda.get_current_stream())
    assert cupy.asnumpy(dst).tobytes() == src.astype(np.float32).tobytes()


def _float64_edges(seed: int = 0) -> np.ndarray:
    """float64 values where converting them can go wrong: a hair (2**-40 of the value)
    off the midpoints between neighbouring float16 and between neighbouring bfloat16
    values, where rounding once (as NumPy casts to float16) and rounding through float32
    differ; values about float32's subnormals, with all 53 bits; zeros, infinities and
    the edges of float16's range. Both signs."""
    rng = np.random.default_rng(seed)
    ties = []
    # bfloat16's finite values are float32's with their low 16 bits zero
    for grid in (np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64),
                 (np.arange(0x7F80, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)):
        ties.append((grid[:-1] + grid[1:]) / 2)
    mid = np.concatenate(ties)
    hair = np.maximum(mid, 2.0 ** -140) * 2.0 ** -40 * rng.choice([-1.0, 1.0], mid.size)
    tiny = rng.uniform(-1, 1, 4000) * 2.0 ** rng.integers(-148, -118, 4000)
    x = np.concatenate([mid + hair, tiny, [0.0, np.inf, 65504.0, 65519.99, 65520.0, 1e300]])
    return x * rng.choice([-1.0, 1.0], x.size)


@pytest.mark.gpu
@pytest.mark.parametrize("u", marked(["float16", "bfloat16", "float32"]))
def test_one_float64_term_is_cast_as_numpy_casts(u):
    """A float64 term copied into a narrower float (the copy kernel, and a one-term sum)
    gives the twin's bits, NumPy's cast: float16 rounded once (through float32 it would
    round twice), bfloat16 through float32 as ml_dtypes casts, float32 and bfloat16
    subnormals kept (explicit PTX, which -ftz=true does not flush)."""
    import cupy
    u = _dtype(u)
    x = _float64_edges()
    want = np.empty(x.size, u)
    with np.errstate(over="ignore"):
        HK.multi_copy_host([(want, x)])
        assert want.tobytes() == x.astype(u).tobytes()
        if u == np.float16:  # the edges are where rounding twice goes wrong
            assert np.count_nonzero(x.astype(np.float32).astype(u) != want) > 10000
    bits = want.view(f"u{u.itemsize}") & ((1 << (8 * u.itemsize - 1)) - 1)
    assert np.count_nonzero((bits > 0) & (bits < (0x80 if u.itemsize == 2 else 0x800000))) \
        > (1000 if u != np.float16 else 0)  # subnormals of the out's dtype
    copied, summed = cupy.zeros(x.size, u), cupy.zeros(x.size, u)
    src = cupy.asarray(x)
    stream = cupy.cuda.get_current_stream()
    K.multi_copy_gpu([(copied, src)], stream)
    K.multi_sum_gpu([K.SumItem(summed, (src,), ())], stream)
    assert cupy.asnumpy(copied).tobytes() == want.tobytes()
    assert cupy.asnumpy(summed).tobytes() == want.tobytes()


@pytest.mark.gpu
def test_float64_terms_sum_into_float16_like_the_twin():
    """Two or more float64 terms into float16 add in float32, as the twin does: the same
    bits on the rounding edges (one term is a cast, rounded once; more are not). Values
    of float32's subnormal range left out: sums of several terms flush them."""
    import cupy
    x, y = _float64_edges(), _float64_edges(seed=1)
    normal = (np.abs(x) > 2.0 ** -100) & (np.abs(y) > 2.0 ** -100)
    x, y = x[normal], y[normal]
    host = [np.empty(x.size, np.float16) for _ in range(2)]
    with np.errstate(over="ignore", invalid="ignore"):
        HK.multi_sum_host([K.SumItem(host[0], (x, y), ()), K.SumItem(host[1], (x, y, x), ())])
    gpu = [cupy.empty(x.size, cupy.float16) for _ in range(2)]
    gx, gy = cupy.asarray(x), cupy.asarray(y)
    K.multi_sum_gpu([K.SumItem(gpu[0], (gx, gy), ()), K.SumItem(gpu[1], (gx, gy, gx), ())],
                    cupy.cuda.get_current_stream())
    for h, g in zip(host, gpu):  # inf - inf: a GPU's NaN has its own payload
        assert _nan_as_one(cupy.asnumpy(g)).tobytes() == _nan_as_one(h).tobytes()


def _nan_as_one(a: np.ndarray) -> np.ndarray:
    """`a`'s bits with every NaN made float16's default NaN (payloads and signs are not
    part of the sums' contract: a GPU's arithmetic gives its canonical NaN)."""
    a = a.copy()
    a[np.isnan(a)] = np.nan
    return a


@pytest.mark.gpu
def test_float32_subnormals_widen_to_float64_kept():
    """A float32 term copied into float64 keeps its subnormals and their signs, as NumPy
    casts (explicit PTX: -ftz=true's cvt.ftz.f64.f32 would give zeros)."""
    import cupy
    rng = np.random.default_rng(2)
    x = (rng.uniform(-1, 1, 5000) * 2.0 ** rng.integers(-149, -118, 5000)).astype(np.float32)
    assert np.count_nonzero(np.abs(x) < np.finfo(np.float32).tiny) > 3000
    out = cupy.zeros(x.size, cupy.float64)
    K.multi_copy_gpu([(out, cupy.asarray(x))], cupy.cuda.get_current_stream())
    assert cupy.asnumpy(out).tobytes() == x.astype(np.float64).tobytes()


@pytest.mark.gpu
def test_pieces_of_one_out_run_in_order():
    """A key whose terms have two dtypes is summed in two pieces, the second adding into
    what the first wrote; a piece of another key with the second dtype, listed first,
    must not pull the second piece ahead of the first (100 + 10, not 10 then 100)."""
    import cupy
    f16 = lambda v: cupy.full(8, v, cupy.float16)  # noqa: E731
    f64 = lambda v: cupy.full(8, v, cupy.float64)  # noqa: E731
    out_a, out_b = cupy.zeros(8, cupy.float32), cupy.zeros(8, cupy.float32)
    items = [K.SumItem(out_b, (f16(1),), ()),                # key B, float16 terms
             K.SumItem(out_a, (f64(100),), ()),              # key A, piece 1: float64
             K.SumItem(out_a, (f16(10),), (out_a,))]         # key A, piece 2: adds in
    K.multi_sum_gpu(items, cupy.cuda.get_current_stream())
    np.testing.assert_array_equal(cupy.asnumpy(out_a), 110)
    np.testing.assert_array_equal(cupy.asnumpy(out_b), 1)


_ALL = sorted(K._CTYPES)


@pytest.mark.gpu
@pytest.mark.parametrize("u", marked(_ALL))
@pytest.mark.parametrize("t", marked(_ALL))
def test_every_dtype_pair_sums_like_the_twin(t, u):
    """The sum kernel of every (source, out) dtype pair gives the twin's bytes: two terms
    of T and the out itself (U), and a one-term cast of T into U."""
    import cupy
    t, u = _dtype(t), _dtype(u)
    rng = np.random.default_rng(3)
    n = 1031
    # into an unsigned out, terms that fit it: a negative float (bfloat16's kind is 'V')
    # converted to an unsigned integer is undefined in C: a GPU saturates, the twin wraps
    terms = [_rand(rng, n, u if u.kind == "u" else t).astype(t) for _ in range(2)]
    host_out, host_cast = _rand(rng, n, u), np.zeros(n, u)
    gpu_out, gpu_cast = cupy.asarray(host_out), cupy.zeros(n, u)
    with np.errstate(over="ignore", invalid="ignore"):
        HK.multi_sum_host([K.SumItem(host_out, tuple(terms), (host_out,)),
                          K.SumItem(host_cast, (terms[0],), ())])
    K.multi_sum_gpu([K.SumItem(gpu_out, tuple(map(cupy.asarray, terms)), (gpu_out,)),
                     K.SumItem(gpu_cast, (cupy.asarray(terms[0]),), ())],
                    cupy.cuda.get_current_stream())
    assert cupy.asnumpy(gpu_out).tobytes() == host_out.tobytes()
    assert cupy.asnumpy(gpu_cast).tobytes() == host_cast.tobytes()


@pytest.mark.gpu
def test_a_sum_table_is_uploaded_once_for_the_same_arrays(monkeypatch):
    """The same arrays summed again reuse their uploaded table (a training loop's steps);
    other arrays, or a table pushed out of the cache, get one of their own."""
    import cupy
    uploads = []
    real = K.upload_table
    monkeypatch.setattr(K, "upload_table", lambda *a: uploads.append(1) or real(*a))
    monkeypatch.setattr(K, "_SUM_TABLES", K.TableCache(keep=1))
    a, b = cupy.full(10, 1.0, cupy.float32), cupy.zeros(10, cupy.float32)
    out = cupy.zeros(10, cupy.float32)
    stream = cupy.cuda.get_current_stream()
    for k in range(3):
        b.fill(k)
        K.multi_sum_gpu([K.SumItem(out, (a, b), ())], stream)
        assert (out.get() == 1 + k).all()
    assert len(uploads) == 1
    other = cupy.zeros(12, cupy.float32)
    K.multi_sum_gpu([K.SumItem(other, (cupy.full(12, 3.0, cupy.float32),), ())], stream)
    assert len(uploads) == 2 and (other.get() == 3).all()
    K.multi_sum_gpu([K.SumItem(out, (a, b), ())], stream)  # its table was pushed out
    assert len(uploads) == 3 and (out.get() == 3).all()

"""Gradient compression on GPUs: the CUDA kernels against their NumPy twins, and 'device'
stores pushing from every GPU against the same store on host arrays, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv.device import codecs as K
from gpukv.device import host_device

from ..bfloat16 import BF16, needs_bfloat16
from .test_blockwise_range import CASES as RANGE_CASES
from .test_blockwise_range import steps as range_steps

pytestmark = pytest.mark.gpu

# Sizes that are not multiples of a packed word (16 values at 2 bits, 32 at 1 bit),
# around them, and one value alone.
SIZES = [1, 2, 15, 16, 17, 31, 33, 47, 1001, 4099]


def f32_without_subnormals(x):
    """`x` as float32 with no subnormal (a GPU flushes them: CuPy compiles with -ftz)."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)


def _bits(a) -> np.ndarray:
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


def assert_same_bits(got, want, what=""):
    """Same dtype, shape and bytes; else say where they first differ."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    differ = np.flatnonzero(_bits(got) != _bits(want))
    assert differ.size == 0, (f"{what}: {differ.size} of {got.size} elements differ, first "
                              f"at {differ[0]}: {got.reshape(-1)[differ[0]]!r} != "
                              f"{want.reshape(-1)[differ[0]]!r}")


@pytest.fixture
def cp():
    """CuPy (or the emulation), imported once the GPU gate let the test run."""
    import cupy
    return cupy


def _on(cp, dev, array):
    """A copy of host `array` on logical device `dev`'s GPU."""
    with dev.cuda_device:
        return cp.asarray(array)


def _grad_and_residual(n, seed):
    rng = np.random.default_rng(seed)
    g = f32_without_subnormals(rng.standard_normal(n) * 0.7)
    r = f32_without_subnormals(rng.standard_normal(n) * 0.3)
    return g, r


# ----------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits,threshold", [(2, 0.5), (2, 0.125), (1, 0.0), (1, -0.2)],
                         ids=["2bit-0.5", "2bit-0.125", "1bit-0", "1bit-neg"])
def test_quantize_kernels_give_the_twins_bytes_and_residuals(cp, bits, threshold, n):
    """Three quantisations in a row with one residual: the CUDA kernel writes the twin's
    payload bytes (padding of the last word zero, even over a poisoned `out`) and leaves
    the twin's residual; decoding into an exact-size out, or adding to it, gives the
    twin's values."""
    quantize = K.quantize_2bit if bits == 2 else K.quantize_1bit
    g, r = _grad_and_residual(n, n)
    r_gpu = cp.asarray(r)
    nbytes = K.packed_nbytes(n, bits)
    for step in range(3):
        want = quantize(g, r, threshold)
        out = cp.empty(nbytes, cp.uint8) if step else None  # fresh memory is poisoned
        got = quantize(cp.asarray(g), r_gpu, threshold, out=out)
        assert got.dtype == cp.uint8 and got.shape == (nbytes,)
        assert got.get().tobytes() == want.tobytes(), f"payload of step {step}"
        assert_same_bits(r_gpu.get(), r, f"residual after step {step}")
    used = -(-n * bits // 8)
    assert not want[used:].any()
    for accumulate in (False, True):
        base = f32_without_subnormals(np.linspace(-1, 1, n))
        host_out, gpu_out = base.copy(), cp.asarray(base)
        if bits == 2:
            K.dequantize_2bit(want, n, threshold, host_out, accumulate)
            K.dequantize_2bit(got, n, threshold, gpu_out, accumulate)
        else:
            K.dequantize_1bit(want, n, host_out, accumulate)
            K.dequantize_1bit(got, n, gpu_out, accumulate)
        assert_same_bits(gpu_out.get(), host_out, f"decoded, accumulate={accumulate}")


@pytest.mark.parametrize("n", SIZES + [63, 64, 65, 127, 128, 129, 255, 256, 257, 70_001])
@pytest.mark.parametrize("codec", ["sign", "ternary"])
def test_blockwise_kernels_give_the_twins_bytes_and_residuals(cp, codec, n):
    """Three sign or ternary quantisations in a row with one residual: the CUDA kernel
    writes the twin's scales and codes (padding zero over a poisoned `out`) and leaves the
    twin's residual; decoding, or adding, gives the twin's values."""
    quantize, dequantize = getattr(K, f"quantize_{codec}"), getattr(K, f"dequantize_{codec}")
    g, r = _grad_and_residual(n, n)
    r_gpu = cp.asarray(r)
    nbytes = getattr(K, f"{codec}_nbytes")(n)
    for step in range(3):
        want = quantize(g, r)
        out = cp.empty(nbytes, cp.uint8) if step else None  # fresh memory is poisoned
        got = quantize(cp.asarray(g), r_gpu, out=out)
        assert got.dtype == cp.uint8 and got.shape == (nbytes,)
        assert got.get().tobytes() == want.tobytes(), f"payload of step {step}"
        assert_same_bits(r_gpu.get(), r, f"residual after step {step}")
    for accumulate in (False, True):
        base = f32_without_subnormals(np.linspace(-1, 1, n))
        host_out, gpu_out = base.copy(), cp.asarray(base)
        dequantize(want, n, host_out, accumulate)
        dequantize(got, n, gpu_out, accumulate)
        assert_same_bits(gpu_out.get(), host_out, f"decoded, accumulate={accumulate}")


@pytest.mark.parametrize("case", list(RANGE_CASES))
@pytest.mark.parametrize("codec", ["sign", "ternary"])
def test_blockwise_kernels_rescale_blocks_past_float32s_range_as_the_twin(cp, codec, case):
    """Blocks of huge finite values (their squares or magnitudes summing to inf) and of
    tiny ones (their squares below float32's normals), alone and beside ordinary blocks:
    push after push, the kernel writes the twin's payload and leaves its residual, all
    finite, and decodes to the twin's values, bit for bit."""
    quantize, dequantize = getattr(K, f"quantize_{codec}"), getattr(K, f"dequantize_{codec}")
    g = RANGE_CASES[case]
    n = g.size
    r = np.zeros(n, np.float32)
    r_gpu = cp.asarray(r)
    for step in range(range_steps(g)):
        want = quantize(g, r)
        got = quantize(cp.asarray(g), r_gpu)
        assert got.get().tobytes() == want.tobytes(), f"payload of step {step}"
        assert_same_bits(r_gpu.get(), r, f"residual after step {step}")
        assert np.isfinite(r).all()
    for accumulate in (False, True):
        base = f32_without_subnormals(np.linspace(-1, 1, n))
        host_out, gpu_out = base.copy(), cp.asarray(base)
        dequantize(want, n, host_out, accumulate)
        dequantize(got, n, gpu_out, accumulate)
        assert_same_bits(gpu_out.get(), host_out, f"decoded, accumulate={accumulate}")
        assert np.isfinite(host_out).all()


def assert_same_values(got, want, what=""):
    """`assert_same_bits`, a NaN matching any NaN (a GPU's arithmetic makes its own NaN
    bits, where the host's keeps an operand's)."""
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"{what}: NaNs differ"
    assert_same_bits(np.where(nan, 0, got), np.where(nan, 0, want), what)


@pytest.mark.parametrize("n", [5, 128, 129, 300])
@pytest.mark.parametrize("codec", ["sign", "ternary"])
def test_blockwise_kernels_send_a_block_with_an_inf_or_nan_as_the_twin(cp, codec, n):
    """A block holding an inf or a NaN (ternary: it crosses as NaN, every value code 1;
    sign: its scale NaN): the kernel's codes are the twin's, and its scales, residual and
    decoded values too, NaN for NaN."""
    quantize, dequantize = getattr(K, f"quantize_{codec}"), getattr(K, f"dequantize_{codec}")
    g, r = _grad_and_residual(n, n)
    g[1], g[-1] = np.inf, np.nan
    r_gpu = cp.asarray(r)
    with np.errstate(invalid="ignore"):
        want = quantize(g, r)
    got = quantize(cp.asarray(g), r_gpu).get()
    blocks = -(-n // (64 if codec == "sign" else 128))  # a float32 scale each, first
    assert got[4 * blocks:].tobytes() == want[4 * blocks:].tobytes(), "codes"
    assert_same_values(got[:4 * blocks].view(np.float32), want[:4 * blocks].view(np.float32),
                       "scales")
    assert_same_values(r_gpu.get(), r, "residual")
    host_out, gpu_out = np.zeros(n, np.float32), cp.zeros(n, cp.float32)
    with np.errstate(invalid="ignore"):
        dequantize(want, n, host_out, False)
    dequantize(cp.asarray(got), n, gpu_out, False)
    assert_same_values(gpu_out.get(), host_out, "decoded")
    assert not np.isfinite(host_out[:min(n, 64)]).any()  # the first block shows it


@pytest.mark.parametrize("bits", [2, 1])
@pytest.mark.parametrize("n", [1, 17, 33])
def test_dequantize_kernels_write_only_n_values(cp, bits, n):
    """Decoding n values into a longer out writes its first n elements and leaves the
    rest (poisoned, NaN) as it was."""
    g, r = _grad_and_residual(n, 3)
    payload = (K.quantize_2bit if bits == 2 else K.quantize_1bit)(cp.asarray(g),
                                                                  cp.asarray(r), 0.25)
    out = cp.empty(n + 40, cp.float32)
    out[n:] = cp.nan
    if bits == 2:
        K.dequantize_2bit(payload, n, 0.25, out[:n])
    else:
        K.dequantize_1bit(payload, n, out[:n])
    host = out.get()
    assert not np.isnan(host[:n]).any() and np.isnan(host[n:]).all()


# Signed zeros, float16's largest value and what rounds past it, infinities, float16's
# subnormals, ties of both formats, float32's extremes (no value, divided or multiplied by
# a scale below, is a float32 subnormal, which a GPU would flush to zero).
_SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, -7e4, 1e5, np.inf, -np.inf,
                     2.0 ** -14, 2.0 ** -24, 3 * 2.0 ** -25, 1.0 + 2.0 ** -11,
                     1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.4e38,
                     -3.4e38, 2.0 ** -100], np.float32)


# Values past float32's range after the scale overflow to inf, with NumPy's warning.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", [1.0, 4.0, 0.3])
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_cast_kernels_give_the_twins_bits(cp, kind, scale, n, offset):
    """float32 -> fp16 / bf16 (with a pre-divide scale) and back, written or added into
    an out, give the twin's bits: ties to even, overflow to inf, fp16 subnormals kept.
    With `offset` 1 every GPU array starts one element into its allocation, so the
    kernels take the values one at a time instead of four."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    x[:min(n, _SPECIAL.size)] = _SPECIAL[:min(n, _SPECIAL.size)]
    cast, uncast = ((K.cast_fp16, K.uncast_fp16) if kind == "fp16"
                    else (K.cast_bf16, K.uncast_bf16))

    def on_gpu(a):
        padded = cp.empty(a.size + offset, a.dtype)
        padded[offset:] = cp.asarray(a)
        return padded[offset:]

    want = cast(x, scale)
    got = cast(on_gpu(x), scale)
    assert_same_bits(got.get(), want, "payload")
    for accumulate in (False, True):
        base = f32_without_subnormals(rng.standard_normal(n))
        host_out, gpu_out = base.copy(), on_gpu(base)
        uncast(want, scale, host_out, accumulate)
        uncast(on_gpu(got.get()), scale, gpu_out, accumulate)
        assert_same_bits(gpu_out.get(), host_out, f"decoded, accumulate={accumulate}")


@pytest.mark.parametrize("out_dtype", [np.float16, np.float64])
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_cast_decoders_write_outs_of_other_dtypes_and_layouts(cp, kind, out_dtype):
    """A decoded payload goes into an out of another dtype, or a strided one, as on the
    host: the float32 value (times the scale) rounded once into it, or added to it (in
    float32, or float64 for a float64 out)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(37) * 3).astype(np.float32)
    cast, uncast = ((K.cast_fp16, K.uncast_fp16) if kind == "fp16"
                    else (K.cast_bf16, K.uncast_bf16))
    payload = cast(x, 2.0)
    for accumulate in (False, True):
        base = rng.standard_normal(37).astype(out_dtype)
        host_out, gpu_out = base.copy(), cp.asarray(base)
        uncast(payload, 2.0, host_out, accumulate)
        uncast(cp.asarray(payload), 2.0, gpu_out, accumulate)
        assert_same_bits(gpu_out.get(), host_out, f"accumulate={accumulate}")
        wide = np.zeros((37, 2), np.float32)
        host_strided, gpu_wide = wide[:, 0], cp.asarray(wide)
        uncast(payload, 2.0, host_strided, accumulate)
        uncast(cp.asarray(payload), 2.0, gpu_wide[:, 0], accumulate)
        assert_same_bits(gpu_wide.get(), wide, f"strided, accumulate={accumulate}")


@needs_bfloat16
def test_cast_payload_dtypes(cp):
    """An fp16 payload is float16, a bf16 payload holds bfloat16 bit patterns (uint16),
    on the GPU as on the host."""
    x = np.array([1.5, -2.25, 1e-3], np.float32)
    assert K.cast_fp16(cp.asarray(x), 1.0).dtype == np.float16 == K.cast_fp16(x, 1.0).dtype
    bits = K.cast_bf16(cp.asarray(x), 2.0)
    assert bits.dtype == np.uint16
    assert_same_bits(bits.get().view(BF16), (x / np.float32(2)).astype(BF16))


# ------------------------------------------------------------------------- the store
KEYS = {  # name: (shape, dtype); one push carries all of them
    "a": ((4099,), np.dtype(np.float32)),
    "b": ((33, 3), np.dtype(np.float16)),
    "c": ((17,), np.dtype(np.float64)),
    "d": ((31,), BF16),
    "e": ((5,), np.dtype(np.int32)),          # travels uncompressed
    "f": ((1,), np.dtype(np.float32)),
}
if BF16 is None:  # no ml_dtypes (a GPU machine may lack it): the other keys still run
    del KEYS["d"]
COMPRESSIONS = {
    "2bit-0.5": {"type": "2bit", "threshold": 0.5},
    "2bit-0.25": {"type": "2bit", "threshold": 0.25},
    "1bit-0": {"type": "1bit", "threshold": 0.0},
    "1bit-0.3": {"type": "1bit", "threshold": 0.3},
    "fp16": {"type": "fp16"},
    "fp16-pre8": {"type": "fp16", "pre_divide": 8},
    "bf16": {"type": "bf16"},
    "bf16-pre4": {"type": "bf16", "pre_divide": 4},
    "sign": {"type": "sign"},
    "ternary": {"type": "ternary"},
}
#: those that compress pulls too, with scales off the grid of `_gradient` (their stores are
#: deterministic, whose strategy is always the canonical one)
BOTH_WAYS = ("sign", "ternary")
#: those whose decoded terms sum exactly in any order
EXACT_IN_ANY_ORDER = sorted(k for k in COMPRESSIONS if k not in BOTH_WAYS)


def _compressed_stores(cp, rng, keys, params, strategy="home"):
    """Two 'device' stores with compression `params` and the same random values of
    `keys`: one fed host arrays (the host reference, which sums the terms in source
    order), one GPU arrays made on GPU 0 reducing with `strategy` ('home' sums in
    source order too). Sign's and ternary's terms are off `_gradient`'s exact grid: both
    stores then sum in the canonical order (deterministic), the same bits wherever the
    terms lie."""
    init = {k: _gradient(rng, *KEYS[k], {}) for k in keys}
    exact = params["type"] in BOTH_WAYS
    host = gpukv.create("device", deterministic=exact)
    gpu = gpukv.create("device", strategy=strategy, deterministic=exact)
    host.init(keys, [init[k] for k in keys])
    with cp.cuda.Device(0):
        gpu.init(keys, [cp.asarray(init[k]) for k in keys])
    for kv in (host, gpu):
        kv.set_gradient_compression(params)
    return host, gpu


def _gradient(rng, shape, dtype, params):
    """A gradient of `dtype` on a grid where a sum of eight of them, or of their trips,
    is exact in float32 in any order (a strategy's order, or the home GPU's, which adds
    the terms it reads through staging after those it reads directly): multiples of
    1/64 up to 4; for fp16 with a pre_divide, float32 and float64 multiples of 512 up
    to 65536, beyond float16's range, which only the pre-divided trip keeps finite."""
    if dtype.kind == "i":
        return rng.integers(-50, 50, shape).astype(dtype)
    step = 1 / 64
    if params.get("type") == "fp16" and params.get("pre_divide") and dtype.itemsize >= 4:
        step = 512.0
    return (rng.integers(-256, 257, shape) * step).astype(dtype)


@pytest.mark.parametrize("gpus", [pytest.param(4, marks=pytest.mark.multi_gpu(4)),
                                  pytest.param(8, marks=pytest.mark.multi_gpu(8))])
@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_store_on_gpus_equals_the_host_store(cp, name, gpus):
    """Four pushes of six keys (float32, float16, float64, bfloat16, int32), one source
    per logical GPU: after each push the stored values, and every (key, source)
    residual, equal those of the same store fed NumPy arrays, bit for bit."""
    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:gpus]  # the GPU gate made at least `gpus` of them
    assert len(devs) == gpus
    params = COMPRESSIONS[name]
    rng = np.random.default_rng(gpus)
    keys = sorted(KEYS)
    host, gpu = _compressed_stores(cp, rng, keys, params)
    assert {gpu._entries[k].home.kind for k in keys} == {"gpu"}
    for step in range(4):
        grads = {k: [_gradient(rng, *KEYS[k], params) for _ in devs] for k in keys}
        host.push(keys, [grads[k] for k in keys])
        # source i on logical GPU i (its slot: how many sources before it on its GPU)
        gpu.push(keys, [[_on(cp, d, g) for d, g in zip(devs, grads[k])] for k in keys])
        for k in keys:
            assert_same_bits(gpu._entries[k].value.get(), host._entries[k].value,
                             f"key {k!r} after push {step}")
        if params["type"] in ("2bit", "1bit", *BOTH_WAYS):
            hr, gr = host._compression.feedback.residuals, gpu._compression.feedback.residuals
            assert len(gr) == len(hr) == len(devs) * (len(keys) - 1)
            for k in keys:
                for i, d in enumerate(devs):
                    if KEYS[k][1].kind == "i":
                        assert (k, d) not in gr
                        continue
                    assert_same_bits(gr[(k, d)].get(), hr[(k, host_device(i))],
                                     f"residual of key {k!r}, source {i}, push {step}")
    out = [cp.zeros(KEYS[k][0], KEYS[k][1]) for k in keys]
    gpu.pull(keys, out=out)
    for k, o in zip(keys, out):
        assert_same_bits(o.get(), host._entries[k].value, f"pulled key {k!r}")
        assert KEYS[k][1].kind == "i" or np.isfinite(o.get().astype(np.float64)).all()


@pytest.mark.multi_gpu(8)
@pytest.mark.parametrize("strategy", ["auto", "tree", "ring", "cpu"])
@pytest.mark.parametrize("name", EXACT_IN_ANY_ORDER)
def test_every_strategy_reduces_the_encoded_terms(cp, name, strategy):
    """With compression on, a 'device' store on eight logical GPUs hands the encoded
    terms to its strategy: every strategy stores the host store's bits and leaves the
    same residuals."""
    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:8]
    params = COMPRESSIONS[name]
    rng = np.random.default_rng(3)
    keys = sorted(KEYS)
    host, gpu = _compressed_stores(cp, rng, keys, params, strategy)
    assert gpu.strategy == strategy
    reduced, reduce_many = [], gpu._strategy.reduce_many
    gpu._strategy.reduce_many = lambda jobs: (reduced.extend(jobs), reduce_many(jobs))
    for step in range(3):
        grads = {k: [_gradient(rng, *KEYS[k], params) for _ in devs] for k in keys}
        host.push(keys, [grads[k] for k in keys])
        gpu.push(keys, [[_on(cp, d, g) for d, g in zip(devs, grads[k])] for k in keys])
        assert sorted(job.key for job in reduced) == keys  # compressed keys too
        assert all(job.out.dtype == np.float32 for job in reduced if job.key != "e")
        reduced.clear()
        for k in keys:
            assert_same_bits(gpu._entries[k].value.get(), host._entries[k].value,
                             f"key {k!r} after push {step}")
        hr, gr = host._compression.feedback.residuals, gpu._compression.feedback.residuals
        assert len(gr) == len(hr)
        for (k, d), r in gr.items():
            assert_same_bits(r.get(), hr[(k, host_device(devs.index(d)))],
                             f"residual of key {k!r} on {d!r}")


@pytest.mark.parametrize("strategy", ["auto", "home", "tree", "ring", "cpu"])
@pytest.mark.parametrize("name", ["2bit-0.5", "fp16", "bf16"])
@pytest.mark.parametrize("home", ["gpu", "host"])
def test_virtual_gpus_read_the_terms_their_streams_decoded(cp, monkeypatch, name, strategy,
                                                           home):
    """Logical GPUs dealt onto fewer physical ones (GPUKV_VIRTUAL_GPUS: two per GPU),
    each with a stream of its own: a compressed push decodes each source's term on its
    stream, and every strategy reads the term after it (the copy to the host of keys
    made from NumPy arrays, whose home is the host, included: the race checker names an
    unordered read), storing the host store's bits. Two sources on GPU 0 (its two
    logical GPUs), as in a loop over one GPU's replicas; then one on every logical GPU."""
    from gpukv.device.cuda.device import gpu_count, gpu_devices
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", str(2 * gpu_count()))
    devs = gpu_devices()
    on_gpu0 = [d for d in devs if d.physical == 0]
    assert [d.slot for d in on_gpu0] == [0, 1]
    params = COMPRESSIONS[name]
    rng = np.random.default_rng(5)
    keys = sorted(KEYS)
    init = {k: _gradient(rng, *KEYS[k], {}) for k in keys}
    host = gpukv.create("device")
    gpu = gpukv.create("device", strategy=strategy)
    host.init(keys, [init[k] for k in keys])
    with cp.cuda.Device(0):
        gpu.init(keys, [cp.asarray(init[k]) if home == "gpu" else init[k] for k in keys])
    assert {gpu._entries[k].home.kind for k in keys} == {home if home == "gpu" else "cpu"}
    for kv in (host, gpu):
        kv.set_gradient_compression(params)
    for step, sources in enumerate([on_gpu0, sorted(devs, key=lambda d: d.physical)]):
        grads = {k: [_gradient(rng, *KEYS[k], params) for _ in sources] for k in keys}
        host.push(keys, [grads[k] for k in keys])
        gpu.push(keys, [[_on(cp, d, g) for d, g in zip(sources, grads[k])] for k in keys])
        for k in keys:
            stored = gpu._entries[k].value
            assert_same_bits(stored if home == "host" else stored.get(),
                             host._entries[k].value, f"key {k!r} after push {step}")


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("name", ["2bit-0.5", "1bit-0", "fp16-pre8", "bf16", *BOTH_WAYS])
def test_compressed_pushes_feed_the_optimizer_as_on_the_host(cp, name):
    """With an optimizer, the decompressed float32 sum of every GPU's source updates
    each float key (float32, float16, float64, bfloat16) to the host store's bits, its
    states and master copy too, and with sign and ternary what pulls read of it too."""
    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:4]
    params = COMPRESSIONS[name]
    rng = np.random.default_rng(7)
    keys = [k for k in sorted(KEYS) if KEYS[k][1].kind != "i"]
    host, gpu = _compressed_stores(cp, rng, keys, params)
    for kv in (host, gpu):
        kv.set_optimizer(gpukv.optim.Adam(learning_rate=0.01, wd=1e-3))
    for step in range(3):
        grads = {k: [_gradient(rng, *KEYS[k], {}) for _ in devs] for k in keys}
        host.push(keys, [grads[k] for k in keys])
        gpu.push(keys, [[_on(cp, d, g) for d, g in zip(devs, grads[k])] for k in keys])
    for k in keys:
        assert_same_bits(gpu._entries[k].value.get(), host._entries[k].value, f"key {k!r}")
        # sign and ternary compress pulls: the value the optimizer updates is kept apart
        assert (gpu._entries[k].kept is None) == (name not in BOTH_WAYS)
        assert_same_bits(gpu._entries[k].stored.get(), host._entries[k].stored,
                         f"key {k!r}, the value kept apart")
        hs, gs = host._updater.states[k], gpu._updater.states[k]
        for i, (g, h) in enumerate(zip(gs.arrays, hs.arrays)):
            assert_same_bits(g.get(), h, f"state {i} of key {k!r}")
        if hs.master is not None:
            assert_same_bits(gs.master.get(), hs.master, f"master of key {k!r}")


@pytest.mark.multi_gpu(4)
def test_powersgd_on_gpus_gives_the_host_stores_bits(cp):
    """PowerSGD runs its sums on the host whatever the sources: a 'device' store fed one
    source per logical GPU (a matrix homed on a GPU) gives the host store's bits, push
    after push, and its vector key too."""
    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:4]
    rng = np.random.default_rng(11)
    shapes = {"m": (96, 40), "v": (300,)}
    params = {"type": "powersgd", "rank": 3}
    host, gpu = gpukv.create("device"), gpukv.create("device")
    for kv in (host, gpu):
        kv.set_gradient_compression(params)
    host.init(list(shapes), [np.zeros(s, np.float32) for s in shapes.values()])
    with cp.cuda.Device(0):
        gpu.init(list(shapes), [cp.zeros(s, np.float32) for s in shapes.values()])
    assert {gpu._entries[k].home.kind for k in shapes} == {"gpu"}
    for step in range(3):
        grads = {k: [rng.standard_normal(s).astype(np.float32) for _ in devs]
                 for k, s in shapes.items()}
        host.push(list(shapes), [grads[k] for k in shapes])
        gpu.push(list(shapes), [[_on(cp, d, g) for d, g in zip(devs, grads[k])]
                                for k in shapes])
        for k in shapes:
            if k == "v":  # sent as it is: the strategy's own order of the float32 sum
                np.testing.assert_allclose(gpu._entries[k].value.get(),
                                           host._entries[k].value, rtol=1e-6)
                continue
            assert_same_bits(gpu._entries[k].value.get(), host._entries[k].value,
                             f"key {k!r} after push {step}")

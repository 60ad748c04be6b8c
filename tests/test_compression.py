"""Gradient compression: MXNet's 2-bit bytes and rule, 1-bit, fp16/bf16 casts, store wiring."""
from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukv
from gpukv.device.cuda import compression_kernels as K
from gpukv.update.compression import Cast, OneBit, TwoBit, make_compressor

from .strategies import float32_bits, gradient_steps

REF = json.loads((pathlib.Path(__file__).parent / "data" / "mxnet_2bit_reference.json").read_text())


def f32(xs):
    return np.array(xs, dtype=np.float32)


def without_subnormals(x):
    """`x` (float32) with its subnormals made zero, as a GPU flushes them (-ftz=true)."""
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)


# ------------------------------------------------------------- pure-Python rules
def simulate_2bit(grad, residual, t):
    """MXNet's 2-bit rule, one element at a time: (packed bytes, new residual)."""
    t = np.float32(t)
    r = residual.copy()
    out = bytearray(K.packed_nbytes(grad.size, 2))
    for i in range(grad.size):
        r[i] = np.float32(r[i] + grad[i])
        if r[i] >= t:
            out[i // 4] |= 0b11 << (6 - 2 * (i % 4))
            r[i] = np.float32(r[i] - t)
        elif r[i] <= -t:
            out[i // 4] |= 0b10 << (6 - 2 * (i % 4))
            r[i] = np.float32(r[i] + t)
    return bytes(out), r


def simulate_1bit(grad, residual, t):
    """MXNet master's 1-bit rule, one element at a time: (packed bytes, new residual)."""
    t = np.float32(t)
    r = residual.copy()
    out = bytearray(K.packed_nbytes(grad.size, 1))
    for i in range(grad.size):
        r[i] = np.float32(r[i] + grad[i])
        if r[i] > t:
            out[i // 8] |= 0x80 >> (i % 8)
            r[i] = np.float32(r[i] - 1)
        else:
            r[i] = np.float32(r[i] + 1)
    return bytes(out), r


def same_bits(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                          np.asarray(b, np.float32).view(np.uint32))


# ------------------------------------------------------------ MXNet byte equality
@pytest.mark.parametrize("case", REF["quantize"], ids=lambda c: f"n{c['n']}-t{c['threshold']}")
def test_2bit_bytes_equal_mxnet(case):
    """Packed bytes, residuals and decoded values equal MXNet 1.9.1's for recorded inputs."""
    comp = TwoBit(case["threshold"])
    residual = f32(case["residual_in"])
    for step in case["steps"]:
        payload, ctx = comp.compress(f32(step["grad"]), residual)
        assert payload.tobytes().hex() == step["packed_hex"]
        assert same_bits(residual, step["residual_after"])
        assert same_bits(comp.decompress(payload, ctx), step["decoded"])


def test_2bit_decodes_every_byte_as_mxnet():
    """Every byte value (0b01 codes included) decodes to MXNet's values."""
    ref = REF["decode_every_byte"]
    payload = np.frombuffer(bytes.fromhex(ref["packed_hex"]), np.uint8)
    out = TwoBit(ref["threshold"]).decompress(payload, gpukv.update.compression.Ctx(1024, (1024,)))
    assert same_bits(out, ref["decoded"])


# ---------------------------------------------------------- rule vs simulator
@settings(max_examples=60, deadline=None)
@given(gradient_steps())
def test_2bit_matches_python_rule(size_steps):
    """The vectorised 2-bit twin equals the element-by-element rule, residual carried over."""
    _, steps = size_steps
    residual = np.zeros(steps[0].size, np.float32)
    expected_r = residual.copy()
    for g in steps:
        payload = K.quantize_2bit(g, residual, 0.5)
        expected, expected_r = simulate_2bit(g, expected_r, 0.5)
        assert payload.tobytes() == expected
        assert same_bits(residual, expected_r)


@settings(max_examples=60, deadline=None)
@given(gradient_steps())
def test_1bit_matches_python_rule(size_steps):
    """The vectorised 1-bit twin equals MXNet master's rule element by element."""
    _, steps = size_steps
    residual = np.zeros(steps[0].size, np.float32)
    expected_r = residual.copy()
    for g in steps:
        payload = K.quantize_1bit(g, residual, 0.25)
        expected, expected_r = simulate_1bit(g, expected_r, 0.25)
        assert payload.tobytes() == expected
        assert same_bits(residual, expected_r)
        decoded = np.empty(g.size, np.float32)
        K.dequantize_1bit(payload, g.size, decoded)
        bits = np.unpackbits(np.frombuffer(expected, np.uint8))[:g.size]
        assert same_bits(decoded, np.where(bits == 1, 1, -1))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 32768, 32769, 100_003])
@pytest.mark.parametrize("kind", ["2bit", "1bit"])
def test_block_edges(n, kind):
    """Sizes around word and block boundaries pack like the rule, padding bytes zero."""
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n).astype(np.float32)
    r0 = (rng.standard_normal(n) * 0.3).astype(np.float32)
    r = r0.copy()
    if kind == "2bit":
        payload = K.quantize_2bit(g, r, 0.5)
        expected, er = simulate_2bit(g[:2000], r0[:2000], 0.5)
    else:
        payload = K.quantize_1bit(g, r, 0.5)
        expected, er = simulate_1bit(g[:2000], r0[:2000], 0.5)
    bits = 2 if kind == "2bit" else 1
    assert payload.size == K.packed_nbytes(n, bits)
    used = -(-min(n, 2000) * bits // 8)
    assert payload[:used].tobytes() == expected[:used]
    assert same_bits(r[:2000], er)
    assert not payload[-(-n * bits // 8):].any()


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("comp", [TwoBit(0.5), OneBit(0.0), Cast("fp16"), Cast("bf16", 4.0)],
                         ids=["2bit", "1bit", "fp16", "bf16"])
def test_decompress_accumulate(comp, accumulate):
    """decompress writes the decoded value, or adds it to `out` with accumulate=True."""
    g = np.linspace(-2, 2, 37, dtype=np.float32).reshape(37, 1)
    payload, ctx = comp.compress(g, np.zeros(37, np.float32))
    plain = comp.decompress(payload, ctx)
    out = np.full(g.shape, 3, np.float32)
    comp.decompress(payload, ctx, out, accumulate=accumulate)
    assert same_bits(out, plain + 3 if accumulate else plain)


@pytest.mark.parametrize("kind,dtype", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)])
@pytest.mark.parametrize("pre_divide", [1.0, 4.0])
def test_casts_round_to_nearest_even(kind, dtype, pre_divide):
    """fp16/bf16 payloads are the round-to-nearest-even cast of x / pre_divide, NaN kept."""
    rng = np.random.default_rng(3)
    x = np.concatenate([(rng.standard_normal(5000) * 300).astype(np.float32),
                        f32([0, -0.0, 1e-30, np.inf, -np.inf, 65504 * 3])])
    comp = Cast(kind, pre_divide)
    payload, ctx = comp.compress(x)
    with np.errstate(over="ignore"):
        expected = (x / np.float32(pre_divide)).astype(dtype)
    assert np.array_equal(payload.view(np.uint16), expected.view(np.uint16))
    back = comp.decompress(payload, ctx)
    assert same_bits(back, expected.astype(np.float32) * np.float32(pre_divide))
    nan_payload, _ = comp.compress(f32([np.nan]))
    assert np.isnan(comp.decompress(nan_payload, ctx._replace(size=1, shape=(1,))))[0]


# ------------------------------------------------ host twins vs NumPy's own casts
def bf16_reference(x):
    """MXNet/CUDA-style bfloat16 bits of float32 `x`: round to nearest even, NaN quieted."""
    u = x.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    return np.where(np.isnan(x), (u >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


@settings(max_examples=150, deadline=None)
@given(float32_bits(), st.sampled_from([1.0, 3.0, 0.125]))
def test_cast_twins_match_numpy_on_any_bits(x, scale):
    """fp16 payloads are NumPy's astype (NaN payloads, subnormals, ties, overflow to inf),
    bf16 payloads the rounding rule, with and without NaN in the block."""
    with np.errstate(all="ignore"):
        for v in (x, x[~np.isnan(x)]):  # a NaN sends its block to NumPy's own cast
            if not v.size:
                continue
            scaled = v if scale == 1.0 else v / np.float32(scale)
            fp16 = K.cast_fp16(v, scale)
            assert fp16.dtype == np.float16
            assert np.array_equal(fp16.view(np.uint16), scaled.astype(np.float16).view(np.uint16))
            assert np.array_equal(K.cast_bf16(v, scale), bf16_reference(scaled))


@pytest.mark.parametrize("scale", [1.0, 0.3])
@pytest.mark.parametrize("accumulate", [False, True])
def test_uncast_twins_match_numpy_on_every_pattern(scale, accumulate):
    """Every float16 and bfloat16 bit pattern decodes as NumPy's astype times the scale,
    finite-only blocks (the arithmetic path) and blocks with inf/NaN alike."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = every[(every & 0x7C00) != 0x7C00]
    for bits in (every, finite):
        start = np.linspace(-2, 2, bits.size, dtype=np.float32)
        half = bits.view(np.float16).astype(np.float32)
        brain = (bits.astype(np.uint32) << 16).view(np.float32)
        with np.errstate(all="ignore"):
            if scale != 1.0:  # (x * 1 would quiet signalling NaNs)
                half, brain = half * np.float32(scale), brain * np.float32(scale)
            for payload, value, uncast in ((bits.view(np.float16), half, K.uncast_fp16),
                                           (bits, brain, K.uncast_bf16)):
                out = start.copy()
                uncast(payload, scale, out, accumulate)
                assert same_bits(out, start + value if accumulate else value)


@pytest.mark.parametrize("comp", [TwoBit(0.5), OneBit(0.1), Cast("fp16", 2.0), Cast("bf16")],
                         ids=["2bit", "1bit", "fp16", "bf16"])
def test_threaded_host_twins_equal_one_thread(comp, monkeypatch):
    """Long arrays split over the host threads give the bytes and residuals of one thread."""
    from gpukv.comm import host
    n = K._THREADED_MIN * 2 + 77
    rng = np.random.default_rng(11)
    g = rng.standard_normal(n).astype(np.float32)
    r0 = (rng.standard_normal(n) * 0.3).astype(np.float32)
    results = []
    for threads, threshold in ((1, 1 << 62), (3, K._THREADED_MIN)):
        monkeypatch.setattr(host, "THREADS", threads)
        monkeypatch.setattr(K, "_THREADED_MIN", threshold)
        r = r0.copy()
        payload, ctx = comp.compress(g, r)
        out = np.full(n, 0.5, np.float32)
        comp.decompress(payload, ctx, out, accumulate=True)
        results.append((payload.tobytes(), r.tobytes(), out.tobytes()))
    assert results[0] == results[1]


# ------------------------------------------------------------------- the store
def _store(params, updater=None):
    kv = gpukv.create("device")
    kv.set_gradient_compression(params)
    if updater is not None:
        kv.set_updater(updater)
    return kv


def test_nightly_sequence_matches_mxnet():
    """MXNet's nightly compression sequence (4 devices, w += 2*g, t=0.5) pulls MXNet's values."""
    ref = REF["kvstore_sequence"]
    shape = tuple(ref["shape"])

    def update(key, grad, weight):
        weight += grad * ref["rate"]

    kv = _store({"type": "2bit", "threshold": ref["threshold"]}, update)
    kv.init(0, np.zeros(shape, np.float32))
    kv.init(1, np.ones(shape, np.float32))
    out = np.zeros(shape, np.float32)
    kv.pull(1, out=out)
    assert (out == ref["init_ones_pulled"]).all()  # init is not compressed
    seen = []
    for step in ref["steps"]:
        kv.push(0, [np.full(shape, step["push_each"], np.float32)
                    for _ in range(ref["devices"])])
        kv.pull(0, out=out)
        assert same_bits(out.ravel(), step["pulled"]), step
        seen.append(float(out[0, 0]))
    assert seen[:15] == [0, 0, 4, 4, 8, 4, 0, -4, -8, -12, -16, -20, -24, -28, -32]


def test_random_pushes_match_mxnet():
    """Random per-device pushes without updater pull MXNet's sums, residuals per device."""
    ref = REF["kvstore_random"]
    shape = tuple(ref["shape"])
    kv = _store({"type": "2bit", "threshold": ref["threshold"]})
    kv.init("k", np.zeros(shape, np.float32))
    out = np.zeros(shape, np.float32)
    for step in ref["steps"]:
        kv.push("k", [f32(g).reshape(shape) for g in step["grads"]])
        kv.pull("k", out=out)
        assert same_bits(out.ravel(), step["pulled"])
    single = _store({"type": "2bit", "threshold": ref["threshold"]})
    single.init(0, np.zeros((2, 2), np.float32))
    single.push(0, f32(ref["single_source"]["grad"]))  # a lone source is compressed too
    o = np.zeros((2, 2), np.float32)
    single.pull(0, out=o)
    assert same_bits(o.ravel(), ref["single_source"]["pulled"])


@pytest.mark.parametrize("params", [{"type": "1bit", "threshold": 0.0},
                                    {"type": "fp16"}, {"type": "bf16", "pre_divide": 2}],
                         ids=["1bit", "fp16", "bf16"])
def test_store_applies_compressor_per_source(params):
    """The pulled value is the float32 sum of each source's own compress/decompress trip."""
    rng = np.random.default_rng(5)
    comp = make_compressor(params)
    kv = _store(params)
    kv.init(3, np.zeros((4, 7), np.float32))
    residuals = [np.zeros(28, np.float32) for _ in range(3)]
    out = np.zeros((4, 7), np.float32)
    for _ in range(3):
        grads = [rng.standard_normal((4, 7)).astype(np.float32) for _ in range(3)]
        expected = np.zeros((4, 7), np.float32)
        for i, g in enumerate(grads):
            payload, ctx = comp.compress(g, residuals[i])
            comp.decompress(payload, ctx, expected, accumulate=i > 0)
        kv.push(3, grads)
        kv.pull(3, out=out)
        assert same_bits(out, expected)


def test_narrow_and_integer_keys():
    """fp16 keys are compressed via float32 and assigned back; int keys travel as they are."""
    kv = _store({"type": "2bit", "threshold": 0.5})
    kv.init(["h", "i"], [np.zeros(5, np.float16), np.zeros(5, np.int32)])
    kv.push(["h", "i"], [[np.full(5, 0.7, np.float16)] * 2, [np.full(5, 3, np.int32)] * 2])
    h, i = np.zeros(5, np.float16), np.zeros(5, np.int32)
    kv.pull(["h", "i"], out=[h, i])
    assert (h == 1.0).all() and (i == 6).all()


def test_no_compression_after_none():
    """set_gradient_compression(None) turns compression off again."""
    kv = _store({"type": "2bit", "threshold": 0.5})
    assert kv.gradient_compression == {"type": "2bit", "threshold": 0.5}
    kv.set_gradient_compression(None)
    assert kv.gradient_compression is None
    kv.init(0, np.zeros(3, np.float32))
    kv.push(0, np.full(3, 0.3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull(0, out=out)
    assert (out == np.float32(0.3)).all()


# ------------------------------------------------------------------- refusals
@pytest.mark.parametrize("name", ["local", "local_allreduce_cpu", "nccl"])
def test_refused_for_stores_mxnet_refuses(name):
    """Stores whose type has neither 'device' nor 'dist' refuse compression, as MXNet does."""
    kv = gpukv.create(name)
    assert REF["refusals"]["local"].startswith("Gradient compression is not supported")
    with pytest.raises(gpukv.ArgumentError, match="not supported"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    assert not kv.is_capable("gradient_compression")


@pytest.mark.parametrize("params,error,words", [
    ({"type": "2bit", "threshold": 0}, gpukv.ArgumentError, "'threshold'"),
    ({"type": "2bit", "threshold": -1}, gpukv.ArgumentError, "'threshold'"),
    ({"type": "2bit", "threshold": float("nan")}, gpukv.ArgumentError, "'threshold'"),
    ({"type": "2bit", "threshold": "x"}, gpukv.ArgumentError, "'threshold'"),
    ({"type": "2bit", "threshold": [1]}, gpukv.ArgumentKindError, "'threshold'"),
    ({"type": "3bit"}, gpukv.ArgumentError, "'type'"),
    ({"threshold": 0.5}, gpukv.ArgumentError, "'type'"),
    ({"type": "2bit", "treshold": 0.5}, gpukv.ArgumentError, "'treshold'"),
    ({"type": "fp16", "threshold": 0.5}, gpukv.ArgumentError, "'threshold'"),
    ({"type": "fp16", "pre_divide": 0}, gpukv.ArgumentError, "'pre_divide'"),
    ("2bit", gpukv.ArgumentKindError, "dict"),
])
def test_bad_options(params, error, words):
    """Bad compression options raise a typed error naming the option; nothing changes."""
    kv = _store({"type": "fp16"})
    with pytest.raises(error, match=words):
        kv.set_gradient_compression(params)
    assert kv.gradient_compression == {"type": "fp16", "pre_divide": 1.0}


def test_threshold_as_string_accepted():
    """Options given as strings (as MXNet passes them) are parsed."""
    assert make_compressor({"type": "2bit", "threshold": "0.25"}).threshold == 0.25


# ------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("comp", [TwoBit(0.5), OneBit(0.1), Cast("fp16", 2.0), Cast("bf16")],
                         ids=["2bit", "1bit", "fp16", "bf16"])
@pytest.mark.parametrize("n", [1, 17, 33, 100_003])
def test_gpu_kernels_bit_identical(comp, n):
    """The CUDA kernels give the NumPy twins' bytes, residuals and decoded values (for
    inputs without float32 subnormals, which CuPy's -ftz=true flushes to zero)."""
    import cupy
    rng = np.random.default_rng(n)
    g = without_subnormals(rng.standard_normal(n).astype(np.float32))
    r = without_subnormals((rng.standard_normal(n) * 0.3).astype(np.float32))
    r_gpu = cupy.asarray(r)
    p_host, ctx = comp.compress(g, r)
    p_gpu, _ = comp.compress(cupy.asarray(g), r_gpu)
    assert p_gpu.get().tobytes() == p_host.tobytes()
    assert same_bits(r_gpu.get(), r)
    out = cupy.ones(n, cupy.float32)
    comp.decompress(p_gpu, ctx, out, accumulate=True)
    assert same_bits(out.get(), comp.decompress(p_host, ctx) + 1)


@pytest.mark.multi_gpu(2)
def test_gpu_store_nightly_sequence():
    """The nightly sequence on GPUs pulls MXNet's values."""
    import cupy
    from gpukv.device.cuda.device import gpu_devices
    ref = REF["kvstore_sequence"]
    shape = tuple(ref["shape"])
    devs = gpu_devices()[:4]

    def update(key, grad, weight):
        weight += grad * ref["rate"]

    kv = _store({"type": "2bit", "threshold": 0.5}, update)
    with cupy.cuda.Device(devs[0].physical):
        kv.init(0, cupy.zeros(shape, cupy.float32))
    for step in ref["steps"]:
        values = []
        for d in range(ref["devices"]):
            with cupy.cuda.Device(devs[d % len(devs)].physical):
                values.append(cupy.full(shape, step["push_each"], cupy.float32))
        kv.push(0, values)
        out = np.zeros(shape, np.float32)
        kv.pull(0, out=out)
        assert same_bits(out.ravel(), step["pulled"])


# ----------------------------------------------- stream order of GPU paths, on the host
def test_gpu_residual_zeroed_on_its_device_stream():
    """A GPU residual is zero-filled on its device's stream, where the kernels read it."""
    from gpukv.update.compression import GradientCompression
    from .fake_gpu import FakeGpu
    log, current = [], {}
    dev = FakeGpu(0, log, current, slot=1)
    r = GradientCompression(TwoBit(0.5)).residual("k", dev, 8)
    assert not r.any()
    assert log == [("fill", dev.name, dev.stream.name)]


def test_gpu_compressed_reduce_enters_and_leaves_every_device():
    """A compressed push on GPUs waits for the caller's streams first and makes them wait
    for its work last (virtual GPUs have streams of their own), as the strategies do."""
    from gpukv.update.compression import GradientCompression
    from .fake_gpu import FakeGpu
    log, current = [], {}
    home, other = FakeGpu(0, log, current), FakeGpu(0, log, current, slot=1)
    sources = [f32([1, -1, 0.2, 0.7]), f32([1, 0.1, -1, 0.7])]
    out = np.zeros(4, np.float32)
    GradientCompression(TwoBit(0.5)).reduce("k", sources, [home, other], home, out)
    assert out.tolist() == [1.0, -0.5, -0.5, 1.0]
    names = {home.name, other.name}
    ops = [e for e in log if e[0] != "fill"]
    assert {e[1] for e in ops[:2] if e[0] == "enter"} == names
    assert {e[1] for e in ops[-2:] if e[0] == "leave"} == names
    assert ("wait_for", other.name, home.name) in ops  # sources are read before reuse

"""Gradient compression: MXNet's 2-bit bytes and rule, 1-bit, fp16/bf16 casts, store wiring."""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukv
from gpukv.comm import ReduceJob
from gpukv.comm.registry import make_strategy
from gpukv.device import codecs as K
from gpukv.device import host_codecs as twins
from gpukv.device import host_device
from gpukv.encoding.compression import GradientCompression
from gpukv.encoding.compressors import Cast, Ctx, OneBit, TwoBit, make_compressor

from ..bfloat16 import BF16, needs_bfloat16
from ..strategies import float32_bits, gradient_steps

REF = json.loads((pathlib.Path(__file__).parents[1] / "data"
                  / "mxnet_2bit_reference.json").read_text())


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
@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
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
    out = TwoBit(ref["threshold"]).decompress(payload, Ctx(1024, (1024,)))
    assert same_bits(out, ref["decoded"])


# ---------------------------------------------------------- rule vs simulator
@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
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


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
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


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 32768, twins.BLOCK, twins.BLOCK + 1,
                               100_003])
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


def reference_2bit(grad, residual, t):
    """MXNet's 2-bit rule in plain whole-array NumPy: (packed bytes, new residual)."""
    t = np.float32(t)
    r = residual + grad
    pos, neg = r >= t, r <= -t
    new_r = np.where(pos, r - t, np.where(neg, r + t, r))
    codes = np.zeros(-(-grad.size // 16) * 16, np.uint8)
    codes[:grad.size] = np.where(pos, 3, np.where(neg, 2, 0))
    quads = codes.reshape(-1, 4)
    packed = quads[:, 0] << 6 | quads[:, 1] << 4 | quads[:, 2] << 2 | quads[:, 3]
    return packed.tobytes(), new_r


def reference_1bit(grad, residual, t):
    """MXNet master's 1-bit rule in plain whole-array NumPy: (packed bytes, new residual)."""
    t = np.float32(t)
    r = residual + grad
    up = r > t
    bits = np.zeros(-(-grad.size // 32) * 32, bool)
    bits[:grad.size] = up
    return np.packbits(bits).tobytes(), np.where(up, r - np.float32(1), r + np.float32(1))


@st.composite
def long_gradients(draw):
    """(gradient, residual) of up to three blocks and a bit, random normals with ties at
    +-threshold, signed zeros, infinities and NaNs dropped in at drawn places."""
    n = max(1, draw(st.integers(0, 3)) * twins.BLOCK + draw(st.integers(0, 40)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    grad = (rng.standard_normal(n) * draw(st.sampled_from([0.1, 1.0, 10.0]))).astype(np.float32)
    residual = (rng.standard_normal(n) * 0.3).astype(np.float32)
    specials = [0.5, -0.5, 0.25, -0.25, 0.0, -0.0, np.inf, -np.inf, np.nan]
    for _ in range(draw(st.integers(0, 6))):
        where = draw(st.integers(0, n - 1))
        target = grad if draw(st.booleans()) else residual
        target[where] = draw(st.sampled_from(specials))
    return grad, residual


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
@settings(max_examples=40, deadline=None)
@given(long_gradients(), st.sampled_from([0.5, 0.25]))
def test_2bit_whole_blocks_match_reference(case, threshold):
    """Over whole blocks and ragged tails, the 2-bit twin's bytes and residuals equal the
    plain NumPy rule's, and decoding (added to a buffer or not) gives the codes' values."""
    grad, residual = case
    expected, expected_r = reference_2bit(grad, residual, threshold)
    r = residual.copy()
    payload = K.quantize_2bit(grad, r, threshold)
    assert payload.tobytes() == expected
    assert same_bits(r, expected_r)
    codes = np.unpackbits(payload).reshape(-1, 2)[:grad.size]
    t = np.float32(threshold)
    values = np.where(codes[:, 0] == 0, np.float32(0), np.where(codes[:, 1] == 1, t, -t))
    out = np.empty(grad.size, np.float32)
    assert same_bits(K.dequantize_2bit(payload, grad.size, threshold, out), values)
    total = residual.copy()
    K.dequantize_2bit(payload, grad.size, threshold, total, accumulate=True)
    assert same_bits(total, residual + values)


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
@settings(max_examples=40, deadline=None)
@given(long_gradients(), st.sampled_from([0.0, 0.25, -0.5]))
def test_1bit_whole_blocks_match_reference(case, threshold):
    """Over whole blocks and ragged tails, the 1-bit twin's bytes and residuals equal the
    plain NumPy rule's, and decoding (added to a buffer or not) gives +1 / -1 per bit."""
    grad, residual = case
    expected, expected_r = reference_1bit(grad, residual, threshold)
    r = residual.copy()
    payload = K.quantize_1bit(grad, r, threshold)
    assert payload.tobytes() == expected
    assert same_bits(r, expected_r)
    bits = np.unpackbits(payload)[:grad.size]
    values = np.where(bits == 1, np.float32(1), np.float32(-1))
    out = np.empty(grad.size, np.float32)
    assert same_bits(K.dequantize_1bit(payload, grad.size, out), values)
    total = residual.copy()
    K.dequantize_1bit(payload, grad.size, total, accumulate=True)
    assert same_bits(total, residual + values)


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
@settings(max_examples=100, deadline=None)
@given(float32_bits(max_size=300), st.sampled_from([0.5, 1e-30, 3e38]))
def test_2bit_and_1bit_match_the_rule_on_any_bits(words, threshold):
    """Gradients and residuals of any bits (NaN payloads, infinities, subnormals): the
    bytes and residuals of the plain NumPy rules, bit for bit. Where both addends are
    NaN, any NaN: which payload an add keeps is not fixed even within NumPy (its scalar
    loop and its vector loop keep different ones)."""
    half = max(1, words.size // 2)
    grad = words[:half].copy()
    residual = np.resize(words[half:], half) if words.size > 1 else words.copy()
    both_nan = np.isnan(grad) & np.isnan(residual)
    with np.errstate(all="ignore"):
        for quantize, reference in ((K.quantize_2bit, reference_2bit),
                                    (K.quantize_1bit, reference_1bit)):
            expected, expected_r = reference(grad, residual, threshold)
            r = residual.copy()
            assert quantize(grad, r, threshold).tobytes() == expected
            assert same_bits(r[~both_nan], expected_r[~both_nan])
            assert np.isnan(r[both_nan]).all()


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


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
@pytest.mark.parametrize("kind,dtype", [
    ("fp16", np.float16), pytest.param("bf16", BF16, id="bf16-bfloat16", marks=needs_bfloat16)])
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


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
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


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
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


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
@pytest.mark.parametrize("comp", [TwoBit(0.5), OneBit(0.1), Cast("fp16", 2.0), Cast("bf16")],
                         ids=["2bit", "1bit", "fp16", "bf16"])
def test_threaded_host_twins_equal_one_thread(comp, monkeypatch):
    """Long arrays split over the host threads give the bytes and residuals of one thread."""
    from gpukv.device import host_sum as host
    n = twins._THREADED_MIN * 2 + 77
    rng = np.random.default_rng(11)
    g = rng.standard_normal(n).astype(np.float32)
    r0 = (rng.standard_normal(n) * 0.3).astype(np.float32)
    results = []
    for threads, threshold in ((1, 1 << 62), (3, twins._THREADED_MIN)):
        monkeypatch.setattr(host, "THREADS", threads)
        monkeypatch.setattr(twins, "_THREADED_MIN", threshold)
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


# ------------------------------------------- compressed terms reduced by a strategy
def reduce_as_before(comp, residuals, sources):
    """The float32 sum of every source's compress/decompress trip (residual i for source
    i), decoded and added at home in source order."""
    out = np.empty(sources[0].shape, np.float32)
    for i, (source, residual) in enumerate(zip(sources, residuals)):
        payload, ctx = comp.compress(source, residual)
        comp.decompress(payload, ctx, out, accumulate=i > 0)
    return out


def compressed_push(gc, key, sources, strategy, home_slot=0):
    """One push of `sources` (source i on host slot i): encoded per source, reduced by
    `strategy` into a fresh float32 out at `home_slot`, then finished there."""
    devices = [host_device(i) for i in range(len(sources))]
    home = host_device(home_slot)
    out = np.full(sources[0].shape, np.nan, np.float32)
    terms = gc.encode(key, sources, devices)
    assert [t.shape for t in terms] == [s.shape for s in sources]
    strategy.reduce_many([ReduceJob(key, terms, devices, home, out)])
    gc.finish(key, out, home)
    return out


def _power_of_two(x: float) -> bool:
    return math.frexp(x)[0] == 0.5


ENCODINGS = [{"type": "2bit", "threshold": 0.5}, {"type": "2bit", "threshold": 0.3},
             {"type": "2bit", "threshold": 1e-3}, {"type": "1bit", "threshold": 0.0},
             {"type": "1bit", "threshold": -0.2}, {"type": "fp16"},
             {"type": "fp16", "pre_divide": 8}, {"type": "fp16", "pre_divide": 0.5},
             {"type": "fp16", "pre_divide": 3}, {"type": "fp16", "pre_divide": 0.3},
             {"type": "bf16"}, {"type": "bf16", "pre_divide": 0.3}]


@settings(max_examples=120, deadline=None)
@given(params=st.sampled_from(ENCODINGS), n=st.integers(1, 5),
       shape=st.sampled_from([(1,), (7,), (3, 5), (67,)]),
       scale=st.sampled_from([1e-3, 1.0, 300.0, 4e4]), steps=st.integers(1, 3),
       seed=st.integers(0, 2 ** 16))
def test_home_reduce_of_encoded_terms_equals_the_decoded_sum(params, n, shape, scale, steps,
                                                             seed):
    """Terms encoded per source and summed by the 'home' strategy give the float32 sum of
    each source's decompressed trip in source order, and its residuals, bit for bit; fp16
    payloads are summed first and scaled by pre_divide once, which is the same bits for
    a power-of-two pre_divide and within the rounding of the sum otherwise."""
    rng = np.random.default_rng(seed)
    comp = make_compressor(params)
    gc = GradientCompression(make_compressor(params))
    residuals = [np.zeros(int(np.prod(shape)), np.float32) for _ in range(n)]
    exact = params["type"] != "fp16" or _power_of_two(comp.pre_divide)
    for _ in range(steps):
        grads = [(rng.standard_normal(shape) * scale).astype(np.float32) for _ in range(n)]
        before = [r.copy() for r in residuals]
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, on purpose
            want = reduce_as_before(comp, residuals, grads)
            got = compressed_push(gc, "k", grads, make_strategy("home"))
        if exact:
            assert same_bits(got, want)
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                terms = [comp.decompress(*comp.compress(g, r.copy()))
                         for g, r in zip(grads, before)]
                bound = 2 * n * np.finfo(np.float32).eps * np.sum(np.abs(terms), axis=0)
            finite = np.isfinite(want)
            assert same_bits(got[~finite], want[~finite])
            assert (np.abs(got[finite] - want[finite]) <= bound[finite]).all()
        for i, r in enumerate(residuals):
            if comp.uses_residual:
                assert same_bits(gc.feedback.residuals[("k", host_device(i))], r)


@pytest.mark.parametrize("params", [{"type": "2bit", "threshold": 0.5},
                                    {"type": "1bit", "threshold": 0.25}, {"type": "fp16"},
                                    {"type": "fp16", "pre_divide": 4},
                                    {"type": "bf16", "pre_divide": 2}],
                         ids=["2bit", "1bit", "fp16", "fp16-pre4", "bf16-pre2"])
def test_compressed_push_same_for_every_strategy(params):
    """Pushes from four host devices, encoded per source, pull the same sums (and leave
    the same residuals) whether 'home', 'tree' (sliced) or 'ring' reduces the terms."""
    rng = np.random.default_rng(1)
    strategies = {"home": make_strategy("home"), "tree": make_strategy("tree", array_bound=4),
                  "ring": make_strategy("ring")}
    stores = {name: GradientCompression(make_compressor(params)) for name in strategies}
    for step in range(3):
        # multiples of 1/64 below 8: every sum of their trips is exact in float32
        grads = [rng.integers(-512, 512, (33, 5)).astype(np.float32) / 64 for _ in range(4)]
        got = {name: compressed_push(stores[name], "w", grads, strategy, home_slot=step)
               for name, strategy in strategies.items()}
        assert not np.isnan(got["home"]).any()
        for name in ("tree", "ring"):
            assert same_bits(got[name], got["home"]), name
            for slot, r in stores["home"].feedback.residuals.items():
                assert same_bits(stores[name].feedback.residuals[slot], r)


def test_repeated_device_keeps_each_sources_term():
    """Two sources of one key on the same device get a decoded term each, so the second
    source's decoding never overwrites the first's before the strategy reads it."""
    gc = GradientCompression(make_compressor({"type": "2bit", "threshold": 0.5}))
    dev = host_device(0)
    terms = gc.encode("k", [f32([1, -1, 0]), f32([-1, 1, 0.6])], [dev, dev])
    assert terms[0].tolist() == [0.5, -0.5, 0] and terms[1].tolist() == [-0.5, 0.5, 0.5]


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
    ({"type": 3}, gpukv.ArgumentKindError, "'type' must be a str, got int 3"),
    ({"type": None}, gpukv.ArgumentKindError, "'type' must be a str, got NoneType"),
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


# Values that are not representable in float32, the precision the kernels run in: a
# nonzero value that rounds to 0, one that is a subnormal (a GPU flushes it to 0), or one
# that overflows to inf; and values that are not numbers at all.
UNREPRESENTABLE = [
    ({"type": "2bit", "threshold": 1e-50}, gpukv.ArgumentError, r"'threshold'.*1e-50"),
    ({"type": "2bit", "threshold": 1e-40}, gpukv.ArgumentError, r"'threshold'.*1e-40"),
    ({"type": "2bit", "threshold": 1e39}, gpukv.ArgumentError, r"'threshold'.*1e\+39"),
    ({"type": "2bit", "threshold": "1e39"}, gpukv.ArgumentError, r"'threshold'.*'1e39'"),
    ({"type": "2bit", "threshold": 10 ** 400}, gpukv.ArgumentError, r"'threshold'.*10000"),
    ({"type": "2bit", "threshold": float("inf")}, gpukv.ArgumentError, r"'threshold'.*inf"),
    ({"type": "2bit", "threshold": True}, gpukv.ArgumentKindError, r"'threshold'.*bool"),
    ({"type": "1bit", "threshold": 1e-50}, gpukv.ArgumentError, r"'threshold'.*1e-50"),
    ({"type": "1bit", "threshold": -1e-40}, gpukv.ArgumentError, r"'threshold'.*-1e-40"),
    ({"type": "1bit", "threshold": -1e39}, gpukv.ArgumentError, r"'threshold'.*-1e\+39"),
    ({"type": "1bit", "threshold": -(10 ** 400)}, gpukv.ArgumentError, r"'threshold'.*-1000"),
    ({"type": "1bit", "threshold": float("nan")}, gpukv.ArgumentError, r"'threshold'.*nan"),
    ({"type": "1bit", "threshold": "nan"}, gpukv.ArgumentError, r"'threshold'.*'nan'"),
    ({"type": "fp16", "pre_divide": 1e39}, gpukv.ArgumentError, r"'pre_divide'.*1e\+39"),
    ({"type": "fp16", "pre_divide": 1e-50}, gpukv.ArgumentError, r"'pre_divide'.*1e-50"),
    ({"type": "fp16", "pre_divide": 1e-45}, gpukv.ArgumentError, r"'pre_divide'.*1e-45"),
    ({"type": "fp16", "pre_divide": 10 ** 400}, gpukv.ArgumentError, r"'pre_divide'.*10000"),
    ({"type": "fp16", "pre_divide": float("nan")}, gpukv.ArgumentError, r"'pre_divide'.*nan"),
    ({"type": "fp16", "pre_divide": float("-inf")}, gpukv.ArgumentError,
     r"'pre_divide'.*-inf"),
    ({"type": "fp16", "pre_divide": False}, gpukv.ArgumentKindError, r"'pre_divide'.*bool"),
    ({"type": "fp16", "pre_divide": "two"}, gpukv.ArgumentError, r"'pre_divide'.*'two'"),
    ({"type": "bf16", "pre_divide": "1e-50"}, gpukv.ArgumentError, r"'pre_divide'.*'1e-50'"),
    ({"type": "bf16", "pre_divide": np.float64(3e38 * 10)}, gpukv.ArgumentError,
     r"'pre_divide'.*3e\+39"),
]


@pytest.mark.parametrize("params,error,words", UNREPRESENTABLE,
                         ids=[f"{p['type']}-{list(p.values())[1]!r:.12}"
                              for p, _, _ in UNREPRESENTABLE])
def test_options_unrepresentable_in_float32_are_refused(params, error, words):
    """An option that is no float32 number (0, a subnormal or inf once rounded to float32,
    beyond any float, NaN, a bool, a word) raises a typed error naming the option and the
    value when compression is set, and the previous setting stays."""
    kv = _store({"type": "2bit", "threshold": 0.25})
    with pytest.raises(error, match=words):
        kv.set_gradient_compression(params)
    assert kv.gradient_compression == {"type": "2bit", "threshold": 0.25}


@pytest.mark.parametrize("params", [{"type": "1bit", "threshold": 0},
                                    {"type": "1bit", "threshold": -3.4e38},
                                    {"type": "2bit", "threshold": 2.0 ** -126},
                                    {"type": "fp16", "pre_divide": 3.4e38},
                                    {"type": "bf16", "pre_divide": "1.2e-38"}],
                         ids=["1bit-0", "1bit-min", "2bit-tiny", "fp16-max", "bf16-tiny"])
def test_float32_extremes_accepted(params):
    """0 (for 1bit) and float32's largest and smallest normal magnitudes are valid options."""
    kv = _store(params)
    assert kv.gradient_compression["type"] == params["type"]


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
    from ..fake_gpu import FakeGpu
    log, current = [], {}
    dev = FakeGpu(0, log, current, slot=1)
    r = GradientCompression(TwoBit(0.5)).residual("k", dev, 8)
    assert not r.any()
    assert log == [("fill", dev.name, dev.stream.name)]


def test_gpu_encode_enters_every_device_first():
    """Encoding on GPUs first orders every device after the caller's streams (virtual
    GPUs have streams of their own), then works on each device's own stream."""
    from ..fake_gpu import FakeGpu
    log, current = [], {}
    home, other = FakeGpu(0, log, current), FakeGpu(0, log, current, slot=1)
    sources = [f32([1, -1, 0.2, 0.7]), f32([1, 0.1, -1, 0.7])]
    terms = GradientCompression(TwoBit(0.5)).encode("k", sources, [home, other])
    assert [t.tolist() for t in terms] == [[0.5, -0.5, 0, 0.5], [0.5, 0, -0.5, 0.5]]
    assert log[:2] == [("enter", home.name), ("enter", other.name)]
    assert log[2:] == [("fill", home.name, home.name), ("fill", other.name, other.name)]


def test_gpu_finish_scales_on_the_home_stream_then_leaves(monkeypatch):
    """fp16 with a pre_divide scales the summed payloads on the home device's stream and
    then orders the caller's stream after it; without a scale, finish does nothing."""
    from gpukv.device import codecs as kernels

    from ..fake_gpu import FakeGpu
    log, current = [], {}
    home = FakeGpu(0, log, current, slot=2)
    scale = kernels.scale_in_place
    monkeypatch.setattr(kernels, "scale_in_place", lambda out, factor: (
        log.append(("scale", current.get("stream"), factor)), scale(out, factor))[1])
    out = f32([1, -2.5])
    GradientCompression(Cast("fp16", 4)).finish("k", out, home)
    assert out.tolist() == [4, -10]
    assert log == [("scale", home.name, 4.0), ("leave", home.name)]
    log.clear()
    for comp in (Cast("fp16"), Cast("bf16", 4), TwoBit(0.5)):
        GradientCompression(comp).finish("k", out, home)
    assert log == [] and out.tolist() == [4, -10]


@pytest.mark.parametrize("params", [{"type": "2bit", "threshold": 0.1},
                                    {"type": "1bit", "threshold": 0.5}])
def test_a_one_process_store_warns_once_of_a_residual_past_its_bound(params, caplog):
    """A 'device' store's pushes go through the same watch of the residual as a dist
    store's: gradients the rule cannot keep up with log one warning naming the key, however
    many pushes follow (and none for a key whose gradients it keeps up with)."""
    kv = gpukv.create("device")
    kv.set_gradient_compression(params)
    kv.init(["big", "small"], [np.zeros(64, np.float32), np.zeros(64, np.float32)])
    with caplog.at_level("WARNING", logger="gpukv"):
        for _ in range(40):
            kv.push(["big", "small"], [[np.full(64, 5.0, np.float32)] * 2,
                                       [np.full(64, 0.01, np.float32)] * 2])
    named = [r.getMessage() for r in caplog.records if "residual of key" in r.getMessage()]
    assert len(named) == 1 and "residual of key 'big'" in named[0], named
    assert str(params) in named[0]  # its threshold as given (0.1, not 0.10000000149...)

"""'sign' and 'ternary' on finite values whose block sums leave float32's range: a block's
squares (sign) or magnitudes (ternary) that sum to inf, or squares that sum below
float32's smallest normal, are taken over the block's largest magnitude m and the scale
multiplied back by m. Such blocks cross as finite values and leave a finite residual,
the bits of the rules' NumPy statements (test_sign.sign_rule, test_ternary.ternary_rule)
through the codecs, the compressors and a store's pushes and pulls, with the compiled
codecs and with their NumPy twins alike; the kernels' side is test_compression_gpu's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import gpukv
from gpukv.device import codecs, host_jit
from gpukv.encoding.compressors import make_compressor

from .test_sign import sign_rule
from .test_ternary import ternary_rule

RULES = {"sign": sign_rule, "ternary": ternary_rule}
BIGGEST = np.finfo(np.float32).max


def range_cases() -> dict[str, np.ndarray]:
    """Gradients (float32, no subnormal) with blocks past float32's range for the sums:
    huge finite values (alone, mixed with ordinary ones, at float32's largest), tiny ones
    whose squares underflow, and blocks of each kind side by side with ordinary ones."""
    rng = np.random.default_rng(11)

    def normal(n, scale):
        return (rng.standard_normal(n) * scale).astype(np.float32)

    one_huge = normal(300, 1.0)
    one_huge[5], one_huge[130], one_huge[299] = 1e25, -3e37, 7e36
    alternating = np.full(192, BIGGEST, np.float32)
    alternating[1::2] *= -1
    long = normal(2 * 65536 + 1000, 1.0)  # past the NumPy twins' chunks of 65536 values
    for edge in (65536, 2 * 65536):
        long[edge - 64:edge] *= np.float32(1e30)   # the block before a chunk edge
        long[edge:edge + 64] *= np.float32(1e-25)  # and the one after it
    long[-3:] = 2e37                               # a short last block
    return {
        "1e20": np.full(64, 1e20, np.float32),
        "-3e37-short": np.full(200, -3e37, np.float32),
        "largest-alternating": alternating,
        "one-huge-a-block": one_huge,
        "wide-1e30": normal(1000, 1e30),
        "ternary-sum-3e36": normal(777, 3e36),
        "1e-25": np.full(64, 1e-25, np.float32),
        "squares-underflow": normal(500, 1e-21),
        "long": long,
        "side-by-side": np.concatenate([normal(64, 1e20), normal(64, 1.0), normal(64, 1e-25),
                                        np.zeros(64, np.float32), normal(64, 1e-3),
                                        normal(100, 3e37)]),
    }


CASES = range_cases()


def steps(g: np.ndarray) -> int:
    """Pushes of `g` with one residual that stay finite: the residual stays within the
    block's largest magnitude, so three pushes of values up to 1e38 stay below float32's
    largest; one of larger ones."""
    return 3 if np.abs(g).max() <= 1e38 else 1


# a test run twice: the host codecs compiled by Numba, then their NumPy twins
both_paths = pytest.mark.usefixtures("host_codec_path")


@both_paths
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["sign", "ternary"])
def test_blocks_past_float32s_range_are_the_rule_and_finite(kind, case):
    """Push after push with one residual, the payload, decoded values and residual are
    the rule's, bit for bit, and every scale, decoded value and residual is finite."""
    g = CASES[case]
    comp = make_compressor({"type": kind})
    residual = np.zeros(g.size, np.float32)
    want_r = residual.copy()
    for step in range(steps(g)):
        payload, ctx = comp.compress(g, residual)
        decoded = comp.decompress(payload, ctx)
        want_payload, want, want_r = RULES[kind](g, want_r)
        assert payload.tobytes() == want_payload, f"payload of step {step}"
        assert decoded.tobytes() == want.tobytes(), f"decoded of step {step}"
        assert residual.tobytes() == want_r.tobytes(), f"residual of step {step}"
        assert np.isfinite(decoded).all() and np.isfinite(residual).all()


@both_paths
@pytest.mark.parametrize("kind", ["sign", "ternary"])
@pytest.mark.parametrize("value", [1e20, 1e30, 3e36, 3e38, float(BIGGEST), -1e25])
def test_a_block_of_one_huge_value_crosses_as_itself(kind, value):
    """A whole block of one finite value crosses as exactly that value (m's quotient is
    1, the mean of 1 is 1), leaving a zero residual, where its sum overflows."""
    g = np.full(256, value, np.float32)
    residual = np.zeros(256, np.float32)
    comp = make_compressor({"type": kind})
    payload, ctx = comp.compress(g, residual)
    assert comp.decompress(payload, ctx).tobytes() == g.tobytes()
    assert not residual.any()


@both_paths
@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.integers(1, 700),
              elements=st.floats(-float(BIGGEST), float(BIGGEST), width=32)),
       st.sampled_from(["sign", "ternary"]))
def test_any_finite_gradient_crosses_finite_as_the_rule(g, kind):
    """Any finite float32 gradient (subnormals, huge values and their mixtures): the
    payload, decoded values and residual of a push are the rule's, and all finite."""
    comp = make_compressor({"type": kind})
    residual = np.zeros(g.size, np.float32)
    payload, ctx = comp.compress(g, residual)
    decoded = comp.decompress(payload, ctx)
    want_payload, want, want_r = RULES[kind](g, np.zeros(g.size, np.float32))
    assert payload.tobytes() == want_payload
    assert decoded.tobytes() == want.tobytes()
    assert residual.tobytes() == want_r.tobytes()
    assert np.isfinite(decoded).all() and np.isfinite(residual).all()


@both_paths
@pytest.mark.parametrize("kind", ["sign", "ternary"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("big", [1e20, 1e30, 3e38])
def test_a_store_pulls_a_huge_push_finite_and_recovers(kind, dtype, big):
    """A 'device' store with the compression: a push of a huge finite gradient pulls
    finite (the rule's values: the worker's and then the home's residual), and the
    ordinary pushes after it pull ordinary values, for float32 and float64 keys."""
    n = 300
    kv = gpukv.create("device")
    kv.set_gradient_compression({"type": kind})
    kv.init("w", np.zeros(n, dtype))
    rule = RULES[kind]
    worker, home = np.zeros(n, np.float32), np.zeros(n, np.float32)
    out = np.empty(n, dtype)
    for g in (big, 1.0, 1.0):
        grad = np.full(n, g, dtype)
        kv.push("w", grad)
        _, sent, worker = rule(grad.astype(np.float32), worker)
        _, want, home = rule(sent, home)
        kv.pull("w", out=out)
        assert np.isfinite(out).all(), f"after a push of {g}"
        assert out.tobytes() == want.astype(dtype).tobytes(), f"after a push of {g}"
    assert (out == 1.0).all()  # both residuals spent: each block sent whole


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["sign", "ternary"])
def test_the_compiled_codecs_and_the_numpy_twins_agree(kind, case, monkeypatch):
    """The codecs themselves (gpukv.device.codecs), compiled and as NumPy twins: the
    same payload bytes, residuals and decoded values, written or added, on every case."""
    pytest.importorskip("numba", reason="the compiled codecs need Numba (the test extra)")
    g = CASES[case]
    quantize = getattr(codecs, f"quantize_{kind}")
    dequantize = getattr(codecs, f"dequantize_{kind}")
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv(host_jit.ENV, setting)
        assert host_jit.enabled() == (setting == "1")
        residual = np.zeros(g.size, np.float32)
        got = []
        for _ in range(steps(g)):
            payload = quantize(g, residual)
            written = dequantize(payload, g.size, np.full(g.size, np.nan, np.float32))
            added = dequantize(payload, g.size, np.full(g.size, 0.5, np.float32), True)
            got += [payload.tobytes(), residual.tobytes(), written.tobytes(), added.tobytes()]
        results.append(got)
    assert results[0] == results[1]

"""The sign compressor against a plain NumPy statement of its rule (scaled sign with error
feedback, a root-mean-square scale per 64 values), its payload's size, and bad options on
a store (what it shares with 'ternary': test_compressors.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import gpukv
from gpukv.encoding.compressors import Ctx, make_compressor

# every test twice: the host codecs compiled by Numba, then their NumPy twins
pytestmark = pytest.mark.usefixtures("host_codec_path")

BLOCK = 64


def _by_halves(m: np.ndarray) -> np.ndarray:
    """Each row's sum by halves (x[i] += x[i + h], h = 32, 16, ..., 1), in float32."""
    m = m.copy()
    h = BLOCK // 2
    while h:
        m[:, :h] = m[:, :h] + m[:, h:2 * h]
        h //= 2
    return m[:, 0]


def sign_rule(grad: np.ndarray, residual: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
    """(payload bytes, decoded values, new residual) of one push of float32 `grad` with
    `residual`, as the rule says: e = r + g; per block of 64 its squares summed by halves
    (x[i] += x[i+h], h = 32, 16, ..., 1), divided by the block's count, square-rooted:
    the scale; bit 1 where e >= 0; the decoded value +1 or -1 times the scale, taken out
    of e. A block of finite values whose sum of squares is inf or below float32's
    smallest normal, and whose largest magnitude m is above 0, takes the scale
    m * sqrt(the sum by halves of (v / m)**2 / count) instead."""
    e = residual + grad
    n = e.size
    blocks = -(-n // BLOCK)
    v = np.zeros(blocks * BLOCK, np.float32)
    v[:n] = e
    v = v.reshape(blocks, BLOCK)
    counts = np.full(blocks, BLOCK, np.float32)
    if n % BLOCK:
        counts[-1] = n % BLOCK
    with np.errstate(over="ignore", invalid="ignore"):
        sums = _by_halves(v * v)
        scales = np.sqrt(sums / counts)
        m = np.abs(v).max(axis=1)
    odd = ((sums == np.inf) | (sums < np.finfo(np.float32).tiny)) & (m > 0) & (m < np.inf)
    q = v / np.where(odd, m, np.float32(1))[:, None]
    rescaled = m * np.sqrt(_by_halves(q * q) / counts)
    scales = np.where(odd, rescaled, scales).astype(np.float32)
    bits = np.zeros(-(-n // 32) * 32, bool)
    bits[:n] = e >= 0
    signs = np.where(bits[:n], np.float32(1), np.float32(-1))
    decoded = signs * np.repeat(scales, BLOCK)[:n]
    return scales.tobytes() + np.packbits(bits).tobytes(), decoded, e - decoded


def reference_step(g: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(decoded value, new residual) of one push of `g` with residual `r` (`sign_rule`)."""
    _, decoded, residual = sign_rule(g, r)
    return decoded, residual


finite = st.floats(-1e4, 1e4, width=32, allow_subnormal=False)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.integers(1, 1300), elements=finite),
       st.integers(1, 3), st.floats(1e-3, 1e3))
def test_sign_is_its_rule_push_after_push(g, pushes, scale):
    """Push after push with one residual, the decoded values and the residual are the
    rule's, bit for bit (the gradients scaled too: nothing to tune)."""
    comp = make_compressor({"type": "sign"})
    residual = np.zeros(g.size, np.float32)
    want_r = residual.copy()
    for step in range(pushes):
        grad = (g * np.float32(scale) * np.float32(step + 1)).astype(np.float32)
        payload, ctx = comp.compress(grad, residual)
        decoded = comp.decompress(payload, ctx)
        want, want_r = reference_step(grad, want_r)
        assert decoded.tobytes() == want.tobytes()
        assert residual.tobytes() == want_r.tobytes()


@pytest.mark.parametrize("n", [1, 31, 32, 63, 64, 65, 256, 70_001])
def test_sign_payload_is_a_bit_a_value_and_a_scale_a_block(n):
    """4 * ceil(n / 64) + 4 * ceil(n / 32) bytes: 21x fewer than float32 for keys of a
    whole number of blocks, and at least 16x for any key of 2048 values or more."""
    comp = make_compressor({"type": "sign"})
    payload, ctx = comp.compress(np.ones(n, np.float32), np.zeros(n, np.float32))
    assert payload.dtype == np.uint8
    assert payload.nbytes == 4 * -(-n // 64) + 4 * -(-n // 32)
    assert ctx == Ctx(n, (n,))
    if n % 64 == 0:
        assert 4 * n / payload.nbytes == 64 * 4 / 12
    if n >= 2048:
        assert 4 * n / payload.nbytes >= 16


def test_a_store_with_sign_compression_changes_nothing_on_bad_options():
    """A bad option raises before the store's compression changes."""
    kv = gpukv.create("device")
    kv.init("w", np.zeros(300, np.float32))
    kv.set_gradient_compression({"type": "sign"})
    with pytest.raises(gpukv.ArgumentError):
        kv.set_gradient_compression({"type": "sign", "block": 64})
    assert kv.gradient_compression == {"type": "sign"}

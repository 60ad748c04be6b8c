"""The ternary compressor against a plain NumPy statement of its rule (0 or +-a block's
scale per value, a value sent when its magnitude passes 0.7 of its block's mean, error
feedback), its payload's size, and its pulls (what it shares with 'sign': test_compressors.py)."""
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

BLOCK = 128


def _by_halves(m: np.ndarray) -> np.ndarray:
    """Each row's sum by halves (x[i] += x[i + h], h = 64, 32, ..., 1), in float32."""
    m = m.copy()
    h = BLOCK // 2
    while h:
        m[:, :h] = m[:, :h] + m[:, h:2 * h]
        h //= 2
    return m[:, 0]


def ternary_rule(grad: np.ndarray,
                 residual: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
    """(payload bytes, decoded values, new residual) of one push of float32 `grad` with
    `residual`, as the rule says: e = r + g; per block of 128, its magnitudes summed by
    halves over the block's count: the mean; a value is sent where its magnitude exceeds
    mean * 0.7; the scale is the sent magnitudes summed by halves over their count (0
    with none); code 1 (+scale) for a sent value > 0, 2 (-scale) for the other sent
    ones, 0 (+0) for the rest; five codes a byte, base 3, the first the lowest digit,
    26 bytes a block; the decoded value taken out of e. A block of finite values whose
    magnitudes sum to inf takes them divided by the largest, m, for the whole rule, its
    scale then multiplied by m. A block whose mean is no finite number (an inf or NaN in
    it) crosses as NaN: every value code 1, the scale NaN."""
    e = residual + grad
    n = e.size
    blocks = -(-n // BLOCK)
    size = np.zeros(blocks * BLOCK, np.float32)
    size[:n] = np.abs(e)
    counts = np.full(blocks, BLOCK, np.float32)
    if n % BLOCK:
        counts[-1] = n % BLOCK
    with np.errstate(invalid="ignore", over="ignore"):
        rows = size.reshape(blocks, BLOCK)
        m = rows.max(axis=1)
        unit = np.where((_by_halves(rows) == np.inf) & (m < np.inf), m, np.float32(1))
        size = (rows / unit[:, None]).reshape(-1)  # (exact for the others: over 1)
        mean = _by_halves(size.reshape(blocks, BLOCK)) / counts
        bar = mean * np.float32(0.7)
        poisoned = np.repeat(~np.isfinite(bar), BLOCK)
        sent = (size > np.repeat(bar, BLOCK)) | poisoned
    sent[n:] = False
    kept = np.where(sent, size, np.float32(0)).reshape(blocks, BLOCK)
    how_many = sent.reshape(blocks, BLOCK).sum(1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scales = np.where(how_many > 0, _by_halves(kept) / how_many.astype(np.float32),
                          np.float32(0)).astype(np.float32)
    scales *= unit
    scales[~np.isfinite(bar)] = np.float32(np.nan)
    positive = poisoned.copy()
    positive[:n] |= e > 0
    codes = np.where(sent, np.where(positive, 1, 2), 0).reshape(blocks, BLOCK)
    digits = np.zeros((blocks, 130), np.int64)
    digits[:, :BLOCK] = codes
    packed = (digits.reshape(blocks, 26, 5) * [1, 3, 9, 27, 81]).sum(2).astype(np.uint8)
    spread = np.repeat(scales, BLOCK)
    decoded = np.where(codes.reshape(-1) == 1, spread, -spread)
    decoded[codes.reshape(-1) == 0] = 0
    decoded = decoded[:n].astype(np.float32)
    return scales.tobytes() + packed.tobytes(), decoded, e - decoded


finite = st.floats(-1e4, 1e4, width=32, allow_subnormal=False)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.integers(1, 1300), elements=finite),
       st.integers(1, 3), st.floats(1e-3, 1e3))
def test_ternary_is_its_rule_push_after_push(g, pushes, scale):
    """Push after push with one residual, the payload, decoded values and residual are
    the rule's, bit for bit (the gradients scaled too: nothing to tune)."""
    comp = make_compressor({"type": "ternary"})
    residual = np.zeros(g.size, np.float32)
    want_r = residual.copy()
    for step in range(pushes):
        grad = (g * np.float32(scale) * np.float32(step + 1)).astype(np.float32)
        payload, ctx = comp.compress(grad, residual)
        decoded = comp.decompress(payload, ctx)
        want_payload, want, want_r = ternary_rule(grad, want_r)
        assert payload.tobytes() == want_payload
        assert decoded.tobytes() == want.tobytes()
        assert residual.tobytes() == want_r.tobytes()


@pytest.mark.parametrize("n", [1, 5, 127, 128, 129, 389, 512, 640, 1024, 70_001, 600_000])
def test_ternary_of_long_keys_is_its_rule(n):
    """Keys across the twin's chunks (and its thread pool's, past 2**19 values), and
    across the compiled encoder's groups of four blocks (389: three whole blocks and a
    short one, all in the padded rest; 512 and 1024: whole groups, no rest), with
    infinities and NaNs in some blocks: the rule's bytes and residual."""
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n).astype(np.float32)
    r = (rng.standard_normal(n) * 0.5).astype(np.float32)
    g[rng.integers(0, n, max(1, n // 5000))] = np.inf
    g[rng.integers(0, n, max(1, n // 7000))] = np.nan
    want_payload, want, want_r = ternary_rule(g, r)
    comp = make_compressor({"type": "ternary"})
    with np.errstate(invalid="ignore"):
        payload, ctx = comp.compress(g, r)
    assert payload.tobytes() == want_payload
    assert comp.decompress(payload, ctx).tobytes() == want.tobytes()
    assert r.tobytes() == want_r.tobytes()


@pytest.mark.parametrize("n", [1, 127, 128, 129, 256, 70_001])
def test_ternary_payload_is_30_bytes_a_block(n):
    """30 * ceil(n / 128) bytes: 17x fewer than float32 for keys of a whole number of
    blocks, and at least 16x for any key of 2048 values or more."""
    comp = make_compressor({"type": "ternary"})
    payload, ctx = comp.compress(np.ones(n, np.float32), np.zeros(n, np.float32))
    assert payload.dtype == np.uint8
    assert payload.nbytes == 30 * -(-n // 128)
    assert ctx == Ctx(n, (n,))
    if n >= 2048:
        assert 4 * n / payload.nbytes >= 16


@settings(max_examples=20, deadline=None)
@given(arrays(np.float32, st.integers(1, 700),
              elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)),
       st.integers(1, 4))
def test_pulls_travel_ternary_with_the_homes_residual(g, rounds):
    """Both ways: a push sums the sources' ternary values (each source its residual); a
    pull returns the ternary value of that sum plus the home's residual, bit for bit."""
    kv = gpukv.create("device")
    kv.set_gradient_compression({"type": "ternary"})
    kv.init("w", np.zeros(g.size, np.float32))
    residuals = [np.zeros(g.size, np.float32) for _ in range(2)]
    home = np.zeros(g.size, np.float32)
    for r in range(rounds):
        grads = [(g * np.float32(r + 1)).astype(np.float32),
                 (-g * np.float32(0.5) + np.float32(r)).astype(np.float32)]
        kv.push("w", grads)
        total = np.zeros(g.size, np.float32)
        for j, x in enumerate(grads):
            _, decoded, residuals[j] = ternary_rule(x, residuals[j])
            total = (total + decoded).astype(np.float32)
        _, want, home = ternary_rule(total, home)
        out = np.empty(g.size, np.float32)
        kv.pull("w", out=out)
        assert out.tobytes() == want.tobytes()

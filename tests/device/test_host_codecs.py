"""The host codecs' chunks (gpukv.device.host_codecs) and the float16 sums of host_sum:
arrays that straddle a chunk edge give the bytes of the plain, unchunked NumPy rule."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukv.canonical.arrays import leaf_plan, run_adds
from gpukv.device import host_codecs as twins
from gpukv.device import host_sum as host

from ..encoding.test_sign import sign_rule

SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan]


def same_bits(got, want) -> bool:
    return got.dtype == want.dtype and got.tobytes() == want.tobytes()


def same_or_nan(got, want) -> bool:
    """Same bits, or NaN in both (which NaN two NaNs add to is the loop's choice)."""
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan)
                and same_bits(got[~nan], want[~nan]))


@st.composite
def straddling(draw, dtype=np.float32):
    """n values around the edge of the first or second chunk (twins.BLOCK), normals of a
    drawn scale with signed zeros, infinities and NaNs dropped in near the edge."""
    edge = draw(st.sampled_from([1, 2])) * twins.BLOCK
    n = edge + draw(st.integers(-200, 200))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal(n) * draw(st.sampled_from([1e-3, 1.0, 1e3]))).astype(dtype)
    for _ in range(draw(st.integers(0, 4))):
        x[min(n - 1, edge - 100 + draw(st.integers(0, 200)))] = draw(st.sampled_from(SPECIALS))
    return x


@pytest.mark.usefixtures("host_codec_path")
@settings(max_examples=30, deadline=None)
@given(straddling(), st.integers(0, 2**32 - 1))
def test_sign_across_chunk_edges_is_the_rule(grad, seed):
    """The sign twin's payload, residual and decoded values (written or added) across a
    chunk edge equal the rule's on the whole array."""
    n = grad.size
    residual = (np.random.default_rng(seed).standard_normal(n) * 0.3).astype(np.float32)
    with np.errstate(all="ignore"):
        want, decoded, want_r = sign_rule(grad, residual)
        r = residual.copy()
        payload = twins.quantize_sign(grad, r, np.full(twins.sign_nbytes(n), 0xA5, np.uint8))
        assert payload.tobytes() == want
        assert same_bits(r, want_r)
        out = np.full(n, np.nan, np.float32)
        assert same_bits(twins.dequantize_sign(payload, n, out, False), decoded)
        total = residual.copy()
        assert same_bits(twins.dequantize_sign(payload, n, total, True), residual + decoded)


@pytest.mark.usefixtures("host_codec_path")
@settings(max_examples=30, deadline=None)
@given(straddling(np.float16), st.integers(1, 3))  # (3: a division, not a product)
def test_fp16_casts_across_chunk_edges_are_numpys(half, scale):
    """float32 -> float16 and back (written or added, scaled) across a chunk edge give
    NumPy's astype of the whole array."""
    x = half.astype(np.float32) * np.float32(1 + 2.0**-12)  # ties and between them
    with np.errstate(all="ignore"):
        want = (x / np.float32(scale)).astype(np.float16)
        assert same_bits(twins.cast_fp16(x, float(scale)), want)
        out = np.full(x.size, 2.0, np.float32)
        twins.uncast_fp16(want, float(scale), out, True)
        assert same_bits(out, np.float32(2.0) + want.astype(np.float32) * np.float32(scale))


@pytest.mark.usefixtures("host_codec_path")
def test_fp16_casts_of_every_float16_and_its_neighbours_are_numpys():
    """Every float16 decodes as NumPy's cast does; every float32 at a float16, one ulp
    either side of it, and at the midpoints to its neighbours (ties) and one ulp either
    side of those encodes as NumPy's astype: subnormals, overflow and NaNs included."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    wide = np.empty(every.size, np.float32)
    twins.uncast_fp16(every, 1.0, wide, False)
    assert same_bits(wide, every.astype(np.float32))
    finite = wide[np.isfinite(wide)]
    with np.errstate(all="ignore"):
        up = np.nextafter(finite.astype(np.float16), np.float16(np.inf)).astype(np.float32)
        mid = finite + (up - finite) / np.float32(2)
        points = np.concatenate([finite, mid, np.float32([65520, 65536, 1e30, np.inf,
                                                          np.nan])])
        bits = points.view(np.uint32)
        x = np.concatenate([bits - 1, bits, bits + 1]).view(np.float32)
        assert same_bits(twins.cast_fp16(x, 1.0), x.astype(np.float16))
        # thrice those points, and neighbours: divided by 3 they land on and beside the
        # ties, where the last bit of the division decides the rounding
        thrice = (points * np.float32(3)).view(np.uint32)
        x = np.concatenate([thrice - np.uint32(2), thrice - np.uint32(1), thrice,
                            thrice + np.uint32(1), thrice + np.uint32(2)]).view(np.float32)
        assert same_bits(twins.cast_fp16(x, 3.0), (x / np.float32(3)).astype(np.float16))


@pytest.mark.usefixtures("host_codec_path")
def test_bf16_casts_of_every_bfloat16_and_its_neighbours_are_the_rule():
    """Every float32 at a bfloat16, one ulp either side, at the ties between two (the low
    16 bits 0x8000) and one ulp either side of those, NaNs included, encodes by the rule
    (round to nearest even, a NaN's top bits quieted); every bfloat16 decodes to its
    float32, scaled, written or added."""
    every = np.arange(1 << 16, dtype=np.uint32)
    x = (every[:, None] << 16 | np.uint32([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])).ravel()
    x = x.view(np.float32)
    u = x.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    want = np.where(np.isnan(x), (u >> 16) | np.uint32(0x40), rounded).astype(np.uint16)
    assert np.array_equal(twins.cast_bf16(x, 1.0), want)
    with np.errstate(all="ignore"):
        third = (x / np.float32(3)).view(np.uint32)
        rounded = (third + (np.uint32(0x7FFF) + ((third >> 16) & np.uint32(1)))) >> 16
        want = np.where(np.isnan(third.view(np.float32)), (third >> 16) | np.uint32(0x40),
                        rounded).astype(np.uint16)
        assert np.array_equal(twins.cast_bf16(x, 3.0), want)  # scaled by a division
    bits = every.astype(np.uint16)
    wide = (every << 16).view(np.float32)
    with np.errstate(all="ignore"):
        for scale, accumulate in ((1.0, False), (0.5, True)):
            out = np.full(bits.size, 2.0, np.float32)
            twins.uncast_bf16(bits, scale, out, accumulate)
            value = wide if scale == 1.0 else wide * np.float32(scale)
            assert same_or_nan(out, np.float32(2.0) + value if accumulate else value)


def sum_rule(sources, tree):
    """NumPy's float32 adds of whole arrays: left to right, or the canonical tree's."""
    if not tree:
        total = np.add(sources[0], sources[1], dtype=np.float32)
        for s in sources[2:]:
            total = np.add(total, s, dtype=np.float32)
        return total
    ops, temps = leaf_plan(len(sources))
    total = np.empty(sources[0].size, np.float32)
    slots = [np.empty_like(total) for _ in range(temps)]
    run_adds(ops, sources, slots, total, dtype=np.float32, casting="unsafe")
    return total


@pytest.mark.usefixtures("host_codec_path")  # compiled, then NumPy
@settings(max_examples=30, deadline=None)
@given(straddling(np.float16), st.lists(st.booleans(), min_size=1, max_size=4),
       st.integers(0, 2**32 - 1), st.booleans(), st.booleans())
def test_float16_sums_across_chunk_edges_are_numpys(half, kinds, seed, tree, wide_first):
    """host_sum and host_tree_sum of float16 (and float32) sources into a float32 out,
    which widen the float16 blocks themselves, equal NumPy's float32 adds of the whole
    arrays."""
    rng = np.random.default_rng(seed)
    sources = [half] + [rng.permutation(half) if is_half
                        else rng.permutation(half).astype(np.float32) * 3 for is_half in kinds]
    if wide_first:  # a float32 source first, float16 ones after it
        sources.insert(0, rng.permutation(half).astype(np.float32) * 3)
    with np.errstate(all="ignore"):
        want = sum_rule(sources, tree)
        out = np.empty(half.size, np.float32)
        (host.host_tree_sum if tree else host.host_sum)(out, sources)
    assert same_or_nan(out, want)

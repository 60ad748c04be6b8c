"""Hypothesis strategies shared by the test modules (the one place they live)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

INT_KEYS = st.one_of(st.integers(-5, 40), st.sampled_from([2 ** 31, 2 ** 63, 2 ** 70, -(2 ** 65)]))
STR_KEYS = st.sampled_from(["w", "b", "emb", "layer.0.weight", "", "ключ", "x" * 40])

SHAPES = st.sampled_from([(), (1,), (3,), (2, 3), (1, 2, 2)])
DEVICES = st.integers(1, 4)
# Dtypes in which sums of a few small integers (and halves of them) stay exact.
DTYPES = st.sampled_from([np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)])


def small_ints(shape, dtype=np.float32):
    """Arrays of small integers, so sums are exact in every float dtype the tests use."""
    size = int(np.prod(shape, dtype=np.int64))
    return st.lists(st.integers(-4, 4), min_size=size, max_size=size).map(
        lambda xs: np.array(xs, dtype=dtype).reshape(shape))


def device_values(shape, dtype=np.float32, max_devices=4):
    """One key's value as a list of 1..max_devices arrays (one per device)."""
    return st.lists(small_ints(shape, dtype), min_size=1, max_size=max_devices)


def keys_of(kind: str):
    return INT_KEYS if kind == "int" else STR_KEYS


# ----------------------------------------------------------- gradient compression
def gradient_steps(max_size=70, max_steps=4):
    """(size, steps): a few float32 gradients of one size, including exact-threshold ties."""
    value = st.one_of(st.floats(-2, 2, width=32), st.sampled_from([0.5, -0.5, 0.25, 0.0]))

    def steps_of(size):
        arrays = st.lists(value, min_size=size, max_size=size).map(
            lambda xs: np.array(xs, dtype=np.float32))
        return st.lists(arrays, min_size=1, max_size=max_steps)

    return st.integers(1, max_size).flatmap(lambda n: st.tuples(st.just(n), steps_of(n)))


# float32 bit patterns around the float16 edges: subnormals, ties, 65504/65520, inf, NaN.
F16_EDGE_BITS = [0, 0x80000000, 1, 0x007FFFFF, 0x00800000, 0x33000000, 0x33000001,
                 0x337FFFFF, 0x33800000, 0x33C00000, 0x387FC000, 0x387FE000, 0x387FF000,
                 0x38800000, 0x38801000, 0x38803000, 0x3F801000, 0x3F803000, 0x477FE000,
                 0x477FEFFF, 0x477FF000, 0x47800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                 0x7F800001, 0x7F801FFF, 0x7F802000, 0x7FC00000, 0xFFC00001, 0xFFFFFFFF]


def float32_bits(max_size=200):
    """Arrays of float32 values from arbitrary bit patterns, float16 edge cases among them."""
    word = st.one_of(st.integers(0, 2 ** 32 - 1), st.sampled_from(F16_EDGE_BITS),
                     st.sampled_from(F16_EDGE_BITS).map(lambda b: b ^ 0x80000000))
    return st.lists(word, min_size=1, max_size=max_size).map(
        lambda ws: np.array(ws, dtype=np.uint32).view(np.float32))

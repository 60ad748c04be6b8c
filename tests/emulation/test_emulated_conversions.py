"""The emulation's 16-bit float conversions (emu.h, and the inline PTX rewritten into it)
give NumPy's float16 and ml_dtypes' bfloat16 bits: round to nearest even, subnormals,
overflow to inf and NaN, over every 16-bit pattern and millions of floats."""
from __future__ import annotations

import numpy as np
import pytest

from ..bfloat16 import BF16, needs_bfloat16
from .support import device, kernels

_SOURCE = r"""
#define EACH long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; if (i >= n) return;

extern "C" __global__ void half_to_float(const unsigned short* in, float* out, float* ptx,
                                         long long n) {
    EACH
    out[i] = __half2float(__ushort_as_half(in[i]));
    float f; unsigned short h = in[i];
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    ptx[i] = f;
}

extern "C" __global__ void float_to_half(const float* in, unsigned short* out,
                                         unsigned short* ptx, long long n) {
    EACH
    out[i] = __half_as_ushort(__float2half_rn(in[i]));
    unsigned short h; float f = in[i];
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    ptx[i] = h;
}

extern "C" __global__ void double_to_half(const double* in, unsigned short* out,
                                          unsigned short* ptx, long long n) {
    EACH
    out[i] = __half_as_ushort(__double2half(in[i]));
    unsigned short h; double d = in[i];
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(d));
    ptx[i] = h;
}

extern "C" __global__ void bfloat16_to_float(const unsigned short* in, float* out,
                                             long long n) {
    EACH
    out[i] = __bfloat162float(__ushort_as_bfloat16(in[i]));
}

extern "C" __global__ void float_to_bfloat16(const float* in, unsigned short* out,
                                             unsigned short* rn, long long n) {
    EACH
    out[i] = __bfloat16_as_ushort(__float2bfloat16(in[i]));
    rn[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
}

extern "C" __global__ void double_to_bfloat16(const double* in, unsigned short* out,
                                              long long n) {
    EACH
    out[i] = __bfloat16_as_ushort(__double2bfloat16(in[i]));
}
"""


@pytest.fixture(scope="module")
def module():
    return kernels.RawModule(code=_SOURCE)


def _run(module, name, inputs, *out_dtypes):
    n = inputs.size
    outs = [device(np.zeros(n, d)) for d in out_dtypes]
    module.get_function(name)((-(-n // 256),), (256,), (device(inputs), *outs, n))
    return [o.host for o in outs]


def _every_16_bit_pattern():
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _float_cases(grid: np.ndarray) -> np.ndarray:
    """float32 bits around the values of a 16-bit grid (`grid`: its nonnegative finite
    values as float64, ascending): the values, the ties between neighbours and their
    neighbouring floats, random bit patterns, and NaNs, infinities, zeros, both signs."""
    ahead = np.append(grid[1:], 2 * grid[-1] - grid[-2])  # past the largest: where inf is
    ties = ((grid + ahead) / 2).astype(np.float32).view(np.uint32)
    exact = grid.astype(np.float32).view(np.uint32)
    random = np.random.default_rng(5).integers(0, 1 << 32, 1 << 20, dtype=np.uint64)
    special = np.array([0, 0x00000001, 0x007fffff, 0x00800000, 0x33000000, 0x33000001,
                        0x337fffff, 0x387fe000, 0x38800000, 0x477fefff, 0x477ff000,
                        0x477ff001, 0x47800000, 0x7f7fffff, 0x7f800000, 0x7f800001,
                        0x7f801fff, 0x7f802000, 0x7fa00000, 0x7fc00000, 0x7fffffff],
                       np.uint32)
    bits = np.concatenate([exact, ties, ties - 1, ties + 1, random.astype(np.uint32), special])
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)


def test_half_to_float_over_every_pattern(module):
    """All 65536 float16 patterns, NaN payloads included, widen to NumPy's float32 bits
    (through __half2float and through the rewritten cvt.f32.f16 PTX)."""
    bits = _every_16_bit_pattern()
    want = bits.view(np.float16).astype(np.float32).view(np.uint32)
    got, ptx = _run(module, "half_to_float", bits, np.float32, np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want)
    np.testing.assert_array_equal(ptx.view(np.uint32), want)


def test_float_to_half_rounds_as_numpy(module):
    """Ties to even, subnormals, 65520 and above to inf, NaN payloads as NumPy keeps them
    (through __float2half_rn and through the rewritten cvt.rn.f16.f32 PTX)."""
    grid = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    x = _float_cases(grid)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    got, ptx = _run(module, "float_to_half", x, np.uint16, np.uint16)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ptx, want)


def test_double_to_half_rounds_once(module):
    """A double converts to float16 directly, not through a float that could round twice
    (ties nudged by far less than a float's precision), through __double2half and
    through the rewritten cvt.rn.f16.f64 PTX."""
    grid = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ahead = np.append(grid[1:], 65536.0)
    ties = (grid + ahead) / 2
    nudge = np.maximum(np.abs(ties), 2.0 ** -30) * 2.0 ** -40
    rng = np.random.default_rng(9)
    x = np.concatenate([ties, ties + nudge, ties - nudge, grid,
                        rng.standard_normal(1 << 18) * 10.0 ** rng.integers(-9, 6, 1 << 18),
                        [np.inf, np.nan, 1e300, 1e-300]])
    x = np.concatenate([x, -x])
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    got, ptx = _run(module, "double_to_half", x, np.uint16, np.uint16)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ptx, want)


@needs_bfloat16
def test_bfloat16_to_float_over_every_pattern(module):
    """All 65536 bfloat16 patterns widen to ml_dtypes' float32 bits."""
    bits = _every_16_bit_pattern()
    want = bits.view(BF16).astype(np.float32).view(np.uint32)
    (got,) = _run(module, "bfloat16_to_float", bits, np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want)


@needs_bfloat16
def test_float_to_bfloat16_rounds_as_ml_dtypes(module):
    """Ties to even, subnormals, overflow to inf, and ml_dtypes' quiet NaN of the sign."""
    grid = np.arange(0x7F80, dtype=np.uint16).view(BF16).astype(np.float64)
    x = _float_cases(grid)
    with np.errstate(invalid="ignore"):
        want = x.astype(BF16).view(np.uint16)
    got, rn = _run(module, "float_to_bfloat16", x, np.uint16, np.uint16)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(rn, want)


@pytest.mark.parametrize("value, bits", [
    (1.0, 0x3F80), (1.00390625, 0x3F80), (1.00390625 + 2.0 ** -40, 0x3F81),
    (1.01171875, 0x3F82), (1.01171875 - 2.0 ** -40, 0x3F81), (-3.0e38, 0xFF62),
    (3.4e38, 0x7F80), (1e300, 0x7F80), (-1e-300, 0x8000), (float("inf"), 0x7F80)])
def test_double_to_bfloat16_rounds_once(module, value, bits):
    """A double rounds to bfloat16 directly (ml_dtypes goes through float and may round
    twice, so these were worked out exactly with fractions)."""
    (got,) = _run(module, "double_to_bfloat16", np.array([value]), np.uint16)
    assert hex(got[0]) == hex(bits)


_ARITHMETIC = r"""
extern "C" __global__ void arithmetic(float* out) {
    __half a = __float2half(1.5f), b = 2.25f;
    out[0] = __half2float(a + b); out[1] = (float)(a * b); out[2] = a < b ? 1.0f : 0.0f;
    out[3] = (float)(-a); out[4] = (float)__hdiv(__float2half(1.0f), __float2half(3.0f));
    __nv_bfloat16 c = 3.0f;
    c += __nv_bfloat16(0.5f);
    out[5] = (float)c; out[6] = __bfloat162float(c * __float2bfloat16(1.0f / 3.0f));
}
"""


@needs_bfloat16
def test_16_bit_float_arithmetic_rounds_each_result_to_its_type():
    """__half and __nv_bfloat16 operators compute in float and round the result once."""
    out = device(np.zeros(7, np.float32))
    kernels.RawKernel(_ARITHMETIC, "arithmetic")((1,), (1,), (out,))
    third_h = np.float32(np.float16(1.0) / np.float16(3.0))
    bf16 = BF16.type
    third_b = np.float32(np.float32(bf16(3.5)) * np.float32(bf16(np.float32(1.0) / 3)))
    assert out.host.tolist() == [3.75, 3.375, 1.0, -1.5, third_h, 3.5,
                                 float(np.float32(bf16(third_b)))]

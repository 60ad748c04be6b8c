"""The gradient-compression codecs, the front door to their NumPy twins (`host_codecs.py`)
and CUDA kernels (`cuda/codec_kernels.py`, which imports CuPy only to launch one).

Every function takes flat, contiguous float32 arrays (the caller converts) and works on
whichever library the arrays belong to: NumPy arrays run the vectorised NumPy twin,
CuPy arrays a CUDA kernel. The two produce identical bytes and identical residuals,
except where a float32 subnormal (magnitude below 2**-126) is read or produced: CuPy
compiles every kernel, its own elementwise ones included, with -ftz=true, so on the GPU
such a value is a (signed) zero, in residuals, decoded sums and `pre_divide` scaling.

Packed layouts are MXNet's (src/kvstore/gradient_compression-inl.h):

- 2bit: 16 values per 32-bit word, 4 per byte, the first value in the two most
  significant bits of the first byte; 0b11 is +threshold, 0b10 is -threshold,
  0b00 is 0 (0b01 is never written and decodes to 0). Payload: 4 * ceil(n / 16) bytes.
- 1bit: 32 values per 32-bit word, 8 per byte, the first value in the most significant
  bit of the first byte; 1 decodes to +1 and 0 to -1. Payload: 4 * ceil(n / 32) bytes.
- sign (gpukv's own): a float32 scale per block of 64 values (the root mean square of
  the block's residual: its squares summed pairwise, 32 apart, then 16, ..., 1, divided
  by the block's count, then the square root; for a block of finite values whose sum
  of squares is inf or below float32's smallest normal, m times that of the values
  divided by m, m the block's largest magnitude), then 1bit's bit layout with 1 for a
  value >= 0 (+scale) and 0 for the others (-scale). Payload: 4 * ceil(n / 64) +
  4 * ceil(n / 32) bytes.

- ternary (gpukv's own): a float32 scale per block of 128 values, then each block's
  26 bytes of codes, five to a byte as base-3 digits (the first value the lowest; 0 is
  0, 1 is +scale, 2 is -scale). A value is sent when its magnitude exceeds 0.7 times
  its block's mean magnitude (magnitudes summed pairwise, 64 apart, then 32, ..., 1,
  divided by the block's count, times 0.7f); the scale is the mean magnitude of the
  values sent (summed in the same order, divided by their count; 0 when none is). A
  block of finite values whose magnitudes sum to inf takes the rule on the values
  divided by its largest magnitude m, and its scale times m.
  Payload: 30 * ceil(n / 128) bytes.

The residual updates are MXNet's: for 2bit `r += g; if r >= t: r -= t; elif r <= -t:
r += t`; for 1bit `r += g; if r > t: r -= 1 else r += 1`; for sign `r += g`, then
`r -= +scale if r >= 0 else -scale`; for ternary `r += g`, then `r -= v`, v the value
sent (+0 for a value not sent). Subtracting -t and adding t
(or subtracting 1 and adding -1) give the same IEEE result, which is what lets the
NumPy twin apply the update as one vectorised add.
"""
from __future__ import annotations

import numpy as np

from . import host_codecs as host
from .host_codecs import packed_nbytes, sign_nbytes, ternary_nbytes

__all__ = ["quantize_2bit", "dequantize_2bit", "quantize_1bit", "dequantize_1bit",
           "quantize_sign", "dequantize_sign", "sign_nbytes",
           "quantize_ternary", "dequantize_ternary", "ternary_nbytes",
           "flat_f32", "empty_f32", "scale_in_place", "difference_f32", "write_f32",
           "cast_fp16", "uncast_fp16",
           "cast_bf16", "uncast_bf16", "packed_nbytes"]

_F32 = np.float32


def _is_host(a) -> bool:
    return isinstance(a, np.ndarray)


def _launch(name, items, args):
    from .cuda.codec_kernels import launch
    launch(name, items, args)


def _payload(like, nbytes: int, out):
    """`out`, or a new uint8 payload of `nbytes` where `like` lives (current device and
    stream for a GPU array)."""
    return _xp(like).empty(nbytes, np.uint8) if out is None else out


def _quantize(bits, host_fn, kernel, grad, residual, threshold, out):
    """`host_fn` on host arrays, else the CUDA `kernel` (2bit: a thread per byte it
    writes; 1bit: a thread per value); the payload's bytes past the last value are zero."""
    n = grad.size
    out = _payload(grad, packed_nbytes(n, bits), out)
    if _is_host(grad):
        return host_fn(grad, residual, threshold, out)
    nbytes = min(out.size, packed_nbytes(n, bits))  # the kernel zeroes the padding too
    if out.size > nbytes:
        out[nbytes:] = 0
    _launch(kernel, nbytes if bits == 2 else n,
            (grad, residual, out, np.int64(n), np.int64(nbytes), np.float32(threshold)))
    return out


def quantize_2bit(grad, residual, threshold, out=None):
    """Add `grad` into `residual`, write MXNet's 2-bit codes into `out` (uint8), return it."""
    return _quantize(2, host.quantize_2bit, "gpukv_quantize_2bit", grad, residual, threshold,
                     out)


def dequantize_2bit(payload, n, threshold, out, accumulate=False):
    """Decode `n` values of a 2-bit payload into `out` (float32), or add them to it."""
    if _is_host(payload):
        return host.dequantize_2bit(payload, n, threshold, out, accumulate)
    _launch("gpukv_dequantize_2bit", n,
            (payload, out, np.int64(n), np.float32(threshold), np.int32(bool(accumulate))))
    return out


def quantize_1bit(grad, residual, threshold, out=None):
    """Add `grad` into `residual`, write MXNet master's 1-bit codes into `out`, return it."""
    return _quantize(1, host.quantize_1bit, "gpukv_quantize_1bit", grad, residual, threshold,
                     out)


def dequantize_1bit(payload, n, out, accumulate=False):
    """Decode `n` values of a 1-bit payload (+1/-1) into `out` (float32), or add them."""
    if _is_host(payload):
        return host.dequantize_1bit(payload, n, out, accumulate)
    _launch("gpukv_dequantize_1bit", n,
            (payload, out, np.int64(n), np.int32(bool(accumulate))))
    return out


def quantize_sign(grad, residual, out=None):
    """Add `grad` into `residual`; write each block's root mean square and every value's
    sign into `out` (uint8, `sign_nbytes(n)` bytes); take the decoded value (+-scale) out
    of the residual; return `out`."""
    n = grad.size
    out = _payload(grad, host.sign_nbytes(n), out)
    if _is_host(grad):
        return host.quantize_sign(grad, residual, out)
    blocks = -(-n // host.SIGN_BLOCK)
    _launch("gpukv_quantize_sign", 32 * blocks,  # a warp per block
            (grad, residual, out, np.int64(n), np.int64(blocks)))
    return out


def dequantize_sign(payload, n, out, accumulate=False):
    """Decode `n` values of a sign payload (+-their block's scale) into `out`, or add them."""
    if _is_host(payload):
        return host.dequantize_sign(payload, n, out, accumulate)
    blocks = -(-n // host.SIGN_BLOCK)
    _launch("gpukv_dequantize_sign", n,
            (payload, out, np.int64(n), np.int64(blocks), np.int32(bool(accumulate))))
    return out


def quantize_ternary(grad, residual, out=None):
    """Add `grad` into `residual`; write each block's scale and every value's code into
    `out` (uint8, `ternary_nbytes(n)` bytes); take the decoded value out of the residual;
    return `out`."""
    n = grad.size
    out = _payload(grad, host.ternary_nbytes(n), out)
    if _is_host(grad):
        return host.quantize_ternary(grad, residual, out)
    blocks = -(-n // host.TERNARY_BLOCK)
    _launch("gpukv_quantize_ternary", 32 * blocks,  # a warp per block
            (grad, residual, out, np.int64(n), np.int64(blocks)))
    return out


def dequantize_ternary(payload, n, out, accumulate=False):
    """Decode `n` values of a ternary payload (0 or +-their block's scale) into `out`, or
    add them."""
    if _is_host(payload):
        return host.dequantize_ternary(payload, n, out, accumulate)
    blocks = -(-n // host.TERNARY_BLOCK)
    _launch("gpukv_dequantize_ternary", n,
            (payload, out, np.int64(n), np.int64(blocks), np.int32(bool(accumulate))))
    return out


def _xp(a):
    if _is_host(a):
        return np
    import cupy
    return cupy


def flat_f32(x):
    """`x` as a flat, contiguous float32 array on its own device (a view when it already
    is one; a GPU copy is made on the current device and stream)."""
    xp = _xp(x)
    return xp.ascontiguousarray(x, dtype=xp.float32).reshape(-1)


def empty_f32(like, shape):
    """A new float32 array of `shape` where `like` lives (current device and stream)."""
    return _xp(like).empty(shape, _F32)


def difference_f32(a, b):
    """float32(a - b), flat, a new array where `a` lives (current device and stream):
    subtracted in float32, or in float64 for float64 arrays, then rounded once."""
    xp = _xp(a)
    wide = np.float64 if a.dtype == np.float64 else _F32
    d = xp.subtract(a.reshape(-1).astype(wide, copy=False),
                    b.reshape(-1).astype(wide, copy=False))
    return d.astype(_F32, copy=False)


def write_f32(out, value, accumulate: bool) -> None:
    """out = value, or out += value, for a float32 `value` and an `out` of any floating
    dtype (the sum in float32, or float64 for a float64 `out`, rounded once)."""
    xp = _xp(out)
    flat = out.reshape(-1)
    if accumulate:
        wide = np.float64 if out.dtype == np.float64 else _F32
        value = xp.add(flat.astype(wide, copy=False), value)
    flat[...] = value


def scale_in_place(out, factor: float):
    """out *= float32(factor), in place (on the current stream for a GPU array)."""
    xp = _xp(out)
    xp.multiply(out, xp.float32(factor), out=out)
    return out


def _host_vectors(payload, dtype, out) -> bool:
    """Whether the NumPy twin decodes `payload` into `out`: 1-D host arrays of one length."""
    return (_is_host(payload) and _is_host(out) and payload.dtype == dtype
            and out.dtype == _F32 and payload.ndim == 1 and out.shape == payload.shape)


def _aligned(*pairs) -> int:
    """1 when every (GPU array, bytes) pair's data starts on a multiple of those bytes
    (the 16-bit kernels then move four values at a time), else 0."""
    return int(all(a.data.ptr % nbytes == 0 for a, nbytes in pairs))


def _cast16(kernel: str, host_fn, x, scale: float):
    """`x / scale` as 16-bit codes (uint16 on the host for bf16, float16 for fp16), in
    `x`'s shape: the NumPy twin, or one CUDA kernel for any GPU array."""
    if _is_host(x) and x.dtype == _F32:
        return host_fn(x.reshape(-1), scale).reshape(x.shape)
    if _is_host(x):  # other host dtypes: through float32, as the GPU reads them
        return host_fn(x.astype(_F32).reshape(-1), scale).reshape(x.shape)
    import cupy
    flat = flat_f32(x)
    out = cupy.empty(flat.size, np.float16 if kernel.endswith("fp16") else np.uint16)
    _launch(kernel, -(-flat.size // 4),
            (flat, out, np.int64(flat.size), np.float32(scale), np.int32(scale != 1.0),
             np.int32(_aligned((flat, 16), (out, 8)))))
    return out.reshape(x.shape)


def _uncast16(kernel: str, host_fn, dtype, payload, scale: float, out, accumulate: bool):
    """float32(payload) * scale written into `out`, or added to it: the NumPy twin, or one
    CUDA kernel (decoding into a float32 temporary first for an out of another dtype or
    layout)."""
    if _host_vectors(payload, dtype, out):
        return host_fn(payload, scale, out, accumulate)
    if _is_host(payload):
        wide = np.empty(payload.size, _F32)
        host_fn(payload.reshape(-1), scale, wide, False)
        write_f32(out, wide, accumulate)
        return out
    import cupy
    codes = cupy.ascontiguousarray(payload).reshape(-1)
    direct = out.dtype == _F32 and out.flags.c_contiguous and out.size == codes.size
    target = out.reshape(-1) if direct else cupy.empty(codes.size, _F32)
    _launch(kernel, -(-codes.size // 4),
            (codes, target, np.int64(codes.size), np.float32(scale), np.int32(scale != 1.0),
             np.int32(bool(accumulate and direct)), np.int32(_aligned((codes, 8), (target, 16)))))
    if not direct:
        write_f32(out, target, accumulate)
    return out


def cast_fp16(x, scale: float):
    """`x / scale` rounded to float16 (round to nearest even); `scale` 1 divides nothing."""
    return _cast16("gpukv_cast_fp16", host.cast_fp16, x, scale)


def uncast_fp16(payload, scale: float, out, accumulate=False):
    """float32(payload) * scale written into `out`, or added to it."""
    return _uncast16("gpukv_uncast_fp16", host.uncast_fp16, np.float16, payload, scale, out,
                     accumulate)


def cast_bf16(x, scale: float):
    """`x / scale` as bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    return _cast16("gpukv_cast_bf16", host.cast_bf16, x, scale)


def uncast_bf16(payload, scale: float, out, accumulate=False):
    """The float32 value of bfloat16 bit patterns, times `scale`, into `out` (or added)."""
    return _uncast16("gpukv_uncast_bf16", host.uncast_bf16, np.uint16, payload, scale, out,
                     accumulate)

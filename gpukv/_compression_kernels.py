"""Gradient-compression kernels: CuPy kernels and their NumPy twins, bit for bit the same.

Every function takes flat, contiguous float32 arrays (the caller converts) and works on
whichever library the arrays belong to: NumPy arrays run the vectorised NumPy twin,
CuPy arrays a CUDA kernel. The two produce identical bytes and identical residuals.

Packed layouts are MXNet's (src/kvstore/gradient_compression-inl.h):

- 2bit: 16 values per 32-bit word, 4 per byte, the first value in the two most
  significant bits of the first byte; 0b11 is +threshold, 0b10 is -threshold,
  0b00 is 0 (0b01 is never written and decodes to 0). Payload: 4 * ceil(n / 16) bytes.
- 1bit: 32 values per 32-bit word, 8 per byte, the first value in the most significant
  bit of the first byte; 1 decodes to +1 and 0 to -1. Payload: 4 * ceil(n / 32) bytes.

The residual updates are MXNet's: for 2bit `r += g; if r >= t: r -= t; elif r <= -t:
r += t`; for 1bit `r += g; if r > t: r -= 1 else r += 1`. Subtracting -t and adding t
(or subtracting 1 and adding -1) give the same IEEE result, which is what lets the
NumPy twin apply the update as one vectorised add.
"""
from __future__ import annotations

import functools

import numpy as np

# Elements per block of the NumPy twins: the temporaries of one block stay in L2.
BLOCK = 1 << 15  # a multiple of 32, so blocks start on word boundaries of both layouts


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of the packed payload of `n` values at `bits` (1 or 2) bits each."""
    per_word = 32 // bits
    return 4 * (-(-n // per_word))


def _is_host(a) -> bool:
    return isinstance(a, np.ndarray)


# ------------------------------------------------------------------ lookup tables
def _table_2bit(threshold: float) -> np.ndarray:
    """256 x 4 float32: the four values one packed byte decodes to."""
    t = np.float32(threshold)
    codes = (np.arange(256, dtype=np.uint16)[:, None] >> np.array([6, 4, 2, 0])) & 3
    table = np.zeros((256, 4), np.float32)
    table[codes == 3] = t
    table[codes == 2] = -t
    return table


_TABLE_1BIT = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(bool),
    np.float32(1), np.float32(-1)).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _cached_table_2bit(threshold: float) -> np.ndarray:
    return _table_2bit(threshold)


# -------------------------------------------------------------------- NumPy twins
def _np_quantize_2bit(grad, residual, threshold, out):
    n = grad.size
    t = np.float32(threshold)
    nt = np.float32(-t)
    m = min(n, BLOCK)
    pos = np.empty(m, bool)
    neg = np.empty(m, bool)
    q = np.empty(m, np.int8)
    qf = np.empty(m, np.float32)
    codes = np.zeros(BLOCK if n > BLOCK else -(-n // 16) * 16, np.uint8)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        k = stop - start
        r = residual[start:stop]
        p, ng, qq, qv = pos[:k], neg[:k], q[:k], qf[:k]
        np.add(r, grad[start:stop], out=r)
        np.greater_equal(r, t, out=p)
        np.less_equal(r, nt, out=ng)
        np.subtract(p.view(np.int8), ng.view(np.int8), out=qq)
        np.multiply(qq, t, out=qv)           # +t, -t or +0
        np.subtract(r, qv, out=r)            # r - t, r - (-t) == r + t, or r unchanged
        words = -(-k // 16)
        c = codes[:words * 16]
        if words * 16 > k:
            c[k:] = 0
        np.bitwise_or(p, ng, out=ng)
        np.left_shift(ng.view(np.uint8), 1, out=c[:k])
        np.bitwise_or(c[:k], p.view(np.uint8), out=c[:k])
        w = c.view("<u4")                    # four codes per word, one per byte
        packed = w << 6
        packed |= w >> 4
        packed |= w >> 14
        packed |= w >> 24
        b0 = start // 4
        np.copyto(out[b0:b0 + words * 4], packed, casting="unsafe")
    return out


def _np_dequantize_2bit(payload, n, threshold, out, accumulate):
    table = _cached_table_2bit(float(np.float32(threshold)))
    _np_lookup(table, 4, payload, n, out, accumulate)
    return out


def _np_lookup(table, per_byte, payload, n, out, accumulate):
    nbytes_used = -(-n // per_byte)
    full = n // per_byte
    step = BLOCK // per_byte
    scratch = np.empty((min(step, max(full, 1)), per_byte), np.float32) if accumulate else None
    body = out[:full * per_byte].reshape(full, per_byte)
    for b in range(0, full, step):
        e = min(b + step, full)
        if accumulate:
            s = scratch[:e - b]
            np.take(table, payload[b:e], axis=0, out=s)
            np.add(body[b:e], s, out=body[b:e])
        else:
            np.take(table, payload[b:e], axis=0, out=body[b:e])
    if nbytes_used > full:  # a last, partial byte
        tail = table[payload[full]][:n - full * per_byte]
        if accumulate:
            np.add(out[full * per_byte:], tail, out=out[full * per_byte:])
        else:
            out[full * per_byte:] = tail


def _np_quantize_1bit(grad, residual, threshold, out):
    n = grad.size
    t = np.float32(threshold)
    m = min(n, BLOCK)
    bit = np.empty(m, bool)
    delta = np.empty(m, np.float32)
    out[-(-n // 8):] = 0  # padding bytes of the last word
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        k = stop - start
        r = residual[start:stop]
        bt, d = bit[:k], delta[:k]
        np.add(r, grad[start:stop], out=r)
        np.greater(r, t, out=bt)
        np.multiply(bt, np.float32(-2), out=d)
        np.add(d, np.float32(1), out=d)      # -1 where the bit is set, +1 elsewhere
        np.add(r, d, out=r)
        packed = np.packbits(bt)
        b0 = start // 8
        out[b0:b0 + packed.size] = packed
    return out


def _np_dequantize_1bit(payload, n, out, accumulate):
    _np_lookup(_TABLE_1BIT, 8, payload, n, out, accumulate)
    return out


# ------------------------------------------------------------------- CUDA kernels
_CUDA_SOURCE = r"""
extern "C" __global__ void gpukv_quantize_2bit(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nbytes, float t) {
    const unsigned char posbits[4] = {0xc0, 0x30, 0x0c, 0x03};
    const unsigned char negbits[4] = {0x80, 0x20, 0x08, 0x02};
    for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < nbytes;
         b += (long long)gridDim.x * blockDim.x) {
        unsigned char byte = 0;
        long long start = b * 4;
        for (int k = 0; k < 4; ++k) {
            long long i = start + k;
            if (i >= n) break;
            float r = __fadd_rn(residual[i], grad[i]);
            if (r >= t) { byte |= posbits[k]; r = __fsub_rn(r, t); }
            else if (r <= -t) { byte |= negbits[k]; r = __fadd_rn(r, t); }
            residual[i] = r;
        }
        out[b] = byte;
    }
}

extern "C" __global__ void gpukv_dequantize_2bit(
        const unsigned char* __restrict__ in, float* __restrict__ out, long long n,
        float t, int accumulate) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int shift = 6 - 2 * (int)(i & 3);
        int code = (in[i >> 2] >> shift) & 3;
        float v = code == 3 ? t : (code == 2 ? -t : 0.0f);
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}

extern "C" __global__ void gpukv_quantize_1bit(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nbytes, float t) {
    for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < nbytes;
         b += (long long)gridDim.x * blockDim.x) {
        unsigned char byte = 0;
        long long start = b * 8;
        for (int k = 0; k < 8; ++k) {
            long long i = start + k;
            if (i >= n) break;
            float r = __fadd_rn(residual[i], grad[i]);
            if (r > t) { byte |= (unsigned char)(0x80 >> k); r = __fsub_rn(r, 1.0f); }
            else { r = __fadd_rn(r, 1.0f); }
            residual[i] = r;
        }
        out[b] = byte;
    }
}

extern "C" __global__ void gpukv_dequantize_1bit(
        const unsigned char* __restrict__ in, float* __restrict__ out, long long n,
        int accumulate) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ((in[i >> 3] >> (7 - (int)(i & 7))) & 1) ? 1.0f : -1.0f;
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}
"""


#: NVRTC options of `_CUDA_SOURCE` (CuPy adds -arch and a few of its own)
COMPILE_OPTIONS = ()


@functools.lru_cache(maxsize=None)
def _module(device_id: int):
    import cupy
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=_CUDA_SOURCE, options=COMPILE_OPTIONS)


def _launch(name, items, args):
    import cupy
    fn = _module(cupy.cuda.Device().id).get_function(name)
    threads = 256
    blocks = max(1, min(-(-items // threads), 65535))
    fn((blocks,), (threads,), args)


# ---------------------------------------------------------------------- front door
def quantize_2bit(grad, residual, threshold, out=None):
    """Add `grad` into `residual`, write MXNet's 2-bit codes into `out` (uint8), return it."""
    n = grad.size
    nbytes = packed_nbytes(n, 2)
    if _is_host(grad):
        if out is None:
            out = np.empty(nbytes, np.uint8)
        return _np_quantize_2bit(grad, residual, threshold, out)
    import cupy
    if out is None:
        out = cupy.empty(nbytes, cupy.uint8)
    out[(n + 3) // 4:] = 0
    _launch("gpukv_quantize_2bit", (n + 3) // 4,
            (grad, residual, out, np.int64(n), np.int64((n + 3) // 4), np.float32(threshold)))
    return out


def dequantize_2bit(payload, n, threshold, out, accumulate=False):
    """Decode `n` values of a 2-bit payload into `out` (float32), or add them to it."""
    if _is_host(payload):
        return _np_dequantize_2bit(payload, n, threshold, out, accumulate)
    _launch("gpukv_dequantize_2bit", n,
            (payload, out, np.int64(n), np.float32(threshold), np.int32(bool(accumulate))))
    return out


def quantize_1bit(grad, residual, threshold, out=None):
    """Add `grad` into `residual`, write MXNet master's 1-bit codes into `out`, return it."""
    n = grad.size
    nbytes = packed_nbytes(n, 1)
    if _is_host(grad):
        if out is None:
            out = np.empty(nbytes, np.uint8)
        return _np_quantize_1bit(grad, residual, threshold, out)
    import cupy
    if out is None:
        out = cupy.empty(nbytes, cupy.uint8)
    out[(n + 7) // 8:] = 0
    _launch("gpukv_quantize_1bit", (n + 7) // 8,
            (grad, residual, out, np.int64(n), np.int64((n + 7) // 8), np.float32(threshold)))
    return out


def dequantize_1bit(payload, n, out, accumulate=False):
    """Decode `n` values of a 1-bit payload (+1/-1) into `out` (float32), or add them."""
    if _is_host(payload):
        return _np_dequantize_1bit(payload, n, out, accumulate)
    _launch("gpukv_dequantize_1bit", n,
            (payload, out, np.int64(n), np.int32(bool(accumulate))))
    return out


def _xp(a):
    if _is_host(a):
        return np
    import cupy
    return cupy


def cast_fp16(x, scale: float):
    """`x / scale` rounded to float16 (round to nearest even); `scale` 1 divides nothing."""
    xp = _xp(x)
    if scale != 1.0:
        x = xp.divide(x, xp.float32(scale))
    if xp is np:
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as on the GPU
            return x.astype(np.float16)
    return x.astype(xp.float16)


def uncast_fp16(payload, scale: float, out, accumulate=False):
    """float32(payload) * scale written into `out`, or added to it."""
    xp = _xp(payload)
    value = payload.astype(xp.float32)
    if scale != 1.0:
        xp.multiply(value, xp.float32(scale), out=value)
    if accumulate:
        xp.add(out, value, out=out)
    else:
        out[...] = value
    return out


def cast_bf16(x, scale: float):
    """`x / scale` as bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    xp = _xp(x)
    if scale != 1.0:
        x = xp.divide(x, xp.float32(scale))
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + (xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1)))) >> 16
    quiet = (u >> 16) | xp.uint32(0x0040)
    return xp.where(xp.isnan(x), quiet, rounded).astype(xp.uint16)


def uncast_bf16(payload, scale: float, out, accumulate=False):
    """The float32 value of bfloat16 bit patterns, times `scale`, into `out` (or added)."""
    xp = _xp(payload)
    value = (payload.astype(xp.uint32) << 16).view(xp.float32)
    if scale != 1.0:
        xp.multiply(value, xp.float32(scale), out=value)
    if accumulate:
        xp.add(out, value, out=out)
    else:
        out[...] = value
    return out

"""The NumPy twins of the gradient-compression codecs (`gpukv.device.codecs` picks them
for host arrays; `cuda/codec_kernels.py` holds the CUDA kernels): the same bytes and
residuals as the kernels, bit for bit, but for float32 subnormals, which a GPU flushes to
zero.

Each twin runs block by block (a block's residual, flags and codes stay in L2), with
in-place ufuncs on per-thread scratch buffers, and splits long arrays over the host thread
pool (`host_sum`). The packed layouts and the residual rules are `gpukv.device.codecs`'s.
Where Numba is installed, every codec and cast runs compiled instead (`host_jit`: the
same bytes, 2-6x faster).
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from . import host_jit
from .host_blocks import BLOCK, POOL_MIN, widen_fp16

_U8, _I8, _U32, _I32, _F32 = np.uint8, np.int8, np.uint32, np.int32, np.float32
# Arrays at least this long (elements) are split over the host thread pool.
_THREADED_MIN = 1 << 19
_LOCAL = threading.local()
_CONSTS: dict = {}


def _scratch(name: str, dtype, size: int) -> np.ndarray:
    """`size` elements of this thread's scratch buffer `name`, kept between calls."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    key = (name, dtype)
    buf = bufs.get(key)
    if buf is None or buf.size < size:
        buf = bufs[key] = np.empty(max(size, BLOCK), dtype)
    return buf[:size]


def _const(value: int, dtype, size: int) -> np.ndarray:
    """`size` copies of `value`, read-only: np.minimum/np.maximum of two arrays run
    several times faster than against a scalar."""
    key = (value, np.dtype(dtype).str)
    arr = _CONSTS.get(key)
    if arr is None:
        arr = np.full(BLOCK, value, dtype)
        arr.flags.writeable = False
        _CONSTS[key] = arr
    return arr[:size]


def _blocks(fn, n: int, *args) -> None:
    """fn(*args, lo, hi) over [0, n): inline, or in BLOCK-aligned chunks on the host
    thread pool (gpukv.device.host_sum) for long arrays (NumPy releases the GIL in
    ufuncs) when that pool has at least POOL_MIN threads. On a 2-vCPU VM two threads
    were slower than one for every encoder (the twins are compute-bound in L2, and the
    second vCPU is often busy), so small pools run inline."""
    if n < _THREADED_MIN:
        fn(*args, 0, n)
        return
    from . import host_sum
    if host_sum.thread_count() < POOL_MIN:
        fn(*args, 0, n)
        return
    host_sum.run_chunks(fn, [args + c for c in host_sum.chunk_ranges(n, 4, BLOCK)])


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of the packed payload of `n` values at `bits` (1 or 2) bits each."""
    per_word = 32 // bits
    return 4 * (-(-n // per_word))


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


# ------------------------------------------------------------------------- twins
# (c0 | c1 << 8 | c2 << 16 | c3 << 24) * _GATHER_2BIT >> 24, mod 2**32, is the byte
# c0 << 6 | c1 << 4 | c2 << 2 | c3 for 2-bit codes c: the partial products below bit 24
# sum to less than 2**24 and the others fall above bit 31.
_GATHER_2BIT = 0x40100401
_POS_CODES = np.array(3 * _GATHER_2BIT & 0xFFFFFFFF, np.uint32)  # code 0b11 for +t
_NEG_CODES = np.array(2 * _GATHER_2BIT & 0xFFFFFFFF, np.uint32)  # code 0b10 for -t
_SHIFT_24 = np.array(24, np.uint32)
_STEP_1BIT = np.array(0xFE, np.uint32)
_ONES_1BIT = np.array(0x01010101, np.uint32)


def _quantize_2bit_range(grad, residual, t, out, lo, hi):
    t0, nt0 = np.array(t, _F32), np.array(-t, _F32)  # 0-d: cheaper to pass than scalars
    pos = _scratch("pos", np.bool_, BLOCK)
    neg = _scratch("neg", np.bool_, BLOCK)
    q = _scratch("q", _I8, BLOCK)
    qf = _scratch("qf", _F32, BLOCK)
    words = _scratch("words", _U32, BLOCK // 4)
    words2 = _scratch("words2", _U32, BLOCK // 4)
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        k = stop - start
        kk = -(-k // 16) * 16
        r = residual[start:stop]
        if k == BLOCK:  # whole blocks use the scratch buffers as they are: no new views
            p, ng, qq, qv, w, w2 = pos, neg, q, qf, words, words2
        else:
            p, ng, qq, qv = pos[:k], neg[:k], q[:k], qf[:k]
            w, w2 = words[:kk // 4], words2[:kk // 4]
        np.add(r, grad[start:stop], r)
        np.greater_equal(r, t0, p)
        np.less_equal(r, nt0, ng)
        np.subtract(p.view(_I8), ng.view(_I8), qq)
        np.copyto(qv, qq)                    # -1, 0 or +1
        np.multiply(qv, t0, qv)              # -t, +0 or +t
        np.subtract(r, qv, r)                # r - t, r - (-t) == r + t, or r unchanged
        if kk > k:                           # codes of the last word's padding: 0
            pos[k:kk] = False
            neg[k:kk] = False
        np.multiply(pos[:kk].view(_U32), _POS_CODES, w)  # four flags per word, one per byte
        np.multiply(neg[:kk].view(_U32), _NEG_CODES, w2)
        np.add(w, w2, w)
        np.right_shift(w, _SHIFT_24, w)
        b0 = start // 4
        np.copyto(out[b0:b0 + kk // 4], w, casting="unsafe")


def quantize_2bit(grad, residual, threshold, out):
    n = grad.size
    if host_jit.enabled():
        out[-(-n // 4):] = 0  # padding bytes of the last word
        _blocks(host_jit.two_bit_encode, n, grad, residual, np.float32(threshold), out)
    else:
        _blocks(_quantize_2bit_range, n, grad, residual, np.float32(threshold), out)
    return out


def dequantize_2bit(payload, n, threshold, out, accumulate):
    table = _cached_table_2bit(float(np.float32(threshold)))
    _lookup(table, 4, payload, n, out, accumulate)
    return out


def _lookup_range(table, per_byte, payload, out, accumulate, lo, hi):
    idx = _scratch("idx", np.intp, BLOCK // per_byte)
    rows = _scratch("rows", _F32, BLOCK).reshape(-1, per_byte) if accumulate else None
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        b0 = start // per_byte
        full = (stop - start) // per_byte
        if full:
            ib = idx[:full]
            np.copyto(ib, payload[b0:b0 + full])  # take() converts to intp anyway
            body = out[start:start + full * per_byte].reshape(full, per_byte)
            dest = rows[:full] if accumulate else body
            np.take(table, ib, axis=0, out=dest, mode="wrap")  # 0 <= ib < 256: no wrap
            if accumulate:
                np.add(body, dest, out=body)
        rest = stop - start - full * per_byte
        if rest:  # a last, partial byte
            tail = table[payload[b0 + full]][:rest]
            o = out[stop - rest:stop]
            if accumulate:
                np.add(o, tail, out=o)
            else:
                o[...] = tail


def _lookup(table, per_byte, payload, n, out, accumulate):
    if host_jit.enabled():
        kernel = host_jit.two_bit_decode if per_byte == 4 else host_jit.one_bit_decode
        _blocks(kernel, n, table, payload, out, accumulate)
    else:
        _blocks(_lookup_range, n, table, per_byte, payload, out, accumulate)


def _quantize_1bit_range(grad, residual, t, out, lo, hi):
    t0 = np.array(t, _F32)
    bits = _scratch("bits", np.bool_, BLOCK)
    step8 = _scratch("step8", _U8, BLOCK)
    step = _scratch("step", _F32, BLOCK)
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        k = stop - start
        kk = -(-k // 4) * 4
        r = residual[start:stop]
        bt, d = (bits, step) if k == BLOCK else (bits[:k], step[:k])
        np.add(r, grad[start:stop], r)
        np.greater(r, t0, bt)
        if kk > k:
            bits[k:kk] = False
        s32 = step8[:kk].view(_U32)          # four flags per word, one per byte
        np.multiply(bits[:kk].view(_U32), _STEP_1BIT, s32)
        np.bitwise_or(s32, _ONES_1BIT, s32)  # int8 -1 where the bit is set, else +1
        np.copyto(d, step8[:k].view(_I8))
        np.add(r, d, r)                      # r + (-1) == r - 1, or r + 1
        packed = np.packbits(bt)
        b0 = start // 8
        out[b0:b0 + packed.size] = packed


def quantize_1bit(grad, residual, threshold, out):
    n = grad.size
    out[-(-n // 8):] = 0  # padding bytes of the last word
    fn = host_jit.one_bit_encode if host_jit.enabled() else _quantize_1bit_range
    _blocks(fn, n, grad, residual, np.float32(threshold), out)
    return out


def dequantize_1bit(payload, n, out, accumulate):
    _lookup(_TABLE_1BIT, 8, payload, n, out, accumulate)
    return out


def _scaled_into(values, scale, out, accumulate) -> None:
    """The last steps of a decoder's block: `values` (float32, in `out` itself unless
    `accumulate`) times `scale` (None: 1), added to `out` when `accumulate`."""
    if scale is not None:
        np.multiply(values, scale, out=values)
    if accumulate:
        np.add(out, values, out=out)


def _scaled_blocks(x, scale, lo, hi):
    """(start, stop, block of x[lo:hi] divided by `scale`, or x's own slice if None)."""
    xs = _scratch("xs", _F32, BLOCK) if scale is not None else None
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        xb = x[start:stop]
        if scale is not None:
            xb = np.divide(xb, scale, out=xs[:stop - start])
        yield start, stop, xb


def _cast_fp16_range(x, scale, out, lo, hi):
    """float32 -> float16 bits as NumPy's astype (round to nearest even), without its
    per-element loop. For a = |x| with exponent e (e >= -14, as fp16's subnormals share
    the grid of its smallest normals), M = 2**(e+13) has fp16's ulp at a, so the float32
    sum a + M rounds a to fp16's grid (ties to even, M being even) and its bits minus
    M's are the fp16 significand; adding the rebiased exponent gives the fp16 bits.
    a >= 65536 is clamped to 65536, which rounds to inf. The sign is added to the 16-bit
    result (half the bytes of a 32-bit pass). A block with a NaN takes NumPy's cast,
    which keeps the payload."""
    a = _scratch("a", _U32, BLOCK)
    m = _scratch("m", _U32, BLOCK)
    neg = _scratch("neg", np.bool_, BLOCK)
    sign = _scratch("sign16", np.uint16, BLOCK)
    for start, stop, xb in _scaled_blocks(x, scale, lo, hi):
        k = stop - start
        u = xb.view(_U32)
        ab, mb, nb, sb = a[:k], m[:k], neg[:k], sign[:k]
        np.bitwise_and(u, _U32(0x7FFFFFFF), out=ab)
        top = ab.max()
        if top > 0x7F800000:
            with np.errstate(over="ignore"):
                np.copyto(out[start:stop], xb, casting="unsafe")
            continue
        if top >= 0x47800000:
            np.minimum(ab, _const(0x47800000, _U32, k), out=ab)
        np.bitwise_and(ab, _U32(0x7F800000), out=mb)
        np.maximum(mb, _const(0x38800000, _U32, k), out=mb)  # 2**e, e >= -14
        np.add(mb, _U32(13 << 23), out=mb)                     # M = 2**(e+13)
        np.add(ab.view(_F32), mb.view(_F32), out=ab.view(_F32))
        np.subtract(ab, mb, out=ab)                            # significand (+1024 if normal)
        np.right_shift(mb, _U32(13), out=mb)
        np.add(ab, mb, out=ab)                                 # fp16 bits + 0x1F800
        o = out[start:stop].view(np.uint16)
        np.copyto(o, ab, casting="unsafe")                     # fp16 bits + 0xF800 (mod 2**16)
        np.signbit(xb, out=nb)
        np.copyto(sb, nb)
        np.multiply(sb, np.uint16(0x8000), out=sb)
        np.bitwise_or(sb, np.uint16(0x0800), out=sb)           # sign, and -0xF800 mod 2**16
        np.add(o, sb, out=o)


def cast_fp16(x, scale):
    out = np.empty(x.size, np.float16)
    fn = (host_jit.with_twin(host_jit.fp16_encode, _cast_fp16_range) if host_jit.enabled()
          else _cast_fp16_range)
    _blocks(fn, x.size, x, None if scale == 1.0 else np.float32(scale), out)
    return out


def _uncast_fp16_range(payload, scale, out, accumulate, lo, hi):
    wide = _scratch("wide", _F32, BLOCK) if accumulate else None
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        f = wide[:stop - start] if accumulate else out[start:stop]
        widen_fp16(payload[start:stop], f)
        _scaled_into(f, scale, out[start:stop], accumulate)


def uncast_fp16(payload, scale, out, accumulate):
    fn = (host_jit.with_twin(host_jit.fp16_decode, _uncast_fp16_range) if host_jit.enabled()
          else _uncast_fp16_range)
    _blocks(fn, payload.size, payload.view(np.uint16),
            None if scale == 1.0 else np.float32(scale), out, accumulate)
    return out


def bf16_bits(u):
    """bfloat16 bits (uint32) of float32 bits `u`: round to nearest even, NaN quieted."""
    rounded = (u + (_U32(0x7FFF) + ((u >> 16) & _U32(1)))) >> 16
    quiet = (u >> 16) | _U32(0x0040)
    return np.where(np.isnan(u.view(_F32)), quiet, rounded)


def _cast_bf16_range(x, scale, out, lo, hi):
    tmp = _scratch("bf", _U32, BLOCK)
    for start, stop, xb in _scaled_blocks(x, scale, lo, hi):
        k = stop - start
        u = xb.view(_U32)
        if np.isnan(np.minimum.reduce(xb)):  # the minimum is NaN when any value is
            out[start:stop] = bf16_bits(u)
            continue
        tb = tmp[:k]
        np.right_shift(u, 16, out=tb)
        np.bitwise_and(tb, _U32(1), out=tb)
        np.add(tb, _U32(0x7FFF), out=tb)
        np.add(tb, u, out=tb)
        np.right_shift(tb, 16, out=tb)
        np.copyto(out[start:stop], tb, casting="unsafe")


def cast_bf16(x, scale):
    out = np.empty(x.size, np.uint16)
    fn = host_jit.bf16_encode if host_jit.enabled() else _cast_bf16_range
    _blocks(fn, x.size, x, None if scale == 1.0 else np.float32(scale), out)
    return out


def _uncast_bf16_range(payload, scale, out, accumulate, lo, hi):
    wide = _scratch("wide", _U32, BLOCK) if accumulate else None
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        k = stop - start
        f = wide[:k] if accumulate else out[start:stop].view(_U32)
        np.copyto(f, payload[start:stop])
        np.left_shift(f, 16, out=f)
        _scaled_into(f.view(_F32), scale, out[start:stop], accumulate)


def uncast_bf16(payload, scale, out, accumulate):
    fn = (host_jit.with_twin(host_jit.bf16_decode, _uncast_bf16_range) if host_jit.enabled()
          else _uncast_bf16_range)
    _blocks(fn, payload.size, payload, None if scale == 1.0 else np.float32(scale), out,
            accumulate)
    return out


# --------------------------------------------------------------------------- sign
#: values per scale of the sign codec (a multiple of 8 dividing 256, a CUDA block's
#: values in the kernel, and BLOCK)
SIGN_BLOCK = 64
_HALVES = tuple(SIGN_BLOCK >> k for k in range(1, SIGN_BLOCK.bit_length()))  # 32 .. 1
_TINY = np.finfo(_F32).tiny  # float32's smallest normal


def sign_nbytes(n: int) -> int:
    """Bytes of the sign payload of `n` values: a float32 scale per SIGN_BLOCK values,
    then the bits, 32 values per 32-bit word."""
    return 4 * (-(-n // SIGN_BLOCK)) + packed_nbytes(n, 1)


def sign_parts(payload, n: int):
    """(scales as float32, packed bits) of a sign payload of `n` values."""
    blocks = -(-n // SIGN_BLOCK)
    return payload[:4 * blocks].view(_F32), payload[4 * blocks:]


_V64 = np.dtype((np.void, 64))  # 16 float32 as one item: copies of it skip ufunc loops


def _halve(x, y, n, width, halves):
    """The sums by halves of every `width`-value block of x[:n] (x[i] += x[i + h] for
    each h of `halves`), as shifted adds of whole arrays, y[p] = x[p] + x[p + h] for
    every p: 2-D slices cost a ufunc inner-loop call per block, 4x the time. Each
    block's first h elements then hold its next level; the others mix two blocks and are
    never read (their overflow is silenced). x and y alternate; returns the array
    holding the last level."""
    with np.errstate(over="ignore"):
        for h in halves:
            m = n - width + h  # up to the last block's first h elements
            np.add(x[:m], x[h:m + h], out=y[:m])
            x, y = y, x
    return x


def _block_scales(r, k, short, scales):
    """scales[:] = the root mean square of each SIGN_BLOCK of r[:k]: the squares summed
    by halves (x[i] += x[i + h], h = 32, 16, ..., 1) as the CUDA kernel's threads do,
    divided by the block's count (`short` for the last block when it is short, else 0),
    then the square root. A block of finite values whose sum of squares leaves float32's
    normal range (inf, or below its smallest normal) takes `_rescaled_scales`."""
    blocks = scales.size
    n = blocks * SIGN_BLOCK
    x = _scratch("sign_x", _F32, BLOCK)[:n]
    y = _scratch("sign_y", _F32, BLOCK)[:n]
    with np.errstate(over="ignore"):  # (such blocks are rescaled below)
        np.square(r, out=x[:k])
    x[k:] = 0
    x = _halve(x, y, n, SIGN_BLOCK, _HALVES[:2])  # 32, 16
    # The first 16 values of each block, packed (a 64-byte item per block: one plain
    # copy), take the last halves: 1/4 of the values.
    c = _scratch("sign_c", _F32, BLOCK // 4)[:16 * blocks]
    d = _scratch("sign_d", _F32, BLOCK // 4)[:16 * blocks]
    np.copyto(c.view(_V64), x.view(_V64)[::4])
    sums = _halve(c, d, c.size, 16, _HALVES[2:])[::16]  # 8, 4, 2, 1
    if np.isnan(np.maximum.reduce(sums)):  # keep the NaNs the sums always kept
        sums = _block_sums_2d(r, k, blocks)
    odd = np.flatnonzero((sums == np.inf) | (sums < _TINY))  # (never a NaN's block)
    np.divide(sums, _F32(SIGN_BLOCK), out=scales)
    if short:
        scales[-1] = sums[-1] / _F32(short)
    np.sqrt(scales, out=scales)
    if odd.size:
        _rescaled_scales(r, k, short, odd, scales)


def _rescaled_scales(r, k, short, odd, scales):
    """scales[odd] = m * sqrt(s / count) for the blocks `odd` of r[:k] whose sum of
    squares is inf or below float32's smallest normal and whose largest magnitude m is
    finite and above 0, s the sum by halves of (v / m)**2 over the block's values v
    (zeros past a short last block's end): the root mean square without the squares'
    overflow or underflow (every quotient is at most 1, and m's is 1). The others (an
    inf in the block, or every value 0) keep their scale."""
    blocks = scales.size
    # The largest magnitudes as the largest of the values' bits, sign cleared (no NaN
    # here): integer maxima over whole blocks run 5x faster than float maxima by rows.
    bits = _scratch("sign_y", _U32, BLOCK)[:k]
    np.bitwise_and(r.view(_U32), _U32(0x7FFFFFFF), out=bits)
    top = np.maximum.reduceat(bits, np.arange(0, k, SIGN_BLOCK))[odd]
    keep = (top > 0) & (top < 0x7F800000)  # (not all zeros, no inf: else the scale stands)
    if not keep.any():
        return
    odd, m = odd[keep], top[keep].view(_F32)
    if k == blocks * SIGN_BLOCK:
        rows = r.reshape(blocks, SIGN_BLOCK)[odd]
    else:  # a short last block: zeros after its values
        padded = np.zeros(blocks * SIGN_BLOCK, _F32)
        padded[:k] = r
        rows = padded.reshape(blocks, SIGN_BLOCK)[odd]
    np.divide(rows, m[:, None], out=rows)
    np.square(rows, out=rows)
    for h in _HALVES:
        np.add(rows[:, :h], rows[:, h:2 * h], out=rows[:, :h])
    counts = np.full(odd.size, SIGN_BLOCK, _F32)
    if short:
        counts[odd == blocks - 1] = short
    s = np.divide(rows[:, 0], counts)
    np.sqrt(s, out=s)
    scales[odd] = np.multiply(s, m, out=s)


def _block_sums_2d(r, k, blocks):
    """The blocks' sums of squares by halves on 2-D views (a ufunc call per block and
    half): the sums of `_block_scales`, slower, but with the NaN they always had where
    two NaNs meet (which of the two an add returns depends on NumPy's loop, and a short
    row takes another path than a long array)."""
    a = _scratch("sign_x", _F32, BLOCK)[:blocks * SIGN_BLOCK]
    np.square(r, out=a[:k])
    a[k:] = 0
    m = a.reshape(blocks, SIGN_BLOCK)
    for h in _HALVES:
        np.add(m[:, :h], m[:, h:2 * h], out=m[:, :h])
    return m[:, 0]


def _sign_values(scales, bits, k, out):
    """out[:k] = the sign payload's values: +1 or -1 per bit (1 for +), times its block's
    scale (the scales of the SIGN_BLOCKs of the k values, spread over their values)."""
    _lookup_range(_TABLE_1BIT, 8, bits, out, False, 0, k)
    s = _scratch("sign_y", _F32, BLOCK)[:scales.size * SIGN_BLOCK]
    np.copyto(s.reshape(scales.size, SIGN_BLOCK), scales[:, None])
    np.multiply(out, s[:k], out=out)


def _quantize_sign_range(grad, residual, scales, bits, total, lo, hi):
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        k = stop - start
        r = residual[start:stop]
        np.add(r, grad[start:stop], r)
        first = start // SIGN_BLOCK
        sc = scales[first:first - (-k // SIGN_BLOCK)]
        _block_scales(r, k, k % SIGN_BLOCK if stop == total else 0, sc)
        positive = _scratch("sign_pos", np.bool_, BLOCK)[:k]
        np.greater_equal(r, _F32(0), positive)
        packed = np.packbits(positive)
        b = bits[start // 8:start // 8 + packed.size]
        b[...] = packed
        step = _scratch("sign_x", _F32, BLOCK)[:k]  # +scale or -scale: the decoded value
        _sign_values(sc, b, k, step)
        np.subtract(r, step, r)


def quantize_sign(grad, residual, out):
    n = grad.size
    scales, bits = sign_parts(out, n)
    bits[-(-n // 8):] = 0  # padding bytes of the last word
    if host_jit.enabled():
        _blocks(host_jit.sign_encode, n, grad, residual, scales, bits)
    else:
        _blocks(_quantize_sign_range, n, grad, residual, scales, bits, n)
    return out


def _dequantize_sign_range(scales, bits, out, accumulate, lo, hi):
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        k = stop - start
        first = start // SIGN_BLOCK
        o = out[start:stop]
        values = _scratch("sign_x", _F32, BLOCK)[:k] if accumulate else o
        _sign_values(scales[first:first - (-k // SIGN_BLOCK)], bits[start // 8:], k, values)
        if accumulate:
            np.add(o, values, o)


def dequantize_sign(payload, n, out, accumulate):
    scales, bits = sign_parts(payload, n)
    fn = host_jit.sign_decode if host_jit.enabled() else _dequantize_sign_range
    _blocks(fn, n, scales, bits, out, accumulate)
    return out


# ------------------------------------------------------------------------ ternary
#: values per scale of the ternary codec (divides 256, a CUDA block's values, and BLOCK)
TERNARY_BLOCK = 128
#: bytes of a block's codes, five to a byte (3**5 = 243 <= 256)
TERNARY_CODE_BYTES = -(-TERNARY_BLOCK // 5)
#: a value is sent when its magnitude exceeds this fraction of its block's mean magnitude
TERNARY_THRESHOLD = _F32(0.7)
_LAST_HALVES = (16, 8, 4, 2, 1)  # of a block's sum, after the whole-row halves 64 and 32
_POW3 = np.array([1, 3, 9, 27, 81])


def ternary_nbytes(n: int) -> int:
    """Bytes of the ternary payload of `n` values: a float32 scale per TERNARY_BLOCK
    values, then each block's TERNARY_CODE_BYTES bytes of codes."""
    return (4 + TERNARY_CODE_BYTES) * (-(-n // TERNARY_BLOCK))


def ternary_parts(payload, n: int):
    """(scales as float32, codes as (blocks, TERNARY_CODE_BYTES) bytes) of a payload."""
    blocks = -(-n // TERNARY_BLOCK)
    codes = payload[4 * blocks:(4 + TERNARY_CODE_BYTES) * blocks]
    return payload[:4 * blocks].view(_F32), codes.reshape(blocks, TERNARY_CODE_BYTES)


def _ternary_sums(x, out) -> None:
    """out[b] = the sum of row b of x (blocks, TERNARY_BLOCK) by halves (x[i] += x[i + h],
    h = 64, 32, ..., 1), as the CUDA kernel's threads add them: the first two halves on
    whole rows, the rest (a quarter of the values) as shifted adds (`_halve`)."""
    blocks = x.shape[0]
    a = _scratch("ternary_h64", _F32, blocks * 64).reshape(blocks, 64)
    b = _scratch("ternary_h32", _F32, blocks * 32).reshape(blocks, 32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(x[:, :64], x[:, 64:], out=a)
        np.add(a[:, :32], a[:, 32:], out=b)
    flat = b.reshape(-1)
    y = _scratch("ternary_hy", _F32, flat.size)
    np.copyto(out, _halve(flat, y, flat.size, 32, _LAST_HALVES)[::32])


def _rescaled_magnitudes(size, sums):
    """For the rows of `size` (magnitudes, blocks x TERNARY_BLOCK) whose sum `sums`
    overflowed to inf while every magnitude is finite: the row divided by its largest
    magnitude m, and its sum taken again, in place. Returns (those rows, their m), or
    None; a row with an inf keeps its inf sum."""
    over = np.flatnonzero(sums == np.inf)
    if not over.size:
        return None
    rows = size[over]
    m = np.maximum.reduce(rows, axis=1)
    finite = m < np.inf
    if not finite.all():
        over, rows, m = over[finite], rows[finite], m[finite]
    if not over.size:
        return None
    np.divide(rows, m[:, None], out=rows)
    size[over] = rows
    part = np.empty(over.size, _F32)
    _ternary_sums(rows, part)
    sums[over] = part
    return over, m


#: each byte's five values' signs (0, +1, -1), first value first, as one 20-byte item
_TERNARY_SIGNS = np.array([0, 1, -1], _F32)[
    (np.arange(256)[:, None] // _POW3) % 3].view(np.dtype((np.void, 20)))[:, 0]


def _times_scale(signs, scales, out) -> None:
    """out = signs (0, +1, -1) times their row's scale, 0 (+0) where the sign is 0 even
    for an infinite scale (masks and np.where cost ten times these plain ufuncs)."""
    with np.errstate(invalid="ignore"):
        np.multiply(signs, scales[:, None], out=out)
    if not np.isfinite(scales).all():  # 0 * inf: NaN, where the kernel writes 0
        out[signs == 0] = 0


def _quantize_ternary_range(grad, residual, scales, codes, total, lo, hi):
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        k = stop - start
        blocks = -(-k // TERNARY_BLOCK)
        first = start // TERNARY_BLOCK
        shape = (blocks, TERNARY_BLOCK)
        r = residual[start:stop]
        np.add(r, grad[start:stop], r)
        whole = k == blocks * TERNARY_BLOCK
        if whole:  # the residual itself, block by block
            e = r.reshape(shape)
        else:  # r, zeros past its end
            e = _scratch("ternary_e", _F32, blocks * TERNARY_BLOCK)
            e[:k] = r
            e[k:] = 0
            e = e.reshape(shape)
        size = _scratch("ternary_size", _F32, e.size).reshape(shape)
        np.abs(e, out=size)
        threshold = _scratch("ternary_mean", _F32, blocks)
        _ternary_sums(size, threshold)
        rescaled = _rescaled_magnitudes(size, threshold)
        short = k % TERNARY_BLOCK if stop == total else 0
        with np.errstate(over="ignore", invalid="ignore"):
            last = threshold[-1] / _F32(short) if short else None
            np.divide(threshold, _F32(TERNARY_BLOCK), out=threshold)  # the mean
            if last is not None:
                threshold[-1] = last
            np.multiply(threshold, TERNARY_THRESHOLD, out=threshold)
        chosen = _scratch("ternary_chosen", np.bool_, e.size).reshape(shape)
        np.greater(size, threshold[:, None], out=chosen)  # never a NaN's, nor padding's
        poisoned = ~np.isfinite(threshold)  # an inf or NaN in the block: it crosses as NaN
        if poisoned.any():
            chosen[poisoned] = True
            chosen.reshape(-1)[k:] = False  # (padding)
        kept = _scratch("ternary_kept", _F32, e.size).reshape(shape)
        with np.errstate(invalid="ignore"):
            np.multiply(size, chosen, out=kept)
        np.fmax(kept, 0, out=kept)  # inf * 0 or NaN * 0 (not chosen): NaN, made 0
        sc = scales[first:first + blocks]
        _ternary_sums(kept, sc)
        # exact: at most 128 (a uint16 sum of the bytes is twice as fast as bool's sum)
        how_many = np.add.reduce(chosen.view(_U8), axis=1, dtype=np.uint16).astype(_F32)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            np.divide(sc, how_many, out=sc)
        sc[how_many == 0] = 0
        if rescaled is not None:
            rows, m = rescaled
            sc[rows] = np.multiply(sc[rows], m)
        negative = _scratch("ternary_negative", np.bool_, e.size).reshape(shape)
        np.less(e, 0, out=negative)
        np.logical_and(negative, chosen, out=negative)
        if poisoned.any():
            sc[poisoned] = np.nan
            negative[poisoned] = False
        digits = _scratch("ternary_digits", _U8, blocks * 5 * TERNARY_CODE_BYTES)
        digits = digits.reshape(blocks, 5 * TERNARY_CODE_BYTES)
        digits[:, TERNARY_BLOCK:] = 0
        np.add(chosen.view(_U8), negative.view(_U8), out=digits[:, :TERNARY_BLOCK])
        by_five = digits.reshape(blocks, TERNARY_CODE_BYTES, 5)
        packed = codes[first:first + blocks]
        np.copyto(packed, by_five[:, :, 4])
        for place in (3, 2, 1, 0):  # Horner: ((d4 * 3 + d3) * 3 + ...) + d0
            np.multiply(packed, _U8(3), out=packed)
            np.add(packed, by_five[:, :, place], out=packed)
        signs = _scratch("ternary_signs", _F32, e.size).reshape(shape)
        # chosen - 2 * negative: +1, -1 or 0, in int8 (as uint8 0 - 1 would be 255)
        np.subtract(chosen.view(np.int8), negative.view(np.int8), out=signs,
                    casting="unsafe")
        np.subtract(signs, negative.view(np.int8), out=signs, casting="unsafe")
        sent = size  # the magnitudes are spent: their buffer takes the values sent
        _times_scale(signs, sc, sent)
        with np.errstate(over="ignore", invalid="ignore"):
            np.subtract(e, sent, out=e)
        if not whole:
            r[...] = e.reshape(-1)[:k]


def quantize_ternary(grad, residual, out):
    n = grad.size
    scales, codes = ternary_parts(out, n)
    if host_jit.enabled():
        _blocks(host_jit.ternary_encode, n, grad, residual, scales, codes.reshape(-1))
    else:
        _blocks(_quantize_ternary_range, n, grad, residual, scales, codes, n)
    return out


def _dequantize_ternary_range(scales, codes, out, accumulate, lo, hi):
    for start in range(lo, hi, BLOCK):
        stop = min(start + BLOCK, hi)
        k = stop - start
        first = start // TERNARY_BLOCK
        blocks = -(-k // TERNARY_BLOCK)
        signs = np.take(_TERNARY_SIGNS, codes[first:first + blocks].reshape(-1))
        signs = signs.view(_F32).reshape(blocks, -1)[:, :TERNARY_BLOCK]
        values = _scratch("ternary_values", _F32, blocks * TERNARY_BLOCK)
        values = values.reshape(blocks, TERNARY_BLOCK)
        _times_scale(signs, scales[first:first + blocks], values)
        o = out[start:stop]
        if accumulate:
            np.add(o, values.reshape(-1)[:k], o)
        else:
            o[...] = values.reshape(-1)[:k]


def dequantize_ternary(payload, n, out, accumulate):
    scales, codes = ternary_parts(payload, n)
    if host_jit.enabled():
        _blocks(host_jit.ternary_decode, n, scales, codes.reshape(-1), out, accumulate)
    else:
        _blocks(_dequantize_ternary_range, n, scales, codes, out, accumulate)
    return out

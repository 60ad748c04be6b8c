"""The compiled codecs of `host_jit` (Numba): importing this module imports Numba, which
`host_jit` does on the first call that needs it.

Each function works on the values [lo, hi) of flat, contiguous arrays, lo a multiple of
the codec's block (host_codecs' SIGN_BLOCK, 64 values, TERNARY_BLOCK, 128 values, and a
byte's values for the 2-bit and 1-bit codes), so that a long array can be cut over the
host thread pool: they release the GIL. They are
compiled on their first call in a process and then kept in Numba's cache (next to this
file, or Numba's own cache directory where that is read-only)."""
from __future__ import annotations

import sys

import numba
import numpy as np

if sys.byteorder != "little":  # the sign encoder reads eight bytes as one word
    raise ImportError("gpukv's compiled codecs assume a little-endian machine")

_F32 = np.float32
_TERNARY_CODE_BYTES = 26  # a ternary block's bytes of codes: five values to a byte
_ZERO, _ONE, _SEVEN_TENTHS, _NAN = _F32(0), _F32(1), _F32(0.7), _F32(np.nan)
_INF, _TINY = _F32(np.inf), np.finfo(_F32).tiny  # (float32's smallest normal)
# (eight bytes of 0 or 1 as a little-endian uint64) * _GATHER_BITS >> 56 is the byte of
# their bits, the first byte's the most significant: the partial products that reach the
# top byte are those eight bits, and those below it never carry into it.
_GATHER_BITS, _SHIFT_56 = np.uint64(0x8040201008040201), np.uint64(56)
#: (the decoders' `table`: as an argument rather than a global they run twice as fast)
#: +1 or -1 for each of a byte's 8 bits, the most significant first
SIGN_TABLE = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1) == 1,
                      _F32(1), _F32(-1)).astype(_F32)
PLUS_MINUS = np.array([-1, 1], _F32)
#: the lanes of the sums by halves (halves_64, halves_128), 8: as an argument, the loop
#: over them is vectorised, where a constant 8 has it unrolled into scalar adds
LANES = 8
#: 0, +1 or -1 for each of a byte's five base-3 digits, the lowest first
TERNARY_TABLE = np.array([0, 1, -1], _F32)[
    (np.arange(256)[:, None] // np.array([1, 3, 9, 27, 81])) % 3]
jit = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
# (a call per block costs more than the block)
inline = numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy",
                    inline="always")


# Indices below count from 0 within slices taken on entry: Numba checks an index
# that may be negative (it wraps), which stops LLVM from vectorising the loops.
@inline
def halves_from_eight(c):
    """The last three levels of a sum by halves: of c[:8] (c[i] += c[i + h], h = 4, 2,
    1), as scalars."""
    d0, d1, d2, d3 = c[0] + c[4], c[1] + c[5], c[2] + c[6], c[3] + c[7]
    return (d0 + d2) + (d1 + d3)


@inline
def halves_64(x, c, lanes):
    """The sum of x[:64] by halves (x[i] += x[i + h], h = 32, ..., 1): the first three
    levels as one pass of eight lanes (`lanes`, LANES) into c[:8] (each lane the tree
    those levels make of its eight values), then the last three. The same additions in
    the same order as level by level, with no level stored and read back."""
    for i in range(lanes):
        c[i] = (((x[i] + x[i + 32]) + (x[i + 16] + x[i + 48]))
                + ((x[i + 8] + x[i + 40]) + (x[i + 24] + x[i + 56])))
    return halves_from_eight(c)


@inline
def halves_128(x, at, c, lanes):
    """The sum of x[at:at + 128] by halves (h = 64, ..., 1), as halves_64 does it."""
    for i in range(lanes):
        j = at + i
        c[i] = ((((x[j] + x[j + 64]) + (x[j + 32] + x[j + 96]))
                 + ((x[j + 16] + x[j + 80]) + (x[j + 48] + x[j + 112])))
                + (((x[j + 8] + x[j + 72]) + (x[j + 40] + x[j + 104]))
                   + ((x[j + 24] + x[j + 88]) + (x[j + 56] + x[j + 120]))))
    return halves_from_eight(c)


@inline
def rescaled_square(v, m):
    """(v / m)**2 in float32."""
    q = v / m
    return q * q


@inline
def rescaled_column(e, i, m):
    """The first three levels of the sum by halves of (e[:64] / m)**2 at column i (< 8):
    halves_64's c[i], without an array (writes to scratch in sign_block's rare branch
    made its common path 2.5x slower)."""
    return (((rescaled_square(e[i], m) + rescaled_square(e[i + 32], m))
             + (rescaled_square(e[i + 16], m) + rescaled_square(e[i + 48], m)))
            + ((rescaled_square(e[i + 8], m) + rescaled_square(e[i + 40], m))
               + (rescaled_square(e[i + 24], m) + rescaled_square(e[i + 56], m))))


@inline
def rescaled_rms(e, count, scale):
    """The root mean square of e[:64] (its first `count` real, zeros after them) as
    m * sqrt(the sum by halves of (v / m)**2 / count), m the largest magnitude, for a
    block whose squares overflow or underflow float32; `scale` where m is 0 or inf (an
    inf in the block). m is the largest of the bits, sign cleared (no NaN here): an
    integer maximum, which vectorises. (The uint32 view of e is made here: one passed
    in beside e made sign_block's common path 2.5x slower.)"""
    eu = e.view(np.uint32)
    top = np.uint32(0)
    for i in range(64):
        top = np.uint32(max(top, eu[i] & np.uint32(0x7FFFFFFF)))
    m = np.uint32(top).view(np.float32)
    if not (m > _ZERO and m < _INF):
        return scale
    total = (((rescaled_column(e, 0, m) + rescaled_column(e, 4, m))
              + (rescaled_column(e, 2, m) + rescaled_column(e, 6, m)))
             + ((rescaled_column(e, 1, m) + rescaled_column(e, 5, m))
                + (rescaled_column(e, 3, m) + rescaled_column(e, 7, m))))  # halves 4, 2, 1
    return m * _F32(np.sqrt(total / _F32(count)))


@inline
def sign_block(g, r, at, count, e, x, c, p, words, bits, byte, plus_minus, lanes):
    """One block of 64 values from g[at:], r[at:] (its first `count` real, zeros after
    them): r += g, the squares summed by halves (x[i] += x[i + h], h = 32, ..., 1)
    over `count`, square-rooted: the scale, returned (`rescaled_rms` where that sum is
    inf or below float32's smallest normal); the signs into bits[byte:byte + 8] (1 for
    >= 0); r -= +-scale. e, x, c and p (`words`: p as uint64) are scratch."""
    for i in range(64):
        v = r[at + i] + g[at + i]
        e[i] = v
        x[i] = v * v
        p[i] = 1 if v >= _ZERO else 0
    total = halves_64(x, c, lanes)
    s = _F32(np.sqrt(total / _F32(count)))
    if total == _INF or total < _TINY:  # (never for a NaN)
        s = rescaled_rms(e, count, s)
    for j in range(8):  # eight 0/1 bytes to one byte, the first the most significant
        bits[byte + j] = np.uint8((words[j] * _GATHER_BITS) >> _SHIFT_56)
    minus, plus = plus_minus[0] * s, plus_minus[1] * s  # -1 * s, +1 * s (sign_encode)
    for i in range(64):
        r[at + i] = e[i] - (plus if p[i] else minus)
    return s


@jit
def sign_encode(grad, residual, scales, bits, lo, hi, plus_minus, lanes):
    """`plus_minus` is [-1, +1] (PLUS_MINUS), an argument so that LLVM cannot fold
    `-1 * s` into `-s`: for a NaN scale the two differ in the NaN's sign."""
    g, r = grad[lo:hi], residual[lo:hi]
    sc, bt = scales[lo // 64:], bits[lo // 8:]
    e = np.empty(64, np.float32)
    x = np.empty(64, np.float32)
    c = np.empty(8, np.float32)
    p = np.empty(64, np.uint8)
    words = p.view(np.uint64)
    whole = (hi - lo) // 64
    for b in range(whole):
        sc[b] = sign_block(g, r, b * 64, 64, e, x, c, p, words, bt, b * 8, plus_minus,
                           lanes)
    k = hi - lo - whole * 64
    if k:  # the array's last, short block: zeros after its values, its bits cleared
        g64 = np.zeros(64, np.float32)
        r64 = np.zeros(64, np.float32)
        for i in range(k):  # (loops: slice assignments take Numba 2-3 s more to compile)
            g64[i] = g[whole * 64 + i]
            r64[i] = r[whole * 64 + i]
        b8 = np.zeros(8, np.uint8)
        sc[whole] = sign_block(g64, r64, 0, k, e, x, c, p, words, b8, 0, plus_minus,
                               lanes)
        for i in range(k):
            r[whole * 64 + i] = r64[i]
        full, rest = k // 8, k % 8
        for j in range(full):
            bt[whole * 8 + j] = b8[j]
        if rest:
            bt[whole * 8 + full] = b8[full] & ((0xFF << (8 - rest)) & 0xFF)


@jit
def sign_decode(scales, bits, out, accumulate, lo, hi, table):
    sc, bt, o = scales[lo // 64:], bits[lo // 8:], out[lo:hi]
    whole = (hi - lo) // 8
    for j in range(whole):
        s = sc[j // 8]
        row = table[bt[j]]
        if accumulate:
            for t in range(8):
                o[8 * j + t] += row[t] * s
        else:
            for t in range(8):
                o[8 * j + t] = row[t] * s
    for i in range(whole * 8, hi - lo):  # the values of a last, partial byte
        v = table[bt[i // 8], i % 8] * sc[i // 64]
        o[i] = o[i] + v if accumulate else v


@inline
def five_digits(d0, d1, d2, d3, d4):
    """The byte of five base-3 digits (0, 1 or 2), the first the lowest."""
    return (((d4 * 3 + d3) * 3 + d2) * 3 + d1) * 3 + d0


#: the blocks `ternary_blocks` takes through each pass together: a block's two sums and
#: divisions wait on each other, and those of four blocks run side by side
TERNARY_GROUP = 4


@jit
def rescaled_magnitudes(a, at):
    """The largest m of the magnitudes a[at:at + 128] (no NaN), after dividing them by
    it where m is finite."""
    m = _ZERO
    for i in range(128):
        m = max(m, a[at + i])
    if m < _INF:
        for i in range(128):
            a[at + i] = a[at + i] / m
    return m


@jit
def ternary_blocks(g, r, scales, codes, blocks, count, lanes):
    """`blocks` blocks of 128 values from g and r: r += g; a value is sent when its
    magnitude exceeds 0.7 times the block's mean magnitude; the block's scale (scales[b])
    is the mean magnitude of those sent; codes five to a byte (codes[26 b:26 b + 26]);
    r -= the values sent. A block of finite values whose magnitudes sum to inf takes
    them divided by the largest, m (`rescaled_magnitudes`), its scale then multiplied by
    m. A block with an inf or NaN sends its values as +NaN (code 1, the scale NaN):
    r = r + g - NaN. The last block has `count` real values (zeros after them), the
    others 128.

    The blocks go through each pass TERNARY_GROUP at a time, and the arrays must hold
    whole groups (the caller pads the last). One function rather than a call per block:
    Numba counts the references of each array an inlined function takes, which cost a
    fifth of the encoder's time at every block. The digits are found in the pass that
    moves the residual on, from the magnitudes left after the threshold, which keeps the
    threshold's pass free of byte stores (it then runs on vectors)."""
    e = np.empty(TERNARY_GROUP * 128, np.float32)
    a = np.empty(TERNARY_GROUP * 128, np.float32)
    y = np.empty(8, np.float32)
    threshold = np.empty(TERNARY_GROUP, np.float32)
    unit = np.empty(TERNARY_GROUP, np.float32)
    sent = np.empty(TERNARY_GROUP, np.int32)
    s = np.empty(TERNARY_GROUP, np.float32)
    # (the last byte of each block's codes has two digits past 128, which stay 0)
    d = np.zeros(TERNARY_GROUP * 130, np.uint8)
    for p in range((blocks + TERNARY_GROUP - 1) // TERNARY_GROUP):
        first = p * TERNARY_GROUP
        at = first * 128
        for i in range(TERNARY_GROUP * 128):
            v = r[at + i] + g[at + i]
            e[i] = v
            a[i] = abs(v)
        for k in range(TERNARY_GROUP):
            real = count if first + k == blocks - 1 else 128
            total = halves_128(a, k * 128, y, lanes)
            unit[k] = _ONE  # (m, far above 1, for a block rescaled)
            if total == _INF:
                m = rescaled_magnitudes(a, k * 128)
                if m < _INF:  # finite magnitudes, now over m (an inf: poisoned below)
                    unit[k] = m
                    total = halves_128(a, k * 128, y, lanes)
            threshold[k] = total / _F32(real) * _SEVEN_TENTHS
        for k in range(TERNARY_GROUP):
            t = threshold[k]
            chosen = 0
            for i in range(128):
                over = a[k * 128 + i] > t  # never when t or the value is NaN
                a[k * 128 + i] = a[k * 128 + i] if over else _ZERO
                chosen += np.int32(over)
            sent[k] = chosen
        for k in range(TERNARY_GROUP):
            s[k] = halves_128(a, k * 128, y, lanes) / _F32(sent[k]) if sent[k] else _ZERO
            if unit[k] != _ONE:
                s[k] = s[k] * unit[k]
        for k in range(TERNARY_GROUP):
            sk = s[k]
            minus = _F32(-1) * sk
            for i in range(128):  # (a value sent has a magnitude above 0: threshold >= 0)
                on = a[k * 128 + i] != _ZERO
                negative = e[k * 128 + i] < _ZERO
                d[k * 130 + i] = np.uint8(on) + np.uint8(on and negative)
                r[at + k * 128 + i] = e[k * 128 + i] - (
                    _ZERO if not on else (minus if negative else sk))
        for k in range(TERNARY_GROUP):  # a block with an inf or NaN crosses as NaN
            if not np.isfinite(threshold[k]):
                s[k] = _NAN
                real = count if first + k == blocks - 1 else 128
                for i in range(128):
                    d[k * 130 + i] = np.uint8(i < real)
                    r[at + k * 128 + i] = e[k * 128 + i] - _NAN
        byte = first * _TERNARY_CODE_BYTES
        for j in range(TERNARY_GROUP * _TERNARY_CODE_BYTES):
            q = 5 * j
            codes[byte + j] = five_digits(d[q], d[q + 1], d[q + 2], d[q + 3], d[q + 4])
        for k in range(TERNARY_GROUP):
            scales[first + k] = s[k]


@jit
def ternary_encode(grad, residual, scales, codes, lo, hi, lanes):
    """`ternary_blocks` over [lo, hi): whole groups of blocks in place, then what is
    left (fewer than TERNARY_GROUP blocks, the last of them maybe short) through padded
    copies."""
    g, r = grad[lo:hi], residual[lo:hi]
    sc, cd = scales[lo // 128:], codes[lo // 128 * _TERNARY_CODE_BYTES:]
    n = hi - lo
    grouped = n // (128 * TERNARY_GROUP) * TERNARY_GROUP  # blocks in whole groups
    ternary_blocks(g, r, sc, cd, grouped, 128, lanes)
    rest = n - grouped * 128
    if rest:
        blocks = (rest + 127) // 128
        g_pad = np.zeros(TERNARY_GROUP * 128, np.float32)
        r_pad = np.zeros(TERNARY_GROUP * 128, np.float32)
        sc_pad = np.empty(TERNARY_GROUP, np.float32)
        cd_pad = np.empty(TERNARY_GROUP * _TERNARY_CODE_BYTES, np.uint8)
        at = grouped * 128
        for i in range(rest):  # (loops: slice assignments take Numba 2-4 s more to compile)
            g_pad[i] = g[at + i]
            r_pad[i] = r[at + i]
        ternary_blocks(g_pad, r_pad, sc_pad, cd_pad, blocks, rest - (blocks - 1) * 128, lanes)
        for i in range(rest):
            r[at + i] = r_pad[i]
        for k in range(blocks):
            sc[grouped + k] = sc_pad[k]
        byte = grouped * _TERNARY_CODE_BYTES
        for j in range(blocks * _TERNARY_CODE_BYTES):
            cd[byte + j] = cd_pad[j]


@inline
def ternary_value(row, t, s):
    """Digit t of a decoded byte (`row`: 0, +1 or -1) times the scale; 0 for 0 whatever
    the scale (0 * inf would be NaN)."""
    return _ZERO if row[t] == _ZERO else row[t] * s


@inline
def put_or_add(o, i, v, accumulate):
    """o[i] = v, or o[i] += v when `accumulate`."""
    if accumulate:
        o[i] += v
    else:
        o[i] = v


@jit
def ternary_decode(scales, codes, out, accumulate, lo, hi, table):
    sc, cd, o = scales[lo // 128:], codes[lo // 128 * _TERNARY_CODE_BYTES:], out[lo:hi]
    n = hi - lo
    whole = n // 128
    for b in range(whole):  # whole blocks: 25 bytes of five values and one of three
        s = sc[b]
        ob = o[b * 128:b * 128 + 128]
        cb = cd[b * _TERNARY_CODE_BYTES:(b + 1) * _TERNARY_CODE_BYTES]
        for j in range(25):
            row = table[cb[j]]
            for t in range(5):
                put_or_add(ob, 5 * j + t, ternary_value(row, t, s), accumulate)
        row = table[cb[25]]
        for t in range(3):
            put_or_add(ob, 125 + t, ternary_value(row, t, s), accumulate)
    if whole * 128 < n:  # a last, short block
        s = sc[whole]
        for j in range(_TERNARY_CODE_BYTES):
            row = table[cd[whole * _TERNARY_CODE_BYTES + j]]
            for t in range(5):
                i = whole * 128 + 5 * j + t
                if i < n:
                    put_or_add(o, i, ternary_value(row, t, s), accumulate)


# --------------------------------------------------------------- 2-bit and 1-bit
@jit
def two_bit_encode(grad, residual, t, out, lo, hi):
    """MXNet's 2-bit rule over [lo, hi) (lo a multiple of 4): r += g; r >= t sends +t
    (code 0b11) and r -= t, r <= -t sends -t (0b10) and r += t, else 0 (0b00); four codes
    to a byte, the first value in the high bits. The last byte's missing values are 0."""
    g, r, o = grad[lo:hi], residual[lo:hi], out[lo // 4:]
    c = np.empty(64, np.uint8)
    n = hi - lo
    minus_t = -t
    for b in range((n + 63) // 64):
        at = b * 64
        k = min(64, n - at)
        for i in range(64):  # (a loop of 64 with a test vectorises; one of k does not)
            if i < k:
                v = r[at + i] + g[at + i]
                up, down = v >= t, v <= minus_t
                r[at + i] = v - t if up else (v + t if down else v)
                c[i] = 3 if up else (2 if down else 0)
            else:
                c[i] = 0
        for j in range((k + 3) // 4):
            q = 4 * j
            o[at // 4 + j] = (c[q] << 6) | (c[q + 1] << 4) | (c[q + 2] << 2) | c[q + 3]


@jit
def one_bit_encode(grad, residual, t, out, lo, hi):
    """The 1-bit rule over [lo, hi) (lo a multiple of 8): r += g; r > t sets the bit and
    r -= 1, else r += 1; eight bits to a byte, the first value the most significant. The
    last byte's missing values are 0."""
    g, r, o = grad[lo:hi], residual[lo:hi], out[lo // 8:]
    c = np.empty(64, np.uint8)
    n = hi - lo
    for b in range((n + 63) // 64):
        at = b * 64
        k = min(64, n - at)
        for i in range(64):
            if i < k:
                v = r[at + i] + g[at + i]
                up = v > t
                r[at + i] = v - _ONE if up else v + _ONE
                c[i] = 1 if up else 0
            else:
                c[i] = 0
        for j in range((k + 7) // 8):
            q = 8 * j
            o[at // 8 + j] = ((c[q] << 7) | (c[q + 1] << 6) | (c[q + 2] << 5) | (c[q + 3] << 4)
                              | (c[q + 4] << 3) | (c[q + 5] << 2) | (c[q + 6] << 1) | c[q + 7])


@inline
def table_decode(table, payload, out, accumulate, lo, hi, per_byte):
    """out[lo:hi] = the rows of `table` (256 x per_byte float32) that payload's bytes
    pick, the first value of a byte its first column, or added to out."""
    p, o = payload[lo // per_byte:], out[lo:hi]
    n = hi - lo
    whole = n // per_byte
    for j in range(whole):
        row = table[p[j]]
        at = per_byte * j
        if accumulate:
            for t in range(per_byte):
                o[at + t] += row[t]
        else:
            for t in range(per_byte):
                o[at + t] = row[t]
    for i in range(whole * per_byte, n):  # the values of a last, partial byte
        v = table[p[whole], i - whole * per_byte]
        o[i] = o[i] + v if accumulate else v


@jit
def two_bit_decode(table, payload, out, accumulate, lo, hi):
    table_decode(table, payload, out, accumulate, lo, hi, 4)


@jit
def one_bit_decode(table, payload, out, accumulate, lo, hi):
    table_decode(table, payload, out, accumulate, lo, hi, 8)


# ------------------------------------------------------------------------- fp16
# values per pass of the float16 casts: their three scratch arrays stay in L1 (host_jit.CHUNK)
_CHUNK = 1024
_TWO_112 = _F32(2.0 ** 112)
_U32 = np.uint32


@inline
def scaled_chunk(xs, at, k, scale, y):
    """y[:k] = xs[at:at + k] / scale (`scale` 1: copied), the casts' float32 input."""
    if scale != 1:
        for i in range(k):
            y[i] = xs[at + i] / scale
    else:
        for i in range(k):
            y[i] = xs[at + i]


@inline
def write_widened(wide, k, widen, scale, o, at, accumulate):
    """o[at:at + k] = wide[:k] * widen (`widen` 1: no product) * scale (`scale` 1: no
    product), or added to it: the decoders' last step, NumPy's order of operations."""
    for i in range(k):
        f = wide[i] * widen if widen != 1 else wide[i]
        if scale != 1:
            f = f * scale
        o[at + i] = o[at + i] + f if accumulate else f


@inline
def fp16_bits(x):
    """(|x|'s float32 bits, the float16 bits of float32 x): see fp16_encode."""
    u = np.float32(x).view(np.uint32)
    v = u & _U32(0x7FFFFFFF)
    a = _U32(min(v, _U32(0x47800000)))
    m = _U32(max(a & _U32(0x7F800000), _U32(0x38800000)) + _U32(13 << 23))
    rounded = np.float32(a.view(np.float32) + m.view(np.float32)).view(np.uint32)
    h = _U32(_U32(rounded - m) + (m >> _U32(13)))
    return v, np.uint16(((u >> _U32(16)) & _U32(0x8000)) + _U32(0x0800) + h)


@jit
def fp16_encode(x, scale, out, lo, hi):
    """out[lo:hi] = the float16 bits (uint16) of x[lo:hi] / scale (`scale` 1: x itself),
    rounded to nearest even, inf past float16's range, as NumPy's astype. Returns -1, or
    the index where a chunk with a NaN starts, the last written (the caller has NumPy
    cast that chunk again, keeping a NaN's payload as it does).

    The rounding is the NumPy twin's (host_codecs._cast_fp16_range): for a = |x| (at
    most 65536) with exponent e >= -14, M = 2**(e+13) has float16's ulp at a, so the
    float32 sum a + M rounds a to float16's grid, ties to even; its bits minus M's are
    the significand, and M's bits >> 13 add the exponent (plus 0x1F800, taken off with
    the sign)."""
    xs, o = x[lo:hi], out[lo:hi]
    n = hi - lo
    for c in range((n + _CHUNK - 1) // _CHUNK):
        at = c * _CHUNK
        k = min(_CHUNK, n - at)
        xc, oc = xs[at:at + k], o[at:at + k]
        top = _U32(0)
        if scale != 1:
            for i in range(k):
                v, h = fp16_bits(xc[i] / scale)
                top = max(top, v)
                oc[i] = h
        else:
            for i in range(k):
                v, h = fp16_bits(xc[i])
                top = max(top, v)
                oc[i] = h
        if top > _U32(0x7F800000):
            return lo + at
    return -1


@inline
def fp16_shifted(v):
    """Float16 bits `v` (a uint32) as float32 bits: its sign in bit 31, the rest 13 bits
    up, which is the float32 of v / 2**112 for a finite v (subnormals too)."""
    return _U32(((v & _U32(0x8000)) << _U32(16)) | ((v & _U32(0x7FFF)) << _U32(13)))


@jit
def fp16_decode(half, scale, out, accumulate, lo, hi):
    """out[lo:hi] = float32(half[lo:hi] as float16 bits) * scale (`scale` 1: no
    product), or added to it, as NumPy's cast and ufuncs give it. Returns -1, or the index
    where a chunk with an inf or NaN starts, written no further (NumPy decodes that
    chunk)."""
    hs, o = half[lo:hi], out[lo:hi]
    w = np.empty(_CHUNK, np.uint32)
    wf = w.view(np.float32)
    n = hi - lo
    for c in range((n + _CHUNK - 1) // _CHUNK):
        at = c * _CHUNK
        k = min(_CHUNK, n - at)
        top = _U32(0)
        for i in range(k):
            v = _U32(hs[at + i])
            top = max(top, v & _U32(0x7FFF))
            w[i] = fp16_shifted(v)
        if top >= _U32(0x7C00):
            return lo + at
        write_widened(wf, k, _TWO_112, scale, o, at, accumulate)  # exact, subnormals too
    return -1


@inline
def widened_fp16(v):
    """The float32 of float16 bits `v` (a uint32, not an inf or NaN): exact."""
    return fp16_shifted(v).view(np.float32) * _TWO_112


@jit
def fp16_sum_two(a, b, out, lo, hi):
    """out[lo:hi] = float32(a) + float32(b) for float16 bits (uint16) a and b, as NumPy's
    add with dtype=float32. Returns -1, or the index where a chunk with an inf or NaN in
    a or b starts, the last written (the caller has NumPy sum that chunk again, keeping
    NaNs as it does)."""
    o, xa, xb = out[lo:hi], a[lo:hi], b[lo:hi]
    n = hi - lo
    for c in range((n + _CHUNK - 1) // _CHUNK):
        at = c * _CHUNK
        k = min(_CHUNK, n - at)
        ca, cb, oc = xa[at:at + k], xb[at:at + k], o[at:at + k]
        top = _U32(0)
        for i in range(k):
            va, vb = _U32(ca[i]), _U32(cb[i])
            top = max(top, max(va & _U32(0x7FFF), vb & _U32(0x7FFF)))
            oc[i] = widened_fp16(va) + widened_fp16(vb)
        if top >= _U32(0x7C00):
            return lo + at
    return -1


# ------------------------------------------------------------------------- bf16
@jit
def bf16_encode(x, scale, out, lo, hi):
    """out[lo:hi] = the bfloat16 bits (uint16) of x[lo:hi] / scale (`scale` 1: x itself),
    rounded to nearest even; a NaN keeps its top bits, quieted (host_codecs.bf16_bits)."""
    xs, o = x[lo:hi], out[lo:hi]
    y = np.empty(_CHUNK, np.float32)
    yu = y.view(np.uint32)
    n = hi - lo
    for c in range((n + _CHUNK - 1) // _CHUNK):
        at = c * _CHUNK
        k = min(_CHUNK, n - at)
        scaled_chunk(xs, at, k, scale, y)
        for i in range(k):
            u = yu[i]
            rounded = (u + _U32(0x7FFF) + ((u >> _U32(16)) & _U32(1))) >> _U32(16)
            nan = (u & _U32(0x7FFFFFFF)) > _U32(0x7F800000)
            o[at + i] = np.uint16(((u >> _U32(16)) | _U32(0x0040)) if nan else rounded)


@jit
def bf16_decode(half, scale, out, accumulate, lo, hi):
    """out[lo:hi] = float32(half[lo:hi] as bfloat16 bits) * scale (`scale` 1: no product),
    or added to it. Returns -1, or the index where a chunk with a NaN starts, written no
    further (NumPy decodes that chunk: which of two NaNs an add keeps is its choice)."""
    hs, o = half[lo:hi], out[lo:hi]
    w = np.empty(_CHUNK, np.uint32)
    wf = w.view(np.float32)
    n = hi - lo
    for c in range((n + _CHUNK - 1) // _CHUNK):
        at = c * _CHUNK
        k = min(_CHUNK, n - at)
        top = _U32(0)
        for i in range(k):
            v = _U32(hs[at + i])
            top = max(top, v & _U32(0x7FFF))
            w[i] = v << _U32(16)
        if top > _U32(0x7F80):
            return lo + at
        write_widened(wf, k, _F32(1), scale, o, at, accumulate)
    return -1


# ------------------------------------------------------------------------ low rank
@jit
def low_rank_product(p, qt, out):
    """out = P Q^T (`qt` is Q^T, rank x cols) as rank-one terms added in order, each
    product and sum a float32 rounding of its own (no fused multiply-add): the bits of
    powersgd.decode's whole-array products and adds, one row at a time (it stays in L1)."""
    rows, rank = p.shape
    cols = qt.shape[1]
    for i in range(rows):
        o = out[i]
        first = p[i, 0]
        for j in range(cols):
            o[j] = first * qt[0, j]
        for k in range(1, rank):
            factor = p[i, k]
            for j in range(cols):
                o[j] = o[j] + factor * qt[k, j]

"""What the host's blockwise NumPy code shares (the codecs' twins in `host_codecs`, the
sums in `host_sum`): the block length, when vector code takes the thread pool, and the
float16 widening both use. A leaf: it imports nothing of gpukv."""
from __future__ import annotations

import numpy as np

# Elements per block of the NumPy twins: the temporaries of one block stay in L2 (1 MiB
# per core here), and each of a block's dozen ufunc calls costs about 0.3 us of Python
# whatever its length, which 2**15 elements made a third of the 2-bit encoder's time.
BLOCK = 1 << 16  # a multiple of 32, so blocks start on word boundaries of both layouts
POOL_MIN = 3  # vector code runs on the host thread pool only when it has this many threads

_I32, _F32 = np.int32, np.float32


def widen_fp16(half, out) -> None:
    """out[...] = half (float16, or its bits as uint16) as float32, as NumPy's astype
    but without its per-element loop: the bits widened as int16 (the sign in bit 31),
    shifted to a float32's significand, the sign's copies cleared, times 2**112 (exact,
    subnormals included). 1-D contiguous arrays of one length. One with an inf or NaN
    (int16 >= 0x7C00, or uint16 >= 0xFC00) takes NumPy's cast, which keeps NaN payloads."""
    bits = half.view(np.int16)
    if bits.max() >= 0x7C00 or bits.view(np.uint16).max() >= 0xFC00:
        np.copyto(out, half.view(np.float16))
        return
    f = out.view(_I32)
    np.copyto(f, bits)
    np.left_shift(f, _I32(13), out=f)
    np.bitwise_and(f, _I32(-0x70000001), out=f)  # 0x8FFFFFFF: sign | bits << 13
    np.multiply(out, _F32(2.0 ** 112), out=out)

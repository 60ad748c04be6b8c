"""The host's codecs compiled by Numba when it is installed (`host_jit_kernels`): the
2-bit, 1-bit, sign and ternary encoders and decoders, the float16 and bfloat16 casts, the
float16 sums of `host_sum` and PowerSGD's decoding; one pass over each block of values
where the NumPy twins (`host_codecs`, `host_sum`, `powersgd.decode`) make several, with
the same bytes and residuals, NaNs included (the tests hold both to the same rules).

`host_codecs` and `host_sum` call these when `enabled()`: Numba imports (the `fast`
extra; the test extra installs it too) and `GPUKV_HOST_JIT` is not '0'. Numba is
imported on the first call, not with gpukv."""
from __future__ import annotations

import atexit
import functools
import logging
import shutil
import tempfile

import numpy as np

from .._env import flag

log = logging.getLogger("gpukv")
ENV = "GPUKV_HOST_JIT"
#: values per pass of the float16 casts: one with an inf or NaN is left to NumPy
CHUNK = 1024
_F32 = np.float32


def check_setting() -> None:
    """ArgumentError for a malformed GPUKV_HOST_JIT (anything but '0', '1' or unset)."""
    flag(ENV)


def enabled() -> bool:
    """Whether the compiled codecs run: Numba is installed and GPUKV_HOST_JIT is not '0'
    (a malformed value is an ArgumentError)."""
    if flag(ENV) is False:
        return False
    return _kernels() is not None


@functools.lru_cache(maxsize=1)
def _kernels():
    """The compiled functions' module, or None without Numba."""
    try:
        from . import host_jit_kernels
    except ImportError:
        return None
    except RuntimeError as exc:  # Numba finds no folder to cache compiled code in
        return _kernels_cached_apart(exc)
    return host_jit_kernels


def _kernels_cached_apart(exc: RuntimeError):
    """Numba caches compiled code beside the module or under the home folder, and refuses
    to compile at all where it can write in neither (an installed package run by another
    user whose home is not writable). Cache in a folder of this process's own then
    (compiled anew in each process), or, failing that, run the NumPy twins."""
    from numba.core import config  # (read when each function is compiled)
    try:
        folder = tempfile.mkdtemp(prefix="gpukv-numba-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        config.CACHE_DIR = folder  # type: ignore[attr-defined]  # (set from the environment)
        from . import host_jit_kernels
    except (OSError, RuntimeError) as again:
        log.warning("gpukv: Numba cannot cache the host's compiled codecs (%s): they run "
                    "as NumPy, slower; set NUMBA_CACHE_DIR to a writable folder", again)
        return None
    log.info("gpukv: Numba cannot cache in gpukv's folder or the home folder (%s): it "
             "compiles the host's codecs in each process, into %s; set NUMBA_CACHE_DIR to "
             "a writable folder to keep them", exc, folder)
    return host_jit_kernels


def with_twin(kernel, twin):
    """fn(*args, lo, hi): the compiled `kernel` over [lo, hi); a chunk it stops at (it
    returns where one with an inf or NaN starts) goes to the NumPy `twin`, which keeps
    NaNs as NumPy does, and the kernel goes on after it."""
    def run(*args):
        *rest, lo, hi = args
        while lo < hi:
            stopped = kernel(*rest, lo, hi)
            if stopped < 0:
                return
            lo = min(stopped + CHUNK, hi)
            twin(*rest, stopped, lo)
    return run


def two_bit_encode(grad, residual, t, out, lo, hi):
    _kernels().two_bit_encode(grad, residual, t, out, lo, hi)


def one_bit_encode(grad, residual, t, out, lo, hi):
    _kernels().one_bit_encode(grad, residual, t, out, lo, hi)


def two_bit_decode(table, payload, out, accumulate, lo, hi):
    _kernels().two_bit_decode(table, payload, out, accumulate, lo, hi)


def one_bit_decode(table, payload, out, accumulate, lo, hi):
    _kernels().one_bit_decode(table, payload, out, accumulate, lo, hi)


def sign_encode(grad, residual, scales, bits, lo, hi):
    k = _kernels()
    k.sign_encode(grad, residual, scales, bits, lo, hi, k.PLUS_MINUS, k.LANES)


def sign_decode(scales, bits, out, accumulate, lo, hi):
    k = _kernels()
    k.sign_decode(scales, bits, out, accumulate, lo, hi, k.SIGN_TABLE)


def ternary_encode(grad, residual, scales, codes, lo, hi):
    k = _kernels()
    k.ternary_encode(grad, residual, scales, codes, lo, hi, k.LANES)


def ternary_decode(scales, codes, out, accumulate, lo, hi):
    k = _kernels()
    k.ternary_decode(scales, codes, out, accumulate, lo, hi, k.TERNARY_TABLE)


def _factor(scale):
    """The casts' scale as the kernels take it: None (no scaling) is 1."""
    return _F32(1) if scale is None else scale


def fp16_encode(x, scale, out, lo, hi) -> int:
    """out[lo:hi] (float16) = x[lo:hi] / scale (None: 1); -1, or where the CHUNK with a
    NaN that stopped it starts."""
    return _kernels().fp16_encode(x, _factor(scale), out.view(np.uint16), lo, hi)


def fp16_decode(half, scale, out, accumulate, lo, hi) -> int:
    """out[lo:hi] = half[lo:hi] (uint16 bits of float16) * scale (None: 1), or added;
    -1, or where the CHUNK with an inf or NaN that stopped it starts."""
    return _kernels().fp16_decode(half, _factor(scale), out, accumulate, lo, hi)


def fp16_sum_two(a, b, out, lo, hi) -> int:
    """out[lo:hi] = float32(a) + float32(b), a and b float16; -1, or where the CHUNK with
    an inf or NaN that stopped it starts (written, for NumPy to write again)."""
    return _kernels().fp16_sum_two(a.view(np.uint16), b.view(np.uint16), out, lo, hi)


def bf16_encode(x, scale, out, lo, hi) -> None:
    """out[lo:hi] (bfloat16 bits, uint16) = x[lo:hi] / scale (None: 1)."""
    _kernels().bf16_encode(x, _factor(scale), out, lo, hi)


def bf16_decode(half, scale, out, accumulate, lo, hi) -> int:
    """out[lo:hi] = half[lo:hi] (uint16 bits of bfloat16) * scale (None: 1), or added;
    -1, or where the CHUNK with a NaN that stopped it starts."""
    return _kernels().bf16_decode(half, _factor(scale), out, accumulate, lo, hi)


def low_rank_product(p, q, out) -> None:
    """out (rows x cols, float32) = P Q^T as rank-one terms added in order (powersgd)."""
    _kernels().low_rank_product(p, np.ascontiguousarray(q.T), out)

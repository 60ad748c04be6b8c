"""Flush-to-zero for CuPy's built-in kernels: float32 subnormals become (signed) zeros.

CuPy compiles its elementwise kernels, as every kernel, with -ftz=true
(`_compile_with_cache_cuda` in cupy/cuda/compiler.py), so every float32 arithmetic
instruction, comparison and conversion to or from float64 reads a subnormal operand as zero
and writes a subnormal result as zero (`add.ftz.f32`, `setp.gt.ftz.f32`,
`cvt.ftz.f64.f32`, `cvt.rn.ftz.f32.f64`); moves do not (a copy, `copysign`, bit views).
The emulated ufuncs and casts run NumPy on the host, so they flush around it: `inputs`
before, `outputs` after. float64 arithmetic keeps its subnormals, as on a GPU.
"""
from __future__ import annotations

import numpy as np

_F32 = np.dtype(np.float32)
_EXPONENT, _SIGN = np.uint32(0x7F800000), np.uint32(0x80000000)
_TINY = np.float32(np.finfo(np.float32).tiny)

#: ufuncs whose CUDA code moves bits rather than computing: no flush on a GPU
UNFLUSHED_UFUNCS = frozenset(["copysign"])


def _subnormal(bits: np.ndarray) -> np.ndarray:
    return ((bits & _EXPONENT) == 0) & ((bits & ~(_EXPONENT | _SIGN)) != 0)


def flush_in_place(view: np.ndarray) -> None:
    """Zero (keeping the sign) the float32 subnormals of `view`, a float32 array."""
    bits = view.view(np.uint32)
    mask = _subnormal(bits)
    if mask.any():
        bits[mask] &= _SIGN


def inputs(x):
    """An operand (or nested list/tuple of operands) as a GPU reads it: float32 arrays and
    scalars with their subnormals zeroed (arrays copied only when they hold one)."""
    if isinstance(x, np.ndarray):
        if x.dtype != _F32 or not x.size:
            return x
        mask = _subnormal(x.view(np.uint32))
        if not mask.any():
            return x
        return np.where(mask, np.copysign(np.float32(0), x), x)
    if isinstance(x, np.float32):
        return np.copysign(np.float32(0), x) if abs(x) < _TINY else x
    if isinstance(x, (list, tuple)):
        return type(x)(inputs(v) for v in x)
    return x


def outputs(x):
    """`x` (a result: array, scalar, or nested tuple/list of them) with its float32
    subnormals zeroed: arrays in place, scalars replaced."""
    if isinstance(x, np.ndarray):
        if x.dtype == _F32 and x.size:
            flush_in_place(x)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(outputs(v) for v in x)
    return inputs(x)  # a scalar


def cast_flushes(source: np.dtype, target: np.dtype) -> bool:
    """Whether CuPy's astype from `source` to `target` flushes float32 subnormals: the
    float32 <-> float64 conversions do (cvt.ftz); float16 has no such values to give, and
    a float32 copy is a move."""
    return {np.dtype(source).name, np.dtype(target).name} == {"float32", "float64"}

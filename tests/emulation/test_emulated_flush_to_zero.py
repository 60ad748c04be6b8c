"""Flush-to-zero in the emulation, where CuPy's -ftz=true has a GPU flush: float32
subnormals read or produced by gpukv's kernels and by CuPy's elementwise built-ins and
float32 <-> float64 casts are (signed) zeros; copies, bit views, copysign and explicit PTX
without .ftz keep them."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv.device.cuda import kernels as _kernels

from .. import gpu_env
from .support import device, kernels

F32 = np.float32
TINY = np.finfo(F32).tiny  # 2**-126: below it, a float32 is subnormal


def _bits(a) -> list:
    return np.asarray(a, F32).view(np.uint32).tolist()


def _run_sum(out_values, term_values) -> np.ndarray:
    """out += term through gpukv's float32 sum kernel in the emulation; the new out."""
    name, source = _kernels.sum_source(np.dtype(F32), np.dtype(F32))
    kernel = kernels.RawKernel(source, name, options=_kernels.COMPILE_OPTIONS)
    out, term = device(np.array(out_values, F32)), device(np.array(term_values, F32))
    n = out.size
    table, blocks = _kernels.build_table([out.data.ptr], [n], [[term.data.ptr]],
                                         [[out.data.ptr]], max_blocks=1)
    kernel((blocks,), (_kernels.THREADS,), (device(table), np.int32(1)))
    return out.host


@pytest.mark.parametrize("out, term, want", [
    ([0.0], [1e-40], [0.0]),            # a subnormal operand reads as zero
    ([1.0], [-1e-40], [1.0]),
    ([-1e-40], [-0.0], [-0.0]),         # ... keeping its sign
    ([1.5e-38], [-1.4e-38], [0.0]),     # a subnormal result of normal operands is zero
    ([3e-38], [-1e-38], [3e-38]),       # (1e-38 is subnormal itself)
    ([TINY], [TINY], [2 * TINY]),       # the smallest normal number is kept
], ids=["operand", "operand-beside-one", "sign", "result", "mixed", "smallest-normal"])
def test_project_kernel_flushes_float32_subnormals(out, term, want):
    """gpukv's float32 sum kernel, run by the emulation, reads and writes float32
    subnormals as signed zeros, as on a GPU (CuPy compiles it with -ftz=true)."""
    assert _bits(_run_sum(out, term)) == _bits(want)


_CONVERSIONS = r"""
extern "C" __global__ void convert(const double* wide, const float* narrow, float* narrowed,
                                   float* narrowed_cast, double* widened,
                                   double* widened_cast, unsigned short* half,
                                   long long n) {
    const long long i = threadIdx.x;
    if (i >= n) return;
    const double w = wide[i];
    const float x = narrow[i];
    float f; double d; unsigned short h;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(w));
    narrowed[i] = f;
    narrowed_cast[i] = (float)w;  /* after the PTX: the launch's flush is back */
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(x));
    widened[i] = d;
    widened_cast[i] = (double)x;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(w));
    half[i] = h;
}
"""


def test_explicit_ptx_conversions_keep_subnormals_and_c_casts_flush():
    """cvt.rn.f32.f64, cvt.f64.f32 and cvt.rn.f16.f64 (PTX without .ftz) give NumPy's
    casts, float32 subnormals kept, in a launch that flushes; the C casts beside them
    flush (-ftz=true makes them cvt.rn.ftz.f32.f64 and cvt.ftz.f64.f32)."""
    wide = np.array([1e-40, -3e-39, 2.0 ** -149, -(2.0 ** -150) * 1.5, 2.5,
                     1 + 2.0 ** -11 + 2.0 ** -40, 2.0 ** -25 * (1 + 2.0 ** -52), 1e-300])
    narrow = wide.astype(F32)
    n = wide.size
    outs = [device(np.zeros(n, d)) for d in (F32, F32, np.float64, np.float64, np.uint16)]
    kernel = kernels.RawKernel(_CONVERSIONS, "convert", options=_kernels.COMPILE_OPTIONS)
    kernel((1,), (32,), (device(wide), device(narrow), *outs, np.int64(n)))
    narrowed, narrowed_cast, widened, widened_cast, half = (o.host for o in outs)
    tiny = np.abs(narrow) < TINY
    assert _bits(narrowed) == _bits(narrow) and tiny.sum() == 5
    assert _bits(narrowed_cast) == _bits(np.where(tiny, np.copysign(F32(0), narrow), narrow))
    assert widened.tobytes() == narrow.astype(np.float64).tobytes()
    assert widened_cast.tobytes() == \
        np.where(tiny, np.copysign(0.0, narrow), narrow).astype(np.float64).tobytes()
    assert half.tolist() == wide.astype(np.float16).view(np.uint16).tolist()
    assert half[5:7].tolist() == [0x3C01, 0x0001]  # rounded once: not 0x3C00, 0x0000


def test_launch_restores_the_callers_float_mode():
    """After a flushing launch, host (NumPy) arithmetic keeps its subnormals again."""
    _run_sum([0.0], [1e-40])
    assert np.array([1e-40], F32)[0] * F32(1) != 0


# ------------------------------------------------------------ CuPy's built-ins
needs_emulated_cupy = pytest.mark.skipif(not gpu_env.EMULATED,
                                         reason="tests of the CUDA emulation")


@pytest.fixture
def cp():
    import cupy
    return cupy


SUB = np.array([1e-40, -1e-40, 2.5, -3e-39], F32)


@needs_emulated_cupy
@pytest.mark.parametrize("operation, want", [
    (lambda cp, a: a + cp.float32(0), [0.0, 0.0, 2.5, 0.0]),  # -0 + 0 is +0
    (lambda cp, a: cp.add(a, a), [0.0, -0.0, 5.0, -0.0]),
    (lambda cp, a: a * cp.float32(1e30), [0.0, -0.0, 2.5e30, -0.0]),
    (lambda cp, a: cp.float32(1e-20) * cp.full(4, 1e-20, cp.float32), [0.0] * 4),
    (lambda cp, a: -a, [-0.0, 0.0, -2.5, 0.0]),
    (lambda cp, a: abs(a), [0.0, 0.0, 2.5, 0.0]),
    (lambda cp, a: cp.maximum(a, cp.float32(-1)), [0.0, -0.0, 2.5, -0.0]),
    (lambda cp, a: np.multiply(a, cp.float32(2)), [0.0, -0.0, 5.0, -0.0]),
], ids=["add-scalar", "add", "multiply", "subnormal-result", "negative", "abs", "maximum",
        "numpy-ufunc"])
def test_elementwise_builtins_flush_float32_subnormals(cp, operation, want):
    """CuPy's elementwise arithmetic on float32 reads and writes subnormals as zeros."""
    got = operation(cp, cp.asarray(SUB)).get()
    assert got.dtype == F32 and _bits(got) == _bits(want)


@needs_emulated_cupy
def test_comparisons_see_subnormals_as_zero(cp):
    """A float32 subnormal compares equal to zero on the GPU (setp.ftz)."""
    a = cp.asarray(SUB)
    assert (a > 0).get().tolist() == [False, False, True, False]
    assert (a == 0).get().tolist() == [True, True, False, True]


@needs_emulated_cupy
def test_in_place_arithmetic_flushes(cp):
    """`a *= 1` on float32 leaves no subnormal in `a`."""
    a = cp.asarray(SUB)
    a *= cp.float32(1)
    assert _bits(a.get()) == _bits([0.0, -0.0, 2.5, -0.0])


@needs_emulated_cupy
@pytest.mark.parametrize("source, target, want", [
    (F32, np.float64, [0.0, -0.0, 2.5, -0.0]),         # cvt.ftz.f64.f32
    (np.float64, F32, [0.0, -0.0, 2.5, -0.0]),         # cvt.rn.ftz.f32.f64
    (F32, np.float16, [0.0, -0.0, 2.5, -0.0]),         # no float16 value that small
])
def test_float_casts_flush(cp, source, target, want):
    """astype between float32 and float64 flushes float32 subnormals, as CuPy's cast."""
    got = cp.asarray(SUB.astype(source)).astype(target).get()
    assert got.dtype == target
    assert got.astype(np.float64).tolist() == want
    assert np.signbit(got).tolist() == np.signbit(want).tolist()


@needs_emulated_cupy
@pytest.mark.parametrize("operation, want", [
    (lambda cp, a: a.copy(), SUB),
    (lambda cp, a: a.astype(cp.float32), SUB),
    (lambda cp, a: a.view(cp.uint32).view(cp.float32), SUB),
    (lambda cp, a: cp.ascontiguousarray(a[::-1])[::-1], SUB),
    (lambda cp, a: cp.copysign(a, cp.float32(1)), np.abs(SUB)),
], ids=["copy", "astype-same", "bits", "contiguous-copy", "copysign"])
def test_moves_keep_subnormals(cp, operation, want):
    """Copies, views and copysign move bits: the subnormals are kept, as on a GPU."""
    got = operation(cp, cp.asarray(SUB)).get()
    assert got.dtype == F32 and _bits(got) == _bits(want)


# ------------------------------------------------------------- a store, GPU vs host
@needs_emulated_cupy
@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("strategy, flushed", [
    ("home", True), ("tree", True), ("ring", True), ("nccl", False), ("cpu", False)])
def test_store_sum_of_subnormal_gradients_on_gpus(cp, strategy, flushed):
    """Gradients of 1e-40 pushed from two GPUs: the same store fed host arrays sums them
    to 2e-40; on GPUs, strategies summing with gpukv's kernels (home, tree, ring) give 0,
    as float32 subnormals flush there (-ftz=true), while NCCL's sums (built without
    -ftz) and the host's keep them. Normal values agree bit for bit."""
    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:2]
    grad = np.array([1e-40, -1e-40, 0.5, 3e-39], F32)
    host, gpu = gpukv.create("device"), gpukv.create("device", strategy=strategy)
    host.init("w", np.zeros(4, F32))
    with devs[0].cuda_device:
        gpu.init("w", cp.zeros(4, F32))
    host.push("w", [grad, grad])
    sources = []
    for d in devs:
        with d.cuda_device:
            sources.append(cp.asarray(grad))
    gpu.push("w", sources)
    on_host, on_gpu = np.zeros(4, F32), np.zeros(4, F32)
    host.pull("w", out=on_host)
    gpu.pull("w", out=on_gpu)
    assert _bits(on_host) == _bits(grad + grad)
    want = [0.0, -0.0, 1.0, 0.0] if flushed else grad + grad
    assert _bits(on_gpu) == _bits(want)

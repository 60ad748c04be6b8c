"""No CUDA kernel gpukv can generate spills registers or uses local memory on sm_80, sm_90
or sm_100: every source of test_cuda_compile's enumeration is compiled by NVRTC to PTX for
each architecture (with CuPy's options) and assembled by `ptxas -v`, which must report 0
bytes of spill stores, spill loads, stack frame and lmem for every kernel.

NVRTC and ptxas come from the `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-nvcc-cu12` wheels
of the `test` extra; without them the tests skip, or fail when GPUKV_TEST_NVRTC=1.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpukv.tools import kernel_resources as kr

from .test_cuda_compile import _ENTRY, REQUIRED, VARIANT_PARAMS, VARIANTS

ARCHS = ("sm_80", "sm_90", "sm_100")


def _tools():
    """(NVRTC, ptxas), or the skip (a failure when required) naming what is missing."""
    try:
        return kr.find_nvrtc(), kr.find_ptxas()
    except kr.KernelToolMissing as exc:
        if REQUIRED:
            pytest.fail(f"GPUKV_TEST_NVRTC=1 but {exc}", pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def resources(request):
    """{(variant, arch): [Resources] or the error text}, for the selected variants,
    compiled in parallel once (NVRTC releases the GIL; ptxas is a child process)."""
    compiler, ptxas = _tools()
    selected = [item.callspec.params["variant"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and "variant" in item.callspec.params]

    def run(job):
        variant, arch = job
        source, options = VARIANTS[variant]
        try:
            return job, kr.compile_resources(compiler, ptxas, source, options, arch)
        except Exception as exc:  # reported by the variant's test
            return job, f"{type(exc).__name__}: {exc}"

    jobs = [(v, a) for v in selected if VARIANTS[v].source is not None for a in ARCHS]
    with ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 1) + 1)) as pool:
        return dict(pool.map(run, jobs))


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_kernel_does_not_spill_or_use_local_memory(variant, resources):
    """ptxas reports every kernel of the source on sm_80, sm_90 and sm_100 with no spill
    stores or loads, no stack frame and no lmem."""
    entries = set(_ENTRY.findall(VARIANTS[variant].source))
    failures = []
    for arch in ARCHS:
        found = resources[(variant, arch)]
        if isinstance(found, str):
            failures.append(f"{arch}: {found}")
            continue
        assert {r.kernel for r in found} == entries, f"{arch}: kernels ptxas reported"
        failures += [f"{arch} {r.kernel}: {', '.join(r.problems())} ({r.registers} registers)"
                     for r in found if r.problems()]
    assert not failures, "\n".join(failures)


_LOCAL_ARRAY = r"""
extern "C" __global__ void uses_local(const int* idx, float* out) {
    float a[64];
    for (int i = 0; i < 64; ++i) a[i] = out[i];
    for (int i = 0; i < 64; ++i) a[idx[i] & 63] += a[i];
    out[threadIdx.x] = a[idx[threadIdx.x] & 63];
}
"""


@pytest.mark.parametrize("source, ptxas_options, problem", [
    (_LOCAL_ARRAY, (), "stack frame"),
    (next(v.source for k, v in VARIANTS.items() if k.startswith("optim-lamb")),
     ("-maxrregcount=16",), "spill"),
], ids=["dynamically-indexed-array", "registers-capped"])
def test_local_memory_is_caught(source, ptxas_options, problem):
    """The check sees local memory: an array indexed at run time (a stack frame), and a
    kernel squeezed into 16 registers (spills)."""
    compiler, ptxas = _tools()
    found = kr.compile_resources(compiler, ptxas, source, ("--fmad=false",), "sm_90",
                                 ptxas_options)
    assert any(problem in p for r in found for p in r.problems()), found

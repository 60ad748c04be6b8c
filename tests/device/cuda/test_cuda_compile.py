"""Every CUDA kernel source gpukv can generate compiles with NVRTC: no GPU or driver needed.

Covered: the multi-key sum/copy and the canonical tree sum of `gpukv/device/cuda/kernels.py`
for every (source, destination) dtype pair and its row-sparse run sum for every dtype, the
compression module of `gpukv/device/cuda/codec_kernels.py`, and the multi-tensor
optimizer step of `gpukv/device/cuda/optim_kernels.py` for every registered rule, weight
dtype, compile-time switch (`defines()`), body (dense and row-sparse) and phase. Each source
is compiled with the options its module gives CuPy plus the ones CuPy adds, to a cubin for
the oldest target (as CuPy does at run time: ptxas runs too) and to PTX for a recent one.

NVRTC comes from the `nvidia-cuda-nvrtc-cu12` wheel of the `test` extra (or from
GPUKV_NVRTC_LIB, the path of a libnvrtc.so.*) and is driven through ctypes (tests/nvrtc.py),
so neither CuPy nor a GPU is needed. Without it the tests go through the GPU gate: they
skip, or fail when GPUKV_TEST_GPU=1 or GPUKV_TEST_NVRTC=1.
"""
from __future__ import annotations

import inspect
import itertools
import os
import re
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import NamedTuple

import pytest

from gpukv import optim
from gpukv._errors import GpukvError
from gpukv.device.cuda import codec_kernels as _codec_kernels
from gpukv.device.cuda import kernels as _kernels
from gpukv.device.cuda import optim_kernels as _optim_kernels
from gpukv.optim import _base as optim_base

from ... import nvrtc
from ...bfloat16 import dtype_named as _dtype
from ...bfloat16 import needs_bfloat16
from ...gpu_gate import gpu_unavailable

REQUIRED = os.environ.get("GPUKV_TEST_NVRTC", "") == "1"

#: oldest GPU generation compiled for (Volta), or NVRTC's oldest if that is newer
OLDEST_ARCH = 70
#: PTX target besides the oldest one's cubin (Hopper)
RECENT_PTX = "compute_90"
#: options CuPy's RawKernel/RawModule add to a module's own (cupy/cuda/compiler.py)
CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
#: the options `_optim_kernels._compiled` gives CuPy
OPTIM_OPTIONS = ("--fmad=false",)

_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')


class Variant(NamedTuple):
    source: str
    options: tuple


# ------------------------------------------------------------------ the sources

def _sum_variants():
    """Every (T, U) pair: sums read T and U, and `multi_copy` casts any T to any U; the
    canonical tree sum too."""
    names = sorted(_kernels._CTYPES)
    for t, u in itertools.product(names, names):
        for kind, make in (("sum", _kernels.sum_source), ("tree", _kernels.tree_sum_source)):
            dt, du = _dtype(t), _dtype(u)
            source = None if dt is None or du is None else make(dt, du)[1]
            yield f"{kind}-{t}-{u}", Variant(source, _kernels.COMPILE_OPTIONS)


def _segment_variants():
    """The row-sparse run sum, for every dtype."""
    for name in sorted(_kernels._CTYPES):
        t = _dtype(name)
        source = None if t is None else _kernels.segment_sum_source(t)[1]
        yield f"segment-{name}", Variant(source, _kernels.COMPILE_OPTIONS)


def _compression_variants():
    yield "compression", Variant(_codec_kernels.CUDA_SOURCE,
                                 _codec_kernels.COMPILE_OPTIONS)


#: values of constructor options that are not a bool or an optional (None) number
_OPTION_VALUES = {"momentum": (0.0, 0.9)}


def _option_grid(cls) -> dict:
    """{option: values} whose product flips every compile-time switch of `cls`."""
    grid = {"clip_gradient": (None, 1.0)}
    common = inspect.signature(optim.Optimizer.__init__).parameters
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name in common:
            continue
        if p.name in _OPTION_VALUES:
            grid[p.name] = _OPTION_VALUES[p.name]
        elif isinstance(p.default, bool):
            grid[p.name] = (False, True)
        elif p.default is None and p.kind is p.POSITIONAL_OR_KEYWORD:
            grid[p.name] = (None, 1.0)
    return grid


def _rules() -> list:
    return optim_base.registered()


def _rule_instances(cls):
    grid = _option_grid(cls)
    for values in itertools.product(*grid.values()):
        kwargs = dict(zip(grid, values))
        try:
            opt = cls(**kwargs)
        except GpukvError:  # not a valid configuration: no kernel to build for it
            continue
        label = ",".join(f"{k}={v}" for k, v in kwargs.items() if v not in (None, False, 0.0))
        yield label or "default", opt


#: the weight dtypes of the optimizer kernels
WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _optim_variants():
    """The sources `_optim_kernels.step` can compile, over every switch combination."""
    for cls in _rules():
        for label, opt in _rule_instances(cls):
            rule_phases = (1, 2) if getattr(opt, "per_key_norms", False) else (0,)
            launches = [("dense", None, phase) for phase in rule_phases]
            if opt.sparse_cuda_body != opt.cuda_body:
                launches.append(("sparse", opt.sparse_cuda_body, 0))
            for name in WEIGHT_DTYPES:
                for body_name, body, phase in launches:
                    dtype = _dtype(name)
                    source = (None if dtype is None
                              else _optim_kernels.kernel_source(opt, dtype, phase, body))
                    yield (f"optim-{opt.name}-{name}-{label}-{body_name}-p{phase}",
                           Variant(source, OPTIM_OPTIONS))


def _variants() -> dict:
    """{id: Variant}, one per distinct (source, options).

    Without ml_dtypes a bfloat16 variant has no source: it is listed where its float16
    twin is (their sources differ only in the conversions, so they repeat alike), so the
    same ids are collected, and its test skips.
    """
    everything = list(itertools.chain(_sum_variants(), _segment_variants(),
                                      _compression_variants(), _optim_variants()))
    kept, seen = set(), set()
    for vid, variant in everything:
        if variant.source is not None and variant not in seen:
            seen.add(variant)
            kept.add(vid)
    return {vid: variant for vid, variant in everything
            if vid in kept
            or (variant.source is None and vid.replace("bfloat16", "float16") in kept)}


VARIANTS = _variants()
#: the ids to parametrize over, bfloat16's marked
VARIANT_PARAMS = [pytest.param(vid, marks=needs_bfloat16) if "bfloat16" in vid else vid
                  for vid in VARIANTS]


# ---------------------------------------------------------------------- NVRTC
def _nvrtc():
    """NVRTC, or the GPU gate's skip (a failure when NVRTC is required) naming why not."""
    compiler, why = nvrtc.load()
    if compiler is None:
        if REQUIRED:
            pytest.fail(f"GPUKV_TEST_NVRTC=1 but {why}", pytrace=False)
        gpu_unavailable(why)
    return compiler


@cache
def _targets() -> tuple:
    """A cubin for the oldest GPU generation, as CuPy builds one at run time (ptxas runs
    on the inline PTX too, and code needing a newer GPU fails), and PTX for a recent one."""
    oldest = max([OLDEST_ARCH, min(_nvrtc().supported_archs())])
    return f"sm_{oldest}", RECENT_PTX


@cache
def _compile(source: str, options: tuple, arch: str) -> tuple:
    """(ok, NVRTC log, cubin or PTX) of `source` for `arch`."""
    try:
        log, image = _nvrtc().compile(source, [*options, *CUPY_OPTIONS], arch)
    except nvrtc.NvrtcError as exc:
        return False, f"{exc}\n{exc.log}", b""
    return True, log, image


@pytest.fixture(scope="module")
def compile_selected(request):
    """Compiles every selected variant in parallel once (NVRTC releases the GIL)."""
    _nvrtc()
    selected = [item.callspec.params["variant"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and "variant" in item.callspec.params]
    jobs = [(VARIANTS[v].source, VARIANTS[v].options, arch) for v in selected
            if VARIANTS[v].source is not None for arch in _targets()]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda job: _compile(*job), jobs))
    return _compile


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_kernel_compiles(variant, compile_selected):
    """The source compiles for every target and holds each kernel it declares."""
    source, options = VARIANTS[variant]
    entries = _ENTRY.findall(source)
    assert entries, "no extern \"C\" __global__ kernel in the source"
    failures = []
    for arch in _targets():
        ok, log, image = compile_selected(source, options, arch)
        if not ok:
            failures.append(f"--- -arch={arch} {' '.join(options)}: NVRTC log\n{log}")
            continue
        missing = [e for e in entries if e.encode() not in image]
        if missing:
            failures.append(f"--- -arch={arch}: kernels missing from the output: {missing}")
    if failures:
        numbered = "\n".join(f"{i + 1:4d} {line}" for i, line in enumerate(source.splitlines()))
        pytest.fail("\n".join(failures) + f"\n--- source of {variant}\n{numbered}",
                    pytrace=False)


def test_every_rule_switch_combination_is_compiled():
    """The option grid reaches every 0/1 combination of each rule's `defines()`.

    A new rule or switch that the grid does not reach fails here: extend _OPTION_VALUES.
    """
    for cls in _rules():
        seen = {tuple(sorted(opt.defines().items())) for _, opt in _rule_instances(cls)}
        names = sorted({k for combo in seen for k, _ in combo})
        want = {tuple(zip(names, bits)) for bits in itertools.product((0, 1), repeat=len(names))}
        missing = want - seen
        assert not missing, f"{cls.__name__}: switch combinations not compiled: {missing}"


def test_variants_cover_every_family():
    """Each kernel module contributes its sources (a guard against an empty enumeration)."""
    families = {vid.split("-")[0] for vid in VARIANTS}
    assert families == {"sum", "tree", "segment", "compression", "optim"}
    rules = {vid.split("-")[1] for vid in VARIANTS if vid.startswith("optim-")}
    assert rules == {cls.name for cls in _rules()}

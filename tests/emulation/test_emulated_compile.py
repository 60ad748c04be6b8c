"""Compiling CUDA sources for the CPU emulation: every source gpukv generates compiles,
NVRTC options and inline PTX are vetted, errors read like CuPy's, and the disk cache is
keyed and written safely."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.device.cuda.test_cuda_compile import _ENTRY, VARIANT_PARAMS, VARIANTS

from .support import device, kernels


@pytest.fixture(scope="module")
def compiled_variants(request):
    """Compiles every selected variant once, in parallel (g++ runs in subprocesses)."""
    selected = [item.callspec.params["variant"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and "variant" in item.callspec.params]

    def build(vid):
        try:
            module = kernels.RawModule(code=VARIANTS[vid].source, options=VARIANTS[vid].options)
            module.compile()
            return vid, module
        except kernels.CompileException as exc:
            return vid, exc

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(pool.map(build, [v for v in selected if VARIANTS[v].source is not None]))


@pytest.mark.compile_all
@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_every_gpukv_kernel_source_compiles_for_the_emulation(variant, compiled_variants):
    """The source compiles through emu.h with its own options, and every extern "C"
    kernel it declares can be launched (its parameters are known)."""
    module = compiled_variants[variant]
    if isinstance(module, Exception):
        pytest.fail(str(module), pytrace=False)
    names = _ENTRY.findall(VARIANTS[variant].source)
    assert names
    for name in names:
        assert module.get_function(name).params


def test_the_variants_are_the_full_enumeration():
    """All 297 sources of tests/test_cuda_compile.py are here (a guard against an empty
    or shrunken parametrisation)."""
    assert len(VARIANTS) >= 297


_SQUARE = r"""
extern "C" __global__ void square(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * x[i] * SCALE;
}
"""


@pytest.mark.parametrize("options", [
    ("-DSCALE=2.0f",), ("--define-macro=SCALE=2.0f", "-std=c++14", "--fmad=false"),
    ("-DSCALE=2.0f", "-ftz=true", "-arch=sm_70", "--use_fast_math", "-lineinfo", "-w")])
def test_nvrtc_options_are_accepted_and_macros_defined(options):
    """NVRTC's options are accepted; -D/--define-macro reach the source."""
    kernel = kernels.RawKernel(_SQUARE, "square", options=options)
    x = device(np.arange(4, dtype=np.float32))
    kernel((1,), (32,), (x, np.int32(4)))
    assert x.host.tolist() == [0.0, 2.0, 8.0, 18.0]
    assert kernel.options == options and kernel.name == "square" and kernel.code == _SQUARE


@pytest.mark.parametrize("option, why", [
    ("-O3", "unrecognized option"), ("--frobnicate", "unrecognized option"),
    ("--fmad=maybe", "one of true, false"), ("-std=c++99", "one of"),
    ("-arch=sm_x", "not a GPU architecture"), ("-lineinfo=1", "takes no value")])
def test_options_nvrtc_would_refuse_are_refused(option, why):
    """An option NVRTC does not know, or a value it refuses, is a CompileException."""
    with pytest.raises(kernels.CompileException, match=why):
        kernels.RawKernel(_SQUARE, "square", options=(option, "-DSCALE=1"))


def test_options_must_be_a_tuple():
    """As in CuPy, whose options parameter is typed tuple."""
    with pytest.raises(TypeError, match="tuple"):
        kernels.RawKernel(_SQUARE, "square", options=["-DSCALE=1"])


def test_a_compile_error_carries_the_log_and_the_numbered_source():
    """g++'s message with the line, and the source as compiled, numbered."""
    source = 'extern "C" __global__ void broken(float* x) {\n    x[0] = undeclared;\n}\n'
    kernel = kernels.RawKernel(source, "broken")
    with pytest.raises(kernels.CompileException) as info:
        kernel((1,), (1,), (device(np.zeros(1, np.float32)),))
    message = info.value.get_message()
    assert "kernel.cu:2:" in message and "undeclared" in message
    assert "   2     x[0] = undeclared;" in message
    assert "broken" in info.value.source


def test_an_unknown_function_name_is_an_error_naming_it():
    """get_function of a name the module does not define: CUDA_ERROR_NOT_FOUND, naming
    the function and the kernels that do exist."""
    module = kernels.RawModule(code=_SQUARE, options=("-DSCALE=1",))
    with pytest.raises(kernels.CUDADriverError, match="'cube'.*its kernels: square") as info:
        module.get_function("cube")
    assert info.value.status == "CUDA_ERROR_NOT_FOUND"


def test_a_kernel_without_c_linkage_cannot_be_found_by_name():
    """As with NVRTC, a C++ kernel's name is mangled: only extern "C" kernels are found."""
    source = "__global__ void plain(float* x) { x[0] = 1.0f; }\n" + _SQUARE
    module = kernels.RawModule(code=source, options=("-DSCALE=1",))
    module.get_function("square")
    with pytest.raises(kernels.CUDADriverError, match="plain"):
        module.get_function("plain")


@pytest.mark.parametrize("statement", [
    'asm("add.f32 %0, %1, %2;" : "=f"(y) : "f"(x), "f"(x));',
    'asm volatile("membar.gl;");',
    'asm("cvt.rn.f16.f32 %0, %1;" : "=r"(bits) : "f"(x));',  # not the operands known
    'asm("cvt.f32.f16 %0, %1;\\n\\tcvt.f32.f16 %0, %1;" : "=f"(y) : "h"(bits));',
])
def test_unknown_inline_ptx_is_refused_at_construction_quoting_it(statement):
    """PTX without a CPU equivalent: UnsupportedPTXError when the kernel is made, with
    the statement and its line."""
    source = ('extern "C" __global__ void k(float* out, float x) {\n'
              '    float y = 0.0f; unsigned short bits = 0; (void)bits;\n'
              f"    {statement}\n    out[0] = y;\n}}\n")
    with pytest.raises(kernels.UnsupportedPTXError) as info:
        kernels.RawKernel(source, "k")
    assert statement in str(info.value) and "line 3" in str(info.value)


def test_known_ptx_is_recognised_however_it_is_spaced_and_named():
    """Whitespace, line breaks, `volatile` and operand names do not matter; comments
    with asm in them are left alone."""
    source = r"""
// asm("nothing here");
extern "C" __global__ void round_trip(const float* in, float* out) {
    unsigned short bits; const float value = in[threadIdx.x];
    asm volatile ( "cvt.rn.f16.f32   %0 ,%1 ;"
                   : "=h"( bits )
                   : "f"(value) );
    float back;
    asm("cvt.f32.f16 %0, %1;" : "=f"(back) : "h"(bits));
    out[threadIdx.x] = back;
    __syncthreads();  /* a line count that moved would show in a barrier error */
}
"""
    kernel = kernels.RawKernel(source, "round_trip")
    x = np.array([1.0, 1.0 / 3.0, 65519.0, 70000.0], np.float32)
    out = device(np.zeros(4, np.float32))
    kernel((1,), (4,), (device(x), out))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out.host, x.astype(np.float16).astype(np.float32))


def test_unsupported_constructor_arguments_are_refused():
    """A compiled file (path=), C++ template names and cuComplex translation have no
    emulation; the backend must be NVRTC's or NVCC's."""
    with pytest.raises(NotImplementedError, match="path"):
        kernels.RawModule(path="kernels.cubin")
    with pytest.raises(NotImplementedError, match="name_expressions"):
        kernels.RawModule(code=_SQUARE, name_expressions=["square"])
    with pytest.raises(NotImplementedError, match="translate_cucomplex"):
        kernels.RawKernel(_SQUARE, "square", translate_cucomplex=True)
    with pytest.raises(ValueError, match="Invalid backend"):
        kernels.RawKernel(_SQUARE, "square", backend="hip")


def test_the_cache_folder_is_read_from_the_environment(monkeypatch, tmp_path):
    """CUDAEMU_CACHE_DIR first, then $XDG_CACHE_HOME/gpukv-cudaemu, then ~/.cache."""
    monkeypatch.setenv("CUDAEMU_CACHE_DIR", str(tmp_path / "explicit"))
    assert kernels._cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("CUDAEMU_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels._cache_dir() == tmp_path / "xdg" / "gpukv-cudaemu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernels._cache_dir() == tmp_path / "home" / ".cache" / "gpukv-cudaemu"


_CACHE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from cudaemu import kernels
kernels.RawKernel('extern "C" __global__ void one(int* x) { x[0] = COUNT; }', "one",
                  options=("-DCOUNT=" + sys.argv[2],)).compile()
print(kernels.CACHE_DIR)
"""


def test_compiled_kernels_are_cached_on_disk_by_source_and_options(tmp_path):
    """A second process finds the library the first built; other options build another;
    nothing half-written is left behind."""
    root = str(Path(kernels.__file__).resolve().parents[1])
    env = dict(os.environ, CUDAEMU_CACHE_DIR=str(tmp_path / "cache"))

    def run(count):
        out = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, root, count], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(tmp_path / "cache")
        return {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("kernel-*.so")}

    first = run("1")
    assert len(first) == 1
    assert run("1") == first  # found, not rebuilt
    assert len(run("2")) == 2
    assert not list((tmp_path / "cache").glob(".build-*"))


def test_threads_compiling_one_new_source_build_it_once(tmp_path, monkeypatch):
    """Concurrent first uses of a source share one compile and one loaded module."""
    monkeypatch.setattr(kernels, "CACHE_DIR", tmp_path)  # a source new to every run
    source = _SQUARE.replace("SCALE", f"SCALE * {os.getpid()}.0f / {os.getpid()}.0f")
    made = [kernels.RawKernel(source, "square", options=("-DSCALE=3.0f",)) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        functions = list(pool.map(lambda k: k.kernel, made))
    assert len({id(f.module) for f in functions}) == 1


def test_kernels_in_branches_the_preprocessor_drops_are_left_out():
    """A kernel under `#if 0` is not in the module; the others are."""
    source = '#if 0\nextern "C" __global__ void old(float* x) { x[0] = 1.0f; }\n#endif\n' + _SQUARE
    module = kernels.RawModule(code=source, options=("-DSCALE=1.0f",))
    x = device(np.full(2, 3.0, np.float32))
    module.get_function("square")((1,), (2,), (x, np.int32(2)))
    assert x.host.tolist() == [9.0, 9.0]
    with pytest.raises(kernels.CUDADriverError, match="'old'"):
        module.get_function("old")

"""NVRTC, the CUDA runtime compiler, through ctypes: compiles kernel sources with no GPU, no
driver and no CuPy. The library comes from the `nvidia-cuda-nvrtc-cu12` wheel (in the
`test` extra) or from GPUKV_NVRTC_LIB (the path of a libnvrtc.so.*). Used by
`gpukv info --kernels` and by the tests that compile every kernel."""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from functools import cache


class NvrtcError(RuntimeError):
    """A failed NVRTC call; `log` holds the compiler's log when there is one."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


def _library_path() -> str | None:
    """GPUKV_NVRTC_LIB, else the wheel's libnvrtc, else None."""
    path = os.environ.get("GPUKV_NVRTC_LIB", "")
    if path:
        if not os.path.isfile(path):
            raise NvrtcError(f"GPUKV_NVRTC_LIB={path!r} is not a file")
        return path
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        # CUDA 12's wheel (nvidia-cuda-nvrtc-cu12) keeps it in cuda_nvrtc/lib, CUDA 13's
        # (nvidia-cuda-nvrtc 13.x) in cu13/lib
        for folder in ("cuda_nvrtc", "cu13"):
            libs = sorted(glob.glob(os.path.join(root, folder, "lib", "libnvrtc.so.[0-9]*")))
            if libs:
                return libs[-1]
    return None


class Nvrtc:
    """The few NVRTC entry points the compile tests use."""

    def __init__(self, path: str):
        libdir = os.path.dirname(path)
        for builtins in sorted(glob.glob(os.path.join(libdir, "libnvrtc-builtins.so.*"))):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)  # libnvrtc dlopens it
        lib = self.lib = ctypes.CDLL(path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.path = path

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise NvrtcError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def version(self) -> tuple:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)),
                    "nvrtcVersion")
        return major.value, minor.value

    def supported_archs(self) -> list:
        n = ctypes.c_int()
        self._check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)),
                    "nvrtcGetNumSupportedArchs")
        archs = (ctypes.c_int * n.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        return list(archs)

    def compile(self, source: str, options, arch: str) -> tuple:
        """(log, image): a cubin for `sm_XX`, PTX for `compute_XX`; NvrtcError on failure."""
        lib = self.lib
        prog = ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(),
                                           b"gpukv_kernel.cu", 0, None, None),
                    "nvrtcCreateProgram")
        try:
            opts = [o.encode() for o in [*options, f"-arch={arch}"]]
            status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            log = self._text(prog, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog)
            if status != 0:
                raise NvrtcError(f"nvrtcCompileProgram: "
                                 f"{lib.nvrtcGetErrorString(status).decode()}", log)
            if arch.startswith("sm_"):
                image = self._bytes(prog, lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            else:
                image = self._bytes(prog, lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
            return log, image
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _bytes(self, prog, size_fn, get_fn) -> bytes:
        size = ctypes.c_size_t()
        self._check(size_fn(prog, ctypes.byref(size)), size_fn.__name__)
        buf = ctypes.create_string_buffer(size.value)
        self._check(get_fn(prog, buf), get_fn.__name__)
        return buf.raw

    def _text(self, prog, size_fn, get_fn) -> str:
        return self._bytes(prog, size_fn, get_fn).rstrip(b"\0").decode(errors="replace")


@cache
def load() -> tuple:
    """(Nvrtc, None), or (None, why it is not usable here)."""
    try:
        path = _library_path()
        if path is None:
            return None, ("no libnvrtc found (pip install nvidia-cuda-nvrtc-cu12, or set "
                          "GPUKV_NVRTC_LIB to a libnvrtc.so.*)")
        nvrtc = Nvrtc(path)
        nvrtc.version()
    except (OSError, NvrtcError) as exc:
        return None, f"NVRTC is not usable: {exc}"
    return nvrtc, None

"""CuPy's RawKernel and RawModule on the CPU: gpukv's own CUDA sources compiled with g++.

A source is prepared (its known inline PTX rewritten into calls of emulation functions,
`extern __shared__` arrays pointed at the dynamic shared buffer), compiled with the system
g++ through `native/emu.h`, cached on disk, and loaded with ctypes. A launch is queued on
its stream (streams.py); when it runs, it runs the grid on the thread that forces it,
block after block (`native/runtime.cpp`): one plain call per thread,
or one fiber per thread when the compiled code synchronises with `__syncthreads()`.

Arguments are passed as CuPy passes them (device arrays as their data pointer, Python int
as int64, float as float64, NumPy scalars with their own type, None as a null pointer; a
Python bool is an int to CuPy, so int64 too), and every launch checks them against the
kernel's parameter list as the compiler sees it, so an argument that a GPU would silently
misread is a TypeError here. Faults in a kernel (a read or write through a guard page)
become `IllegalAddressError` naming the kernel, block, thread and address.

Two hooks connect the memory side: `register_array_type(cls)` (instances pass as
`.data.ptr`) and `set_address_describer(fn)` (words for a faulting address).

Kernels run with float32 subnormals flushed to zero, inputs and results (the CPU's DAZ and
FTZ switches, set for the launch): CuPy adds -ftz=true to every module it compiles
(`_compile_with_cache_cuda` in cupy/cuda/compiler.py), whatever its options. The CPU's
switches flush float64 subnormals too, which a GPU does not. Explicit PTX without `.ftz`
(the float32 add and the float64 <-> float32 and float64 -> float16 conversions of
PTX_EMULATION) keeps subnormals on a GPU: its emulation turns the switches off around it.

Not emulated: fused multiply-add (sources are compiled with -ffp-contract=off, which is
what --fmad=false asks for), warp-level primitives, grid-wide synchronisation, and C++
(mangled) kernel names.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

__all__ = [
    "RawKernel", "RawModule", "CompileException", "UnsupportedPTXError", "CUDADriverError",
    "InvalidConfigurationError", "KernelFaultError", "IllegalAddressError", "BarrierError",
    "Function", "Parameter", "register_array_type", "set_address_describer", "CACHE_DIR",
    "PTX_EMULATION", "MAX_THREADS_PER_BLOCK", "MAX_BLOCK_DIMS", "MAX_GRID_DIMS",
    "DEFAULT_MAX_DYNAMIC_SHARED", "FLUSH_TO_ZERO",
]

NATIVE_DIR = Path(__file__).resolve().parent / "native"
HEADER = NATIVE_DIR / "emu.h"
RUNTIME_SOURCE = NATIVE_DIR / "runtime.cpp"
STUB_INCLUDE_DIR = NATIVE_DIR / "include"  # empty cuda_fp16.h & co.: emu.h has it all

CXX = "g++"
#: every kernel source is compiled with these (-ffp-contract=off is --fmad=false)
# (-fstack-clash-protection: a big frame probes its pages, so it cannot step over a fiber
# stack's guard page into the next fiber's stack)
CXX_FLAGS = ("-std=gnu++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off",
             "-fno-fast-math", "-fno-math-errno", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE",
             "-fstack-clash-protection", "-fvisibility=hidden", "-fno-exceptions", "-fno-rtti",
             "-w")
RUNTIME_FLAGS = ("-std=gnu++17", "-O2", "-fPIC", "-shared", "-pthread", "-U_FORTIFY_SOURCE",
                 "-fvisibility=hidden", "-fno-exceptions", "-fno-rtti")

MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIMS = (1024, 1024, 64)
MAX_GRID_DIMS = (2 ** 31 - 1, 65535, 65535)
DEFAULT_MAX_DYNAMIC_SHARED = 48 * 1024  # without cudaFuncSetAttribute's opt-in
#: 1: launches flush float32 subnormals, as CuPy's -ftz=true has every kernel do
FLUSH_TO_ZERO = 1
MAX_DYNAMIC_SHARED = 232448             # the most a GPU (Hopper) lets a block opt in to


def _cache_dir() -> Path:
    explicit = os.environ.get("CUDAEMU_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpukv-cudaemu"


#: where compiled kernels are kept, resolved once at import (later changes to the
#: environment do not move it)
CACHE_DIR = _cache_dir()


# ===================================================================== errors
class CompileException(RuntimeError):
    """A source the emulation cannot compile (CuPy's `CompileException`): g++'s log and
    the numbered source it compiled."""

    def __init__(self, message: str, source: str = "", name: str = "",
                 options: tuple = (), backend: str = "nvrtc"):
        super().__init__(message)
        self._message = message
        self.source = source
        self.name = name
        self.options = options
        self.backend = backend

    def get_message(self) -> str:
        return self._message

    def dump(self, f) -> None:
        f.write(_numbered(self.source) + "\n")


class UnsupportedPTXError(CompileException, NotImplementedError):
    """Inline PTX that the emulation has no equivalent for."""


class CUDADriverError(RuntimeError):
    """A failed launch, as CuPy reports a CUDA driver error: `status` is the CUDA name."""

    def __init__(self, status: str, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class InvalidConfigurationError(CUDADriverError):
    """A launch configuration a GPU refuses (block or grid too large or empty, too much
    dynamic shared memory)."""


class KernelFaultError(CUDADriverError):
    """A kernel failed while running. `kernel`, `block` and `thread` say where."""

    def __init__(self, status: str, message: str, kernel: str, block=None, thread=None):
        super().__init__(status, message)
        self.kernel = kernel
        self.block = block
        self.thread = thread


class IllegalAddressError(KernelFaultError):
    """A kernel read or wrote memory it may not (cudaErrorIllegalAddress)."""

    def __init__(self, status, message, kernel, block, thread, address: int, access: str):
        super().__init__(status, message, kernel, block, thread)
        self.address = address
        self.access = access


class BarrierError(KernelFaultError):
    """Threads of a block that did not all reach the same `__syncthreads()`."""


# ====================================================================== hooks
_array_types: tuple = ()
_describe_address = None


def register_array_type(cls) -> None:
    """Pass instances of `cls` to kernels as their `.data.ptr` (a device array type)."""
    global _array_types
    if not isinstance(cls, type):
        raise TypeError(f"register_array_type: expected a class, got {cls!r}")
    if cls not in _array_types:
        _array_types = _array_types + (cls,)


_launch_guard = contextlib.nullcontext


def set_launch_guard(factory) -> None:
    """Run every launch inside `factory()` (a context manager; None: nothing), e.g. to
    make memory the launching GPU may not access unreachable for its duration."""
    global _launch_guard
    _launch_guard = contextlib.nullcontext if factory is None else factory


def set_address_describer(fn):
    """Use `fn(address: int) -> str` to word a faulting address in IllegalAddressError's
    message, in place of its hex (None: the hex only). Returns the describer it replaces."""
    global _describe_address
    if fn is not None and not callable(fn):
        raise TypeError(f"set_address_describer: expected a callable or None, got {fn!r}")
    previous, _describe_address = _describe_address, fn
    return previous


# ========================================================= preparing a source
# Each known inline PTX statement, whitespace-normalised, and what replaces it:
# (output constraints, input constraints, emulation function of emu.h).
PTX_EMULATION = {
    "cvt.f32.f16 %0, %1": (("=f",), ("h",), "gpukv_emu_cvt_f32_f16"),
    "cvt.rn.f16.f32 %0, %1": (("=h",), ("f",), "gpukv_emu_cvt_rn_f16_f32"),
    # explicit PTX without .ftz: subnormal operands and results kept, whatever -ftz says
    "add.rn.f32 %0, %1, %2": (("=f",), ("f", "f"), "gpukv_emu_add_rn_f32"),
    "cvt.rn.f32.f64 %0, %1": (("=f",), ("d",), "gpukv_emu_cvt_rn_f32_f64"),
    "cvt.f64.f32 %0, %1": (("=d",), ("f",), "gpukv_emu_cvt_f64_f32"),
    "cvt.rn.f16.f64 %0, %1": (("=h",), ("d",), "gpukv_emu_cvt_rn_f16_f64"),
}

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_COMMENT_OR_LITERAL = re.compile(
    r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""", re.S)
_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b(?:\s*\b(?:volatile|__volatile__|inline|goto)\b)*"
                  r"\s*\(")
_EXTERN_SHARED = re.compile(
    r"\bextern\s+__shared__\s+(?P<type>[^;\[\]{}()]*(?:\([^()]*\)[^;\[\]{}()]*)*?)\s*"
    r"\b(?P<name>\w+)\s*\[\s*\]\s*;")
_ALIGN = re.compile(r"__align__\s*\([^()]*\)|__attribute__\s*\(\(.*?\)\)")
_KERNEL = re.compile(r"\b__global__\s+(?:\w+\s+)*?void\s+"
                     r"(?:__launch_bounds__\s*\([^()]*\)\s*)?(?P<name>\w+)\s*\(")
_EXTERN_C_BLOCK = re.compile(r'\bextern\s+"C"\s*\{')
_EXTERN_C_BEFORE = re.compile(r'\bextern\s+"C"\s+(?:\w+\s+)*$')
_STRING = re.compile(r'"((?:\\.|[^"\\])*)"', re.S)


def _blanked(text: str) -> str:
    """`text` with every character but newlines turned into a space (same length)."""
    return re.sub(r"[^\n]", " ", text)


def _mask(source: str, literals: bool) -> str:
    """`source` with comments (and string/char literals if `literals`) blanked out, so
    that positions in it are positions in `source`."""
    pattern = _COMMENT_OR_LITERAL if literals else _COMMENT
    return pattern.sub(lambda m: _blanked(m.group()), source)


def _closing(masked: str, open_at: int) -> int:
    """Index of the bracket closing the one at `open_at` (masked text), or -1."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    want = [pairs[masked[open_at]]]
    for i in range(open_at + 1, len(masked)):
        c = masked[i]
        if c in pairs:
            want.append(pairs[c])
        elif c in ")}]":
            if c != want[-1]:
                return -1
            want.pop()
            if not want:
                return i
    return -1


def _split_top(masked: str, text: str, sep: str) -> list:
    """`text` split at the `sep` characters of `masked` (same positions) outside brackets;
    a `::` is never a separator."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(masked):
        c = masked[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            if sep == ":" and masked[i:i + 2] == "::":
                i += 2
                continue
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


def _line_of(source: str, index: int) -> int:
    return source.count("\n", 0, index) + 1


def _unescape(literal: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)),
                  literal)


def _normal_ptx(template: str) -> str:
    text = " ".join(template.replace(";", " ; ").split())
    text = re.sub(r"\s*,\s*", ", ", text)
    return re.sub(r"(\s*;)+$", "", text).strip()


def _operands(text: str) -> list:
    """[(constraint, expression)] of an asm operand list."""
    masked = _mask(text, literals=True)
    out = []
    for part in _split_top(masked, text, ","):
        if not part.strip():
            continue
        m = re.fullmatch(r'\s*(?:\[\s*\w+\s*\]\s*)?"([^"]*)"\s*\((.*)\)\s*', part, re.S)
        if m is None:
            return []
        out.append((m.group(1), m.group(2).strip()))
    return out


def _rewrite_asm(source: str, masked: str, start: int, open_at: int) -> tuple:
    """(end, replacement) of the asm statement at `start`, or UnsupportedPTXError."""
    line = _line_of(source, start)
    close = _closing(masked, open_at)
    semicolon = close + 1 if close >= 0 else len(masked)
    while semicolon < len(masked) and masked[semicolon].isspace():
        semicolon += 1
    complete = close >= 0 and semicolon < len(masked) and masked[semicolon] == ";"
    statement = source[start:semicolon + 1] if complete else source[start:start + 200]

    def refuse(why: str):
        raise UnsupportedPTXError(
            f"inline PTX on line {line} has no CPU emulation ({why}):\n    {statement}\n"
            f"known statements: {', '.join(sorted(PTX_EMULATION))} (see PTX_EMULATION)",
            source)

    if not complete:
        refuse("not a complete asm statement")
    inner, inner_masked = source[open_at + 1:close], masked[open_at + 1:close]
    sections = _split_top(inner_masked, inner, ":")
    template = "".join(_unescape(s) for s in _STRING.findall(sections[0]))
    known = PTX_EMULATION.get(_normal_ptx(template))
    if known is None:
        refuse(f"unknown instruction {_normal_ptx(template)!r}")
    outputs = _operands(sections[1]) if len(sections) > 1 else []
    inputs = _operands(sections[2]) if len(sections) > 2 else []
    want_out, want_in, function = known
    if tuple(c for c, _ in outputs) != want_out or tuple(c for c, _ in inputs) != want_in:
        refuse(f"operands {[c for c, _ in outputs]} : {[c for c, _ in inputs]}, expected "
               f"{list(want_out)} : {list(want_in)}")
    call = f"({outputs[0][1]}) = {function}({', '.join(e for _, e in inputs)});"
    return semicolon + 1, call + "\n" * statement.count("\n")


def _extern_c_spans(masked: str) -> list:
    spans = []
    for m in _EXTERN_C_BLOCK.finditer(masked):
        close = _closing(masked, m.end() - 1)
        spans.append((m.end(), close if close >= 0 else len(masked)))
    return spans


class PreparedSource:
    """A kernel source made ready for g++: its text, and its C-linkage kernels with their
    declared parameters."""

    def __init__(self, code: str):
        masked = _mask(code, literals=True)
        edits = []  # (start, end, replacement), applied back to front
        for m in _ASM.finditer(masked):
            end, text = _rewrite_asm(code, masked, m.start(), m.end() - 1)
            edits.append((m.start(), end, text))
        for m in _EXTERN_SHARED.finditer(masked):
            ctype = " ".join(code[m.start("type"):m.end("type")].split())
            plain = " ".join(_ALIGN.sub(" ", ctype).split())
            text = (f"{ctype} *const {m.group('name')} = "
                    f"reinterpret_cast<{plain} *>(gpukv_emu_dynamic_shared);")
            edits.append((m.start(), m.end(), text + "\n" * code.count("\n", *m.span())))
        text = code
        for start, end, replacement in sorted(edits, reverse=True):
            text = text[:start] + replacement + text[end:]
        self.text = text
        self.kernels = self._c_kernels(text)

    @staticmethod
    def _c_kernels(text: str) -> dict:
        """{name: [declared parameter text]} of the defined extern "C" kernels."""
        masked = _mask(text, literals=False)
        blocks = _extern_c_spans(masked)
        kernels: dict = {}
        for m in _KERNEL.finditer(masked):
            open_at = m.end() - 1
            close = _closing(masked, open_at)
            rest = masked[close + 1:close + 200].lstrip() if close >= 0 else ""
            if not rest.startswith("{"):
                continue  # a declaration; its definition comes later
            c_linkage = (_EXTERN_C_BEFORE.search(masked, 0, m.start()) is not None
                         or any(a <= m.start() < b for a, b in blocks))
            if not c_linkage:
                continue  # C++ linkage: CuPy finds it only through name_expressions
            params = text[open_at + 1:close]
            parts = [" ".join(p.split()) for p in
                     _split_top(masked[open_at + 1:close], params, ",")]
            kernels[m.group("name")] = [] if parts in ([""], ["void"]) else parts
        return kernels

    def compiled_text(self, skip=()) -> str:
        """The text g++ compiles: the prepared source and one export per kernel (but those
        in `skip`)."""
        exports = "".join(f"GPUKV_EMU_KERNEL({name})\n" for name in self.kernels
                          if name not in skip)
        return f"{self.text}\n{exports}"

    def unexported(self, log: str) -> set:
        """Kernels whose export g++ found undeclared: defined in a branch of #if that the
        preprocessor dropped."""
        first = self.text.count("\n") + 2  # the line of the first export
        return {m.group(2) for m in re.finditer(r"kernel\.cu:(\d+):\d+: error: '(\w+)' was "
                                                r"not declared", log)
                if int(m.group(1)) >= first and m.group(2) in self.kernels}


# ==================================================================== options
# NVRTC's options: name (long or short) -> what its value must be. Only -D, -U, -I and
# --pre-include change anything here; the others are accepted and have no CPU meaning.
_BOOL = ("true", "false")
_NVRTC_OPTIONS = {
    "gpu-architecture": "arch", "arch": "arch",
    "device-c": None, "dc": None, "device-w": None, "dw": None,
    "relocatable-device-code": _BOOL, "rdc": _BOOL,
    "extensible-whole-program": None, "ewp": None,
    "device-debug": None, "G": None, "generate-line-info": None, "lineinfo": None,
    "dopt": ("on", "off"), "ptxas-options": "any", "Xptxas": "any",
    "maxrregcount": "int", "ftz": _BOOL, "prec-sqrt": _BOOL, "prec-div": _BOOL,
    "fmad": _BOOL, "use_fast_math": None, "extra-device-vectorization": None,
    "modify-stack-limit": _BOOL, "dlink-time-opt": None, "dlto": None,
    "gen-opt-lto": None, "optix-ir": None, "jump-table-density": "int",
    "define-macro": "any", "D": "any", "undefine-macro": "any", "U": "any",
    "include-path": "any", "I": "any", "pre-include": "any", "include": "any",
    "no-source-include": None,
    "std": ("c++03", "c++11", "c++14", "c++17", "c++20"),
    "builtin-move-forward": _BOOL, "builtin-initializer-list": _BOOL,
    "disable-warnings": None, "w": None, "restrict": None,
    "device-as-default-execution-space": None, "default-device": None,
    "device-int128": None, "optimization-info": "any", "opt-info": "any",
    "display-error-number": None, "err-no": None,
    "no-display-error-number": None, "no-err-no": None,
    "diag-error": "any", "diag-suppress": "any", "diag-warn": "any",
    "brief-diagnostics": _BOOL, "brief-diag": _BOOL, "time": "any",
    "split-compile": "int", "fdevice-syntax-only": None, "minimal": None,
    "device-stack-protector": _BOOL, "fdevice-time-trace": "any",
    "Ofast-compile": ("0", "min", "mid", "max"),
    "pch": None, "create-pch": "any", "use-pch": "any", "pch-dir": "any",
    "pch-verbose": _BOOL, "pch-messages": _BOOL, "instantiate-templates-in-pch": _BOOL,
    "Wreorder": None, "Werror": "any",
}
_GXX_FOR = {"define-macro": "-D", "D": "-D", "undefine-macro": "-U", "U": "-U",
            "include-path": "-I", "I": "-I"}


def _option_error(option, why: str, source: str) -> CompileException:
    return CompileException(f"nvrtc: error: {why}: {option!r}", source)


def gxx_options(options: tuple, source: str = "") -> tuple:
    """The g++ flags that NVRTC `options` stand for; CompileException for an option NVRTC
    does not know or a value it refuses."""
    flags: list = []
    for option in options:
        if not isinstance(option, str):
            raise TypeError(f"options: expected str items, got {option!r}")
        m = re.fullmatch(r"-([DUI])(.+)", option)  # glued -DNAME=1, -Ipath
        if m:
            name, value = m.group(1), m.group(2).lstrip("=")
        else:
            m = re.fullmatch(r"--?([A-Za-z][\w+.-]*?)(?:=(.*))?", option, re.S)
            if m is None or m.group(1) not in _NVRTC_OPTIONS:
                raise _option_error(option, "unrecognized option", source)
            name, value = m.group(1), m.group(2)
        spec = _NVRTC_OPTIONS[name]
        if spec is None and value is not None:
            raise _option_error(option, "this option takes no value", source)
        if spec is not None and not value:
            raise _option_error(option, "this option needs a value", source)
        if isinstance(spec, tuple) and value not in spec:
            raise _option_error(option, f"value must be one of {', '.join(spec)}", source)
        if spec == "int" and not value.isdigit():
            raise _option_error(option, "value must be a number", source)
        if spec == "arch" and not re.fullmatch(r"(compute|sm|lto)_\d+[af]?", value):
            raise _option_error(option, "not a GPU architecture", source)
        if name in _GXX_FOR:
            flags.append(_GXX_FOR[name] + value)
        elif name in ("pre-include", "include"):
            flags += ["-include", value]
    return tuple(flags)


# ================================================================== building
_build_locks: dict = {}
_build_locks_lock = threading.Lock()
_compiler_id = None
_runtime = None
_runtime_lock = threading.Lock()
_pch = None
_header = None
_C_LOCALE = dict(os.environ, LC_ALL="C", LANG="C")  # plain quotes in g++'s messages


def _numbered(source: str) -> str:
    return "\n".join(f"{i + 1:4d} {line}" for i, line in enumerate(source.splitlines()))


def _compiler() -> str:
    """The compiler's identity (command and version), part of every cache key."""
    global _compiler_id
    if _compiler_id is None:
        try:
            out = subprocess.run([CXX, "--version"], capture_output=True, text=True,
                                 check=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            raise CompileException(f"the CUDA emulation needs {CXX}, which failed: {exc}"
                                   ) from exc
        _compiler_id = f"{shutil.which(CXX)}\n{out.splitlines()[0] if out else ''}"
    return _compiler_id


def _header_text() -> str:
    """emu.h and the stub headers, as one text (read once: part of every cache key)."""
    global _header
    if _header is None:
        stubs = sorted(STUB_INCLUDE_DIR.glob("*.h"))
        _header = HEADER.read_text() + "".join(f"\n//{p.name}\n{p.read_text()}"
                                               for p in stubs)
    return _header


def _key(*parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(str(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:40]


def _lock_for(key: str) -> threading.Lock:
    with _build_locks_lock:
        return _build_locks.setdefault(key, threading.Lock())


def _build(path: Path, command: list, source: str, display: str, what: str) -> None:
    """Run `command` (it writes {out} from {src}) into a temporary file, then move the
    result to `path` at once, so that concurrent processes never see half a library."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=".build-", dir=CACHE_DIR))
    try:
        src, out = workdir / display, workdir / "out.so"
        src.write_text(source)
        argv = [str(out) if a == "{out}" else str(src) if a == "{src}" else a
                for a in command]
        proc = subprocess.run(argv, capture_output=True, text=True, env=_C_LOCALE)
        if proc.returncode != 0:
            log = (proc.stderr + proc.stdout).replace(f"{workdir}{os.sep}", "")
            raise CompileException(f"{what}: {CXX} failed:\n{log}\n--- {display} as compiled:\n"
                                   f"{_numbered(source)}", source)
        os.replace(out, path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _precompiled_header() -> str:
    """The header to -include: a precompiled copy in the cache (a third of each compile's
    time), or emu.h itself if it cannot be built."""
    global _pch
    if _pch is not None:
        return _pch
    folder = CACHE_DIR / f"pch-{_key(_header_text(), _compiler(), CXX_FLAGS)}"
    with _lock_for(str(folder)):
        if _pch is None:
            if not (folder / "emu.h.gch").exists():
                CACHE_DIR.mkdir(parents=True, exist_ok=True)
                work = Path(tempfile.mkdtemp(prefix=".pch-", dir=CACHE_DIR))
                shutil.copy(HEADER, work / "emu.h")
                flags = [f for f in CXX_FLAGS if f != "-shared"]
                proc = subprocess.run([CXX, *flags, "-x", "c++-header", "-o",
                                       str(work / "emu.h.gch"), str(work / "emu.h")],
                                      capture_output=True, text=True, env=_C_LOCALE)
                try:
                    if proc.returncode == 0:
                        os.rename(work, folder)  # atomic; fails if another process won
                except OSError:
                    pass
                shutil.rmtree(work, ignore_errors=True)
            _pch = str(folder / "emu.h") if (folder / "emu.h.gch").exists() else str(HEADER)
    return _pch


def _load_runtime() -> ctypes.CDLL:
    """The launcher library, loaded for all to see (kernels link to it when loaded)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            text = RUNTIME_SOURCE.read_text()
            key = _key(text, _header_text(), _compiler(), RUNTIME_FLAGS)
            path = CACHE_DIR / f"runtime-{key}.so"
            if not path.exists():
                _build(path, [CXX, *RUNTIME_FLAGS, f"-I{NATIVE_DIR}", "-o", "{out}",
                              "{src}"], text, "runtime.cpp", "the emulation's launcher")
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            lib.gpukv_emu_run.restype = None
            _runtime = lib
    return _runtime


class _Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("shared_mem", ctypes.c_uint64), ("fibers", ctypes.c_int32),
                ("ftz", ctypes.c_int32)]


class _Result(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int32), ("signo", ctypes.c_int32),
                ("sigcode", ctypes.c_int32), ("access", ctypes.c_int32),
                ("address", ctypes.c_uint64), ("block", ctypes.c_uint32 * 3),
                ("thread", ctypes.c_uint32 * 3), ("line", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("message", ctypes.c_char * 4096)]


class _Param(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint64), ("kind", ctypes.c_int32),
                ("align", ctypes.c_int32), ("type", ctypes.c_char_p)]


# emu.h's gpukv_emu_kind and gpukv_emu_status
_POINTER, _FLOAT, _INT, _OTHER = 0, 1, 2, 3
_SIGNAL, _BARRIER, _STACK_OVERFLOW, _TRAP = 1, 2, 3, 4
_KIND_WORDS = {_POINTER: "pointer", _FLOAT: "floating-point", _INT: "integer",
               _OTHER: "value"}


class Parameter:
    """One kernel parameter as the compiler sees it: byte size, kind and C type, plus the
    declaration as written (if the source could be read that far)."""

    __slots__ = ("size", "kind", "ctype", "declaration")

    def __init__(self, size: int, kind: int, ctype: str, declaration: str):
        self.size, self.kind, self.ctype, self.declaration = size, kind, ctype, declaration

    def __repr__(self):
        return f"Parameter({self.declaration or self.ctype!r}, {self.size} bytes)"


class _Module:
    """A compiled, loaded source: its library, and whether its threads must run as fibers.

    Fibers are needed only if the compiled code calls the barrier: what the preprocessor
    and the optimiser left decides, not the text (gpukv's optimizer sources spell
    `__syncthreads` in a phase that most of them compile out)."""

    def __init__(self, prepared: PreparedSource, path: Path):
        self.prepared = prepared
        self.synchronises = b"gpukv_emu_barrier" in path.read_bytes()
        self.library = ctypes.CDLL(str(path))
        self.kernels = [name for name in prepared.kernels
                        if hasattr(self.library, f"gpukv_emu_launch__{name}")]

    def parameters(self, name: str) -> list:
        describe = getattr(self.library, f"gpukv_emu_describe__{name}")
        describe.restype = ctypes.c_int
        capacity = 64
        while True:
            out = (_Param * capacity)()
            n = describe(out, capacity)
            if n <= capacity:
                break
            capacity = n
        declared = self.prepared.kernels.get(name, [])
        params = []
        for i in range(n):
            p = out[i]
            pretty = (p.type or b"").decode(errors="replace")
            m = re.search(r"\[with T = (.*)\]$", pretty)
            ctype = m.group(1) if m else pretty
            params.append(Parameter(int(p.size), int(p.kind), ctype,
                                    declared[i] if len(declared) == n else ""))
        return params


_modules: dict = {}


def _compile(prepared: PreparedSource, options: tuple, flags: tuple) -> _Module:
    """The loaded module of `prepared`, compiled now or found in the cache."""
    text = prepared.compiled_text()
    key = _key(text, _header_text(), _compiler(), CXX_FLAGS, flags)
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock_for(key):
        module = _modules.get(key)
        if module is None:
            _load_runtime()  # before any kernel: kernels resolve their symbols against it
            path = CACHE_DIR / f"kernel-{key}.so"
            if not path.exists():
                # The precompiled header must be the first thing included.
                command = [CXX, *CXX_FLAGS, f"-I{STUB_INCLUDE_DIR}", "-include",
                           _precompiled_header(), *flags, "-o", "{out}", "-x", "c++", "{src}"]
                try:
                    try:
                        _build(path, command, text, "kernel.cu", "kernel source")
                    except CompileException as exc:
                        skip = prepared.unexported(exc.get_message())
                        if not skip:
                            raise
                        text = prepared.compiled_text(skip)
                        _build(path, command, text, "kernel.cu", "kernel source")
                except CompileException as exc:
                    raise CompileException(exc.get_message(), text, ",".join(prepared.kernels),
                                           options) from None
            module = _modules[key] = _Module(prepared, path)
    return module


# ================================================================== arguments
# The NumPy scalar types CuPy passes by value ('?bhilqBHILQefdFD'), with their kind.
_SCALAR_KINDS = {np.dtype(c).type: (_FLOAT if c in "efd" else _OTHER if c in "FD" else _INT)
                 for c in "?bhilqBHILQefdFD"}


def _argument(value) -> tuple:
    """(kind, bytes) of a launch argument, converted as CuPy converts it."""
    if value is None:  # meant as NULL (CuPy 13.3 passes garbage: cupy/cupy#9046)
        return _POINTER, _NULL
    if _array_types and isinstance(value, _array_types):
        return _POINTER, int(value.data.ptr).to_bytes(8, "little")
    kind = _SCALAR_KINDS.get(type(value))
    if kind is not None:
        return kind, value.tobytes()
    # CuPy tests int before bool, so a Python bool goes as int64, like any int.
    if isinstance(value, int):
        return _INT, np.int64(value).tobytes()
    if isinstance(value, float):
        return _FLOAT, np.float64(value).tobytes()
    raise TypeError(f"Unsupported type {type(value)}")


_NULL = bytes(8)


def _argument_words(value) -> str:
    """How an argument reads in an error message."""
    if value is None:
        return "None (a null pointer)"
    if isinstance(value, _array_types):
        return f"a {type(value).__name__} (a device pointer)"
    if isinstance(value, np.generic):
        return f"numpy.{type(value).__name__}({value!r})"
    if isinstance(value, int):
        return f"a Python int ({value!r}, passed as int64)"
    return f"a Python float ({value!r}, passed as float64)"


def _pack(kernel: str, params: list, args) -> tuple:
    """(keep-alive buffer, ctypes argument array) for `args`, each checked against its
    parameter: size and kind must match, as a GPU would otherwise misread it."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"kernel {kernel}: args must be a tuple, got {type(args).__name__}")
    if len(args) != len(params):
        listed = ", ".join(p.declaration or p.ctype for p in params)
        raise TypeError(f"kernel {kernel} takes {len(params)} argument(s) ({listed}), "
                        f"{len(args)} given")
    blob = bytearray(16 * max(1, len(args)))
    for i, (value, param) in enumerate(zip(args, params)):
        kind, data = _argument(value)
        if (kind != param.kind and (param.kind != _OTHER or kind == _POINTER)
                or len(data) != param.size):
            what = param.declaration or param.ctype
            expected = f"{param.size}-byte {_KIND_WORDS[param.kind]}"
            raise TypeError(f"kernel {kernel}: argument {i} is {_argument_words(value)}, "
                            f"{len(data)} bytes; parameter {i} `{what}` ({param.ctype}) takes "
                            f"a {expected}")
        blob[16 * i:16 * i + len(data)] = data
    buffer = (ctypes.c_char * len(blob)).from_buffer(blob)
    base = ctypes.addressof(buffer)
    argv = (ctypes.c_void_p * len(args))(*range(base, base + 16 * len(args), 16))
    return (blob, buffer), argv


# ==================================================================== launches
_launch_lock = threading.Lock()  # the runtime keeps one launch's state


def _dims(what: str, kernel: str, value) -> tuple:
    if type(value) is tuple and all(type(v) is int for v in value) and 1 <= len(value) <= 3:
        return value + (1,) * (3 - len(value))  # the usual case, quickly
    if not isinstance(value, tuple):  # CuPy takes tuples only
        raise TypeError(f"Argument '{what}' has incorrect type (expected tuple, got "
                        f"{type(value).__name__})")
    if (not 1 <= len(value) <= 3
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                       for v in value)):
        raise TypeError(f"kernel {kernel}: {what} must be a tuple of 1 to 3 ints, "
                        f"got {value!r}")
    return tuple(int(v) for v in value) + (1,) * (3 - len(value))


def _invalid(kernel: str, why: str) -> InvalidConfigurationError:
    return InvalidConfigurationError("CUDA_ERROR_INVALID_VALUE",
                                     f"invalid argument: kernel {kernel}: {why}")


def _check_configuration(kernel: str, grid: tuple, block: tuple, shared_mem: int,
                         max_shared: int) -> None:
    for what, dims, limits in (("grid", grid, MAX_GRID_DIMS), ("block", block, MAX_BLOCK_DIMS)):
        for axis, n, limit in zip("xyz", dims, limits):
            if n < 1:
                raise _invalid(kernel, f"{what} {dims} is empty along {axis}")
            if n > limit:
                raise _invalid(kernel, f"{what} {dims}: {axis} = {n} is above the limit {limit}")
    threads = block[0] * block[1] * block[2]
    if threads > MAX_THREADS_PER_BLOCK:
        raise _invalid(kernel, f"block {block} has {threads} threads, more than "
                               f"{MAX_THREADS_PER_BLOCK}")
    if not isinstance(shared_mem, (int, np.integer)) or shared_mem < 0:
        raise TypeError(f"kernel {kernel}: shared_mem must be a non-negative int, "
                        f"got {shared_mem!r}")
    if shared_mem > max_shared:
        raise _invalid(kernel, f"{shared_mem} bytes of dynamic shared memory, more than the "
                               f"{max_shared} allowed (max_dynamic_shared_size_bytes)")


def _access_words(access: int) -> str:
    return {1: "reading", 2: "writing"}.get(access, "accessing")


def _fault(kernel: str, result: _Result) -> KernelFaultError:
    """The exception for a failed launch (`result` copied out of the runtime)."""
    block, thread = tuple(result.block), tuple(result.thread)
    where = f"kernel {kernel}, block {block}, thread {thread}"
    note = result.message.decode(errors="replace")
    status = result.status
    if status == _SIGNAL and result.signo in (signal.SIGSEGV, signal.SIGBUS):
        address = int(result.address)
        described = f"address 0x{address:x}"
        if _describe_address is not None:
            try:
                described = str(_describe_address(address))
            except Exception as exc:  # the description must not hide the fault
                described += f" (describing it failed: {type(exc).__name__}: {exc})"
        access = _access_words(result.access)
        return IllegalAddressError(
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            f"an illegal memory access was encountered: {where}: {access} {described}",
            kernel, block, thread, address, access)
    if status == _SIGNAL:
        what = {signal.SIGFPE: "arithmetic fault (integer division by zero?)",
                signal.SIGILL: "illegal instruction"}.get(result.signo, f"signal {result.signo}")
        return KernelFaultError("CUDA_ERROR_LAUNCH_FAILED",
                                f"unspecified launch failure: {where}: {what}",
                                kernel, block, thread)
    if status == _BARRIER:
        return BarrierError("CUDA_ERROR_LAUNCH_FAILED",
                            f"unspecified launch failure: kernel {kernel}, block {block}: "
                            f"{note}", kernel, block, None)
    if status == _STACK_OVERFLOW:
        return KernelFaultError("CUDA_ERROR_LAUNCH_FAILED",
                                f"unspecified launch failure: {where}: stack overflow (a "
                                f"thread has 64 KiB of stack here) at 0x{result.address:x}",
                                kernel, block, thread)
    if status == _TRAP:
        code = "CUDA_ERROR_ASSERT" if note.startswith("assertion") else "CUDA_ERROR_LAUNCH_FAILED"
        return KernelFaultError(code, f"device-side trap: {where}: {note}", kernel, block, thread)
    return KernelFaultError("CUDA_ERROR_LAUNCH_FAILED", f"{where}: {note}", kernel, block, thread)


def _check_stream(kernel: str, stream) -> None:
    """A launch's stream: None (the current one) or a stream of the current GPU."""
    if stream is None:
        return
    if not hasattr(stream, "ptr"):
        raise AttributeError(f"'{type(stream).__name__}' object has no attribute 'ptr'")
    owner = getattr(stream, "device_id", -1)
    from . import runtime
    if owner not in (-1, runtime.current_device()):
        raise CUDADriverError("CUDA_ERROR_INVALID_HANDLE",
                              f"invalid resource handle: kernel {kernel} launched with GPU "
                              f"{runtime.current_device()} current on a stream of GPU {owner}")


class Function:
    """One kernel of a compiled module, callable as CuPy's `Function`."""

    def __init__(self, module: _Module, name: str):
        if name not in module.kernels:
            known = ", ".join(sorted(module.kernels)) or "none"
            raise CUDADriverError(
                "CUDA_ERROR_NOT_FOUND",
                f"named symbol not found: no extern \"C\" __global__ function {name!r} in the "
                f"module (its kernels: {known})")
        self.name = name
        self.module = module
        self.params = module.parameters(name)
        self.fibers = module.synchronises
        self.max_dynamic_shared_size_bytes = DEFAULT_MAX_DYNAMIC_SHARED
        self._launch = getattr(module.library, f"gpukv_emu_launch__{name}")
        self._launch.restype = None

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        """Queue the kernel on `stream` (None: the current one), which must be a stream of
        the current GPU, as cuLaunchKernel requires; it runs on the thread that forces it
        (or at once, in the issue-order schedule)."""
        _check_stream(self.name, stream)
        grid = _dims("grid", self.name, grid)
        block = _dims("block", self.name, block)
        _check_configuration(self.name, grid, block, shared_mem,
                             min(MAX_DYNAMIC_SHARED, self.max_dynamic_shared_size_bytes))
        keep, argv = _pack(self.name, self.params, args)  # argv points into `keep`
        config = _Config(grid, block, int(shared_mem), int(self.fibers), FLUSH_TO_ZERO)
        from . import kernel_access, runtime, streams
        device = runtime.current_device()
        lane = runtime.lane_of(stream)
        accesses = [(lane, p, n, w, m) for p, n, w, m in kernel_access.ranges(self, args)]

        def run():
            result = _Result()
            with runtime.Device(device), _launch_lock, _launch_guard():
                self._launch(ctypes.byref(config), argv, ctypes.byref(result))
            if result.status:
                raise _fault(self.name, result)

        streams.issue(lane, run, f"kernel {self.name}", accesses=accesses,
                      keep=(keep, argv, tuple(args)))


# ======================================================== RawKernel, RawModule
def _check_common(code, options, backend, translate_cucomplex) -> None:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(options, tuple):
        raise TypeError(f"options must be a tuple, got {type(options).__name__}")
    if backend not in ("nvrtc", "nvcc"):
        raise ValueError(f"Invalid backend {backend}")
    if translate_cucomplex:
        raise NotImplementedError("translate_cucomplex=True is not emulated on the CPU")


class RawModule:
    """CuPy's RawModule for source code: `get_function(name)` gives a kernel."""

    def __init__(self, *, code=None, path=None, options=(), backend="nvrtc",
                 translate_cucomplex=False, enable_cooperative_groups=False,
                 name_expressions=None, jitify=False):
        if path is not None:
            raise NotImplementedError("RawModule(path=...) loads a compiled cubin/PTX, which "
                                      "cannot run on the CPU emulation; pass the source as code=")
        if code is None:
            raise TypeError("RawModule: code (the CUDA source) is required")
        _check_common(code, options, backend, translate_cucomplex)
        if name_expressions is not None:
            raise NotImplementedError("name_expressions (C++ template kernels) are not "
                                      "emulated; declare kernels extern \"C\"")
        self.code = code
        self.options = options
        self.backend = backend
        self.translate_cucomplex = translate_cucomplex
        self.enable_cooperative_groups = enable_cooperative_groups
        self.name_expressions = name_expressions
        self.jitify = jitify
        self.file_path = None
        self._prepared = PreparedSource(code)  # refuses unknown PTX now
        self._flags = gxx_options(options, code)
        self._module = None
        self._functions: dict = {}
        self._lock = threading.Lock()

    def compile(self, log_stream=None):
        """Compile now (else the first `get_function` does)."""
        with self._lock:
            if self._module is None:
                self._module = _compile(self._prepared, self.options, self._flags)
        return self._module

    def get_function(self, name: str) -> Function:
        module = self.compile()
        with self._lock:
            fn = self._functions.get(name)
            if fn is None:
                fn = self._functions[name] = Function(module, name)
        return fn


class RawKernel:
    """CuPy's RawKernel: `kernel(grid, block, args, *, shared_mem=0, stream=None)`; the
    source is prepared (and unknown PTX refused) now, compiled at the first call."""

    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, jitify=False):
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        self._module = RawModule(code=code, options=options, backend=backend,
                                 translate_cucomplex=translate_cucomplex,
                                 enable_cooperative_groups=enable_cooperative_groups,
                                 jitify=jitify)
        self.code = code
        self.name = name
        self.options = options
        self.backend = backend
        self.translate_cucomplex = translate_cucomplex
        self.enable_cooperative_groups = enable_cooperative_groups
        self.jitify = jitify
        self.file_path = None
        self._function = None

    def compile(self, log_stream=None) -> None:
        """Compile now (else the first call does), and find the kernel."""
        self.kernel  # noqa: B018  (compiles)

    @property
    def kernel(self) -> Function:
        """The compiled kernel (CuPy's `Function`)."""
        fn = self._function
        if fn is None:
            fn = self._function = self._module.get_function(self.name)
        return fn

    @property
    def max_threads_per_block(self) -> int:
        return MAX_THREADS_PER_BLOCK

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.kernel.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        if not 0 <= value <= MAX_DYNAMIC_SHARED:
            raise _invalid(self.name, f"max_dynamic_shared_size_bytes={value} is outside "
                                      f"[0, {MAX_DYNAMIC_SHARED}]")
        self.kernel.max_dynamic_shared_size_bytes = int(value)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        self.kernel(grid, block, args, shared_mem=shared_mem, stream=stream)

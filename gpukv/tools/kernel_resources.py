"""What gpukv's CUDA kernels cost on real GPUs, found without one.

NVRTC compiles a kernel source to PTX for an architecture (with the options CuPy would
use), `ptxas -v` (from the `nvidia-cuda-nvcc-cu12` wheel) assembles it for that
architecture and reports registers, shared memory, stack frame and spills, and CUDA's
occupancy rules turn those into the blocks and warps an SM keeps resident at the block
size gpukv launches with.

Every kernel here streams: a handful of arithmetic operations per element against at
least a few bytes read and written, far below the FLOP-per-byte balance of any of these
GPUs, so each is memory-bound and its time is bytes moved / bandwidth. How much of the
HBM bandwidth it can reach is estimated with Little's law: an SM must keep
bandwidth x latency / SMs bytes in flight, and a kernel with one element per thread in
flight keeps (resident warps x 32 x bytes moved per element) there.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from . import nvrtc

#: options CuPy adds to every module's own when it compiles (cupy/cuda/compiler.py)
CUPY_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


@dataclass(frozen=True)
class Arch:
    """One GPU architecture's per-SM limits (CUDA C++ Programming Guide, "Technical
    Specifications per Compute Capability"; allocation units from the CUDA Occupancy
    Calculator, cuda_occupancy.h) and the HBM of its flagship data-center GPU."""

    name: str            # ptxas's -arch
    gpu: str             # the GPU its bandwidth figures are for
    max_warps: int       # resident warps per SM
    max_blocks: int      # resident blocks per SM
    max_threads: int     # resident threads per SM
    registers: int       # 32-bit registers per SM
    smem_per_sm: int     # bytes of shared memory per SM, largest carveout
    sms: int             # SMs of `gpu`
    hbm_gbs: float       # HBM bandwidth of `gpu`, GB/s
    reg_unit: int = 256          # registers are given to a warp in units of this many
    sub_partitions: int = 4      # register file quarters, each serving its own warps
    smem_unit: int = 128         # shared memory is given to a block in units of bytes
    smem_reserved: int = 1024    # bytes the system keeps per block (compute 8.0 and up)


ARCHS = (
    # compute 8.0: 164 KB shared per SM; A100 SXM4 80 GB: 108 SMs, 2039 GB/s
    Arch("sm_80", "A100 SXM4 80GB", 64, 32, 2048, 65536, 164 * 1024, 108, 2039.0),
    # compute 9.0: 228 KB shared per SM; H100 SXM5: 132 SMs, 3352 GB/s
    Arch("sm_90", "H100 SXM5", 64, 32, 2048, 65536, 228 * 1024, 132, 3352.0),
    # compute 10.0: 228 KB shared per SM; B200: 148 SMs, 8000 GB/s
    Arch("sm_100", "B200", 64, 32, 2048, 65536, 228 * 1024, 148, 8000.0),
)
ARCH_BY_NAME = {a.name: a for a in ARCHS}

#: loaded HBM latency assumed by the bandwidth estimate (a round figure for these GPUs)
DRAM_LATENCY_S = 600e-9
WARP = 32


class KernelToolMissing(RuntimeError):
    """NVRTC or ptxas is not installed (or not usable): the message says which and how."""


# ------------------------------------------------------------------------ occupancy
@dataclass(frozen=True)
class Occupancy:
    blocks: int          # resident blocks per SM
    warps: int           # resident warps per SM
    fraction: float      # warps / the SM's most
    limiter: str         # what stops one more block: registers, shared memory, ...


def occupancy(arch: Arch, registers: int, smem: int, threads: int) -> Occupancy:
    """Resident blocks and warps per SM of a kernel using `registers` per thread and `smem`
    bytes of shared memory per block (static + dynamic), launched with `threads` per block
    (cudaOccMaxActiveBlocksPerMultiprocessor's rules)."""
    if not 1 <= threads <= 1024:
        raise ValueError(f"threads per block must be in 1..1024, got {threads}")
    warps_per_block = -(-threads // WARP)
    limits = {"blocks per SM": arch.max_blocks,
              "threads per SM": arch.max_threads // (warps_per_block * WARP)}
    if registers > 0:
        per_warp = -(-registers * WARP // arch.reg_unit) * arch.reg_unit
        warps_per_part = arch.registers // arch.sub_partitions // per_warp
        limits["registers"] = warps_per_part // -(-warps_per_block // arch.sub_partitions)
    per_block = -(-(smem + arch.smem_reserved) // arch.smem_unit) * arch.smem_unit
    limits["shared memory"] = arch.smem_per_sm // per_block
    limiter = min(limits, key=lambda k: limits[k])
    blocks = max(0, limits[limiter])
    warps = blocks * warps_per_block
    return Occupancy(blocks, warps, warps / arch.max_warps, limiter)


def hbm_fraction(arch: Arch, warps: int, element_bytes: float) -> float:
    """The fraction of `arch`'s HBM bandwidth that `warps` resident warps per SM, each
    thread with one element's traffic (`element_bytes`, read and written) in flight, can
    keep busy (Little's law; at most 1)."""
    needed = arch.hbm_gbs * 1e9 * DRAM_LATENCY_S / arch.sms
    return min(1.0, warps * WARP * element_bytes / needed)


# --------------------------------------------------------------------------- ptxas
@dataclass
class Resources:
    """What ptxas -v says of one kernel for one architecture."""

    kernel: str
    arch: str
    registers: int = 0
    smem: int = 0             # static shared memory, bytes
    stack: int = 0            # stack frame, bytes
    spill_stores: int = 0
    spill_loads: int = 0
    lmem: int = 0             # local memory, bytes
    barriers: int = 0

    def problems(self) -> list:
        """Local memory in any form (spills, a stack frame, lmem): slow on a GPU."""
        found = [f"{v} bytes {what}" for what, v in (
            ("spill stores", self.spill_stores), ("spill loads", self.spill_loads),
            ("stack frame", self.stack), ("lmem", self.lmem)) if v]
        return found


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                    r"(\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_FIELDS = {"smem": re.compile(r"(\d+) bytes smem"), "lmem": re.compile(r"(\d+) bytes lmem"),
           "barriers": re.compile(r"used (\d+) barriers")}


def parse_ptxas(log: str) -> list:
    """[Resources] of every entry function in a `ptxas -v` log."""
    out: list = []
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            out.append(Resources(m.group(1), m.group(2)))
            continue
        if not out:
            continue
        r = out[-1]
        m = _PROPS.search(line)
        if m:
            r.stack, r.spill_stores, r.spill_loads = (int(g) for g in m.groups())
        m = _USED.search(line)
        if m:
            r.registers = int(m.group(1))
            for name, pattern in _FIELDS.items():
                f = pattern.search(line)
                if f:
                    setattr(r, name, int(f.group(1)))
    return out


def find_ptxas() -> str:
    """ptxas: GPUKV_PTXAS, else the nvidia-cuda-nvcc-cu12 (or CUDA 13 nvidia-cuda-nvcc)
    wheel's, else on PATH."""
    explicit = os.environ.get("GPUKV_PTXAS", "")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise KernelToolMissing(f"GPUKV_PTXAS={explicit!r} is not an executable")
        return explicit
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for folder in ("cuda_nvcc", "cu13"):  # CUDA 12's wheel layout, then CUDA 13's
            path = os.path.join(root, folder, "bin", "ptxas")
            if os.access(path, os.X_OK):
                return path
    found = shutil.which("ptxas")
    if found:
        return found
    raise KernelToolMissing("no ptxas found (pip install nvidia-cuda-nvcc-cu12, or set "
                            "GPUKV_PTXAS to a ptxas executable)")


def find_nvrtc() -> nvrtc.Nvrtc:
    """NVRTC, or KernelToolMissing saying why not."""
    compiler, why = nvrtc.load()
    if compiler is None:
        raise KernelToolMissing(why)
    return compiler


def compile_resources(compiler: nvrtc.Nvrtc, ptxas: str, source: str, options: Iterable,
                      arch: str, ptxas_options: Iterable = ()) -> list:
    """[Resources] of every kernel of `source` on `arch` ('sm_90'): NVRTC to PTX for
    compute_XX with CuPy's options, then ptxas -v (with `ptxas_options` too).
    NvrtcError or RuntimeError on failure."""
    _, ptx = compiler.compile(source, [*options, *CUPY_OPTIONS],
                              arch.replace("sm_", "compute_"))
    with tempfile.TemporaryDirectory(prefix="gpukv-ptxas-") as work:
        path = os.path.join(work, "kernel.ptx")
        with open(path, "wb") as f:
            f.write(ptx.rstrip(b"\0"))
        proc = subprocess.run([ptxas, "-v", *ptxas_options, f"-arch={arch}", "-o",
                               os.devnull, path],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas -arch={arch} failed:\n{proc.stderr}{proc.stdout}")
    return parse_ptxas(proc.stderr + proc.stdout)


# -------------------------------------------------------------------- the kernels
@dataclass
class KernelCase:
    """One kernel gpukv launches, as the report shows it: the source and options it is
    compiled from, the threads per block it is launched with, and the bytes it reads and
    writes per element (`traffic` says for which case)."""

    label: str
    kernel: str
    source: str
    options: tuple
    threads: int
    read: float
    written: float
    traffic: str
    resources: dict = field(default_factory=dict)  # arch -> Resources


def _itemsize(name: str) -> int:
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def _sum_cases() -> list:
    from ..device.cuda import kernels as k
    pairs = [("float32", "float32"), ("float16", "float32"), ("float16", "float16"),
             ("float64", "float64")]
    try:
        import ml_dtypes  # noqa: F401  (names NumPy's bfloat16)
        pairs.insert(3, ("bfloat16", "float32"))
    except ImportError:
        pass
    cases = []
    for t, u in pairs:
        name, source = k.sum_source(np.dtype(t), np.dtype(u))
        ti, ui = _itemsize(t), _itemsize(u)
        cases.append(KernelCase(f"sum {t}->{u}", name, source, k.COMPILE_OPTIONS, k.THREADS,
                                2 * ti, ui, "2 terms"))
    name, source = k.segment_sum_source(np.dtype("float32"))
    cases.append(KernelCase("row-sparse run sum float32", name, source, k.COMPILE_OPTIONS,
                            k.SEGMENT_THREADS, 4, 1, "per row read, runs of 4 rows"))
    return cases


def _compression_cases() -> list:
    """The CUDA kernels every registered compressor declares (`Compressor.kernels`)."""
    from ..device.cuda import codec_kernels as c
    from ..encoding.compressors import registered
    threads = 256  # what codec_kernels.launch launches with
    return [KernelCase(k.label, k.function, c.CUDA_SOURCE, c.COMPILE_OPTIONS, threads,
                       k.read, k.written, k.traffic)
            for cls in registered() for k in cls.kernels]


def _optimizer_cases() -> list:
    from ..device.cuda import optim_kernels as o
    from ..optim import registered
    cases = []
    for cls in registered():
        opt = cls()
        states = len(opt.state_names())
        phases = (1, 2) if getattr(opt, "per_key_norms", False) else (0,)
        for phase in phases:
            source = o.kernel_source(opt, np.dtype("float32"), phase)
            if phase == 2:  # w -= lr * r * d: reads w and d, writes w
                read, written, why = 8.0, 4.0, "float32 weights"
            else:  # w and g in, each state in and out, w (or d) out
                read, written = 4.0 * (2 + states), 4.0 * (1 + states)
                why = f"float32 weights, {states} state(s)"
            label = f"{opt.name} step" + (f" phase {phase}" if phase else "")
            cases.append(KernelCase(label, "gpukv_optim_step", source, ("--fmad=false",),
                                    o.BLOCK, read, written, why))
    return cases


def kernel_cases() -> list:
    """One case per kernel gpukv launches (sums for the common dtype pairs, every
    compression kernel, every optimizer's step with float32 weights and default options)."""
    return _sum_cases() + _compression_cases() + _optimizer_cases()


def measure(cases: list, archs=ARCHS, jobs: int | None = None,
            progress: Callable | None = None) -> list:
    """Fill each case's `resources` for every arch (compiling in parallel); returns
    `cases`. KernelToolMissing when NVRTC or ptxas is missing."""
    from concurrent.futures import ThreadPoolExecutor
    compiler, ptxas = find_nvrtc(), find_ptxas()
    units = {(c.source, c.options, a.name) for c in cases for a in archs}

    def run(unit):
        source, options, arch = unit
        return unit, compile_resources(compiler, ptxas, source, options, arch)

    found: dict = {}
    with ThreadPoolExecutor(max_workers=jobs or min(8, os.cpu_count() or 1)) as pool:
        for unit, resources in pool.map(run, sorted(units)):
            found[unit] = {r.kernel: r for r in resources}
    for c in cases:
        for a in archs:
            c.resources[a.name] = found[(c.source, c.options, a.name)][c.kernel]
    return cases


# ----------------------------------------------------------------------- rendering
def report_rows(cases: list, archs=ARCHS) -> list:
    """One dict per (case, arch): resources, occupancy and the bandwidth estimate."""
    rows = []
    for c in cases:
        for a in archs:
            r = c.resources[a.name]
            occ = occupancy(a, r.registers, r.smem, c.threads)
            rows.append({
                "kernel": c.label, "function": c.kernel, "arch": a.name, "gpu": a.gpu,
                "registers": r.registers, "smem": r.smem, "spills": r.problems(),
                "threads": c.threads, "blocks_per_sm": occ.blocks, "warps_per_sm": occ.warps,
                "occupancy": occ.fraction, "limiter": occ.limiter,
                "bytes_read": c.read, "bytes_written": c.written, "traffic": c.traffic,
                "hbm_fraction": hbm_fraction(a, occ.warps, c.read + c.written)})
    return rows


def render(rows: list, archs=ARCHS) -> str:
    """The table `gpukv info --kernels` prints."""
    head = (f"{'kernel':<28} {'arch':<6} {'regs':>4} {'smem':>5} {'block':>5} "
            f"{'blk/SM':>6} {'occup.':>6}  {'limited by':<14} {'B/elem r+w':>11} "
            f"{'HBM est.':>8}  spills")
    lines = [head, "-" * len(head)]
    for r in rows:
        traffic = f"{r['bytes_read']:g}+{r['bytes_written']:g}"
        lines.append(f"{r['kernel']:<28} {r['arch']:<6} {r['registers']:>4} {r['smem']:>5} "
                     f"{r['threads']:>5} {r['blocks_per_sm']:>6} {r['occupancy']:>6.0%}  "
                     f"{r['limiter']:<14} {traffic:>11} {r['hbm_fraction']:>8.0%}  "
                     f"{', '.join(r['spills']) or 'none'}")
    lines += [
        "",
        "All of these kernels stream memory with a few operations per element: they are",
        "memory-bound and take (bytes read + written) / bandwidth. B/elem r+w: bytes read +",
        "written per element (sums of 2 terms, optimizer steps on float32 weights with",
        "default options, dequantize without accumulate, run sums of 4 rows).",
        "HBM est.: the share of the bandwidth the resident warps can keep busy (Little's",
        "law: one element's bytes in flight per thread, "
        f"{DRAM_LATENCY_S * 1e9:.0f} ns latency assumed), on:",
    ]
    lines += [f"  {a.name}: {a.gpu}, {a.sms} SMs, {a.hbm_gbs:g} GB/s" for a in archs]
    return "\n".join(lines)

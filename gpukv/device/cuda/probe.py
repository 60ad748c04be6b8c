"""Facts about this machine and its GPUs, as plain Python data.

P2P link ranks and peer access between GPUs, GPU names and memory, the CPU model, the
versions of CuPy, CUDA and NCCL. The layers above turn these into link matrices and
reports; nothing here plans or decides. CuPy is imported only when a GPU fact is asked
for, and every question has an answer without CuPy, a driver or a GPU (empty, None, or
an error text), except where a function says it raises.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import platform
import time
import warnings

import numpy as np

from . import device as _device
from . import nccl as _nccl
from .driver import (
    CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED,
    CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK,
    cuda_driver,
)

log = logging.getLogger("gpukv")

__all__ = ["p2p_ranks", "peer_access", "gpu_properties", "gpu_names", "no_gpu_reason",
           "cupy_versions", "first_compile", "gpu_versions", "nccl_versions", "cpu_model",
           "free_memory", "release_cached_memory", "synchronize"]


def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip().rstrip(":")


def _text(name) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def _runtime():
    return _device.cupy_module().cuda.runtime


# ------------------------------------------------------------------- links
def p2p_ranks(ordinals, *, runtime=None, driver=None) -> dict:
    """{(a, b): CUDA P2P performance rank} of the ordered pairs of distinct GPUs among
    `ordinals` that have peer access (lower rank: faster link); pairs without access are
    left out.

    The CUDA driver API is asked first (`cuDeviceGetP2PAttribute` of libcuda, through
    ctypes: CuPy's runtime module has no `deviceGetP2PAttribute`); `driver` is that
    library or a stand-in, loaded by default unless a `runtime` is given. Without a
    usable driver the runtime (`runtime`, default `cupy.cuda.runtime`) is asked:
    `deviceCanAccessPeer`, and the rank where it has `deviceGetP2PAttribute`, else 0.
    """
    distinct = sorted({int(o) for o in ordinals})
    if len(distinct) < 2:
        return {}
    if driver is None and runtime is None:
        driver = cuda_driver()
    ranks = _driver_ranks(driver, distinct) if driver is not None else None
    if ranks is None:
        ranks = _runtime_ranks(_runtime() if runtime is None else runtime, distinct)
    return ranks


def _driver_ranks(driver, ordinals) -> dict | None:
    """`p2p_ranks` from the CUDA driver API; None when a driver call fails.

    Driver ordinals index the GPUs this process sees after `CUDA_VISIBLE_DEVICES` (and
    `CUDA_DEVICE_ORDER`), exactly as the runtime's, hence CuPy's, device ids do.
    """
    def call(fn, *args):
        status = fn(*args)
        if status != 0:
            raise OSError(f"{getattr(fn, '__name__', 'CUDA driver call')} returned {status}")

    try:
        call(driver.cuInit, 0)
        handles = {}
        for ordinal in ordinals:
            dev = ctypes.c_int()
            call(driver.cuDeviceGet, ctypes.pointer(dev), ordinal)
            handles[ordinal] = dev.value
        ranks = {}
        for a, b in itertools.permutations(ordinals, 2):
            value = ctypes.c_int()
            call(driver.cuDeviceGetP2PAttribute, ctypes.pointer(value),
                 CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, handles[a], handles[b])
            if not value.value:
                continue
            call(driver.cuDeviceGetP2PAttribute, ctypes.pointer(value),
                 CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, handles[a], handles[b])
            ranks[a, b] = int(value.value)
    except OSError as exc:
        log.debug("gpukv: CUDA driver P2P query failed (%s); asking the runtime", exc)
        return None
    return ranks


def _runtime_ranks(runtime, ordinals) -> dict:
    """`p2p_ranks` from the CUDA runtime: pairs `deviceCanAccessPeer` accepts, ranked by
    `deviceGetP2PAttribute` where the runtime has it, else all 0."""
    rank_attr = getattr(runtime, "cudaDevP2PAttrPerformanceRank", 1)
    access_attr = getattr(runtime, "cudaDevP2PAttrAccessSupported", 2)
    get_attr = getattr(runtime, "deviceGetP2PAttribute", None)
    ranks = {}
    for a, b in itertools.permutations(ordinals, 2):
        if not runtime.deviceCanAccessPeer(a, b):
            continue
        rank = 0
        if get_attr is not None:
            try:
                if not get_attr(access_attr, a, b):
                    continue
                rank = int(get_attr(rank_attr, a, b))
            except Exception:  # an old runtime without the attribute: access is enough
                rank = 0
        ranks[a, b] = rank
    return ranks


def peer_access(ordinals) -> list:
    """access[i][j]: whether GPU ordinals[i] can read GPU ordinals[j]'s memory (the same
    GPU always can). Raises what CUDA raises when it cannot be asked."""
    runtime = _runtime()
    return [[a == b or bool(runtime.deviceCanAccessPeer(a, b)) for b in ordinals]
            for a in ordinals]


# -------------------------------------------------------------------- GPUs
def gpu_properties() -> list:
    """One dict per visible GPU: id, name, memory_GiB, compute_capability,
    multiprocessors ([] without a GPU)."""
    count = _device.gpu_count()
    if not count:
        return []
    runtime = _runtime()
    out = []
    for p in range(count):
        props = runtime.getDeviceProperties(p)
        out.append({"id": p, "name": _text(props["name"]),
                    "memory_GiB": round(props["totalGlobalMem"] / 2**30, 1),
                    "compute_capability": f"{props['major']}.{props['minor']}",
                    "multiprocessors": props.get("multiProcessorCount")})
    return out


def gpu_names() -> list:
    """Names of the GPUs this process sees ([] without CuPy, a driver or a GPU)."""
    try:
        return [g["name"] for g in gpu_properties()]
    except Exception:
        return []


def no_gpu_reason() -> str:
    """Why no GPU is visible: CuPy missing, CUDA unusable, or no device."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runtime = _runtime()
    except Exception:
        return ("CuPy is not installed (pip install cupy-cuda12x, or cupy-cuda13x for "
                "CUDA 13; in a gpukv checkout, pip install '.[cuda12]' or '.[cuda13]')")
    try:
        n = runtime.getDeviceCount()
    except Exception as exc:
        return f"CUDA is unusable: {_error_text(exc)}"
    return "no CUDA device is visible" if n == 0 else "unknown"


def free_memory(physical: int) -> int:
    """Bytes GPU `physical` can still hand out: free device memory plus the blocks
    CuPy's memory pool holds unused."""
    cp = _device.cupy_module()
    with cp.cuda.Device(physical):
        free, _ = cp.cuda.runtime.memGetInfo()
    return int(free + cp.get_default_memory_pool().free_bytes())


def release_cached_memory() -> None:
    """Give the unused blocks of CuPy's memory pool back to the GPUs."""
    _device.cupy_module().get_default_memory_pool().free_all_blocks()


def synchronize(physical_ids) -> None:
    """Wait until every GPU of `physical_ids` has finished all its work."""
    cp = _device.cupy_module()
    for p in physical_ids:
        cp.cuda.Device(p).synchronize()


# ----------------------------------------------------------------- versions
def _cuda_version(v: int) -> str:
    """12090 -> '12.9' (CUDA's encoding: 1000 * major + 10 * minor)."""
    if not v:
        return "none"
    return f"{v // 1000}.{(v % 1000) // 10}"


def _nccl_version(v: int) -> str:
    """NCCL's integer code -> 'major.minor.patch' (2.18+: 10000 * major + 100 * minor)."""
    v = int(v)
    if v >= 10000:
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"


def cupy_versions() -> dict:
    """{'installed', 'version', 'cuda_runtime', 'cuda_driver'} ('12.9' style) of the CuPy
    gpukv uses; 'error' says why CuPy or a version is unusable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cp = _device.cupy_module()
    except Exception as exc:
        cause = exc.__cause__ or exc
        return {"installed": False, "error": _error_text(cause)}
    out = {"installed": True, "version": getattr(cp, "__version__", None)}
    for key, name in (("cuda_runtime", "runtimeGetVersion"),
                      ("cuda_driver", "driverGetVersion")):
        try:
            out[key] = _cuda_version(getattr(cp.cuda.runtime, name)())
        except Exception as exc:
            out[key] = None
            out.setdefault("error", _error_text(exc))
    return out


def first_compile(physical: int) -> tuple[str, float]:
    """(name, seconds) of one of gpukv's kernels (the float32 sum) compiled on GPU
    `physical`; raises what CuPy raises when it cannot compile."""
    from . import kernels
    cupy = _device.cupy_module()
    name, source = kernels.sum_source(np.float32, np.float32)
    start = time.perf_counter()
    with cupy.cuda.Device(physical):
        kernels.compiled(cupy, name, source).compile()
    return name, time.perf_counter() - start


def gpu_versions(cp=None) -> dict:
    """{'cupy', 'cuda_runtime', 'cuda_driver', 'nccl'} as CuPy reports them (integer
    codes for CUDA and NCCL; 'nccl' None when it does not load), of `cp` (CuPy or a
    stand-in; default the CuPy gpukv uses). Raises what CuPy raises without a GPU."""
    cp = _device.cupy_module() if cp is None else cp
    out = {"cupy": getattr(cp, "__version__", None),
           "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
           "cuda_driver": cp.cuda.runtime.driverGetVersion()}
    try:
        out["nccl"] = _nccl.nccl_module().get_version()
    except Exception:
        out["nccl"] = None
    return out


def nccl_versions() -> dict:
    """{'available', 'version', 'build_version'} of CuPy's NCCL binding ('2.18.3' style);
    'reason' says why it is unavailable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
    except Exception as exc:
        return {"available": False, "reason": _error_text(exc)}
    if not getattr(nccl, "available", False):
        return {"available": False,
                "reason": "CuPy cannot load libnccl (pip install 'nvidia-nccl-cu12', or "
                          "nvidia-nccl-cu13 with cupy-cuda13x)"}
    out: dict[str, object] = {"available": True}
    try:
        out["version"] = _nccl_version(nccl.get_version())
    except Exception as exc:
        out["version_error"] = _error_text(exc)
    try:
        out["build_version"] = _nccl_version(nccl.get_build_version())
    except Exception:
        pass
    return out


# ------------------------------------------------------------------ machine
def cpu_model(default: str = "") -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux), else platform's guess,
    else `default`."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or default

"""Where gpucheck runs (a real GPU, or the checkout's CUDA emulation) and what it sees there.

The emulation (tests/cuda_emulation, installed as `cupy` as the test suite installs it) is
used only when asked for with `GPUKV_CUDA_EMULATION=1`, so that a machine whose GPU is
broken is never measured on a stand-in by mistake.
"""
from __future__ import annotations

import importlib
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..._env import flag
from ..._errors import ArgumentError
from .section import Section


def checkout_root() -> Path | None:
    """The source tree gpukv runs from, when it has the test suite beside it."""
    root = Path(__file__).resolve().parents[3]
    if (root / "tests" / "gpu_env.py").is_file() and (root / "tests" / "conftest.py").is_file():
        return root
    return None


@dataclass
class Machine:
    emulated: bool
    root: Path | None
    gpus: list            # [{'id', 'name', 'memory_GiB', 'compute_capability', ...}]
    #                       (empty until the environment step has found them)

    @property
    def name(self) -> str:
        if self.emulated:
            return "CUDA emulation"
        return self.gpus[0]["name"] if self.gpus else "unknown GPU"  # (not yet) known


EMULATION_ENV = "GPUKV_CUDA_EMULATION"


def wants_emulation() -> bool:
    """Whether GPUKV_CUDA_EMULATION=1 asks for the emulation; an ArgumentError names any
    value but 1, 0 or unset (a misspelled 'yes' must not measure the real GPU unasked,
    nor 'no' a stand-in)."""
    return bool(flag(EMULATION_ENV))


def open_machine() -> Machine | str:
    """The machine to check, or one line saying why there is none."""
    root = checkout_root()
    try:
        emulated = wants_emulation()
    except ArgumentError as exc:
        return str(exc)
    if emulated:
        if root is None:
            return ("GPUKV_CUDA_EMULATION=1, but the CUDA emulation lives in a checkout's "
                    "tests/ and none is beside this gpukv")
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        # the test suite's own installer of the emulation
        importlib.import_module("tests.gpu_env").install()
    from ...device.cuda import probe
    try:
        gpus = probe.gpu_properties()
    except Exception as exc:  # a driver that answers with an error
        return f"CUDA is unusable here: {type(exc).__name__}: {exc}"
    if not gpus:
        return (f"no GPU here ({probe.no_gpu_reason()}); in a checkout, "
                "GPUKV_CUDA_EMULATION=1 runs the check on the CUDA emulation")
    return Machine(emulated, root, gpus)


def describe(machine: Machine) -> Section:
    """The environment section: GPUs, driver, CUDA runtime, CuPy, NCCL, PyTorch, peer access."""
    from ...device.cuda import probe
    from ...device.cuda.device import gpu_devices
    section = Section("environment")
    section.line = machine.name
    data = section.data
    data["emulated"] = machine.emulated
    data["gpus"] = machine.gpus
    data["host"] = {"python": platform.python_version(), "cpu": probe.cpu_model(),
                    "logical_cpus": os.cpu_count(), "platform": platform.platform(),
                    "numpy": np.__version__}
    # each step is kept before the next: a driver or library that hangs is named
    section.progress(running="CuPy's versions")
    data["cupy"] = probe.cupy_versions()
    section.progress(running="NCCL (libnccl)")
    data["nccl"] = probe.nccl_versions()
    physical = [g["id"] for g in machine.gpus]
    section.progress(running="peer access")
    try:
        data["peer_access"] = probe.peer_access(physical)
    except Exception as exc:
        section.fail(f"peer access could not be asked: {type(exc).__name__}: {exc}")
    section.progress(running="gpukv's devices")
    try:
        data["logical_devices"] = len(gpu_devices())
    except Exception as exc:
        section.fail(f"gpukv's devices: {type(exc).__name__}: {exc}")
    section.progress(running="PyTorch and its CUDA")
    data["torch"] = torch_facts()
    data["ml_dtypes"] = ml_dtypes_facts()
    if data["cupy"].get("error"):
        section.fail(f"CuPy: {data['cupy']['error']}")
    else:
        section.progress(running="the first kernel's compile")
        data["first_compile"] = first_compile(section, physical[0])
    section.line = environment_line(data, machine)
    return section


def first_compile(section: Section, physical: int) -> dict:
    """One of gpukv's kernels compiled on GPU `physical`, timed: a CuPy that cannot compile
    (no NVRTC, no CUDA headers where CuPy 14 looks for them) is named here once, before
    every kernel case fails with the same error."""
    from ...device.cuda import probe
    try:
        name, seconds = probe.first_compile(physical)
    except Exception as exc:
        section.fail(f"CuPy cannot compile gpukv's kernels: {type(exc).__name__}: {exc}")
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "kernel": name, "seconds": round(seconds, 3)}


def ml_dtypes_facts() -> dict:
    """Whether NumPy has bfloat16 here (ml_dtypes): without it the bfloat16 kernel cases
    and tests skip; 0.7 and later round float64 to bfloat16 unlike the kernels."""
    try:
        import ml_dtypes
    except ImportError:
        return {"installed": False, "note": "bfloat16 kernel cases and tests skip"}
    version = getattr(ml_dtypes, "__version__", "?")
    out = {"installed": True, "version": version}
    if _at_least(version, (0, 7)):
        out["note"] = "gpukv needs ml_dtypes below 0.7 (docs/limits.md)"
    return out


def _at_least(version: str, bound: tuple) -> bool:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= bound


def torch_facts() -> dict:
    try:
        import torch
    except Exception as exc:
        return {"installed": False, "reason": f"{type(exc).__name__}: {exc}"}
    out = {"installed": True, "version": torch.__version__,
           "cuda": getattr(torch.version, "cuda", None),
           "cuda_available": bool(torch.cuda.is_available())}
    if out["cuda_available"]:
        out["device"] = torch.cuda.get_device_name(0)
    return out


def environment_line(data: dict, machine: Machine) -> str:
    gpus = machine.gpus
    first = gpus[0]
    what = (f"{len(gpus)} x {first['name']}" if len(gpus) > 1 else first["name"])
    cupy, nccl, torch = data["cupy"], data["nccl"], data["torch"]
    parts = [f"{what} ({first['memory_GiB']} GiB, compute {first['compute_capability']})",
             f"driver CUDA {cupy.get('cuda_driver')}, runtime {cupy.get('cuda_runtime')}",
             f"CuPy {cupy.get('version')}",
             f"NCCL {nccl.get('version')}" if nccl.get("available") else "no NCCL"]
    if torch.get("installed"):
        parts.append(f"torch {torch['version']}"
                     + (f" (CUDA {torch['cuda']})" if torch.get("cuda_available")
                        else " (no CUDA)"))
    else:
        parts.append("no torch")
    if not data["ml_dtypes"]["installed"]:
        parts.append("no ml_dtypes (bfloat16 cases skip)")
    elif data["ml_dtypes"].get("note"):
        parts.append(f"ml_dtypes {data['ml_dtypes']['version']}: {data['ml_dtypes']['note']}")
    access = data.get("peer_access")
    if access is not None and len(access) > 1:
        pairs = sum(a for i, row in enumerate(access) for j, a in enumerate(row) if i != j)
        parts.append(f"peer access {pairs} of {len(access) * (len(access) - 1)} pairs")
    return "; ".join(parts)

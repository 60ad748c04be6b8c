"""Where the test suite's GPUs come from: a real GPU, or the CUDA emulation.

Without a usable GPU, the emulation of tests/cuda_emulation is installed as `cupy` before
any test runs (GPUKV_CUDA_EMULATION=1 forces it, =0 forbids it), so every GPU test runs
the project's CUDA code; `subprocess_env` gives a child process the same GPUs.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EMULATION_DIR = Path(__file__).resolve().parent / "cuda_emulation"


def _real_gpus() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device
        return 0


def _wants_emulation() -> bool:
    """GPUKV_CUDA_EMULATION read as gpukv reads it (a malformed value is an
    ArgumentError naming it, never taken for "unset"); unset: where no GPU is."""
    from gpukv._env import flag
    choice = flag("GPUKV_CUDA_EMULATION")
    return _real_gpus() == 0 if choice is None else choice


EMULATED = _wants_emulation()


def install() -> None:
    """Install the emulation in this process when it stands in for a GPU."""
    if not EMULATED:
        return
    # Four emulated GPUs by default, peer access around a ring (0-1, 1-3, 3-2, 2-0) but
    # not across it, so both direct peer reads and staged copies run in every GPU test.
    os.environ.setdefault("CUDAEMU_GPUS", "4")
    os.environ.setdefault("CUDAEMU_PEERS", "0-1,1-3,3-2,2-0")
    sys.path.insert(0, str(EMULATION_DIR))
    import cudaemu
    cudaemu.install()
    from cudaemu import driver, kernels
    # Child processes share the compiled kernels, whatever XDG_CACHE_HOME says then.
    os.environ.setdefault("CUDAEMU_CACHE_DIR", str(kernels.CACHE_DIR))
    # libcuda's P2P and pointer queries are answered by the emulated machine.
    from gpukv.device.cuda import driver as cuda_driver
    cuda_driver._driver[:] = [driver]


def subprocess_env(*, gpus: bool = True) -> dict:
    """os.environ for a child process: the checkout first on PYTHONPATH and, with `gpus`,
    the emulated GPUs of this run (where they are emulated); without, a plain `cupy`."""
    env = dict(os.environ)
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                           if p and p != str(EMULATION_DIR)]
    if gpus and EMULATED:
        paths.insert(0, str(EMULATION_DIR))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def guarded_zeros(shape, dtype):
    """A zero-filled NumPy array that, under the emulation, lies in a guarded allocation
    (an access past its end faults), for host stand-ins that kernels read and write."""
    if not EMULATED:
        return np.zeros(shape, dtype)
    from cudaemu import memory
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    mem = memory.Memory(count * dtype.itemsize, 0)
    array = memory.host_bytes(mem.ptr, mem.size, mem).view(dtype).reshape(shape)
    array[...] = 0
    return array

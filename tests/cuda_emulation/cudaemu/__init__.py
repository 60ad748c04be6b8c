"""A CUDA emulation for the test suite: CuPy's API over host memory, running the project's
own CUDA kernel sources compiled for the CPU.

The folder holding this package also holds `cupy` and `cupyx` packages that present the
emulation under CuPy's names; putting that folder first on `sys.path` (or PYTHONPATH for
a subprocess) makes `import cupy` load them. Modules:

- machine: how many GPUs, which have peer access, guard pages on or off;
- memory: device memory at real addresses, guard pages, the allocation registry;
- runtime: devices, streams, events, `cupy.cuda.runtime`;
- streams: the work queued on each stream, run when forced or when the schedule
  (`GPUKV_EMU_SCHEDULE`: issue, seed:N, adversarial) picks it;
- races: the happens-before checker over every allocation (vector clocks per stream);
- kernel_access: what memory a kernel launch reads and writes, for the checker;
- array / api: `cupy.ndarray` and the `cupy` functions (NumPy arithmetic);
- kernels: `RawKernel` / `RawModule`, CUDA C++ compiled with g++ and run block by block;
- nccl: `cupy.cuda.nccl` within one process, checking every call;
- dlpack: DLPack capsules for device arrays.

What it cannot show: float32 flush-to-zero and NaN canonicalisation of GPU arithmetic,
concurrency between the blocks of a kernel (they run one after another) and of CuPy's own
kernels (they run as issued, after their stream's queued work), peer-memory mechanics
beyond the access rules, and speed.
"""
from __future__ import annotations

import os
import sys

#: the folder to put first on sys.path / PYTHONPATH so `import cupy` finds the emulation
SHIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def install() -> None:
    """Make `import cupy` (and `cupyx`) load the emulation in this process."""
    if sys.path[:1] != [SHIM_DIR]:
        sys.path.insert(0, SHIM_DIR)
    for name in [m for m in sys.modules if m.split(".")[0] in ("cupy", "cupyx")]:
        del sys.modules[name]

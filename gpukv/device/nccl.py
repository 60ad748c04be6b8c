"""NCCL through the device layer: loading it, its dtype codes, communicators and grouped
collectives on each device's stream (`cuda/nccl.py` holds them; nothing here imports CuPy
until NCCL is asked for)."""
from __future__ import annotations

from .cuda.nccl import (
    INSTALL_HINT,
    bcast,
    communicators,
    group,
    nccl_available,
    nccl_dtype,
    nccl_module,
    reduce,
)

__all__ = ["INSTALL_HINT", "nccl_module", "nccl_available", "nccl_dtype", "communicators",
           "group", "reduce", "bcast"]

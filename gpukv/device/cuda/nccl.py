"""NCCL among the GPUs of this process: loading it, communicators, grouped collectives.

`nccl` below is the module `nccl_module()` returned (CuPy's `cupy.cuda.nccl`, or a
stand-in with its surface); every collective is queued on its device's stream.
"""
from __future__ import annotations

import contextlib
import warnings

import numpy as np

from ..._errors import BackendError

INSTALL_HINT = ("the 'nccl' strategy needs NCCL for CuPy: pip install 'nvidia-nccl-cu12>=2.18' "
                "(or nvidia-nccl-cu13 with cupy-cuda13x), or install CuPy from conda-forge, "
                "which brings NCCL")


def nccl_module():
    """`cupy.cuda.nccl`, loaded; a BackendError saying how to install NCCL otherwise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendError(f"NCCL is not available ({exc}); {INSTALL_HINT}") from exc
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise BackendError(f"NCCL is not available (libnccl could not be loaded); "
                           f"{INSTALL_HINT}")
    return nccl


def nccl_available() -> bool:
    try:
        nccl_module()
    except Exception:
        return False
    return True


_NCCL_TYPES = {"float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16",
               "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "int8": "NCCL_INT8",
               "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "int64": "NCCL_INT64"}


def nccl_dtype(nccl, dtype):
    """NCCL's code for `dtype`, or None when NCCL has none."""
    name = _NCCL_TYPES.get(np.dtype(dtype).name)
    return getattr(nccl, name, None) if name else None


def communicators(nccl, physical) -> list:
    """One communicator per GPU of `physical` (CUDA ordinals), rank i on physical[i].

    Made outside any group: one created inside a group is initialised only at its end,
    too late for the collectives queued on it in that group."""
    return nccl.NcclCommunicator.initAll(list(physical))


@contextlib.contextmanager
def group(nccl):
    """The collectives issued inside run as one grouped NCCL operation."""
    nccl.groupStart()
    try:
        yield
    finally:
        nccl.groupEnd()


def reduce(nccl, comm, device, send, recv, root: int) -> None:
    """Sum `send` of every rank into `recv` of rank `root`, on `device`'s stream (the
    device of this rank's GPU)."""
    with device.cuda_device:
        comm.reduce(send.data.ptr, recv.data.ptr, send.size, nccl_dtype(nccl, send.dtype),
                    nccl.NCCL_SUM, root, device.stream.ptr)


def bcast(nccl, comm, device, buf, root: int) -> None:
    """Copy `buf` of rank `root` into `buf` of every rank, on `device`'s stream."""
    with device.cuda_device:
        comm.bcast(buf.data.ptr, buf.size, nccl_dtype(nccl, buf.dtype), root,
                   device.stream.ptr)

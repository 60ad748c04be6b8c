"""The parts of the CUDA driver API (libcuda) gpukv calls through ctypes, answered from
the emulated machine: P2P attributes and pointer access flags.

Called as ctypes functions are: output arguments arrive as `ctypes.byref(x)` or
`ctypes.pointer(x)`, and every function returns a CUresult (0 on success).
"""
from __future__ import annotations

import ctypes

from . import machine, memory, runtime

CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_DEVICE = 0, 1, 101
P2P_PERFORMANCE_RANK, P2P_ACCESS_SUPPORTED = 1, 2
POINTER_ACCESS_FLAGS = 16


def _store(out, value: int) -> None:
    target = out._obj if hasattr(out, "_obj") else out.contents  # byref or pointer
    target.value = value


def _int(value) -> int:
    return value.value if isinstance(value, ctypes._SimpleCData) else int(value)


def cuInit(flags):  # noqa: N802 - the driver's names
    return CUDA_SUCCESS


def cuDeviceGet(device, ordinal):  # noqa: N802
    ordinal = _int(ordinal)
    if not 0 <= ordinal < machine.MACHINE.gpus:
        return CUDA_ERROR_INVALID_DEVICE
    _store(device, ordinal)
    return CUDA_SUCCESS


def cuDeviceGetP2PAttribute(value, attribute, src, dst):  # noqa: N802
    src, dst = _int(src), _int(dst)
    if _int(attribute) == P2P_ACCESS_SUPPORTED:
        _store(value, int(src != dst and machine.MACHINE.can_access_peer(src, dst)))
    elif _int(attribute) == P2P_PERFORMANCE_RANK:
        _store(value, 0)
    else:
        return CUDA_ERROR_INVALID_VALUE
    return CUDA_SUCCESS


def cuPointerGetAttribute(data, attribute, ptr):  # noqa: N802
    mem = memory.find(_int(ptr))
    if mem is None:
        return CUDA_ERROR_INVALID_VALUE
    attribute = _int(attribute)
    if attribute != POINTER_ACCESS_FLAGS:
        return CUDA_ERROR_INVALID_VALUE
    _store(data, memory.access_flags(runtime.current_device(), mem))
    return CUDA_SUCCESS

"""CuPy, loaded on first use, and the few runtime facts every CUDA module needs.

A leaf: the device, its kernels and its probes all import it, it imports none of them.
"""
from __future__ import annotations

import functools

from ..._errors import BackendError


@functools.cache
def cupy_module():
    """CuPy, imported now; a BackendError saying how to install it if that fails."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise BackendError("GPU arrays need CuPy: pip install cupy-cuda12x (or "
                           "cupy-cuda13x); in a gpukv checkout, pip install '.[cuda12]' "
                           "(or '.[cuda13]')") from exc
    return cupy


def gpu_count() -> int:
    """Physical GPUs CuPy can see; 0 without CuPy, a driver or a GPU."""
    try:
        return cupy_module().cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return 0


def ordering_event(stream):
    """An event recorded now on `stream`, made only to order work: without timing, which
    CUDA records and waits on more cheaply than a timed one."""
    return stream.record(cupy_module().cuda.Event(disable_timing=True))

"""CuPy as the test suite's CUDA emulation provides it (the code lives in `cudaemu`).

Arrays live in emulated device memory (host memory with real addresses, guard pages
around every allocation), and `RawKernel`/`RawModule` run the given CUDA source compiled
for the CPU. Only what CuPy 14 offers is offered, with CuPy's rules.
"""
import numpy as _np
from cudaemu import api as _api
from cudaemu.api import (  # noqa: F401 - the namespace
    array,
    asanyarray,
    asarray,
    ascontiguousarray,
    asnumpy,
    copyto,
    empty,
    empty_like,
    from_dlpack,
    fromDlpack,
    full,
    full_like,
    get_array_module,
    get_default_memory_pool,
    get_default_pinned_memory_pool,
    ndarray,
    ones,
    ones_like,
    ufunc,
    zeros,
    zeros_like,
)
from cudaemu.kernels import RawKernel, RawModule  # noqa: F401

from . import _util, cuda  # noqa: F401

__version__ = "14.2.0+cudaemu"

nan, inf, pi, e, newaxis = _np.nan, _np.inf, _np.pi, _np.e, _np.newaxis


def is_available() -> bool:
    return cuda.runtime.getDeviceCount() > 0


def __getattr__(name):
    return _api.namespace_attribute(name)

"""NVRTC through ctypes, for the tests that compile kernels: gpukv's own wrapper."""
from gpukv.tools.nvrtc import Nvrtc, NvrtcError, load

__all__ = ["Nvrtc", "NvrtcError", "load"]

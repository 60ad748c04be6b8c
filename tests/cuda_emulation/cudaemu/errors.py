"""CUDA runtime errors as CuPy raises them (`cupy_backends.cuda.api.runtime.CUDARuntimeError`)."""
from __future__ import annotations

# status -> (name, description), as cudaGetErrorName / cudaGetErrorString give them
_ERRORS = {
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    9: ("cudaErrorInvalidConfiguration", "invalid configuration argument"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    217: ("cudaErrorPeerAccessUnsupported",
          "peer access is not supported between these two devices"),
    600: ("cudaErrorNotReady", "device not ready"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    704: ("cudaErrorPeerAccessAlreadyEnabled",
          "peer access is already enabled to the context that is being requested"),
    705: ("cudaErrorPeerAccessNotEnabled", "peer access has not been enabled"),
}

INVALID_VALUE = 1
INVALID_DEVICE = 101
PEER_UNSUPPORTED = 217
PEER_ALREADY_ENABLED = 704


class CUDARuntimeError(RuntimeError):
    """A failed CUDA runtime call; `status` is the cudaError_t code."""

    def __init__(self, status: int, detail: str = ""):
        self.status = status
        name, text = _ERRORS.get(status, (f"cudaError{status}", "unknown error"))
        super().__init__(f"{name}: {text}" + (f" ({detail})" if detail else ""))

    def __reduce__(self):
        return (type(self), (self.status,))

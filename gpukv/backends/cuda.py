"""The CUDA backend: CuPy arrays on GPUs. CuPy is imported on first use only."""
from __future__ import annotations

import functools

import numpy as np

from .._errors import BackendError, DeviceError
from ._base import Device


@functools.cache
def cupy_module():
    """CuPy, imported now; a BackendError saying how to install it if that fails."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise BackendError(
            "GPU arrays need CuPy: pip install 'gpukv[cuda12]' (or cuda13)") from exc
    return cupy


def gpu_count() -> int:
    """Physical GPUs CuPy can see; 0 without CuPy, a driver or a GPU."""
    try:
        return cupy_module().cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return 0


class CudaDevice(Device):
    """One GPU, or one virtual GPU (`slot`) sharing a physical one, with its own stream."""

    kind = "gpu"

    def __init__(self, physical: int, slot: int = 0):
        count = gpu_count()
        if not 0 <= physical < count:
            raise DeviceError(f"GPU {physical} does not exist: {count} GPU(s) are visible")
        super().__init__(physical, slot)
        self._cp = cupy_module()
        self._cuda_device = self._cp.cuda.Device(physical)
        self._stream = None

    @property
    def xp(self):
        return self._cp

    @property
    def cuda_device(self):
        return self._cuda_device

    @property
    def stream(self):
        """The stream this device's work is queued on.

        Slot 0 uses CuPy's current stream on the GPU, so results are ordered with the
        caller's own work; other slots (virtual GPUs) each own a non-blocking stream.
        """
        if self.slot == 0:
            return self._cp.cuda.get_current_stream(self.physical)
        if self._stream is None:
            with self._cuda_device:
                self._stream = self._cp.cuda.Stream(non_blocking=True)
        return self._stream

    def wait_for(self, other: "Device") -> None:
        """Order this device's stream after the work queued so far on `other`'s stream."""
        if isinstance(other, CudaDevice) and other.stream is not self.stream:
            with other._cuda_device:
                event = other.stream.record()
            with self._cuda_device:
                self.stream.wait_event(event)

    def empty(self, shape, dtype):
        with self._cuda_device:
            return self._cp.empty(shape, dtype)

    def owns(self, array) -> bool:
        return isinstance(array, self._cp.ndarray) and array.device.id == self.physical

    def copy(self, dst, src) -> None:
        cp = self._cp
        with self._cuda_device, self.stream:
            if isinstance(src, np.ndarray):
                if src.dtype == dst.dtype and src.flags.c_contiguous and dst.flags.c_contiguous:
                    dst.set(src, stream=self.stream)
                else:
                    dst[...] = cp.asarray(src).astype(dst.dtype, copy=False)
                return
            if (src.dtype == dst.dtype and src.flags.c_contiguous
                    and dst.flags.c_contiguous):
                # Peer or local: one async memcpy on this device's stream (UVA).
                dst.data.copy_from_device_async(src.data, src.nbytes, self.stream)
                return
            if src.device.id != self.physical:
                staged = cp.empty(src.shape, src.dtype)
                staged.data.copy_from_device_async(
                    cp.ascontiguousarray(src).data, src.nbytes, self.stream)
                src = staged
            cp.copyto(dst, src, casting="unsafe")

    def synchronize(self) -> None:
        self.stream.synchronize()


@functools.cache
def cuda_device(physical: int, slot: int = 0) -> CudaDevice:
    """The shared CudaDevice for (physical, slot): one stream per virtual GPU."""
    return CudaDevice(physical, slot)


def gpu_devices() -> list[CudaDevice]:
    """The logical GPUs of this process: every visible GPU, or `GPUKV_VIRTUAL_GPUS` of them.

    With `GPUKV_VIRTUAL_GPUS=N`, N logical devices are dealt round-robin onto the
    physical GPUs, each with its own stream, so multi-device code runs on one GPU.
    """
    import os

    count = gpu_count()
    if count == 0:
        return []
    wanted = os.environ.get("GPUKV_VIRTUAL_GPUS", "").strip()
    n = int(wanted) if wanted else count
    return [cuda_device(i % count, i // count) for i in range(n)]

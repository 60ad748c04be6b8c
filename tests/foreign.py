"""Stand-ins for arrays of other libraries: objects that expose one array protocol only."""
from __future__ import annotations


class DLPackOnly:
    """Exposes an array (NumPy or CuPy) through `__dlpack__`/`__dlpack_device__` only."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class ArrayInterfaceOnly:
    """Exposes a NumPy array through `__array_interface__` only."""

    def __init__(self, a):
        self._a = a

    @property
    def __array_interface__(self):
        return self._a.__array_interface__


class CudaInterfaceOnly:
    """Exposes a CuPy array through `__cuda_array_interface__` only."""

    def __init__(self, a):
        self._a = a

    @property
    def __cuda_array_interface__(self):
        return self._a.__cuda_array_interface__


class OnDLPackDevice:
    """A DLPack array that says it lives on DLPack device (type, id) and is never read."""

    def __init__(self, device_type, device_id=0):
        self._device = (device_type, device_id)

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, **kwargs):
        raise AssertionError("an array on a device gpukv cannot use is never read")

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


class RefusingDLPack:
    """A DLPack array its own library will not hand over, as JAX's: sharded over several
    devices ('sharded': BufferError) or deleted ('deleted': TypeError)."""

    def __init__(self, why: str):
        self.why = why

    def __dlpack_device__(self):
        if self.why == "sharded":
            raise BufferError("__dlpack__ only supported for unsharded arrays.")
        raise TypeError("object of type 'NoneType' has no len()")

    def __dlpack__(self, **kwargs):
        raise AssertionError("never reached: __dlpack_device__ refuses first")


def torch_cuda_tensor(array):
    """A PyTorch CUDA tensor holding the CuPy array `array`: the real thing where PyTorch
    has CUDA, else a `torch.Tensor` that says it lives on `array`'s GPU and hands out
    `array` through DLPack and the CUDA array interface as PyTorch does (bfloat16 there
    as the raw `<V2` PyTorch publishes)."""
    import torch
    if torch.cuda.is_available():
        return torch.from_dlpack(array)

    class CudaTensor(torch.Tensor):
        @staticmethod
        def __new__(cls, backing):
            tensor = torch.Tensor._make_subclass(cls, torch.empty(0))
            tensor.backing = backing
            return tensor

        is_cuda = property(lambda self: True)
        device = property(lambda self: torch.device("cuda", self.backing.device.id))

        def detach(self):
            return self

        def data_ptr(self):
            return self.backing.data.ptr

        def __dlpack__(self, stream=None, **kwargs):
            return self.backing.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.backing.__dlpack_device__()

        @property
        def __cuda_array_interface__(self):
            return self.backing.__cuda_array_interface__

    return CudaTensor(array)


def cuda_tensor_values(tensor):
    """The values of a tensor made by `torch_cuda_tensor`, as a NumPy array."""
    backing = getattr(tensor, "backing", None)
    if backing is not None:
        return backing.get()
    import torch
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own: by the bits
        import ml_dtypes
        return tensor.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.cpu().numpy()


class ArrayMethodCopy:
    """Exposes a NumPy array through `__array__` only, handing out a new copy each time."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a.copy()


class ArrayMethodOnly:
    """Exposes a NumPy array through `__array__` only, handing out the array itself."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a

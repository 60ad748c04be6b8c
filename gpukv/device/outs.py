"""Writing into another library's array as that library would: what `adopt` cannot see.

An adopted array shares the memory of the caller's object, but a write through it
bypasses the object's own library. `write_refusal` says why an object must not be written
in place at all (PyTorch's autograd forbids it, or the adopted array is a copy whose
writes would be lost); `announce_writes` tells the library of a write afterwards
(PyTorch's version counters, so autograd sees the change as it sees `t.copy_(v)`).
PyTorch is found through `sys.modules`: nothing is imported here.
"""
from __future__ import annotations

import sys

import numpy as np


def _torch_tensor(obj):
    """The `torch` module when `obj` is a PyTorch tensor, else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(obj, torch.Tensor) else None


def write_refusal(obj, array) -> str | None:
    """Why `obj`, adopted as `array`, cannot be written in place; None when it can."""
    torch = _torch_tensor(obj)
    if torch is not None:
        return _torch_refusal(torch, obj)
    if isinstance(array, np.ndarray) and array.size and _through_array_method(obj):
        # `__array__` may hand out its memory or a copy: a copy comes back new each time.
        if not np.may_share_memory(array, np.asarray(obj)):
            return (f"a {type(obj).__name__} whose __array__ returns a copy, not its memory: "
                    f"a pull into it would be lost; pass an array that shares its memory "
                    f"(NumPy, CuPy, DLPack, __array_interface__ or the buffer protocol)")
    return None


def _torch_refusal(torch, tensor) -> str | None:
    """Why PyTorch would refuse `tensor.copy_(value)` here, or would record it in an
    autograd graph, which a write from outside PyTorch cannot do; None when neither."""
    if tensor.requires_grad and torch.is_grad_enabled():
        what = ("a PyTorch leaf tensor that requires grad, which PyTorch writes in place "
                "only under torch.no_grad()" if tensor.is_leaf else
                "a PyTorch tensor that requires grad (part of an autograd graph), which a "
                "write from outside PyTorch would cut from its graph unrecorded")
        return f"{what}; pull into it inside `with torch.no_grad():` (as optimizers do)"
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        return ("a PyTorch inference tensor, which PyTorch writes in place only inside "
                "torch.inference_mode()")
    return None


def _through_array_method(obj) -> bool:
    """Whether `adopt` takes `obj` through its `__array__` alone: no protocol that
    promises its memory (CUDA array interface, DLPack, array interface, buffer)."""
    if not hasattr(obj, "__array__") or any(hasattr(obj, name) for name in (
            "__cuda_array_interface__", "__dlpack__", "__array_interface__",
            "__array_struct__")):
        return False
    try:
        memoryview(obj)
    except TypeError:
        return True
    return False


def announce_writes(objs) -> None:
    """Tell the libraries of `objs` (written in place just now) of the write: a PyTorch
    tensor's version counter moves, so a backward through a graph that saved it fails
    as it would after `t.copy_(value)`."""
    for obj in objs:
        torch = _torch_tensor(obj)
        if torch is not None and not obj.is_inference():  # inference tensors have none
            torch.autograd.graph.increment_version(obj)

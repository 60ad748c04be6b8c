"""A worker's own state (data-loader position, RNG states) as JSON plus arrays, for snapshots.

Saved as it is: dicts with str keys, lists, tuples, str, int, float, bool, None, NumPy
arrays and torch tensors, nested in any way. Tuples come back as tuples (as
`random.setstate` wants them), arrays as NumPy arrays and tensors as CPU tensors. No
pickle: anything else is an ArgumentError naming where in the state it is.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from .._errors import ArgumentError

_ARRAY = "__gpukv_array__"
_TUPLE = "__gpukv_tuple__"
_FLOAT = "__gpukv_float__"  # inf, -inf and nan, which plain JSON has no words for


def encode(state, where: str = "user_state") -> tuple:
    """(JSON-able object, {name: NumPy array}) for `state`, or ArgumentError."""
    if not isinstance(state, dict):
        raise ArgumentError(f"{where}: expected a dict, got {type(state).__name__}")
    arrays: dict = {}
    return _encode(state, where, arrays), arrays


def _encode(value, where: str, arrays: dict):
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(float(value))}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ArgumentError(f"{where}: key {key!r} is a {type(key).__name__}; "
                                    f"a saved dict takes str keys only")
            if key in (_ARRAY, _TUPLE, _FLOAT):
                raise ArgumentError(f"{where}: key {key!r} is reserved")
            out[key] = _encode(item, f"{where}[{key!r}]", arrays)
        return out
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", arrays) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{where}[{i}]", arrays) for i, v in enumerate(value)]}
    if isinstance(value, np.generic):
        return _encode(value.item(), where, arrays)
    is_tensor = _is_tensor(value)
    if isinstance(value, np.ndarray) or is_tensor:
        array = value.detach().cpu().numpy() if is_tensor else value
        if array.dtype.hasobject:
            raise ArgumentError(f"{where}: an array of Python objects cannot be saved")
        name = f"user/{len(arrays)}"
        arrays[name] = np.array(array, copy=True)  # as it is now, not as it will be
        return {_ARRAY: name, "torch": is_tensor}
    raise ArgumentError(f"{where}: a {type(value).__name__} cannot be saved (expected "
                        f"dicts, lists, tuples, str, numbers, bool, None, NumPy arrays or "
                        f"torch tensors)")


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def decode(obj, arrays: dict):
    """The state `encode` made `obj` and `arrays` from."""
    if isinstance(obj, list):
        return [decode(v, arrays) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _FLOAT in obj:
        return float(obj[_FLOAT])
    if _TUPLE in obj:
        return tuple(decode(v, arrays) for v in obj[_TUPLE])
    if _ARRAY in obj:
        array = np.array(arrays[obj[_ARRAY]], copy=True)  # writable, not a mapped file
        if obj.get("torch"):
            import torch
            return torch.from_numpy(array)
        return array
    return {k: decode(v, arrays) for k, v in obj.items()}

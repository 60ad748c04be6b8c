"""A worker's own state (data-loader position, RNG states) as JSON plus arrays, for snapshots.

Saved as it is: dicts with str keys, lists, tuples, str, int, float, bool, None, NumPy
arrays and torch tensors, nested in any way. Tuples come back as tuples (as
`random.setstate` wants them), arrays as NumPy arrays and tensors as CPU tensors. No
pickle: a state that is no dict is an ArgumentKindError, and anything in it that cannot
come back exactly an ArgumentError naming where in the state it is, raised before
anything is written. In particular:

- nesting: at most `MAX_DEPTH` dicts, lists and tuples deep, the state itself counted;
  a container inside itself (a cycle) is refused (one shared by several places is saved
  in each);
- ints of at most 4300 decimal digits (JSON writes an int in decimal, and Python's
  `int`/`str` limit is 4300 digits by default: save `hex(n)` for longer ones);
- NumPy scalars come back as the Python numbers they hold; `longdouble` and
  `clongdouble` ones hold none (save `np.asarray(x)`, a 0-d array, instead), and
  datetime64, timedelta64 and void (record) scalars are refused;
- arrays of numbers and bool (byte-swapped ones come back in native order), and of
  ml_dtypes' real types (bfloat16, float8s, int4, ...); arrays of str, bytes, datetimes,
  objects, records, raw bytes or ml_dtypes' complex types, and masked arrays, are refused;
- torch tensors: dense (strided) ones of a dtype with a NumPy twin, and bfloat16 and the
  float8s through ml_dtypes' twins; sparse, quantized, nested and meta tensors, and other
  dtypes (complex32, the sub-byte ones), are refused saying what to save instead.
"""
from __future__ import annotations

import math
import struct
import sys

import numpy as np

from .._errors import ArgumentError, ArgumentKindError

_ARRAY = "__gpukv_array__"
_TUPLE = "__gpukv_tuple__"
_FLOAT = "__gpukv_float__"  # inf, -inf and nan, which plain JSON has no words for
_NAN_BITS = 0x7FF8000000000000  # the nan float('nan') gives; others are saved as "nan:<bits>"

#: how many dicts, lists and tuples deep a state may be, the state itself counted: far
#: below Python's recursion limit, which JSON's encoder and decoder and `decode` share
MAX_DEPTH = 100

#: decimal digits an int may have: Python's default `sys.int_info.default_max_str_digits`,
#: what a reader's json.loads allows unless that process raised it
MAX_INT_DIGITS = 4300
_SHORT_BITS = 2126  # ints below 2**2126 < 10**640 have at most 640 digits, the least limit

#: torch dtypes without a NumPy twin that have an ml_dtypes one of the same name and bits
_THROUGH_ML_DTYPES = frozenset(["bfloat16", "float8_e4m3fn", "float8_e5m2",
                                "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"])
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

_ARRAY_ADVICE = {
    "U": "save it as a list of str (a.tolist())",
    "S": "save it as a list of str, or as a uint8 array (a.view(np.uint8))",
    "M": "save a.astype('int64') and its unit",
    "m": "save a.astype('int64') and its unit",
}


def encode(state, where: str = "user_state") -> tuple:
    """(JSON-able object, {name: NumPy array}) for `state`; ArgumentKindError when it is
    no dict, ArgumentError when something in it cannot be saved."""
    if not isinstance(state, dict):
        raise ArgumentKindError(f"{where}: expected a dict, got {type(state).__name__}")
    arrays: dict = {}
    return _encode(state, where, arrays, {}), arrays


def _encode(value, where: str, arrays: dict, inside: dict):
    """`value` as JSON; `inside`: {id: container} of the containers `value` is in."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: _non_finite(value)}
    if isinstance(value, int) and not isinstance(value, bool):
        _check_int(value, where)
        return value
    if value is None or isinstance(value, (bool, float, str)):
        return value
    if isinstance(value, (dict, list, tuple)):
        return _encode_container(value, where, arrays, inside)
    if isinstance(value, np.generic):
        return _encode(_number(value, where), where, arrays, inside)
    is_tensor = _is_tensor(value)
    if isinstance(value, np.ndarray) or is_tensor:
        array = _tensor_values(value, where) if is_tensor else _array_values(value, where)
        name = f"user/{len(arrays)}"
        arrays[name] = np.array(array, copy=True)  # as it is now, not as it will be
        return {_ARRAY: name, "torch": is_tensor}
    raise ArgumentError(f"{where}: a {type(value).__name__} cannot be saved (expected "
                        f"dicts, lists, tuples, str, numbers, bool, None, NumPy arrays or "
                        f"torch tensors)")


def _encode_container(value, where: str, arrays: dict, inside: dict):
    if id(value) in inside:
        raise ArgumentError(f"{where}: refers back to a {type(value).__name__} it is inside "
                            f"(a cycle); a saved state must be a tree")
    if len(inside) >= MAX_DEPTH:
        raise ArgumentError(f"{where}: nested deeper than {MAX_DEPTH} dicts, lists and "
                            f"tuples (the state itself counted); flatten it")
    inside[id(value)] = value  # the value kept alive, so that its id is not reused
    try:
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ArgumentError(f"{where}: key {key!r} is a {type(key).__name__}; "
                                        f"a saved dict takes str keys only")
                if key in (_ARRAY, _TUPLE, _FLOAT):
                    raise ArgumentError(f"{where}: key {key!r} is reserved")
                out[key] = _encode(item, f"{where}[{key!r}]", arrays, inside)
            return out
        items = []
        for i, item in enumerate(value):  # a loop, not a comprehension: one frame less a level
            items.append(_encode(item, f"{where}[{i}]", arrays, inside))
        return items if isinstance(value, list) else {_TUPLE: items}
    finally:
        del inside[id(value)]


def _non_finite(value: float) -> str:
    """inf, -inf, nan, or a nan of another sign or payload as its bits."""
    if not math.isnan(value):
        return repr(float(value))
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    return "nan" if bits == _NAN_BITS else f"nan:{bits:#018x}"


def _float(text: str) -> float:
    """The float `_non_finite` wrote as `text`."""
    if isinstance(text, str) and text.startswith("nan:"):
        bits = int(text[4:], 16)
        if not 0 <= bits < 2 ** 64:
            raise ValueError(f"{text!r} is not the bits of a float")
        return struct.unpack("<d", struct.pack("<Q", bits))[0]
    return float(text)


def _check_int(value: int, where: str) -> None:
    if value.bit_length() <= _SHORT_BITS:
        return
    get_limit = getattr(sys, "get_int_max_str_digits", None)  # Python 3.10.7 and later
    limit = 0 if get_limit is None else get_limit()
    digits = MAX_INT_DIGITS if limit == 0 else min(limit, MAX_INT_DIGITS)
    if abs(value) >= 10 ** digits:
        raise ArgumentError(f"{where}: an int of more than {digits} digits cannot be saved "
                            f"(JSON writes ints in decimal); save hex(n) and read it back "
                            f"with int(s, 16)")


def _number(value: np.generic, where: str):
    """The Python number a NumPy scalar holds, or ArgumentError."""
    if isinstance(value, np.void):
        raise ArgumentError(f"{where}: a numpy.void scalar (a record or raw bytes) cannot "
                            f"be saved; save its fields one by one")
    if isinstance(value, (np.datetime64, np.timedelta64)):  # .item() may give an int or None
        raise ArgumentError(f"{where}: a numpy.{type(value).__name__} scalar cannot be "
                            f"saved; save int(x.astype('int64')) and its unit")
    item = value.item()
    if isinstance(item, np.generic):  # longdouble, clongdouble: no Python number holds them
        kind = type(value).__name__
        raise ArgumentError(f"{where}: a numpy.{kind} scalar cannot be saved as a Python "
                            f"number exactly; save np.asarray(x) (a 0-d array) instead")
    return item


def _array_values(array: np.ndarray, where: str) -> np.ndarray:
    """`array` if the archive can hold it and give it back exactly, else ArgumentError."""
    masked = sys.modules.get("numpy.ma")
    if masked is not None and isinstance(array, masked.MaskedArray):
        raise ArgumentError(f"{where}: a masked array cannot be saved with its mask; save "
                            f"a.data and a.mask as two arrays")
    dtype = array.dtype
    if dtype.hasobject:
        raise ArgumentError(f"{where}: an array of Python objects cannot be saved")
    if dtype.kind in "biufc" or _ml_dtype(dtype):
        return array
    advice = _ARRAY_ADVICE.get(dtype.kind, "save each field as its own array" if dtype.fields
                               else "save a.view(np.uint8)")
    raise ArgumentError(f"{where}: an array of dtype {dtype} cannot be saved (numbers, bool "
                        f"and ml_dtypes' types only); {advice}")


def _ml_dtype(dtype: np.dtype) -> bool:
    """Whether `dtype` is one of ml_dtypes' that the archive stores as raw bits and finds
    again by its name."""
    ml_dtypes = sys.modules.get("ml_dtypes")
    return (dtype.kind == "V" and not dtype.fields and dtype.itemsize in _SIGNED
            and ml_dtypes is not None and getattr(ml_dtypes, dtype.name, None) is dtype.type)


def _tensor_values(tensor, where: str) -> np.ndarray:
    """The values of a torch tensor as a NumPy array (not yet copied), or ArgumentError."""
    import torch
    if tensor.is_nested:
        raise ArgumentError(f"{where}: a nested torch tensor cannot be saved; save "
                            f"t.unbind() (a tuple of tensors) instead")
    if tensor.is_meta:
        raise ArgumentError(f"{where}: a torch tensor on the meta device has no values to "
                            f"save")
    if tensor.layout != torch.strided:
        raise ArgumentError(f"{where}: a torch tensor of {tensor.layout} layout cannot be "
                            f"saved; save t.to_dense() instead")
    if tensor.is_quantized:
        raise ArgumentError(f"{where}: a quantized torch tensor ({tensor.dtype}) cannot be "
                            f"saved; save t.dequantize(), or t.int_repr() with its scale and "
                            f"zero point")
    tensor = tensor.detach().cpu().resolve_conj().resolve_neg()
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _THROUGH_ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError as exc:
            raise ArgumentError(f"{where}: a torch tensor of dtype {tensor.dtype} needs the "
                                f"ml_dtypes package to be saved: pip install ml_dtypes") from exc
        bits = tensor.view(getattr(torch, _SIGNED[tensor.element_size()].__name__))
        return bits.numpy().view(getattr(ml_dtypes, name))
    try:
        array = tensor.numpy()
    except (TypeError, RuntimeError) as exc:  # a dtype NumPy has no twin for
        raise ArgumentError(f"{where}: a torch tensor of dtype {tensor.dtype} cannot be "
                            f"saved; save it as a dtype NumPy has (t.to(torch.float32), "
                            f"t.to(torch.complex64), ...) instead") from exc
    return _array_values(array, where)


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def decode(obj, arrays: dict):
    """The state `encode` made `obj` and `arrays` from."""
    if isinstance(obj, list):
        items = []
        for item in obj:  # loops, not comprehensions: one frame less a level
            items.append(decode(item, arrays))
        return items
    if not isinstance(obj, dict):
        return obj
    if _FLOAT in obj:
        return _float(obj[_FLOAT])
    if _TUPLE in obj:
        return tuple(decode(obj[_TUPLE], arrays))
    if _ARRAY in obj:
        array = np.array(arrays[obj[_ARRAY]], copy=True)  # writable, not a mapped file
        if obj.get("torch"):
            return torch_tensor(array)
        return array
    out = {}
    for key, item in obj.items():
        out[key] = decode(item, arrays)
    return out


def torch_tensor(array: np.ndarray):
    """The torch tensor `_tensor_values` saved as `array` (bfloat16 and the other dtypes
    NumPy has through ml_dtypes only, as torch's own)."""
    import torch
    name = array.dtype.name
    if name not in _THROUGH_ML_DTYPES:
        return torch.from_numpy(array)
    dtype = getattr(torch, name, None)  # bfloat16 & co, saved as ml_dtypes' twins
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"this torch has no dtype {name} for a saved tensor")
    return torch.from_numpy(array.view(_SIGNED[array.dtype.itemsize])).view(dtype)

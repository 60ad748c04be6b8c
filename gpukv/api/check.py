"""Call normalisation: every accepted argument form becomes one flat, validated list.

`group(keys, values)` turns a key or a list of keys, with an array, a list of arrays, or a
list of (arrays or lists of arrays), into `Groups`: one entry per distinct key, in order
of first appearance, holding every array given for that key (a key repeated in a list
counts as more devices). All argument errors are raised here, before any key is touched.
"""
from __future__ import annotations

import numbers
import sys
from typing import NamedTuple

import numpy as np

from .._errors import ArgumentError, ArgumentKindError, GpukvError, KeyKindError
from ..device import adopt
from ..update.sparse import RowSparse

_SEQ = (list, tuple)
_NDARRAY = np.ndarray


class Groups(NamedTuple):
    keys: list          # distinct keys, in order of first appearance
    arrays: list        # arrays[i]: the adopted arrays given for keys[i]
    originals: list     # originals[i]: the objects as the caller passed them
    all_host: bool      # every array is a NumPy array
    key_kind: type | None  # int or str; None when no key was given
    sparse: bool = False   # some array is a RowSparse


#: int keys of at least this many bits are looked at closely: Python refuses to write
#: ints of more than `sys.get_int_max_str_digits()` digits (4300 by default) as text, so
#: such a key could be named in no message and written in no checkpoint.
_LONG_KEY_BITS = 13_000
_LONG_KEY = 1 << _LONG_KEY_BITS


def _check_key(key):
    if isinstance(key, str):
        return key, str
    if isinstance(key, numbers.Integral) and not isinstance(key, (bool, np.bool_)):
        key = int(key)
        if not -_LONG_KEY < key < _LONG_KEY:
            _check_long_key(key)
        return key, int
    raise KeyKindError(f"key {key!r}: expected an int or a str, got {type(key).__name__}")


def _check_long_key(key: int) -> None:
    """ArgumentError unless Python can write `key` in decimal (to name it, to save it)."""
    try:
        repr(key)
    except ValueError:
        raise ArgumentError(
            f"key <an int of {key.bit_length()} bits>: too long to write in decimal; int "
            f"keys may have at most {sys.get_int_max_str_digits()} digits") from None


def _short_keys(keys) -> bool:
    """Whether every int of `keys` (a non-empty list of ints) is short enough to skip
    `_check_long_key`."""
    return -_LONG_KEY < min(keys) and max(keys) < _LONG_KEY


def _adopt(key, obj, name):
    if type(obj) is RowSparse:  # passes as it is; the store routes it
        return obj
    try:
        array = adopt(obj)
    except GpukvError as exc:  # a device or dtype the store cannot take: name the key
        raise type(exc)(f"key {key!r}: {name}: {exc}") from None
    if array is None:
        raise ArgumentKindError(
            f"key {key!r}: {name} must be an array (NumPy, CuPy or any array protocol), "
            f"got {type(obj).__name__}")
    return array


def _one_key(key, value, name, groups_by_key, keys, arrays, originals):
    """Add the arrays of one key (an array, or a list of arrays, one per device)."""
    if isinstance(value, _SEQ):
        if not value:
            raise ArgumentError(f"key {key!r}: {name} is an empty list; give one array per device")
        objs = value
    else:
        objs = (value,)
    adopted = []
    for obj in objs:
        if isinstance(obj, _SEQ):
            raise ArgumentKindError(
                f"key {key!r}: {name} is nested too deeply: expected an array or a list of "
                f"arrays, got a list containing a {type(obj).__name__}")
        adopted.append(_adopt(key, obj, name))
    index = groups_by_key.get(key)
    if index is None:
        groups_by_key[key] = len(keys)
        keys.append(key)
        arrays.append(adopted)
        originals.append(list(objs))
    else:  # a repeated key: more devices for the same key
        arrays[index].extend(adopted)
        originals[index].extend(objs)


def _plain_arrays(value):
    """`value` as a list of arrays when it is a NumPy array or a non-empty list of them
    (exact `np.ndarray`, which adopt returns as they are); None for anything else."""
    if type(value) is _NDARRAY:
        return [value]
    if type(value) is not list or not value:
        return None
    for a in value:
        if type(a) is not _NDARRAY:
            return None
    return value


def _group_plain(keys, values):
    """Groups for the common call (distinct int or str keys, each with a NumPy array or a
    non-empty list of them), or None for any other call, which `group` then handles."""
    kind = type(keys[0])
    if kind is not int and kind is not str:
        return None
    ndarray = _NDARRAY
    arrays = []
    append = arrays.append
    for key, value in zip(keys, values):
        if type(key) is not kind:
            return None
        if type(value) is list:  # one array per device
            if not value:
                return None
            for a in value:
                if type(a) is not ndarray:
                    return None
            append(value)
        elif type(value) is ndarray:
            append([value])
        else:
            return None
    out_keys = list(keys)
    if kind is int and not _short_keys(out_keys):
        return None
    if len(set(out_keys)) != len(out_keys):  # a repeated key: more devices, merged by group
        return None
    # Every array is adopted as it is, so the originals are the arrays themselves.
    return Groups(out_keys, arrays, arrays, True, kind)


def group(keys, values, name: str = "value") -> Groups:
    """Normalise `keys` and `values` (or `out`) into Groups; raise on any malformed part."""
    # Fast paths: NumPy arrays under int or str keys, taken as they are.
    if (type(keys) is int and -_LONG_KEY < keys < _LONG_KEY) or type(keys) is str:
        plain = _plain_arrays(values)
        if plain is not None:
            return Groups([keys], [plain], [plain], True, type(keys))
    elif (type(keys) is list or type(keys) is tuple) and keys and (
            type(values) is list or type(values) is tuple) and len(keys) == len(values):
        groups = _group_plain(keys, values)
        if groups is not None:
            return groups
    groups_by_key: dict = {}
    out_keys: list = []
    arrays: list = []
    originals: list = []
    if isinstance(keys, _SEQ):
        if not isinstance(values, _SEQ):
            raise ArgumentKindError(
                f"keys {list(keys)!r}: a list of keys needs a list of {name}s, "
                f"got {type(values).__name__}")
        if len(keys) != len(values):
            raise ArgumentError(
                f"keys {list(keys)!r}: {len(keys)} keys but {len(values)} {name}s")
        kind = None
        for raw_key, value in zip(keys, values):
            key, this_kind = _check_key(raw_key)
            if kind is None:
                kind = this_kind
            elif this_kind is not kind:
                raise KeyKindError(
                    f"key {key!r}: one call mixes int and str keys ({kind.__name__} first)")
            _one_key(key, value, name, groups_by_key, out_keys, arrays, originals)
    else:
        key, kind = _check_key(keys)
        _one_key(key, values, name, groups_by_key, out_keys, arrays, originals)
    all_host = all(type(a) is np.ndarray or isinstance(a, np.ndarray)
                   for per_key in arrays for a in per_key)
    sparse = not all_host and any(type(a) is RowSparse for per_key in arrays for a in per_key)
    return Groups(out_keys, arrays, originals, all_host, kind, sparse)


def check_priority(key, priority) -> None:
    """An ArgumentKindError unless `priority` is an int (as MXNet, which takes a C int)."""
    if type(priority) is not int and not isinstance(priority, numbers.Integral):
        raise ArgumentKindError(
            f"key {key!r}: priority must be an int, got {type(priority).__name__}")

"""The check phase of every call: its arguments normalised and checked whole, against the
store's keys too, before anything is touched; every argument error is raised here, typed,
naming the key.

`group(keys, values)` turns a key or a list of keys, with an array, a list of arrays, or a
list of (arrays or lists of arrays), into `Groups`: one entry per distinct key, in order
of first appearance, holding every array given for that key (a key repeated in a list
counts as more devices). The functions after it check Groups against the store's entries
(`lookup`, `all_sources`, `all_outs`, `init_values`) and the parts of row-sparse calls.
"""
from __future__ import annotations

import inspect
import numbers
import sys
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from .._errors import (
    ArgumentError,
    ArgumentKindError,
    DTypeError,
    DuplicateKeyError,
    GpukvError,
    KeyKindError,
    ReadOnlyError,
    ShapeError,
    UnknownKeyError,
)
from ..device import SUPPORTED_DTYPES, adopt, has_overlapping_elements, write_refusal
from ..encoding.sparse import RowSparse, check_row_ids

_SEQ = (list, tuple)
_NDARRAY = np.ndarray


class Groups(NamedTuple):
    keys: list          # distinct keys, in order of first appearance
    arrays: list        # arrays[i]: the adopted arrays given for keys[i]
    all_host: bool      # every array is a NumPy array
    key_kind: type | None  # int or str; None when no key was given
    sparse: bool = False   # some array is a RowSparse
    #: the caller's objects behind adopted arrays that the call writes into (not NumPy
    #: or CuPy arrays): their libraries are told of the write (`device.announce_writes`)
    foreign: tuple = ()


#: int keys of at least this many bits are looked at closely: Python refuses to write
#: ints of more than `sys.get_int_max_str_digits()` digits (4300 by default) as text, so
#: such a key could be named in no message and written in no checkpoint.
_LONG_KEY_BITS = 13_000
_LONG_KEY = 1 << _LONG_KEY_BITS
#: below this, an int key is short at a glance (comparing with `_LONG_KEY` costs more)
_SHORT_KEY = 1 << 62


def check_key(key) -> tuple:
    """(`key` as an int or a str, its kind); KeyKindError or ArgumentError otherwise."""
    if isinstance(key, str):  # (a subclass, NumPy's str_, as a plain str, as ints are)
        return (key if type(key) is str else str(key)), str
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
    lo, hi = min(keys), max(keys)
    return (-_SHORT_KEY < lo and hi < _SHORT_KEY) or (-_LONG_KEY < lo and hi < _LONG_KEY)


def _adopt(key, obj, name, foreign):
    """`obj` adopted; when `foreign` is a list (the call writes into `obj`), a
    ReadOnlyError unless `obj` can be written in place, and `obj` appended to it when it
    is another library's array."""
    if type(obj) is RowSparse:  # passes as it is; the store routes it
        return obj
    try:
        array = adopt(obj)
    except GpukvError as exc:  # a device or dtype the store cannot take, an array its
        # own library will not hand over: name the key
        raise type(exc)(f"key {key!r}: {name}: {exc}") from None
    if array is None:
        raise ArgumentKindError(
            f"key {key!r}: {name} must be an array (NumPy, CuPy or any array protocol), "
            f"got {type(obj).__name__}")
    if foreign is not None and array is not obj:
        reason = write_refusal(obj, array)
        if reason is not None:
            raise ReadOnlyError(f"key {key!r}: {name} cannot be written in place: {reason}")
        foreign.append(obj)
    return array


def _one_key(key, value, name, groups_by_key, keys, arrays, foreign):
    """Add the arrays of one key (an array, or a list of arrays, one per device)."""
    if isinstance(value, _SEQ):
        if not value:
            raise ArgumentError(f"key {key!r}: {name} is an empty list; give one array per device")
        objs = value
    else:
        objs = (value,)
    adopted = []
    for obj in objs:
        if isinstance(obj, _SEQ) or (objs is value and type(obj) in (int, float, bool)):
            raise ArgumentKindError(
                f"key {key!r}: {name} is a list containing a {type(obj).__name__}: a list "
                f"holds one array per device; make a list of numbers an array first "
                f"(np.asarray)")
        adopted.append(_adopt(key, obj, name, foreign))
    index = groups_by_key.get(key)
    if index is None:
        groups_by_key[key] = len(keys)
        keys.append(key)
        arrays.append(adopted)
    else:  # a repeated key: more devices for the same key
        arrays[index].extend(adopted)


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
    return Groups(out_keys, arrays, True, kind)


def group(keys, values, name: str = "value", written: bool = False) -> Groups:
    """Normalise `keys` and `values` (or `out`) into Groups; raise on any malformed part.

    `written`: the call writes into these arrays (a pull's outs, pushpull's values when
    it has no out): each must be writable in place as its own library would allow.
    """
    # Fast paths: NumPy arrays under int or str keys, taken as they are.
    if (type(keys) is int and -_SHORT_KEY < keys < _SHORT_KEY) or type(keys) is str:
        plain = _plain_arrays(values)
        if plain is not None:
            return Groups([keys], [plain], True, type(keys))
    elif (type(keys) is list or type(keys) is tuple) and keys and (
            type(values) is list or type(values) is tuple) and len(keys) == len(values):
        groups = _group_plain(keys, values)
        if groups is not None:
            return groups
    groups_by_key: dict = {}
    out_keys: list = []
    arrays: list = []
    foreign: list | None = [] if written else None
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
            key, this_kind = check_key(raw_key)
            if kind is None:
                kind = this_kind
            elif this_kind is not kind:
                raise KeyKindError(
                    f"key {key!r}: one call mixes int and str keys ({kind.__name__} first)")
            _one_key(key, value, name, groups_by_key, out_keys, arrays, foreign)
    else:
        key, kind = check_key(keys)
        _one_key(key, values, name, groups_by_key, out_keys, arrays, foreign)
    all_host = all(type(a) is np.ndarray or isinstance(a, np.ndarray)
                   for per_key in arrays for a in per_key)
    sparse = not all_host and any(type(a) is RowSparse for per_key in arrays for a in per_key)
    return Groups(out_keys, arrays, all_host, kind, sparse, tuple(foreign or ()))


def pull_outs(key, out, priority, ignore_sparse=True) -> Groups:
    """A pull's `out` grouped by key and checked (after its priority and ignore_sparse):
    an ArgumentError without outs to write into."""
    if out is None:
        raise ArgumentError(f"key {key!r}: pull needs `out` arrays to write into")
    if type(priority) is not int:
        check_priority(key, priority)
    if type(ignore_sparse) is not bool and not isinstance(ignore_sparse, np.bool_):
        raise ArgumentKindError(f"key {key!r}: ignore_sparse: expected True or False, got "
                                f"{type(ignore_sparse).__name__}")
    return group(key, out, "out", written=True)


def pushpull_groups(key, value, out, priority) -> tuple[Groups, Groups]:
    """(values, outs) of a pushpull, grouped by key and checked (after its priority); the
    outs are the values themselves when `out` is None (written into, then)."""
    if type(priority) is not int:
        check_priority(key, priority)
    groups = group(key, value, "value", written=out is None)
    return groups, groups if out is None else group(key, out, "out", written=True)


#: what a priority that is no int says in row_sparse_pull, where MXNet's order differs
ROW_SPARSE_ORDER = ("; row_sparse_pull takes (key, out, row_ids, priority), where "
                    "MXNet's takes priority before row_ids: pass row_ids=...")


def check_priority(key, priority, hint: str = "") -> None:
    """An ArgumentKindError unless `priority` is an int (as MXNet, which takes a C int);
    `hint` ends its message."""
    if type(priority) is not int and not isinstance(priority, numbers.Integral):
        raise ArgumentKindError(
            f"key {key!r}: priority must be an int, got {type(priority).__name__}{hint}")


#: what `load_optimizer_states(update_counts=...)` takes: the file's counts, or a start over
UPDATE_COUNTS = ("saved", "restart")


def update_counts(value) -> str:
    """`load_optimizer_states`'s `update_counts`, checked: ArgumentKindError unless a
    str, ArgumentError unless one of UPDATE_COUNTS."""
    if not isinstance(value, str):
        raise ArgumentKindError(f"load_optimizer_states: update_counts must be one of "
                                f"{', '.join(map(repr, UPDATE_COUNTS))}, got "
                                f"{type(value).__name__}")
    if value not in UPDATE_COUNTS:
        raise ArgumentError(f"load_optimizer_states: update_counts={value!r} is not one of "
                            f"{', '.join(map(repr, UPDATE_COUNTS))}")
    return value


# ------------------------------------------------------------- against the store
# `entries` is the store's {key: entry}; an entry has the key's `value` (on its home).
_DTYPE_OK: dict = {}


def supported(dtype) -> bool:
    """Whether the store takes `dtype` (memoised: `dtype.name` is slow in NumPy)."""
    ok = _DTYPE_OK.get(dtype)
    if ok is None:  # (a dtype with named fields may be named as its base: float32)
        ok = _DTYPE_OK[dtype] = dtype.name in SUPPORTED_DTYPES and dtype.names is None
    return ok


def _supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_DTYPES))


def key_kind(kind, held, keys=()) -> None:
    """KeyKindError (naming the first of `keys`) if `kind` is not the store's `held`."""
    if kind is not None and held is not None and kind is not held:
        named = f"key {keys[0]!r}: " if keys else ""
        raise KeyKindError(f"{named}this store holds {held.__name__} keys; "
                           f"got a {kind.__name__} key")


def lookup(entries: dict, held, groups: Groups, op: str) -> list:
    """The entries of `groups`' keys; KeyKindError or UnknownKeyError naming the key."""
    kind = groups.key_kind
    if kind is not held and kind is not None and held is not None:
        key_kind(kind, held, groups.keys)
    found = list(map(entries.get, groups.keys))
    if None in found:  # name the first key never initialised
        for key, entry in zip(groups.keys, found):
            if entry is None:
                raise UnknownKeyError(f"key {key!r}: {op} of a key that was never initialised")
    return found


def sources(key, entry, arrays, op: str) -> None:
    """ShapeError or DTypeError naming `key` unless every array can be pushed into it."""
    value = entry.value
    for a in arrays:
        if a.shape != value.shape:
            raise ShapeError(f"key {key!r}: {op} expects shape {value.shape}, got {a.shape}")
        if a.dtype != value.dtype and not supported(a.dtype):
            raise DTypeError(f"key {key!r}: {op} of unsupported dtype {a.dtype} into a "
                             f"{value.dtype} key; supported: {_supported_list()}")


def outs(key, shape, arrays) -> None:
    """ShapeError, DTypeError or ReadOnlyError naming `key` unless every array can be
    pulled into."""
    for a in arrays:
        if a.shape != shape:
            raise ShapeError(f"key {key!r}: pull expects out of shape {shape}, got {a.shape}")
        if not supported(a.dtype):
            raise DTypeError(f"key {key!r}: out has unsupported dtype {a.dtype}; "
                             f"supported: {_supported_list()}")
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ReadOnlyError(f"key {key!r}: out array is read-only")
        if has_overlapping_elements(a):  # host or GPU: an expanded/overlapping view
            raise ReadOnlyError(f"key {key!r}: out has elements sharing memory (a "
                                f"zero-stride or overlapping view); pull needs one "
                                f"place per element")


def all_sources(groups: Groups, entries: list, op: str) -> bool:
    """`sources` for every key of a call; arrays of the key's own shape and dtype pass at
    once, any other key is checked (and named) by `sources`.

    Returns whether every array has its key's dtype (then none needs a cast).
    """
    exact = True
    for key, entry, arrays in zip(groups.keys, entries, groups.arrays):
        value = entry.value
        shape, dtype = value.shape, value.dtype
        for a in arrays:
            if a.dtype is not dtype or a.shape != shape:
                sources(key, entry, arrays, op)
                exact = False
                break
    return exact


def all_outs(groups: Groups, entries: list) -> None:
    """`outs` for every key of a call; writable C-contiguous NumPy arrays of the key's
    shape and a supported dtype pass at once, any other key is checked (and named) by
    `outs`."""
    ndarray = np.ndarray
    ok_dtype = None  # the last dtype found supported
    for key, entry, arrays in zip(groups.keys, entries, groups.arrays):
        shape = entry.value.shape
        for a in arrays:
            if type(a) is ndarray and a.shape == shape:
                dtype = a.dtype
                if dtype is ok_dtype or supported(dtype):
                    ok_dtype = dtype
                    flags = a.flags
                    if flags.writeable and flags.c_contiguous:  # one place per element
                        continue
            outs(key, shape, arrays)
            break


def distinct_outs(groups: Groups) -> Groups:
    """The outs of a call that writes GPU arrays (`groups`, not all on the host), each
    written once: an out given twice for one key (the same memory, shape and strides:
    the same value either way) is dropped the second time, since two copies into one
    array on two streams would race. ArgumentError naming both keys where two keys have
    one out: which value lands last is not defined on GPUs (on the host, the later key's,
    as in call order)."""
    if groups.sparse or sum(len(outs) for outs in groups.arrays) < 2:
        return groups
    owner: dict = {}  # memory_of(out) -> the key whose out it is
    arrays = []
    for key, outs in zip(groups.keys, groups.arrays):
        kept = []
        for a in outs:
            if not a.size:  # (no memory to share: empty arrays may all have address 0)
                kept.append(a)
                continue
            where = memory_of(a)
            first = owner.get(where)  # (keys are ints or strs, never None)
            if first is None:
                owner[where] = key
                kept.append(a)
            elif first != key:  # (another key's out; the same key's is written once)
                raise ArgumentError(
                    f"key {key!r}: its out is key {first!r}'s out too in this call; which "
                    f"value lands last is not defined on GPUs: pull them into arrays of "
                    f"their own")
        arrays.append(kept)
    return groups._replace(arrays=arrays)


def memory_of(a) -> tuple:
    """Where array `a` (NumPy or CuPy) keeps its elements, element for element: device,
    address, shape, strides and dtype (equal for two views of the same elements)."""
    if isinstance(a, np.ndarray):
        return ("host", a.__array_interface__["data"][0], a.shape, a.strides, a.dtype)
    return (a.device.id, a.data.ptr, a.shape, a.strides, a.dtype)


def init_group(keys, values) -> Groups:
    """`group` of an init's (or a broadcast's) keys and values, each key once: a key given
    twice is a DuplicateKeyError naming it (init takes one value per key, where a push
    sums a repeated key as more devices; MXNet refuses it too)."""
    if isinstance(keys, _SEQ) and len(keys) > 1:
        seen: set = set()
        for raw in keys:
            key, _ = check_key(raw)
            if key in seen:
                raise DuplicateKeyError(f"key {key!r}: given twice in one call; init takes "
                                        f"one value per key (a list of arrays for one key "
                                        f"gives one per device)")
            seen.add(key)
    return group(keys, values, "value")


def init_values(groups: Groups, entries: Mapping, held) -> None:
    """DuplicateKeyError, DTypeError or ShapeError naming the key unless every key of an
    init is new and its values agree."""
    key_kind(groups.key_kind, held, groups.keys)
    for key, arrays in zip(groups.keys, groups.arrays):
        if key in entries:
            raise DuplicateKeyError(f"key {key!r}: already initialised")
        first = arrays[0]
        if not supported(first.dtype):
            raise DTypeError(f"key {key!r}: unsupported dtype {first.dtype}; "
                             f"supported: {_supported_list()}")
        for a in arrays[1:]:
            if a.shape != first.shape:
                raise ShapeError(f"key {key!r}: init values disagree in shape: "
                                 f"{first.shape} and {a.shape}")
            if a.dtype != first.dtype and (a.dtype.newbyteorder("=")
                                           != first.dtype.newbyteorder("=")):
                raise DTypeError(f"key {key!r}: init values disagree in dtype: "
                                 f"{first.dtype} and {a.dtype}")


def broadcast_args(groups: Groups, out_groups: Groups, entries: Mapping, held) -> None:
    """`init_values` of a broadcast's values, then its outs against them: an out for a
    key without a value is an ArgumentError, one of another shape a ShapeError, each
    naming the key (checked whole, before the broadcast makes any key)."""
    init_values(groups, entries, held)
    key_kind(out_groups.key_kind, held, out_groups.keys)
    shapes = dict(zip(groups.keys, (a[0].shape for a in groups.arrays)))
    for k, arrays in zip(out_groups.keys, out_groups.arrays):
        if k not in shapes:
            raise ArgumentError(f"key {k!r}: broadcast has an out but no value for it")
        outs(k, shapes[k], arrays)


def refuse_sparse_outs(groups: Groups, in_place: bool) -> None:
    """ArgumentKindError naming the key if pushpull would have to pull into a RowSparse."""
    for key, arrays in zip(groups.keys, groups.arrays):
        if any(type(a) is RowSparse for a in arrays):
            what = "values (out=None pulls into them)" if in_place else "outs"
            raise ArgumentKindError(
                f"key {key!r}: pushpull cannot pull into RowSparse {what}: which rows they "
                f"should get is not defined (MXNet skips them without an error); pass dense "
                f"`out` arrays, or push then row_sparse_pull(key, out, row_ids)")


# ---------------------------------------------------------------- row_sparse_pull
def row_sparse_pulls(pairs, entries: Mapping, held) -> list:
    """(entry, RowSparse out, checked int64 row ids) for every (key, out, row_ids) of a
    row_sparse_pull, every part checked before any is returned."""
    work = []
    for k, o, ids in pairs:
        k, kind = check_key(k)
        key_kind(kind, held, (k,))
        entry = entries.get(k)
        if entry is None:
            raise UnknownKeyError(
                f"key {k!r}: row_sparse_pull of a key that was never initialised")
        if type(o) is not RowSparse:
            raise ArgumentKindError(f"key {k!r}: row_sparse_pull writes into gpukv.RowSparse "
                                    f"outs, got {type(o).__name__}")
        shape = entry.value.shape
        if o.shape != shape:
            raise ShapeError(f"key {k!r}: row_sparse_pull expects out of shape {shape}, "
                             f"got {o.shape}")
        if not supported(o.dtype):
            raise DTypeError(f"key {k!r}: out has unsupported dtype {o.dtype}; "
                             f"supported: {_supported_list()}")
        if ids is None:
            raise ArgumentError(f"key {k!r}: row_sparse_pull needs row_ids")
        ids = row_ids_array(k, ids)
        work.append((entry, o, check_row_ids(ids, shape[0], f"key {k!r}: row_sparse_pull")))
    return work


def row_ids_array(key, ids):
    """The row ids of one out as an array (any integer dtype; `check_row_ids` checks it).

    A list is taken as it is, never cast: [1, 2.7] is a DTypeError, not rows 1 and 2.
    A lone int (Python's or NumPy's) is refused: in MXNet's order it is the priority.
    """
    if isinstance(ids, (numbers.Number, np.generic)):
        number = f"{str(ids):.40}"
        raise ArgumentKindError(f"key {key!r}: row_ids must be an integer array or a list "
                                f"of ints, got the number {number} (one row is [{number}])"
                                + ROW_SPARSE_ORDER)
    if not isinstance(ids, (list, tuple)):
        try:
            array = adopt(ids)
        except GpukvError as exc:  # an array on a device this process cannot use
            raise type(exc)(f"key {key!r}: row_ids: {exc}") from None
    elif not ids:
        array = np.zeros(0, np.int64)
    else:
        try:
            array = np.asarray(ids)
        except ValueError:  # ragged
            array = None
        if array is not None and array.dtype == object:  # ints past 64 bits, or ragged
            array = None
    if array is None:
        raise ArgumentKindError(f"key {key!r}: row_ids must be an integer array or a list "
                                f"of ints, got {ids!r:.80}")
    return array


def row_sparse_pairs(key, out, row_ids) -> list:
    """(key, out, row_ids) triples for every out of a row_sparse_pull call."""
    if out is None:
        raise ArgumentError(f"key {key!r}: row_sparse_pull needs RowSparse `out`s")
    if isinstance(key, (list, tuple)):
        if not isinstance(out, (list, tuple)) or len(out) != len(key):
            raise ArgumentError(f"keys {list(key)!r}: a list of keys needs a list of outs "
                                f"of the same length")
        if not isinstance(row_ids, (list, tuple)) or len(row_ids) != len(key):
            raise ArgumentError(f"keys {list(key)!r}: a list of keys needs a list of row_ids "
                                f"of the same length")
        pairs = []
        for k, o, r in zip(key, out, row_ids):
            pairs.extend(_row_sparse_one(k, o, r))
        return pairs
    return _row_sparse_one(key, out, row_ids)


def _is_id_list(row_ids) -> bool:
    """Whether `row_ids` is a list with one id array per out (not a list of ints)."""
    return (isinstance(row_ids, (list, tuple)) and len(row_ids) > 0
            and not isinstance(row_ids[0], numbers.Integral))


def _row_sparse_one(key, out, row_ids) -> list:
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if _is_id_list(row_ids):
        if len(row_ids) == 1:  # as MXNet: one id array for every out
            return [(key, o, row_ids[0]) for o in outs]
        if len(row_ids) != len(outs):
            raise ArgumentError(f"key {key!r}: {len(outs)} outs but {len(row_ids)} row_ids")
        return [(key, o, r) for o, r in zip(outs, row_ids)]
    return [(key, o, row_ids) for o in outs]


def worker_values(values, what: str) -> np.ndarray:
    """`values` for `workers_max`: integers (or bools) of one shape, as an int64 array;
    ArgumentKindError naming `what` otherwise."""
    try:
        array = np.asarray(values)
    except ValueError:  # ragged
        array = np.asarray(values, dtype=object)
    if array.size and not np.can_cast(array.dtype, np.int64):
        raise ArgumentKindError(f"workers_max ({what}): expected integers of one "
                                f"shape, got {array.dtype}")
    return array.astype(np.int64)


def bound_methods(call: str, **methods) -> None:
    """ArgumentKindError naming the first of `methods` (name -> value) that is not a bound
    method: `call` holds them weakly, through their object."""
    for name, method in methods.items():
        if not inspect.ismethod(method):
            raise ArgumentKindError(f"{call}: {name} must be a bound method (held weakly, "
                                    f"through its object), got {type(method).__name__}")

"""The single-machine API on host arrays, and its parity with MXNet 1.9.1.

Numbers marked "MXNet" come from tests/data/mxnet_reference.json, recorded by
tests/data/make_mxnet_reference.py under MXNet 1.9.1; this suite does not need MXNet.
"""
from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gpukv
from gpukv.comm.host import HostStrategy

REF = json.loads((pathlib.Path(__file__).parents[1] / "data" / "mxnet_reference.json").read_text())
MX = REF["behaviours"]
SHAPE = (2, 3)
STORE_NAMES = ["local", "device", "local_update_cpu", "local_allreduce_cpu",
               "local_allreduce_device"]
KEYS = {"int": (3, [5, 7, 11]), "str": ("a", ["b", "c", "d"]),
        "huge": (2 ** 70, [2 ** 64, -(2 ** 65), 2 ** 31])}


@pytest.fixture(params=["local", "device"])
def kv(request):
    return gpukv.create(request.param)


@pytest.fixture(params=sorted(KEYS))
def keys(request):
    return KEYS[request.param]


def ones(value=1.0, shape=SHAPE, dtype=np.float32):
    return np.full(shape, value, dtype=dtype)


def value_of(kv, key, shape=SHAPE, dtype=np.float32):
    out = np.zeros(shape, dtype)
    kv.pull(key, out=out)
    return out


def summing(key, merged, stored):
    stored += merged


# ------------------------------------------------------------------ create and properties
@pytest.mark.parametrize("name", STORE_NAMES)
def test_type_is_the_name_given(name):
    """create(name).type returns the name, including MXNet's aliases."""
    assert gpukv.create(name).type == name


@pytest.mark.parametrize("name,expected", [("LOCAL", "local"), ("Device", "device"),
                                           ("Local_Allreduce_CPU", "local_allreduce_cpu")])
def test_type_is_lower_cased(name, expected):
    """Store names are case-insensitive and .type is the lower-cased name (MXNet too)."""
    assert gpukv.create(name).type == expected
    assert MX["type_upper_case"] == "local"


def test_default_store_is_local():
    """create() with no name makes a 'local' store."""
    assert gpukv.create().type == "local"
    assert isinstance(gpukv.create(), gpukv.KVStore)


@pytest.mark.parametrize("name", STORE_NAMES)
def test_alias_stores_work(name):
    """Every alias store runs the basic init/push/pull cycle."""
    kv = gpukv.create(name)
    kv.init(1, ones(1))
    kv.push(1, [ones(2), ones(3)])
    assert (value_of(kv, 1) == 5).all()


@pytest.mark.parametrize("name", ["foo", "dist", "", "local "])
def test_unknown_store_name_lists_valid_names(name):
    """An unknown store name is a ValueError that lists the valid names."""
    with pytest.raises(ValueError, match="local.*device") as info:
        gpukv.create(name)
    assert isinstance(info.value, gpukv.GpukvError)
    assert repr(name) in str(info.value)


def test_store_name_must_be_str():
    """A store name that is not a str is a TypeError."""
    with pytest.raises(TypeError) as info:
        gpukv.create(3)
    assert isinstance(info.value, gpukv.GpukvError)


def test_rank_and_num_workers(kv):
    """A single-process store is rank 0 of 1 worker (MXNet too)."""
    assert (kv.rank, kv.num_workers) == (MX["rank"], MX["num_workers"]) == (0, 1)


@pytest.mark.parametrize("values", [[0, 3, 1], [[True, False]], np.arange(4, dtype=np.uint8),
                                    []])
def test_workers_max_in_one_process_is_the_values(kv, values):
    """workers_max in one process returns the values themselves as an int64 array."""
    got = kv.workers_max(values, "a test")
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.asarray(values, dtype=np.int64))


@pytest.mark.parametrize("values", [[0.5], [[1, 2], [3]], np.array([1], np.uint64), ["a"]])
def test_workers_max_refuses_what_is_not_integers(kv, values):
    """workers_max refuses floats, ragged lists and integers past int64, naming the call."""
    with pytest.raises(gpukv.ArgumentKindError, match="workers_max .a test."):
        kv.workers_max(values, "a test")


@pytest.mark.parametrize("method", ["barrier", "_barrier"])
def test_barrier_returns_at_once(kv, method):
    """barrier() and its alias _barrier() return None at once in one process."""
    assert getattr(kv, method)() is None


@pytest.mark.parametrize("capability", ["optimizer", "OPTIMIZER"])
def test_is_capable_optimizer(kv, capability):
    """Every store can take an optimizer (MXNet answers True as well)."""
    assert kv.is_capable(capability) is True is MX["is_capable_optimizer"]


def test_is_capable_gradient_compression_follows_the_store_type(kv):
    """is_capable('gradient_compression') answers True for a 'device' store and False for a
    'local' one (MXNet's rule), never raises."""
    assert kv.is_capable("gradient_compression") is (kv.type == "device")


def test_the_capabilities_have_mxnets_names_on_the_class(kv):
    """MXNet's `kv.is_capable(KVStore.OPTIMIZER)`, on the class and on a store."""
    assert gpukv.KVStore.OPTIMIZER == "optimizer" and kv.is_capable(type(kv).OPTIMIZER)
    assert kv.is_capable(gpukv.KVStore.GRADIENT_COMPRESSION) is (kv.type == "device")


def test_is_capable_unknown_is_value_error(kv):
    """An unknown capability is a ValueError naming it (MXNet raises ValueError too)."""
    assert MX["is_capable_unknown_error"] == "ValueError"
    with pytest.raises(ValueError, match="foo") as info:
        kv.is_capable("foo")
    assert isinstance(info.value, gpukv.GpukvError)


# ----------------------------------------------------------------------- init / push / pull
def test_init_then_pull_gives_the_value(kv, keys):
    """A pulled key holds what init gave it, for int, str and huge int keys."""
    key, _ = keys
    kv.init(key, ones(4))
    assert (value_of(kv, key) == 4).all()


def test_push_one_array_assigns(kv, keys):
    """Without an updater a push of one array replaces the stored value."""
    key, _ = keys
    kv.init(key, ones(4))
    kv.push(key, ones(-2))
    assert (value_of(kv, key) == -2).all()


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_push_device_list_is_summed(kv, keys, n):
    """A push of a list of n arrays (one per device) stores their sum."""
    key, _ = keys
    kv.init(key, ones(0))
    kv.push(key, [ones(i + 1) for i in range(n)])
    assert (value_of(kv, key) == n * (n + 1) / 2).all()


def test_list_of_keys_with_arrays(kv, keys):
    """A list of keys takes one array per key."""
    _, key_list = keys
    kv.init(key_list, [ones(0)] * len(key_list))
    kv.push(key_list, [ones(i + 1) for i in range(len(key_list))])
    outs = [np.zeros(SHAPE, np.float32) for _ in key_list]
    kv.pull(key_list, out=outs)
    assert [o[0, 0] for o in outs] == [1, 2, 3]


def test_list_of_keys_with_device_lists(kv, keys):
    """A list of keys takes, per key, a list of arrays that are summed."""
    _, key_list = keys
    kv.init(key_list, [ones(0)] * len(key_list))
    kv.push(key_list, [[ones(i + 1)] * (i + 1) for i in range(len(key_list))])
    outs = [[np.zeros(SHAPE, np.float32) for _ in range(2)] for _ in key_list]
    kv.pull(key_list, out=outs)
    assert [[o[0, 0] for o in row] for row in outs] == [[1, 1], [4, 4], [9, 9]]


def test_list_of_keys_mixing_arrays_and_device_lists(kv):
    """Entries of a list of keys may each be an array or a list of arrays."""
    kv.init([1, 2], [ones(0), ones(0)])
    kv.push([1, 2], [ones(5), [ones(1), ones(2)]])
    assert value_of(kv, 1)[0, 0] == 5 and value_of(kv, 2)[0, 0] == 3


def test_tuples_are_lists(kv):
    """Tuples of keys and of arrays are accepted like lists."""
    kv.init((1, 2), (ones(0), ones(0)))
    kv.push((1, 2), (ones(2), (ones(1), ones(1))))
    outs = (np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32))
    kv.pull((1, 2), out=outs)
    assert outs[0][0, 0] == 2 and outs[1][0, 0] == 2


def test_repeated_key_counts_as_more_devices(kv):
    """A key repeated in one push list has all its values summed (MXNet: 1+3 = 4, +3 = 7)."""
    kv.init([9, 2, 5], [ones(0)] * 3)
    kv.set_updater(summing)
    kv.push([9, 2, 5], [ones(1), ones(2), ones(3)])
    kv.push([5, 9, 5], [ones(1), ones(2), ones(3)])
    assert value_of(kv, 5)[0, 0] == MX["repeated_key_push_sum/local"] == 7
    assert value_of(kv, 9)[0, 0] == 3


def test_repeated_key_with_device_lists(kv):
    """Repeated keys whose entries are device lists contribute every array."""
    kv.init(4, ones(0))
    kv.push([4, 4], [[ones(1), ones(2)], ones(3)])
    assert value_of(kv, 4)[0, 0] == 6


def test_pull_into_a_list_broadcasts(kv, keys):
    """Pulling one key into a list of arrays writes the value into every array."""
    key, _ = keys
    kv.init(key, ones(6))
    outs = [np.zeros(SHAPE, np.float32) for _ in range(4)]
    kv.pull(key, out=outs)
    assert all((o == 6).all() for o in outs)


def test_pull_repeated_key(kv):
    """A key repeated in a pull list fills every out given for it (MXNet too)."""
    kv.init(1, ones(16))
    outs = [np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)]
    kv.pull([1, 1], out=outs)
    assert [o[0, 0] for o in outs] == MX["repeated_key_pull"] == [16, 16]


@pytest.mark.parametrize("dtype", ["float64", "float16", "int32", "uint8"])
def test_pull_casts_into_the_out_dtype(kv, dtype):
    """Pulling into an out of another dtype casts, as MXNet does."""
    kv.init(3, ones(2))
    out = np.zeros(SHAPE, dtype)
    kv.pull(3, out=out)
    assert out.tolist() == MX["pull_casts_to_out_dtype"][dtype]


def test_pull_out_keyword_and_positional(kv):
    """pull takes out by keyword or by position, and priority/ignore_sparse are accepted."""
    kv.init(1, ones(3))
    a, b = np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)
    kv.pull(1, a)
    kv.pull(1, out=b, priority=-3, ignore_sparse=False)
    assert a[0, 0] == b[0, 0] == 3


def test_push_priority_is_accepted(kv):
    """push takes MXNet's priority argument by position or keyword."""
    kv.init(1, ones(0))
    kv.push(1, ones(2), 5)
    kv.push(1, ones(3), priority=-1)
    assert value_of(kv, 1)[0, 0] == 3


def test_pull_writes_out_in_place(kv):
    """pull writes into the given array object and returns None."""
    kv.init(1, ones(7))
    out = np.zeros(SHAPE, np.float32)
    address = out.__array_interface__["data"][0]
    assert kv.pull(1, out=out) is None
    assert out.__array_interface__["data"][0] == address and out[0, 0] == 7


def test_non_contiguous_sources_and_outs(kv):
    """Strided views are valid sources and outs."""
    kv.init(1, np.zeros((2, 3), np.float32))
    big = np.arange(24, dtype=np.float32).reshape(4, 6)
    kv.push(1, [big[::2, ::2], big[1::2, ::2]])
    out = np.zeros((4, 6), np.float32)
    kv.pull(1, out=out[::2, 1::2])
    expected = big[::2, ::2] + big[1::2, ::2]
    assert (out[::2, 1::2] == expected).all() and (out[1::2] == 0).all()


def test_zero_dim_and_empty_arrays(kv):
    """Scalars (shape ()) and empty arrays are keys like any other."""
    kv.init([1, 2], [np.float32(2.0) * np.ones((), np.float32), np.zeros((0, 3), np.float32)])
    kv.push([1, 2], [[np.ones((), np.float32)] * 3, np.zeros((0, 3), np.float32)])
    out, empty = np.zeros((), np.float32), np.ones((0, 3), np.float32)
    kv.pull([1, 2], out=[out, empty])
    assert out == 3 and empty.shape == (0, 3)


def test_numpy_integer_keys_are_ints(kv):
    """NumPy integer scalars are int keys, and the updater sees a Python int."""
    seen = []
    kv.init(np.int64(4), ones(0))
    kv.set_updater(lambda k, m, s: seen.append(k))
    kv.push(4, ones(1))
    kv.push(np.uint8(4), ones(1))
    assert seen == [4, 4] and all(type(k) is int for k in seen)


@pytest.mark.parametrize("key", [2 ** 31, 2 ** 63, 2 ** 70, -(2 ** 70), 10 ** 30])
def test_huge_int_keys_are_distinct(kv, key):
    """Ints past 64 bits are keys of their own (MXNet overflows past int32)."""
    assert MX["key_2_31_error"] == "OverflowError"
    kv.init([key, key + 1, key + 2 ** 64], [ones(1), ones(2), ones(3)])
    kv.push(key, ones(9))
    assert [value_of(kv, k)[0, 0] for k in (key, key + 1, key + 2 ** 64)] == [9, 2, 3]


def test_init_device_list_stores_the_first(kv):
    """init with a list of arrays that agree stores the first (MXNet refuses the form)."""
    assert MX["init_device_list_error"] == "MXNetError"
    kv.init(1, [ones(2), ones(5)])
    assert value_of(kv, 1)[0, 0] == 2


def test_init_key_dtype_is_kept(kv):
    """A key keeps the dtype it was initialised with."""
    kv.init(1, np.arange(6, dtype=np.int64).reshape(SHAPE))
    kv.push(1, [np.ones(SHAPE, np.int64)] * 2)
    out = np.zeros(SHAPE, np.int64)
    kv.pull(1, out=out)
    assert out.tolist() == [[2, 2, 2], [2, 2, 2]]


# ------------------------------------------------------------------------- pushpull
def test_pushpull_without_out_writes_back_into_value(kv):
    """pushpull(key, values) leaves the reduced result in every value array (MXNet: 6)."""
    kv.init(1, ones(1))
    values = [ones(i + 1) for i in range(3)]
    kv.pushpull(1, values)
    assert [v[0, 0] for v in values] == MX["pushpull_in_place"] == [6, 6, 6]


def test_pushpull_with_out_leaves_value_alone(kv):
    """pushpull(key, values, out) writes the result into out and not into values."""
    kv.init(1, ones(1))
    values = [ones(i + 1) for i in range(3)]
    outs = [np.zeros(SHAPE, np.float32) for _ in range(2)]
    kv.pushpull(1, values, out=outs)
    assert [o[0, 0] for o in outs] == MX["pushpull_with_out"]["out"]
    assert [v[0, 0] for v in values] == MX["pushpull_with_out"]["value"]


def test_pushpull_runs_the_updater(kv):
    """pushpull applies the updater before pulling (MXNet: 6 + 10 = 16)."""
    kv.init(1, ones(6))
    kv.set_updater(summing)
    value = ones(10)
    kv.pushpull(1, value)
    assert value[0, 0] == MX["pushpull_with_updater"] == 16


def test_pushpull_list_of_keys(kv, keys):
    """pushpull over a list of keys reduces each key and writes each result back."""
    _, key_list = keys
    kv.init(key_list, [ones(0)] * len(key_list))
    values = [[ones(i + 1), ones(1)] for i in range(len(key_list))]
    kv.pushpull(key_list, values)
    assert [[v[0, 0] for v in row] for row in values] == [[2, 2], [3, 3], [4, 4]]


def test_pushpull_positional_out_and_priority(kv):
    """pushpull takes out and priority by position."""
    kv.init(1, ones(0))
    out = np.zeros(SHAPE, np.float32)
    kv.pushpull(1, ones(4), out, 2)
    assert out[0, 0] == 4


# ------------------------------------------------------------------------- broadcast
def test_broadcast_inits_and_pulls(kv, keys):
    """broadcast(key, value, out) initialises the key and fills out (MXNet's dist test form)."""
    key, _ = keys
    out = np.zeros(SHAPE, np.float32)
    kv.broadcast(key, [ones(3)], out=out)
    assert out[0, 0] == 3 and value_of(kv, key)[0, 0] == 3


def test_broadcast_one_value_to_many_outs(kv):
    """broadcast of one array into a list of outs fills each (MXNet: 6, 6)."""
    outs = [np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)]
    kv.broadcast(22, ones(6), out=outs)
    assert [o[0, 0] for o in outs] == MX["broadcast_one_to_list"]


def test_broadcast_list_of_keys(kv):
    """broadcast of a list of keys into lists of per-device outs (MXNet: [[1, 1], [2, 2]])."""
    outs = [[np.zeros(SHAPE, np.float32) for _ in range(2)] for _ in range(2)]
    kv.broadcast([20, 21], [ones(1), ones(2)], out=outs)
    assert [[o[0, 0] for o in row] for row in outs] == MX["broadcast_list"]


def test_broadcast_priority_is_accepted(kv):
    """broadcast takes MXNet's priority argument."""
    out = np.zeros(SHAPE, np.float32)
    kv.broadcast(1, ones(2), out=out, priority=3)
    assert out[0, 0] == 2


def test_broadcast_of_an_existing_key_fails(kv):
    """broadcast of an initialised key is a duplicate init; nothing changes (MXNet errs too)."""
    assert MX["broadcast_existing_key_error"] == "MXNetError"
    kv.init(3, ones(2))
    out = np.full(SHAPE, -1, np.float32)
    with pytest.raises(gpukv.DuplicateKeyError, match="3"):
        kv.broadcast(3, ones(7), out=out)
    assert value_of(kv, 3)[0, 0] == 2 and (out == -1).all()


@pytest.mark.parametrize("call", ["init", "broadcast"])
def test_a_key_given_twice_in_one_init_is_refused_whole(kv, call):
    """init takes one value per key: a key repeated in the list (which a push sums as
    more devices) is a DuplicateKeyError naming it, and no key of the call is made (MXNet
    refuses it too, after making the keys before it)."""
    out = [np.full(SHAPE, -1, np.float32) for _ in range(3)]
    args = ([5, 6, 5], [ones(1), ones(2), ones(3)])
    with pytest.raises(gpukv.DuplicateKeyError, match="key 5: given twice"):
        getattr(kv, call)(*args, **({"out": out} if call == "broadcast" else {}))
    assert 5 not in kv and 6 not in kv
    assert all((o == -1).all() for o in out)
    kv.init(5, [ones(1), ones(2)])  # a list of arrays for one key: one per device
    assert value_of(kv, 5)[0, 0] == 1


def test_ignore_sparse_is_a_bool(kv):
    """A string would be taken as true: refused, naming the key, before any out changes."""
    kv.init(3, ones(2))
    out = np.zeros(SHAPE, np.float32)
    with pytest.raises(gpukv.ArgumentKindError, match="key 3: ignore_sparse"):
        kv.pull(3, out=out, ignore_sparse="no")
    assert not out.any()
    kv.pull(3, out=out, ignore_sparse=np.bool_(False))
    assert out[0, 0] == 2


# -------------------------------------------------------------------------- updaters
@pytest.mark.parametrize("method", ["set_updater", "_set_updater"])
def test_updater_sees_key_merged_and_stored(kv, keys, method):
    """The updater gets (key as given, the merged sum, the stored value) and edits stored."""
    key, _ = keys
    seen = []

    def update(k, merged, stored):
        seen.append((k, type(k), merged.copy(), stored.copy()))
        stored += merged * 2

    kv.init(key, ones(4))
    getattr(kv, method)(update)
    kv.push(key, [ones(1), ones(2)])
    (k, kind, merged, stored), = seen
    assert (k, kind) == (key, type(key))
    assert (merged == 3).all() and (stored == 4).all()
    assert value_of(kv, key)[0, 0] == 10


def test_updater_not_called_by_init_pull_or_broadcast(kv):
    """Only pushes call the updater."""
    calls = []
    kv.set_updater(lambda *a: calls.append(a))
    kv.init(1, ones(1))
    kv.broadcast(2, ones(1), out=np.zeros(SHAPE, np.float32))
    kv.pull(1, out=np.zeros(SHAPE, np.float32))
    assert calls == []


def test_updater_called_once_per_key_per_push(kv):
    """One push of a list calls the updater once per distinct key (MXNet: [5, 9])."""
    calls = []
    kv.init([9, 2, 5], [ones(0)] * 3)
    kv.set_updater(lambda k, m, s: calls.append(k))
    kv.push([5, 9, 5], [ones(1), ones(2), ones(3)])
    assert sorted(calls) == MX["updater_order_repeated/local"] == [5, 9]


@pytest.mark.parametrize("name", ["local", "device"])
def test_updater_order_int_keys_is_sorted(name):
    """A list push updates int keys in ascending order, as MXNet does ([9, 2, 5] -> 2, 5, 9)."""
    kv = gpukv.create(name)
    calls = []
    kv.init([9, 2, 5], [ones(0)] * 3)
    kv.set_updater(lambda k, m, s: calls.append(k))
    kv.push([9, 2, 5], [ones(1), ones(2), ones(3)])
    assert calls == MX[f"updater_order_int/{name}"] == [2, 5, 9]


@pytest.mark.parametrize("name", ["local", "device"])
def test_updater_order_str_keys_is_init_order(name):
    """A list push updates str keys in the order they were initialised, as MXNet does."""
    kv = gpukv.create(name)
    calls = []
    kv.init(["z", "a"], [ones(0)] * 2)
    kv.set_updater(lambda k, m, s: calls.append(k))
    kv.push(["a", "z"], [ones(1), ones(1)])
    assert calls == MX[f"updater_order_str/{name}"] == ["z", "a"]


def test_set_updater_replaces_the_previous(kv):
    """A second set_updater replaces the first."""
    kv.init(1, ones(0))
    kv.set_updater(summing)
    kv.push(1, ones(1))
    kv.set_updater(lambda k, m, s: s.__imul__(m))
    kv.push(1, ones(5))
    assert value_of(kv, 1)[0, 0] == 5


def test_updater_exception_propagates(kv):
    """An exception raised by the updater reaches the caller, and the store stays usable."""
    kv.init(1, ones(2))

    def boom(key, merged, stored):
        raise RuntimeError("updater failed")

    kv.set_updater(boom)
    with pytest.raises(RuntimeError, match="updater failed"):
        kv.push(1, ones(1))
    kv.set_updater(summing)
    kv.push(1, ones(1))
    assert value_of(kv, 1)[0, 0] == 3


# --------------------------------------------------------------------------- no aliasing
def test_init_copies_its_input(kv):
    """Changing an array after init changes nothing in the store (MXNet copies too)."""
    x = ones(3)
    kv.init(30, x)
    x[:] = 100
    assert value_of(kv, 30)[0, 0] == MX["init_copies"] == 3


def test_push_does_not_alias(kv):
    """Changing a pushed array after the push changes nothing (MXNet would give 77)."""
    assert MX["push_aliases"] == 77
    kv.init(30, ones(0))
    y = ones(5)
    kv.push(30, y)
    y[:] = 77
    assert value_of(kv, 30)[0, 0] == 5


@pytest.mark.parametrize("with_updater", [False, True])
def test_device_list_push_does_not_alias(kv, with_updater):
    """Changing any array of a pushed device list afterwards changes nothing."""
    kv.init(1, ones(0))
    if with_updater:
        kv.set_updater(lambda k, m, s: s.__setitem__(Ellipsis, m))
    values = [ones(1), ones(2)]
    kv.push(1, values)
    for v in values:
        v[:] = 50
    assert value_of(kv, 1)[0, 0] == 3


def test_pulled_array_is_a_copy(kv):
    """Changing a pulled array changes nothing in the store."""
    kv.init(1, ones(3))
    out = value_of(kv, 1)
    out[:] = -9
    assert value_of(kv, 1)[0, 0] == 3


def test_updater_cannot_change_the_pushed_array(kv):
    """The merged array an updater sees is never the caller's array under another name."""
    kv.init(1, ones(0))
    pushed = ones(4)

    def meddle(key, merged, stored):
        stored[...] = merged
        try:
            merged[...] = -1
        except ValueError:
            pass  # read-only is fine

    kv.set_updater(meddle)
    kv.push(1, pushed)
    assert (pushed == 4).all() and value_of(kv, 1)[0, 0] == 4


# ------------------------------------------------------------------------------ logging
def test_device_store_says_once_it_reduces_on_host(caplog):
    """A 'device' store with host arrays logs once that it reduces on the host."""
    kv = gpukv.create("device")
    with caplog.at_level(logging.INFO, logger="gpukv"):
        kv.init(1, ones(0))
        kv.init(2, ones(0))
        kv.push([1, 2], [ones(1), ones(1)])
    messages = [r.getMessage() for r in caplog.records if "host" in r.getMessage()]
    assert len(messages) == 1


def test_local_store_logs_nothing(caplog):
    """A 'local' store with host arrays logs no warning."""
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        kv = gpukv.create("local")
        kv.init(1, ones(0))
        kv.push(1, ones(1))
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def _made_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and "store made" in r.getMessage()]


@pytest.mark.parametrize("name,options,line", [
    ("local", {}, "gpukv 'local' store made: one process, strategy cpu"),
    ("device", {"strategy": "tree", "deterministic": True},
     "gpukv 'device' store made: one process, strategy tree, deterministic"),
])
def test_a_store_made_says_its_kind_and_strategy_at_info(name, options, line, monkeypatch,
                                                         caplog):
    """gpukv.create of a one-process store logs one INFO line naming its kind, its
    strategy and whether it is deterministic."""
    monkeypatch.delenv("GPUKV_RUN_ATTEMPT", raising=False)
    monkeypatch.delenv("GPUKV_DETERMINISTIC", raising=False)
    monkeypatch.delenv("GPUKV_STRATEGY", raising=False)
    with caplog.at_level(logging.INFO, logger="gpukv"):
        gpukv.create(name, **options)
    assert _made_lines(caplog) == [line]


def test_a_store_made_in_a_restart_says_which(monkeypatch, caplog):
    """In attempt 2 of `gpukv run --max-restarts 3` the store-made line says the restart."""
    monkeypatch.setenv("GPUKV_RUN_ATTEMPT", "2")
    monkeypatch.setenv("GPUKV_RUN_MAX_RESTARTS", "3")
    with caplog.at_level(logging.INFO, logger="gpukv"):
        gpukv.create("local")
    assert _made_lines(caplog) == ["gpukv 'local' store made: one process, strategy cpu, "
                                   "restart 2 of at most 3 (GPUKV_RUN_ATTEMPT=2)"]


def test_a_malformed_attempt_is_named_and_the_store_still_made(monkeypatch, caplog):
    """A GPUKV_RUN_ATTEMPT that is not a count is named in the store-made line, not raised."""
    monkeypatch.setenv("GPUKV_RUN_ATTEMPT", "two")
    with caplog.at_level(logging.INFO, logger="gpukv"):
        gpukv.create("local")
    assert _made_lines(caplog) == ["gpukv 'local' store made: one process, strategy cpu, "
                                   "GPUKV_RUN_ATTEMPT='two': not a count"]


def test_repr_names_type():
    """repr(kv) shows the store type."""
    assert "local" in repr(gpukv.create("local"))


# ----------------------------------------------------------------------- import hygiene
def test_import_does_not_import_cupy():
    """`import gpukv` and a host push/pull never import CuPy."""
    code = (
        "import sys, numpy as np, gpukv\n"
        "assert 'cupy' not in sys.modules, 'import'\n"
        "for name in ('local', 'device'):\n"
        "    kv = gpukv.create(name)\n"
        "    kv.init([1, 2], [np.ones(3), np.ones(3)])\n"
        "    kv.push(1, [np.ones(3)] * 2); kv.pushpull(2, np.ones(3))\n"
        "    kv.pull([1, 2], out=[np.zeros(3), [np.zeros(3)]])\n"
        "assert 'cupy' not in sys.modules, 'host push/pull'\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ------------------------------------------------ MXNet's own test_kvstore.py, replayed
UNIT = REF["kvstore_unittests"]
UNIT_SHAPE = (4, 4)


def _first(a):
    return float(a.ravel()[0])


def _unit_store(name, use_str):
    kv = gpukv.create(name)
    if use_str:
        kv.init("a", np.zeros(UNIT_SHAPE, np.float32))
        kv.init(["b", "c", "d"], [np.zeros(UNIT_SHAPE, np.float32)] * 3)
        return kv, "a", ["b", "c", "d"]
    kv.init(3, np.zeros(UNIT_SHAPE, np.float32))
    kv.init([5, 7, 11], [np.zeros(UNIT_SHAPE, np.float32)] * 3)
    return kv, 3, [5, 7, 11]


def _unit(z=0.0):
    return np.full(UNIT_SHAPE, z, np.float32)


def _run_unittest(test, name, use_str):
    kv, key, key_list = _unit_store(name, use_str)
    if test == "single":
        kv.push(key, _unit(1))
        val = _unit()
        kv.pull(key, out=val)
        return _first(val)
    if test == "init":
        kv2 = gpukv.create(name)
        kv2.init(key, _unit(4))
        a = _unit()
        kv2.pull(key, out=a)
        return _first(a)
    if test == "list":
        kv.push(key, _unit(1))
        kv.push(key_list, [_unit(4)] * len(key_list))
        val = [_unit() for _ in key_list]
        kv.pull(key_list, out=val)
        return [_first(v) for v in val]
    if test in ("aggregator", "updater"):
        scale = 2.0 if test == "aggregator" else 1.0
        if test == "updater":
            kv._set_updater(summing)
        vals = [_unit(1) for _ in range(4)]
        kv.push(key, vals)
        kv.pull(key, out=vals)
        single = [_first(v) for v in vals]
        vals = [[_unit(scale) for _ in range(4)] for _ in key_list]
        for _ in range(4 if test == "updater" else 1):
            kv.push(key_list, vals)
        kv.pull(key_list, out=vals)
        return {"single": single, "list": [[_first(v) for v in vv] for vv in vals]}
    if test in ("broadcast", "pushpull"):
        kv = gpukv.create(name)
        bkeys = ["10", "11", "12"] if use_str else [10, 11, 12]
        val = [_unit() for _ in bkeys]
        for i, k in enumerate(bkeys):
            kv.broadcast(k, [_unit(i)], out=val[i])
        if test == "broadcast":
            return [_first(v) for v in val]
        arrs = [_unit(j + 1) for j in range(4)]
        kv.pushpull(bkeys[0], arrs)
        return [_first(v) for v in arrs]
    raise AssertionError(test)


UNIT_CASES = sorted(k for k in UNIT if not k.startswith("get_type/"))


@pytest.mark.parametrize("case", UNIT_CASES)
def test_mxnet_kvstore_unittest(case):
    """gpukv gives the numbers MXNet 1.9.1's own KVStore unit tests give."""
    test, name, kind = case.split("/")
    assert _run_unittest(test, name, kind == "str") == UNIT[case]


@pytest.mark.parametrize("case", sorted(k for k in UNIT if k.startswith("get_type/")))
def test_mxnet_get_type(case):
    """kv.type equals MXNet's answer for every store name."""
    name = case.split("/", 1)[1]
    assert gpukv.create(name).type == UNIT[case]


# --------------------------------------------- random operation sequences, replayed
def _decode(entry):
    if "a" in entry:
        return np.array(entry["a"], np.float32)
    return [np.array(x, np.float32) for x in entry["l"]]


def _call_arg(key, encoded):
    if isinstance(key, list):
        return [_decode(e) for e in encoded]
    return _decode(encoded)


def _zeros_like(arg):
    if isinstance(arg, list):
        return [_zeros_like(a) for a in arg]
    return np.zeros_like(arg)


def _as_lists(arg):
    if isinstance(arg, list):
        return [_as_lists(a) for a in arg]
    return arg.tolist()


def _encoded_lists(key, encoded):
    return _as_lists(_call_arg(key, encoded))


UPDATERS = {"sum": lambda k, m, s: s.__iadd__(m), "scaled": lambda k, m, s: s.__iadd__(m * 0.5)}


@pytest.mark.parametrize("seq", REF["sequences"],
                         ids=[f"{s['seed']}-{s['store']}-{s['key_kind']}"
                              for s in REF["sequences"]])
def test_mxnet_random_sequence(seq):
    """A recorded random sequence of MXNet calls gives gpukv exactly MXNet's pulled values."""
    kv = gpukv.create(seq["store"])
    for step, op in enumerate(seq["ops"]):
        name, key = op["op"], op.get("key")
        where = f"step {step}: {name} {key!r}"
        if name == "set_updater":
            kv._set_updater(UPDATERS[op["updater"]])
        elif name == "init":
            kv.init(key, _call_arg(key, op["value"]))
        elif name == "push":
            kv.push(key, _call_arg(key, op["value"]))
        elif name in ("pull", "broadcast", "pushpull"):
            out = None
            if "out" in op:
                out = _zeros_like(_call_arg(key, op["out"]))
            if name == "pull":
                kv.pull(key, out=out)
            elif name == "broadcast":
                kv.broadcast(key, _call_arg(key, op["value"]), out=out)
            else:
                value = _call_arg(key, op["value"])
                kv.pushpull(key, value, out=out)
                if out is None:
                    assert _as_lists(value) == _encoded_lists(key, op["value_after"]), where
                    continue
            assert _as_lists(out) == _encoded_lists(key, op["out"]), where
        else:
            raise AssertionError(where)
    for k, expected in seq["final"].items():
        key = int(k) if seq["key_kind"] == "int" else k
        assert value_of(kv, key, shape=(2, 2)).tolist() == expected, f"final {key!r}"


def test_updater_set_after_a_device_push_sees_the_stored_value(kv):
    """An updater set after plain pushes adds to the stored value (MXNet's aliasing gives 4)."""
    assert MX["updater_after_device_push"] == 4
    kv.init(1, ones(1))
    kv.push(1, [ones(2), ones(3)])
    kv.set_updater(summing)
    kv.push(1, [ones(1), ones(1)])
    assert value_of(kv, 1)[0, 0] == 7


def test_keys_len_and_contains():
    """keys() lists the keys in init order, len() counts them and `in` tells a key of the
    store from any other object (unhashable ones included) without raising."""
    kv = gpukv.create("local")
    assert kv.keys() == [] and len(kv) == 0 and 3 not in kv
    kv.init([7, 3], [np.zeros(2), np.zeros(2)])
    kv.init(5, np.zeros(2))
    assert kv.keys() == [7, 3, 5] and len(kv) == 3
    assert 3 in kv and 4 not in kv and "3" not in kv and [3] not in kv and True not in kv
    assert np.int64(3) in kv


@pytest.mark.parametrize("name", ["local", "device"])
def test_numpy_keys_are_kept_as_plain_ints_and_strs(name):
    """NumPy's int and str scalars (keys read from an array) are the plain int and str
    keys: keys() gives those, and either form reaches the key."""
    kv = gpukv.create(name)
    kv.init([np.int64(3), np.int32(4)], [np.zeros(2), np.zeros(2)])
    assert [type(k) for k in kv.keys()] == [int, int]
    words = gpukv.create(name)
    words.init(np.array(["w", "b"])[0], np.zeros(2))
    words.init("b", np.zeros(2))
    assert words.keys() == ["w", "b"] and [type(k) for k in words.keys()] == [str, str]
    words.push(np.str_("w"), np.ones(2))
    assert np.str_("w") in words and "w" in words
    out = np.empty(2)
    words.pull("w", out=out)
    assert out.tolist() == [1.0, 1.0]


# ------------------------------------------------------------------ adopted values
@pytest.mark.parametrize("name", ["local", "device"])
def test_a_pull_into_an_adopted_value_writes_the_other_outs_and_copies_nothing(
        name, monkeypatch):
    """A store that adopted the caller's arrays (`LocalStore.adopt`) updates them in
    place; a pull whose outs include the value itself writes the others and leaves the
    value as the update made it, and a pull into the value alone copies nothing."""
    kv = gpukv.create(name)
    weights = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
    kv.adopt(list(weights), list(weights.values()))
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.5))
    kv.push(["w", "b"], [np.ones((2, 3), np.float32), np.full(4, 2.0, np.float32)])
    expected_w = np.arange(6, dtype=np.float32).reshape(2, 3) - 0.5
    np.testing.assert_array_equal(weights["w"], expected_w)  # the update, in place
    np.testing.assert_array_equal(weights["b"], np.zeros(4, np.float32))
    other = np.full((2, 3), -7.0, np.float32)
    kv.pull("w", out=[weights["w"], other])
    np.testing.assert_array_equal(other, expected_w)
    np.testing.assert_array_equal(weights["w"], expected_w)
    copies: list = []
    for method in ("broadcast_columns", "broadcast_many"):
        real = getattr(HostStrategy, method)
        monkeypatch.setattr(HostStrategy, method,
                            lambda self, *a, real=real: (copies.append(a), real(self, *a)))
    kv.pull(["w", "b"], out=[weights["w"], weights["b"][:]])
    assert copies == []
    np.testing.assert_array_equal(weights["b"], np.zeros(4, np.float32))
    kv.pull("b", out=[weights["b"], np.empty(4, np.float32)])  # (the check above can fail)
    assert len(copies) == 1

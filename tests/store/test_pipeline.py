"""The call pipeline: every call is checked whole before anything changes, and updaters run
in the documented order for every key kind (dense, compressed, row-sparse)."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import RowSparse


def _values(kv, keys, shape):
    out = {}
    for k in keys:
        o = np.zeros(shape, np.float32)
        kv.pull(k, out=o)
        out[k] = o
    return out


def _store(name="local", keys=(1, 2, 3), shape=(4, 2)):
    kv = gpukv.create(name)
    kv.init(list(keys), [np.full(shape, float(k), np.float32) for k in keys])
    return kv


def test_push_with_a_bad_dense_key_leaves_the_row_sparse_key_unchanged():
    """A push of [key of a dtype the optimizer refuses, row-sparse key] raises before the
    optimizer touches the row-sparse key."""
    kv = gpukv.create("local")
    kv.init([1, 2], [np.ones((4, 2), np.int32), np.ones((4, 2), np.float32)])
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=1.0))
    rows = RowSparse(np.array([0, 2]), np.ones((2, 2), np.float32), (4, 2))
    with pytest.raises(gpukv.DTypeError, match="key 1"):  # SGD needs a float key
        kv.push([1, 2], [np.ones((4, 2), np.int32), rows])
    np.testing.assert_array_equal(_values(kv, (2,), (4, 2))[2], np.ones((4, 2), np.float32))


def test_push_with_a_bad_dense_key_leaves_the_compressed_key_and_its_residual_unchanged():
    """With compression on, a failing push changes neither the other keys nor their residuals."""
    kv, fresh = gpukv.create("device"), gpukv.create("device")
    for s in (kv, fresh):
        s.init([1, 2], [np.ones((4, 2), np.int32), np.full((4, 2), 2, np.float32)])
        s.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        s.set_optimizer(gpukv.optim.SGD(learning_rate=1.0))
    grad = np.full((4, 2), 0.3, np.float32)
    with pytest.raises(gpukv.DTypeError, match="key 1"):
        kv.push([1, 2], [np.ones((4, 2), np.int32), grad])
    np.testing.assert_array_equal(_values(kv, (2,), (4, 2))[2], np.full((4, 2), 2, np.float32))
    for s in (kv, fresh):  # a residual kept from the failed push would make 0.6 cross 0.5
        s.push(2, grad)
    np.testing.assert_array_equal(_values(kv, (2,), (4, 2))[2], _values(fresh, (2,), (4, 2))[2])


def test_row_sparse_keeps_the_ids_it_was_built_with():
    """Editing the caller's id array after building a RowSparse changes nothing it holds."""
    ids = np.array([0, 2], np.int64)
    rows = RowSparse(ids, np.ones((2, 2), np.float32), (4, 2))
    ids[0] = -1
    kv = _store()
    kv.push(1, rows)
    expected = np.zeros((4, 2), np.float32)
    expected[[0, 2]] = 1
    np.testing.assert_array_equal(_values(kv, (1,), (4, 2))[1], expected)


@pytest.mark.parametrize("bad", [-1, 4, 99])
def test_push_checks_row_ids_edited_in_place(bad):
    """Ids edited in a RowSparse after it was built are checked by push, which then changes
    nothing and names the key."""
    rows = RowSparse(np.array([0, 2]), np.ones((2, 2), np.float32), (4, 2))
    rows.indices[0] = bad
    kv = _store()
    before = _values(kv, (1, 2), (4, 2))
    with pytest.raises(gpukv.ArgumentError, match=f"key 2: .*row id {bad}"):
        kv.push([1, 2], [np.ones((4, 2), np.float32), rows])
    after = _values(kv, (1, 2), (4, 2))
    for k in (1, 2):
        np.testing.assert_array_equal(after[k], before[k])


def test_init_that_cannot_allocate_creates_no_key():
    """An init whose second value cannot be copied (no memory) raises a typed error naming the
    key and creates neither key."""
    kv = gpukv.create("local")
    huge = np.broadcast_to(np.float32(1), (1 << 46,))
    with pytest.raises(gpukv.GpukvError, match="key 'b'") as info:
        kv.init(["a", "b"], [np.ones(3, np.float32), huge])
    assert isinstance(info.value, MemoryError)
    kv.init("a", np.full(3, 2, np.float32))  # not a DuplicateKeyError: 'a' was never created
    out = np.zeros(3, np.float32)
    kv.pull("a", out=out)
    np.testing.assert_array_equal(out, [2, 2, 2])


def _recording_store(name, *, raise_on=None):
    kv = _store(name)
    seen = []

    def updater(key, merged, stored):
        seen.append(key)
        if key == raise_on:
            raise RuntimeError("boom")
        stored += 10

    kv.set_updater(updater)
    return kv, seen


@pytest.mark.parametrize("kinds", ["compressed", "row_sparse", "both"])
def test_updater_order_is_ascending_for_every_key_kind(kinds):
    """Int keys reach the updater in ascending order whatever their kinds in one push."""
    kv, seen = _recording_store("device")
    if kinds != "row_sparse":
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    rows = RowSparse(np.array([1]), np.ones((1, 2), np.float32), (4, 2))
    dense = np.ones((4, 2), np.float32)
    values = {3: dense, 1: dense, 2: rows if kinds != "compressed" else dense}
    kv.push([3, 1, 2], [values[3], values[1], values[2]])
    assert seen == [1, 2, 3]


def test_updater_raising_keeps_the_earlier_keys_updates():
    """An updater raising on key 2 leaves key 1 updated and key 3 unchanged, row-sparse keys
    included."""
    kv, seen = _recording_store("device", raise_on=2)
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    rows = RowSparse(np.array([1]), np.ones((1, 2), np.float32), (4, 2))
    with pytest.raises(RuntimeError, match="boom"):
        kv.push([3, 2, 1], [np.ones((4, 2), np.float32), np.ones((4, 2), np.float32), rows])
    values = _values(kv, (1, 2, 3), (4, 2))
    np.testing.assert_array_equal(values[1], np.full((4, 2), 11, np.float32))
    np.testing.assert_array_equal(values[3], np.full((4, 2), 3, np.float32))
    assert seen == [1, 2]


@pytest.mark.parametrize("devices", [1, 2])
def test_updater_may_scale_merged_in_place(devices):
    """`merged *= 0.5` works with one device as with two, and never writes the caller's array."""
    kv = _store()
    kv.set_updater(lambda key, merged, stored: (merged.__imul__(0.5), stored.__setitem__(
        slice(None), merged)))
    grads = [np.full((4, 2), 2, np.float32) for _ in range(devices)]
    kv.push(1, grads if devices > 1 else grads[0])
    np.testing.assert_array_equal(_values(kv, (1,), (4, 2))[1],
                                  np.full((4, 2), devices, np.float32))
    for g in grads:
        np.testing.assert_array_equal(g, np.full((4, 2), 2, np.float32))


def test_merged_kept_by_the_updater_does_not_see_the_callers_writes():
    """With one device, `merged` is not the caller's array: writing the array after the push
    does not change what the updater was given."""
    kept = []
    kv = _store()
    kv.set_updater(lambda key, merged, stored: kept.append(merged.copy() if kept else merged))
    grad = np.full((4, 2), 2, np.float32)
    kv.push(1, grad)
    grad[...] = 99
    assert not np.shares_memory(kept[0], grad)
    np.testing.assert_array_equal(kept[0], np.full((4, 2), 2, np.float32))


def test_int_keys_too_long_to_write_are_refused_by_name():
    """An int key of more digits than Python writes (4300) is an ArgumentError whose message
    can be printed, in a single and in a list call."""
    key = 10 ** 5000
    kv = gpukv.create("local")
    with pytest.raises(gpukv.ArgumentError) as info:
        kv.init(key, np.zeros(3, np.float32))
    assert "bits" in str(info.value)
    with pytest.raises(gpukv.ArgumentError):
        kv.push([1, key], [np.zeros(3, np.float32)] * 2)


def test_long_int_keys_still_work():
    """Ints past 64 bits but short enough to write remain keys."""
    kv = gpukv.create("local")
    keys = [2 ** 70, -(2 ** 65), 10 ** 4000]
    kv.init(keys, [np.full(2, i, np.float32) for i in range(3)])
    out = np.zeros(2, np.float32)
    kv.pull(10 ** 4000, out=out)
    np.testing.assert_array_equal(out, [2, 2])

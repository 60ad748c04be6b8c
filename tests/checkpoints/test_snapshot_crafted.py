"""Snapshots whose files are whole (every checksum holds) but wrong inside: a shard header
missing a field or holding one of the wrong type, a key of the other key kind, a shard or
worker file copied in from another step. Loading or resuming such a snapshot raises
CheckpointError naming the file and the problem, and leaves the store as it was."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import gpukv
from gpukv import optim
from gpukv.checkpoints import snapshots
from gpukv.checkpoints.checkpoint import read_archive, write_archive

INT_KEYS = {1: ("float32", (2, 3)), 2: ("float16", (5,)), 3: ("float32", (4,))}
STR_KEYS = {"a": ("float32", (2, 3)), "b": ("float32", (5,))}


def _store(keys, seed=0, optimizer=True):
    """A one-process store holding `keys`, trained two pushes by Adam (or, without
    `optimizer`, holding the sums of the pushes)."""
    kv = gpukv.create("local")
    rng = np.random.default_rng(seed)
    kv.init(list(keys), [rng.standard_normal(s).astype(d) for d, s in keys.values()])
    if optimizer:
        kv.set_optimizer(optim.Adam(learning_rate=0.01))
    for _ in range(2):
        kv.push(list(keys), [rng.standard_normal(s).astype(d) for d, s in keys.values()])
    return kv


def _fingerprint(kv, keys, path):
    """The store's keys, the bytes of the values of `keys` and its whole optimizer
    state."""
    outs = [np.zeros(s, d) for d, s in keys.values()]
    kv.pull(list(keys), out=outs)
    kv.save_optimizer_states(path, dump_optimizer=True)
    header, arrays = read_archive(path)
    return (kv.keys(), [o.tobytes() for o in outs], header,
            {n: a.tobytes() for n, a in sorted(arrays.items())})


def _snapshots(root, keys, steps=(1, 2), optimizer=True):
    """Folders of snapshots of a store holding `keys`, one per step (all kept)."""
    kv = _store(keys, seed=1, optimizer=optimizer)
    folders = []
    for step in steps:
        kv.push(list(keys), [np.ones(s, d) for d, s in keys.values()])
        folders.append(kv.snapshot(root, step, user_state={"step": step}, keep=len(steps)))
    kv.finish_snapshots()
    return folders


def _forge(path, edit):
    """Rewrite the archive at `path` with `edit(header)` applied to its header, through
    the archive writer: every checksum holds, only the content is wrong."""
    header, arrays = read_archive(path)
    edit(header)
    write_archive(path, header, arrays)


def _refused(tmp_path, keys, folder, file, *words):
    """A fresh store's load of `folder` and resume from its root both raise
    CheckpointError naming `file` and holding every one of `words` (outside the path),
    and change nothing."""
    kv = _store(keys, seed=7)
    before = _fingerprint(kv, keys, tmp_path / "before.states")
    with pytest.raises(gpukv.CheckpointError) as loaded:
        kv.load(folder)
    with pytest.raises(gpukv.CheckpointError) as resumed:
        kv.resume(os.path.dirname(folder))
    for error in (loaded.value, resumed.value):
        message = str(error)
        assert str(file) in message, (file, message)
        for word in words:
            assert word in message.replace(str(tmp_path), "<tmp>"), (word, message)
    assert _fingerprint(kv, keys, tmp_path / "after.states") == before


def _key_entry(header, key):
    (entry,) = [e for e in header["keys"] if e.get("key") == key]
    return entry


def _drop(field):
    return lambda h: _key_entry(h, 2).pop(field)


def _set(field, value):
    return lambda h: _key_entry(h, 2).__setitem__(field, value)


#: (edit of the shard's header, what the message must name besides the file)
BAD_KEY_FIELDS = {
    "no index": (_drop("index"), ["key 2", "'index'", "missing"]),
    "no shape": (_drop("shape"), ["key 2", "'shape'", "missing"]),
    "no home": (_drop("home"), ["key 2", "'home'", "missing"]),
    "no start": (_drop("start"), ["key 2", "'start'", "missing"]),
    "no stop": (_drop("stop"), ["key 2", "'stop'", "missing"]),
    "shape ab": (_set("shape", "ab"), ["key 2", "'shape'", "'ab'"]),
    "shape of strs": (_set("shape", ["5"]), ["key 2", "'shape'", "['5']"]),
    "negative shape": (_set("shape", [-5]), ["key 2", "'shape'", "[-5]"]),
    "index a str": (_set("index", "1"), ["key 2", "'index'", "'1'"]),
    "index a bool": (_set("index", True), ["key 2", "'index'", "True"]),
    "index a float": (_set("index", 1.0), ["key 2", "'index'", "1.0"]),
    "home an int": (_set("home", 3), ["key 2", "'home'", "3"]),
    "start a float": (_set("start", 0.0), ["key 2", "'start'", "0.0"]),
    "stop None": (_set("stop", None), ["key 2", "'stop'", "None"]),
    "stop before start": (_set("start", 9), ["key 2", "'start'", "9"]),
}

#: fields of the shard itself
BAD_SHARD_FIELDS = {
    "no step": (lambda h: h.pop("step"), ["'step'", "missing"]),
    "step a str": (lambda h: h.__setitem__("step", "2"), ["'step'", "'2'"]),
    "no keys": (lambda h: h.pop("keys"), ["'keys'", "missing"]),
    "keys a dict": (lambda h: h.__setitem__("keys", {}), ["'keys'", "{}"]),
    "a key entry a list": (lambda h: h["keys"].__setitem__(1, [2]), ["'keys'", "[2]"]),
    "no key": (lambda h: h["keys"][1].pop("key"), ["'key'", "missing"]),
    "store_type an int": (lambda h: h.__setitem__("store_type", 1), ["'store_type'", "1"]),
    "key_kind float": (lambda h: h.__setitem__("key_kind", "float"), ["'key_kind'", "'float'"]),
    "optimizer a list": (lambda h: h.__setitem__("optimizer", []), ["'optimizer'", "[]"]),
    "optimizer arrays a str": (lambda h: h["optimizer"].__setitem__("arrays", "x"),
                               ["'optimizer'", "'arrays'", "'x'"]),
    "optimizer without header": (lambda h: h["optimizer"].pop("header"),
                                 ["'optimizer'", "'header'", "missing"]),
}


@pytest.mark.parametrize("edit,words", list(BAD_KEY_FIELDS.values()), ids=list(BAD_KEY_FIELDS))
def test_a_key_field_missing_or_of_a_wrong_type_is_refused(tmp_path, edit, words):
    """A shard header (checksums whole) missing a key's field or holding one of the wrong
    type is refused naming the shard, the key and the field; nothing changes."""
    _, newest = _snapshots(tmp_path / "snaps", INT_KEYS)
    shard = os.path.join(newest, snapshots.shard_file(0, 1))
    _forge(shard, edit)
    _refused(tmp_path, INT_KEYS, newest, shard, *words)


@pytest.mark.parametrize("edit,words", list(BAD_SHARD_FIELDS.values()),
                         ids=list(BAD_SHARD_FIELDS))
def test_a_shard_field_missing_or_of_a_wrong_type_is_refused(tmp_path, edit, words):
    """A shard header (checksums whole) missing one of its own fields, or holding one of
    the wrong type, is refused naming the shard and the field; nothing changes."""
    _, newest = _snapshots(tmp_path / "snaps", INT_KEYS)
    shard = os.path.join(newest, snapshots.shard_file(0, 1))
    _forge(shard, edit)
    _refused(tmp_path, INT_KEYS, newest, shard, *words)


def test_a_value_of_an_unsupported_dtype_is_refused(tmp_path):
    """A shard whose value array (checksum whole) has a dtype no store holds is refused
    naming the shard, the key and the dtype; nothing changes."""
    _, newest = _snapshots(tmp_path / "snaps", INT_KEYS)
    shard = os.path.join(newest, snapshots.shard_file(0, 1))
    header, arrays = read_archive(shard)
    j = [e["key"] for e in header["keys"]].index(3)
    arrays[f"value/{j}"] = arrays[f"value/{j}"].astype(np.complex64)
    write_archive(shard, header, arrays)
    _refused(tmp_path, INT_KEYS, newest, shard, "key 3", "complex64")


KEY_KINDS = {
    "a str key among int keys": (INT_KEYS, 2, "2", ["key '2'", "a str", "int keys"]),
    "an int key among str keys": (STR_KEYS, "b", 7, ["key 7", "an int", "str keys"]),
    "a bool key among int keys": (INT_KEYS, 2, True, ["key True", "a bool", "int keys"]),
}


@pytest.mark.parametrize("optimizer", [False, True], ids=["values", "with-adam"])
@pytest.mark.parametrize("keys,key,forged,words", list(KEY_KINDS.values()),
                         ids=list(KEY_KINDS))
def test_a_key_of_the_other_kind_is_refused(tmp_path, keys, key, forged, words, optimizer):
    """A shard carrying a key of another kind than the snapshot's is refused naming the
    shard, the key and the kinds (with or without optimizer state that names the key as
    it was); the store keeps one key kind and every key it had."""
    _, newest = _snapshots(tmp_path / "snaps", keys, optimizer=optimizer)
    shard = os.path.join(newest, snapshots.shard_file(0, 1))
    _forge(shard, lambda h: _key_entry(h, key).__setitem__("key", forged))
    _refused(tmp_path, keys, newest, shard, *words)


def test_a_shard_copied_from_an_earlier_step_is_refused(tmp_path):
    """A shard copied into a snapshot from an earlier step of the same run is refused
    naming the shard, its step and the snapshot's; nothing changes."""
    older, newest = _snapshots(tmp_path / "snaps", INT_KEYS)
    shard = os.path.join(newest, snapshots.shard_file(0, 1))
    shutil.copyfile(os.path.join(older, snapshots.shard_file(0, 1)), shard)
    _refused(tmp_path, INT_KEYS, newest, shard, "step 1", "step 2")


def test_a_worker_file_copied_from_an_earlier_step_is_refused(tmp_path):
    """A worker file copied in from an earlier step (its user_state is another step's)
    is refused by load, resume and user_state(), naming the file and both steps."""
    older, newest = _snapshots(tmp_path / "snaps", INT_KEYS)
    worker = os.path.join(newest, snapshots.worker_file(0, 1))
    shutil.copyfile(os.path.join(older, snapshots.worker_file(0, 1)), worker)
    _refused(tmp_path, INT_KEYS, newest, worker, "step 1", "step 2")
    with pytest.raises(gpukv.CheckpointError, match="step 1.*step 2"):
        gpukv.latest_snapshot(tmp_path / "snaps").user_state()


def test_a_forged_step_is_refused_even_when_every_file_agrees(tmp_path):
    """A snapshot whose files all record another step than its folder's name says is
    refused (the folder's name is the step resume goes on from)."""
    _, newest = _snapshots(tmp_path / "snaps", INT_KEYS)
    shard = os.path.join(newest, snapshots.shard_file(0, 1))
    for path in (shard, os.path.join(newest, snapshots.worker_file(0, 1))):
        _forge(path, lambda h: h.__setitem__("step", 5))
    _refused(tmp_path, INT_KEYS, newest, shard, "step 5", "step 2")

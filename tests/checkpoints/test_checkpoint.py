"""KVStore.save / KVStore.load and the checkpoint archive format (gpukv.checkpoints.checkpoint)."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv.checkpoints.checkpoint import read_archive, write_archive

from ..bfloat16 import BF16, marked, needs_bfloat16
from ..bfloat16 import dtype_named as _dtype
from .failing_file import FailingFile

REPO = Path(__file__).resolve().parents[2]

DTYPES = ["float16", "bfloat16", "float32", "float64", "uint8", "int8", "int32", "int64"]
#: DTYPES as cases: bfloat16's skips without ml_dtypes
DTYPE_PARAMS = marked(DTYPES)


def _value(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dtype = _dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.asarray(rng.integers(info.min, info.max, size=shape, dtype=dtype,
                                       endpoint=True))
    return np.asarray((rng.standard_normal(shape) * 100).astype(dtype))


def _pull(kv, key, like):
    out = np.empty_like(like)
    kv.pull(key, out=out)
    return out


def _same(a, b):
    """Bit-for-bit equality (NaNs and -0.0 included) with equal dtype and shape."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.tobytes() == np.ascontiguousarray(b).tobytes())


def _snapshot(kv, keys, likes):
    return [_pull(kv, k, v) for k, v in zip(keys, likes)]


def _reloaded(kv, path):
    """A fresh 'local' store loaded from `kv` saved at `path`."""
    kv.save(path)
    fresh = gpukv.create("local")
    fresh.load(path)
    return fresh


# ------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("keys", [
    [3, 5, 7],
    ["weight", "bias", "layer.0/γ"],
    [2**64 + 1, -(2**80), 2**200],
    [0],
], ids=["int", "str", "huge-int", "one"])
def test_round_trip_keys(tmp_path, keys):
    """Every key comes back with its exact value, whatever its kind or size."""
    values = [_value((4, 3), "float32", seed=i) for i in range(len(keys))]
    kv = gpukv.create("local")
    kv.init(keys, values)
    fresh = _reloaded(kv, tmp_path / "ck.npz")
    for key, value in zip(keys, values):
        assert _same(_pull(fresh, key, value), value)
    other = "x" if isinstance(keys[0], int) else 1
    with pytest.raises(gpukv.KeyKindError):  # the key kind travels with the file
        fresh.init(other, np.zeros(1, np.float32))


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("shape", [(), (0, 3), (7,), (2, 3, 5)], ids=str)
def test_round_trip_dtypes(tmp_path, dtype, shape):
    """Every supported dtype and shape (scalars and empty arrays too) round-trips exactly."""
    value = _value(shape, dtype)
    kv = gpukv.create("local")
    kv.init(9, value)
    fresh = _reloaded(kv, tmp_path / "ck.npz")
    assert _same(_pull(fresh, 9, value), value)


@needs_bfloat16
def test_round_trip_special_floats(tmp_path):
    """NaN, inf, -0.0 and subnormals survive bit for bit in fp16, bf16 and fp32."""
    for i, name in enumerate(["float16", "bfloat16", "float32"]):
        dt = _dtype(name)
        value = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-40, 65504.0], np.float32).astype(dt)
        kv = gpukv.create("local")
        kv.init(i, value)
        fresh = _reloaded(kv, tmp_path / f"{name}.npz")
        assert _same(_pull(fresh, i, value), value)


@needs_bfloat16  # a key of every dtype
def test_mixed_dtypes_one_file(tmp_path):
    """One store with keys of several dtypes round-trips in one file."""
    keys = list(range(len(DTYPES)))
    values = [_value((3, 2), d, seed=i) for i, d in enumerate(DTYPES)]
    kv = gpukv.create("local")
    kv.init(keys, values)
    fresh = _reloaded(kv, tmp_path / "ck.npz")
    for key, value in zip(keys, values):
        assert _same(_pull(fresh, key, value), value)


def test_saved_after_pushes_and_usable_after_load(tmp_path):
    """The saved value is the one after every push, and a loaded store keeps working."""
    shape = (2, 3)
    kv = gpukv.create("local")
    kv.init(3, np.ones(shape) * 2)
    kv.push(3, [np.ones(shape)] * 4)
    kv.save(tmp_path / "ck.npz")
    fresh = gpukv.create("device")  # host arrays only: keys live on the host
    fresh.load(tmp_path / "ck.npz")
    assert np.array_equal(_pull(fresh, 3, np.zeros(shape)), np.full(shape, 4.0))
    fresh.set_updater(lambda key, merged, stored: stored.__iadd__(merged))
    fresh.push(3, np.ones(shape))
    assert np.array_equal(_pull(fresh, 3, np.zeros(shape)), np.full(shape, 5.0))


@pytest.mark.parametrize("store", ["local", "device"])
@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=needs_bfloat16)])
def test_a_loaded_16_bit_value_is_what_the_next_step_starts_from(tmp_path, store, dtype):
    """A 16-bit key already stepped by an optimizer (which keeps a float32 master copy)
    then loaded from a file without optimizer state: the next step starts from the
    loaded value, not from the master copy of before."""
    source = gpukv.create("local")
    source.init(0, np.full(4, 100, _dtype(dtype)))
    source.save(tmp_path / "values.npz")
    kv = gpukv.create(store)
    kv.init(0, np.ones(4, _dtype(dtype)))
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.5))
    kv.push(0, np.ones(4, _dtype(dtype)))  # 1 -> 0.5, and a master copy of 0.5
    kv.load(tmp_path / "values.npz")
    kv.push(0, np.ones(4, _dtype(dtype)))
    assert _pull(kv, 0, np.zeros(4, _dtype(dtype))).astype(np.float32).tolist() == [99.5] * 4


@pytest.mark.parametrize("kind", [int, str])
def test_empty_store(tmp_path, kind):
    """An empty store saves and loads to an empty store that still takes either key kind,
    and loading it into a full store changes none of its keys."""
    kv = gpukv.create("local")
    kv.save(tmp_path / "ck.npz")
    fresh = gpukv.create("local")
    fresh.load(tmp_path / "ck.npz")
    key = kind(5) if kind is int else "a"
    fresh.init(key, np.arange(2.0))
    assert np.array_equal(_pull(fresh, key, np.zeros(2)), [0.0, 1.0])
    fresh.load(tmp_path / "ck.npz")
    assert np.array_equal(_pull(fresh, key, np.zeros(2)), [0.0, 1.0])
    other = 7 if kind is str else "b"
    with pytest.raises(gpukv.KeyKindError):
        fresh.init(other, np.zeros(2))


@needs_bfloat16
def test_file_is_plain_npz_without_pickle(tmp_path):
    """The file opens with numpy.load(allow_pickle=False) and carries a versioned JSON header."""
    kv = gpukv.create("local")
    kv.init([2**70, 1], [np.arange(3, dtype=np.float32),
                         np.ones(2, BF16)])
    kv.save(tmp_path / "ck.npz")
    with np.load(tmp_path / "ck.npz", allow_pickle=False) as npz:
        meta = json.loads(npz["__gpukv__"].tobytes())
        assert meta["format"] == "gpukv-archive" and meta["version"] == 1
        header = meta["header"]
        assert header["kind"] == "gpukv.api.store" and header["version"] == 1
        assert header["key_kind"] == "int"
        assert header["keys"] == [str(2**70), "1"]
        bf16 = meta["arrays"]["value/1"]
        assert bf16["dtype"] == "bfloat16" and bf16["stored_as"] == "uint16"
        assert npz["value/1"].dtype == np.uint16


@needs_bfloat16
def test_archive_round_trip(tmp_path):
    """write_archive / read_archive keep the header and every array (bf16 included)."""
    arrays = {"a": np.arange(5, dtype=np.int64), "m/0": np.ones((2, 2), BF16),
              "big.endian": np.arange(3, dtype=">f4")}
    header = {"kind": "test", "lr": 0.1, "nested": {"steps": [1, 2]}}
    write_archive(tmp_path / "a.npz", header, arrays)
    got_header, got = read_archive(tmp_path / "a.npz")
    assert got_header == header
    assert list(got) == list(arrays)
    for name, value in arrays.items():
        assert got[name].dtype == value.dtype.newbyteorder("=")
        assert np.array_equal(got[name].astype(np.float64), value.astype(np.float64))


@pytest.mark.parametrize("name", ["", "../x", "__gpukv__", "a b"])
def test_archive_rejects_bad_names(tmp_path, name):
    """Array names that could escape or clash are refused before anything is written."""
    with pytest.raises(gpukv.CheckpointError):
        write_archive(tmp_path / "a.npz", {}, {name: np.zeros(1)})
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- load semantics
def _three_keys():
    kv = gpukv.create("local")
    keys = [1, 2, 3]
    values = [np.full((2, 2), float(k), np.float32) for k in keys]
    kv.init(keys, values)
    return kv, keys, values


def test_load_overwrites_matching_keys_and_keeps_others(tmp_path):
    """Loading overwrites keys in the file, creates new ones, and leaves the rest alone."""
    src = gpukv.create("local")
    src.init([2, 4], [np.full((2, 2), 20.0, np.float32), np.full(3, 40.0)])
    src.save(tmp_path / "ck.npz")
    kv, _, values = _three_keys()
    kv.load(tmp_path / "ck.npz")
    assert np.array_equal(_pull(kv, 1, values[0]), values[0])
    assert np.array_equal(_pull(kv, 2, values[1]), np.full((2, 2), 20.0, np.float32))
    assert np.array_equal(_pull(kv, 3, values[2]), values[2])
    assert np.array_equal(_pull(kv, 4, np.zeros(3)), np.full(3, 40.0))


@pytest.mark.parametrize("conflict", ["shape", "dtype"])
def test_load_conflict_names_key_and_changes_nothing(tmp_path, conflict):
    """A key whose shape or dtype differ aborts the whole load before any key changes."""
    src = gpukv.create("local")
    bad = np.zeros((3, 2), np.float32) if conflict == "shape" else np.zeros((2, 2), np.float64)
    src.init([1, 3, 99], [np.full((2, 2), 7.0, np.float32), bad, np.zeros(1)])
    src.save(tmp_path / "ck.npz")
    kv, keys, values = _three_keys()
    with pytest.raises(gpukv.CheckpointError, match="key 3"):
        kv.load(tmp_path / "ck.npz")
    assert all(_same(a, b) for a, b in zip(_snapshot(kv, keys, values), values))
    with pytest.raises(gpukv.UnknownKeyError):  # key 99 was not created either
        kv.pull(99, out=np.zeros(1))


def test_load_other_key_kind_changes_nothing(tmp_path):
    """A file of str keys cannot be loaded into a store of int keys."""
    src = gpukv.create("local")
    src.init("w", np.zeros(2))
    src.save(tmp_path / "ck.npz")
    kv, keys, values = _three_keys()
    with pytest.raises(gpukv.CheckpointError, match="str keys"):
        kv.load(tmp_path / "ck.npz")
    assert all(_same(a, b) for a, b in zip(_snapshot(kv, keys, values), values))


def test_checkpoint_error_is_a_value_error():
    """CheckpointError is caught as both a gpukv error and a ValueError."""
    assert issubclass(gpukv.CheckpointError, gpukv.GpukvError)
    assert issubclass(gpukv.CheckpointError, ValueError)


# ------------------------------------------------------------------------ damaged files
@pytest.fixture
def saved(tmp_path):
    kv = gpukv.create("local")
    kv.init([1, 2], [np.arange(1000, dtype=np.float32), np.ones(10, BF16)])
    path = tmp_path / "ck.npz"
    kv.save(path)
    return path


def _assert_load_fails_cleanly(path, match=None):
    kv, keys, values = _three_keys()
    with pytest.raises(gpukv.CheckpointError, match=match):
        kv.load(path)
    assert all(_same(a, b) for a, b in zip(_snapshot(kv, keys, values), values))
    with pytest.raises(gpukv.UnknownKeyError):
        kv.pull(4, out=np.zeros(1))


def test_missing_file(tmp_path):
    """A path that does not exist raises CheckpointError naming it."""
    _assert_load_fails_cleanly(tmp_path / "nope.npz", match="nope.npz")


@needs_bfloat16  # `saved` holds a bfloat16 key
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_truncated_file(saved, fraction):
    """A file cut short anywhere raises CheckpointError and changes nothing."""
    data = saved.read_bytes()
    saved.write_bytes(data[:int(len(data) * fraction)])
    _assert_load_fails_cleanly(saved)


@needs_bfloat16  # `saved` holds a bfloat16 key
@pytest.mark.parametrize("where", ["header", "value"])
def test_corrupt_bytes(saved, where):
    """A flipped byte inside the header or a value is detected (checksums), not loaded."""
    data = bytearray(saved.read_bytes())
    if where == "header":
        at = data.index(b'"format"') + 3
    else:
        at = data.index(np.arange(1000, dtype=np.float32)[500:502].tobytes())
    data[at] ^= 0x40
    saved.write_bytes(bytes(data))
    _assert_load_fails_cleanly(saved)


def test_foreign_npz(tmp_path):
    """An ordinary .npz, a .npy, a text file and a zip of text are not checkpoints."""
    np.savez(tmp_path / "plain.npz", a=np.zeros(3))
    _assert_load_fails_cleanly(tmp_path / "plain.npz", match="not a gpukv checkpoint")
    np.save(tmp_path / "one.npy", np.zeros(3))
    _assert_load_fails_cleanly(tmp_path / "one.npy", match="not a gpukv checkpoint")
    (tmp_path / "text.npz").write_text("hello\n")
    _assert_load_fails_cleanly(tmp_path / "text.npz")
    with zipfile.ZipFile(tmp_path / "zip.npz", "w") as zf:
        zf.writestr("__gpukv__.npy", "not an array")
    _assert_load_fails_cleanly(tmp_path / "zip.npz")


def test_pickled_objects_refused(tmp_path):
    """An archive member holding pickled objects is never unpickled."""
    with zipfile.ZipFile(tmp_path / "evil.npz", "w") as zf:
        header = json.dumps({"format": "gpukv-archive", "version": 1,
                             "header": {"kind": "gpukv.api.store", "version": 1, "key_kind": "int",
                                        "keys": ["1"], "homes": ["cpu"], "optimizer": None},
                             "arrays": {"value/0": {"dtype": "float32", "stored_as": None,
                                                    "shape": [2], "crc32": 0}}})
        with zf.open("__gpukv__.npy", "w") as m:
            np.lib.format.write_array(m, np.frombuffer(header.encode(), np.uint8))
        with zf.open("value/0.npy", "w") as m:
            np.lib.format.write_array(m, np.array([object(), 1], dtype=object),
                                      allow_pickle=True)
    _assert_load_fails_cleanly(tmp_path / "evil.npz")


def test_newer_versions_refused(tmp_path):
    """Archives or store headers of a newer version, or of another kind, are refused."""
    write_archive(tmp_path / "kind.npz", {"kind": "gpukv.optimizer", "version": 1}, {})
    _assert_load_fails_cleanly(tmp_path / "kind.npz", match="not a store checkpoint")
    write_archive(tmp_path / "store.npz", {"kind": "gpukv.api.store", "version": 99,
                                           "key_kind": None, "keys": [], "homes": []}, {})
    _assert_load_fails_cleanly(tmp_path / "store.npz", match="version 99")
    text = json.dumps({"format": "gpukv-archive", "version": 2, "header": {}, "arrays": {}})
    np.savez(tmp_path / "archive.npz", __gpukv__=np.frombuffer(text.encode(), np.uint8))
    _assert_load_fails_cleanly(tmp_path / "archive.npz", match="version 2")


def test_damaged_store_header(tmp_path):
    """A store header whose keys and values do not agree is refused whole."""
    write_archive(tmp_path / "a.npz", {"kind": "gpukv.api.store", "version": 1, "key_kind": "int",
                                       "keys": ["1", "2"], "homes": ["cpu", "cpu"]},
                  {"value/0": np.zeros((2, 2), np.float32)})
    _assert_load_fails_cleanly(tmp_path / "a.npz", match="key 2")
    write_archive(tmp_path / "b.npz", {"kind": "gpukv.api.store", "version": 1, "key_kind": "int",
                                       "keys": ["x"], "homes": ["cpu"]},
                  {"value/0": np.zeros((2, 2), np.float32)})
    _assert_load_fails_cleanly(tmp_path / "b.npz")


# ---------------------------------------------------------------------------- atomicity
def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    """A save whose file write fails halfway raises CheckpointError chained from the OS
    error, and leaves the previous file whole and no temporary file."""
    kv = gpukv.create("local")
    kv.init([1, 2], [np.ones(1000), np.ones(1000)])
    path = tmp_path / "ck.npz"
    kv.save(path)
    before = path.read_bytes()
    kv.push([1, 2], [np.zeros(1000), np.zeros(1000)])
    real = os.fdopen

    # The temporary file: its writes fail once half the previous size is written.
    monkeypatch.setattr(os, "fdopen",
                        lambda *a, **k: FailingFile(real(*a, **k), len(before) // 2, errno.EIO))
    with pytest.raises(gpukv.CheckpointError, match="ck.npz") as caught:
        kv.save(path)
    assert isinstance(caught.value.__cause__, OSError)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.npz"]


_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    import gpukv
    path, n = sys.argv[1], int(sys.argv[2])
    kv = gpukv.create("local")
    kv.init(["a", "b"], [np.zeros(n, np.float32), np.zeros(n // 2, np.float64)])
    gen = 0
    while True:
        gen += 1
        kv.push(["a", "b"], [np.full(n, gen, np.float32), np.full(n // 2, gen, np.float64)])
        print("saving", gen, flush=True)
        kv.save(path)
        print("saved", gen, flush=True)
""")


def _writer(tmp_path, n):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "ck.npz"), str(n)],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def _expect(proc, line, deadline):
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if not got:
            break
        if got.split() == line.split():
            return
    proc.kill()
    pytest.fail(f"writer never printed {line!r}")


def _generation(path, n):
    """The single generation every value of the file holds (the file must load whole)."""
    kv = gpukv.create("local")
    kv.load(path)
    a, b = np.empty(n, np.float32), np.empty(n // 2, np.float64)
    kv.pull(["a", "b"], out=[a, b])
    gens = {float(a.min()), float(a.max()), float(b.min()), float(b.max())}
    assert len(gens) == 1, f"a torn checkpoint: generations {sorted(gens)}"
    return int(gens.pop())


def test_sigkill_mid_save_keeps_previous_file(tmp_path):
    """A writer killed while its temporary file is half written leaves the previous save whole."""
    n = 4_000_000  # 32 MB of float32 + 16 MB of float64 per save
    proc = _writer(tmp_path, n)
    try:
        deadline = time.monotonic() + 20
        _expect(proc, "saved 1", deadline)
        _expect(proc, "saving 2", deadline)
        partial = None
        while partial is None and time.monotonic() < deadline:
            for p in tmp_path.iterdir():
                if p.name.endswith(".tmp") and p.stat().st_size > 1_000_000:
                    partial = p
        assert partial is not None, "never saw the second save's temporary file"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait()
    assert partial.exists()  # the kill did land mid-save
    assert _generation(tmp_path / "ck.npz", n) == 1


@pytest.mark.parametrize("delay", [0.05, 0.23, 0.61])
def test_sigkill_at_random_points(tmp_path, delay):
    """However the writer's loop is cut, the file on disk is one whole earlier save."""
    n = 1_000_000
    proc = _writer(tmp_path, n)
    saved, saving = [], 0
    try:
        deadline = time.monotonic() + 20
        _expect(proc, "saved 1", deadline)
        saved.append(1)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for line in proc.stdout.read().split("\n"):
            word, _, gen = line.partition(" ")
            if word == "saved":
                saved.append(int(gen))
            elif word == "saving":
                saving = int(gen)
    finally:
        proc.kill()
        proc.wait()
    gen = _generation(tmp_path / "ck.npz", n)
    assert gen == saved[-1] or gen == saving  # killed after the rename, before "saved"


# ------------------------------------------------------------ the store's two doors
def test_checkpoint_module_uses_no_store_privates():
    """gpukv.checkpoints.checkpoint imports nothing of the stores and reads no private
    member of another object: a store reaches it only through `_snapshot` and
    `_apply_load`."""
    import ast

    source = (REPO / "gpukv" / "checkpoints" / "checkpoint.py").read_text()
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
            imported.update("." * node.level + a.name for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {name for name in imported if name.endswith("store") or "store." in name
                or name.endswith(".local")}, imported
    private = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and node.attr.startswith("_") and not node.attr.endswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id == "self")}
    assert not private, private


def test_snapshot_lists_keys_in_init_order(tmp_path):
    """KVStore._snapshot gives every key in init order with its value and home kind, the
    key kind and the optimizer's updater; the values are the ones `save` writes."""
    from gpukv.checkpoints.checkpoint import StoreSnapshot

    kv = gpukv.create("local")
    kv.init(["b", "a", "c"], [np.full(2, float(i), np.float32) for i in range(3)])
    snap = kv._snapshot(to_host=True)
    assert isinstance(snap, StoreSnapshot)
    assert [(k, v.tolist(), home) for k, v, home in snap.entries] == [
        ("b", [0.0, 0.0], "cpu"), ("a", [1.0, 1.0], "cpu"), ("c", [2.0, 2.0], "cpu")]
    assert (snap.key_kind, snap.updater, snap.store_type) == (str, None, "local")
    kv.set_optimizer(gpukv.optim.SGD())
    assert kv._snapshot().updater is kv._updater
    kv.save(tmp_path / "ck.npz")
    assert read_archive(tmp_path / "ck.npz")[0]["keys"] == ["b", "a", "c"]


@needs_bfloat16
def test_archive_members_are_read_from_a_map_of_the_file(tmp_path, monkeypatch):
    """Members as write_archive writes them are read straight from the file: zipfile opens
    only the JSON header, however many arrays there are (opening each member through
    numpy.load scanned its list of names per member, so loads grew with the square of the
    number of keys)."""
    arrays = {f"a/{i}": np.full((i % 3, 2), i, np.float32) for i in range(200)}
    arrays.update({"bf16": np.arange(5, dtype=np.float32).astype(BF16),
                   "scalar": np.array(2.5), "empty": np.zeros((0, 4), np.int8),
                   "bool": np.array([True, False]), "complex": np.array([1 + 2j], np.complex64),
                   "swapped": np.arange(3, dtype=">i4"), "fortran": np.asfortranarray(
                       np.arange(6, dtype=np.int16).reshape(2, 3))})
    write_archive(tmp_path / "a.npz", {"n": 1}, arrays)
    opened = []
    real = zipfile.ZipFile.open

    def counted(self, name, *args, **kwargs):
        opened.append(getattr(name, "filename", name))
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", counted)
    header, got = read_archive(tmp_path / "a.npz")
    assert header == {"n": 1}
    assert opened == ["__gpukv__.npy"]
    for name, value in arrays.items():
        assert got[name].dtype == value.dtype.newbyteorder("=")
        assert got[name].shape == value.shape and got[name].flags.c_contiguous
        assert got[name].tolist() == value.tolist()


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_values_round_trip(tmp_path):
    """GPU values are saved through the host and come back on GPUs (or the host for 'local')."""
    import cupy

    values = [_value((64, 3), d, seed=i) for i, d in enumerate(["float32", "float16", "int64"])]
    kv = gpukv.create("device")
    kv.init([1, 2, 3], [cupy.asarray(v) for v in values])
    kv.save(tmp_path / "ck.npz")
    fresh = gpukv.create("device")
    fresh.load(tmp_path / "ck.npz")
    for key, value in zip([1, 2, 3], values):
        assert fresh._entries[key].home.kind == "gpu"
        out = cupy.zeros(value.shape, value.dtype)
        fresh.pull(key, out=out)
        assert _same(out.get(), value)
    host = gpukv.create("local")
    host.load(tmp_path / "ck.npz")
    for key, value in zip([1, 2, 3], values):
        assert host._entries[key].home.kind == "cpu"
        assert _same(_pull(host, key, value), value)


# ------------------------------------------------------------------- real optimizer state
def _trained(optimizer, steps=3):
    kv = gpukv.create("local")
    keys = [1, 2**65, 3]
    kv.init(keys, [np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
                   np.full(5, 0.5, np.float16), np.zeros(2, np.float64)])
    kv.set_optimizer(optimizer)
    for step in range(steps):
        kv.push(keys, _grads(step))
    return kv, keys


def _grads(step):
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal((3, 4)).astype(np.float32),
            rng.standard_normal(5).astype(np.float16), rng.standard_normal(2)]


def _values(kv, keys):
    likes = [np.zeros((3, 4), np.float32), np.zeros(5, np.float16), np.zeros(2)]
    return _snapshot(kv, keys, likes)


def test_optimizer_state_round_trip(tmp_path):
    """Momentum and fp16 master copies are saved with the values: training resumes exactly."""
    optim = pytest.importorskip("gpukv.optim")
    kv, keys = _trained(optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3))
    kv.save(tmp_path / "ck.npz")
    resumed = gpukv.create("local")
    resumed.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3))
    resumed.load(tmp_path / "ck.npz")
    for step in range(3, 6):
        kv.push(keys, _grads(step))
        resumed.push(keys, _grads(step))
    assert all(_same(a, b) for a, b in zip(_values(kv, keys), _values(resumed, keys)))


def test_optimizer_state_ignored_without_optimizer_is_warned_of(tmp_path, caplog):
    """A store with no optimizer loads the values of a file that also holds optimizer
    state, and warns, naming the file, that the state was left (set_optimizer first)."""
    optim = pytest.importorskip("gpukv.optim")
    kv, keys = _trained(optim.Adam(learning_rate=0.01))
    kv.save(tmp_path / "ck.npz")
    plain = gpukv.create("local")
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        plain.load(tmp_path / "ck.npz")
    assert all(_same(a, b) for a, b in zip(_values(kv, keys), _values(plain, keys)))
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "ck.npz" in record.getMessage() and "set_optimizer before load" in \
        record.getMessage(), record.getMessage()
    caplog.clear()
    plain.set_optimizer(optim.Adam(learning_rate=0.01))
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        plain.load(tmp_path / "ck.npz")  # (the state restored: nothing to warn of)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_optimizer_state_mismatch_changes_nothing(tmp_path):
    """Adam state loaded into a store running SGD is a CheckpointError; no key is touched."""
    optim = pytest.importorskip("gpukv.optim")
    kv, keys = _trained(optim.Adam(learning_rate=0.01))
    kv.save(tmp_path / "ck.npz")
    other, _ = _trained(optim.SGD(learning_rate=0.1, momentum=0.9), steps=1)
    before = _values(other, keys)
    fresh = gpukv.create("local")
    fresh.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
    for store in (other, fresh):
        with pytest.raises(gpukv.CheckpointError, match="adam"):
            store.load(tmp_path / "ck.npz")
    assert all(_same(a, b) for a, b in zip(_values(other, keys), before))
    with pytest.raises(gpukv.UnknownKeyError):
        fresh.pull(1, out=np.zeros((3, 4), np.float32))

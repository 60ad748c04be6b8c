"""Each misuse raises its gpukv error, which is also the built-in a user catches, names the
key, and leaves the store exactly as it was."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gpukv

from .foreign import OnDLPackDevice, RefusingDLPack

MX = json.loads((pathlib.Path(__file__).parent / "data" / "mxnet_reference.json").read_text())[
    "behaviours"]
SHAPE = (2, 3)
F32 = np.float32


def ones(value=1.0, shape=SHAPE, dtype=F32):
    return np.full(shape, value, dtype=dtype)


def readonly(value=0.0, shape=SHAPE, dtype=F32):
    a = ones(value, shape, dtype)
    a.flags.writeable = False
    return a


class World:
    """A store holding keys 1 and 2 (or 'a' and 'b'), sentinel outs, and the calls made."""

    def __init__(self, name, kind, with_updater):
        self.kv = gpukv.create(name)
        self.k1, self.k2 = (1, 2) if kind == "int" else ("a", "b")
        self.other = "x" if kind == "int" else 7      # a key of the other kind
        self.missing = 99 if kind == "int" else "zz"  # never initialised
        self.kv.init([self.k1, self.k2], [ones(1), ones(2)])
        self.calls = []
        if with_updater:
            self.kv.set_updater(lambda k, m, s: (self.calls.append(k), s.__iadd__(m)))
        self.outs = [ones(-7), ones(-7)]

    def snapshot(self):
        values = []
        for k in (self.k1, self.k2):
            out = np.zeros(SHAPE, F32)
            self.kv.pull(k, out=out)
            values.append(out.tolist())
        return values

    def assert_unchanged(self, before, fresh_keys=()):
        assert self.snapshot() == before
        assert self.calls == []
        assert all((o == -7).all() for o in self.outs)
        for k in (self.missing, *fresh_keys):
            with pytest.raises(KeyError):
                self.kv.pull(k, out=np.zeros(SHAPE, F32))


# (id, call(world), gpukv class, built-in, text the message contains, keys that must not exist)
CASES = [
    ("push-unknown", lambda w: w.kv.push(w.missing, ones()),
     gpukv.UnknownKeyError, KeyError, "missing", ()),
    ("pull-unknown", lambda w: w.kv.pull(w.missing, out=w.outs[0]),
     gpukv.UnknownKeyError, KeyError, "missing", ()),
    ("pushpull-unknown", lambda w: w.kv.pushpull(w.missing, ones(), out=w.outs[0]),
     gpukv.UnknownKeyError, KeyError, "missing", ()),
    ("push-list-one-unknown", lambda w: w.kv.push([w.k1, w.missing], [ones(5), ones(5)]),
     gpukv.UnknownKeyError, KeyError, "missing", ()),
    ("pull-list-one-unknown", lambda w: w.kv.pull([w.k1, w.missing], out=w.outs),
     gpukv.UnknownKeyError, KeyError, "missing", ()),
    ("pushpull-out-shape", lambda w: w.kv.pushpull(w.k1, ones(5), out=[w.outs[0], ones(0, (3,))]),
     gpukv.ShapeError, ValueError, "k1", ()),
    ("init-duplicate", lambda w: w.kv.init(w.k1, ones(5)),
     gpukv.DuplicateKeyError, ValueError, "k1", ()),
    ("init-list-one-duplicate", lambda w: w.kv.init([w.fresh, w.k2], [ones(5), ones(5)]),
     gpukv.DuplicateKeyError, ValueError, "k2", ("fresh",)),
    ("broadcast-duplicate", lambda w: w.kv.broadcast(w.k1, ones(5), out=w.outs[0]),
     gpukv.DuplicateKeyError, ValueError, "k1", ()),
    ("init-other-kind", lambda w: w.kv.init(w.other, ones(5)),
     gpukv.KeyKindError, TypeError, "other", ()),
    ("push-other-kind", lambda w: w.kv.push(w.other, ones(5)),
     gpukv.KeyKindError, TypeError, "other", ()),
    ("pull-other-kind", lambda w: w.kv.pull(w.other, out=w.outs[0]),
     gpukv.KeyKindError, TypeError, "other", ()),
    ("init-mixed-in-one-call", lambda w: w.kv.init([w.fresh, w.other], [ones(5), ones(5)]),
     gpukv.KeyKindError, TypeError, "other", ("fresh",)),
    ("push-mixed-in-one-call", lambda w: w.kv.push([w.k1, w.other], [ones(5), ones(5)]),
     gpukv.KeyKindError, TypeError, "other", ()),
    ("key-float", lambda w: w.kv.push(1.0, ones(5)), gpukv.KeyKindError, TypeError, "1.0", ()),
    ("key-bool", lambda w: w.kv.push(True, ones(5)), gpukv.KeyKindError, TypeError, "True", ()),
    ("key-none", lambda w: w.kv.push(None, ones(5)), gpukv.KeyKindError, TypeError, "None", ()),
    ("key-bytes", lambda w: w.kv.init(b"k", ones(5)), gpukv.KeyKindError, TypeError, "b'k'", ()),
    ("push-shape", lambda w: w.kv.push(w.k1, ones(5, (3, 2))),
     gpukv.ShapeError, ValueError, "k1", ()),
    ("push-shape-same-size", lambda w: w.kv.push(w.k1, ones(5, (6,))),
     gpukv.ShapeError, ValueError, "k1", ()),
    ("push-shape-one-device", lambda w: w.kv.push(w.k1, [ones(5), ones(5, (3, 2))]),
     gpukv.ShapeError, ValueError, "k1", ()),
    ("push-list-one-bad-shape", lambda w: w.kv.push([w.k1, w.k2], [ones(5), ones(5, (3, 3))]),
     gpukv.ShapeError, ValueError, "k2", ()),
    ("pull-shape", lambda w: w.kv.pull(w.k1, out=[w.outs[0], np.zeros((3, 2), F32)]),
     gpukv.ShapeError, ValueError, "k1", ()),
    ("pull-list-one-bad-shape", lambda w: w.kv.pull([w.k1, w.k2], out=[w.outs[0], ones(0, (3,))]),
     gpukv.ShapeError, ValueError, "k2", ()),
    ("init-devices-disagree", lambda w: w.kv.init(w.fresh, [ones(5), ones(5, (3, 2))]),
     gpukv.ShapeError, ValueError, "fresh", ("fresh",)),
    ("broadcast-out-shape", lambda w: w.kv.broadcast(w.fresh, ones(5), out=ones(0, (3, 2))),
     gpukv.ShapeError, ValueError, "fresh", ("fresh",)),
    ("init-complex", lambda w: w.kv.init(w.fresh, np.ones(SHAPE, np.complex64)),
     gpukv.DTypeError, ValueError, "fresh", ("fresh",)),
    ("init-complex128", lambda w: w.kv.init(w.fresh, np.ones(SHAPE, np.complex128)),
     gpukv.DTypeError, ValueError, "fresh", ("fresh",)),
    ("init-bool", lambda w: w.kv.init(w.fresh, np.ones(SHAPE, bool)),
     gpukv.DTypeError, ValueError, "fresh", ("fresh",)),
    ("init-object", lambda w: w.kv.init(w.fresh, np.full(SHAPE, None, object)),
     gpukv.DTypeError, ValueError, "fresh", ("fresh",)),
    ("init-uint16", lambda w: w.kv.init(w.fresh, np.ones(SHAPE, np.uint16)),
     gpukv.DTypeError, ValueError, "fresh", ("fresh",)),
    ("init-unicode", lambda w: w.kv.init(w.fresh, np.full(SHAPE, "ab")),
     gpukv.DTypeError, ValueError, "fresh", ("fresh",)),
    ("init-list-one-bad-dtype",
     lambda w: w.kv.init([w.fresh, w.fresh2], [ones(1), np.ones(SHAPE, bool)]),
     gpukv.DTypeError, ValueError, "fresh2", ("fresh", "fresh2")),
    ("push-unsupported-dtype", lambda w: w.kv.push(w.k1, np.ones(SHAPE, np.uint16)),
     gpukv.DTypeError, ValueError, "k1", ()),
    ("push-complex", lambda w: w.kv.push(w.k1, np.ones(SHAPE, np.complex64)),
     gpukv.DTypeError, ValueError, "k1", ()),
    ("pull-complex-out", lambda w: w.kv.pull(w.k1, out=np.zeros(SHAPE, np.complex64)),
     gpukv.DTypeError, ValueError, "k1", ()),
    ("pull-bool-out", lambda w: w.kv.pull(w.k1, out=np.zeros(SHAPE, bool)),
     gpukv.DTypeError, ValueError, "k1", ()),
    ("init-list-of-floats", lambda w: w.kv.init(w.fresh, [1.0, 2.0]),
     gpukv.ArgumentKindError, TypeError, "fresh", ("fresh",)),
    ("push-nested-too-deep", lambda w: w.kv.push(w.k1, [[ones(5)]]),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("push-list-nested-too-deep", lambda w: w.kv.push([w.k1, w.k2], [ones(5), [[ones(5)]]]),
     gpukv.ArgumentKindError, TypeError, "k2", ()),
    ("pull-nested-too-deep", lambda w: w.kv.pull(w.k1, out=[[w.outs[0]]]),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("keys-list-value-array", lambda w: w.kv.push([w.k1, w.k2], ones(5)),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("push-not-an-array", lambda w: w.kv.push(w.k1, "abc"),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("push-number", lambda w: w.kv.push(w.k1, 5.0), gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("push-none", lambda w: w.kv.push(w.k1, None), gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("push-dict", lambda w: w.kv.push(w.k1, {"a": ones()}),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("push-object-array", lambda w: w.kv.push(w.k1, np.empty(SHAPE, object)),
     (gpukv.ArgumentKindError, gpukv.DTypeError), (TypeError, ValueError), "k1", ()),
    ("pull-out-not-an-array", lambda w: w.kv.pull(w.k1, out=[w.outs[0], 3]),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("push-len-mismatch", lambda w: w.kv.push([w.k1, w.k2], [ones(5)]),
     gpukv.ArgumentError, ValueError, "k1", ()),
    ("pull-len-mismatch", lambda w: w.kv.pull([w.k1, w.k2], out=[w.outs[0]]),
     gpukv.ArgumentError, ValueError, "k1", ()),
    ("init-len-mismatch", lambda w: w.kv.init([w.fresh, w.fresh2], [ones(5)]),
     gpukv.ArgumentError, ValueError, "fresh", ("fresh", "fresh2")),
    ("pushpull-out-len-mismatch", lambda w: w.kv.pushpull([w.k1, w.k2], [ones(5), ones(5)],
                                                          out=[w.outs[0]]),
     gpukv.ArgumentError, ValueError, "k1", ()),
    ("push-empty-device-list", lambda w: w.kv.push(w.k1, []),
     gpukv.ArgumentError, ValueError, "k1", ()),
    ("pull-without-out", lambda w: w.kv.pull(w.k1), gpukv.ArgumentError, ValueError, "k1", ()),
    ("pull-read-only-out", lambda w: w.kv.pull(w.k1, out=readonly()),
     gpukv.ReadOnlyError, ValueError, "k1", ()),
    ("pull-broadcast-view-out",
     lambda w: w.kv.pull(w.k1, out=np.broadcast_to(ones(0, (3,)), SHAPE)),
     gpukv.ReadOnlyError, ValueError, "k1", ()),
    ("pull-list-one-read-only", lambda w: w.kv.pull([w.k1, w.k2], out=[w.outs[0], readonly()]),
     gpukv.ReadOnlyError, ValueError, "k2", ()),
    ("pull-device-list-one-read-only", lambda w: w.kv.pull(w.k1, out=[w.outs[0], readonly()]),
     gpukv.ReadOnlyError, ValueError, "k1", ()),
    ("pushpull-read-only-value", lambda w: w.kv.pushpull(w.k1, readonly(5)),
     gpukv.ReadOnlyError, ValueError, "k1", ()),
    ("pushpull-read-only-out", lambda w: w.kv.pushpull(w.k1, ones(5), out=readonly()),
     gpukv.ReadOnlyError, ValueError, "k1", ()),
    ("broadcast-read-only-out", lambda w: w.kv.broadcast(w.fresh, ones(5), out=readonly()),
     gpukv.ReadOnlyError, ValueError, "fresh", ("fresh",)),
    ("broadcast-list-one-bad-out",
     lambda w: w.kv.broadcast([w.fresh, w.fresh2], [ones(5), ones(5)],
                              out=[w.outs[0], [ones(0, (4,))]]),
     gpukv.ShapeError, ValueError, "fresh2", ("fresh", "fresh2")),
    ("push-priority-str", lambda w: w.kv.push(w.k1, ones(5), priority="high"),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("pull-priority-float", lambda w: w.kv.pull(w.k1, out=w.outs[0], priority=1.5),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("pushpull-priority-none", lambda w: w.kv.pushpull(w.k1, ones(5), w.outs[0], None),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("broadcast-priority-str", lambda w: w.kv.broadcast(w.fresh, ones(5), w.outs[0], "0"),
     gpukv.ArgumentKindError, TypeError, "fresh", ("fresh",)),
    ("push-unsupported-dlpack-device", lambda w: w.kv.push(w.k1, [ones(5), OnDLPackDevice(10)]),
     gpukv.DeviceError, ValueError, "k1", ()),
    ("pull-unsupported-dlpack-device",
     lambda w: w.kv.pull(w.k1, out=[w.outs[0], OnDLPackDevice(7)]),
     gpukv.DeviceError, ValueError, "k1", ()),
    ("init-list-unsupported-dlpack-device",
     lambda w: w.kv.init([w.fresh, w.fresh2], [ones(5), OnDLPackDevice(14)]),
     gpukv.DeviceError, ValueError, "fresh2", ("fresh", "fresh2")),
    # an array whose library refuses to hand it over: its error, typed and naming the key
    ("push-refused-dlpack", lambda w: w.kv.push(w.k1, [ones(5), RefusingDLPack("sharded")]),
     gpukv.ArgumentKindError, TypeError, "k1", ()),
    ("pull-refused-dlpack-deleted",
     lambda w: w.kv.pull([w.k1, w.k2], out=[w.outs[0], RefusingDLPack("deleted")]),
     gpukv.ArgumentKindError, TypeError, "k2", ()),
    ("init-list-refused-dlpack",
     lambda w: w.kv.init([w.fresh, w.fresh2], [ones(5), RefusingDLPack("sharded")]),
     gpukv.ArgumentKindError, TypeError, "fresh2", ("fresh", "fresh2")),
]


@pytest.fixture(params=["local", "device"])
def name(request):
    return request.param


@pytest.mark.parametrize("kind", ["int", "str"])
@pytest.mark.parametrize("with_updater", [False, True], ids=["assign", "updater"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_misuse_raises_and_changes_nothing(name, kind, with_updater, case):
    """The bad call raises its gpukv class and built-in, names the key, and changes nothing."""
    _, call, cls, builtin, text, fresh = case
    w = World(name, kind, with_updater)
    w.fresh, w.fresh2 = (50, 51) if kind == "int" else ("new", "new2")
    before = w.snapshot()
    with pytest.raises(cls) as info:
        call(w)
    err = info.value
    assert isinstance(err, gpukv.GpukvError)
    assert isinstance(err, builtin)
    if text in ("k1", "k2", "missing", "other", "fresh", "fresh2"):
        text = repr(getattr(w, text))
    assert text in str(err)
    w.assert_unchanged(before, [getattr(w, f) for f in fresh])


def test_failed_call_leaves_store_usable():
    """After a failed list push the same keys push and pull normally."""
    w = World("local", "int", True)
    with pytest.raises(ValueError):
        w.kv.push([1, 2], [ones(1), ones(1, (4,))])
    w.kv.push([1, 2], [ones(1), ones(1)])
    assert w.snapshot() == [ones(2).tolist(), ones(3).tolist()]
    assert w.calls == [1, 2]


def test_unknown_key_message_is_not_quoted():
    """str() of an UnknownKeyError is the message itself, not KeyError's quoted repr."""
    kv = gpukv.create()
    kv.init(1, ones())
    with pytest.raises(KeyError) as info:
        kv.pull(99, out=ones())
    assert str(info.value).startswith("key 99")


@pytest.mark.parametrize("bad", [3, None, "update", ones()], ids=repr)
def test_non_callable_updater(bad):
    """A non-callable updater is a TypeError and the previous updater stays."""
    kv = gpukv.create()
    kv.init(1, ones(1))
    kv.set_updater(lambda k, m, s: s.__iadd__(m))
    with pytest.raises(gpukv.ArgumentKindError) as info:
        kv.set_updater(bad)
    assert isinstance(info.value, TypeError)
    kv.push(1, ones(2))
    out = ones(0)
    kv.pull(1, out=out)
    assert (out == 3).all()


@pytest.mark.parametrize("name", ["local", "device"])
@pytest.mark.parametrize("strategy", ["bogus", "Ringg", ""])
def test_bad_strategy_name(name, strategy):
    """An unknown strategy is a ValueError listing the valid ones, for any store."""
    with pytest.raises(gpukv.ArgumentError, match="valid strategies are") as info:
        gpukv.create(name, strategy=strategy)
    assert isinstance(info.value, ValueError)
    assert repr(strategy) in str(info.value)


@pytest.mark.parametrize("name", ["local", "device"])
@pytest.mark.parametrize("strategy", ["auto", "home", "tree", "ring", "cpu", "nccl", "AUTO"])
def test_known_strategy_names_are_accepted_with_host_arrays(name, strategy):
    """Every documented strategy name creates a store that works with host arrays."""
    kv = gpukv.create(name, strategy=strategy)
    kv.init(1, ones(1))
    kv.push(1, [ones(1), ones(2)])
    out = ones(0)
    kv.pull(1, out=out)
    assert (out == 3).all()


def test_unknown_store_option():
    """An unknown keyword option to create() is a TypeError naming it."""
    with pytest.raises(gpukv.ArgumentKindError, match="colour") as info:
        gpukv.create("local", colour="red")
    assert isinstance(info.value, TypeError)


def test_mxnet_raises_on_the_same_misuses():
    """The calls MXNet 1.9.1 refuses (as recorded) raise gpukv's typed errors, and a failed
    init leaves the value MXNet leaves."""
    kv = gpukv.create("local")
    kv.init(3, ones(2))
    misuses = {
        "broadcast_existing_key_error": (lambda: kv.broadcast(3, ones(7), out=ones(0)),
                                         gpukv.DuplicateKeyError),
        "duplicate_init_error": (lambda: kv.init(3, ones()), gpukv.DuplicateKeyError),
        "unknown_push_error": (lambda: kv.push(99, ones()), gpukv.UnknownKeyError),
        "unknown_pull_error": (lambda: kv.pull(99, out=ones(0)), gpukv.UnknownKeyError),
        "mixed_kinds_across_calls_error": (lambda: kv.init("a", ones()), gpukv.KeyKindError),
        "push_shape_error": (lambda: kv.push(3, ones(1, (3, 2))), gpukv.ShapeError),
        "mixed_kinds_one_call_error": (lambda: gpukv.create().init([1, "a"], [ones()] * 2),
                                       gpukv.KeyKindError),
    }
    for name, (call, cls) in misuses.items():
        assert MX[name] is not None, name
        with pytest.raises(cls):
            call()
    out = ones(0)
    kv.pull(3, out=out)
    assert MX["value_after_failed_init"] == 2.0 and (out == 2.0).all()


@pytest.mark.parametrize("cls,builtin", [
    (gpukv.UnknownKeyError, KeyError), (gpukv.DuplicateKeyError, ValueError),
    (gpukv.KeyKindError, TypeError), (gpukv.ArgumentError, ValueError),
    (gpukv.ArgumentKindError, TypeError), (gpukv.ShapeError, ValueError),
    (gpukv.DTypeError, ValueError), (gpukv.ReadOnlyError, ValueError),
    (gpukv.DeviceError, ValueError), (gpukv.BackendError, RuntimeError),
    (gpukv.OutOfMemoryError, MemoryError), (gpukv.CheckpointError, ValueError),
    (gpukv.PeerError, RuntimeError), (gpukv.PeerMismatchError, ValueError),
    (gpukv.PeerMismatchError, gpukv.PeerError), (gpukv.CheckpointPathKindError, TypeError),
    (gpukv.CheckpointPathKindError, gpukv.CheckpointError)])
def test_error_classes_subclass_base_and_builtin(cls, builtin):
    """Every gpukv error class is both a GpukvError and the built-in a user would catch."""
    assert issubclass(cls, gpukv.GpukvError) and issubclass(cls, builtin)


def test_every_error_class_is_importable_from_gpukv():
    """The errors page promises each of gpukv._errors' classes under `gpukv`."""
    import inspect

    from gpukv import _errors
    defined = {name for name, obj in inspect.getmembers(_errors, inspect.isclass)
               if obj.__module__ == _errors.__name__}
    assert defined and defined <= set(gpukv.__all__)
    assert all(getattr(gpukv, name) is getattr(_errors, name) for name in defined)


def test_failed_first_init_does_not_fix_the_key_kind():
    """A first init that fails leaves the store free to take either key kind."""
    kv = gpukv.create()
    with pytest.raises(gpukv.DTypeError):
        kv.init("a", np.ones(SHAPE, np.complex64))
    kv.init(1, ones(3))
    with pytest.raises(gpukv.KeyKindError, match="'a'"):
        kv.init("a", ones(3))


@pytest.mark.parametrize("name", ["dist_sync", "dist_async", "dist_device_sync", "DIST_SYNC"])
def test_dist_store_without_mpi_is_a_missing_backend(name):
    """Without mpi4py the several-process store names are a BackendError (RuntimeError)
    that says how to install MPI, not 'unknown'."""
    code = ("import sys\nsys.modules['mpi4py'] = None\nimport gpukv\n"
            f"try:\n    gpukv.create({name!r})\n"
            "except gpukv.BackendError as e:\n    print(isinstance(e, RuntimeError), e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True dist stores need mpi4py"), done.stdout
    assert "pip install 'gpukv[mpi]'" in done.stdout


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "two"])
@pytest.mark.parametrize("name", ["device", "nccl", "local_allreduce_device"])
def test_malformed_virtual_gpus_is_a_device_error_at_create(monkeypatch, name, value):
    """A malformed GPUKV_VIRTUAL_GPUS is a DeviceError naming it when a GPU store is made."""
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", value)
    with pytest.raises(gpukv.DeviceError, match="GPUKV_VIRTUAL_GPUS") as info:
        gpukv.create(name)
    assert isinstance(info.value, ValueError) and repr(value) in str(info.value)


@pytest.mark.parametrize("value", ["abc", "0"])
def test_virtual_gpus_does_not_concern_a_local_store(monkeypatch, value):
    """A 'local' store never uses GPUKV_VIRTUAL_GPUS, so it works whatever it says."""
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", value)
    kv = gpukv.create("local")
    kv.init(1, ones(2))
    assert kv.type == "local"


@pytest.mark.parametrize("failing", [1, 2, 3])
@pytest.mark.parametrize("name", ["local", "device"])
def test_updater_error_keeps_earlier_keys_and_releases_the_lock(name, failing):
    """A raising updater: earlier keys keep their update, later ones do not, other threads go on."""
    import threading

    kv = gpukv.create(name)
    kv.init([3, 1, 2], [ones(0), ones(0), ones(0)])

    def update(key, merged, stored):
        if key == failing:
            raise RuntimeError(f"updater failed on {key}")
        stored += merged

    kv.set_updater(update)
    with pytest.raises(RuntimeError, match=f"failed on {failing}"):
        kv.push([3, 1, 2], [ones(1), ones(1), ones(1)])

    def value(key):
        out = ones(-1)
        kv.pull(key, out=out)
        return float(out[0, 0])

    # int keys are updated in ascending order: those before the failing key are done
    assert [value(k) for k in (1, 2, 3)] == [1.0 if k < failing else 0.0 for k in (1, 2, 3)]
    kv.set_updater(lambda k, m, s: s.__iadd__(m))
    worker = threading.Thread(target=kv.push, args=([1, 2, 3], [ones(1), ones(1), ones(1)]))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the failed push kept the store's lock"
    assert [value(k) for k in (1, 2, 3)] == [2.0 if k < failing else 1.0 for k in (1, 2, 3)]

"""Checkpoints of 'device' stores whose keys live on several GPUs: values and optimizer
state (Adam, float32 master copies of 16-bit weights) round-trip exactly, into GPU and
host stores, through `save`/`load` and `save_optimizer_states`/`load_optimizer_states`."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv.checkpoints.checkpoint import read_archive

from ..bfloat16 import dtype_named as _dtype
from ..bfloat16 import needs_bfloat16

optim = pytest.importorskip("gpukv.optim")

pytestmark = pytest.mark.gpu

#: key -> (dtype, shape); the optimizer trains the float keys, the int keys only hold values
KEYS = {
    1: ("float16", (33,)),
    2: ("bfloat16", (5, 7)),
    3: ("float32", (300,)),
    2**70: ("float64", (4,)),
    5: ("int32", (6,)),
    6: ("int64", (3,)),
}
TRAINED = [k for k, (d, _) in KEYS.items() if d.startswith(("float", "bfloat"))]
#: Logical GPUs dealt onto the physical ones (GPUKV_VIRTUAL_GPUS, set by each test).
LOGICAL_GPUS = (pytest.param(4, id="4gpus"), pytest.param(8, id="8gpus"))


def _adam(**options):
    return optim.Adam(**{"learning_rate": 0.01, "wd": 1e-3, "multi_precision": True,
                         **options})


@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.fixture
def devices(request, monkeypatch):
    """The logical GPUs of the test (GPUKV_VIRTUAL_GPUS)."""
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", str(request.param))
    from gpukv.device.cuda.device import gpu_devices
    return gpu_devices()


def _init(cp, kv, devices, keys=None, values=None):
    """Every key of KEYS in `kv`, each from a GPU array on a different logical GPU."""
    keys = list(KEYS) if keys is None else keys
    rng = np.random.default_rng(0)
    if values is None:
        values = {k: (rng.standard_normal(KEYS[k][1]) * 4).astype(_dtype(KEYS[k][0]))
                  for k in keys}
    arrays = []
    for i, k in enumerate(keys):
        with cp.cuda.Device(devices[i % len(devices)].physical):
            arrays.append(cp.asarray(values[k]))
    kv.init(keys, arrays)


def _train(cp, kv, devices, steps, first=0):
    """`steps` pushes of every trained key, one gradient from every logical GPU."""
    for step in range(first, first + steps):
        rng = np.random.default_rng(100 + step)
        grads = []
        for k in TRAINED:
            per = []
            for d in devices:
                g = rng.standard_normal(KEYS[k][1]).astype(_dtype(KEYS[k][0]))
                with cp.cuda.Device(d.physical):
                    per.append(cp.asarray(g))
            grads.append(per)
        kv.push(TRAINED, grads)


def _values(cp, kv, on_gpu=True):
    """{key: NumPy copy of its value}, pulled into a GPU array (or a host one)."""
    out = {}
    for k, (d, shape) in KEYS.items():
        if on_gpu:
            a = cp.full(shape, 7, _dtype(d))
            kv.pull(k, out=a)
            out[k] = cp.asnumpy(a)
        else:
            a = np.full(shape, 7, _dtype(d))
            kv.pull(k, out=a)
            out[k] = a
    return out


def _same(a, b):
    """Bit-for-bit equality, dtype and shape included."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _states(kv, path, dump=False):
    """(header, arrays) of `kv`'s optimizer state, through save_optimizer_states."""
    kv.save_optimizer_states(path, dump_optimizer=dump)
    return read_archive(path)


def _assert_same_states(a, b):
    assert a[0] == b[0]
    assert sorted(a[1]) == sorted(b[1])
    for name in a[1]:
        assert _same(a[1][name], b[1][name]), name


@needs_bfloat16  # a key of KEYS is bfloat16
@pytest.mark.parametrize("devices", LOGICAL_GPUS, indirect=True)
def test_round_trip_into_device_and_local_stores(cp, devices, tmp_path):
    """A trained GPU store saved and loaded into a fresh 'device' store (keys back on
    several GPUs) and into a 'local' store gives the same value and optimizer-state bits;
    the reloaded GPU store then trains exactly as the original does."""
    kv = gpukv.create("device")
    _init(cp, kv, devices)
    assert len({kv._entries[k].home for k in KEYS}) == min(len(KEYS), len(devices))
    kv.set_optimizer(_adam())
    _train(cp, kv, devices, 3)
    kv.save(tmp_path / "ck.npz")
    values = _values(cp, kv)
    states = _states(kv, tmp_path / "a.states")

    fresh = gpukv.create("device")
    fresh.set_optimizer(_adam())
    fresh.load(tmp_path / "ck.npz")
    homes = {fresh._entries[k].home for k in KEYS}
    assert all(h.kind == "gpu" for h in homes) and len(homes) > 1
    assert all(_same(values[k], v) for k, v in _values(cp, fresh).items())
    _assert_same_states(states, _states(fresh, tmp_path / "b.states"))

    host = gpukv.create("local")
    host.set_optimizer(_adam())
    host.load(tmp_path / "ck.npz")
    assert all(host._entries[k].home.kind == "cpu" for k in KEYS)
    assert all(_same(values[k], v) for k, v in _values(cp, host, on_gpu=False).items())
    _assert_same_states(states, _states(host, tmp_path / "c.states"))

    _train(cp, kv, devices, 2, first=3)
    _train(cp, fresh, devices, 2, first=3)
    after = _values(cp, kv)
    assert all(_same(after[k], v) for k, v in _values(cp, fresh).items())


@needs_bfloat16  # a key of KEYS is bfloat16
@pytest.mark.parametrize("devices", LOGICAL_GPUS, indirect=True)
def test_optimizer_states_file_restores_gpu_states(cp, devices, tmp_path):
    """load_optimizer_states on a GPU store (keys on other GPUs than the saver's, other
    options, states of its own) restores states, update counts and, with dump_optimizer,
    the options: given the same weights, both stores then train to the same bits."""
    kv = gpukv.create("device")
    _init(cp, kv, devices)
    kv.set_optimizer(_adam())
    _train(cp, kv, devices, 2)
    kv.save_optimizer_states(tmp_path / "opt.states", dump_optimizer=True)
    saved = read_archive(tmp_path / "opt.states")
    weights = gpukv.create("device")  # no optimizer: its checkpoint holds values only
    _init(cp, weights, devices, values=_values(cp, kv))
    weights.save(tmp_path / "weights.npz")

    other = gpukv.create("device")
    for k in reversed(KEYS):  # one key per call: other homes than kv's
        _init(cp, other, devices, [k])
    assert any(other._entries[k].home != kv._entries[k].home for k in KEYS)
    other.set_optimizer(_adam(learning_rate=0.5, wd=0.0))
    _train(cp, other, devices, 1, first=7)  # states of its own, to be replaced
    other.load(tmp_path / "weights.npz")
    other.load_optimizer_states(tmp_path / "opt.states")
    _assert_same_states(saved, _states(other, tmp_path / "other.states", dump=True))
    _train(cp, kv, devices, 2, first=2)
    _train(cp, other, devices, 2, first=2)
    after = _values(cp, kv)
    assert all(_same(after[k], v) for k, v in _values(cp, other).items())


def test_a_loaded_16_bit_value_on_a_gpu_is_what_the_next_step_starts_from(cp, tmp_path):
    """On a GPU too: a loaded value replaces the float32 master copy of a key an
    optimizer stepped before, so the next step starts from it."""
    source = gpukv.create("local")
    source.init(0, np.full(4, 100, np.float16))
    source.save(tmp_path / "values.npz")
    kv = gpukv.create("device")
    kv.init(0, cp.ones(4, cp.float16))
    kv.set_optimizer(optim.SGD(learning_rate=0.5))
    kv.push(0, cp.ones(4, cp.float16))
    kv.load(tmp_path / "values.npz")
    kv.push(0, cp.ones(4, cp.float16))
    out = cp.zeros(4, cp.float16)
    kv.pull(0, out=out)
    assert cp.asnumpy(out).tolist() == [99.5] * 4

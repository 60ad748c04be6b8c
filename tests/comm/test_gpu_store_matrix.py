"""The whole 'device' store on 4 and 8 logical GPUs, every strategy: one list call of keys
of several dtypes, sizes and layouts gives the bits a 'local' store gives for the same data.

Values are multiples of 1/4 small enough that every float32 partial sum is exact, so the
order a strategy sums in cannot change a bit; float16 and bfloat16 are summed in float32
on both sides and rounded once.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

import gpukv
from gpukv.comm import nccl as nccl_mod
from gpukv.device.cuda import sums as _sums

from ..bfloat16 import BF16
from ..bfloat16 import dtype_named as _dtype
from ..gpu_gate import hardware_missing, physical_gpus

pytestmark = pytest.mark.gpu

STRATEGIES = ("home", "tree", "ring", "cpu", "auto", "nccl")
#: Logical GPUs dealt onto the physical ones (GPUKV_VIRTUAL_GPUS, set by each test).
LOGICAL_GPUS = (pytest.param(4, id="4gpus"), pytest.param(8, id="8gpus"))
#: Elements above which 'tree' slices a key over every tree (MXNet's fixed rule).
TREE_BOUND = 64


class Spec(NamedTuple):
    """One key of the call: its dtype and shape, and how its arrays look."""
    dtype: str
    shape: tuple
    strided: bool = False  # sources and outs are transposed (non-contiguous) views
    sources: tuple = ()  # dtypes of the pushed arrays, dealt over the GPUs (default: dtype)
    outs: tuple = ()  # dtypes of the pulled-into arrays, dealt over the GPUs
    negative_zero: bool = False  # every value is -0.0


KEYS = {
    0: Spec("float32", (5,)),
    1: Spec("float16", (7, 3)),
    2: Spec("bfloat16", (11,)),
    3: Spec("int32", (4, 6)),
    # Large: sliced over every tree (TREE_BOUND), cut into ring chunks, staged in several
    # pieces between GPUs without peer access, copied by memcpy (see `machine`).
    4: Spec("float32", (2053,)),
    5: Spec("bfloat16", (1031,)),
    6: Spec("float32", (6, 10), strided=True),
    7: Spec("float16", (9, 4), strided=True),
    8: Spec("float32", (3, 5), sources=("float16", "float64"), outs=("float32", "float64")),
    9: Spec("float32", (8,), negative_zero=True),
    10: Spec("bfloat16", (4,), negative_zero=True),
}
if BF16 is None:  # no ml_dtypes (a GPU machine may lack it): the other keys still run
    KEYS = {k: spec for k, spec in KEYS.items() if spec.dtype != "bfloat16"}


def _is_float(dtype):
    return dtype.kind in "fV"


def _values(spec: Spec, n: int, seed: int, kinds) -> list:
    """n NumPy arrays for `spec`, the i-th of dtype kinds[i % len(kinds)]."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        dtype = _dtype(kinds[i % len(kinds)] if kinds else spec.dtype)
        if spec.negative_zero:
            out.append(np.full(spec.shape, -0.0, dtype))
        elif _is_float(dtype):
            out.append((rng.integers(-40, 41, size=spec.shape) * 0.25).astype(dtype))
        else:
            out.append(rng.integers(-40, 41, size=spec.shape).astype(dtype))
    return out


def _on_gpu(cp, array, device, strided):
    """`array` copied to `device`'s GPU, as a transposed view when `strided`."""
    with cp.cuda.Device(device.physical):
        if strided:
            return cp.asarray(np.ascontiguousarray(array.T)).T
        return cp.asarray(array)


def _outs(cp, spec: Spec, devices) -> list:
    """One out per device for `spec`, filled with a sentinel the pull must overwrite."""
    outs = []
    for i, d in enumerate(devices):
        dtype = _dtype(spec.outs[i % len(spec.outs)] if spec.outs else spec.dtype)
        outs.append(_on_gpu(cp, np.full(spec.shape, 7, dtype), d, spec.strided))
    return outs


def _host_outs(spec: Spec, n: int) -> list:
    return [np.full(spec.shape, 7, _dtype(spec.outs[i % len(spec.outs)] if spec.outs
                                          else spec.dtype)) for i in range(n)]


def _assert_same_bits(cp, gpu_outs, host_outs, key):
    """Every GPU out holds the bits of the matching 'local' out (-0.0 keys: all -0.0)."""
    for i, (g, h) in enumerate(zip(gpu_outs, host_outs)):
        got = cp.asnumpy(g)
        assert got.dtype == h.dtype and got.shape == h.shape, (key, i)
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(h).tobytes(), \
            f"key {key}, device {i}: {got!r} != {h!r}"
        if KEYS[key].negative_zero:
            assert np.signbit(got.astype(np.float32)).all(), f"key {key}: {got!r}"


@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.fixture
def machine(request, monkeypatch):
    """The logical GPUs of the test (GPUKV_VIRTUAL_GPUS), with a small tree bound and
    small staging/memcpy thresholds so that large keys take every path."""
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", str(request.param))
    monkeypatch.setenv("GPUKV_TREE_ARRAY_BOUND", str(TREE_BOUND))
    monkeypatch.delenv("GPUKV_STRATEGY", raising=False)
    monkeypatch.setattr(_sums, "STAGE_BYTES", 1024)
    monkeypatch.setattr(_sums, "BIG_COPY", 2048)
    from gpukv.device.cuda.device import gpu_devices
    devices = gpu_devices()
    assert len(devices) == request.param
    return devices


def _store(name):
    from gpukv.device.cuda.device import gpu_count
    if name == "nccl" and gpu_count() > 1 and not nccl_mod.nccl_available():
        hardware_missing("NCCL is not installed")
    return gpukv.create("device", strategy=name)


def _init_both(cp, kv, ref, devices, seed):
    """Every key of KEYS in `kv` (from a GPU array on device key % n) and in `ref`."""
    keys = list(KEYS)
    host = [_values(KEYS[k], 1, seed + k, ())[0] for k in keys]
    n = len(devices)
    kv.init(keys, [_on_gpu(cp, h, devices[k % n], KEYS[k].strided) for k, h in zip(keys, host)])
    ref.init(keys, host)
    homes = {kv._entries[k].home for k in keys}
    assert len(homes) == n  # the keys are spread over every logical GPU
    return keys


def _sources(cp, devices, seed):
    """(GPU sources, host sources): per key, one array from every logical GPU."""
    gpu, host = [], []
    for k, spec in KEYS.items():
        values = _values(spec, len(devices), seed + 100 * k, spec.sources)
        host.append(values)
        gpu.append([_on_gpu(cp, v, d, spec.strided) for v, d in zip(values, devices)])
    return gpu, host


@pytest.mark.parametrize("machine", LOGICAL_GPUS, indirect=True)
@pytest.mark.parametrize("name", STRATEGIES)
def test_push_then_pull(cp, machine, name):
    """A list push from every logical GPU, then a list pull to every logical GPU, gives
    'local''s bits for every key: dtypes, sizes, strided arrays, mixed source dtypes, -0.0."""
    kv, ref = _store(name), gpukv.create("local")
    keys = _init_both(cp, kv, ref, machine, 1)
    outs = [_outs(cp, KEYS[k], machine) for k in keys]
    host_outs = [_host_outs(KEYS[k], len(machine)) for k in keys]
    kv.pull(keys, out=outs)  # the initial values, -0.0 included
    ref.pull(keys, out=host_outs)
    for k, g, h in zip(keys, outs, host_outs):
        _assert_same_bits(cp, g, h, k)
    gpu, host = _sources(cp, machine, 2)
    kv.push(keys, gpu)
    ref.push(keys, host)
    kv.pull(keys, out=outs)
    ref.pull(keys, out=host_outs)
    for k, g, h in zip(keys, outs, host_outs):
        _assert_same_bits(cp, g, h, k)


@pytest.mark.parametrize("machine", LOGICAL_GPUS, indirect=True)
@pytest.mark.parametrize("name", STRATEGIES)
def test_pushpull(cp, machine, name):
    """pushpull into separate outs, then in place (out=None), gives 'local''s bits."""
    kv, ref = _store(name), gpukv.create("local")
    keys = _init_both(cp, kv, ref, machine, 3)
    gpu, host = _sources(cp, machine, 4)
    outs = [_outs(cp, KEYS[k], machine) for k in keys]
    host_outs = [_host_outs(KEYS[k], len(machine)) for k in keys]
    kv.pushpull(keys, gpu, out=outs)
    ref.pushpull(keys, host, out=host_outs)
    for k, g, h in zip(keys, outs, host_outs):
        _assert_same_bits(cp, g, h, k)
    kv.pushpull(keys, gpu)
    ref.pushpull(keys, host)
    for k, g, h in zip(keys, gpu, host):
        _assert_same_bits(cp, g, h, k)


@pytest.mark.parametrize("machine", LOGICAL_GPUS, indirect=True)
@pytest.mark.parametrize("name", STRATEGIES)
def test_broadcast(cp, machine, name):
    """broadcast of every key from one GPU into outs on every logical GPU gives 'local''s
    bits, with the new keys homed over every logical GPU."""
    kv, ref = _store(name), gpukv.create("local")
    n = len(machine)
    keys = list(KEYS)
    host = [_values(KEYS[k], 1, 5 + k, ())[0] for k in keys]
    values = [_on_gpu(cp, h, machine[(k + 1) % n], KEYS[k].strided) for k, h in zip(keys, host)]
    outs = [_outs(cp, KEYS[k], machine) for k in keys]
    host_outs = [_host_outs(KEYS[k], n) for k in keys]
    kv.broadcast(keys, values, out=outs)
    ref.broadcast(keys, host, out=host_outs)
    for k, g, h in zip(keys, outs, host_outs):
        _assert_same_bits(cp, g, h, k)
    assert len({kv._entries[k].home for k in keys}) == n


@pytest.mark.parametrize("machine", LOGICAL_GPUS, indirect=True)
@pytest.mark.parametrize("name", ["tree", "ring", "home"])
def test_large_keys_take_the_sliced_paths(cp, monkeypatch, machine, name):
    """A push of KEYS really cuts the large keys: over every tree ('tree'), into one
    chunk per logical GPU ('ring'), and into several staged pieces when two GPUs have
    no peer access ('home'), so the bit-for-bit tests above cover those paths."""
    from gpukv.comm import ring, tree
    from gpukv.device.cuda.device import can_access_peer
    seen = {"slices": [], "chunks": [], "staged": []}
    segments, bounds, staged = tree.TreeStrategy._segments, ring.chunk_bounds, _sums._staged_sum

    def spy_segments(self, plan, job, size, itemsize):
        cut = segments(self, plan, job, size, itemsize)
        seen["slices"].append((size, len(cut)))
        return cut

    def spy_bounds(n, k):
        seen["chunks"].append((n, k))
        return bounds(n, k)

    def spy_staged(device, out, terms, have):
        seen["staged"].extend(t.array.size for t in terms)
        return staged(device, out, terms, have)

    monkeypatch.setattr(tree.TreeStrategy, "_segments", spy_segments)
    monkeypatch.setattr(ring, "chunk_bounds", spy_bounds)
    monkeypatch.setattr(_sums, "_staged_sum", spy_staged)
    kv = _store(name)
    keys = _init_both(cp, kv, gpukv.create("local"), machine, 1)
    kv.push(keys, _sources(cp, machine, 2)[0])
    n, large = len(machine), {KEYS[k].shape[0] for k in (4, 5) if k in KEYS}
    if name == "tree":
        assert {(size, n) for size in large} <= set(seen["slices"])
    elif name == "ring":
        assert {(size, n) for size in large} <= set(seen["chunks"])
    else:
        physical = sorted({d.physical for d in machine})
        unlinked = any(not can_access_peer(a, b) for a in physical for b in physical)
        piece = _sums.STAGE_BYTES // 4  # float32 elements per staged piece
        if unlinked:
            assert any(size > piece for size in seen["staged"])


# --------------------------------------------------------------------------------- NCCL
class _Recorder:
    """One NCCL rank that records its collectives (and whether a group was open)."""

    def __init__(self, comm, log, groups):
        self._comm, self._log, self._groups = comm, log, groups

    def reduce(self, send, recv, count, datatype, op, root, stream):
        self._log.append(("reduce", self._comm.device_id(), count, datatype, root,
                          self._groups["open"]))
        self._comm.reduce(send, recv, count, datatype, op, root, stream)

    def bcast(self, buff, count, datatype, root, stream):
        self._log.append(("bcast", self._comm.device_id(), count, datatype, root,
                          self._groups["open"]))
        self._comm.bcast(buff, count, datatype, root, stream)


@pytest.fixture
def nccl_calls(monkeypatch):
    """(collectives issued, group counts) of every 'nccl' store of the test."""
    from gpukv.device.cuda.device import gpu_count
    if gpu_count() < 2:
        hardware_missing("NCCL between GPUs needs two physical GPUs")
    if not nccl_mod.nccl_available():
        hardware_missing("NCCL is not installed")
    nccl = nccl_mod.nccl_module()
    log, groups = [], {"open": 0, "ended": 0}
    start, end = nccl.groupStart, nccl.groupEnd

    def group_start():
        groups["open"] += 1
        start()

    def group_end():
        groups["open"] -= 1
        groups["ended"] += 1
        end()

    monkeypatch.setattr(nccl, "groupStart", group_start)
    monkeypatch.setattr(nccl, "groupEnd", group_end)
    made = nccl_mod.NcclStrategy._communicators
    monkeypatch.setattr(nccl_mod.NcclStrategy, "_communicators",
                        lambda self, mod, physical: [_Recorder(c, log, groups)
                                                     for c in made(self, mod, physical)])
    return log, groups


def _calls_of(log, shape):
    """The recorded collectives of the key of `shape` (every key has its own size)."""
    return [c for c in log if c[2] == int(np.prod(shape))]


NCCL_KEYS = {  # key: (dtype, shape, strided sources); every key of its own size
    0: ("float16", (6,), False),
    1: ("bfloat16", (5, 3), False),
    2: ("float32", (300,), False),
    3: ("int32", (7,), False),
    4: ("float64", (4, 6), True),
}
if BF16 is None:
    del NCCL_KEYS[1]
#: NCCL's data type of the sum of each key (16-bit floats are summed in float32).
_SUM_TYPE = {"float16": "NCCL_FLOAT32", "bfloat16": "NCCL_FLOAT32", "float32": "NCCL_FLOAT32",
             "int32": "NCCL_INT32", "float64": "NCCL_FLOAT64"}
_OWN_TYPE = {"float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16"}


@pytest.mark.parametrize("virtual", [None, 8], ids=["physical", "8virtual"])
def test_nccl_store_runs_grouped_collectives(cp, monkeypatch, nccl_calls, virtual):
    """The 'nccl' store reduces every key of a push with one NCCL reduce per physical GPU
    (16-bit floats in float32, root the home's GPU) inside one group, pulls with one
    grouped bcast per GPU in the key's own dtype, and matches 'local' bit for bit."""
    if virtual is None:
        monkeypatch.delenv("GPUKV_VIRTUAL_GPUS", raising=False)
    else:
        monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", str(virtual))
    from gpukv.device.cuda.device import gpu_count, gpu_devices
    devices = gpu_devices()
    physical = sorted({d.physical for d in devices})
    assert len(physical) == gpu_count() >= 2
    log, groups = nccl_calls
    nccl = nccl_mod.nccl_module()
    kv, ref = gpukv.create("nccl"), gpukv.create("local")
    keys = list(NCCL_KEYS)
    specs = {k: Spec(d, shape) for k, (d, shape, _) in NCCL_KEYS.items()}
    init = [_values(specs[k], 1, 10 + k, ())[0] for k in keys]
    kv.init(keys, [_on_gpu(cp, v, devices[k % len(devices)], False)
                   for k, v in zip(keys, init)])
    ref.init(keys, init)
    homes = {k: kv._entries[k].home.physical for k in keys}
    assert len(set(homes.values())) > 1
    host = [_values(specs[k], len(devices), 20 + k, ()) for k in keys]
    kv.push(keys, [[_on_gpu(cp, v, d, NCCL_KEYS[k][2]) for v, d in zip(vs, devices)]
                   for k, vs in zip(keys, host)])
    ref.push(keys, host)
    assert groups == {"open": 0, "ended": 1}
    assert len(log) == len(keys) * len(physical)
    assert all(c[0] == "reduce" and c[5] == 1 for c in log)  # all inside the group
    for k in keys:
        dtype, shape, _ = NCCL_KEYS[k]
        calls = _calls_of(log, shape)
        assert sorted(c[1] for c in calls) == physical  # one rank per physical GPU
        assert {c[3:5] for c in calls} == {(getattr(nccl, _SUM_TYPE[dtype]),
                                            physical.index(homes[k]))}
    log.clear()
    outs = [[_on_gpu(cp, np.zeros(NCCL_KEYS[k][1], _dtype(NCCL_KEYS[k][0])), d, False)
             for d in devices] for k in keys]
    host_outs = [[np.zeros(NCCL_KEYS[k][1], _dtype(NCCL_KEYS[k][0])) for _ in devices]
                 for k in keys]
    kv.pull(keys, out=outs)
    ref.pull(keys, out=host_outs)
    assert groups == {"open": 0, "ended": 2}
    assert len(log) == len(keys) * len(physical)
    assert all(c[0] == "bcast" and c[5] == 1 for c in log)
    for i, k in enumerate(keys):
        dtype, shape, _ = NCCL_KEYS[k]
        code = getattr(nccl, _OWN_TYPE.get(dtype, _SUM_TYPE[dtype]))
        calls = _calls_of(log, shape)
        assert sorted(c[1] for c in calls) == physical
        assert {c[3:5] for c in calls} == {(code, physical.index(homes[k]))}
        for g, h in zip(outs[i], host_outs[i]):
            got = cp.asnumpy(g)
            assert got.dtype == h.dtype and got.tobytes() == h.tobytes(), k


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("name", STRATEGIES + ("nccl store",))
def test_one_source_is_stored_bit_for_bit(cp, name):
    """A push of one array, from another GPU than the key's home, stores its bits as
    'local' assigns them: -0.0, a NaN's payload and a subnormal kept (with nothing to
    sum, NCCL's reduction would add it to 0 and make -0.0 +0.0)."""
    # (logical GPUs on one physical one hold their arrays on GPU 0)
    physical_gpus(4, "needs 4 physical GPUs (the home on GPU 1, the push from GPU 3)")
    values = np.array([0x80000000, 0x7FC00001, 0x00000001, 0x3F800000],
                      np.uint32).view(np.float32)
    kv = gpukv.create("nccl") if name == "nccl store" else _store(name)
    with cp.cuda.Device(1):
        kv.init("k", cp.zeros(4, cp.float32))
    with cp.cuda.Device(3):  # (NCCL's root, the home, is then its first rank)
        kv.push("k", cp.asarray(values))
    out = np.full(4, 7, np.float32)
    kv.pull("k", out=out)
    assert out.view(np.uint32).tolist() == values.view(np.uint32).tolist()

"""Every reduction strategy gives NumPy's sums, on host devices (CI) and on GPUs."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpukv
from gpukv import ArgumentError, BackendError
from gpukv.comm import BroadcastJob, ReduceJob
from gpukv.comm import nccl as nccl_mod
from gpukv.comm.auto import AutoStrategy
from gpukv.comm.plan import simulate, topology
from gpukv.comm.registry import STRATEGIES, describe, make_strategy, strategy_class
from gpukv.comm.ring import chunk_bounds, gather_schedule, reduce_schedule
from gpukv.comm.tree import TreeStrategy
from gpukv.device import host_device

from ..bfloat16 import BF16, needs_bfloat16
from ..bfloat16 import dtype_named as _dtype

# 'tree-model': the tree strategy slicing by its cost model, on a latency-free machine
# where slicing pays at every size, so tiny keys are cut into uneven slices.
ALGORITHMS = ("home", "tree", "tree-model", "ring", "cpu", "nccl", "auto")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")
#: the DTYPES drawn by the property tests: bfloat16 only with ml_dtypes
DRAWN_DTYPES = tuple(d for d in DTYPES if d != "bfloat16" or BF16 is not None)
SHAPES = st.sampled_from([(), (1,), (5,), (2, 3), (7, 5), (3, 1, 4), (1000,)])


def _acc(dtype):
    return np.dtype(np.float32) if dtype.itemsize == 2 and dtype.kind in "fV" \
        or dtype.name == "bfloat16" else dtype


def _values(rng, shape, dtype, n):
    hi = 3 if dtype.name == "uint8" else 50
    lo = 0 if dtype.name == "uint8" else -50
    return [rng.integers(lo, hi, size=shape).astype(dtype) for _ in range(n)]


def _reference(values, acc):
    total = np.zeros(values[0].shape, dtype=acc)
    for v in values:
        total = total + v.astype(acc)
    return total


def _machine(nodes):
    """A DGX-1 for up to 8 host slots, a PCIe box beyond."""
    n = len(nodes)
    return topology.dgx1_v100()[:n, :n] if n <= 8 else topology.pcie_two_socket(n)


#: Only bandwidth counts: no launch, kernel or link latency.
_FREE_COSTS = simulate.CostModel(launch_us=0.0, kernel_us=0.0)


def _free_machine(nodes):
    """`_machine(nodes)` as a simulated machine whose links have no latency."""
    m = simulate.generic_machine(_machine(nodes))
    weights = {float(w) for w in np.unique(m.matrix) if w > 0}
    links = {w: simulate.LinkClass(f"w{w:g}", 10.0 * w, 0.0) for w in weights}
    return dataclasses.replace(m, links=links,
                               staged=simulate.LinkClass("staged", 1.0, 0.0))


def _model_tree():
    return TreeStrategy(matrix=_machine, machine=_free_machine, costs=_FREE_COSTS,
                        min_slice_bytes=1)


def _make(name):
    if name == "tree":  # slice every key over all trees, and plan on a DGX-1
        return TreeStrategy(matrix=_machine, array_bound=4)
    if name == "tree-model":
        return _model_tree()
    if name == "ring":
        return make_strategy("ring", matrix=_machine)
    return make_strategy(name)


def _reduce(strategy, values, home_slot, acc):
    devices = [host_device(i) for i in range(len(values))]
    out = np.full(values[0].shape, 99, dtype=acc)
    strategy.reduce_many([ReduceJob("k", values, devices, host_device(home_slot), out)])
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(ALGORITHMS), dtype=st.sampled_from(DRAWN_DTYPES), shape=SHAPES,
       n=st.integers(1, 8), home=st.integers(0, 8), seed=st.integers(0, 2 ** 16))
def test_reduce_matches_numpy_on_host_devices(name, dtype, shape, n, home, seed):
    """Each strategy's reduction over 1..8 host devices equals NumPy's sum (fp16 in fp32)."""
    dtype = _dtype(dtype)
    acc = _acc(dtype)
    values = _values(np.random.default_rng(seed), shape, dtype, n)
    out = _reduce(_make(name), values, home % (n + 1), acc)
    np.testing.assert_array_equal(out, _reference(values, acc).astype(acc))


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(ALGORITHMS), dtype=st.sampled_from(DRAWN_DTYPES), shape=SHAPES,
       n=st.integers(1, 8), home=st.integers(0, 8), seed=st.integers(0, 2 ** 16))
def test_broadcast_copies_to_every_host_device(name, dtype, shape, n, home, seed):
    """Each strategy's broadcast writes the home value into every out array."""
    dtype = _dtype(dtype)
    src = _values(np.random.default_rng(seed), shape, dtype, 1)[0]
    outs = [np.zeros(shape, dtype) for _ in range(n)]
    devices = [host_device(i) for i in range(n)]
    _make(name).broadcast_many([BroadcastJob("k", src, host_device(home % (n + 1)), outs,
                                             devices)])
    for o in outs:
        np.testing.assert_array_equal(o, src)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DRAWN_DTYPES), shape=SHAPES, n=st.integers(2, 8),
       home=st.integers(0, 8), seed=st.integers(0, 2 ** 16))
def test_model_sliced_tree_matches_numpy(dtype, shape, n, home, seed):
    """The tree sliced by its cost model (with three or more devices, slicing at every
    size here) reduces and broadcasts exactly, whatever the slice count and home."""
    dtype = _dtype(dtype)
    acc = _acc(dtype)
    values = _values(np.random.default_rng(seed), shape, dtype, n)
    strategy = _model_tree()
    seen = []
    original = strategy._segments
    strategy._segments = lambda *a: seen.append(original(*a)) or seen[-1]
    home = home % (n + 1)
    out = _reduce(strategy, values, home, acc)
    np.testing.assert_array_equal(out, _reference(values, acc).astype(acc))
    outs = [np.zeros(shape, acc) for _ in range(n)]
    strategy.broadcast_many([BroadcastJob("k", out, host_device(home), outs,
                                          [host_device(i) for i in range(n)])])
    for o in outs:
        np.testing.assert_array_equal(o, out)
    # Two devices gain next to nothing from slicing (the home needs the whole sum), so
    # the model may tie and keep a key whole there.
    if int(np.prod(shape)) >= 2 and n >= 3:
        assert seen and all(len(seg) > 1 for seg in seen)


@needs_bfloat16  # keys of every dtype
@pytest.mark.parametrize("name", ALGORITHMS)
def test_many_keys_in_one_call(name):
    """A list of many keys of mixed sizes and dtypes is reduced and broadcast correctly."""
    rng = np.random.default_rng(0)
    strategy = _make(name)
    jobs, refs, bjobs = [], [], []
    for key in range(120):
        n = 1 + key % 5
        dtype = _dtype(DTYPES[key % len(DTYPES)])
        acc = _acc(dtype)
        values = _values(rng, (key % 13 + 1, 2), dtype, n)
        devices = [host_device(i) for i in range(n)]
        out = np.zeros(values[0].shape, acc)
        jobs.append(ReduceJob(key, values, devices, host_device(key % 3), out))
        refs.append(_reference(values, acc))
        outs = [np.zeros(values[0].shape, acc) for _ in range(n)]
        bjobs.append(BroadcastJob(key, out, host_device(key % 3), outs, devices))
    strategy.reduce_many(jobs)
    for job, ref in zip(jobs, refs):
        np.testing.assert_array_equal(job.out, ref)
    strategy.broadcast_many(bjobs)
    for job, ref in zip(bjobs, refs):
        for o in job.outs:
            np.testing.assert_array_equal(o, ref)


@pytest.mark.parametrize("name", ["home", "tree", "ring"])
def test_non_contiguous_arrays(name):
    """Strided sources and outs are reduced and broadcast like contiguous ones."""
    strategy = _make(name)
    base = [np.arange(40, dtype=np.float32).reshape(5, 8) * (i + 1) for i in range(3)]
    values = [b[:, ::2] for b in base]
    devices = [host_device(i) for i in range(3)]
    out_base = np.zeros((5, 8), np.float32)
    out = out_base[:, 1::2]
    strategy.reduce_many([ReduceJob("k", values, devices, host_device(0), out)])
    np.testing.assert_array_equal(out, sum(values))
    outs_base = [np.zeros((8, 5), np.float32) for _ in range(3)]
    outs = [o.T[:, ::2][:, :4] for o in outs_base]
    strategy.broadcast_many([BroadcastJob("k", out, host_device(0), outs, devices)])
    for o in outs:
        np.testing.assert_array_equal(o, out)


@pytest.mark.parametrize("matrix", [topology.dgx1_v100(), topology.pcie_two_socket(8),
                                    topology.nvswitch_h100(8)], ids=["dgx1", "pcie", "nvswitch"])
@pytest.mark.parametrize("bound", [1, 10, 10 ** 9])
def test_tree_slices_over_roots(matrix, bound):
    """Tree reduction with and without slicing over per-root trees sums exactly."""
    strategy = TreeStrategy(matrix=matrix, array_bound=bound)
    values = [np.arange(37, dtype=np.int64) * (i + 2) for i in range(8)]
    devices = [host_device(i) for i in range(8)]
    for home in (0, 5):
        out = np.zeros(37, np.int64)
        strategy.reduce_many([ReduceJob("k", values, devices, host_device(home), out)])
        np.testing.assert_array_equal(out, sum(values))
        outs = [np.zeros(37, np.int64) for _ in range(8)]
        strategy.broadcast_many([BroadcastJob("k", out, host_device(home), outs, devices)])
        for o in outs:
            np.testing.assert_array_equal(o, out)


@pytest.fixture
def no_bound(monkeypatch):
    for prefix in ("GPUKV_TREE_", "MXNET_KVSTORE_TREE_"):
        monkeypatch.delenv(prefix + "ARRAY_BOUND", raising=False)
    return monkeypatch


@pytest.mark.parametrize("n,nelems", [(2, 2), (3, 5), (5, 7), (8, 3), (8, 37), (8, 1000)])
def test_tree_model_slices_small_keys(no_bound, n, nelems):
    """Where the model says slicing pays, even tiny keys are cut over several trees (never
    more slices than elements), and the sums stay exact."""
    strategy = _model_tree()
    seen = []
    original = strategy._segments

    def spy(*args):
        segments = original(*args)
        seen.append(segments)
        return segments

    strategy._segments = spy
    values = [np.arange(nelems, dtype=np.int64) * (i + 3) for i in range(n)]
    devices = [host_device(i) for i in range(n)]
    for home in (0, n - 1, n):
        out = np.zeros(nelems, np.int64)
        strategy.reduce_many([ReduceJob("k", values, devices, host_device(home), out)])
        np.testing.assert_array_equal(out, sum(values))
        outs = [np.zeros(nelems, np.int64) for _ in range(n)]
        strategy.broadcast_many([BroadcastJob("k", out, host_device(home), outs, devices)])
        for o in outs:
            np.testing.assert_array_equal(o, out)
    assert all(1 < len(seg) <= nelems for seg in seen)


def test_tree_model_keeps_small_keys_whole(no_bound):
    """With the default model and minimum slice, small keys stay on the home's tree; the
    explicit array bound still slices them."""
    values = [np.full(1000, i + 1.0, np.float32) for i in range(8)]
    devices = [host_device(i) for i in range(8)]
    for strategy, count in ((TreeStrategy(matrix=topology.dgx1_v100()), 1),
                            (TreeStrategy(matrix=topology.dgx1_v100(), array_bound=10), 8)):
        seen = []
        original = strategy._segments
        strategy._segments = lambda *a, _o=original: seen.append(_o(*a)) or seen[-1]
        out = np.zeros(1000, np.float32)
        strategy.reduce_many([ReduceJob("k", values, devices, host_device(2), out)])
        np.testing.assert_array_equal(out, np.full(1000, 36.0))
        assert [len(s) for s in seen] == [count]


def test_tree_home_without_source():
    """A home device that holds no source still receives the whole sum."""
    strategy = TreeStrategy(matrix=topology.dgx1_v100(), array_bound=2)
    values = [np.full(9, i + 1.0) for i in range(4)]
    devices = [host_device(i) for i in range(4)]
    out = np.zeros(9)
    strategy.reduce_many([ReduceJob("k", values, devices, host_device(6), out)])
    np.testing.assert_array_equal(out, np.full(9, 10.0))


def test_ring_schedule_covers_every_chunk():
    """After the ring's reduce-scatter each position holds one complete, distinct chunk."""
    for k in range(2, 9):
        partial = {(j, c): {j} for j in range(k) for c in range(k)}  # contributors
        for step in reduce_schedule(k):
            new = dict(partial)
            for j, c, pred in step:
                new[(j, c)] = partial[(j, c)] | partial[(pred, c)]
            partial = new
        for j in range(k):
            assert partial[(j, (j + 1) % k)] == set(range(k))
        got = {j: {j} for j in range(k)}
        for step in gather_schedule(k):
            for j, c, pred in step:
                assert c in got[pred]
                got[j] = got[j] | {c}
        assert all(g == set(range(k)) for g in got.values())


def test_ring_chunk_bounds_cover_array():
    """Chunks partition the array, including arrays shorter than the ring."""
    for n in range(0, 20):
        for k in range(1, 9):
            bounds = chunk_bounds(n, k)
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("name", ["home", "tree", "ring", "nccl"])
def test_store_routes_host_arrays_through_named_strategy(name, monkeypatch):
    """create('device', strategy=...) runs that strategy's algorithm over host slots."""
    cls = type(_make(name)) if name != "tree" else TreeStrategy
    calls = []
    original = cls.reduce_many
    monkeypatch.setattr(cls, "reduce_many",
                        lambda self, jobs: (calls.append(len(jobs)), original(self, jobs)))
    kv = gpukv.create("device", strategy=name)
    kv.init([1, 2], [np.zeros(6), np.zeros(6)])
    kv.push([1, 2], [[np.ones(6)] * 3, [np.full(6, 2.0)] * 4])
    out = [np.zeros(6), np.zeros(6)]
    kv.pull([1, 2], out=out)
    np.testing.assert_array_equal(out[0], np.full(6, 3.0))
    np.testing.assert_array_equal(out[1], np.full(6, 8.0))
    assert calls and calls[0] == 2


def test_default_store_keeps_host_fast_path(monkeypatch):
    """Without a named strategy, host arrays take the host sum, not a GPU strategy."""
    monkeypatch.delenv("GPUKV_STRATEGY", raising=False)
    kv = gpukv.create("device")
    assert kv._route_host is False
    kv.init(1, np.zeros(3))
    kv.push(1, [np.ones(3)] * 2)
    out = np.zeros(3)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, np.full(3, 2.0))


def test_env_strategy_selects_and_routes(monkeypatch):
    """GPUKV_STRATEGY picks the strategy of a GPU store and counts as asked for."""
    monkeypatch.setenv("GPUKV_STRATEGY", "ring")
    kv = gpukv.create("device")
    assert kv.strategy == "ring" and kv._route_host
    kv.init(1, np.zeros(10))
    kv.push(1, [np.arange(10.0)] * 3)
    out = np.zeros(10)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, np.arange(10.0) * 3)


@pytest.mark.parametrize("bad", ["rings", "", "NCCL2"])
def test_bad_strategy_name(bad):
    """An unknown strategy name raises ArgumentError listing the valid ones."""
    with pytest.raises(ArgumentError, match="valid strategies"):
        gpukv.create("device", strategy=bad)
    with pytest.raises(ArgumentError):
        make_strategy(bad)


def test_bad_env_strategy_name(monkeypatch):
    """A bad GPUKV_STRATEGY is an ArgumentError too."""
    monkeypatch.setenv("GPUKV_STRATEGY", "fastest")
    with pytest.raises(ArgumentError, match="fastest"):
        gpukv.create("device")


def test_registry_lists_and_builds_every_strategy():
    """Every listed name builds a strategy of that name and has a description."""
    info = describe()
    for name in STRATEGIES:
        s = make_strategy(name)
        assert s.name == name and s.explicit
        assert strategy_class(name) is type(s)
        assert info[name]
    assert make_strategy(None, on_gpu=False).name == "cpu"


def test_nccl_missing_raises_backend_error_with_hint(monkeypatch):
    """Without a loadable NCCL, the 'nccl' strategy says how to install it."""
    import builtins
    real_import = builtins.__import__

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "cupy.cuda" and fromlist and "nccl" in fromlist or name == "cupy.cuda.nccl":
            raise ImportError("No module named 'cupy_backends.cuda.libs.nccl'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(BackendError, match="pip install 'nvidia-nccl-cu12"):
        nccl_mod.nccl_module()
    assert not nccl_mod.nccl_available()


def test_nccl_unloadable_library_raises_backend_error(monkeypatch):
    """A CuPy whose NCCL module exists but cannot load libnccl also gives the hint."""
    import sys
    import types
    fake = types.ModuleType("cupy.cuda.nccl")
    fake.available = False
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = fake
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake)
    with pytest.raises(BackendError, match="nvidia-nccl"):
        nccl_mod.nccl_module()


def test_auto_choice_logged_and_dispatched(caplog):
    """'auto' asks the chooser per key, logs the choice at DEBUG and runs that strategy."""
    seen = []

    def choose(nbytes, n, machine, home, candidates):
        seen.append((nbytes, n, candidates))
        return "ring" if nbytes > 100 else "tree"

    auto = AutoStrategy(machine=topology.dgx1_v100()[:4, :4], choose=choose, model_host=True)
    devices = [host_device(i) for i in range(4)]
    small = [np.ones(4, np.float32)] * 4
    big = [np.ones(1 << 20, np.float32)] * 4
    jobs = [ReduceJob(3, big, devices, host_device(0), np.zeros(1 << 20, np.float32)),
            ReduceJob(4, small, devices, host_device(0), np.zeros(4, np.float32))]
    with caplog.at_level(logging.DEBUG, logger="gpukv"):
        auto.reduce_many(jobs)
    np.testing.assert_array_equal(jobs[0].out, 4)
    np.testing.assert_array_equal(jobs[1].out, 4)
    assert "gpukv: key 3 (4 MiB, 4 devices) -> ring" in caplog.text
    assert "gpukv: key 4 (16 B, 4 devices) -> tree" in caplog.text
    assert [s[:2] for s in seen] == [(4 << 20, 4), (16, 4)]
    assert "nccl" not in seen[0][2]


def test_auto_host_jobs_take_host_sum():
    """By default 'auto' sends host-only keys to the host sum without asking the model."""
    auto = AutoStrategy(choose=lambda *a: pytest.fail("model consulted"))
    devices = [host_device(i) for i in range(3)]
    assert auto.choose(3, 4 << 20, devices, host_device(0)) == "cpu"


# ----------------------------------------------------------------------- GPU
def _gpu_store_case(name, n_dev, dtype, shape, seed):
    import cupy

    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:n_dev]
    rng = np.random.default_rng(seed)
    host_vals = _values(rng, shape, _dtype(dtype), n_dev)
    kv = gpukv.create("device", strategy=name)
    with cupy.cuda.Device(devs[0].physical):
        kv.init(0, cupy.zeros(shape, _dtype(dtype)))
    vals = []
    for v, d in zip(host_vals, devs):
        with cupy.cuda.Device(d.physical):
            vals.append(cupy.asarray(v))
    kv.push(0, vals)
    outs = []
    for d in devs:
        with cupy.cuda.Device(d.physical):
            outs.append(cupy.zeros(shape, _dtype(dtype)))
    kv.pull(0, out=outs)
    ref = _reference(host_vals, _acc(_dtype(dtype))).astype(_dtype(dtype))
    for o in outs:
        np.testing.assert_array_equal(cupy.asnumpy(o), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["home", "tree", "ring", "cpu", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "float64"])
def test_gpu_store_one_device(name, dtype):
    """On one GPU each strategy's push/pull matches NumPy."""
    _gpu_store_case(name, 1, dtype, (33, 7), 1)


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("name", ["home", "tree", "ring", "cpu", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
@pytest.mark.parametrize("shape", [(5,), (1000, 37), (3 << 20,)])
def test_gpu_store_four_devices(name, dtype, shape):
    """On four (possibly virtual) GPUs each strategy's push/pull matches NumPy."""
    _gpu_store_case(name, 4, dtype, shape, 2)


@pytest.mark.multi_gpu(8)
@pytest.mark.parametrize("name", ["home", "tree", "ring", "auto"])
def test_gpu_store_eight_devices(name, monkeypatch):
    """On eight GPUs each strategy's push/pull matches NumPy (tree: with sliced keys)."""
    monkeypatch.setenv("GPUKV_TREE_ARRAY_BOUND", "1000")
    _gpu_store_case(name, 8, "float32", (4099,), 3)


@pytest.mark.multi_gpu(8)
def test_gpu_tree_slices_a_key_over_the_eight_trees(monkeypatch):
    """With an array bound of 1000 elements, the tree strategy cuts a 4099-element key
    into slices: no sum on any GPU covers more than a slice, and every GPU sums some."""
    from gpukv.device.cuda.device import CudaDevice
    monkeypatch.setenv("GPUKV_TREE_ARRAY_BOUND", "1000")
    sums = []
    real = CudaDevice.sum_into

    def spy(self, jobs):
        sums.extend((self.physical, self.slot, out.size) for out, _ in jobs)
        return real(self, jobs)

    monkeypatch.setattr(CudaDevice, "sum_into", spy)
    _gpu_store_case("tree", 8, "float32", (4099,), 3)
    assert sums and max(size for _, _, size in sums) <= 1000
    assert len({(p, s) for p, s, _ in sums}) == 8


@pytest.mark.multi_gpu(2)
def test_gpu_nccl_or_backend_error():
    """'nccl' on two GPUs either matches NumPy or raises BackendError naming the install."""
    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:2]
    try:
        nccl_mod.nccl_module()
    except BackendError:
        if devs[0].physical != devs[1].physical:
            with pytest.raises(BackendError, match="pip install"):
                _gpu_store_case("nccl", 2, "float32", (100,), 4)
            return
    _gpu_store_case("nccl", 2, "float32", (100,), 4)
    _gpu_store_case("nccl", 2, "float16", (100,), 4)


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("name", ["home", "tree", "ring"])
def test_gpu_many_keys_one_call(name):
    """A push and pull of 300 small keys on four GPUs gives NumPy's sums."""
    import cupy

    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:4]
    kv = gpukv.create("device", strategy=name)
    keys = list(range(300))
    with cupy.cuda.Device(devs[0].physical):
        kv.init(keys, [cupy.zeros(k % 17 + 1, cupy.float32) for k in keys])
    vals = []
    for k in keys:
        per = []
        for i, d in enumerate(devs):
            with cupy.cuda.Device(d.physical):
                per.append(cupy.full(k % 17 + 1, i + k, cupy.float32))
        vals.append(per)
    kv.push(keys, vals)
    kv.pull(keys, out=vals)
    for k in keys:
        for v in vals[k]:
            np.testing.assert_array_equal(cupy.asnumpy(v), np.full(k % 17 + 1, 4 * k + 6.0))

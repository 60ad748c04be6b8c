"""Row-sparse values on GPUs: pushes from several GPUs, row_sparse_pull into GPU outs and
lazy optimizer updates give a 'local' store's bits; repeated rows are summed in order,
16-bit floats in float32, the same on the GPU as on the host."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import RowSparse, optim

from ..bfloat16 import BF16, marked, needs_bfloat16

pytestmark = pytest.mark.multi_gpu(4)


@pytest.fixture
def cp():
    """CuPy (or the emulation), imported once the GPU gate let the test run."""
    import cupy
    return cupy


@pytest.fixture
def devs():
    """Four logical GPUs, one per physical GPU where there are four."""
    from gpukv.device.cuda.device import gpu_devices
    return gpu_devices()[:4]


def _bits(a) -> np.ndarray:
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


def assert_same_bits(got, want, what=""):
    """Same dtype, shape and bytes; else say where they first differ."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape,
                                                                 want.dtype, want.shape)
    differ = np.flatnonzero(_bits(got) != _bits(want))
    assert differ.size == 0, (f"{what}: {differ.size} of {got.size} elements differ, first "
                              f"at {differ[0]}: {got.reshape(-1)[differ[0]]!r} != "
                              f"{want.reshape(-1)[differ[0]]!r}")


def _on(cp, dev, array):
    """A copy of host `array` on logical device `dev`'s GPU."""
    with dev.cuda_device:
        return cp.asarray(array)


def _to_gpu(cp, dev, value: RowSparse) -> RowSparse:
    return RowSparse(_on(cp, dev, value.indices), _on(cp, dev, value.data), value.shape)


def _rows(rng, shape, dtype, n):
    """n rows of `shape` (ids drawn with repetition, unsorted) whose magnitudes span
    several binades, so that the order of a sum shows in its last bits."""
    ids = rng.integers(0, min(shape[0], 12), n)
    rows = (n,) + shape[1:]
    if dtype.kind == "i":
        data = rng.integers(-2 ** 30, 2 ** 30, rows)  # sums wrap, as int32 sums do
    else:
        top = 6 if dtype == np.float16 else 20
        data = rng.standard_normal(rows) * 2.0 ** rng.integers(-top, top, rows)
    return RowSparse(ids, data.astype(dtype), shape)


# -------------------------------------------------- pushes, pulls, without an updater
KEYS = {"h": ((50, 3), np.dtype(np.float16)), "b": ((40, 2), BF16),
        "f": ((60, 5), np.dtype(np.float32)), "i": ((30, 4), np.dtype(np.int32)),
        "v": ((25,), np.dtype(np.float32))}


def _pushes(rng, step):
    """Per key, one RowSparse per GPU: repeated ids inside each and across them; at the
    second step the third GPU sends no rows."""
    return {k: [_rows(rng, shape, dtype, 0 if (step == 1 and g == 2) else 9)
                for g in range(4)] for k, (shape, dtype) in KEYS.items()}


def _stores(cp, devs, keys, init):
    """A 'local' store and a 'device' store of the row-sparse values `init` (the latter's
    made on the first GPU)."""
    host, gpu = gpukv.create("local"), gpukv.create("device")
    host.init(keys, init)
    gpu.init(keys, [_to_gpu(cp, devs[0], v) for v in init])
    return host, gpu


@needs_bfloat16  # a key of KEYS is bfloat16
def test_pushes_from_four_gpus_equal_local(cp, devs):
    """Row-sparse pushes from four GPUs, with rows repeated inside each source and
    across them, store a 'local' store's bits after every push (16-bit floats summed in
    float32, int32 wrapping), on GPUs 0..3 as homes."""
    rng = np.random.default_rng(1)
    keys = sorted(KEYS)
    init = [_rows(rng, *KEYS[k], 5) for k in keys]
    host, gpu = _stores(cp, devs, keys, init)
    homes = {(gpu._entries[k].home.physical, gpu._entries[k].home.slot) for k in keys}
    assert homes == {(d.physical, d.slot) for d in devs}
    for step in range(3):
        pushes = _pushes(rng, step)
        host.push(keys, [pushes[k] for k in keys])
        gpu.push(keys, [[_to_gpu(cp, d, v) for d, v in zip(devs, pushes[k])] for k in keys])
        for k in keys:
            assert_same_bits(gpu._entries[k].value.get(), host._entries[k].value,
                             f"key {k!r} after push {step}")


def _ids(cp, kind, dev, ids):
    """Row ids as a GPU array on `dev`, a host array or a list."""
    if kind == "gpu":
        return _on(cp, dev, ids)
    return ids if kind == "host" else ids.tolist()


@needs_bfloat16  # a key of KEYS is bfloat16
@pytest.mark.parametrize("ids_kind", ["gpu", "host", "list"])
def test_row_sparse_pull_into_gpu_outs_equals_local(cp, devs, ids_kind):
    """row_sparse_pull of every key into RowSparse outs on each GPU (float32 outs for
    the float16 key) gives the 'local' store's rows, sorted and unique, on the out's
    GPU, and a dense pull into GPU arrays the 'local' store's values."""
    rng = np.random.default_rng(2)
    keys = sorted(KEYS)
    init = [_rows(rng, *KEYS[k], 20) for k in keys]
    host, gpu = _stores(cp, devs, keys, init)
    pushes = _pushes(rng, 0)
    host.push(keys, [pushes[k] for k in keys])
    gpu.push(keys, [[_to_gpu(cp, d, v) for d, v in zip(devs, pushes[k])] for k in keys])
    for k in keys:
        shape, dtype = KEYS[k]
        out_dtype = np.dtype(np.float32) if k == "h" else dtype
        ids = [rng.integers(0, shape[0], 7) for _ in devs]  # unsorted, repeated
        outs = []
        for d in devs:
            with d.cuda_device:
                outs.append(RowSparse.zeros(shape, out_dtype, xp=cp))
        gpu.row_sparse_pull(k, out=outs, row_ids=[_ids(cp, ids_kind, d, i)
                                                  for d, i in zip(devs, ids)])
        for d, o, i in zip(devs, outs, ids):
            want = RowSparse.zeros(shape, out_dtype)
            host.row_sparse_pull(k, out=want, row_ids=i)
            assert o.indices.device.id == o.data.device.id == d.physical
            assert o.indices.get().tolist() == want.indices.tolist() == sorted(set(i))
            assert_same_bits(o.data.get(), want.data, f"rows of key {k!r} on GPU {d}")
        dense = [_on(cp, d, np.zeros(shape, dtype)) for d in devs]
        gpu.pull(k, out=dense)
        for o in dense:
            assert_same_bits(o.get(), host._entries[k].value, f"dense pull of key {k!r}")


# ----------------------------------------------------- repeated rows, summed in order
def _sequential(ids, data, acc):
    """The rows of each id summed one after the other in `acc`, ids ascending."""
    out = {}
    for i, row in zip(ids.tolist(), data.astype(acc)):
        out[i] = row.copy() if i not in out else (out[i] + row).astype(acc)
    return np.array([out[i] for i in sorted(out)])


CASES = {  # rows of id 1 and 4 interleaved, where the order or width of a sum shows
    # a float16 running sum overflows (inf) or rounds 2048 + 1 back to 2048
    "float16": ([60000, 2048, 60000, 1, -60000, 1, -59000, 1, 1, 1], np.float16),
    # a float16 running sum would round at every step
    "float16_ulps": ([1.0, 1024, 2 ** -11, 0.5, 2 ** -11, 0.5, 2 ** -11, 0.5, 2 ** -11, 0.25],
                     np.float16),
    "bfloat16": ([256, 1.0, 1, 2 ** -8, 1, 2 ** -8, 1, 2 ** -8, -256, 2 ** -8], BF16),
    # three terms: (a + b) + c differs from a + (b + c)
    "float32": ([1.0, 3.0, 2 ** -24, 2 ** -23, 2 ** -24, 2 ** -23, 0.5, 2 ** -22, 0.25,
                 -3.0], np.float32),
}
#: the names of CASES as cases: bfloat16's skips without ml_dtypes
CASE_NAMES = marked(sorted(CASES))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_repeated_rows_are_summed_in_order_on_gpu_and_host(cp, devs, name):
    """Coalescing repeated rows adds them one after the other in their order (16-bit
    floats in float32, then rounded once): the GPU and the host give those bits, and
    the GPU gives them again on a second run."""
    values, dtype = CASES[name]
    dtype = np.dtype(dtype)
    ids = np.array([1, 4] * (len(values) // 2), np.int64)
    data = np.array(values, np.float64).astype(dtype).reshape(-1, 1)
    acc = np.float32 if dtype.itemsize == 2 else dtype
    want = _sequential(ids, data, acc).astype(dtype)
    assert np.isfinite(want.astype(np.float64)).all()
    host = RowSparse(ids, data, (6, 1)).coalesce()
    assert host.indices.tolist() == [1, 4]
    assert_same_bits(host.data, want, "host")
    runs = []
    for _ in range(2):
        got = _to_gpu(cp, devs[1], RowSparse(ids, data, (6, 1))).coalesce()
        assert got.indices.get().tolist() == [1, 4]
        runs.append(got.data.get())
    assert_same_bits(runs[0], want, "GPU")
    assert_same_bits(runs[1], runs[0], "second GPU run")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_repeated_rows_across_gpus_store_the_in_order_sum(cp, devs, name):
    """Rows of one id pushed from four GPUs are summed in source order, 16-bit floats in
    float32: the GPU store holds the same bits as a 'local' store and the in-order sum."""
    values, dtype = CASES[name]
    dtype = np.dtype(dtype)
    data = np.array(values, np.float64).astype(dtype).reshape(-1, 1)
    parts = np.array_split(np.arange(len(values)), 4)  # sources of 2 or 3 rows
    ids = np.array([1, 4] * (len(values) // 2), np.int64)
    sources = [RowSparse(ids[p], data[p], (6, 1)) for p in parts]
    host, gpu = gpukv.create("local"), gpukv.create("device")
    host.init(0, np.zeros((6, 1), dtype))
    with devs[2].cuda_device:
        gpu.init(0, cp.zeros((6, 1), dtype))
    host.push(0, sources)
    gpu.push(0, [_to_gpu(cp, d, s) for d, s in zip(devs, sources)])
    acc = np.float32 if dtype.itemsize == 2 else dtype
    want = np.zeros((6, 1), dtype)
    want[[1, 4]] = _sequential(ids, data, acc).astype(dtype)
    assert_same_bits(host._entries[0].value, want, "host")
    assert_same_bits(gpu._entries[0].value.get(), want, "GPU")


# ------------------------------------------------------------- optimizers on rows
OPTIMIZERS = {
    "sgd_lazy": lambda: optim.SGD(learning_rate=0.1, wd=1e-3),
    "sgd_mom_lazy_clip": lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                                           clip_gradient=0.5),
    "sgd_mom_standard": lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                                          lazy_update=False),
    "adam_lazy": lambda: optim.Adam(learning_rate=0.01, wd=1e-3),
    "adam_lazy_clip": lambda: optim.Adam(learning_rate=0.01, clip_gradient=0.3),
    "adam_standard": lambda: optim.Adam(learning_rate=0.01, wd=1e-3, lazy_update=False),
    "adagrad": lambda: optim.AdaGrad(learning_rate=0.1, wd=1e-3),
    "nag_dense": lambda: optim.NAG(learning_rate=0.05, momentum=0.9, wd=1e-3),
    "adamw_dense": lambda: optim.AdamW(learning_rate=0.01, wd=1e-2),
    "rmsprop_dense": lambda: optim.RMSProp(learning_rate=0.01, centered=True),
}


@pytest.mark.parametrize("dtype", [
    np.dtype(np.float32), np.dtype(np.float16),
    pytest.param(BF16, id="bfloat16", marks=needs_bfloat16)], ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_on_row_sparse_pushes_equals_local(cp, devs, name, dtype):
    """Three row-sparse pushes from four GPUs (rows repeated) through an optimizer: the
    weights, master copies and states of two keys equal a 'local' store's bit for bit
    (a lazy rule leaves the other rows untouched), and so do rows pulled to a GPU."""
    rng = np.random.default_rng(3)
    shapes = {"e": (300, 8), "w": (40,)}
    keys = sorted(shapes)
    w0 = [(rng.standard_normal(shapes[k]) * 0.5).astype(np.float32).astype(dtype)
          for k in keys]
    host, gpu = gpukv.create("local"), gpukv.create("device")
    host.init(keys, w0)
    gpu.init(keys, [_on(cp, devs[1], w) for w in w0])
    host.set_optimizer(OPTIMIZERS[name]())
    gpu.set_optimizer(OPTIMIZERS[name]())
    touched = {k: set() for k in keys}
    for step in range(3):
        pushes = {}
        for k in keys:
            pushes[k] = []
            for _ in devs:
                ids = rng.choice(shapes[k][0], 6)
                touched[k].update(ids.tolist())
                data = rng.standard_normal((6,) + shapes[k][1:]).astype(np.float32)
                pushes[k].append(RowSparse(ids, data.astype(dtype), shapes[k]))
        host.push(keys, [pushes[k] for k in keys])
        gpu.push(keys, [[_to_gpu(cp, d, v) for d, v in zip(devs, pushes[k])] for k in keys])
        for k in keys:
            what = f"{name} {dtype} key {k!r} push {step}"
            assert_same_bits(gpu._entries[k].value.get(), host._entries[k].value, what)
            hs, gs = host._updater.states[k], gpu._updater.states[k]
            for i, (g, h) in enumerate(zip(gs.arrays, hs.arrays)):
                assert_same_bits(g.get(), h, f"{what} state {i}")
            assert (gs.master is None) == (hs.master is None) == (dtype.itemsize == 4)
            if hs.master is not None:
                assert_same_bits(gs.master.get(), hs.master, f"{what} master")
    if host._optimizer.lazy_rows():
        for k, w in zip(keys, w0):
            absent = sorted(set(range(shapes[k][0])) - touched[k])
            assert absent and np.array_equal(_bits(host._entries[k].value[absent]),
                                             _bits(w[absent]))
    ids = np.arange(0, 40, 3)
    with devs[3].cuda_device:
        out = RowSparse.zeros(shapes["e"], dtype, xp=cp)
        gpu.row_sparse_pull("e", out=out, row_ids=cp.asarray(ids))
    want = RowSparse.zeros(shapes["e"], dtype)
    host.row_sparse_pull("e", out=want, row_ids=ids)
    assert_same_bits(out.data.get(), want.data, "pulled rows")


@pytest.mark.multi_gpu(8)
def test_an_assigned_row_sparse_push_is_ordered_before_the_callers_stream(cp):
    """Without an updater a row-sparse push assigns the rows on the key's home (a virtual
    GPU's own stream included): work the caller then queues on its current stream reads
    the new value, ordered after the assignment (the race checker would name both)."""
    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:8]
    rng = np.random.default_rng(3)
    keys = [f"k{i}" for i in range(16)]
    shape, dtype = (20, 3), np.dtype(np.float32)
    gpu = gpukv.create("device")
    gpu.init(keys, [[_on(cp, d, np.zeros(shape, dtype)) for d in devs] for _ in keys])
    homes = {k: gpu._entries[k].home for k in keys}
    assert any(h.slot > 0 for h in homes.values())  # some keys live on a virtual GPU
    pushes = {k: _rows(rng, shape, dtype, 6) for k in keys}
    gpu.push(keys, [_to_gpu(cp, homes[k], pushes[k]) for k in keys])
    for k in keys:
        with homes[k].cuda_device:  # the caller's current stream on the home's GPU
            seen = gpu._entries[k].value.copy()
        want = np.zeros(shape, dtype)
        np.add.at(want, pushes[k].indices, pushes[k].data)
        np.testing.assert_array_equal(seen.get(), want, err_msg=f"key {k!r}")

"""Row-sparse values: RowSparse validation and helpers, push, row_sparse_pull, ignore_sparse."""
from __future__ import annotations

import contextlib
import json
import pathlib
import warnings

import numpy as np
import pytest

import gpukv
from gpukv import RowSparse

from ..bfloat16 import needs_bfloat16
from ..gpu_gate import physical_gpus

REF = json.loads((pathlib.Path(__file__).parents[1] / "data" / "mxnet_sparse_reference.json")
                 .read_text())
SHAPE = tuple(REF["shape"])


def rsp(indices, data, shape=SHAPE, dtype=np.float32):
    return RowSparse(np.array(indices, np.int64), np.array(data, dtype), shape)


def mxnet_store():
    kv = gpukv.create("device")
    kv.init("w", rsp(REF["init"]["indices"], REF["init"]["data"]))
    return kv


# ------------------------------------------------------------------ RowSparse
@pytest.mark.parametrize("indices,data,shape,error", [
    ([[0]], [[1, 1]], (3, 2), gpukv.ShapeError),
    ([0, 1], [[1, 1]], (3, 2), gpukv.ShapeError),
    ([0], [[1, 1, 1]], (3, 2), gpukv.ShapeError),
    ([3], [[1, 1]], (3, 2), gpukv.ArgumentError),
    ([-1], [[1, 1]], (3, 2), gpukv.ArgumentError),
    (np.array([0.5]), [[1, 1]], (3, 2), gpukv.DTypeError),
    ([0], [[1, 1]], "3x2", gpukv.ArgumentKindError),
])
def test_rowsparse_validation(indices, data, shape, error):
    """RowSparse refuses bad index shapes, data shapes, out-of-range rows and float ids."""
    with pytest.raises(error):
        RowSparse(np.asarray(indices), np.asarray(data, np.float32), shape)


@pytest.mark.parametrize("indices", [[2, 0], [1, 1, 0], []])
def test_todense_sums_repeated_rows(indices):
    """todense puts each row in place and sums rows whose index repeats."""
    data = np.arange(len(indices) * 2, dtype=np.float32).reshape(-1, 2) + 1
    expected = np.zeros((3, 2), np.float32)
    for i, row in zip(indices, data):
        expected[i] += row
    assert np.array_equal(RowSparse(np.array(indices, np.int64), data, (3, 2)).todense(),
                          expected)


def test_from_dense_and_retain():
    """from_dense keeps nonzero rows (or given ones); retain gives sorted unique rows,
    zero-filled."""
    dense = np.array([[0, 0], [1, 2], [0, 0], [3, 0]], np.float32)
    r = RowSparse.from_dense(dense)
    assert r.indices.tolist() == [1, 3] and np.array_equal(r.todense(), dense)
    kept = r.retain(np.array([[3, 0], [3, 2]]))
    assert kept.indices.tolist() == [0, 2, 3]
    assert kept.data.tolist() == [[0, 0], [0, 0], [3, 0]]
    assert RowSparse.from_dense(dense, [2, 1, 1]).indices.tolist() == [1, 2]


# --------------------------------------------------------------- store vs MXNet
def test_pull_after_init_matches_mxnet():
    """row_sparse_pull after init returns MXNet's rows for unsorted, repeated ids."""
    kv = mxnet_store()
    out = RowSparse.zeros(SHAPE)
    kv.row_sparse_pull("w", out=out, row_ids=np.array(REF["pull_after_init"]["row_ids"]))
    assert out.indices.tolist() == REF["pull_after_init"]["indices"]
    assert out.data.tolist() == REF["pull_after_init"]["data"]


def _push_ref(kv):
    kv.push("w", [rsp(p["indices"], p["data"]) for p in REF["push"]])


def test_push_assign_matches_mxnet():
    """A row-sparse push without updater sums rows across devices and replaces the value."""
    kv = mxnet_store()
    _push_ref(kv)
    out = RowSparse.zeros(SHAPE)
    kv.row_sparse_pull("w", out=out, row_ids=np.array(REF["pull_after_push"]["row_ids"]))
    assert out.indices.tolist() == REF["pull_after_push"]["indices"]
    assert out.data.tolist() == REF["pull_after_push"]["data"]
    dense = np.zeros(SHAPE, np.float32)
    kv.pull("w", out=dense)
    assert dense.tolist() == REF["dense_pull_after_push"]


def test_updater_sees_merged_rows_like_mxnet():
    """The updater gets a RowSparse of sorted unique merged rows, as MXNet's does."""
    kv = mxnet_store()
    _push_ref(kv)
    seen = []

    def update(key, grad, weight):
        seen.append({"stype": "row_sparse", "indices": grad.indices.tolist(),
                     "data": grad.data.tolist()})
        weight += grad

    kv.set_updater(update)
    _push_ref(kv)
    assert seen == REF["updater_saw"]
    out = RowSparse.zeros(SHAPE)
    kv.row_sparse_pull("w", out=out, row_ids=np.arange(SHAPE[0]))
    assert out.indices.tolist() == REF["pull_after_updater_push"]["indices"]
    assert out.data.tolist() == REF["pull_after_updater_push"]["data"]


@pytest.mark.parametrize("ignore_sparse", [True, False])
def test_pull_ignore_sparse(ignore_sparse):
    """pull skips RowSparse outs with ignore_sparse=True and fills them whole otherwise."""
    kv = mxnet_store()
    _push_ref(kv)
    out = rsp([5], [[9, 9]])
    dense = np.zeros(SHAPE, np.float32)
    kv.pull("w", out=[out, dense], ignore_sparse=ignore_sparse)
    assert dense.tolist() == REF["dense_pull_after_push"]
    if ignore_sparse:
        assert out.indices.tolist() == REF["ignore_sparse_true_out"]["indices"]
        assert out.data.tolist() == REF["ignore_sparse_true_out"]["data"]
    else:
        assert out.todense().tolist() == REF["dense_pull_after_push"]


@pytest.mark.parametrize("shared", ["one array", "a list of one", False])
def test_row_ids_shared_or_one_per_out(shared):
    """One row_ids array may serve several outs (given bare, or as MXNet also takes it,
    as a list of one), or each out gets its own."""
    kv = mxnet_store()
    outs = [RowSparse.zeros(SHAPE) for _ in range(2)]
    ids = np.array(REF["shared_row_ids"]["row_ids"])
    row_ids = {"one array": ids, "a list of one": [ids]}.get(shared, [ids, np.array([5, 0])])
    kv.row_sparse_pull("w", out=outs, row_ids=row_ids)
    assert outs[0].indices.tolist() == REF["shared_row_ids"]["indices"][0]
    assert outs[1].indices.tolist() == (REF["shared_row_ids"]["indices"][1] if shared
                                        else [0, 5])


def test_duplicate_rows_within_one_push_are_summed():
    """Repeated indices inside one RowSparse push are summed (MXNet leaves this undefined)."""
    kv = gpukv.create("local")
    kv.init(0, np.zeros((4, 2), np.float32))
    kv.push(0, [rsp([1, 1, 0], np.ones((3, 2)), (4, 2)), rsp([1], [[5, 5]], (4, 2))])
    out = np.zeros((4, 2), np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [[1, 1], [7, 7], [0, 0], [0, 0]]


@pytest.mark.parametrize("repeats", [3, 9, 40])
def test_repeated_rows_are_summed_in_their_order(repeats):
    """coalesce adds a row's repeats one after the other, as the GPU does: 1 followed by
    2**-24s stays 1 (each addition rounds back), where adding the small ones first
    would not."""
    data = np.array([[1.0]] + [[2.0 ** -24]] * (repeats - 1), np.float32)
    got = RowSparse(np.zeros(repeats, np.int64), data, (2, 1)).coalesce()
    assert got.indices.tolist() == [0] and got.data.tolist() == [[1.0]]


def test_list_of_keys_and_fp16():
    """Lists of keys work, and fp16 rows are summed in float32 before the cast back."""
    kv = gpukv.create("local")
    kv.init(["a", "b"], [np.zeros((3, 1), np.float16), rsp([2], [[1]], (3, 1))])
    big = rsp([0], [[60000]], (3, 1), np.float16)
    kv.push(["a", "a"], [big, rsp([0], [[-59968]], (3, 1), np.float16)])
    outs = [RowSparse.zeros((3, 1), np.float16), RowSparse.zeros((3, 1))]
    kv.row_sparse_pull(["a", "b"], out=outs, row_ids=[np.array([0]), np.array([2, 1])])
    assert outs[0].data.tolist() == [[32.0]] and outs[0].dtype == np.float16
    assert outs[1].indices.tolist() == [1, 2] and outs[1].data.tolist() == [[0], [1]]


def test_optimizer_gets_row_sparse_gradient():
    """set_optimizer with row-sparse pushes updates the value as with the dense gradient."""
    kv = gpukv.create("local")
    kv.init(0, np.ones((4, 2), np.float32))
    from gpukv.optim import create
    kv.set_optimizer(create("sgd", learning_rate=0.5))
    kv.push(0, rsp([2], [[2, 2]], (4, 2)))
    out = np.zeros((4, 2), np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [[1, 1], [1, 1], [0, 0], [1, 1]]


@pytest.mark.parametrize("explicit_out", [False, True])
def test_pushpull_into_row_sparse_is_refused_before_pushing(explicit_out):
    """pushpull with RowSparse values and out=None (or RowSparse outs) is an
    ArgumentKindError naming the key, raised before anything is pushed: MXNet 1.9.1
    pushes and then leaves them unchanged, which hands back stale values silently."""
    kv = mxnet_store()
    values = [rsp(p["indices"], p["data"]) for p in REF["push"]]
    out = RowSparse.zeros(SHAPE) if explicit_out else None
    with pytest.raises(gpukv.ArgumentKindError,
                       match="key 'w': pushpull .*RowSparse .*row_sparse_pull"):
        kv.pushpull("w", values, out=out)
    assert [v.indices.tolist() for v in values] == [p["indices"] for p in REF["push"]]
    assert [v.data.tolist() for v in values] == [p["data"] for p in REF["push"]]
    dense = np.zeros(SHAPE, np.float32)
    kv.pull("w", out=dense)
    assert dense.tolist() == rsp(REF["init"]["indices"], REF["init"]["data"]).todense().tolist()
    kv.pushpull("w", values, out=dense)  # dense outs take the result, as in MXNet
    assert dense.tolist() == REF["dense_pull_after_push"]


def test_dense_updater_gets_rows_made_dense_on_the_key_stream(monkeypatch):
    """For an updater taking dense gradients, a GPU key's merged rows are made dense on
    the key's own stream (a virtual GPU's is not CuPy's current one), where it reads them."""
    from ..fake_gpu import FakeGpu
    log, current = [], {}
    kv = gpukv.create("local")
    kv.init("w", np.zeros((4, 2), np.float32))
    home = kv._entries["w"].home = FakeGpu(0, log, current, slot=1)
    streams, todense = [], RowSparse.todense

    def logged(self, dtype=None):
        streams.append(current.get("stream"))
        return todense(self, dtype)

    monkeypatch.setattr(RowSparse, "todense", logged)

    class DenseUpdater:
        def check(self, keys, stored):
            pass

        def update(self, keys, merged, stored, homes):
            for m, s in zip(merged, stored):
                s += m

    kv._updater = DenseUpdater()
    kv.push("w", rsp([2], [[1, 1]], (4, 2)))
    assert streams == [home.name]
    assert kv._entries["w"].value.tolist() == [[0, 0], [0, 0], [1, 1], [0, 0]]


# -------------------------------------------------------------------- errors
@pytest.mark.parametrize("call,error,words", [
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=np.array([6])),
     gpukv.ArgumentError, "'w'.*6"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=np.array([-1])),
     gpukv.ArgumentError, "'w'"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=np.array([0.5])),
     gpukv.DTypeError, "'w'"),
    (lambda kv, o: kv.row_sparse_pull("w", out=np.zeros(SHAPE), row_ids=np.array([0])),
     gpukv.ArgumentKindError, "'w'.*RowSparse"),
    (lambda kv, o: kv.row_sparse_pull("nope", out=o, row_ids=np.array([0])),
     gpukv.UnknownKeyError, "'nope'"),
    (lambda kv, o: kv.row_sparse_pull("w", out=RowSparse.zeros((6, 3)), row_ids=[0]),
     gpukv.ShapeError, "'w'"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o), gpukv.ArgumentError, "row_ids"),
    (lambda kv, o: kv.row_sparse_pull(["w", "w"], out=[o, o], row_ids=[[0], [9]]),
     gpukv.ArgumentError, "'w'.*9"),
    (lambda kv, o: kv.push("w", [rsp([0], [[1, 1]]), np.ones(SHAPE, np.float32)]),
     gpukv.ArgumentKindError, "'w'.*mixes"),
    (lambda kv, o: kv.push("w", rsp([0], [[1, 1]], (7, 2))), gpukv.ShapeError, "'w'"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=[1, 2.7]), gpukv.DTypeError, "'w'"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=[True]), gpukv.DTypeError, "'w'"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=[1, 2 ** 70]),
     gpukv.ArgumentKindError, "'w'"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=[1, [2]]),
     gpukv.ArgumentKindError, "'w'"),
    # a lone number, Python's or NumPy's: in MXNet's order it is the priority
    (lambda kv, o: kv.row_sparse_pull("w", o, 0), gpukv.ArgumentKindError,
     r"'w'.*got the number 0 \(one row is \[0\]\).*MXNet's takes priority"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=np.int32(3)),
     gpukv.ArgumentKindError, "'w'.*got the number 3"),
    (lambda kv, o: kv.row_sparse_pull(7, out=o, row_ids=[0]), gpukv.KeyKindError, "key 7"),
    (lambda kv, o: kv.row_sparse_pull(["w", 7], out=[o, o], row_ids=[[0], [0]]),
     gpukv.KeyKindError, "key 7"),
    (lambda kv, o: kv.row_sparse_pull("w", out=o, row_ids=[0], priority="high"),
     gpukv.ArgumentKindError, "'w'.*priority"),
    # MXNet's order, (key, out, priority, row_ids): the message says gpukv's
    (lambda kv, o: kv.row_sparse_pull("w", o, 0, np.array([1])),
     gpukv.ArgumentKindError, r"'w'.*got ndarray; row_sparse_pull takes \(key, out, "
                              r"row_ids, priority\), where MXNet's takes priority before"),
])
def test_errors_change_nothing(call, error, words):
    """Bad row_ids, out kinds, shapes and unknown keys raise typed errors; nothing changes."""
    kv = mxnet_store()
    out = rsp([4], [[7, 7]])
    with pytest.raises(error, match=words):
        call(kv, out)
    assert out.indices.tolist() == [4] and out.data.tolist() == [[7, 7]]
    dense = np.zeros(SHAPE, np.float32)
    kv.pull("w", out=dense)
    assert dense.tolist() == RowSparse(np.array([1, 3]), np.array([[1, 1], [3, 3]], np.float32),
                                       SHAPE).todense().tolist()


@pytest.mark.gpu
def test_gpu_row_sparse_roundtrip():
    """Row-sparse push and row_sparse_pull with CuPy arrays give the host results."""
    import cupy
    kv = gpukv.create("device")
    kv.init("w", RowSparse(cupy.array([1, 3]), cupy.array([[1, 1], [3, 3]], cupy.float32), SHAPE))
    kv.push("w", [RowSparse(cupy.asarray(p["indices"]), cupy.asarray(p["data"], cupy.float32),
                            SHAPE) for p in REF["push"]])
    out = RowSparse.zeros(SHAPE, xp=cupy)
    kv.row_sparse_pull("w", out=out, row_ids=cupy.array(REF["pull_after_push"]["row_ids"]))
    assert out.indices.get().tolist() == REF["pull_after_push"]["indices"]
    assert out.data.get().tolist() == REF["pull_after_push"]["data"]


# ------------------------------------------------ GPU code paths, on GPUs of their own
def _on_gpu(physical, array):
    """A copy of host `array` on GPU `physical`."""
    import cupy
    with cupy.cuda.Device(physical):
        return cupy.asarray(array)


@contextlib.contextmanager
def _reads_of_other_gpus_raise():
    """Any operation that reads another GPU's array raises: CuPy's ValueError without
    peer access, and its PerformanceWarning (made an error here) with it."""
    import cupy
    with warnings.catch_warnings():
        warnings.simplefilter("error", cupy._util.PerformanceWarning)
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint32",
                                   "int64", "uint64", "bool", "float16",
                                   pytest.param("bfloat16", marks=needs_bfloat16),
                                   "float32", "float64"])
def test_gpu_coalesce_sums_every_dtype(dtype):
    """The GPU row sum works for every dtype, those with no kernel of their own too (summed
    wider), and gives the host's bytes (integers wrap, bool rows are or-ed, 16-bit floats
    are summed in float32)."""
    if dtype == "bfloat16":
        dtype = __import__("ml_dtypes").bfloat16
    idx = np.array([3, 1, 3, 0, 3], np.int64)
    values = np.array([[100, 1], [1, 2], [100, 3], [4, 5], [100, -9]])
    big = {"int16": 30000, "uint16": 60000, "uint32": 4 * 10 ** 9}.get(np.dtype(dtype).name)
    if big is not None:  # sums that wrap in the dtype
        values[[0, 2, 4]] = big
    data = values.astype(dtype)
    got = RowSparse.trusted(_on_gpu(0, idx), _on_gpu(0, data), (5, 2)).coalesce()
    want = RowSparse.trusted(idx, data, (5, 2)).coalesce()
    assert got.indices.get().tolist() == want.indices.tolist() == [0, 1, 3]
    assert got.data.dtype == want.data.dtype == np.dtype(dtype)
    assert got.data.get().tobytes() == want.data.tobytes()


_DENSE = np.array([[0, 0], [1, 2], [0, 0], [3, 0]], np.float32)
_ON_GPU1 = {  # name: work on a RowSparse, a dense array and int32 row ids
    "init": lambda v, d, i: RowSparse(v.indices, v.data, v.shape),
    "init_int32": lambda v, d, i: RowSparse(i, v.data, v.shape),
    "init_list": lambda v, d, i: RowSparse([3, 0, 3], v.data, v.shape),
    "from_dense": lambda v, d, i: RowSparse.from_dense(d),
    "from_dense_ids": lambda v, d, i: RowSparse.from_dense(d, [3, 1, 3]),
    "from_dense_host_ids": lambda v, d, i: RowSparse.from_dense(d, np.array([3, 1])),
    "coalesce": lambda v, d, i: v.coalesce(),
    "coalesce_fp16": lambda v, d, i: v.coalesce(np.float16),
    "retain": lambda v, d, i: v.retain([3, 1]),
    "todense": lambda v, d, i: v.todense(),
    "copy": lambda v, d, i: v.copy(),
    "mul": lambda v, d, i: 2 * v,
    "neg": lambda v, d, i: -v,
}


@pytest.mark.gpu
@pytest.mark.parametrize("gpu", [1, 3], ids=["gpu1", "gpu3"])
@pytest.mark.parametrize("name", sorted(_ON_GPU1))
def test_gpu_rowsparse_work_runs_on_its_own_device(name, gpu):
    """A RowSparse on another GPU than the current one computes on its own GPU, reading
    no other GPU's memory (the emulation gives GPU 0 peer access to GPU 1, not to GPU 3),
    and its results live there, with the host's values."""
    import cupy
    physical_gpus(gpu + 1, f"needs {gpu + 1} physical GPUs")
    idx, data = np.array([3, 0, 3], np.int64), np.array([[1, 1], [2, 2], [3, 3]], np.float32)
    value = RowSparse.trusted(_on_gpu(gpu, idx), _on_gpu(gpu, data), (4, 2))
    with cupy.cuda.Device(0), _reads_of_other_gpus_raise():
        got = _ON_GPU1[name](value, _on_gpu(gpu, _DENSE), _on_gpu(gpu, idx.astype(np.int32)))
        assert cupy.cuda.Device().id == 0
    arrays = [got.indices, got.data] if isinstance(got, RowSparse) else [got]
    assert [a.device.id for a in arrays] == [gpu] * len(arrays)
    want = _ON_GPU1[name](RowSparse.trusted(idx, data, (4, 2)), _DENSE, idx.astype(np.int32))
    if isinstance(want, RowSparse):
        assert got.indices.get().tolist() == want.indices.tolist()
        assert got.data.dtype == want.data.dtype
        assert got.data.get().tolist() == want.data.tolist()
    else:
        assert got.get().tolist() == want.tolist()


@pytest.mark.gpu
def test_gpu_rowsparse_refuses_row_ids_of_another_gpu():
    """from_dense and retain take row ids on the data's GPU or the host, not another GPU."""
    physical_gpus(2, "needs 2 physical GPUs")
    value = RowSparse.trusted(_on_gpu(1, np.array([1])),
                              _on_gpu(1, np.ones((1, 2), np.float32)), (4, 2))
    ids = _on_gpu(0, np.array([1]))
    with pytest.raises(gpukv.ArgumentError, match="GPU 0 .* GPU 1"):
        value.retain(ids)
    with pytest.raises(gpukv.ArgumentError, match="GPU 0 .* GPU 1"):
        RowSparse.from_dense(_on_gpu(1, _DENSE), ids)


def test_gpu_merge_orders_after_and_before_source_devices(monkeypatch):
    """Row-sparse sources on other GPUs are read only after their devices' queued work,
    and those devices reuse them only after the home device has read them."""
    import gpukv.device
    from gpukv.encoding.sparse import merge

    from ..fake_gpu import FakeGpu
    log, current = [], {}
    home, other = FakeGpu(0, log, current), FakeGpu(1, log, current)
    a, b = rsp([1], [[1, 1]]), rsp([1, 2], [[2, 2], [3, 3]])
    where = {id(a.data): home, id(b.data): other}
    real = gpukv.device.device_of
    monkeypatch.setattr(gpukv.device, "device_of",
                        lambda x, slot=0: where.get(id(x)) or real(x, slot))
    merged = merge([a, b], home, np.float32)
    assert merged.indices.tolist() == [1, 2]
    assert merged.data.tolist() == [[3, 3], [3, 3]]
    assert ("wait_for", home.name, other.name) in log
    assert ("wait_event", other.name, home.name) in log  # (home's event for the call)
    assert log.index(("wait_for", home.name, other.name)) < log.index(
        ("record", home.name)) < log.index(("wait_event", other.name, home.name))


def _gpu_entry(log, current):
    from types import SimpleNamespace

    from ..fake_gpu import FakeGpu
    home = FakeGpu(0, log, current)
    value = np.arange(8, dtype=np.float32).reshape(4, 2)
    return SimpleNamespace(value=value, home=home)


def test_gpu_row_sparse_pull_into_host_out_waits_for_the_gather():
    """row_sparse_pull of a GPU key into a host RowSparse waits for the gather on the
    key's stream (a host copy reads on CuPy's current stream, not the key's)."""
    from gpukv.store import rows
    log, current = [], {}
    entry = _gpu_entry(log, current)
    out = RowSparse.zeros((4, 2))
    rows.fill_rows(entry, out, np.array([2, 0, 2]))
    assert out.indices.tolist() == [0, 2] and out.data.tolist() == [[0, 1], [4, 5]]
    assert ("synchronize", entry.home.name) in log


def test_gpu_row_sparse_pull_into_other_gpu_keeps_temporaries_alive():
    """Into a RowSparse on another GPU: the key's device waits for the copies before its
    gathered rows go back to its memory pool."""
    from gpukv.store import rows

    from ..fake_gpu import FakeGpu
    log, current = [], {}
    entry = _gpu_entry(log, current)
    target = FakeGpu(1, log, current)
    out = RowSparse.zeros((4, 2))
    mp = pytest.MonkeyPatch()
    mp.setattr(rows, "device_of", lambda a, slot=0: target)
    try:
        rows.fill_rows(entry, out, np.array([3]))
    finally:
        mp.undo()
    assert out.indices.tolist() == [3] and out.data.tolist() == [[6, 7]]
    last_copy = max(i for i, e in enumerate(log) if e == ("copy", target.name))
    assert ("wait_for", entry.home.name, target.name) in log[last_copy:]


def test_gpu_row_sparse_pull_orders_row_ids_of_another_gpu():
    """row_ids on another GPU are copied to the key's GPU only after the work queued on
    theirs, and their GPU may reuse them only once the copy has read them."""
    from gpukv.store import rows

    from ..fake_gpu import FakeGpu
    log, current = [], {}
    entry = _gpu_entry(log, current)
    other = FakeGpu(1, log, current)
    ids = np.array([3, 1, 3])
    entry.home.owns = lambda a: a is not ids  # the ids live on `other`
    out = RowSparse.zeros((4, 2))
    mp = pytest.MonkeyPatch()
    mp.setattr(rows, "device_of",
               lambda a, slot=0: other if a is ids else gpukv.device.device_of(a, slot))
    try:
        rows.fill_rows(entry, out, ids)
    finally:
        mp.undo()
    assert out.indices.tolist() == [1, 3] and out.data.tolist() == [[2, 3], [6, 7]]
    copy = log.index(("copy", entry.home.name))
    assert ("wait_for", entry.home.name, other.name) in log[:copy]
    assert ("wait_for", other.name, entry.home.name) in log[copy:]


def test_row_ids_on_a_device_gpukv_cannot_use_name_the_key():
    """row_ids on a device this process cannot use are a DeviceError naming the key."""
    torch = pytest.importorskip("torch")
    kv = mxnet_store()
    out = rsp([4], [[7, 7]])
    with pytest.raises(gpukv.DeviceError, match="key 'w': row_ids: .*'meta'"):
        kv.row_sparse_pull("w", out=out, row_ids=torch.zeros(2, dtype=torch.int64, device="meta"))
    assert out.indices.tolist() == [4]


@pytest.mark.parametrize("why", ["sharded", "deleted"])
def test_row_ids_their_library_will_not_hand_over_name_the_key(why):
    """row_ids whose own library refuses to hand them over (JAX's sharded or deleted
    arrays): an ArgumentKindError naming the key, quoting that error; nothing changes."""
    from ..foreign import RefusingDLPack
    kv = mxnet_store()
    out = rsp([4], [[7, 7]])
    with pytest.raises(gpukv.ArgumentKindError,
                       match="key 'w': row_ids: cannot be read as an array: "
                             "(BufferError|TypeError)"):
        kv.row_sparse_pull("w", out=out, row_ids=RefusingDLPack(why))
    assert out.indices.tolist() == [4]


def _add_into(key, merged, stored):
    stored += merged.todense()


@pytest.mark.parametrize("updater", [None, "sgd", "fn"])
@pytest.mark.parametrize("rows", [(1, 4), (1, 1), (1,), (1, 3, 1)])
def test_rows_replaced_by_rows_of_another_shape_are_refused_before_anything(updater, rows):
    """A RowSparse whose `data` was replaced after it was built (a gradient object
    reused) by rows of another shape is a ShapeError naming the key: no rows that
    NumPy would broadcast, and no key of the call changed."""
    kv = gpukv.create("device")
    kv.init([1, 2], [np.zeros((5, 3), np.float32)] * 2)
    if updater == "sgd":
        kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.5))
    elif updater == "fn":
        kv._set_updater(_add_into)
    good = RowSparse(np.array([0]), np.ones((1, 3), np.float32), (5, 3))
    bad = RowSparse(np.array([0]), np.ones((1, 3), np.float32), (5, 3))
    bad.data = np.full(rows, 7, np.float32)
    with pytest.raises(gpukv.ShapeError, match=r"key 2: push: RowSparse of shape \(5, 3\): "
                                               r"data for 1 row\(s\) must have shape "
                                               r"\(1, 3\)"):
        kv.push([1, 2], [good, bad])
    for key in (1, 2):
        out = np.ones((5, 3), np.float32)
        kv.pull(key, out=out)
        np.testing.assert_array_equal(out, 0)
    with pytest.raises(gpukv.ShapeError, match="key 3: init"):
        kv.init(3, bad)


def test_row_sparse_zeros_takes_an_int_shape_and_refuses_a_bool():
    """`RowSparse.zeros(5)` is one dimension of 5, as NumPy's `zeros(5)`; a bool is no
    row count."""
    assert RowSparse.zeros(5).shape == (5,)
    with pytest.raises(gpukv.ArgumentKindError, match="non-negative ints"):
        RowSparse.zeros((True, 2))
    for bad in ("5", (3, -1), (3, 2.5)):
        with pytest.raises(gpukv.ArgumentKindError, match="non-negative ints"):
            RowSparse.zeros(bad)


def test_a_row_sparse_has_no_dense_array_to_share():
    """NumPy 2's `copy=False` asks for no copy, which a RowSparse cannot give: a
    ValueError, as NumPy's own arrays raise, and gpukv's ArgumentError (one of its errors,
    as every error it raises on purpose); `np.asarray` makes the dense copy."""
    rows = RowSparse(np.array([1]), np.ones((1, 2), np.float32), (3, 2))
    np.testing.assert_array_equal(np.asarray(rows), [[0, 0], [1, 1], [0, 0]])
    with pytest.raises(gpukv.ArgumentError, match="always a copy") as raised:
        np.array(rows, copy=False)
    assert isinstance(raised.value, ValueError)

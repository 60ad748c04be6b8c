"""The core API on CuPy arrays and CUDA tensors, on real GPUs or the CUDA emulation (the GPU
gate of tests/gpu_gate.py decides). Several logical devices come from the GPUs or
GPUKV_VIRTUAL_GPUS."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import gpukv

from ..bfloat16 import needs_bfloat16
from ..foreign import CudaInterfaceOnly, DLPackOnly, cuda_tensor_values, torch_cuda_tensor
from ..gpu_gate import hardware_missing

pytestmark = pytest.mark.gpu

REF = json.loads((pathlib.Path(__file__).parents[1] / "data" / "mxnet_reference.json").read_text())
SHAPE = (2, 3)


@pytest.fixture
def cp():
    """CuPy, imported only once the GPU gate in conftest has let the test run."""
    import cupy
    return cupy


@pytest.fixture
def devices():
    """The logical GPUs gpukv sees: (physical id, slot) of each."""
    from gpukv.device.cuda.device import gpu_devices
    return [(d.physical, d.slot) for d in gpu_devices()]


def on(cp, physical, make):
    with cp.cuda.Device(physical):
        return make()


def spread(cp, devices, n, value=1.0, shape=SHAPE, dtype=np.float32):
    """n arrays filled with value, dealt round-robin over the logical devices."""
    return [on(cp, devices[i % len(devices)][0], lambda: cp.full(shape, value, dtype=dtype))
            for i in range(n)]


def host(cp, a):
    return cp.asnumpy(a)


@pytest.fixture(params=["device", "local"])
def name(request):
    return request.param


# ------------------------------------------------------------------------------ tutorial
def test_tutorial_on_gpus(cp, devices, name, capsys):
    """The tutorial with CuPy arrays over the GPUs gives MXNet's numbers and lines."""
    expected = REF["tutorial"]["values"]
    kv = gpukv.create(name)
    shape = SHAPE
    g0 = devices[0][0]
    kv.init(3, on(cp, g0, lambda: cp.ones(shape) * 2))
    a = on(cp, g0, lambda: cp.zeros(shape))
    kv.pull(3, out=a)
    assert host(cp, a).tolist() == expected["after_init"]
    kv.push(3, on(cp, g0, lambda: cp.ones(shape) * 8))
    kv.pull(3, out=a)
    assert host(cp, a).tolist() == expected["after_push"]
    b = spread(cp, devices, 4, dtype=np.float64)
    kv.push(3, b)
    kv.pull(3, out=a)
    assert host(cp, a).tolist() == expected["after_device_push"]

    def update(key, input, stored):
        print(f"update on key: {key}")
        stored += input * 2

    kv.set_updater(update)
    kv.pull(3, out=a)
    assert host(cp, a).tolist() == expected["after_set_updater"]
    kv.push(3, on(cp, g0, lambda: cp.ones(shape)))
    kv.pull(3, out=a)
    assert host(cp, a).tolist() == expected["after_updater_push"]
    b = spread(cp, devices, 4, dtype=np.float64)
    kv.pull(3, out=b)
    assert [host(cp, x).tolist() for x in b] == expected["pull_to_devices"]
    keys = [5, 7, 9]
    kv.init(keys, [on(cp, g0, lambda: cp.ones(shape))] * len(keys))
    kv.push(keys, [on(cp, g0, lambda: cp.ones(shape))] * len(keys))
    b = [on(cp, g0, lambda: cp.zeros(shape)) for _ in keys]
    kv.pull(keys, out=b)
    assert [host(cp, x).tolist() for x in b] == expected["list_pull"]
    b = [spread(cp, devices, 4, dtype=np.float64) for _ in keys]
    kv.push(keys, b)
    kv.pull(keys, out=b)
    assert [[host(cp, x).tolist() for x in row] for row in b] == expected["list_device_pull"]
    assert capsys.readouterr().out.splitlines() == REF["tutorial"]["printed"]


def test_tutorial_several_arrays_on_one_gpu(cp, name):
    """Several arrays on GPU 0 count as several devices and are summed."""
    kv = gpukv.create(name)
    kv.init(3, cp.zeros(SHAPE, cp.float32))
    kv.push(3, [cp.ones(SHAPE, cp.float32) for _ in range(4)])
    outs = [cp.zeros(SHAPE, cp.float32) for _ in range(3)]
    kv.pull(3, out=outs)
    assert all((host(cp, o) == 4).all() for o in outs)


# ---------------------------------------------------------------------- API on CuPy arrays
@pytest.mark.parametrize("n", [1, 2, 5])
def test_gpu_push_device_list_sums(cp, devices, name, n):
    """A push of n GPU arrays spread over devices stores their sum."""
    kv = gpukv.create(name)
    kv.init("w", cp.zeros(SHAPE, cp.float32))
    kv.push("w", [on(cp, devices[i % len(devices)][0],
                     lambda i=i: cp.full(SHAPE, i + 1, cp.float32)) for i in range(n)])
    out = cp.zeros(SHAPE, cp.float32)
    kv.pull("w", out=out)
    assert (host(cp, out) == n * (n + 1) / 2).all()


def test_gpu_list_of_keys_with_device_lists(cp, devices, name):
    """A list of keys with per-key device lists reduces each key (MXNet's aggregator test)."""
    unit = REF["kvstore_unittests"]["aggregator/local/int"]
    kv = gpukv.create(name)
    kv.init([5, 7, 11], [cp.zeros((4, 4), cp.float32)] * 3)
    vals = [spread(cp, devices, 4, 2.0, (4, 4)) for _ in range(3)]
    kv.push([5, 7, 11], vals)
    kv.pull([5, 7, 11], out=vals)
    assert [[float(host(cp, v).ravel()[0]) for v in vv] for vv in vals] == unit["list"]


def test_gpu_updater_gets_gpu_arrays_on_device_store(cp):
    """On a 'device' store the updater gets CuPy arrays and edits stored in place."""
    kv = gpukv.create("device")
    kv.init(1, cp.ones(SHAPE, cp.float32))
    kinds = []

    def update(key, merged, stored):
        kinds.append((type(merged).__module__.split(".")[0], type(stored).__module__.split(".")[0]))
        stored += merged

    kv.set_updater(update)
    kv.push(1, [cp.ones(SHAPE, cp.float32)] * 3)
    out = cp.zeros(SHAPE, cp.float32)
    kv.pull(1, out=out)
    assert (host(cp, out) == 4).all()
    assert kinds == [("cupy", "cupy")]


def test_gpu_pull_into_an_adopted_value(cp, devices):
    """A 'device' store that adopted a GPU array updates it in place on its GPU; a pull
    into it and another GPU's array writes the other, and leaves it as updated."""
    kv = gpukv.create("device")
    physical = devices[-1][0]
    weight = on(cp, physical, lambda: cp.arange(6, dtype=cp.float32).reshape(SHAPE))
    kv.adopt(["w"], [weight])
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.5))
    kv.push("w", spread(cp, devices, 2, 1.0))
    expected = np.arange(6, dtype=np.float32).reshape(SHAPE) - 1.0
    np.testing.assert_array_equal(host(cp, weight), expected)
    other = on(cp, devices[0][0], lambda: cp.full(SHAPE, -7.0, cp.float32))
    kv.pull("w", out=[weight, other])
    np.testing.assert_array_equal(host(cp, other), expected)
    np.testing.assert_array_equal(host(cp, weight), expected)
    kv.pull("w", out=weight)
    np.testing.assert_array_equal(host(cp, weight), expected)


def test_a_pull_into_the_adopted_value_under_another_stream_follows_the_push(cp):
    """A pull whose out is the key's adopted value itself copies nothing, but still
    orders the caller's current stream after the push that wrote the value, when the
    push ran under another stream (the race checker sees a read that overtakes it)."""
    kv = gpukv.create("device", strategy="home")
    value = cp.zeros(1 << 12, cp.float32)
    kv.adopt(["w"], [value])
    first, second = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with first:
        kv.push("w", cp.ones(1 << 12, cp.float32))
    with second:
        kv.pull("w", out=value)
        doubled = value * 2
        second.synchronize()
    np.testing.assert_array_equal(host(cp, doubled), 2.0)


def test_gpu_pushpull_in_place(cp, devices, name):
    """pushpull without out writes the reduced value back into every GPU array."""
    kv = gpukv.create(name)
    kv.init(1, cp.zeros(SHAPE, cp.float32))
    values = spread(cp, devices, 3, 2.0)
    kv.pushpull(1, values)
    assert all((host(cp, v) == 6).all() for v in values)


def test_gpu_broadcast(cp, devices, name):
    """broadcast initialises a key from a GPU array and fills outs on every device."""
    kv = gpukv.create(name)
    outs = spread(cp, devices, 3, 0.0)
    kv.broadcast(1, cp.full(SHAPE, 5, cp.float32), out=outs)
    assert all((host(cp, o) == 5).all() for o in outs)


def test_gpu_and_host_arrays_mix(cp, name):
    """One push may mix NumPy and CuPy arrays; pulls fill both kinds."""
    kv = gpukv.create(name)
    kv.init(1, np.zeros(SHAPE, np.float32))
    kv.push(1, [np.ones(SHAPE, np.float32), cp.full(SHAPE, 2, cp.float32)])
    outs = [np.zeros(SHAPE, np.float32), cp.zeros(SHAPE, cp.float32)]
    kv.pull(1, out=outs)
    assert (outs[0] == 3).all() and (host(cp, outs[1]) == 3).all()


def test_local_store_keeps_gpu_keys_on_host(cp):
    """A 'local' store takes GPU arrays, reduces on the host and pulls back into GPU arrays."""
    kv = gpukv.create("local")
    kv.init(1, cp.zeros(SHAPE, cp.float32))
    kv.push(1, [cp.ones(SHAPE, cp.float32)] * 2)
    out = cp.zeros(SHAPE, cp.float32)
    kv.pull(1, out=out)
    assert (host(cp, out) == 2).all()


def test_gpu_push_does_not_alias(cp, name):
    """Changing a pushed GPU array afterwards (on the current stream) changes nothing."""
    kv = gpukv.create(name)
    kv.init(1, cp.zeros(SHAPE, cp.float32))
    x = cp.full(SHAPE, 3, cp.float32)
    kv.push(1, x)
    x.fill(77)
    out = cp.zeros(SHAPE, cp.float32)
    kv.pull(1, out=out)
    assert (host(cp, out) == 3).all()


def test_gpu_results_are_ordered_on_current_stream(cp, name):
    """Work queued on CuPy's current stream after a pull sees the pulled values."""
    kv = gpukv.create(name)
    kv.init(1, cp.zeros((1 << 20,), cp.float32))
    kv.push(1, [cp.ones((1 << 20,), cp.float32)] * 4)
    out = cp.zeros((1 << 20,), cp.float32)
    kv.pull(1, out=out)
    total = out.sum()  # on the current stream, no explicit synchronisation
    assert float(total) == 4 * (1 << 20)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "uint8"])
def test_gpu_dtypes(cp, name, dtype):
    """Every supported dtype round-trips on GPU arrays."""
    kv = gpukv.create(name)
    kv.init(1, cp.zeros(SHAPE, dtype))
    kv.push(1, [cp.ones(SHAPE, dtype)] * 3)
    out = cp.zeros(SHAPE, dtype)
    kv.pull(1, out=out)
    assert out.dtype == np.dtype(dtype) and (host(cp, out) == 3).all()


def test_gpu_fp16_summed_in_float32(cp, devices, name):
    """fp16 pushes 60000, 60000, -60000, -60000 on GPUs give 0, and the updater sees float32."""
    kv = gpukv.create(name)
    kv.init(0, cp.zeros(SHAPE, cp.float16))
    pushes = [on(cp, devices[i % len(devices)][0], lambda s=s: cp.full(SHAPE, s, cp.float16))
              for i, s in enumerate((60000, 60000, -60000, -60000))]
    kv.push(0, pushes)
    out = cp.zeros(SHAPE, cp.float16)
    kv.pull(0, out=out)
    assert (host(cp, out) == 0).all()
    seen = []
    kv.set_updater(lambda k, m, s: (seen.append(m.dtype), s.__setitem__(Ellipsis, m / 2)))
    kv.push(0, pushes[:2])
    kv.pull(0, out=out)
    assert seen == [np.dtype(np.float32)] and (host(cp, out) == 60000).all()


@pytest.mark.parametrize("strategy", ["auto", "home", "tree", "ring", "cpu", "nccl"])
def test_gpu_strategies_agree(cp, devices, strategy):
    """Every strategy of a 'device' store gives the same sum over every logical GPU."""
    try:
        kv = gpukv.create("device", strategy=strategy)
    except gpukv.BackendError as exc:  # e.g. NCCL missing from this CuPy build
        hardware_missing(str(exc))
    kv.init([1, 2], [cp.zeros((1000,), cp.float32), cp.zeros(SHAPE, cp.float32)])
    big = [on(cp, d[0], lambda i=i: cp.full((1000,), i + 1, cp.float32))
           for i, d in enumerate(devices)]
    small = spread(cp, devices, len(devices), 1.0)
    kv.push([1, 2], [big, small])
    outs = [spread(cp, devices, len(devices), 0.0, (1000,)), spread(cp, devices, 2, 0.0)]
    kv.pull([1, 2], out=outs)
    n = len(devices)
    assert all((host(cp, o) == n * (n + 1) / 2).all() for o in outs[0])
    assert all((host(cp, o) == n).all() for o in outs[1])


@pytest.mark.parametrize("strategy", ["home", "tree", "ring", "cpu", "auto"])
@pytest.mark.parametrize("call", ["pull", "repeated key", "pushpull in place"])
def test_one_out_given_twice_for_a_key_is_written_once(cp, devices, strategy, call):
    """An out given twice for one key (one array twice in `out`, or in a pushpull's
    values) is written once: two copies into it on two streams would race (the race
    checker named them), for the same value."""
    kv = gpukv.create("device", strategy=strategy)
    kv.init(0, on(cp, devices[0][0], lambda: cp.full(SHAPE, 3, cp.float32)))
    y = on(cp, devices[-1][0], lambda: cp.ones(SHAPE, cp.float32))
    if call == "pull":
        kv.pull(0, out=[y, y])
    elif call == "repeated key":
        kv.pull([0, 0], out=[y, y])
    else:
        kv.pushpull(0, [y, y])
    assert (host(cp, y) == (2 if call == "pushpull in place" else 3)).all()


def test_two_keys_pulled_into_one_gpu_array_are_refused(cp, devices):
    """Which of two keys' values would land last in one GPU out is not defined (on the
    host the later key's does, as in call order): an ArgumentError naming both keys,
    before anything is written."""
    kv = gpukv.create("device")
    kv.init([0, 1], [on(cp, devices[0][0], lambda: cp.full(SHAPE, 3, cp.float32)),
                     on(cp, devices[-1][0], lambda: cp.full(SHAPE, 5, cp.float32))])
    y = on(cp, devices[-1][0], lambda: cp.ones(SHAPE, cp.float32))
    with pytest.raises(gpukv.ArgumentError, match="key 1: its out is key 0's out too"):
        kv.pull([0, 1], out=[y, y])
    assert (host(cp, y) == 1).all()
    kv.init([2, 3], [cp.zeros(0, cp.float32), cp.zeros(0, cp.float32)])
    kv.pull([2, 3], out=[cp.zeros(0, cp.float32), cp.zeros(0, cp.float32)])  # (no memory)


def test_gpu_errors_change_nothing(cp, name):
    """A shape mismatch among GPU arrays is a ShapeError and the key keeps its value."""
    kv = gpukv.create(name)
    kv.init(1, cp.full(SHAPE, 2, cp.float32))
    with pytest.raises(gpukv.ShapeError) as info:
        kv.push(1, [cp.ones(SHAPE, cp.float32), cp.ones((3, 2), cp.float32)])
    assert isinstance(info.value, ValueError) and str(info.value).startswith("key 1:")
    out = cp.zeros(SHAPE, cp.float32)
    kv.pull(1, out=out)
    assert (host(cp, out) == 2).all()


def test_missing_device_is_device_error():
    """Asking for a GPU that does not exist is a DeviceError (a ValueError)."""
    from gpukv.device.cuda.device import cuda_device, gpu_count
    with pytest.raises(gpukv.DeviceError) as info:
        cuda_device(gpu_count() + 7)
    assert isinstance(info.value, ValueError)


# ------------------------------------------------------------------ protocols on the GPU
@pytest.mark.parametrize("wrap", [CudaInterfaceOnly, DLPackOnly], ids=lambda w: w.__name__)
def test_gpu_protocol_objects(cp, name, wrap):
    """GPU objects exposing only one protocol are sources and outs written in place."""
    kv = gpukv.create(name)
    kv.init(1, wrap(cp.zeros(SHAPE, cp.float32)))
    kv.push(1, [wrap(cp.ones(SHAPE, cp.float32)), wrap(cp.full(SHAPE, 2, cp.float32))])
    backing = cp.zeros(SHAPE, cp.float32)
    kv.pull(1, out=wrap(backing))
    assert (host(cp, backing) == 3).all()


def test_torch_cuda_tensors_in_place(cp, name):
    """CUDA tensors are pushed without copies and pulled into in place."""
    pytest.importorskip("torch")

    def tensor(value):
        return torch_cuda_tensor(cp.full(SHAPE, value, cp.float32))

    kv = gpukv.create(name)
    kv.init(1, tensor(0.0))
    kv.push(1, [tensor(1.0), tensor(2.0)])
    out = tensor(0.0)
    pointer = out.data_ptr()
    kv.pull(1, out=out)
    assert out.data_ptr() == pointer
    np.testing.assert_array_equal(cuda_tensor_values(out), np.full(SHAPE, 3.0))
    grads = [tensor(1.0) for _ in range(3)]
    kv.pushpull(1, grads)
    assert all((cuda_tensor_values(g) == 3.0).all() for g in grads)


@needs_bfloat16
def test_torch_cuda_bfloat16_adopted_through_dlpack(cp, name):
    """A bfloat16 CUDA tensor keeps its dtype and memory: it is adopted through DLPack,
    not through the CUDA array interface, where bfloat16 is a raw 2-byte void."""
    pytest.importorskip("torch")
    import ml_dtypes

    from gpukv.device import adopt
    bf16 = np.dtype(ml_dtypes.bfloat16)
    backing = cp.full(SHAPE, 1.5, bf16)
    adopted = adopt(torch_cuda_tensor(backing))
    assert adopted.dtype == bf16 and adopted.data.ptr == backing.data.ptr
    kv = gpukv.create(name)
    kv.init("w", cp.zeros(SHAPE, bf16))
    kv.push("w", [torch_cuda_tensor(cp.full(SHAPE, 1.5, bf16)) for _ in range(2)])
    out = torch_cuda_tensor(cp.zeros(SHAPE, bf16))
    kv.pull("w", out=out)
    np.testing.assert_array_equal(cuda_tensor_values(out), np.full(SHAPE, 3.0, bf16))


def test_calls_from_another_thread(cp, devices, name):
    """A push and pull issued from a thread other than the main one (as a Trainer's
    early reductions are), whose current device is 0 whatever the main thread's: the
    same values as from the main thread."""
    import threading
    results = {}

    def train(where):
        kv = gpukv.create(name)
        kv.init(["w", "v"], [cp.zeros((4, 5), cp.float32), cp.zeros(3, cp.float32)])
        kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.5, momentum=0.9))
        outs = spread(cp, devices, 3, 0.0, (4, 5))
        for step in range(3):
            grads = [spread(cp, devices, 3, step + 1.0, (4, 5)),
                     spread(cp, devices, 3, -step, (3,))]
            kv.push(["w", "v"], grads)
        kv.pull("w", out=outs)
        results[where] = [host(cp, o) for o in outs]

    with cp.cuda.Device(devices[-1][0]):
        worker = threading.Thread(target=train, args=("thread",))
        worker.start()
        worker.join(timeout=120)
    train("main")
    assert set(results) == {"thread", "main"}
    for a, b in zip(results["thread"], results["main"]):
        np.testing.assert_array_equal(a, b)
    assert not np.all(results["main"][0] == 0)

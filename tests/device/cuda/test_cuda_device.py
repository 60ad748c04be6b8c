"""The CUDA backend: virtual GPUs, peer access bookkeeping, streams and events."""
from __future__ import annotations

import collections
import logging

import numpy as np
import pytest

import gpukv
from gpukv import DeviceError
from gpukv.device.cuda import device as cuda_mod

from ... import gpu_env
from ...gpu_gate import hardware_missing


class _FakeRuntime:
    """Stands in for cupy.cuda.runtime: peer access allowed only between 0 and 1."""

    class CUDARuntimeError(Exception):
        def __init__(self, status):
            super().__init__(status)
            self.status = status

    def __init__(self):
        self.enabled = []
        self.current = 0

    def deviceCanAccessPeer(self, a, b):
        return int({a, b} == {0, 1})

    def deviceEnablePeerAccess(self, peer):
        if (self.current, peer) in self.enabled:
            raise self.CUDARuntimeError(704)
        self.enabled.append((self.current, peer))


class _FakeDevice:
    def __init__(self, runtime, i):
        self.runtime, self.i = runtime, i

    def __enter__(self):
        self.runtime.current = self.i

    def __exit__(self, *exc):
        self.runtime.current = 0


@pytest.fixture
def fake_cuda(monkeypatch):
    import types
    runtime = _FakeRuntime()
    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda i: _FakeDevice(runtime, i))
    fake = types.SimpleNamespace(cuda=cuda)
    monkeypatch.setattr(cuda_mod, "cupy_module", lambda: fake)
    monkeypatch.setattr(cuda_mod, "_peer", {})
    monkeypatch.setattr(cuda_mod, "_peer_logged", set())
    return runtime


def test_peer_access_enabled_once_per_pair(fake_cuda):
    """Peer access is enabled once per (reader, owner) pair and then remembered."""
    assert cuda_mod.can_access_peer(0, 1)
    assert cuda_mod.can_access_peer(0, 1)
    assert cuda_mod.can_access_peer(1, 0)
    assert fake_cuda.enabled == [(0, 1), (1, 0)]
    assert cuda_mod.can_access_peer(2, 2)


def test_peer_access_already_enabled_is_fine(fake_cuda):
    """A pair CuPy enabled first (error 704) still counts as accessible."""
    fake_cuda.enabled.append((0, 1))
    assert cuda_mod.can_access_peer(0, 1)


def test_missing_peer_pairs_logged_together(fake_cuda, caplog):
    """Pairs without peer access are listed in one log line, once."""
    with caplog.at_level(logging.INFO, logger="gpukv"):
        table = cuda_mod.enable_peer_access([0, 1, 2])
        cuda_mod.enable_peer_access([0, 1, 2])
    assert table[(0, 1)] and not table[(0, 2)] and not table[(2, 1)]
    lines = [r.getMessage() for r in caplog.records if "no peer access" in r.getMessage()]
    assert lines and "0->2" in " ".join(lines)
    assert sum(line.count("0->2") for line in lines) == 1


class _FakeStream:
    """A CuPy stream: `device` -1 is the default stream, one object for every GPU
    (CuPy's `Stream.null`), whose work goes to the current device's default stream."""

    def __init__(self, cuda, name, device):
        self.cuda, self.name, self.device = cuda, name, device

    def _on(self):
        return self.cuda.current if self.device == -1 else self.device

    def record(self, event=None):
        return ("event", self.name, self._on())

    def wait_event(self, event):
        self.cuda.log.append(("wait", self.name, self._on(), event))

    def synchronize(self):
        self.cuda.log.append(("sync", self.name, self._on()))

    def __enter__(self):
        dev = self._on()
        self.cuda.stack.append((dev, self.cuda.streams.get(dev)))
        self.cuda.streams[dev] = self

    def __exit__(self, *exc):
        dev, prev = self.cuda.stack.pop()
        if prev is None:
            del self.cuda.streams[dev]
        else:
            self.cuda.streams[dev] = prev


class _FakeCuda:
    """cupy.cuda's stream/device surface over `n` GPUs, logging waits and syncs."""

    def __init__(self, n):
        import types
        self.current, self.log, self.stack, self.streams = 0, [], [], {}
        self.runtime = types.SimpleNamespace(getDeviceCount=lambda: n)
        self.null = _FakeStream(self, "null", -1)
        self.Event = lambda disable_timing=False: None  # recorded through the stream

    def get_current_stream(self, device_id=-1):
        return self.streams.get(self.current if device_id == -1 else device_id, self.null)

    def Stream(self, non_blocking=False):  # noqa: N802 - mirrors cupy.cuda.Stream
        return _FakeStream(self, f"s{len(self.log)}-{self.current}", self.current)

    def Device(self, i):  # noqa: N802 - mirrors cupy.cuda.Device
        cuda = self

        class _Ctx:  # re-entrant, as CuPy's Device keeps a stack of previous devices
            def __init__(self):
                self.prev = []

            def __enter__(self):
                self.prev.append(cuda.current)
                cuda.current = i

            def __exit__(self, *exc):
                cuda.current = self.prev.pop()

        return _Ctx()


@pytest.fixture
def fake_cupy(monkeypatch):
    import types
    cuda = _FakeCuda(2)

    class _Array:
        def fill(self, value):
            cuda.log.append(("fill", cuda.current, cuda.get_current_stream().name))

    fake = types.SimpleNamespace(cuda=cuda, empty=lambda shape, dtype: _Array())
    monkeypatch.setattr(cuda_mod, "cupy_module", lambda: fake)
    return cuda


def test_default_streams_of_two_gpus_wait_through_an_event(fake_cupy):
    """Slot 0 of two GPUs, both on CuPy's default stream object, still waits on an event."""
    a, b = cuda_mod.CudaDevice(0), cuda_mod.CudaDevice(1)
    assert a.stream is b.stream  # CuPy's one `Stream.null` object for both GPUs
    b.wait_for(a)
    assert fake_cupy.log == [("wait", "null", 1, ("event", "null", 0))]


def test_synchronize_waits_for_its_own_gpu(fake_cupy):
    """synchronize() of GPU 1 waits for GPU 1's default stream, whatever device is current."""
    cuda_mod.CudaDevice(1).synchronize()
    assert fake_cupy.log == [("sync", "null", 1)]


def test_zeros_filled_on_the_slot_stream(fake_cupy):
    """zeros() on a virtual GPU is filled under its GPU, on its own stream."""
    d = cuda_mod.CudaDevice(1, 1)
    d.zeros(4, np.float32)
    assert fake_cupy.log == [("fill", 1, d.stream.name)]


def test_activate_makes_the_gpu_and_the_slot_stream_current(fake_cupy):
    """Inside `activate()` a virtual GPU's device and its own stream are current (CuPy
    work there is queued on its stream); afterwards the caller's are current again."""
    d = cuda_mod.CudaDevice(1, 1)
    with d.activate():
        assert fake_cupy.current == 1
        assert fake_cupy.get_current_stream() is d.stream
    assert fake_cupy.current == 0 and fake_cupy.get_current_stream() is fake_cupy.null


def test_virtual_gpus_env(monkeypatch):
    """GPUKV_VIRTUAL_GPUS deals N logical devices round-robin onto the physical ones."""
    made = []
    monkeypatch.setattr(cuda_mod, "gpu_count", lambda: 2)
    monkeypatch.setattr(cuda_mod, "cuda_device", lambda p, s=0: made.append((p, s)) or (p, s))
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", "5")
    assert cuda_mod.gpu_devices() == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", "zero")
    with pytest.raises(DeviceError, match="GPUKV_VIRTUAL_GPUS"):
        cuda_mod.gpu_devices()
    monkeypatch.setattr(cuda_mod, "gpu_count", lambda: 0)
    assert cuda_mod.gpu_devices() == []


# ----------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_virtual_slots_have_own_streams():
    """Slot 0 uses CuPy's current stream; every other slot owns a distinct stream."""
    import cupy
    d0 = cuda_mod.cuda_device(0, 0)
    d1 = cuda_mod.cuda_device(0, 1)
    d2 = cuda_mod.cuda_device(0, 2)
    assert d0.stream.ptr == cupy.cuda.get_current_stream(0).ptr
    assert len({d0.stream.ptr, d1.stream.ptr, d2.stream.ptr}) == 3


@pytest.mark.gpu
def test_wait_for_orders_streams_without_host_sync():
    """Work on a virtual slot sees data written on another slot's stream via events."""
    import cupy
    a = cuda_mod.cuda_device(0, 1)
    b = cuda_mod.cuda_device(0, 2)
    x = a.empty((1 << 22,), cupy.float32)
    with a.cuda_device, a.stream:
        x.fill(3)
    b.wait_for(a)
    y = b.empty(x.shape, x.dtype)
    b.copy(y, x)
    b.leave()  # the current stream now waits for b
    assert float(y.sum()) == 3.0 * (1 << 22)


@pytest.mark.gpu
def test_wait_for_covers_work_queued_under_a_stream_no_longer_current():
    """A GPU's slot-0 device queues on CuPy's current stream; work it queued (and
    recorded) under another current stream still orders a later `wait_for` of it."""
    import cupy
    a, b = cuda_mod.cuda_device(0), cuda_mod.cuda_device(0, 1)
    x = a.empty((1 << 16,), cupy.float32)
    with a.cuda_device:
        side = cupy.cuda.Stream(non_blocking=True)
        side.wait_event(cuda_mod.ordering_event(cupy.cuda.get_current_stream()))
    with a.cuda_device, side:
        x.fill(5)
        a.record()  # a's last work: on `side`
    b.wait_for(a)  # a's stream is the default one again
    y = b.empty(x.shape, x.dtype)
    b.copy(y, x)
    b.leave()
    assert float(y.sum()) == 5.0 * (1 << 16)


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("strategy", ["home", "tree", "ring", "auto"])
def test_push_pull_ordered_on_current_stream(strategy):
    """Pull after push, then reads on CuPy's current stream, see every push (no syncs)."""
    import cupy

    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:4]
    kv = gpukv.create("device", strategy=strategy)
    n = 1 << 20
    with cupy.cuda.Device(devs[0].physical):
        kv.init("w", cupy.zeros(n, cupy.float32))
    grads, outs = [], []
    for i, d in enumerate(devs):
        with cupy.cuda.Device(d.physical):
            grads.append(cupy.full(n, float(i + 1), cupy.float32))
            outs.append(cupy.empty(n, cupy.float32))
    for step in range(3):
        kv.push("w", grads)
        kv.pull("w", out=outs)
        for g in grads:  # the caller overwrites its gradients right away
            with cupy.cuda.Device(g.device.id):
                g += 1
        for o in outs:
            with cupy.cuda.Device(o.device.id):
                assert float(o[0]) == float(o[-1]) == 10 + 4 * step


@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("strategy", ["home", "tree", "nccl"])
def test_calls_from_other_current_streams_stay_in_call_order(strategy):
    """A push under one current stream of the home GPU, a pull under another, a second
    push under a third: each call sees the ones before it (the store's arrays are read
    and written in call order whatever stream a call comes from)."""
    import cupy

    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:2]
    kv = gpukv.create("device", strategy=strategy)
    n = 1 << 14
    with cupy.cuda.Device(devs[0].physical):
        kv.init("w", cupy.zeros(n, cupy.float32))
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
    grads, doubled = [], []
    for i, d in enumerate(devs):
        with cupy.cuda.Device(d.physical):  # (each on its own GPU, as a user makes them)
            grads.append(cupy.full(n, float(i + 1), cupy.float32))
            doubled.append(grads[-1] * 2)
            cupy.cuda.get_current_stream().synchronize()
    with cupy.cuda.Device(devs[0].physical):
        out = cupy.empty(n, cupy.float32)
        cupy.cuda.get_current_stream().synchronize()
        with streams[0]:
            kv.push("w", grads)
        with streams[1]:
            kv.pull("w", out=out)
            got = float(out[0]), float(out[-1])
        with streams[2]:
            kv.push("w", doubled)
            kv.pull("w", out=out)
            again = float(out[0]), float(out[-1])
    assert got == (3.0, 3.0) and again == (6.0, 6.0)


@pytest.mark.multi_gpu(2)
def test_host_source_into_gpu_home():
    """A NumPy source pushed to a GPU-homed key is staged onto the home GPU."""
    import cupy
    kv = gpukv.create("device", strategy="home")
    kv.init(1, cupy.zeros(10, cupy.float32))
    kv.push(1, [cupy.ones(10, cupy.float32), np.full(10, 2, np.float32)])
    out = np.zeros(10, np.float32)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, 3)


# ------------------------------------------------------------- stream-order checker
# Fake GPUs run the strategies' GPU code path eagerly on host memory, with one vector
# clock per device: `record`/`wait_event`/`wait_for` move the clocks as CUDA events
# would, and every kernel or copy checks that what it reads was written, and what it
# overwrites was read, by work it is ordered after. A missing event is a failure. The
# sums are the real CUDA kernel, run by the emulation (or a GPU) on those addresses.
class _Storage:
    def __init__(self, data, n_dev):
        self.data = data.reshape(-1)
        self.w_dev = np.full(self.data.size, -1)
        self.w_t = np.zeros(self.data.size, np.int64)
        self.r_t = np.zeros((n_dev, self.data.size), np.int64)


_PTRS: dict = {}


class _Data:
    def __init__(self, arr):
        self.arr = arr
        self.ptr = arr.np.__array_interface__["data"][0]  # a real address the kernel reads
        _PTRS[self.ptr] = arr

    def copy_from_device_async(self, src, nbytes, stream):
        dev = stream.dev
        dev.tick()
        _read(dev, src.arr)
        _write(dev, self.arr)
        self.arr.np[...] = src.arr.np.reshape(self.arr.np.shape)


class _Block:
    """One allocation of a fake device's pool; when the last view of it dies, the block
    goes back to the pool of its device (one stream per device, as in CuPy's pool)."""

    def __init__(self, st, device):
        self.st, self.device = st, device

    def __del__(self):
        self.device.free.append(self.st)


class _Arr:
    """A 1-D (or reshaped contiguous) view of fake device memory."""

    class flags:  # noqa: N801 - mirrors ndarray.flags
        c_contiguous = True

    def __init__(self, st, off, shape, device, block=None):
        self.st, self.off, self.shape, self.device = st, off, tuple(shape), device
        self.block = block  # keeps the pool block in use while this view lives
        self.size = int(np.prod(self.shape, dtype=np.int64))

    @property
    def np(self):
        return self.st.data[self.off:self.off + self.size].reshape(self.shape)

    dtype = property(lambda self: self.st.data.dtype)
    itemsize = property(lambda self: self.st.data.itemsize)
    nbytes = property(lambda self: self.size * self.itemsize)
    data = property(lambda self: _Data(self))

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        shape = (self.size,) if shape in ((-1,), -1) else shape
        return _Arr(self.st, self.off, shape, self.device, self.block)

    def __getitem__(self, s):
        start, stop, _ = s.indices(self.size)
        return _Arr(self.st, self.off + start, (max(0, stop - start),), self.device,
                    self.block)

    def fill(self, value):
        dev = _CURRENT[-1]
        dev.tick()
        _write(dev, self)
        self.np[...] = value


def _span(a):
    return slice(a.off, a.off + a.size)


def _read(dev, a):
    sl = _span(a)
    w_dev, w_t = a.st.w_dev[sl], a.st.w_t[sl]
    for w in set(w_dev.tolist()) - {-1}:
        need = w_t[w_dev == w].max()
        assert dev.clock[w] >= need, f"{dev} reads data of {_DEVS[w]} without waiting for it"
    a.st.r_t[dev.index, sl] = dev.clock[dev.index]


def _write(dev, a):
    sl = _span(a)
    _read_ok = a.st.r_t[:, sl].max(axis=1)
    for r, t in enumerate(_read_ok.tolist()):
        assert r == dev.index or dev.clock[r] >= t, \
            f"{dev} overwrites data {_DEVS[r]} may still be reading"
    _read(dev, a)
    a.st.w_dev[sl] = dev.index
    a.st.w_t[sl] = dev.clock[dev.index]


_DEVS: list = []
_CURRENT: list = []


class _Stream:
    def __init__(self, dev):
        self.dev, self.ptr = dev, 1000 + dev.index

    def __enter__(self):
        _CURRENT.append(self.dev)

    def __exit__(self, *exc):
        _CURRENT.pop()


class _Event:
    def __init__(self, clock):
        self.clock = clock.copy()

    def synchronize(self):
        pass


class _FakeGpu(cuda_mod.CudaDevice):
    """A CudaDevice whose memory, streams and events are the clocked stand-ins above:
    its own verbs (sums, copies, staging) run as on a GPU, on host memory."""

    def __init__(self, physical, slot, index, n_dev):
        gpukv.device.Device.__init__(self, physical, slot)
        self.index, self.n_dev = index, n_dev
        self.clock = np.zeros(n_dev, np.int64)
        self._stream = _Stream(self)
        self._cuda_device = _Stream(self)
        self.free: list = []  # storages freed to this device's (single) stream pool

    xp = property(lambda self: np)
    stream = property(lambda self: self._stream)
    id = property(lambda self: self.physical)  # arrays' `.device.id`, as in CuPy

    def tick(self):
        self.clock[self.index] += 1

    def record(self):
        self.tick()
        return _Event(self.clock)

    def wait_event(self, event):
        np.maximum(self.clock, event.clock, out=self.clock)

    def wait_for(self, other):
        if isinstance(other, _FakeGpu):
            self.wait_event(other.record())

    def enter(self, marks=None):
        pass

    def leave(self):
        self.record()

    def synchronize(self):
        pass

    def empty(self, shape, dtype):
        """A block from this device's pool: a freed one of the dtype and enough size is
        reused first (with its read/write history), as CuPy's pool does per stream."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        size = int(np.prod(shape, dtype=np.int64))
        for i, st in enumerate(self.free):
            if st.data.dtype == np.dtype(dtype) and st.data.size >= size:
                del self.free[i]
                return _Arr(st, 0, shape, self, _Block(st, self))
        st = _Storage(gpu_env.guarded_zeros(shape, dtype), self.n_dev)
        return _Arr(st, 0, shape, self, _Block(st, self))

    def owns(self, array):
        return isinstance(array, _Arr) and array.device.physical == self.physical

    def copy(self, dst, src):
        self.tick()
        _read(self, src)
        _write(self, dst)
        dst.np[...] = src.np.reshape(dst.shape)


@pytest.fixture
def fake_gpus(monkeypatch):
    """Eight fake GPUs on four physical ids; peer access only within pairs (0,1), (2,3)."""
    from gpukv.comm.plan import links as _links
    from gpukv.device.cuda import kernels as _kernels
    from gpukv.device.host_kernels import multi_sum_host

    def kernel_sum(items):
        """The CUDA kernel on the emulation; the NumPy twin on a real GPU, whose kernels
        cannot read the fake devices' host memory (they are tested in test_kernels.py)."""
        if gpu_env.EMULATED:
            import cupy
            return real_sum(items, cupy.cuda.get_current_stream())
        multi_sum_host([_kernels.SumItem(it.out.np, tuple(t.np for t in it.a),
                                         tuple(t.np for t in it.b)) for it in items])

    real_sum = _kernels.multi_sum_gpu

    def multi_sum_gpu(items, stream):
        dev = stream.dev
        dev.tick()
        for it in items:
            for t in list(it.a) + list(it.b):
                _read(dev, t)
        for it in items:
            _write(dev, it.out)
        kernel_sum(items)

    monkeypatch.setattr(_kernels, "multi_sum_gpu", multi_sum_gpu)
    monkeypatch.setattr(cuda_mod, "can_access_peer", lambda r, o: r // 2 == o // 2)
    monkeypatch.setattr(cuda_mod, "peer_readable", lambda r, a: r // 2 == a.device.id // 2)
    monkeypatch.setattr(_links, "link_matrix", lambda nodes: _matrix(nodes))
    devs = [_FakeGpu(i % 4, i // 4, i, 8) for i in range(8)]
    _DEVS[:] = devs
    return devs


def _matrix(nodes):
    from gpukv.comm.plan import topology
    n = len(nodes)
    w = np.zeros((n, n))
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
            if i != j:
                same_pair = a.physical // 2 == b.physical // 2
                w[i, j] = 64 if a.physical == b.physical else (2 if same_pair else 0)
    return topology.as_link_matrix(w)


def _user_array(dev, values):
    a = dev.empty(values.shape, values.dtype)
    a.np[...] = values
    a.st.w_dev[:] = dev.index
    a.st.w_t[:] = dev.clock[dev.index] = dev.clock[dev.index] + 1
    return a


@pytest.mark.parametrize("name", ["home", "tree", "ring"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("bound", [3, 10 ** 6])
def test_gpu_path_is_event_ordered(fake_gpus, name, n, bound, monkeypatch):
    """The GPU code path of each strategy orders every read and overwrite by events."""
    from gpukv.comm import BroadcastJob, ReduceJob
    from gpukv.comm.registry import make_strategy
    from gpukv.comm.tree import TreeStrategy
    from gpukv.device.cuda import sums
    monkeypatch.setattr(sums, "STAGE_BYTES", 16)  # many staging chunks
    strategy = TreeStrategy(array_bound=bound) if name == "tree" else make_strategy(name)
    devs = fake_gpus[:n]
    rng = np.random.default_rng(n)
    for home in {devs[0], devs[-1], fake_gpus[7]}:
        values = [rng.integers(-9, 9, 23).astype(np.float16) for _ in devs]
        sources = [_user_array(d, v) for d, v in zip(devs, values)]
        out = home.empty((23,), np.float32)
        strategy.reduce_many([ReduceJob("k", sources, list(devs), home, out)])
        for d, s in zip(devs, sources):  # callers may overwrite their sources now
            d.tick()
            _write(d, s)
        home.tick()
        _read(home, out)  # and read the result on the home's stream
        np.testing.assert_array_equal(out.np, sum(v.astype(np.float32) for v in values))
        outs = [d.empty((23,), np.float32) for d in devs]
        strategy.broadcast_many([BroadcastJob("k", out, home, outs, list(devs))])
        home.tick()
        _write(home, out)  # the stored value may change after the pull returns
        for d, o in zip(devs, outs):
            d.tick()
            _read(d, o)
            np.testing.assert_array_equal(o.np, out.np)


class _Strided(_Arr):
    """A fake array that reports itself as non-contiguous (so it is copied flat first)."""

    class flags:  # noqa: N801 - mirrors ndarray.flags
        c_contiguous = False


def _strided(a):
    return _Strided(a.st, a.off, a.shape, a.device, a.block)


@pytest.mark.parametrize("name", ["home", "tree", "ring"])
def test_flat_copies_live_until_every_home_read_them(fake_gpus, name):
    """Contiguous copies of strided sources outlive their readers on every home of a call."""
    from gpukv.comm import ReduceJob
    from gpukv.comm.registry import make_strategy
    strategy = make_strategy(name)
    devs = fake_gpus[:3]
    rng = np.random.default_rng(7)
    jobs, refs = [], []
    for key, home in enumerate([devs[0], devs[1], devs[2], devs[0]]):
        values = [rng.integers(-9, 9, 40).astype(np.float32) for _ in devs]
        sources = [_strided(_user_array(d, v)) for d, v in zip(devs, values)]
        jobs.append(ReduceJob(key, sources, list(devs), home, home.empty((40,), np.float32)))
        refs.append(sum(values))
    strategy.reduce_many(jobs)
    for job, ref in zip(jobs, refs):
        job.home.tick()
        _read(job.home, job.out)
        np.testing.assert_array_equal(job.out.np, ref)


def test_checker_catches_a_missing_wait(fake_gpus):
    """The stream-order checker fails a read that no event orders."""
    a, b = fake_gpus[0], fake_gpus[1]
    x = _user_array(a, np.ones(4))
    b.tick()
    with pytest.raises(AssertionError, match="without waiting"):
        _read(b, x)


class _FakeNccl:
    """cupy.cuda.nccl's surface: grouped reduce/bcast run on the fake GPUs at groupEnd."""

    available = True
    NCCL_SUM = 0
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_INT32 = 6, 7, 8, 2

    def __init__(self, devs):
        self.devs = devs
        self.pending = None
        self.groups = 0
        outer = self

        class NcclCommunicator:
            def __init__(self, group, rank):
                self.group, self.rank = group, rank

            @staticmethod
            def initAll(devices):
                # Inside a group NCCL defers the init to groupEnd, so the collectives
                # queued on the new communicators in that group would find it unready.
                assert outer.pending is None, "communicators created inside a group"
                group = tuple(devices)
                return [NcclCommunicator(group, r) for r in range(len(devices))]

            def reduce(self, send, recv, count, dtype, op, root, stream):
                outer.pending.append(("reduce", self, send, recv, count, root, stream))

            def bcast(self, buf, count, dtype, root, stream):
                outer.pending.append(("bcast", self, buf, buf, count, root, stream))

        self.NcclCommunicator = NcclCommunicator

    def groupStart(self):
        self.pending = []

    def groupEnd(self):
        self.groups += 1
        calls, self.pending = self.pending, None
        seen: dict = {}
        collectives: dict = {}
        for call in calls:  # the k-th call of every rank of a group forms one collective
            op, comm = call[0], call[1]
            k = seen.get((comm.group, comm.rank), 0)
            seen[(comm.group, comm.rank)] = k + 1
            collectives.setdefault((comm.group, k), {})[comm.rank] = call
        for (group, _), ranks in collectives.items():
            assert sorted(ranks) == list(range(len(group))), "a rank missed a collective"
            op = {c[0] for c in ranks.values()}
            assert len(op) == 1
            devs = {r: self.devs[c[6] - 1000] for r, c in ranks.items()}
            for r, c in ranks.items():
                assert devs[r].physical == group[r], "NCCL call on another GPU's stream"
            root = ranks[0][5]
            joint = np.max([d.clock for d in devs.values()], axis=0)
            if op == {"reduce"}:
                total = 0
                for r, c in ranks.items():
                    devs[r].tick()
                    _read(devs[r], _PTRS[c[2]][:c[4]])
                    total = total + _PTRS[c[2]][:c[4]].np
                joint = np.max([d.clock for d in devs.values()], axis=0)
                for d in devs.values():
                    np.maximum(d.clock, joint, out=d.clock)
                dst = _PTRS[ranks[root][3]][:ranks[root][4]]
                devs[root].tick()
                _write(devs[root], dst)
                dst.np[...] = total
            else:
                devs[root].tick()
                src = _PTRS[ranks[root][2]][:ranks[root][4]]
                _read(devs[root], src)
                joint = np.max([d.clock for d in devs.values()], axis=0)
                for d in devs.values():
                    np.maximum(d.clock, joint, out=d.clock)
                for r, c in ranks.items():
                    if r != root:
                        devs[r].tick()
                        dst = _PTRS[c[2]][:c[4]]
                        _write(devs[r], dst)
                        dst.np[...] = src.np


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_nccl_path_grouped_and_event_ordered(fake_gpus, n, dtype, monkeypatch):
    """The 'nccl' strategy's GPU path: one group per call, right sums, ordered by events."""
    from gpukv.comm import BroadcastJob, ReduceJob
    from gpukv.comm import nccl as nccl_mod
    fake = _FakeNccl(fake_gpus)
    monkeypatch.setattr(nccl_mod, "nccl_module", lambda: fake)
    monkeypatch.setattr(cuda_mod, "cuda_device", lambda p, s=0: fake_gpus[p + 4 * s])
    strategy = nccl_mod.NcclStrategy()
    devs = fake_gpus[:n]
    rng = np.random.default_rng(n)
    jobs, refs, bjobs = [], [], []
    for key, home in enumerate({devs[0], devs[-1], fake_gpus[5]}):
        values = [rng.integers(-9, 9, 17).astype(dtype) for _ in devs]
        sources = [_user_array(d, v) for d, v in zip(devs, values)]
        jobs.append(ReduceJob(key, sources, list(devs), home, home.empty((17,), np.float32)))
        refs.append(sum(v.astype(np.float32) for v in values))
    strategy.reduce_many(jobs)
    for job, ref in zip(jobs, refs):
        for d, s in zip(job.devices, job.sources):
            d.tick()
            _write(d, s)
        job.home.tick()
        _read(job.home, job.out)
        np.testing.assert_array_equal(job.out.np, ref)
        outs = [d.empty((17,), np.float32) for d in devs]
        bjobs.append(BroadcastJob(job.key, job.out, job.home, outs, list(devs)))
    strategy.broadcast_many(bjobs)
    physical = {d.physical for d in devs}
    assert fake.groups == (2 if len(physical | {j.home.physical for j in jobs}) > 1 else 0)
    for job in bjobs:
        job.home.tick()
        _write(job.home, job.src)
        for d, o in zip(job.devices, job.outs):
            d.tick()
            _read(d, o)
            np.testing.assert_array_equal(o.np, job.src.np)


def test_nccl_strided_sources_over_several_homes(fake_gpus, monkeypatch):
    """Flat copies of strided sources outlive the NCCL reduce of every key of a call."""
    from gpukv.comm import ReduceJob
    from gpukv.comm import nccl as nccl_mod
    fake = _FakeNccl(fake_gpus)
    monkeypatch.setattr(nccl_mod, "nccl_module", lambda: fake)
    monkeypatch.setattr(cuda_mod, "cuda_device", lambda p, s=0: fake_gpus[p + 4 * s])
    devs = [fake_gpus[0], fake_gpus[1], fake_gpus[4]]  # GPU 1, and two slots of GPU 0
    rng = np.random.default_rng(3)
    jobs, refs = [], []
    for key, home in enumerate([devs[0], devs[1], devs[2], devs[1]]):
        values = [rng.integers(-9, 9, 40).astype(np.float32) for _ in devs]
        sources = [_strided(_user_array(d, v)) for d, v in zip(devs, values)]
        jobs.append(ReduceJob(key, sources, list(devs), home, home.empty((40,), np.float32)))
        refs.append(sum(values))
    nccl_mod.NcclStrategy().reduce_many(jobs)
    assert fake.groups == 1
    for job, ref in zip(jobs, refs):
        job.home.tick()
        _read(job.home, job.out)
        np.testing.assert_array_equal(job.out.np, ref)


def test_init_source_may_be_overwritten_after_init(fake_gpus, monkeypatch):
    """init copies its GPU input before the caller's later work on that GPU may change it."""
    from gpukv.store import check as _args
    home = fake_gpus[2]
    monkeypatch.setattr(cuda_mod, "gpu_devices", lambda: [home])
    monkeypatch.setattr(cuda_mod, "cuda_device", lambda p, s=0: fake_gpus[p + 4 * s])
    kv = gpukv.create("device", strategy="home")
    source = _user_array(fake_gpus[0], np.arange(6, dtype=np.float32))
    kv._init_groups(_args.Groups(["w"], [[source]], False, str))
    fake_gpus[0].tick()
    _write(fake_gpus[0], source)  # the caller reuses its array on its own stream
    home.tick()
    _read(home, kv._entries["w"].value)
    np.testing.assert_array_equal(kv._entries["w"].value.np, np.arange(6))


# ------------------------------------------- which GPU and stream do the work (no GPU)
def test_gpu_devices_count_comes_from_virtual_gpus(monkeypatch):
    """gpu_devices() takes the logical device count from virtual_gpus(), the one reader of
    GPUKV_VIRTUAL_GPUS."""
    asked = []
    monkeypatch.setattr(cuda_mod, "gpu_count", lambda: 2)
    monkeypatch.setattr(cuda_mod, "cuda_device", lambda p, s=0: (p, s))
    monkeypatch.setattr(cuda_mod, "virtual_gpus", lambda: asked.append(1) or 3)
    monkeypatch.delenv("GPUKV_VIRTUAL_GPUS", raising=False)
    assert cuda_mod.gpu_devices() == [(0, 0), (1, 0), (0, 1)]
    assert asked
    monkeypatch.setattr(cuda_mod, "virtual_gpus", lambda: None)
    assert cuda_mod.gpu_devices() == [(0, 0), (1, 0)]


class _Tagged:
    """A CuPy array stand-in on GPU `gpu`: copies, packs and reads are logged by tag."""

    def __init__(self, cuda, gpu, tag, contiguous=True):
        import types
        self.cuda, self.tag = cuda, tag
        self.device = types.SimpleNamespace(id=gpu)
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)
        self.shape, self.dtype, self.nbytes = (4,), np.dtype(np.float32), 16
        self.data = types.SimpleNamespace(owner=self, copy_from_device_async=self._memcpy)

    def _memcpy(self, src, nbytes, stream):
        self.cuda.log.append(("memcpy", self.cuda.current, stream.name, src.owner.tag))

    def get(self, stream=None):
        self.cuda.log.append(("get", self.cuda.current, getattr(stream, "name", None)))
        return np.zeros(self.shape, self.dtype)


@pytest.fixture
def tagged_cupy(fake_cupy, monkeypatch):
    """fake_cupy with array functions over `_Tagged`, numbered events, and keep_alive logged."""
    cuda = fake_cupy
    fake = cuda_mod.cupy_module()
    fake.empty = lambda shape, dtype: _Tagged(cuda, cuda.current, "staged")

    def pack(a):
        cuda.log.append(("pack", cuda.current, cuda.get_current_stream().name, a.tag))
        return _Tagged(cuda, cuda.current, "packed")

    fake.ascontiguousarray = pack
    fake.copyto = lambda dst, src, casting: cuda.log.append(
        ("copyto", cuda.current, cuda.get_current_stream().name, dst.tag, src.tag))
    seq = iter(range(1000))

    def record(stream, event=None):
        event = ("event", stream.name, stream._on(), next(seq))
        cuda.log.append(("record",) + event[1:])
        return event

    monkeypatch.setattr(_FakeStream, "record", record)
    monkeypatch.setattr(cuda_mod, "keep_alive",
                        lambda obj, event: cuda.log.append(("keep", obj.tag, event)))
    return cuda


def test_to_host_copies_under_the_arrays_own_gpu(tagged_cupy):
    """A GPU array brought to the host is copied under its own GPU: by the host device, on
    that GPU's current stream; by its own logical device, on that device's stream."""
    cuda = tagged_cupy
    with cuda.Device(1):
        side = cuda.Stream()
    cuda.streams[1] = side  # the caller's current stream on GPU 1 (GPU 0 is current)
    array = _Tagged(cuda, 1, "x")
    gpukv.device.host_device().to_host(array)
    assert cuda.log[-1] == ("get", 1, side.name)
    slot = cuda_mod.CudaDevice(1, 1)
    slot.to_host(array)
    assert cuda.log[-1] == ("get", 1, slot.stream.name) and cuda.current == 0


def test_strided_peer_source_packed_by_its_own_gpu(tagged_cupy):
    """A strided source on another GPU is made contiguous by that GPU (ordered after this
    device's stream), then crosses in one memcpy on this device's stream after the pack,
    and the packed copy is kept alive until that memcpy has run."""
    cuda = tagged_cupy
    dev = cuda_mod.CudaDevice(0, 1)
    mine = dev.stream.name
    src = _Tagged(cuda, 1, "src", contiguous=False)
    dst = _Tagged(cuda, 0, "dst")
    cuda.log.clear()
    dev.copy(dst, src)
    e1, e2, e3 = ("event", mine, 0, 0), ("event", "null", 1, 1), ("event", mine, 0, 2)
    assert cuda.log == [
        ("record", mine, 0, 0),
        ("wait", "null", 1, e1),           # GPU 1's stream after what dev is ordered after
        ("pack", 1, "null", "src"),        # the strided read happens on GPU 1
        ("record", "null", 1, 1),
        ("wait", mine, 0, e2),             # the memcpy after the pack
        ("memcpy", 0, mine, "packed"),
        ("record", mine, 0, 2),
        ("keep", "packed", e3),            # freed only once the memcpy has read it
    ]
    assert cuda.current == 0


def test_strided_peer_source_into_a_cast_packs_then_stages(tagged_cupy):
    """With a dtype cast as well, the packed copy is staged here, then cast locally."""
    cuda = tagged_cupy
    dev = cuda_mod.CudaDevice(0)
    src = _Tagged(cuda, 1, "src", contiguous=False)
    dst = _Tagged(cuda, 0, "dst")
    dst.dtype = np.dtype(np.float16)
    cuda.log.clear()
    dev.copy(dst, src)
    kinds = [entry[0] for entry in cuda.log]
    assert kinds == ["record", "wait", "pack", "record", "wait", "memcpy", "copyto",
                     "record", "keep"]
    assert cuda.log[2][1] == 1 and cuda.log[5][1:] == (0, "null", "packed")
    assert cuda.log[6][1:] == (0, "null", "dst", "staged")


# ------------------------------------------------------- events, threads, pinned buffers
@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("strategy", ["home", "tree", "ring", "cpu", "nccl"])
def test_ordering_events_are_made_without_timing(strategy, monkeypatch):
    """Every event gpukv records to order work is made with disable_timing=True (cheaper
    to record and wait on): a push and pull make no timing event at all."""
    import cupy

    from gpukv.device.cuda.device import gpu_devices

    if gpu_env.EMULATED:  # the emulation counts every event made, CuPy's own included
        from cudaemu import runtime
        timed = lambda: runtime.created["timed_event"]  # noqa: E731
    else:  # a real GPU: the events gpukv makes itself
        made = []
        real = cupy.cuda.Event
        monkeypatch.setattr(cupy.cuda, "Event", lambda *a, **k: made.append(
            not k.get("disable_timing", a[1] if len(a) > 1 else False)) or real(*a, **k))
        timed = lambda: sum(made)  # noqa: E731
    kv = gpukv.create("device", strategy=strategy)
    devs = gpu_devices()[:4]
    values = []
    for i, d in enumerate(devs):
        with cupy.cuda.Device(d.physical):
            values.append(cupy.full((3, 5), float(i), cupy.float32))
    kv.init("w", values[0])
    before = timed()
    kv.pushpull("w", values)
    assert timed() == before


def _events_made(monkeypatch):
    """A function counting the CUDA events made so far (the emulation counts every one;
    on a real GPU, those gpukv makes)."""
    import cupy
    if gpu_env.EMULATED:
        from cudaemu import runtime
        return lambda: runtime.created["event"]
    made = []
    real = cupy.cuda.Event
    monkeypatch.setattr(cupy.cuda, "Event", lambda *a, **k: made.append(1) or real(*a, **k))
    return lambda: len(made)


def _events_of_a_pushpull(monkeypatch, values) -> int:
    kv = gpukv.create("device", strategy="home")
    kv.init("w", values[0])
    kv.pushpull("w", values)  # (warm: plans, pools)
    made = _events_made(monkeypatch)
    before = made()
    kv.pushpull("w", values)
    return made() - before


@pytest.mark.gpu
def test_a_pushpull_on_one_gpu_makes_no_event(monkeypatch):
    """One value on one GPU: the work goes to the caller's current stream, in order,
    and nothing needs an event (each costs a few microseconds of a small call)."""
    import cupy
    assert _events_of_a_pushpull(monkeypatch, [cupy.ones(1024, cupy.float32)]) == 0


@pytest.mark.gpu
def test_virtual_gpus_of_one_gpu_share_the_events_of_a_call(monkeypatch):
    """Four values on one GPU (four virtual GPUs, each with its stream): per call, one
    event of the caller's stream that the three others wait for, one of each as the
    home waits for it before and after the sum or copies, and one of the home that
    stands for the whole call: at most 2 * (2 * 3 + 2) for a pushpull."""
    import cupy
    values = [cupy.full(1024, float(i), cupy.float32) for i in range(4)]
    assert _events_of_a_pushpull(monkeypatch, values) <= 16


@pytest.mark.multi_gpu(2)
def test_a_pushpull_over_two_gpus_makes_few_events(monkeypatch):
    """One value on each of two GPUs with peer access: per call, one event of the other
    GPU as the home waits for it before and after the sum or copy, and one of the
    home's for the whole call, which the other GPU's current stream then follows: at
    most 2 * 3 for a pushpull."""
    import cupy

    from gpukv.device.cuda.device import can_access_peer, gpu_count
    if gpu_count() < 2 or not (can_access_peer(0, 1) and can_access_peer(1, 0)):
        hardware_missing("needs two physical GPUs with peer access")
    values = []
    for i in range(2):
        with cupy.cuda.Device(i):
            values.append(cupy.full(1024, float(i), cupy.float32))
    assert _events_of_a_pushpull(monkeypatch, values) <= 6


@pytest.mark.multi_gpu(4)
def test_virtual_gpu_stream_made_once_under_threads(monkeypatch):
    """Two threads asking a virtual GPU for its stream at the same moment get the same
    stream: it is made once, so no work is queued on a stream nobody waits for."""
    import threading

    import cupy
    device = cuda_mod.CudaDevice(0, 3)  # a fresh logical device, not the shared one
    both_inside = threading.Barrier(2, timeout=0.5)
    real = cupy.cuda.Stream

    def slow_stream(*args, **kwargs):
        try:
            both_inside.wait()  # without a lock both threads get here together
        except threading.BrokenBarrierError:
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(cupy.cuda, "Stream", slow_stream)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(device.stream)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 2 and seen[0] is seen[1]


class _Copy:
    """An event of a copy in flight: done once waited for (or marked done)."""

    def __init__(self, log):
        self.done, self.log = False, log

    def synchronize(self):
        self.log.append(self)
        self.done = True


@pytest.fixture
def kept(monkeypatch):
    """An empty keep-alive list, with the pinned cap at 4 KiB."""
    monkeypatch.setattr(cuda_mod, "_alive", collections.deque())
    monkeypatch.setattr(cuda_mod, "_held", {})
    monkeypatch.setattr(cuda_mod, "_held_bytes", [0])
    monkeypatch.setattr(cuda_mod, "PINNED_CAP", 4096)
    return cuda_mod._alive


def test_buffers_let_go_once_their_copy_is_done(kept):
    """A kept buffer is released at the next call after its copy completed, not later."""
    log = []
    first, second = _Copy(log), _Copy(log)
    cuda_mod.keep_alive(np.zeros(10), first)
    first.done = True
    cuda_mod.keep_alive(np.zeros(10), second)
    assert [e for e, _ in kept] == [second]
    second.done = True
    cuda_mod.release_done()
    assert not kept and log == [] and cuda_mod._held_bytes == [0]


def test_pinned_bytes_in_flight_are_capped(kept):
    """Past PINNED_CAP bytes of host buffers in flight, the oldest copies are waited for
    and their buffers let go; the newest is always kept."""
    log = []
    events = [_Copy(log) for _ in range(4)]
    for e in events:
        cuda_mod.keep_alive(np.zeros(256), e)  # 2 KiB each
    assert log == events[:2] and [e for e, _ in kept] == events[2:]
    big = _Copy(log)
    cuda_mod.keep_alive(np.zeros(4096), big)  # 32 KiB alone: over the cap, yet kept
    assert [e for e, _ in kept] == [big]


def test_a_buffer_kept_for_several_copies_counts_once(kept):
    """A broadcast keeps one host buffer for a copy to every device: its bytes count once
    towards the cap, and it is let go after its last copy."""
    log = []
    shared = np.zeros(400)  # 3.2 KiB, under the 4 KiB cap
    copies = [_Copy(log) for _ in range(8)]
    for e in copies:
        cuda_mod.keep_alive(shared, e)
    assert log == [] and len(kept) == 8 and cuda_mod._held_bytes == [shared.nbytes]
    for e in copies:
        e.done = True
    cuda_mod.release_done()
    assert not kept and cuda_mod._held_bytes == [0] and cuda_mod._held == {}


@pytest.mark.multi_gpu(2)
def test_cpu_strategy_keeps_no_pinned_buffer_after_its_copies(monkeypatch):
    """Pinned buffers of a call whose copies have completed are gone by the next call
    (a few large keys must not keep their size pinned in host memory)."""
    import cupy

    from gpukv.device.cuda.device import gpu_devices
    monkeypatch.setattr(cuda_mod, "_alive", collections.deque())
    kv = gpukv.create("device", strategy="cpu")
    devs = gpu_devices()[:2]
    values, others = [], []  # (one out per key and device: two keys share none)
    for d in devs:
        with cupy.cuda.Device(d.physical):
            values.append(cupy.ones(1 << 16, cupy.float32))
            others.append(cupy.ones(1 << 16, cupy.float32))
    kv.init([0, 1], [values[0], values[1]])
    kv.pushpull([0, 1], [values, others])
    for d in devs:
        d.synchronize()
    earlier = [buffer for _, buffer in cuda_mod._alive]
    kv.pull(0, out=values[0])  # the next call finds the earlier copies done
    assert not any(b is e for _, b in cuda_mod._alive for e in earlier)


# ------------------------------------------------- memory peer access does not reach
def _push_from_gpu1(source, strategy="home"):
    """Push `source` (on GPU 1) and ones on GPU 0 into a key homed on GPU 0; the pull."""
    import cupy
    kv = gpukv.create("device", strategy=strategy)
    with cupy.cuda.Device(0):
        kv.init("w", cupy.zeros(source.shape, cupy.float32))
        local = cupy.ones(source.shape, cupy.float32)
        out = cupy.zeros(source.shape, cupy.float32)
    kv.push("w", [source, local])
    kv.pull("w", out=out)
    return out.get()


@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("strategy", ["home", "tree"])
def test_stream_ordered_pool_memory_of_a_peer_is_staged(strategy):
    """Memory from a stream-ordered pool (cudaMallocAsync) on GPU 1 is not readable from
    GPU 0 through peer access alone: it is copied over, not read by the sum kernel."""
    import cupy

    from gpukv.device.cuda.device import can_access_peer, gpu_count, peer_readable
    if gpu_count() < 2 or not can_access_peer(0, 1):
        hardware_missing("needs two physical GPUs with peer access")
    pool = cupy.cuda.MemoryAsyncPool()
    with cupy.cuda.Device(1), cupy.cuda.using_allocator(pool.malloc):
        source = cupy.full((1000,), 2.0, cupy.float32)
    assert not peer_readable(0, source)
    np.testing.assert_array_equal(_push_from_gpu1(source, strategy), 3.0)


@pytest.mark.multi_gpu(2)
@pytest.mark.skipif(not gpu_env.EMULATED, reason="makes a virtual-memory mapping of the "
                                                 "CUDA emulation")
@pytest.mark.parametrize("granted", [False, True])
def test_virtual_memory_mapping_of_a_peer_is_read_only_once_granted(granted):
    """Memory of a virtual-memory mapping (PyTorch's expandable segments) on GPU 1 is read
    directly from GPU 0 only when the mapping grants GPU 0 access; else it is staged."""
    import cupy
    from cudaemu import memory

    from gpukv.device.cuda.device import peer_readable
    with cupy.cuda.Device(1):
        memptr = memory.mapped_alloc(1000 * 4, 1)
        source = cupy.ndarray((1000,), cupy.float32, memptr=memptr)
        source.fill(2.0)
    if granted:
        memory.mapping_of(memptr).grant(0)
    assert peer_readable(0, source) is granted
    np.testing.assert_array_equal(_push_from_gpu1(source), 3.0)

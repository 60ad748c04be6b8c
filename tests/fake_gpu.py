"""A logging stand-in for a GPU `Device` whose arrays are NumPy arrays.

It lets the stream and event discipline of GPU code paths be checked on the host: which
stream is current when an array is filled, and the order of waits, enters, leaves and
synchronisations, all appended to one shared `log`.
"""
from __future__ import annotations

import numpy as np

import gpukv


class _Context:
    """`with` makes `name` the current one of `kind` ('device' or 'stream') in `state`."""

    def __init__(self, state: dict, kind: str, name: str):
        self.state, self.kind, self.name = state, kind, name
        self.saved: list = []

    def __enter__(self):
        self.saved.append(self.state.get(self.kind))
        self.state[self.kind] = self.name
        return self

    def __exit__(self, *exc):
        self.state[self.kind] = self.saved.pop()
        return False


class StreamCheckedArray(np.ndarray):
    """A NumPy array whose `fill` logs the stream current at the time."""

    def fill(self, value):
        dev = self.fake_device
        dev.log.append(("fill", dev.name, dev.current.get("stream")))
        super().fill(value)


class FakeGpu(gpukv.backends.Device):
    """A "GPU" holding NumPy arrays, logging every ordering call into `log`."""

    kind = "gpu"

    def __init__(self, physical: int, log: list, current: dict, slot: int = 0):
        super().__init__(physical, slot)
        self.log, self.current = log, current
        self.name = f"gpu{physical}.{slot}"
        self.cuda_device = _Context(current, "device", self.name)
        self.stream = _Context(current, "stream", self.name)

    xp = property(lambda self: np)

    def empty(self, shape, dtype):
        with self.cuda_device, self.stream:
            array = np.empty(shape, dtype).view(StreamCheckedArray)
        array.fake_device = self
        return array

    def copy(self, dst, src) -> None:
        self.log.append(("copy", self.name))
        np.copyto(dst, np.asarray(src), casting="unsafe")

    def owns(self, array) -> bool:
        return isinstance(array, np.ndarray)

    def wait_for(self, other) -> None:
        if other.kind == "gpu" and other is not self:
            self.log.append(("wait_for", self.name, other.name))

    def enter(self) -> None:
        self.log.append(("enter", self.name))

    def leave(self) -> None:
        self.log.append(("leave", self.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeCupy:
    """A stand-in for the `cupy` module over NumPy that keeps CuPy's device rules.

    Arrays (`FakeCupy.ndarray`, a NumPy subclass) have a `device` that is a context
    manager, as CuPy's are; a new array lands on the current device (a view stays with its
    base), and every operation that reads or writes arrays on a device other than the
    current one is appended to `cross` as (operation, current device, array devices).
    `scatter_add` stands in for `cupyx.scatter_add`.
    """

    def __init__(self):
        self.current = 0
        self.cross: list = []
        fake = self

        class Device:
            def __init__(self, id):
                self.id = id
                self._saved: list = []

            def __enter__(self):
                self._saved.append(fake.current)
                fake.current = self.id
                return self

            def __exit__(self, *exc):
                fake.current = self._saved.pop()
                return False

        class ndarray(np.ndarray):
            def __array_finalize__(self, obj):
                inherited = getattr(obj, "_device_id", None) if self.base is not None else None
                self._device_id = fake.current if inherited is None else inherited

            @property
            def device(self):
                return Device(self._device_id)

            def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
                fake.check(ufunc.__name__, inputs + (out or ()))
                args = [fake.plain(x) for x in inputs]
                if out is not None:
                    kwargs["out"] = tuple(fake.plain(o) for o in out)
                result = getattr(ufunc, method)(*args, **kwargs)
                return (out[0] if len(out) == 1 else out) if out is not None else fake.wrap(result)

            def __array_function__(self, func, types, args, kwargs):
                return fake.call(func, args, kwargs)

            def __getitem__(self, index):
                fake.check("getitem", (self,) + (index if isinstance(index, tuple) else (index,)))
                return super().__getitem__(index)

            def __setitem__(self, index, value):
                fake.check("setitem", (self, value)
                           + (index if isinstance(index, tuple) else (index,)))
                super().__setitem__(index, value)

            def astype(self, *args, **kwargs):
                fake.check("astype", (self,))
                return super().astype(*args, **kwargs)

            def copy(self, *args, **kwargs):
                fake.check("copy", (self,))
                return super().copy(*args, **kwargs)

        self.ndarray = ndarray
        self.Device = Device

    # ---------------------------------------------------------------- helpers
    def plain(self, x):
        return x.view(np.ndarray) if isinstance(x, self.ndarray) else x

    def wrap(self, result):
        """Results of an operation: new arrays on the current device."""
        if isinstance(result, tuple):
            return tuple(self.wrap(r) for r in result)
        if type(result) is np.ndarray:
            return result.view(self.ndarray)  # a view of a fresh array: current device
        return result

    def check(self, op, arrays) -> None:
        devices = []
        for a in arrays:
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(x, self.ndarray):
                    devices.append(x._device_id)
        if any(d != self.current for d in devices):
            self.cross.append((op, self.current, devices))

    def call(self, func, args, kwargs):
        self.check(getattr(func, "__name__", "call"), tuple(args) + tuple(kwargs.values()))
        args = [[self.plain(x) for x in a] if isinstance(a, (list, tuple)) else self.plain(a)
                for a in args]
        kwargs = {k: self.plain(v) for k, v in kwargs.items()}
        return self.wrap(func(*args, **kwargs))

    def array_on(self, device_id: int, array):
        """A copy of `array` on fake GPU `device_id`."""
        with self.Device(device_id):
            return self.wrap(np.array(array))

    def scatter_add(self, a, slices, value):
        """CuPy 14's scatter_add: only the dtypes CUDA's atomicAdd takes."""
        self.check("scatter_add", (a, slices, value))
        if a.dtype.name not in ("int32", "int64", "uint32", "uint64", "float16", "float32",
                                "float64"):
            raise TypeError(f"cupy.add.at does not support {a.dtype}")
        np.add.at(self.plain(a), self.plain(slices), self.plain(value).astype(a.dtype))

    def __getattr__(self, name):
        target = getattr(np, name)
        if callable(target) and not isinstance(target, type):
            return lambda *args, **kwargs: self.call(target, args, kwargs)
        return target

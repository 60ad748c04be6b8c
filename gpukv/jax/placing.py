"""Pulled values out to JAX: each key pulled once into a fresh buffer per place it is
needed (a GPU's own buffer where CuPy sees that GPU, handed to JAX by DLPack without a
copy; one host buffer for everything else), then each leaf made where it is wanted.

A wanted place is a `jax.Device`, a `jax.sharding.Sharding` (the leaf's whole value laid
out as the sharding says), `None` (JAX's default device), or `PerShard(leaf)`: the value
on every device of `leaf`'s sharding, each shard a whole copy (what a pushed sharded leaf
gets back). A fused bucket is moved to a device once and split there by one jitted call.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from .._errors import ShapeError
from ..device import gpu_devices
from .buckets import Bucket, unpack
from .trees import TreeLayout

#: the alignment (bytes) of a host buffer that a JAX CPU device takes without a copy
ALIGNMENT = 64
#: a bucket of at most this many leaves is put on a device leaf by leaf; a larger one is
#: put whole and split there by one jitted call (on 4 host devices, a put costs about
#: 40 us and a split about 10 us per leaf, plus 350 us per put of 1 MB)
FEW_LEAVES = 8


class PerShard(NamedTuple):
    """Every shard of `leaf`'s sharding holds the whole value (shaped as the shard)."""
    leaf: jax.Array


def pull(kv, layout: TreeLayout, rows: list, divide_by: int | None = None) -> list:
    """The leaves of every row of places (a list of places, one per leaf), pulled, and
    with `divide_by` divided by it as XLA divides by a constant (`_divided`)."""
    of_leaf = {i: (b, k) for b, bucket in enumerate(layout.buckets)
               for k, i in enumerate(bucket.leaves)}
    _check_fits(layout, rows)
    resolved: dict = {}   # id(place) -> its devices; a place is often shared by leaves
    rows = [[_resolved(place, resolved) for place in row] for row in rows]
    wanted = {(of_leaf[i][0], device) for row in rows for i, (_, devices) in enumerate(row)
              for device in devices}
    gpus = {device for _, device in wanted if device is not None and _is_gpu(device)}
    buffers = [_buffers(bucket, gpus) for bucket in layout.buckets]
    if buffers:
        kv.pull(layout.bucket_keys, out=[list(b.values()) for b in buffers])
    if divide_by is not None:
        for found in buffers:
            for buffer in found.values():
                _divided(buffer, divide_by)
    made = _Made(layout, buffers, of_leaf)
    made.place(sorted(wanted, key=lambda pair: (pair[0], str(pair[1]))))
    return [[made.leaf(i, place) for i, place in enumerate(row)] for row in rows]


def _divided(buffer, n: int) -> None:
    """buffer /= n as XLA computes `x / n` for a constant n on host devices, and so
    `jax.lax.pmean`: times 1/n rounded to the buffer's dtype, bfloat16 widened to float32
    for it (1/n a float32 too), then rounded back."""
    if buffer.dtype.name == "bfloat16":
        buffer[...] = (buffer.astype(np.float32) * np.float32(1.0 / n)).astype(buffer.dtype)
    else:
        buffer *= buffer.dtype.type(1.0 / n)


def _check_fits(layout: TreeLayout, rows: list) -> None:
    """A ShapeError naming the leaf, before anything is pulled, where a sharding cannot
    lay out a leaf's shape (an axis it splits more ways than it is long)."""
    for row in rows:
        for i, place in enumerate(row):
            if isinstance(place, jax.sharding.Sharding):
                try:
                    place.shard_shape(layout.shapes[i])
                except Exception as exc:  # JAX's IndivisibleError, an IndexError, ...
                    raise ShapeError(f"leaf {layout.keys[i]!r}: its shape "
                                     f"{layout.shapes[i]} cannot be laid out by {place}: "
                                     f"{exc}") from exc


class _Made:
    """Leaves made on devices from the pulled buffers: every bucket moved to every
    device that wants it in one batched `device_put` (or by DLPack from a GPU's own
    buffer), then handed out leaf by leaf."""

    def __init__(self, layout: TreeLayout, buffers: list, of_leaf: dict):
        self.layout = layout
        self.buffers = buffers
        self.of_leaf = of_leaf  # leaf index -> (its bucket's index, its place there)
        self._on: dict = {}   # (bucket index, device) -> the bucket's leaves there
        self._host: dict = {}   # bucket index -> its leaves as views of its host buffer

    def place(self, wanted: list) -> None:
        """Make the leaves of every (bucket index, device) of `wanted` (None: JAX's
        default device)."""
        puts: dict = {}   # None (JAX's default device) or not -> [(b, device, split, values)]
        for b, device in wanted:
            bucket = self.layout.buckets[b]
            gpu_flat = None if device is None else self.buffers[b].get(device)
            if gpu_flat is not None:  # the GPU's own buffer, handed over without a copy
                flat = jax.dlpack.from_dlpack(gpu_flat)
                self._on[(b, device)] = self._split(b, flat)
            elif len(bucket.leaves) <= FEW_LEAVES:  # the host's, leaf by leaf
                puts.setdefault(device is None, []).append(
                    (b, device, False, self.host_leaves(b)))
            else:  # the host's, put whole and split on the device
                puts.setdefault(device is None, []).append(
                    (b, device, True, [self.buffers[b][None]]))
        for default, items in puts.items():  # one call for every device but the default
            values = [v for _, _, _, vs in items for v in vs]
            placed = iter(jax.device_put(values) if default else jax.device_put(
                values, [device for _, device, _, vs in items for _ in vs]))
            for b, device, split, vs in items:
                mine = [next(placed) for _ in vs]
                self._on[(b, device)] = self._split(b, mine[0]) if split else mine

    def _split(self, b: int, flat) -> list:
        bucket = self.layout.buckets[b]
        return unpack(bucket, flat) if bucket.fused else [flat]

    def leaf(self, i: int, resolved: tuple):
        """Leaf i where a place `_resolved` says."""
        place, devices = resolved
        if isinstance(place, PerShard):
            leaf = place.leaf
            shards = [self.on(i, s.device).reshape(s.data.shape)
                      for s in leaf.addressable_shards]
            return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
        if devices:
            value = self.on(i, devices[0])
            if isinstance(place, jax.sharding.Sharding) and value.sharding != place:
                value = jax.device_put(value, place)  # a sharding of one device: as it says
            return value
        return jax.device_put(self.host(i), place)   # a sharding over several devices

    def on(self, i: int, device):
        """Leaf i on `device` (None: JAX's default device), made by `place`."""
        b, k = self.of_leaf[i]
        return self._on[(b, device)][k]

    def host(self, i: int) -> np.ndarray:
        b, k = self.of_leaf[i]
        return self.host_leaves(b)[k]

    def host_leaves(self, b: int) -> list:
        """Bucket b's leaves as views of its host buffer."""
        if b not in self._host:
            self._host[b] = self.layout.buckets[b].views(self.buffers[b][None])
        return self._host[b]


def _buffers(bucket: Bucket, gpus: set) -> dict:
    """A fresh buffer for `bucket` on each GPU of `gpus` (by its JAX device) and on the
    host (under None); never written after the pull, so JAX may alias any of them."""
    found = {None: _aligned_empty(bucket.shape, bucket.dtype)}
    for device in gpus:
        gpu = _gpu_of(device)
        with gpu.activate():
            found[device] = gpu.empty(bucket.shape, bucket.dtype)
    return found


def _aligned_empty(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An uninitialised host array at a multiple of ALIGNMENT bytes, which JAX's CPU
    devices take without a copy (every device's array then shares it: none is ever
    written, and a donated one is copied, not written in place)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _single_device(place):
    """The one device `place` puts a leaf on, or None (several, or JAX's default)."""
    if isinstance(place, jax.Device):
        return place
    if isinstance(place, jax.sharding.Sharding) and len(place.device_set) == 1:
        (device,) = place.device_set
        return device
    return None


def _resolved(place, memo: dict) -> tuple:
    """(place, the devices it needs a leaf's value on: None for JAX's default device;
    none for a sharding over several devices, laid out from the host)."""
    found = memo.get(id(place))
    if found is None:
        if isinstance(place, PerShard):
            devices = [s.device for s in place.leaf.addressable_shards]
        else:
            device = _single_device(place)
            devices = [device] if device is not None or place is None else []
        found = memo[id(place)] = (place, devices)
    return found


def _is_gpu(device) -> bool:
    return device.platform == "gpu" and _gpu_of(device) is not None


def _gpu_of(device):
    """gpukv's device for a JAX GPU device, or None where gpukv does not see that GPU."""
    for gpu in gpu_devices():
        if gpu.physical == device.local_hardware_id and gpu.slot == 0:
            return gpu
    return None

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

from ..device import gpu_devices
from .buckets import Bucket, unpack
from .trees import TreeLayout

#: a bucket of at most this many leaves is put on a device leaf by leaf; a larger one is
#: put whole and split there by one jitted call (on 4 host devices, a put costs about
#: 40 us and a split about 10 us per leaf, plus 350 us per put of 1 MB)
FEW_LEAVES = 8


class PerShard(NamedTuple):
    """Every shard of `leaf`'s sharding holds the whole value (shaped as the shard)."""
    leaf: jax.Array


def pull(kv, layout: TreeLayout, rows: list, divide_by: int | None = None) -> list:
    """The leaves of every row of places (a list of places, one per leaf), pulled, and
    with `divide_by` divided by it (in each buffer, as `x / n` rounds in its dtype)."""
    devices = {d for row in rows for place in row for d in _single_devices(place)}
    gpus = {d for d in devices if _is_gpu(d)}
    buffers = [_buffers(bucket, gpus) for bucket in layout.buckets]
    if buffers:
        kv.pull(layout.bucket_keys, out=[list(b.values()) for b in buffers])
    if divide_by is not None:
        for found in buffers:
            for buffer in found.values():
                buffer /= divide_by
    made = _Made(layout, buffers)
    return [[made.leaf(i, place) for i, place in enumerate(row)] for row in rows]


class _Made:
    """Leaves made on devices from the pulled buffers, each bucket moved once per device."""

    def __init__(self, layout: TreeLayout, buffers: list):
        self.layout = layout
        self.buffers = buffers
        self.of_leaf = {i: (b, bucket) for b, bucket in enumerate(layout.buckets)
                        for i in bucket.leaves}
        self._on: dict = {}   # (bucket index, device) -> the bucket's leaves there

    def leaf(self, i: int, place):
        if isinstance(place, PerShard):
            leaf = place.leaf
            shards = [self.on(i, s.device).reshape(s.data.shape)
                      for s in leaf.addressable_shards]
            return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
        device = _single_device(place)
        if device is not None or place is None:
            return self.on(i, device)
        return jax.device_put(self.host(i), place)   # a sharding over several devices

    def on(self, i: int, device):
        """Leaf i on `device` (None: JAX's default device)."""
        b, bucket = self.of_leaf[i]
        made = self._on.get((b, device))
        if made is None:
            gpu_flat = self.buffers[b].get(device)
            if gpu_flat is not None:  # the GPU's own buffer, handed over without a copy
                flat = jax.dlpack.from_dlpack(gpu_flat)
                made = unpack(bucket, flat, self.layout.shapes) if bucket.fused else [flat]
            elif len(bucket.leaves) <= FEW_LEAVES:  # the host's, leaf by leaf
                made = jax.device_put(self.host_leaves(b), device)
            else:  # the host's, put whole and split on the device
                made = unpack(bucket, jax.device_put(self.buffers[b][None], device),
                              self.layout.shapes)
            self._on[(b, device)] = made
        return made[bucket.leaves.index(i)]

    def host(self, i: int) -> np.ndarray:
        b, bucket = self.of_leaf[i]
        return self.host_leaves(b)[bucket.leaves.index(i)]

    def host_leaves(self, b: int) -> list:
        """Bucket b's leaves as views of its host buffer."""
        flat, bucket = self.buffers[b][None], self.layout.buckets[b]
        shapes = [self.layout.shapes[i] for i in bucket.leaves]
        ends = np.cumsum([int(np.prod(shape, dtype=np.int64)) for shape in shapes]).tolist()
        flat = flat.reshape(-1)
        return [flat[start:end].reshape(shape)
                for start, end, shape in zip([0, *ends[:-1]], ends, shapes)]


def _buffers(bucket: Bucket, gpus: set) -> dict:
    """A fresh buffer for `bucket` on each GPU of `gpus` (by its JAX device) and on the
    host (under None); never written after the pull, so JAX may alias any of them."""
    found = {None: np.empty(bucket.shape, bucket.dtype)}
    for device in gpus:
        gpu = _gpu_of(device)
        with gpu.activate():
            found[device] = gpu.empty(bucket.shape, bucket.dtype)
    return found


def _single_device(place):
    """The one device `place` puts a leaf on, or None (several, or JAX's default)."""
    if isinstance(place, jax.Device):
        return place
    if isinstance(place, jax.sharding.Sharding) and len(place.device_set) == 1:
        (device,) = place.device_set
        return device
    return None


def _single_devices(place) -> list:
    if isinstance(place, PerShard):
        return [s.device for s in place.leaf.addressable_shards]
    device = _single_device(place)
    return [] if device is None else [device]


def _is_gpu(device) -> bool:
    return device.platform == "gpu" and _gpu_of(device) is not None


def _gpu_of(device):
    """gpukv's device for a JAX GPU device, or None where gpukv does not see that GPU."""
    for gpu in gpu_devices():
        if gpu.physical == device.local_hardware_id and gpu.slot == 0:
            return gpu
    return None

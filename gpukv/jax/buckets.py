"""Buckets: the leaves of a pytree grouped into a few store keys, as PyTorch DDP (and
`gpukv.torch.Trainer`) group gradients, so that a tree of 200 small leaves costs what a
few keys cost.

A bucket is consecutive leaves of one dtype, up to `BUCKET_BYTES`; a leaf of
`ALONE_BYTES` or more, or one the store's PowerSGD compresses (`low_rank_leaves`), is a
bucket of its own. A bucket of one leaf is that leaf's key (named by its path); a bucket
of several is one flat key named ``first..last`` by their paths, packed (NumPy on host
devices, one jitted call on a GPU) and unpacked on the device.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..encoding.compressors import compresses_key

#: bucket capacity in bytes (PyTorch DDP's default)
BUCKET_BYTES = 25 << 20
#: a leaf of at least this many bytes keeps a key of its own: packing it would cost more
#: (a copy per device) than its key costs
ALONE_BYTES = 256 << 10


class Bucket(NamedTuple):
    """A store key and the leaves it holds (their indices in the tree, in order)."""
    key: str
    leaves: tuple
    shape: tuple          # the key's shape: the leaf's own, or (total size,)
    dtype: np.dtype
    shapes: tuple         # each leaf's shape
    ends: tuple           # where each leaf ends in the flat key

    @property
    def fused(self) -> bool:
        return len(self.leaves) > 1

    def views(self, flat) -> list:
        """The leaves as views of the bucket's flat value (any array library's)."""
        flat = flat.reshape(-1)
        return [flat[start:end].reshape(shape) for start, end, shape
                in zip((0, *self.ends[:-1]), self.ends, self.shapes)]


def plan(keys: list, shapes: list, dtypes: list, capacity: int,
         alone: frozenset = frozenset()) -> list[Bucket]:
    """Buckets of consecutive leaves of one dtype, each up to `capacity` bytes (0: one
    leaf per bucket); the leaves whose indices are in `alone` each in a bucket of its
    own."""
    buckets: list[Bucket] = []
    group: list[int] = []
    size = 0

    def close() -> None:
        if not group:
            return
        mine = tuple(tuple(shapes[i]) for i in group)
        ends = tuple(np.cumsum([_count(shape) for shape in mine]).tolist())
        first, last = group[0], group[-1]
        if len(group) == 1:
            buckets.append(Bucket(keys[first], (first,), mine[0], dtypes[first], mine, ends))
        else:
            buckets.append(Bucket(f"{keys[first]}..{keys[last]}", tuple(group), (ends[-1],),
                                  dtypes[first], mine, ends))
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        nbytes = _count(shape) * dtype.itemsize
        own = nbytes >= ALONE_BYTES or i in alone
        if group and (own or dtype != dtypes[group[0]] or capacity == 0
                      or size + nbytes > capacity):  # (0: alone, even when empty)
            close()
            group, size = [], 0
        group.append(i)
        size += nbytes
        if own:
            close()
            group, size = [], 0
    close()
    return buckets


def low_rank_leaves(comp, shapes: list, dtypes: list) -> frozenset:
    """The indices of the leaves the low-rank compressor `comp` compresses (None: none):
    flattened into a shared key, a matrix would cross uncompressed."""
    if comp is None:
        return frozenset()
    return frozenset(i for i, (shape, dtype) in enumerate(zip(shapes, dtypes))
                     if compresses_key(comp, dtype, shape))


def pack(groups: list, device) -> list:
    """Each group of arrays (a fused bucket's leaves of a tree on `device`) as one flat
    array: one jitted call for JAX arrays all on one accelerator, else NumPy on the host
    (where a JAX array is read without a copy, and NumPy copies faster than XLA's CPU
    code)."""
    if device is not None and device.platform != "cpu" and all(
            isinstance(x, jax.Array) and x.devices() == {device} for g in groups for x in g):
        return _pack_jitted(groups)
    return [np.concatenate([np.asarray(x).reshape(-1) for x in g]) for g in groups]


@jax.jit
def _pack_jitted(groups):
    return [jnp.concatenate([x.reshape(-1) for x in g]) for g in groups]


def unpack(bucket: Bucket, flat) -> list:
    """The leaves of `bucket` from its flat value (a JAX array on one device), on that
    device, by one jitted call."""
    return _splitter(bucket)(flat)


@functools.cache
def _splitter(bucket: Bucket):
    return jax.jit(bucket.views)


def _count(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))

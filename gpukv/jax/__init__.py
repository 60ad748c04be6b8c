"""Pytrees of JAX arrays in a gpukv store: leaves bucketed into a few keys, pulls return
new arrays.

    import gpukv, gpukv.jax
    kv = gpukv.create('device')
    gpukv.jax.init_tree(kv, params)                 # the tree's leaves, in a few keys
    kv.set_optimizer(gpukv.optim.create('sgd', learning_rate=0.1))
    for shards in batches:                          # one shard per device
        grads = [jax.grad(loss)(params, *shard) for shard in shards]
        gpukv.jax.push_tree(kv, grads)              # summed over devices, SGD on the store
        params = gpukv.jax.pull_tree(kv, params)    # new arrays, where params' leaves were

Leaves are named ``prefix + jax.tree_util.keystr(path)``, e.g. ``"['dense']['w']"``; a
prefix keeps several trees apart in one store. Consecutive leaves of one dtype share a
key up to `bucket_bytes` (25 MB, as PyTorch DDP; a bucket of one leaf is that leaf's
key, one of several is named ``first..last``), and a leaf of 256 KiB or more keeps its
own (packing it would cost more than its key); ``bucket_bytes=0`` gives every leaf its
own key, which layer-wise optimizers on the store ('lamb') and per-key `lr_mult` /
`wd_mult` need. Under PowerSGD, set on the store before `init_tree`, every matrix it
compresses keeps its own key too (a flat key crosses uncompressed); PowerSGD set after
`init_tree` put such matrices in buckets makes the next push an ArgumentError.

While JAX's x64 is off (its default) a float64, int64, uint64 or complex128 leaf is a
DTypeError naming it, in `init_tree` and in every later pull: JAX would truncate it.

`init_tree` keeps the tree's structure: every later call on its prefix must pass a tree
of that structure, else a gpukv error naming what differs, and nothing changes.

A leaf may be on one device or sharded over several (any `jax.sharding`): each
addressable shard is a device's value in a push (a replicated array counts once per
device, as PyTorch DDP counts replicas), `init_tree` takes the leaf's whole value, and
`pull_tree` lays the value out as its template's sharding says.

Calls must stay outside `jax.jit`, `vmap`, `grad` and other transforms: inside one, a
pull would be compiled in as a constant; gpukv refuses them at trace time.

JAX arrays are immutable, so a pull never writes into one: each key is pulled into a
fresh buffer, on a GPU the leaf's own (handed to JAX by DLPack, no copy) and elsewhere
the host's, then placed. Only this package imports JAX (`import gpukv` never does).
"""
from __future__ import annotations

import numbers

import numpy as np

from .._errors import ArgumentError, ArgumentKindError, BackendError, DTypeError

try:
    import jax
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendError("gpukv.jax needs JAX: pip install 'gpukv[jax]' (JAX, and optax for "
                       "the update beside the store)") from exc

from ..encoding.compressors import low_rank_compressor
from ..store.base import KVStore
from . import placing, pushing, trees
from .buckets import BUCKET_BYTES, low_rank_leaves, plan
from .leaves import check_held, outside_transforms, whole

__all__ = ["init_tree", "push_tree", "pull_tree", "pushpull_tree", "mean_tree",
           "BUCKET_BYTES"]


def init_tree(kv: KVStore, tree, prefix: str = "", bucket_bytes: int = BUCKET_BYTES) -> None:
    """Create the keys of `tree`'s leaves in the store `kv`, each holding a copy of the
    leaf's whole value, and keep the tree's structure for the later calls on `prefix`.

    `tree`: a pytree of arrays (JAX arrays of any sharding, NumPy arrays). `prefix`: a
    str put before every leaf's path in its key, to keep several trees apart in one
    store. `bucket_bytes`: the most bytes of consecutive leaves of one dtype that share
    a key (0: every leaf its own key); under PowerSGD, every leaf it compresses has its
    own. While JAX's x64 is off, a 64-bit leaf is a DTypeError naming it."""
    outside_transforms("init_tree")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) \
            or bucket_bytes < 0:
        raise ArgumentError(f"bucket_bytes={bucket_bytes!r}: expected an int >= 0")
    trees.check_unused(kv, prefix)
    keys, leaves, treedef = trees.flatten(tree, prefix)
    values = [whole(key, leaf, "init_tree") for key, leaf in zip(keys, leaves)]
    shapes = [tuple(v.shape) for v in values]
    dtypes = [np.dtype(v.dtype) for v in values]
    check_held(keys, dtypes, "init_tree")
    # PowerSGD compresses only a matrix with a key of its own (a flat key crosses as it is)
    alone = low_rank_leaves(low_rank_compressor(kv.gradient_compression), shapes, dtypes)
    layout = trees.TreeLayout(treedef, keys, shapes, dtypes,
                              plan(keys, shapes, dtypes, int(bucket_bytes), alone))
    if layout.buckets:
        kv.init(layout.bucket_keys, [_joined(values, bucket) for bucket in layout.buckets])
    trees.remember(kv, prefix, layout)


def push_tree(kv: KVStore, trees_per_device, prefix: str = "") -> None:
    """Push every leaf of every device's tree into `kv`: the store sums each leaf over
    the devices (and over the workers of a dist store) and applies its updater.

    `trees_per_device`: a list of trees of `init_tree`'s structure under `prefix`, one
    per device, or trees of sharded leaves, each shard a device's value."""
    with kv.refusals_agreed("gpukv.jax.push_tree"):  # a worker refusing alone is named
        outside_transforms("push_tree")
        layout = trees.layout_of(kv, prefix, "push_tree")
        trees.check_low_rank(kv, layout, prefix, "push_tree")
        rows = [row for rows in pushing.rows_of(layout, trees_per_device, prefix,
                                                "push_tree") for row in rows]
        columns = pushing.columns(layout, rows)
    if layout.buckets:
        kv.push(layout.bucket_keys, columns)


def pull_tree(kv: KVStore, like_tree, devices=None, prefix: str = ""):
    """The values `kv` holds under `prefix`, as a tree shaped like `like_tree`, made of
    new JAX arrays.

    Leaves of `like_tree` give shape, dtype and placement (arrays, or
    `jax.ShapeDtypeStruct`s, of `init_tree`'s structure). With `devices` (a list of
    `jax.Device`s or shardings) the result is a list of trees, one on each; without, one
    tree, each leaf on the device or sharding of its `like_tree` leaf (JAX's default
    device when it has none).
    """
    outside_transforms("pull_tree")
    layout = trees.layout_of(kv, prefix, "pull_tree")
    check_held(layout.keys, layout.dtypes, "pull_tree")
    likes = trees.leaves(layout, like_tree, prefix, "like_tree")
    trees.check_like(layout, likes)
    if devices is None:
        rows = [[_returned_place(like, whole=True) for like in likes]]
    else:
        rows = [[device] * len(likes) for device in _device_list(devices)]
    made = [jax.tree_util.tree_unflatten(layout.treedef, leaves)
            for leaves in placing.pull(kv, layout, rows)]
    return made if devices is not None else made[0]


def pushpull_tree(kv: KVStore, trees_per_device, prefix: str = "") -> list:
    """Push `trees_per_device` into `kv` under `prefix` as `push_tree` does, then pull:
    one tree of new arrays per tree given, each leaf placed as that tree's leaf was (a
    sharded leaf: every shard holds the whole value)."""
    with kv.refusals_agreed("gpukv.jax.pushpull_tree"):
        outside_transforms("pushpull_tree")
        layout = trees.layout_of(kv, prefix, "pushpull_tree")
        trees.check_low_rank(kv, layout, prefix, "pushpull_tree")
        check_held(layout.keys, layout.dtypes, "pushpull_tree")
        per_tree = pushing.rows_of(layout, trees_per_device, prefix, "pushpull_tree")
    return _push_pull(kv, layout, per_tree, trees_per_device)


def mean_tree(kv: KVStore, trees_per_device, prefix: str = "") -> list:
    """The mean of `trees_per_device` over every device of every worker, as
    `jax.lax.pmean` gives it (the sum, divided by the number of devices): one tree per
    tree given, placed as `pushpull_tree` places them, for an optimizer beside the store
    (optax). `kv` must have no optimizer set, so that a push stores the sum; `prefix`
    names the tree as in `init_tree`; every leaf must be floating-point."""
    with kv.refusals_agreed("gpukv.jax.mean_tree"):
        outside_transforms("mean_tree")
        if kv.type == "dist_async":  # (which applies each push as it comes, never a sum)
            raise ArgumentError("gpukv.jax.mean_tree: a dist_async store applies every "
                                "push with its optimizer as it comes, and keeps no sum; "
                                "use dist_sync (or push_tree and pull_tree, which run the "
                                "store's optimizer)")
        if kv.has_updater:  # a push would update the values, not store the sum
            raise ArgumentError("gpukv.jax.mean_tree: the store has an optimizer or "
                                "updater, so a push would update its values rather than "
                                "store their sum; use a store without one (push_tree and "
                                "pull_tree run the store's optimizer)")
        layout = trees.layout_of(kv, prefix, "mean_tree")
        trees.check_low_rank(kv, layout, prefix, "mean_tree")
        check_held(layout.keys, layout.dtypes, "mean_tree")
        for key, dtype in zip(layout.keys, layout.dtypes):
            if dtype.kind != "f" and dtype.name != "bfloat16":
                raise DTypeError(f"leaf {key!r}: mean_tree averages floating-point leaves, "
                                 f"not {dtype}")
        per_tree = pushing.rows_of(layout, trees_per_device, prefix, "mean_tree")
    count = sum(len(rows) for rows in per_tree)
    counts = kv.workers_max(np.array([count, -count], np.int64), "mean_tree: devices")
    if counts[0] != -counts[1]:
        raise ArgumentError(f"gpukv.jax.mean_tree: workers push from different numbers of "
                            f"devices (between {-counts[1]} and {counts[0]}); the mean "
                            f"needs the same number on every worker")
    return _push_pull(kv, layout, per_tree, trees_per_device, count * kv.num_workers)


# ------------------------------------------------------------------------ helpers
def _push_pull(kv: KVStore, layout: trees.TreeLayout, per_tree: list, trees_per_device,
               divide_by: int | None = None) -> list:
    """Push the rows of every tree, then pull a tree back for each, placed as it was
    (and divided by `divide_by`)."""
    if layout.buckets:
        kv.push(layout.bucket_keys,
                pushing.columns(layout, [row for rows in per_tree for row in rows]))
    places = [[_returned_place(leaf) for leaf in jax.tree_util.tree_leaves(tree)]
              for tree in trees_per_device]
    return [jax.tree_util.tree_unflatten(layout.treedef, leaves)
            for leaves in placing.pull(kv, layout, places, divide_by)]


def _joined(values: list, bucket) -> object:
    """A bucket's initial value: its leaf's, or its leaves' flattened one after another."""
    if not bucket.fused:
        return values[bucket.leaves[0]]
    return np.concatenate([_host(values[i]).reshape(-1) for i in bucket.leaves])


def _host(value) -> np.ndarray:
    return value.get() if hasattr(value, "get") else np.asarray(value)


def _returned_place(leaf, whole: bool = False):
    """Where a leaf's new value goes: as `leaf` is (`pushpull_tree`'s pushed leaf, laid
    out by a sharding, on one device or several, with that sharding and shape; with
    `whole`, `pull_tree`'s template, the whole value laid out by its sharding). A leaf
    on JAX's default device and committed to none comes back so too: the next jitted
    step may then mix it with arrays of any one device, as it did."""
    if isinstance(leaf, jax.Array):
        if not leaf.committed:
            return None
        if whole or isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding):
            return leaf.sharding
        return placing.PerShard(leaf)
    return getattr(leaf, "sharding", None) if whole else None


def _device_list(devices) -> list:
    if not isinstance(devices, (list, tuple)) or not devices:
        raise ArgumentKindError(f"devices: expected a non-empty list of jax devices or "
                                f"shardings, got {type(devices).__name__}")
    for i, device in enumerate(devices):
        if not isinstance(device, (jax.Device, jax.sharding.Sharding)):
            raise ArgumentKindError(f"devices[{i}]: expected a jax.Device or a "
                                    f"jax.sharding.Sharding, got {type(device).__name__}")
    return list(devices)

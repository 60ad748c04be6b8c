"""Pytrees of JAX arrays in a gpukv store: one key per leaf, pulls return new arrays.

    import gpukv, gpukv.jax
    kv = gpukv.create('device')
    gpukv.jax.init_tree(kv, params)                 # one key per leaf, named by its path
    kv.set_optimizer(gpukv.optim.create('sgd', learning_rate=0.1))
    for shards in batches:                          # one shard per device
        grads = [jax.grad(loss)(params, *shard) for shard in shards]
        gpukv.jax.push_tree(kv, grads)              # summed over devices, SGD on the store
        params = gpukv.jax.pull_tree(kv, params)    # new arrays, where params' leaves were

JAX arrays are immutable, so a pull never writes into one: the store's value is pulled
into a fresh host buffer and `jax.device_put` onto the leaf's device (or sharding).
Pushed leaves go to the store without a copy where DLPack or `__array__` allows it
(bfloat16 included). A leaf's key is `prefix + jax.tree_util.keystr(path)`, e.g.
``"['dense']['w']"``; a prefix keeps several trees apart in one store.

Only this module imports JAX (`import gpukv` never does).
"""
from __future__ import annotations

import numpy as np

from ._errors import ArgumentError, ArgumentKindError, BackendError, GpukvError

try:
    import jax
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendError("gpukv.jax needs JAX: pip install jax") from exc

from .device import adopt
from .store.base import KVStore

__all__ = ["init_tree", "push_tree", "pull_tree", "pushpull_tree"]


def init_tree(kv: KVStore, tree, prefix: str = "") -> None:
    """Create one key per leaf of `tree`, named by its path, holding a copy of the leaf."""
    keys, leaves, _ = _flatten(tree, prefix, "tree")
    if keys:
        kv.init(keys, [_as_array(key, leaf) for key, leaf in zip(keys, leaves)])


def push_tree(kv: KVStore, trees_per_device, prefix: str = "") -> None:
    """Push every leaf of every device's tree (a list of trees of one structure, one per
    device); the store sums a leaf over the devices and applies its updater."""
    keys, columns, _ = _flatten_all(trees_per_device, prefix)
    if keys:
        kv.push(keys, columns)


def pull_tree(kv: KVStore, like_tree, devices=None, prefix: str = ""):
    """The stored values as a tree shaped like `like_tree`, made of new JAX arrays.

    Leaves of `like_tree` give shape, dtype and placement (arrays, or
    `jax.ShapeDtypeStruct`s). With `devices` (a list of `jax.Device`s or shardings) the
    result is a list of trees, one on each; without, one tree, each leaf on the device or
    sharding of its `like_tree` leaf (the default device when it has none).
    """
    keys, likes, treedef = _flatten(like_tree, prefix, "like_tree")
    specs = [_shape_dtype(key, like) for key, like in zip(keys, likes)]
    if devices is None:
        places = [[getattr(like, "sharding", None) for like in likes]]
    else:
        places = [[device] * len(keys) for device in _device_list(devices)]
    trees = _pull(kv, keys, specs, places, treedef)
    return trees if devices is not None else trees[0]


def pushpull_tree(kv: KVStore, trees_per_device, prefix: str = "") -> list:
    """Push every device's tree as `push_tree` does, then pull: one tree of new arrays
    per device, each leaf where that device's leaf was."""
    keys, columns, treedef = _flatten_all(trees_per_device, prefix)
    if keys:
        kv.push(keys, columns)
    specs = [(tuple(col[0].shape), col[0].dtype) for col in columns]
    places = [[getattr(leaf, "sharding", None) for leaf in jax.tree_util.tree_leaves(tree)]
              for tree in trees_per_device]
    return _pull(kv, keys, specs, places, treedef)


# ------------------------------------------------------------------------ helpers
def _flatten(tree, prefix: str, where: str) -> tuple[list, list, object]:
    """Keys (prefix + leaf path), leaves and treedef of `tree`."""
    if not isinstance(prefix, str):
        raise ArgumentKindError(f"prefix: expected a str, got {type(prefix).__name__}")
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = [prefix + jax.tree_util.keystr(path) for path, _ in with_path]
    return keys, [leaf for _, leaf in with_path], treedef


def _flatten_all(trees_per_device, prefix: str) -> tuple[list, list, object]:
    """Keys, per-key lists of every device's (adopted) leaf, and the common treedef."""
    if not isinstance(trees_per_device, (list, tuple)) or not trees_per_device:
        raise ArgumentKindError(f"trees_per_device: expected a non-empty list of trees "
                                f"(one per device), got {type(trees_per_device).__name__}")
    keys, first, treedef = _flatten(trees_per_device[0], prefix, "trees_per_device[0]")
    columns = [[_as_array(key, leaf)] for key, leaf in zip(keys, first)]
    for r, tree in enumerate(trees_per_device[1:], start=1):
        mine, leaves, my_def = _flatten(tree, prefix, f"trees_per_device[{r}]")
        if my_def != treedef:
            raise ArgumentError(_structure_mismatch(keys, mine, r, treedef, my_def))
        for column, key, leaf in zip(columns, keys, leaves):
            column.append(_as_array(key, leaf))
    return keys, columns, treedef


def _structure_mismatch(keys: list, mine: list, r: int, treedef, my_def) -> str:
    """Which leaf makes device r's tree differ from device 0's."""
    missing = [k for k in keys if k not in set(mine)]
    extra = [k for k in mine if k not in set(keys)]
    start = f"trees_per_device[{r}] differs in structure from trees_per_device[0]"
    if missing:
        return f"{start}: it has no leaf {missing[0]!r}"
    if extra:
        return f"{start}: it has a leaf {extra[0]!r} that trees_per_device[0] lacks"
    return f"{start}: {my_def} where trees_per_device[0] is {treedef}"


def _as_array(key: str, leaf):
    """`leaf` as an array the store takes without copying; typed error naming the leaf."""
    try:
        array = adopt(leaf)
    except GpukvError as exc:
        raise type(exc)(f"leaf {key!r}: {exc}") from exc
    if array is None:
        raise ArgumentKindError(f"leaf {key!r}: expected an array, got {type(leaf).__name__}")
    return array


def _shape_dtype(key: str, like) -> tuple:
    shape, dtype = getattr(like, "shape", None), getattr(like, "dtype", None)
    if shape is None or dtype is None:
        raise ArgumentKindError(f"leaf {key!r} of like_tree: expected an array or a "
                                f"jax.ShapeDtypeStruct, got {type(like).__name__}")
    return tuple(shape), np.dtype(dtype)


def _device_list(devices) -> list:
    if not isinstance(devices, (list, tuple)) or not devices:
        raise ArgumentKindError(f"devices: expected a non-empty list of jax devices or "
                                f"shardings, got {type(devices).__name__}")
    for i, device in enumerate(devices):
        if not isinstance(device, (jax.Device, jax.sharding.Sharding)):
            raise ArgumentKindError(f"devices[{i}]: expected a jax.Device or a "
                                    f"jax.sharding.Sharding, got {type(device).__name__}")
    return list(devices)


def _pull(kv: KVStore, keys: list, specs: list, places: list, treedef) -> list:
    """Pull every key once into a fresh host buffer; one tree per row of `places`.

    The buffers are never written again, so a `device_put` that aliases one is safe.
    """
    buffers = [np.empty(shape, dtype) for shape, dtype in specs]
    if keys:
        kv.pull(keys, out=buffers)
    return [jax.tree_util.tree_unflatten(
        treedef, [jax.device_put(buf, place) for buf, place in zip(buffers, row)])
        for row in places]

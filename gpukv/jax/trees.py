"""The pytree `init_tree` was given, kept per (store, prefix): its structure, its leaves'
keys, shapes and dtypes, and the buckets they travel in. Every later call on the prefix
is checked against it, so a tree that lost a leaf, or became a tuple, is refused rather
than pushed in part.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import numpy as np

from .._errors import ArgumentError, ArgumentKindError, DTypeError, ShapeError
from ..encoding.compressors import low_rank_compressor
from .buckets import low_rank_leaves

#: store -> {prefix: TreeLayout}, for as long as the store lives
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TreeLayout(NamedTuple):
    treedef: object
    keys: list            # each leaf's name: prefix + its path
    shapes: list
    dtypes: list
    buckets: list         # of Bucket, in leaf order

    @property
    def bucket_keys(self) -> list:
        return [b.key for b in self.buckets]


def flatten(tree, prefix: str) -> tuple[list, list, object]:
    """Keys (prefix + leaf path), leaves and treedef of `tree`."""
    check_prefix(prefix)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = [prefix + jax.tree_util.keystr(path) for path, _ in with_path]
    return keys, [leaf for _, leaf in with_path], treedef


def check_prefix(prefix) -> None:
    if not isinstance(prefix, str):
        raise ArgumentKindError(f"prefix: expected a str, got {type(prefix).__name__}")


def check_unused(kv, prefix: str) -> None:
    """An ArgumentError where `init_tree` already gave `prefix` a tree in `kv`: a second
    would leave the first one's keys in the store with no tree to reach them."""
    check_prefix(prefix)
    if prefix in _LAYOUTS.get(kv, {}):
        raise ArgumentError(f"gpukv.jax.init_tree: prefix {prefix!r} holds a tree already "
                            f"in this store; give the new tree a prefix of its own")


def remember(kv, prefix: str, layout: TreeLayout) -> None:
    _LAYOUTS.setdefault(kv, {})[prefix] = layout


def layout_of(kv, prefix: str, call: str) -> TreeLayout:
    """The layout `init_tree` kept for `prefix` in `kv`; an error saying to call it first."""
    check_prefix(prefix)
    layout = _LAYOUTS.get(kv, {}).get(prefix)
    if layout is None:
        raise ArgumentError(f"gpukv.jax.{call}: no tree was given to init_tree with prefix "
                            f"{prefix!r} in this store (in this process); call "
                            f"gpukv.jax.init_tree(kv, tree, prefix={prefix!r}) first")
    return layout


def check_low_rank(kv, layout: TreeLayout, prefix: str, call: str) -> None:
    """An ArgumentError where the store compresses with PowerSGD, set after `init_tree`
    flattened a matrix it compresses into a shared key: sent that way, the matrix would
    cross uncompressed."""
    compression = kv.gradient_compression
    compressed = low_rank_leaves(low_rank_compressor(compression), layout.shapes,
                                 layout.dtypes)
    flattened = [layout.keys[i] for b in layout.buckets if b.fused for i in b.leaves
                 if i in compressed]
    if flattened:
        raise ArgumentError(
            f"gpukv.jax.{call}: the store compresses with PowerSGD ({compression!r}), set "
            f"after init_tree laid out prefix {prefix!r}: its buckets hold leaf "
            f"{flattened[0]!r} flattened with others, which PowerSGD would send "
            f"uncompressed ({len(flattened)} such "
            f"{'matrix' if len(flattened) == 1 else 'matrices'}); give init_tree the tree "
            f"again after set_gradient_compression (under a new prefix, or in a new "
            f"store): it gives every such matrix a key of its own; nothing was done")


def leaves(layout: TreeLayout, tree, prefix: str, where: str) -> list:
    """The leaves of `tree`, which must have the structure `init_tree` was given."""
    keys, found, treedef = flatten(tree, prefix)
    if treedef != layout.treedef:
        raise ArgumentError(_difference(layout, keys, treedef, where))
    return found


def check_like(layout: TreeLayout, likes: list) -> None:
    """Leaves of a template tree (arrays or `jax.ShapeDtypeStruct`s) match the keys."""
    for key, like, shape, dtype in zip(layout.keys, likes, layout.shapes, layout.dtypes):
        got_shape, got_dtype = getattr(like, "shape", None), getattr(like, "dtype", None)
        if got_shape is None or got_dtype is None:
            raise ArgumentKindError(f"leaf {key!r} of like_tree: expected an array or a "
                                    f"jax.ShapeDtypeStruct, got {type(like).__name__}")
        if tuple(got_shape) != shape:
            raise ShapeError(f"leaf {key!r} of like_tree: shape {tuple(got_shape)}, the key "
                             f"holds {shape}")
        if np.dtype(got_dtype) != dtype:
            raise DTypeError(f"leaf {key!r} of like_tree: dtype {np.dtype(got_dtype)}, the "
                             f"key holds {dtype}")


def _difference(layout: TreeLayout, keys: list, treedef, where: str) -> str:
    """What makes a tree's structure differ from the one `init_tree` was given."""
    start = f"{where} differs in structure from the tree init_tree was given"
    missing = [k for k in layout.keys if k not in set(keys)]
    if missing:
        below = [k for k in keys if k.startswith(missing[0])]  # (the leaf made a subtree)
        if below:
            return (f"{start}: where init_tree's has the leaf {missing[0]!r}, it has "
                    f"{len(below)} leaves ({', '.join(map(repr, below[:3]))}"
                    f"{', ...' if len(below) > 3 else ''}): give it one array there; "
                    f"nothing was done")
        return f"{start}: it has no leaf {missing[0]!r}; nothing was done"
    extra = [k for k in keys if k not in set(layout.keys)]
    if extra:
        return f"{start}: it has a leaf {extra[0]!r} that the tree lacks; nothing was done"
    return f"{start}: {treedef} where init_tree's is {layout.treedef}; nothing was done"

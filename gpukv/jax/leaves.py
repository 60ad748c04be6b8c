"""JAX leaves on their way into the store: each leaf as the values of the devices it is
on, or a gpukv error naming its key when it cannot be one (a tracer, a deleted array,
a dtype the store does not take).

A leaf on one device is that device's value. A leaf spread over several devices (any
`jax.sharding`) gives one value per addressable shard, each a device's: a replicated
array counts once per device, as PyTorch DDP counts replicas, and an array sharded along
its first axis (what `shard_map(..., out_specs=P('i'))` returns) gives each device its
own slice.
"""
from __future__ import annotations

import jax
import numpy as np

from .._errors import ArgumentError, ArgumentKindError, DTypeError, GpukvError, ShapeError
from ..device import adopt

try:  # where JAX keeps whether a trace is under way (no public name for it)
    from jax._src.core import trace_state_clean as _not_tracing
except ImportError:  # pragma: no cover - depends on the JAX version
    def _not_tracing() -> bool:
        return True


def outside_transforms(call: str) -> None:
    """Refuse `call` while JAX traces a function: inside `jit`, `vmap`, `grad`, `scan`...
    a store's value read at trace time would be compiled in as a constant, and a push
    would run once, at trace time, not at every call."""
    if not _not_tracing():
        raise ArgumentError(f"gpukv.jax.{call}: called while JAX traces a function (jit, "
                            f"vmap, grad, scan, ...); gpukv calls must stay outside "
                            f"transforms, on concrete arrays")


def checked(key: str, leaf, call: str) -> None:
    """Refuse a leaf no device value can be read from."""
    if isinstance(leaf, jax.core.Tracer):
        raise ArgumentError(f"leaf {key!r}: a JAX tracer; gpukv.jax.{call} must be called "
                            f"outside jit, vmap, grad and other transforms, on concrete "
                            f"arrays")
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise ArgumentError(f"leaf {key!r}: the array was deleted (donated to a jitted "
                            f"function, or deleted by hand)")


def check_held(keys: list, dtypes: list, call: str) -> None:
    """A DTypeError naming the first leaf whose dtype JAX cannot hold now (float64, int64,
    uint64 and complex128 while x64 is off): JAX would make its pulled value 32-bit,
    truncating it, and the tree pulled would no longer match the keys. Each dtype is
    asked once (a pull's check, for every leaf)."""
    held = {d: np.dtype(jax.dtypes.canonicalize_dtype(d)) for d in set(map(np.dtype, dtypes))}
    for key, dtype in zip(keys, map(np.dtype, dtypes)):
        narrowed = held[dtype]
        if narrowed == dtype:
            continue
        start = (f"gpukv.jax.{call}: leaf {key!r} is {dtype}, which JAX holds as {narrowed} "
                 f"while x64 is off (jax_enable_x64)")
        if call == "init_tree":
            raise DTypeError(f"{start}: pulled, it would come back truncated; cast it to "
                             f"32 bits (float32, int32) first, or enable x64 "
                             f"(jax.config.update('jax_enable_x64', True)); nothing was "
                             f"created")
        raise DTypeError(f"{start}, turned off since init_tree: pulled, it would come back "
                         f"truncated; enable x64 again (jax.config.update("
                         f"'jax_enable_x64', True)), or give init_tree the tree cast to "
                         f"{narrowed} under a new prefix; nothing was done")


def device_values(key: str, leaf, call: str) -> list:
    """(device or None, value) of every device `leaf` is on, in the order of its shards;
    None for a leaf that is no JAX array (a NumPy array: one value, on the host)."""
    checked(key, leaf, call)
    if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1:
        return [(shard.device, shard.data) for shard in leaf.addressable_shards]
    if isinstance(leaf, jax.Array):
        (device,) = leaf.sharding.device_set
        return [(device, leaf)]
    return [(None, store_array(key, leaf))]


def sharded(leaf) -> bool:
    """Whether `leaf` is a JAX array laid out by a sharding (over one device or more),
    whose shards may be slices of a per-device stack."""
    return isinstance(leaf, jax.Array) and not isinstance(
        leaf.sharding, jax.sharding.SingleDeviceSharding)


def whole(key: str, leaf, call: str):
    """The whole value of `leaf` (a sharded array gathered, a replicated one read once),
    as an array the store takes."""
    checked(key, leaf, call)
    if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1:
        if leaf.is_fully_replicated:
            return store_array(key, leaf.addressable_shards[0].data)
        if not leaf.is_fully_addressable:
            raise ArgumentError(f"leaf {key!r}: sharded over devices of other processes; "
                                f"gpukv.jax.{call} takes arrays this process holds whole "
                                f"or replicated")
        return store_array(key, np.asarray(leaf))
    return store_array(key, leaf)


def store_array(key: str, value):
    """`value` as an array the store takes without copying; a gpukv error naming `key`
    for anything JAX or the store refuses."""
    try:
        array = adopt(value)
    except GpukvError as exc:  # (JAX's own refusals among them: see `adopt`)
        raise type(exc)(f"leaf {key!r}: {exc}") from exc
    if array is None:
        raise ArgumentKindError(f"leaf {key!r}: expected an array, got {type(value).__name__}")
    return array


def as_key_shape(key: str, value, shape: tuple, stacked: bool):
    """A device's value of a leaf whose key holds `shape`: of that shape, or, when
    `stacked` (a shard of an array sharded over devices), with a leading axis of 1 more,
    dropped."""
    got = tuple(value.shape)
    if got == shape:
        return value
    if stacked and got == (1, *shape):
        return value.reshape(shape)
    raise ShapeError(f"leaf {key!r}: a device's value has shape {got}, the key holds "
                     f"{shape} (a sharded leaf gives one value per shard)")

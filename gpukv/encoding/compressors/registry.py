"""The compressors by type name: `@register('2bit')` on a class makes
`set_gradient_compression({'type': '2bit', ...})` build it."""
from __future__ import annotations

from ..._errors import ArgumentError, ArgumentKindError
from ...device import host_jit
from .base import Compressor

_REGISTRY: dict[str, type[Compressor]] = {}
NONE = "none"  # the type that turns compression off


def register(*names: str):
    """Class decorator: the compressor answers to each of `names` (lower case)."""
    def add(cls: type[Compressor]) -> type[Compressor]:
        for name in names:
            if name in _REGISTRY or name == NONE:
                raise ValueError(f"compressor type {name!r} is registered twice")
            _REGISTRY[name] = cls
        return cls
    return add


def registered() -> list[type[Compressor]]:
    """Every compressor class, once each, in the order they registered."""
    return list(dict.fromkeys(_REGISTRY.values()))


def type_names() -> list[str]:
    """Every valid 'type', 'none' included, sorted."""
    return sorted([*_REGISTRY, NONE])


def make_compressor(params) -> Compressor | None:
    """Validate a compression dict and build its compressor (None: no compression); a
    malformed GPUKV_HOST_JIT is an ArgumentError here, before any push."""
    if params is None:
        return None
    host_jit.check_setting()
    if not isinstance(params, dict):
        raise ArgumentKindError(
            f"gradient compression: expected a dict such as {{'type': '2bit', "
            f"'threshold': 0.5}}, got {type(params).__name__}")
    valid_types = ", ".join(type_names())
    if "type" not in params:
        raise ArgumentError(f"gradient compression {params!r}: option 'type' is missing; "
                            f"valid types are {valid_types}")
    kind = params["type"]
    if not isinstance(kind, str):
        raise ArgumentKindError(f"gradient compression: option 'type' must be a str, got "
                                f"{type(kind).__name__} {kind!r}; valid types are "
                                f"{valid_types}")
    if kind.lower() not in type_names():
        raise ArgumentError(f"gradient compression: option 'type' is {kind!r}; valid types "
                            f"are {valid_types}")
    kind = kind.lower()
    cls = _REGISTRY.get(kind)
    allowed = tuple(cls.options) if cls is not None else ()
    for option in params:
        if option != "type" and option not in allowed:
            valid = ", ".join(("type",) + allowed)
            raise ArgumentError(f"gradient compression {kind!r}: unknown option {option!r}; "
                                f"valid options are {valid}")
    if cls is None:
        return None
    return cls.build(kind, params)


def low_rank_compressor(params) -> Compressor | None:
    """The compressor `params` make where it is low-rank (PowerSGD, which compresses a
    key as a matrix: one flattened into a key shared with others crosses uncompressed),
    else None; bad `params` are their typed error here, before anything is made."""
    comp = make_compressor(params)
    return comp if comp is not None and comp.low_rank else None

"""Strategy names -> strategy objects.

`STRATEGIES` lists the names; `make_strategy(name, **options)` builds one;
`strategy_class(name)` and `describe()` tell what a name stands for.
A strategy built from a name the caller gave (argument or `GPUKV_STRATEGY`) is marked
`explicit`: the store then sends host arrays through it too (its algorithm runs over
host "devices"), instead of the plain host sum used by default.
"""
from __future__ import annotations

import os

from .._errors import ArgumentError
from ._base import Strategy

STRATEGIES = ("auto", "home", "tree", "ring", "cpu", "nccl")


def _classes() -> dict:
    from .auto import AutoStrategy, delegate_classes
    return {"auto": AutoStrategy, **delegate_classes()}


def strategy_class(name: str) -> type:
    """The class behind strategy `name` (validated like `make_strategy`)."""
    return _classes()[check_name(name)]


def describe() -> dict:
    """{name: first line of the strategy's docstring}."""
    return {name: (cls.__doc__ or "").strip().splitlines()[0]
            for name, cls in _classes().items()}


def check_name(name) -> str:
    """`name` lower-cased, or an ArgumentError naming the valid ones."""
    lowered = name.strip().lower() if isinstance(name, str) else None
    if lowered not in STRATEGIES:
        raise ArgumentError(
            f"strategy {name!r}: unknown; valid strategies are {', '.join(STRATEGIES)}")
    return lowered


def make_strategy(name: str | None = None, *, on_gpu: bool = True, **options) -> Strategy:
    """The strategy called `name`.

    `name=None`: on a GPU store, `$GPUKV_STRATEGY` or else 'auto'; on a host store
    ('local'), the host sum. `options` go to the strategy's constructor (e.g. `matrix`
    for 'tree'/'ring', `machine` for 'auto'). ArgumentError for an unknown name or a
    malformed `GPUKV_HOST_THREADS`.
    """
    from ..device.host_sum import thread_count
    thread_count()  # a malformed GPUKV_HOST_THREADS fails here, when a store is made
    explicit = name is not None
    if name is None:
        env = os.environ.get("GPUKV_STRATEGY", "").strip()
        if on_gpu and env:
            name, explicit = env, True
        elif on_gpu:
            name = "auto"
        else:
            from .host import HostStrategy
            strategy = HostStrategy()
            strategy.explicit = False
            return strategy
    cls = _classes()[check_name(name)]
    strategy = cls(**options)
    strategy.explicit = explicit
    return strategy

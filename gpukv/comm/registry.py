"""Strategy names -> strategy objects.

`STRATEGIES` lists the names; `make_strategy(name, **options)` builds one;
`strategy_class(name)`, `strategy_options(name)` and `describe()` tell what a name stands
for and what it takes.
A strategy the caller gave (a name as argument or in `GPUKV_STRATEGY`, or a Strategy
instance) is marked `explicit`: the store then sends host arrays through it too (its
algorithm runs over host "devices"), instead of the plain host sum used by default.
"""
from __future__ import annotations

import os

from .._errors import ArgumentError, ArgumentKindError
from ._base import Strategy

STRATEGIES = ("auto", "home", "tree", "ring", "cpu", "nccl")


def _classes() -> dict:
    from .auto import AutoStrategy, delegate_classes
    return {"auto": AutoStrategy, **delegate_classes()}


def strategy_class(name: str) -> type[Strategy]:
    """The class behind strategy `name` (validated like `make_strategy`)."""
    return _classes()[check_name(name)]


def strategy_options(name: str) -> set:
    """The keyword options of strategy `name`'s constructor a store passes on (validated
    like `make_strategy`)."""
    return set(strategy_class(name).store_options)


def all_strategy_options() -> set:
    """Every keyword option some strategy takes."""
    return set().union(*(strategy_options(name) for name in STRATEGIES))


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


def make_strategy(name: str | Strategy | None = None, *, on_gpu: bool = True,
                  **options) -> Strategy:
    """The strategy called `name`, or `name` itself when it is a Strategy instance.

    `name=None`: on a GPU store, `$GPUKV_STRATEGY` or else 'auto'; on a host store
    ('local'), the host sum. `options` go to the strategy's constructor (e.g. `matrix`
    for 'tree'/'ring', `array_bound` for 'tree', `machine` for 'auto'). ArgumentError for
    an unknown name or a malformed `GPUKV_HOST_THREADS`; ArgumentKindError for a `name`
    of another kind, or an option the strategy does not take.
    """
    from ..device.host_sum import thread_count
    thread_count()  # a malformed GPUKV_HOST_THREADS fails here, when a store is made
    if isinstance(name, Strategy):
        _refuse_options(options, f"strategy={name!r} is already built; give its options "
                                 f"to its constructor")
        name.explicit = True
        return name
    if name is not None and not isinstance(name, str):
        raise ArgumentKindError(
            f"strategy {name!r}: expected a name (valid strategies are {', '.join(STRATEGIES)})"
            f" or a gpukv.comm.Strategy instance, got {type(name).__name__}")
    explicit = name is not None
    if name is None:
        env = env_strategy() if on_gpu else None
        if env:
            name, explicit = env, True
        elif on_gpu:
            name = "auto"
        else:
            from .host import HostStrategy
            _refuse_options(options, "the host sum of a host store takes no options; name a "
                                     "strategy (strategy='tree', ...) to give it options")
            strategy = HostStrategy()
            strategy.explicit = False
            return strategy
    name = check_name(name)
    takes = strategy_options(name)
    _refuse_options({o: v for o, v in options.items() if o not in takes},
                    f"strategy {name!r} does not take it; it takes "
                    f"{', '.join(sorted(takes)) or 'no options'}")
    strategy = _classes()[name](**options)
    strategy.explicit = explicit
    return strategy


def env_strategy() -> str | None:
    """`$GPUKV_STRATEGY` lower-cased, None when unset or blank; an ArgumentError naming
    the variable when it names no strategy."""
    raw = os.environ.get("GPUKV_STRATEGY", "").strip()
    if not raw:
        return None
    if raw.lower() not in STRATEGIES:
        raise ArgumentError(f"GPUKV_STRATEGY={raw!r}: unknown; valid strategies are "
                            f"{', '.join(STRATEGIES)}")
    return raw.lower()


def _refuse_options(options: dict, why: str) -> None:
    """An ArgumentKindError naming the first of `options` and `why`, when there is one."""
    if options:
        raise ArgumentKindError(f"store option {next(iter(options))!r}: {why}")

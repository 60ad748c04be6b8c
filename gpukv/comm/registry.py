"""Strategy names -> strategy objects."""
from __future__ import annotations

import os

from .._errors import ArgumentError
from ._base import Strategy
from .home import HomeStrategy
from .host import HostStrategy

STRATEGIES = ("auto", "home", "tree", "ring", "cpu", "nccl")


def make_strategy(name: str | None, *, on_gpu: bool) -> Strategy:
    """The strategy called `name` (None: $GPUKV_STRATEGY, else 'auto')."""
    if not on_gpu:
        return HostStrategy()
    if name is None:
        name = os.environ.get("GPUKV_STRATEGY", "").strip() or "auto"
    if not isinstance(name, str) or name.lower() not in STRATEGIES:
        raise ArgumentError(
            f"strategy {name!r}: unknown; valid strategies are {', '.join(STRATEGIES)}")
    name = name.lower()
    if name == "cpu":
        return HostStrategy()
    return HomeStrategy()

"""The GPUKV_* settings a store reads when it is made, each with the reader that refuses it
malformed: a dist store checks them before it agrees with the other processes (so that a
refusal on one is heard by all), and `gpukv info` names every malformed one."""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from .._env import flag, positive_int
from .._errors import GpukvError
from ..comm.plan import topology
from ..comm.registry import env_strategy
from ..device import host_jit
from ..device.base import virtual_gpus

#: the `create` option that wins over each variable: given, the variable is not read
OPTIONS = {"GPUKV_STRATEGY": "strategy", "GPUKV_DETERMINISTIC": "deterministic"}
#: read by GPU stores ('device', 'dist_device_sync') alone: a host store sums on the host
GPU_ONLY = frozenset(["GPUKV_STRATEGY", "GPUKV_VIRTUAL_GPUS"])
#: read by the 'tree' and 'auto' strategies when they are made (each with its
#: MXNET_KVSTORE_TREE_* twin, which it names when that one is malformed)
TREE_CHECKS: dict[str, Callable[[], object]] = {
    "GPUKV_TREE_ARRAY_BOUND": lambda: topology.tree_options("array_bound"),
    "GPUKV_TREE_LINK_USAGE_PENALTY": lambda: topology.tree_options("penalty"),
    "GPUKV_TREE_BACKTRACK": lambda: topology.tree_options("backtrack"),
}


def setting_checks(given: Collection[str] = (), on_gpu: bool = True
                   ) -> dict[str, Callable[[], object]]:
    """{variable: a call that reads it, raising its typed error when it is malformed}
    for each setting a store on GPUs (`on_gpu`) or on the host reads when it is made,
    less those whose option (OPTIONS) is among the `given` options of `create`. (The
    tree's are read by the strategy that needs them: TREE_CHECKS.)"""
    checks: dict[str, Callable[[], object]] = {
        "GPUKV_STRATEGY": env_strategy,
        "GPUKV_DETERMINISTIC": lambda: flag("GPUKV_DETERMINISTIC"),
        "GPUKV_VIRTUAL_GPUS": virtual_gpus,
        "GPUKV_HOST_THREADS": lambda: positive_int("GPUKV_HOST_THREADS"),
        "GPUKV_HOST_JIT": host_jit.check_setting,
    }
    return {name: check for name, check in checks.items()
            if OPTIONS.get(name) not in given and (on_gpu or name not in GPU_ONLY)}


def tree_checks(strategy, given: Collection[str] = ()) -> dict[str, Callable[[], object]]:
    """The TREE_CHECKS a GPU store made with `strategy` (a name, a Strategy instance, made
    already, or None: $GPUKV_STRATEGY, else 'auto') reads when it is made: those of the
    'tree' and 'auto' strategies, less the bound when `array_bound` is given."""
    if strategy is None:
        try:
            strategy = env_strategy() or "auto"
        except GpukvError:
            return {}  # (refused by its own check)
    if not isinstance(strategy, str) or strategy.lower() not in ("tree", "auto"):
        return {}
    return {name: check for name, check in TREE_CHECKS.items()
            if not (name == "GPUKV_TREE_ARRAY_BOUND" and "array_bound" in given)}


def given(options: Mapping[str, object]) -> set[str]:
    """The names of the `create` options given a value (None, every default, is not)."""
    return {name for name, value in options.items() if value is not None}

"""The GPUKV_* settings every store reads, each with the reader that refuses it malformed:
checked together when a store is made, before anything is, and by `gpukv info`."""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from .._env import flag, positive_int
from ..comm.plan import topology
from ..comm.registry import env_strategy
from ..device import host_jit
from ..device.base import virtual_gpus

#: the `create` option that wins over each variable: given, the variable is not read
OPTIONS = {"GPUKV_STRATEGY": "strategy", "GPUKV_DETERMINISTIC": "deterministic",
           "GPUKV_TREE_ARRAY_BOUND": "array_bound"}


#: read by GPU stores ('device', 'nccl', 'dist_device_sync') alone: a host store sums on
#: the host, with no strategy, tree or virtual GPU
GPU_ONLY = frozenset(["GPUKV_STRATEGY", "GPUKV_VIRTUAL_GPUS", "GPUKV_TREE_ARRAY_BOUND",
                      "GPUKV_TREE_LINK_USAGE_PENALTY", "GPUKV_TREE_BACKTRACK"])


def setting_checks(given: Collection[str] = (), on_gpu: bool = True
                   ) -> dict[str, Callable[[], object]]:
    """{variable: a call that reads it, raising its typed error when it is malformed}
    for a store on GPUs (`on_gpu`) or on the host, less those whose option (OPTIONS) is
    among the `given` options of `create`."""
    checks: dict[str, Callable[[], object]] = {
        "GPUKV_STRATEGY": env_strategy,
        "GPUKV_DETERMINISTIC": lambda: flag("GPUKV_DETERMINISTIC"),
        "GPUKV_VIRTUAL_GPUS": virtual_gpus,
        "GPUKV_HOST_THREADS": lambda: positive_int("GPUKV_HOST_THREADS"),
        "GPUKV_HOST_JIT": host_jit.check_setting,
        # (each read with its MXNET_KVSTORE_TREE_* twin, which it names when that is bad)
        "GPUKV_TREE_ARRAY_BOUND": lambda: topology.tree_options("array_bound"),
        "GPUKV_TREE_LINK_USAGE_PENALTY": lambda: topology.tree_options("penalty"),
        "GPUKV_TREE_BACKTRACK": lambda: topology.tree_options("backtrack"),
    }
    return {name: check for name, check in checks.items()
            if OPTIONS.get(name) not in given and (on_gpu or name not in GPU_ONLY)}


def given(options: Mapping[str, object]) -> set[str]:
    """The names of the `create` options given a value (None, every default, is not)."""
    return {name for name, value in options.items() if value is not None}

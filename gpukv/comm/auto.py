"""The 'auto' strategy: per key, the strategy the cost model predicts to be fastest.

For each key the choice depends on its size in bytes, the number of devices that hold
it and their link matrix (from CUDA's P2P attributes); `simulate.best_strategy` (an
alpha-beta model) ranks 'home', 'tree', 'ring', 'cpu' and, where NCCL loads and the
key spans several physical GPUs, 'nccl'. For GPUs the model is
`simulate.calibrated_machine` of their link matrix with `simulate.calibrated_costs`:
the constants `python -m gpukv bench --calibrate` measured on this machine when its
calibration file is there and usable, the defaults otherwise.
Keys on the host only take the host sum; a key on one device takes 'home'. Choices
are cached per (size, devices, home) and logged once at DEBUG, e.g.
``gpukv: key 3 (4 MiB, 4 devices) -> tree``. Keys that chose the same strategy are
handed to it together, so each strategy still batches its keys.
"""
from __future__ import annotations

import logging

from . import execute
from ._base import BroadcastJob, ReduceJob, Strategy

log = logging.getLogger("gpukv")

_CANDIDATES = ("home", "tree", "ring", "cpu")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


class AutoStrategy(Strategy):
    """Picks a strategy per key from `simulate.best_strategy` (see the module docs).

    `machine`: a link matrix, a `simulate` machine profile name or a `Machine`, used in
    place of the measured topology and modelled with the default constants (no
    calibration: it stands for another machine, or for tests). `choose`:
    a callable `(nbytes, n_devices, matrix, home, candidates) -> name` replacing the
    cost model. `model_host`: choose for host devices too (else they take the host sum).
    """

    name = "auto"

    def __init__(self, machine=None, choose=None, strategies: dict | None = None,
                 model_host: bool = False):
        self._machine = machine
        self._model_host = model_host  # host slots consult the model too (tests)
        self._choose = choose
        self._strategies = dict(strategies or {})
        self._cache: dict = {}
        self._said: set = set()

    def strategy(self, name: str) -> Strategy:
        """The strategy object of `name` this auto strategy delegates to."""
        s = self._strategies.get(name)
        if s is None:
            from .registry import make_strategy
            s = self._strategies[name] = make_strategy(name)
        return s

    def choose(self, key, nbytes: int, devices, home) -> str:
        """The strategy name for one key of `nbytes` on `devices` homed on `home`."""
        host = execute.is_host_job(devices, home)
        if host and not self._model_host:
            return "cpu"
        nodes = sorted(execute.unique(list(devices) + [home]), key=execute.node_order)
        if len(nodes) == 1 or not (host or execute.is_gpu_job(devices, home)) \
                or len(set(devices)) != len(devices):
            return "home"
        cache_key = (nbytes, tuple(nodes), home)
        name = self._cache.get(cache_key)
        if name is None:
            name = self._cache[cache_key] = self._decide(nbytes, nodes, home)
        if cache_key not in self._said and log.isEnabledFor(logging.DEBUG):
            self._said.add(cache_key)
            log.debug("gpukv: key %r (%s, %d devices) -> %s", key, _size(nbytes),
                      len(nodes), name)
        return name

    def _decide(self, nbytes: int, nodes, home) -> str:
        candidates = list(_CANDIDATES)
        if not host_nodes(nodes) and len({d.physical for d in nodes}) > 1:
            from .nccl import nccl_available
            if nccl_available():
                candidates.append("nccl")
        machine = self._machine
        measured = machine is None
        if measured:
            machine = execute.link_matrix(nodes)
        h = nodes.index(home)
        if self._choose is not None:
            return self._choose(nbytes, len(nodes), machine, h, tuple(candidates))
        from .plan import simulate
        costs = simulate.COSTS
        if measured and not host_nodes(nodes):  # these GPUs: measured constants, if any
            machine = simulate.calibrated_machine(machine)
            costs = simulate.calibrated_costs()
        return simulate.best_strategy(nbytes, len(nodes), machine,
                                      strategies=tuple(candidates), home=h, costs=costs)

    def _dispatch(self, jobs, nbytes_of, method: str) -> None:
        chosen: dict = {}
        for job in jobs:
            name = self.choose(job.key, nbytes_of(job), job.devices, job.home)
            chosen.setdefault(name, []).append(job)
        for name, group in chosen.items():
            getattr(self.strategy(name), method)(group)

    def reduce(self, job: ReduceJob) -> None:
        self.reduce_many([job])

    def broadcast(self, job: BroadcastJob) -> None:
        self.broadcast_many([job])

    def reduce_many(self, jobs: list) -> None:
        self._dispatch(jobs, lambda j: j.sources[0].nbytes, "reduce_many")

    def broadcast_many(self, jobs: list) -> None:
        self._dispatch(jobs, lambda j: j.src.nbytes, "broadcast_many")


def host_nodes(nodes) -> bool:
    return not any(execute.is_gpu(d) for d in nodes)

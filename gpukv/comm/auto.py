"""The 'auto' strategy: per key, the strategy the cost model predicts to be fastest.

For each key the choice depends on its size in bytes, the number of devices that hold
it and their link matrix (`links.link_matrix`); `simulate.best_strategy` (an
alpha-beta model) ranks 'home', 'tree', 'ring', 'cpu' and, where NCCL loads, the
devices support it (`Device.supports_nccl`) and the key spans several of their
memories, 'nccl'. For devices whose links are read from the hardware
(`links.measured_links`: GPUs) the model is `simulate.calibrated_machine` of their
link matrix with `simulate.calibrated_costs`: the constants `python -m gpukv bench
--calibrate` measured on this machine when its calibration file is there and usable,
the defaults otherwise. Nothing here asks which kind a device is.
Keys on the host only take the host sum; a key on one device takes 'home'. Choices
are cached per (size, devices, home) and logged once at DEBUG, e.g.
``gpukv: key 3 (4 MiB, 4 devices) -> tree``. Keys that chose the same strategy are
handed to it together, so each strategy still batches its keys.
"""
from __future__ import annotations

import logging

from . import ordering
from ._base import BroadcastJob, ReduceJob, Strategy
from .jobs import is_host_job, is_uniform_job, node_order
from .plan import links

log = logging.getLogger("gpukv")

_CANDIDATES = ("home", "tree", "ring", "cpu")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def delegate_classes() -> dict:
    """{name: class} of the strategies 'auto' hands keys to, in the registry's order
    (imported on first use, so that importing this module loads none of them)."""
    from .home import HomeStrategy
    from .nccl import NcclStrategy
    from .ring import RingStrategy
    from .staged import StagedStrategy
    from .tree import TreeStrategy
    return {"home": HomeStrategy, "tree": TreeStrategy, "ring": RingStrategy,
            "cpu": StagedStrategy, "nccl": NcclStrategy}


class AutoStrategy(Strategy):
    """Picks a strategy per key from `simulate.best_strategy` (see the module docs).

    `machine`: a link matrix, a `simulate` machine profile name or a `Machine`, used in
    place of the measured topology and modelled with the default constants (no
    calibration: it stands for another machine, or for tests). `costs`: a
    `simulate.CostModel` used in place of the default or calibrated constants. `choose`:
    a callable `(nbytes, n_devices, matrix, home, candidates) -> name` replacing the
    cost model. `strategies`: {name: strategy object} to delegate to (the others are
    built from `delegate_classes` when first chosen). `model_host`: choose for host
    devices too (else they take the host sum).
    """

    name = "auto"
    store_options = ("machine", "costs")  # `choose`, `strategies`, `model_host`: tests'

    def __init__(self, machine=None, choose=None, strategies: dict | None = None,
                 model_host: bool = False, costs=None):
        self._machine = machine
        self._costs = costs
        self._model_host = model_host  # host slots consult the model too (tests)
        self._choose = choose
        self._strategies = dict(strategies or {})
        self._cache: dict = {}
        self._said: set = set()
        from .plan import topology
        topology.tree_options()  # read by its model and its trees: malformed, refused now

    def strategy(self, name: str) -> Strategy:
        """The strategy object of `name` this auto strategy delegates to."""
        s = self._strategies.get(name)
        if s is None:
            s = self._strategies[name] = delegate_classes()[name]()
        return s

    def choose(self, key, nbytes: int, devices, home) -> str:
        """The strategy name for one key of `nbytes` on `devices` homed on `home`."""
        host = is_host_job(devices, home)
        if host and not self._model_host:
            return "cpu"
        nodes = sorted(ordering.unique(list(devices) + [home]), key=node_order)
        if len(nodes) == 1 or not is_uniform_job(devices, home) \
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
        """The candidate the cost model predicts to be fastest for `nodes`."""
        candidates = list(_CANDIDATES)
        if all(d.supports_nccl for d in nodes) and len({d.physical for d in nodes}) > 1:
            from .nccl import nccl_available
            if nccl_available():
                candidates.append("nccl")
        machine = self._machine
        measured = machine is None
        if measured:
            machine = links.link_matrix(nodes)
        h = nodes.index(home)
        if self._choose is not None:
            return self._choose(nbytes, len(nodes), machine, h, tuple(candidates))
        from .plan import simulate
        costs = simulate.COSTS if self._costs is None else self._costs
        if measured and links.measured_links(nodes):  # this machine: measured constants
            machine = simulate.calibrated_machine(machine)
            if self._costs is None:
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

"""An alpha-beta cost model of the reduction strategies, for machines we may not have.

`predict(strategy, nbytes, n_devices, machine)` estimates the seconds of one push plus
pull of a key of `nbytes` bytes on each of `n_devices` devices: the reduction of every
device's value to the key's home device and the broadcast of the result back to every
device. `best_strategy` picks the cheapest; the 'auto' strategy uses it as its cost
model. Strategies:

- ``home``: the home device reads every source over its own links at once, sums them
  in one kernel, and writes the result back the same way.
- ``tree``: per-root binary trees from `topology.plan_trees`; each step moves partial
  sums one level up (broadcast: down). A key may be sliced over several trees, so more
  trees (and links) work at once; slices reduced on another root are then gathered on
  the home (broadcast: scattered from it) in one more step. How many slices is
  `tree_slice_plan`'s decision, the very one the 'tree' strategy runs.
- ``ring``: reduce-scatter then all-gather over `topology.plan_ring`, 2(n-1) steps of
  nbytes/n, each issued as separate copies and kernels.
- ``cpu``: every device copies to host memory, the host sums, and copies back.
- ``nccl``: the same ring algorithm in one NCCL call: small fixed latency, and NCCL's
  several channels drive all of a device's links at `nccl_efficiency` of their speed
  (but no faster than the ring's slowest hop when that hop is a shared path).

A transfer costs latency + bytes / bandwidth. Transfers issued together (one step) run
at once; they contend where they share a dedicated link (same direction), a per-device
port (PCIe lanes, an NVSwitch port: `LinkClass.port`), or a machine-wide bus (the
socket interconnect: `LinkClass.bus`). Each copy or kernel also costs host time to
issue (`CostModel.launch_us`), which overlaps the device time of its step.

Every constant lives in `COSTS` and in the machine profiles below. They are
defaults: vendor link speeds derated to what a single cudaMemcpyPeer reaches, typical
launch latencies. `python -m gpukv bench --calibrate` measures this machine's own
values and writes them to a calibration file (``GPUKV_CALIBRATION``, else
``$XDG_CACHE_HOME/gpukv/calibration.json``, else ``~/.cache/gpukv/calibration.json``).
`load_calibration` reads it once per process; `calibrated_costs` and
`calibrated_machine` (the generic profile of a measured link matrix) apply it, and
are what the 'auto' and 'tree' strategies model the GPUs they run on with. Without a
usable file they return `COSTS` and `generic_machine`'s defaults. The named profiles
in `MACHINES` describe other machines and are never calibrated.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..._errors import ArgumentError
from . import topology

__all__ = ["LinkClass", "Machine", "CostModel", "COSTS", "MACHINES", "STRATEGIES",
           "MIN_SLICE_BYTES", "machine", "generic_machine", "predict", "predict_all",
           "best_strategy", "tree_slice_plan", "Calibration", "CALIBRATION_FORMAT",
           "CALIBRATION_VERSION", "CALIBRATED", "calibration_path", "load_calibration",
           "reset_calibration", "calibrated_costs", "calibrated_machine",
           "calibration_status"]

log = logging.getLogger("gpukv")

STRATEGIES = ("home", "tree", "ring", "cpu", "nccl")
GB = 1e9
#: Smallest slice, in bytes, `tree_slice_plan` cuts a key into: smaller keys stay on one
#: tree whatever the model says, since their time is launch and link latency, which
#: slicing multiplies.
MIN_SLICE_BYTES = 256 << 10


@dataclass(frozen=True)
class CostModel:
    """Machine-independent constants of the model (times in microseconds)."""

    launch_us: float = 6.0        #: host time to issue one copy or kernel (CuPy call)
    kernel_us: float = 4.0        #: device-side latency of one small kernel
    host_copy_us: float = 10.0    #: latency of a device<->host copy
    host_sum_us: float = 5.0      #: fixed cost of one host-side summation
    nccl_base_us: float = 12.0    #: fixed cost of one NCCL all-reduce call
    nccl_step_us: float = 1.0     #: per-step latency of NCCL's ring (LL protocol)
    nccl_efficiency: float = 0.8  #: fraction of link speed NCCL's channels reach
    itemsize: int = 4             #: bytes per element when slicing keys (float32)


COSTS = CostModel()


@dataclass(frozen=True)
class LinkClass:
    """One kind of link: speed of one transfer alone, latency, and what it shares."""

    name: str
    gbps: float                 #: GB/s (1e9 bytes/s) in one direction
    latency_us: float
    port: str | None = None     #: per-device port shared by all links of this port name
    bus: str | None = None      #: machine-wide bus shared by all links of this bus name


@dataclass(frozen=True)
class Machine:
    """A machine profile: link matrix, what each link weight means, and memory speeds."""

    name: str
    matrix: np.ndarray = field(repr=False)
    links: dict                 #: link weight -> LinkClass
    staged: LinkClass           #: pairs without a direct link (weight 0)
    ports: dict                 #: port name -> GB/s per device per direction
    buses: dict = field(default_factory=dict)  #: bus name -> GB/s per direction
    hbm_gbps: float = 800.0     #: device memory bandwidth a sum kernel reaches
    host_gbps: float = 12.0     #: one device <-> pinned host memory
    host_total_gbps: float = 40.0  #: all devices <-> host memory at once
    host_sum_gbps: float = 10.0    #: host summation, bytes of input per second

    @property
    def n(self) -> int:
        return self.matrix.shape[0]

    def link(self, i: int, j: int) -> LinkClass:
        """The link class between devices i and j."""
        w = float(self.matrix[i, j])
        if w <= 0:
            return self.staged
        if w in self.links:
            return self.links[w]
        return generic_link(w)  # a weight the profile does not list

    def subset(self, n: int) -> Machine:
        """The same machine restricted to its first n devices."""
        if not 1 <= n <= self.n:
            raise ArgumentError(f"machine {self.name!r} has {self.n} devices, asked for {n}")
        return replace(self, matrix=self.matrix[:n, :n].copy())


def generic_link(w: float) -> LinkClass:
    """MXNet's weight convention: 1 PCIe, k+1 k NVLink2 lanes, SAME_DEVICE_WEIGHT local."""
    if w >= topology.SAME_DEVICE_WEIGHT:
        return LinkClass("same device", 400.0, 3.0)
    if w <= 1:
        return LinkClass("pcie", 12.0 * w, 10.0, port="pcie")
    return LinkClass(f"nvlink x{w - 1:g}", 25.0 * (w - 1), 5.0)


def generic_machine(matrix, name: str = "generic") -> Machine:
    """A profile for a bare link matrix in MXNet's convention (see `generic_link`)."""
    w = topology.as_link_matrix(matrix)
    return Machine(name=name, matrix=w, links={},
                   staged=LinkClass("staged via host", 8.0, 15.0, port="pcie"),
                   ports={"pcie": 12.0})


# Per-link speeds are one direction of one transfer, as the cudaMemcpyPeer bandwidth
# tests report them (NVLink2 ~25 GB/s per lane, PCIe 3 x16 ~12, PCIe 4 x16 ~25,
# NVLink4 through NVSwitch ~450 per GPU).
MACHINES = {
    "dgx1-v100": Machine(
        name="dgx1-v100", matrix=topology.dgx1_v100(),
        links={3.0: LinkClass("nvlink2 x2", 50.0, 5.0),
               2.0: LinkClass("nvlink2", 25.0, 5.0),
               1.0: LinkClass("pcie3 + qpi", 10.0, 10.0, port="pcie")},
        staged=LinkClass("staged via host", 8.0, 15.0, port="pcie"),
        ports={"pcie": 12.0},
        hbm_gbps=800.0, host_gbps=12.0, host_total_gbps=40.0, host_sum_gbps=10.0),
    "nvswitch-h100": Machine(
        name="nvswitch-h100", matrix=topology.nvswitch_h100(8),
        links={19.0: LinkClass("nvlink4 via nvswitch", 450.0, 3.0, port="nvlink")},
        staged=LinkClass("staged via host", 40.0, 15.0, port="pcie"),
        ports={"nvlink": 450.0, "pcie": 50.0},
        hbm_gbps=3000.0, host_gbps=50.0, host_total_gbps=150.0, host_sum_gbps=20.0),
    "pcie-2socket": Machine(
        name="pcie-2socket", matrix=topology.pcie_two_socket(8),
        links={2.0: LinkClass("pcie4 switch", 25.0, 8.0, port="pcie"),
               1.0: LinkClass("pcie4 root complex", 20.0, 10.0, port="pcie")},
        staged=LinkClass("cross-socket via host (upi)", 12.0, 15.0, port="pcie", bus="upi"),
        ports={"pcie": 25.0}, buses={"upi": 40.0},
        hbm_gbps=1500.0, host_gbps=25.0, host_total_gbps=80.0, host_sum_gbps=20.0),
}


def machine(spec, n_devices: int | None = None) -> Machine:
    """A Machine from a profile name, a Machine, or a link matrix; first n_devices only."""
    if isinstance(spec, Machine):
        m = spec
    elif isinstance(spec, str):
        try:
            m = MACHINES[spec.lower()]
        except KeyError:
            raise ArgumentError(f"machine {spec!r}: unknown; known machines are "
                                f"{', '.join(MACHINES)}") from None
    else:
        m = generic_machine(spec)
    return m if n_devices is None or n_devices == m.n else m.subset(n_devices)


# ------------------------------------------------------------------------- model
def _step_time(m: Machine, transfers, *, compute: dict | None = None,
               ops: int = 0, costs: CostModel = COSTS) -> float:
    """Seconds of one step: `transfers` (src, dst, bytes) at once, then the sums.

    `compute` maps device -> bytes its sum kernels read and write in this step.
    """
    device_t = 0.0
    if transfers:
        per_link: dict = {}
        per_port: dict = {}
        per_bus: dict = {}
        latency = 0.0
        for src, dst, nbytes in transfers:
            cls = m.link(src, dst)
            latency = max(latency, cls.latency_us * 1e-6)
            key = (src, dst)
            per_link[key] = per_link.get(key, 0.0) + nbytes / (cls.gbps * GB)
            if cls.port is not None:
                for end in (("out", src), ("in", dst)):
                    k = (cls.port,) + end
                    per_port[k] = per_port.get(k, 0.0) + nbytes
            if cls.bus is not None:
                per_bus[cls.bus] = per_bus.get(cls.bus, 0.0) + nbytes
        busiest = max(per_link.values())
        for (port, _, _), nbytes in per_port.items():
            busiest = max(busiest, nbytes / (m.ports[port] * GB))
        for bus, nbytes in per_bus.items():
            busiest = max(busiest, nbytes / (m.buses[bus] * GB))
        device_t = latency + busiest
    if compute:
        device_t += costs.kernel_us * 1e-6 + max(compute.values()) / (m.hbm_gbps * GB)
    return max(device_t, ops * costs.launch_us * 1e-6)


def _home(m: Machine, nbytes: float, home: int, costs: CostModel) -> float:
    n = m.n
    others = [j for j in range(n) if j != home]
    up = _step_time(m, [(j, home, nbytes) for j in others],
                    compute={home: (n + 1) * nbytes}, ops=n, costs=costs)
    down = _step_time(m, [(home, j, nbytes) for j in others], ops=n - 1, costs=costs)
    return up + down


def _tree(m: Machine, nbytes: float, home: int, costs: CostModel,
          array_bound: int | None) -> float:
    nelems = max(1, int(nbytes // costs.itemsize))
    plan = tree_slice_plan(nelems, m, home, itemsize=costs.itemsize,
                           array_bound=array_bound, costs=costs)
    return _tree_time(m, topology.plan_trees(m.matrix), plan, nelems, nbytes, home, costs)


def _tree_time(m: Machine, trees, plan, nelems: int, nbytes: float, home: int,
               costs: CostModel) -> float:
    """Seconds of one push+pull of a key cut as `plan` [(root, start, stop)] over `trees`."""
    parts = [(trees[root], root, (stop - start) * nbytes / max(1, nelems))
             for root, start, stop in plan]
    total = 0.0
    for k in range(trees[0].depth):
        transfers: list = []
        compute: dict = {}
        for tree, _, size in parts:
            for child, par in tree.levels[k]:
                transfers.append((child, par, size))
                compute[par] = compute.get(par, 0.0) + 3 * size
        total += _step_time(m, transfers, compute=compute, ops=2 * len(transfers),
                            costs=costs)
        down = [(p, c, s) for c, p, s in transfers]
        total += _step_time(m, down, ops=len(down), costs=costs)
    gather = [(root, home, size) for _, root, size in parts if root != home]
    if gather:  # reduce: slices to the home; broadcast: slices from it to their roots
        total += _step_time(m, gather, ops=len(gather), costs=costs)
        total += _step_time(m, [(h, r, s) for r, h, s in gather], ops=len(gather),
                            costs=costs)
    return total


_SLICE_CACHE: dict = {}


def tree_slice_plan(nelems: int, machine_or_matrix, home: int, *, itemsize: int | None = None,
                    array_bound: int | None = None, costs: CostModel = COSTS,
                    min_slice_bytes: int | None = None) -> list:
    """How the 'tree' strategy runs a key of `nelems` elements homed on device `home`:
    [(root, start, stop), ...] as `topology.slice_plan` gives it.

    All devices of `machine_or_matrix` (a profile name, a `Machine`, or a link matrix in
    MXNet's convention) take part. Precedence: an explicit `array_bound` (elements), else
    ``GPUKV_TREE_ARRAY_BOUND``, else ``MXNET_KVSTORE_TREE_ARRAY_BOUND`` (see
    `topology.tree_options`), applies MXNet's fixed rule: whole on the home's tree up to
    the bound, sliced over every tree above it. With no bound set, the cost model decides:
    of k = 1..n slices over `topology.slice_roots` (the home's tree and those rooted at
    its best-linked devices), the k with the lowest predicted push+pull time, counting
    the gather on the home; k = 1 (no slicing) unless a larger k is strictly faster, and
    no slice smaller than `min_slice_bytes` (default `MIN_SLICE_BYTES`) of `itemsize`-byte
    elements (default `costs.itemsize`). The simulator's 'tree' prediction uses this
    same decision. Answers are memoised.
    """
    m = machine(machine_or_matrix)
    n = m.n
    nelems = int(nelems)
    if nelems < 0:
        raise ArgumentError(f"tree_slice_plan: nelems {nelems}: expected >= 0")
    if not 0 <= home < n:
        raise ArgumentError(f"tree_slice_plan: home {home} outside 0..{n - 1}")
    bound = (topology.tree_options("array_bound")["array_bound"] if array_bound is None
             else array_bound)
    if bound is not None:
        return topology.slice_plan(nelems, n, home, array_bound=bound)
    itemsize = costs.itemsize if itemsize is None else int(itemsize)
    min_slice = MIN_SLICE_BYTES if min_slice_bytes is None else min_slice_bytes
    whole = [(home, 0, nelems)]
    nbytes = float(nelems * itemsize)
    if n == 1 or nelems < 2 or nbytes < 2 * min_slice:
        return whole
    opts = topology.tree_options("penalty", "backtrack")
    key = (repr(m), m.matrix.tobytes(), nelems, itemsize, home, min_slice, costs,
           opts["penalty"], opts["backtrack"])
    plan = _SLICE_CACHE.get(key)
    if plan is None:
        trees = topology.plan_trees(m.matrix)
        plan, best = whole, _tree_time(m, trees, whole, nelems, nbytes, home, costs)
        for k in range(2, min(n, nelems) + 1):
            if nbytes < k * min_slice:
                break
            trial = topology.slice_plan(nelems, n, home,
                                        roots=topology.slice_roots(m.matrix, home, k))
            t = _tree_time(m, trees, trial, nelems, nbytes, home, costs)
            if t < best * (1 - 1e-9):
                plan, best = trial, t
        if len(_SLICE_CACHE) > 65536:
            _SLICE_CACHE.clear()
        _SLICE_CACHE[key] = plan
    return list(plan)


def _ring(m: Machine, nbytes: float, costs: CostModel) -> float:
    n = m.n
    ring = topology.plan_ring(m.matrix)
    chunk = nbytes / n
    hops = [(a, b, chunk) for a, b in zip(ring, ring[1:] + ring[:1])]
    scatter = _step_time(m, hops, compute={d: 3 * chunk for d in ring}, ops=2 * n,
                         costs=costs)
    gather = _step_time(m, hops, ops=n, costs=costs)
    return (n - 1) * (scatter + gather)


def _cpu(m: Machine, nbytes: float, costs: CostModel) -> float:
    n = m.n
    move = costs.host_copy_us * 1e-6 + max(nbytes / (m.host_gbps * GB),
                                           n * nbytes / (m.host_total_gbps * GB))
    move = max(move, n * costs.launch_us * 1e-6)
    summed = costs.host_sum_us * 1e-6 + n * nbytes / (m.host_sum_gbps * GB)
    return 2 * move + summed


def _nccl_bus_gbps(m: Machine) -> float:
    """What NCCL's channels can drive out of the slowest device: all of its links."""
    best = math.inf
    for i in range(m.n):
        dedicated = 0.0
        ported: dict = {}
        for j in range(m.n):
            if j == i:
                continue
            cls = m.link(i, j)
            if cls.port is None:
                dedicated += cls.gbps
            else:
                ported[cls.port] = ported.get(cls.port, 0.0) + cls.gbps
        total = dedicated + sum(min(g, m.ports[p]) for p, g in ported.items())
        best = min(best, total)
    return best


def _nccl(m: Machine, nbytes: float, costs: CostModel) -> float:
    n = m.n
    gbps = _nccl_bus_gbps(m)
    ring = topology.plan_ring(m.matrix)
    slowest = min((m.link(a, b) for a, b in zip(ring, ring[1:] + ring[:1])),
                  key=lambda c: c.gbps)
    if slowest.port is not None or slowest.bus is not None:
        gbps = min(gbps, slowest.gbps)  # more channels over a shared path add nothing
    bw = costs.nccl_efficiency * gbps * GB
    return (costs.nccl_base_us * 1e-6 + 2 * (n - 1) * costs.nccl_step_us * 1e-6
            + 2 * (n - 1) / n * nbytes / bw)


def predict(strategy: str, nbytes: float, n_devices: int, machine_or_matrix="dgx1-v100",
            *, home: int | None = None, array_bound: int | None = None,
            costs: CostModel = COSTS) -> float:
    """Predicted seconds of one push+pull of `nbytes` per device on `n_devices` devices.

    `machine_or_matrix` is a profile name (`MACHINES`), a `Machine`, or a link matrix
    (MXNet's weight convention); its first `n_devices` devices take part. `home` is the
    key's home device; None averages over all homes (keys spread over the devices).
    `array_bound` fixes the tree's slicing rule (see `tree_slice_plan`, which 'tree'
    follows); by default the environment's bound, else the cost model's choice.
    """
    if strategy not in STRATEGIES:
        raise ArgumentError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if nbytes < 0:
        raise ArgumentError(f"nbytes {nbytes}: expected >= 0")
    m = machine(machine_or_matrix, n_devices)
    return _predict(strategy, float(nbytes), m, home, array_bound, costs)


def _predict(strategy, nbytes, m, home, array_bound, costs) -> float:
    n = m.n
    if n == 1:  # nothing to move: one local copy in, one out
        return 2 * (costs.launch_us * 1e-6 + 2 * nbytes / (m.hbm_gbps * GB))
    homes = range(n) if home is None else [home]
    if strategy == "home":
        return float(np.mean([_home(m, nbytes, h, costs) for h in homes]))
    if strategy == "tree":
        return float(np.mean([_tree(m, nbytes, h, costs, array_bound) for h in homes]))
    if strategy == "ring":
        return _ring(m, nbytes, costs)
    if strategy == "cpu":
        return _cpu(m, nbytes, costs)
    return _nccl(m, nbytes, costs)


def predict_all(nbytes: float, n_devices: int, machine_or_matrix="dgx1-v100",
                strategies=STRATEGIES, **kwargs) -> dict:
    """{strategy: predicted seconds} for every strategy in `strategies`."""
    return {s: predict(s, nbytes, n_devices, machine_or_matrix, **kwargs) for s in strategies}


_BEST_CACHE: dict = {}


def best_strategy(nbytes: float, n_devices: int, machine_or_matrix="dgx1-v100",
                  strategies=STRATEGIES, *, home: int | None = None,
                  array_bound: int | None = None, costs: CostModel = COSTS) -> str:
    """The strategy of `strategies` with the lowest predicted push+pull time.

    Ties go to the earlier strategy in `strategies`. Answers are memoised per machine,
    size and options, so calling it for every key of every step is cheap.
    """
    strategies = tuple(strategies)
    if not strategies:
        raise ArgumentError("best_strategy: no strategies to choose from")
    m = machine(machine_or_matrix, n_devices)
    if array_bound is None:
        array_bound = topology.tree_options("array_bound")["array_bound"]
    key = (repr(m), m.matrix.tobytes(), float(nbytes), strategies, home, array_bound, costs)
    best = _BEST_CACHE.get(key)
    if best is None:
        times = predict_all(nbytes, n_devices, m, strategies, home=home,
                            array_bound=array_bound, costs=costs)
        best = min(strategies, key=times.__getitem__)
        if len(_BEST_CACHE) > 65536:
            _BEST_CACHE.clear()
        _BEST_CACHE[key] = best
    return best


# ------------------------------------------------------------------ calibration
CALIBRATION_FORMAT = "gpukv-calibration"
CALIBRATION_VERSION = 1
#: The constants a calibration file may set: name -> (unit, "costs" for a `CostModel`
#: field or "machine" for a `Machine` field). Link classes come in the file's "links".
CALIBRATED = {
    "launch_us": ("us", "costs"),
    "kernel_us": ("us", "costs"),
    "host_copy_us": ("us", "costs"),
    "host_sum_us": ("us", "costs"),
    "nccl_base_us": ("us", "costs"),
    "hbm_gbps": ("GB/s", "machine"),
    "host_gbps": ("GB/s", "machine"),
    "host_total_gbps": ("GB/s", "machine"),
    "host_sum_gbps": ("GB/s", "machine"),
}
_OFF = ("off", "none", "0")


@dataclass(frozen=True)
class Calibration:
    """Constants measured on this machine by `python -m gpukv bench --calibrate`.

    `constants`: name (a key of `CALIBRATED`) -> value in its unit, only those measured.
    `links`: link weight (MXNet's convention; 0: pairs staged through the host) ->
    (GB/s one way, latency in us) of one transfer over a link of that weight.
    """

    path: str
    created_utc: str
    constants: dict
    links: dict = field(default_factory=dict)
    system: dict = field(default_factory=dict, repr=False, compare=False)
    versions: dict = field(default_factory=dict, repr=False, compare=False)

    def costs(self, base: CostModel = COSTS) -> CostModel:
        """`base` with the measured `CostModel` constants in place of its own."""
        return replace(base, **{k: v for k, v in self.constants.items()
                                if CALIBRATED[k][1] == "costs"})

    def apply(self, m: Machine) -> Machine:
        """`m` (a generic profile) with the measured memory and link speeds.

        A measured link class keeps the generic one's port (PCIe links share the
        device's PCIe port); the port's speed becomes the fastest single transfer
        measured through it or to host memory, since one transfer cannot beat it.
        """
        fields = {k: v for k, v in self.constants.items() if CALIBRATED[k][1] == "machine"}
        links, staged = dict(m.links), m.staged
        ported: dict = {}
        for w, (gbps, latency) in sorted(self.links.items()):
            base = staged if w <= 0 else links.get(w) or generic_link(w)
            cls = replace(base, name=f"{base.name} (measured)", gbps=gbps, latency_us=latency)
            if w <= 0:
                staged = cls
            else:
                links[w] = cls
            if cls.port is not None:
                ported[cls.port] = max(ported.get(cls.port, 0.0), gbps)
        if "host_gbps" in fields:
            ported["pcie"] = max(ported.get("pcie", 0.0), fields["host_gbps"])
        ports = {**m.ports, **ported}
        host_gbps = fields.get("host_gbps", m.host_gbps)
        fields["host_total_gbps"] = max(fields.get("host_total_gbps", m.host_total_gbps),
                                        host_gbps)
        return replace(m, links=links, staged=staged, ports=ports, **fields)


class _Unusable(Exception):
    """Why a calibration file cannot be used."""


def default_calibration_path() -> Path:
    """The per-user cache file: $XDG_CACHE_HOME/gpukv/calibration.json, else
    ~/.cache/gpukv/calibration.json."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "gpukv" / "calibration.json"


def calibration_path() -> Path | None:
    """The calibration file in effect: ``GPUKV_CALIBRATION`` when set (``off``, ``none``
    or ``0``: none at all, so None), else `default_calibration_path()`."""
    env = os.environ.get("GPUKV_CALIBRATION", "").strip()
    if env.lower() in _OFF:
        return None
    return Path(env).expanduser() if env else default_calibration_path()


_LOADED: dict = {}    # path -> Calibration | None, for load_calibration()
_PROBLEMS: dict = {}  # path -> why its file was not used


def reset_calibration() -> None:
    """Forget the calibration read by `load_calibration()`: the next call reads again."""
    _LOADED.clear()
    _PROBLEMS.clear()


def load_calibration(path=None) -> Calibration | None:
    """The calibration in `path`, or None when there is none to use.

    Without `path`: the file of `calibration_path()`, read once per process and cached
    (`reset_calibration` forgets it). A missing default cache file is no calibration; a
    missing ``GPUKV_CALIBRATION`` file, and any file that is malformed, of another
    format, of a newer format version, or measured on another machine (another CPU
    model or other GPU models than this process sees) is logged as a warning naming the
    file and the problem, and None is returned, so the model keeps its defaults.
    """
    if path is not None:
        return _load(Path(path), explicit=True)
    p = calibration_path()
    if p is None:
        return None
    key = str(p)
    if key not in _LOADED:
        explicit = bool(os.environ.get("GPUKV_CALIBRATION", "").strip())
        _LOADED[key] = _load(p, explicit=explicit)
    return _LOADED[key]


def _load(path: Path, explicit: bool) -> Calibration | None:
    try:
        try:
            text = path.read_text()
        except FileNotFoundError:
            if not explicit:
                return None
            raise _Unusable("no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise _Unusable(f"cannot read it: {exc}") from None
        try:
            record = json.loads(text)
        except ValueError as exc:
            raise _Unusable(f"not valid JSON: {exc}") from None
        cal = _parse(record, str(path))
        other = _other_machine(cal.system)
        if other:
            raise _Unusable(f"measured on another machine: {other}")
        return cal
    except _Unusable as exc:
        _PROBLEMS[str(path)] = str(exc)
        log.warning("gpukv: calibration file %s not used (%s); the cost model keeps its "
                    "default constants", path, exc)
        return None


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise _Unusable(f"{what}: {value!r} is not a positive number")
    return float(value)


def _measured(entry, what: str, unit: str) -> float:
    if not isinstance(entry, dict) or "value" not in entry:
        raise _Unusable(f"{what}: expected an object with 'value' and 'unit'")
    if entry.get("unit") != unit:
        raise _Unusable(f"{what}: unit {entry.get('unit')!r}, expected {unit!r}")
    return _number(entry["value"], what)


def _parse(record, path: str) -> Calibration:
    """A Calibration from a parsed file; _Unusable saying what is wrong."""
    if not isinstance(record, dict) or record.get("format") != CALIBRATION_FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise _Unusable(f"not a gpukv calibration file (format {found!r}, expected "
                        f"{CALIBRATION_FORMAT!r})")
    version = record.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _Unusable(f"version {version!r}: expected a positive integer")
    if version > CALIBRATION_VERSION:
        raise _Unusable(f"format version {version} is newer than this gpukv reads "
                        f"({CALIBRATION_VERSION}); run `python -m gpukv bench --calibrate` "
                        "again")
    created = record.get("created_utc")
    system = record.get("machine")
    versions = record.get("versions", {})
    constants = record.get("constants")
    links = record.get("links", [])
    if not isinstance(created, str) or not isinstance(system, dict) \
            or not isinstance(versions, dict):
        raise _Unusable("'created_utc', 'machine' or 'versions' missing or malformed")
    if not isinstance(constants, dict) or not isinstance(links, list):
        raise _Unusable("'constants' must be an object and 'links' a list")
    values = {}
    for name, entry in constants.items():
        if name not in CALIBRATED:
            raise _Unusable(f"unknown constant {name!r}")
        values[name] = _measured(entry, name, CALIBRATED[name][0])
    measured_links = {}
    for i, entry in enumerate(links):
        if not isinstance(entry, dict):
            raise _Unusable(f"links[{i}]: expected an object")
        w = entry.get("weight")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) \
                or w < 0:
            raise _Unusable(f"links[{i}]: weight {w!r} is not a number >= 0")
        measured_links[float(w)] = (_measured(entry.get("gbps"), f"links[{i}].gbps", "GB/s"),
                                    _measured(entry.get("latency_us"),
                                              f"links[{i}].latency_us", "us"))
    return Calibration(path=path, created_utc=created, constants=values,
                       links=measured_links, system=system, versions=versions)


def _other_machine(system: dict) -> str | None:
    """What differs between the machine of a calibration file and this one, or None."""
    theirs = system.get("cpu_model")
    ours = _local_cpu_model()
    if theirs and ours and theirs != ours:
        return f"CPU {theirs!r}, this one has {ours!r}"
    gpus = system.get("gpus") or []
    if gpus:
        ours_gpus = _local_gpu_names()
        if ours_gpus and set(ours_gpus) != set(gpus):
            return f"GPUs {sorted(set(gpus))}, this one has {sorted(set(ours_gpus))}"
    return None


def _local_cpu_model() -> str:
    """This machine's CPU model, as the device layer reports it (and calibrations record)."""
    from ...device import cpu_model
    return cpu_model()


def _local_gpu_names() -> list:
    """Names of the GPUs this process sees ([] without CuPy or a GPU)."""
    from ...device import gpu_names
    return gpu_names()


def calibrated_costs() -> CostModel:
    """`COSTS` with this machine's measured constants (`load_calibration()`), if any."""
    cal = load_calibration()
    return COSTS if cal is None else cal.costs()


def calibrated_machine(matrix, name: str = "measured") -> Machine:
    """`generic_machine(matrix)` with this machine's measured memory and link speeds
    (`load_calibration()`), if any: the model of the GPUs a store runs on."""
    m = generic_machine(matrix, name)
    cal = load_calibration()
    return m if cal is None else cal.apply(m)


def calibration_status() -> dict:
    """What the cost model of this machine uses: the calibration file, its date and
    constants, or the defaults and why (for `python -m gpukv info`)."""
    env = os.environ.get("GPUKV_CALIBRATION", "").strip()
    path = calibration_path()
    if path is None:
        return {"in_use": False, "path": None, "reason": f"GPUKV_CALIBRATION={env}"}
    cal = load_calibration()
    out = {"in_use": cal is not None, "path": str(path),
           "from": "GPUKV_CALIBRATION" if env else "user cache"}
    if cal is None:
        out["reason"] = _PROBLEMS.get(str(path), "no calibration file")
        return out
    out["created_utc"] = cal.created_utc
    out["measured_on"] = cal.system.get("name") or cal.system.get("hostname")
    out["constants"] = dict(cal.constants)
    out["links"] = {f"{w:g}": {"gbps": g, "latency_us": lat}
                    for w, (g, lat) in sorted(cal.links.items())}
    return out

"""Optimizer state: one key's `KeyState`, and the state of every key saved and loaded.

Optimizer state is saved as an archive (`gpukv.checkpoints.checkpoint`): a JSON header with the
format version, the optimizer's name, per-key kind, shape, dtype, state names and update
count (plus the hyper-parameters when asked), and one array per state tensor.
`export_state` makes it; `check_state` checks a saved one against an optimizer and the
store's weights, changing nothing, and returns a `StatePlan`; `loaded_states` and
`apply_plan` install that plan.
"""
from __future__ import annotations

import copy
import logging
import math
import numbers
from typing import NamedTuple

import numpy as np

from .._dtypes import NARROW_FLOATS
from .._errors import CheckpointError, GpukvError
from . import lr_scheduler as _sched
from ._base import Optimizer, check_number

log = logging.getLogger("gpukv")

STATE_KIND = "gpukv.optimizer-states"
STATE_VERSION = 1
#: the dtype names an optimizer updates
FLOATS = frozenset(["float16", "bfloat16", "float32", "float64"])


def compute_dtype(dtype) -> np.dtype:
    """The dtype an optimizer computes in for weights of `dtype`."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


class KeyState:
    """One key's optimizer state: state arrays and an optional float32 master copy.

    Host states made together share `arena` (their flat buffers: one per state, then
    the master's); this key's elements start at `offset` in each.
    """

    __slots__ = ("arrays", "master", "home", "arena", "offset")

    def __init__(self, arrays: tuple, master, home, arena=None, offset=0):
        self.arrays = arrays
        self.master = master
        self.home = home
        self.arena = arena
        self.offset = offset


# ------------------------------------------------------------------------- saving
def export_state(opt: Optimizer, states: dict, dump_optimizer: bool = False,
                 fetch=None) -> tuple[dict, dict]:
    """(header, {name: NumPy array}) holding every state tensor of `states` ({key:
    KeyState}) and every update count of `opt`; its options too when `dump_optimizer`.
    `fetch(home, array)`: the host array each state array goes to (default: a copy)."""
    fetch = fetch or _fetch
    keys, arrays = [], {}
    update_counts = opt.update_counts
    for i, (key, state) in enumerate(states.items()):
        names = list(opt.state_names())
        for name, arr in zip(names, state.arrays):
            arrays[f"state/{i}/{name}"] = fetch(state.home, arr)
        if state.master is not None:
            arrays[f"state/{i}/master"] = fetch(state.home, state.master)
        shape = list(state.arrays[0].shape if state.arrays else
                     (state.master.shape if state.master is not None else ()))
        keys.append({"key": key, "key_kind": type(key).__name__, "states": names,
                     "master": state.master is not None, "shape": shape,
                     "count": update_counts.get(key, opt.begin_num_update)})
    counts = [{"key": k, "key_kind": type(k).__name__, "count": c}
              for k, c in update_counts.items()]
    header = {"kind": STATE_KIND, "version": STATE_VERSION, "optimizer": opt.name,
              "num_update": opt.num_update, "keys": keys, "counts": counts}
    if dump_optimizer:
        options = header["options"] = opt.options()
        header["lr_mult"] = _mults(opt.lr_mult)
        header["wd_mult"] = _mults(opt.wd_mult)
        sched = opt.lr_scheduler
        saved = sched is not None and _sched.restorable(sched)
        if sched is not None and not saved:  # a function, a schedule of one's own
            log.warning("gpukv: lr_scheduler %r cannot be saved; only the rate it gives "
                        "the next update is (the optimizer a file is loaded into keeps "
                        "its own)", sched)
            options["learning_rate"] = _next_rate(opt)
        header["lr_scheduler"] = sched.state() if saved else None
    return header, arrays


def _next_rate(opt: Optimizer) -> float:
    """The rate `opt`'s schedule gives the next update of the keys updated most: at
    num_update + 1, as `Optimizer.next_scalars` asks (its `learning_rate`, as MXNet's, is
    the rate at num_update, the update already done). A copy is asked: a schedule that
    keeps books, as MXNet's do, must not count an update that has not happened."""
    sched = opt.lr_scheduler
    try:
        sched = copy.deepcopy(sched)
    except Exception:  # (one that cannot be copied is asked itself)
        pass
    return float(sched(opt.num_update + 1))


def _mults(table):
    return [{"key": k, "key_kind": type(k).__name__, "mult": v} for k, v in table.items()]


def _fetch(home, arr) -> np.ndarray:
    """A NumPy copy of state array `arr`, which lives on `home`."""
    fetched = home.to_host(arr)
    return fetched.copy() if fetched is arr else fetched


# ---------------------------------------------------------------- checking, loading
def check_state(opt: Optimizer, header, arrays, weights, *, path="") -> StatePlan:
    """Check saved state (`export_state`'s header and arrays) against `opt`.

    `weights`: {key: the key's value as it will be when the plan is applied}; only
    shapes and dtypes are read. Returns the `StatePlan` that `apply_plan` installs.
    Raises CheckpointError, changing nothing, for another optimizer or version, a key
    not in `weights`, states of the wrong names, shape or dtype, bad update counts,
    unknown or invalid options, multipliers that are not numbers >= 0, or a schedule
    with missing, unknown or wrong-typed attributes. When the file holds options the
    states are checked against the optimizer as those options will make it.
    """
    where = f"{path}: " if path else ""
    if not isinstance(header, dict) or header.get("kind") != STATE_KIND:
        raise CheckpointError(f"{where}not a gpukv optimizer-state checkpoint")
    version = header.get("version")
    if type(version) is not int or not 1 <= version <= STATE_VERSION:
        raise CheckpointError(f"{where}optimizer-state version {_brief(version)} is not "
                              f"supported (this gpukv reads up to {STATE_VERSION})")
    if header.get("optimizer") != opt.name:
        raise CheckpointError(f"{where}holds the state of optimizer "
                              f"{_brief(header.get('optimizer'))}, but this store's "
                              f"optimizer is {opt.name!r}")
    try:
        return _checked_plan(opt, header, arrays, weights, where)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where}damaged optimizer-state header: "
                              f"{type(exc).__name__}: {exc}") from exc


def apply_plan(opt: Optimizer, plan: StatePlan) -> None:
    """Swap a plan's update counts, options, multipliers and schedule into `opt` at once
    (its states go in beside them: see `loaded_states`)."""
    if plan.options is not None:
        for attr, value in plan.options.items():
            setattr(opt, attr, value)
        opt.lr_mult = dict(plan.lr_mult or {})
        opt.wd_mult = dict(plan.wd_mult or {})
        if plan.schedule is not None:
            opt.lr_scheduler = plan.schedule
    opt.restore_update_counts(plan.counts, plan.num_update)


def take_saved(opt: Optimizer, header: dict, counts: dict, num_update: int) -> None:
    """`opt` takes what a saved state's `header` (checked where its states are loaded)
    gives beside the states: the update counts ({key: count}) and `num_update`, and the
    options, multipliers and schedule when it holds them (saved with `dump_optimizer`),
    as a load into its own store gives them. For a copy of an optimizer that others run
    (a worker's, whose servers hold the states), which then goes on as they do."""
    options, _ = _checked_options(opt, header.get("options"), "")
    apply_plan(opt, StatePlan([], counts, num_update, options,
                              _checked_mults(header.get("lr_mult"), "lr_mult", ""),
                              _checked_mults(header.get("wd_mult"), "wd_mult", ""),
                              _checked_schedule(header.get("lr_scheduler"), num_update, "")))


def _checked_plan(opt, header, arrays, weights, where) -> StatePlan:
    options, rule = _checked_options(opt, header.get("options"), where)
    num_update = _checked_count(header.get("num_update"), "num_update", where)
    lr_mult = _checked_mults(header.get("lr_mult"), "lr_mult", where)
    wd_mult = _checked_mults(header.get("wd_mult"), "wd_mult", where)
    schedule = _checked_schedule(header.get("lr_scheduler"), num_update, where)
    keys = _checked_keys(opt, header.get("keys"), arrays, weights,
                         tuple(rule.state_names()), where)
    raw_counts = header.get("counts", [])
    if not isinstance(raw_counts, list):
        raise CheckpointError(f"{where}damaged optimizer-state header (counts)")
    counts = {}
    for entry in raw_counts:
        key = _key(entry, where)
        counts[key] = _checked_count(entry.get("count"), f"the update count of key "
                                     f"{_brief(key)}", where)
    for loaded in keys:
        counts.setdefault(loaded.key, loaded.count)
    return StatePlan(keys, counts, num_update, options, lr_mult, wd_mult, schedule)


def _checked_options(opt, raw, where):
    """({attribute: value} the file's options give, the optimizer they make), or
    (None, `opt`) when the file holds none."""
    if raw is None:
        return None, opt
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}damaged optimizer options {_brief(raw)}")
    known = opt.option_names
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise CheckpointError(f"{where}unknown option(s) {', '.join(map(_brief, unknown))} "
                              f"of optimizer {opt.name!r} (it takes {', '.join(known)})")
    try:
        rule = type(opt)(**raw)
    except GpukvError as exc:
        raise CheckpointError(f"{where}the file's optimizer options do not fit: "
                              f"{exc}") from exc
    attrs = ["lr" if name == "learning_rate" else name for name in known]
    return {attr: getattr(rule, attr) for attr in attrs}, rule


def _checked_mults(raw, name, where):
    """{key: multiplier} of the file's `name` section, or None when it has none."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise CheckpointError(f"{where}damaged {name} section {_brief(raw)}")
    table = {}
    for entry in raw:
        key = _key(entry, where)
        try:
            table[key] = check_number(f"{name}[{_brief(key)}]", entry.get("mult"), low=0)
        except GpukvError as exc:
            raise CheckpointError(f"{where}{exc}") from exc
    return table


def _checked_keys(opt, infos, arrays, weights, names, where) -> list:
    """The `_LoadedKey` of every key of the file, checked against `weights`."""
    if not isinstance(infos, list):
        raise CheckpointError(f"{where}damaged optimizer-state header (keys)")
    loaded: list = []
    seen: set = set()
    names_of: dict = {}
    for i, info in enumerate(infos):
        key = _key(info, where)
        if key in seen:
            raise CheckpointError(f"{where}key {_brief(key)} has optimizer state twice")
        seen.add(key)
        weight = weights.get(key)
        if weight is None:
            raise CheckpointError(f"{where}key {_brief(key)} has optimizer state in the "
                                  f"file but is not in this store")
        dtype = weight.dtype
        name_of = names_of.get(dtype)
        if name_of is None:  # dtype.name is slow in NumPy: read once per dtype
            name_of = names_of[dtype] = dtype.name
        if name_of not in FLOATS:
            raise CheckpointError(
                f"{where}key {_brief(key)}: the file has optimizer state for it, but it "
                f"holds {dtype}; optimizer {opt.name!r} updates floating-point values")
        if info.get("states") != list(names):
            raise CheckpointError(
                f"{where}key {_brief(key)}: the file holds states "
                f"{_brief(info.get('states'))}, this optimizer keeps {list(names)} "
                f"(different options?)")
        narrow = name_of in NARROW_FLOATS
        if info.get("master") is not narrow:
            held = {True: "holds a float32 master copy, kept for 16-bit weights",
                    False: "holds no float32 master copy, which 16-bit weights keep"}.get(
                info.get("master"), f"has a damaged master entry ({_brief(info.get('master'))})")
            raise CheckpointError(f"{where}key {_brief(key)}: the file {held}; the key is "
                                  f"{dtype} (saved from a key of another dtype?)")
        count = _checked_count(info.get("count"), f"the update count of key "
                               f"{_brief(key)}", where)
        shape = tuple(weight.shape)
        ct = compute_dtype(dtype)
        states = tuple(_state_array(arrays, f"state/{i}/{name}", key, f"state {name!r}",
                                    shape, ct, where) for name in names)
        master = (_state_array(arrays, f"state/{i}/master", key, "master copy", shape,
                               np.dtype(np.float32), where) if narrow else None)
        loaded.append(_LoadedKey(key, shape, ct, states, master, count))
    return loaded


def loaded_states(plan: StatePlan, homes: dict) -> dict:
    """{key: KeyState} holding copies of the checked arrays of the plan's keys, on each
    key's home (`homes`: {key: device}); host states of one compute dtype share flat
    buffers, as states made together do."""
    keys = plan.keys
    states = dict.fromkeys(loaded.key for loaded in keys)  # the file's order
    on_host: dict = {}
    devices = set()
    for loaded in keys:
        home = homes[loaded.key]
        if home.host_memory:
            on_host.setdefault((loaded.ct, loaded.master is not None), []).append(
                (loaded, home))
            continue
        master = None if loaded.master is None else _on_device(home, loaded.master)
        states[loaded.key] = KeyState(tuple(_on_device(home, a) for a in loaded.states),
                                      master, home)
        devices.add(home)
    for (ct, narrow), group in on_host.items():
        _host_arena(states, group, ct, narrow)
    for home in devices:  # the file's host arrays may go away once this returns
        home.synchronize()
    return states


def _key(info, where=""):
    kind, key = ((info.get("key_kind"), info.get("key")) if isinstance(info, dict)
                 else (None, None))
    if kind == "int" and type(key) is int:
        return key
    if kind == "str" and isinstance(key, str):
        return key
    raise CheckpointError(f"{where}damaged key entry {_brief(info)}")


# ------------------------------------------------------- loading saved state: helpers
class _LoadedKey(NamedTuple):
    """One key's saved state, checked: host arrays of the key's shape."""
    key: object
    shape: tuple
    ct: np.dtype          # the compute dtype of the key's weight
    states: tuple         # one array per state name
    master: object        # the float32 master copy of a 16-bit weight, or None
    count: int  # type: ignore[assignment]  # a field may shadow tuple.count


class StatePlan(NamedTuple):
    """Saved optimizer state checked by `check_state`, ready to apply."""
    keys: list            # _LoadedKey of every key with state
    counts: dict          # key -> update count
    num_update: int
    options: dict | None  # optimizer attribute -> value, when the file holds options
    lr_mult: dict | None
    wd_mult: dict | None
    schedule: object      # a restored LRScheduler, or None


def _brief(value, limit: int = 80) -> str:
    """`repr(value)` for messages: shortened when long, never a ValueError."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return "<an int too long to print>"
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _checked_count(value, what: str, where: str) -> int:
    if type(value) is not int or value < 0:
        raise CheckpointError(f"{where}{what} is {_brief(value)}; expected an int >= 0")
    return value


def _state_array(arrays, name, key, what, shape, dtype, where) -> np.ndarray:
    array = arrays.get(name)
    if array is None:
        raise CheckpointError(f"{where}key {_brief(key)}: {what} is missing")
    if array.shape != shape or array.dtype != dtype:
        raise CheckpointError(f"{where}key {_brief(key)}: {what} is {array.dtype}"
                              f"{list(array.shape)}, expected {dtype}{list(shape)}")
    return array


def _on_device(home, array):
    """A C-ordered copy of host `array` on `home` (an .npz member may be Fortran-ordered,
    and the multi-tensor kernels walk flat pointers)."""
    out = home.empty(array.shape, array.dtype)
    home.copy(out, array)
    return out


def _host_arena(states: dict, group: list, ct, narrow: bool) -> None:
    """Host states of `group` [(loaded key, home)] as views into shared flat buffers (one
    per state, then the master copies'), laid out as `KeyState` describes."""
    nstates = len(group[0][0].states)
    total = sum(math.prod(loaded.shape) for loaded, _ in group)
    arena = tuple(np.empty(total, ct) for _ in range(nstates))
    if narrow:
        arena += (np.empty(total, np.float32),)
    offset = 0
    for loaded, home in group:
        end = offset + math.prod(loaded.shape)
        arrays = tuple(a[offset:end].reshape(loaded.shape) for a in arena[:nstates])
        for dst, src in zip(arrays, loaded.states):
            np.copyto(dst, src)
        master = None
        if narrow:
            master = arena[-1][offset:end].reshape(loaded.shape)
            np.copyto(master, loaded.master)
        states[loaded.key] = KeyState(arrays, master, home, arena, offset)
        offset = end


# Schedules `lr_scheduler.from_state` restores, each made once with the fewest arguments:
# a saved one must have exactly the attributes these have, of the same kinds.
_SCHEDULES = {
    "FactorScheduler": lambda: _sched.FactorScheduler(step=1),
    "MultiFactorScheduler": lambda: _sched.MultiFactorScheduler(step=[1]),
    "PolyScheduler": lambda: _sched.PolyScheduler(max_update=1),
    "CosineScheduler": lambda: _sched.CosineScheduler(max_update=1),
}
_AT_LEAST_ONE = frozenset(["step", "max_update"])
#: FactorScheduler steps its count one `step` at a time up to num_update: a saved count
#: further behind than this many steps would make the next push loop for ever
_MAX_CATCH_UP = 10_000_000


def _checked_schedule(state, num_update: int, where: str):
    """The schedule a file's `lr_scheduler` section describes, every attribute checked
    and tried at the next updates, or None when the section is empty."""
    if state is None:
        return None
    name = state.get("class") if isinstance(state, dict) else None
    attrs = state.get("attrs") if isinstance(state, dict) else None
    if name not in _SCHEDULES or not isinstance(attrs, dict):
        raise CheckpointError(f"{where}lr_scheduler: not a schedule gpukv can restore "
                              f"({_brief(state)})")
    sample = vars(_SCHEDULES[name]())
    missing = sorted(set(sample) - set(attrs))
    unknown = sorted(set(attrs) - set(sample))
    if missing or unknown:
        problems = ([f"missing attribute(s) {', '.join(missing)}"] if missing else []) + (
            [f"unknown attribute(s) {', '.join(map(_brief, unknown))}"] if unknown else [])
        raise CheckpointError(f"{where}lr_scheduler {name}: {'; '.join(problems)}")
    clean = {attr: _schedule_value(f"{where}lr_scheduler {name}.{attr}", attr, attrs[attr],
                                   sample[attr]) for attr in sample}
    what = f"{where}lr_scheduler {name}"
    if "cur_step_ind" in clean and clean["cur_step_ind"] > len(clean["step"]):
        raise CheckpointError(f"{what}: cur_step_ind {clean['cur_step_ind']} is past its "
                              f"{len(clean['step'])} steps")
    if "max_steps" in clean and clean["max_steps"] != clean["max_update"] - clean["warmup_steps"]:
        raise CheckpointError(f"{what}: max_steps {clean['max_steps']} is not max_update - "
                              f"warmup_steps")
    if name == "FactorScheduler" and num_update + 1 - clean["count"] > (
            _MAX_CATCH_UP * clean["step"]):
        raise CheckpointError(f"{what}: count {clean['count']} is too far behind num_update "
                              f"{num_update} for step {clean['step']}")
    schedule = _sched.from_state({"class": name, "attrs": clean})
    trial = copy.deepcopy(schedule)  # schedules keep books as they are called
    for n in (num_update, num_update + 1):
        try:
            lr = trial(n)
        except Exception as exc:
            raise CheckpointError(f"{what} fails at update {n}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        if (isinstance(lr, bool) or not isinstance(lr, numbers.Real)
                or not math.isfinite(lr) or lr < 0):
            raise CheckpointError(f"{what} gives the learning rate {_brief(lr)} at update {n}")
    return schedule


def _schedule_value(what: str, attr: str, value, sample):
    """`value` of a saved schedule's attribute, checked against `sample`'s kind."""
    if isinstance(sample, str):  # warmup_mode
        if value not in ("linear", "constant"):
            raise CheckpointError(f"{what} is {_brief(value)}; expected 'linear' or "
                                  f"'constant'")
        return value
    if isinstance(sample, list):  # MultiFactorScheduler's steps
        if (not isinstance(value, list) or not value
                or not all(type(s) is int and s >= 1 for s in value)
                or any(b <= a for a, b in zip(value, value[1:]))):
            raise CheckpointError(f"{what} is {_brief(value)}; expected increasing ints >= 1")
        return list(value)
    if isinstance(sample, int):
        low = 1 if attr in _AT_LEAST_ONE else (None if attr == "max_steps" else 0)
        if type(value) is not int or (low is not None and value < low):
            bound = f" >= {low}" if low is not None else ""
            raise CheckpointError(f"{what} is {_brief(value)}; expected an int{bound}")
        return value
    high = 1 if attr == "factor" else math.inf
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 <= value <= high):
        raise CheckpointError(f"{what} is {_brief(value)}; expected a number in "
                              f"[0, {high:g}]")
    return float(value)

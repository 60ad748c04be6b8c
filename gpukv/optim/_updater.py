"""`OptimizerUpdater`: runs an Optimizer over the keys of a push, where they live.

The store calls `update(keys, merged, stored, homes)` once per push with every key of
the call. Per key the updater keeps its state arrays (and, for float16/bfloat16 weights,
a float32 master copy) on the key's home device, created on the key's first update.
Host-homed keys are updated with vectorised NumPy, one key at a time; GPU-homed keys are
grouped by (home, dtype) and each group is updated by one multi-tensor kernel launch.

Optimizer state is saved as an archive (`gpukv._checkpoint`): a JSON header with the
format version, the optimizer's name, per-key kind, shape, dtype, state names and update
count (plus the hyper-parameters when asked), and one array per state tensor.
"""
from __future__ import annotations

import logging

import numpy as np

from .._errors import CheckpointError, DTypeError
from ._base import Optimizer
from . import lr_scheduler as _sched

log = logging.getLogger("gpukv")

STATE_KIND = "gpukv.optimizer-states"
STATE_VERSION = 1
_NARROW = frozenset(["float16", "bfloat16"])
_FLOATS = frozenset(["float16", "bfloat16", "float32", "float64"])


def compute_dtype(dtype) -> np.dtype:
    """The dtype an optimizer computes in for weights of `dtype`."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


class KeyState:
    """One key's optimizer state: state arrays and an optional float32 master copy."""

    __slots__ = ("arrays", "master", "home")

    def __init__(self, arrays: tuple, master, home):
        self.arrays = arrays
        self.master = master
        self.home = home


def _host_copy(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


class OptimizerUpdater:
    """The batch updater `KVStore.set_optimizer` installs."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.states: dict = {}

    # ------------------------------------------------------------------ states
    def _new_state(self, stored, home) -> KeyState:
        names = self.optimizer.state_names()
        ct = compute_dtype(stored.dtype)
        narrow = stored.dtype.name in _NARROW
        if home.kind == "gpu":
            with home.cuda_device, home.stream:
                xp = home.xp
                arrays = tuple(xp.zeros(stored.shape, ct) for _ in names)
                master = stored.astype(np.float32) if narrow else None
        else:
            arrays = tuple(np.zeros(stored.shape, ct) for _ in names)
            master = stored.astype(np.float32) if narrow else None
        return KeyState(arrays, master, home)

    # ------------------------------------------------------------------ update
    def update(self, keys, merged, stored, homes) -> None:
        for key, s in zip(keys, stored):
            if s.dtype.name not in _FLOATS:
                raise DTypeError(f"key {key!r}: optimizer {self.optimizer.name!r} needs a "
                                 f"floating-point value, the key holds {s.dtype}")
        opt = self.optimizer
        hp = opt.hyper()
        host, gpu = [], {}
        for key, m, s, home in zip(keys, merged, stored, homes):
            state = self.states.get(key)
            if state is None:
                state = self.states[key] = self._new_state(s, home)
            scalars = opt.next_scalars(key)
            item = (s, m, state.master, state.arrays, scalars)
            if home.kind == "gpu":
                gpu.setdefault((home, s.dtype), []).append(item)
            else:
                host.append(item)
        if host:
            self._host(host, hp)
        if gpu:
            from .. import _optim_kernels
            for (home, _), items in gpu.items():
                with home.cuda_device, home.stream:
                    items = [self._gpu_item(home, it) for it in items]
                    _optim_kernels.step(opt, home, items, hp)

    def _host(self, items, hp) -> None:
        opt = self.optimizer
        typed = {}
        for stored, grad, master, states, scalars in items:
            ct = compute_dtype(stored.dtype).type
            hpc = typed.get(ct)
            if hpc is None:
                hpc = typed[ct] = {k: ct(v) for k, v in hp.items()}
            sc = tuple(ct(v) for v in scalars)
            w = stored if master is None else master
            g = grad if grad.dtype == w.dtype else grad.astype(w.dtype)
            if opt.name == "lamb":
                opt.host_step(w, g, states, sc, hpc, stored=stored)
            else:
                opt.host_step(w, g, states, sc, hpc)
            if master is not None:
                np.copyto(stored, master, casting="unsafe")

    @staticmethod
    def _gpu_item(home, item):
        stored, grad, master, states, scalars = item
        xp = home.xp
        ct = compute_dtype(stored.dtype)
        if not home.owns(grad) or grad.dtype != ct or not grad.flags.c_contiguous:
            local = xp.empty(stored.shape, ct)
            home.copy(local, grad)
            grad = local
        return (stored, grad, master, states, scalars)

    # -------------------------------------------------------------- save / load
    def export_state(self, dump_optimizer: bool = False) -> tuple[dict, dict]:
        """(header, {name: NumPy array}) holding every state tensor and update count."""
        opt = self.optimizer
        keys, arrays = [], {}
        for i, (key, state) in enumerate(self.states.items()):
            names = list(opt.state_names())
            for name, arr in zip(names, state.arrays):
                arrays[f"state/{i}/{name}"] = self._fetch(state.home, arr)
            if state.master is not None:
                arrays[f"state/{i}/master"] = self._fetch(state.home, state.master)
            shape = list(state.arrays[0].shape if state.arrays else
                         (state.master.shape if state.master is not None else ()))
            keys.append({"key": key, "key_kind": type(key).__name__, "states": names,
                         "master": state.master is not None, "shape": shape,
                         "count": opt._index_update_count.get(key, opt.begin_num_update)})
        counts = [{"key": k, "key_kind": type(k).__name__, "count": c}
                  for k, c in opt._index_update_count.items()]
        header = {"kind": STATE_KIND, "version": STATE_VERSION, "optimizer": opt.name,
                  "num_update": opt.num_update, "keys": keys, "counts": counts}
        if dump_optimizer:
            header["options"] = opt.options()
            header["lr_mult"] = self._mults(opt.lr_mult)
            header["wd_mult"] = self._mults(opt.wd_mult)
            sched = opt.lr_scheduler
            if sched is not None and not hasattr(sched, "state"):
                log.warning("gpukv: lr_scheduler %r cannot be saved; only its learning "
                            "rate is", sched)
            header["lr_scheduler"] = sched.state() if hasattr(sched, "state") else None
        return header, arrays

    @staticmethod
    def _mults(table):
        return [{"key": k, "key_kind": type(k).__name__, "mult": v} for k, v in table.items()]

    @staticmethod
    def _fetch(home, arr) -> np.ndarray:
        if isinstance(arr, np.ndarray):
            return arr.copy()
        with home.cuda_device:
            return arr.get(stream=home.stream)

    def import_state(self, header, arrays, entries, *, check_only=False, path="") -> None:
        """Replace every state with the saved ones; `entries`: {key: (value, home)}.

        Everything is checked before anything changes; any mismatch is a CheckpointError.
        """
        where = f"{path}: " if path else ""
        opt = self.optimizer
        if not isinstance(header, dict) or header.get("kind") != STATE_KIND:
            raise CheckpointError(f"{where}not a gpukv optimizer-state checkpoint")
        version = header.get("version")
        if not isinstance(version, int) or not 1 <= version <= STATE_VERSION:
            raise CheckpointError(f"{where}optimizer-state version {version!r} is not "
                                  f"supported (this gpukv reads up to {STATE_VERSION})")
        if header.get("optimizer") != opt.name:
            raise CheckpointError(f"{where}holds the state of optimizer "
                                  f"{header.get('optimizer')!r}, but this store's optimizer "
                                  f"is {opt.name!r}")
        try:
            keys = header["keys"]
            plan = []
            for i, info in enumerate(keys):
                key = self._key(info)
                if key not in entries and check_only:
                    continue  # a whole-store load creates the key before the states
                if key not in entries:
                    raise CheckpointError(f"{where}key {key!r} has optimizer state in the "
                                          f"file but is not in this store")
                value, home = entries[key]
                names = tuple(opt.state_names())
                if tuple(info["states"]) != names:
                    raise CheckpointError(
                        f"{where}key {key!r}: the file holds states {info['states']}, this "
                        f"optimizer keeps {list(names)} (different options?)")
                ct = compute_dtype(value.dtype)
                narrow = value.dtype.name in _NARROW
                if bool(info["master"]) != narrow:
                    raise CheckpointError(f"{where}key {key!r}: the file's master copy does "
                                          f"not fit a {value.dtype} weight")
                got = []
                for name in names:
                    arr = arrays.get(f"state/{i}/{name}")
                    if arr is None:
                        raise CheckpointError(f"{where}key {key!r}: state {name!r} is missing")
                    if arr.shape != value.shape or arr.dtype != ct:
                        raise CheckpointError(
                            f"{where}key {key!r}: state {name!r} is {arr.dtype}"
                            f"{list(arr.shape)}, expected {ct}{list(value.shape)}")
                    got.append(arr)
                master = None
                if narrow:
                    master = arrays.get(f"state/{i}/master")
                    if (master is None or master.shape != value.shape
                            or master.dtype != np.float32):
                        raise CheckpointError(f"{where}key {key!r}: master copy missing or "
                                              f"of the wrong shape")
                plan.append((key, home, got, master, int(info["count"])))
            counts = {self._key(c): int(c["count"]) for c in header.get("counts", [])}
            num_update = int(header["num_update"])
            new_opt = new_sched = None
            if header.get("options") is not None:
                new_opt = type(opt)(**header["options"])
                if header.get("lr_scheduler") is not None:
                    new_sched = _sched.from_state(header["lr_scheduler"])
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{where}damaged optimizer-state header: "
                                  f"{type(exc).__name__}: {exc}") from exc
        if check_only:
            return
        states = {}
        for key, home, got, master, count in plan:
            if home.kind == "gpu":
                with home.cuda_device, home.stream:
                    xp = home.xp
                    arrs = tuple(xp.asarray(a) for a in got)
                    m = xp.asarray(master) if master is not None else None
                home.synchronize()
            else:
                arrs = tuple(np.array(a, copy=True) for a in got)
                m = np.array(master, copy=True) if master is not None else None
            states[key] = KeyState(arrs, m, home)
            counts.setdefault(key, count)
        if new_opt is not None:
            for name in opt._options:
                attr = "lr" if name == "learning_rate" else name
                setattr(opt, attr, getattr(new_opt, attr))
            opt.lr_mult = {self._key(e): float(e["mult"]) for e in header.get("lr_mult", [])}
            opt.wd_mult = {self._key(e): float(e["mult"]) for e in header.get("wd_mult", [])}
            if new_sched is not None:
                opt.lr_scheduler = new_sched
        self.states = states
        opt._index_update_count = counts
        opt.num_update = num_update

    @staticmethod
    def _key(info):
        kind, key = info["key_kind"], info["key"]
        if kind == "int" and isinstance(key, int) and not isinstance(key, bool):
            return key
        if kind == "str" and isinstance(key, str):
            return key
        raise CheckpointError(f"damaged key entry {info!r}")

"""`OptimizerUpdater`: runs an Optimizer over the keys of a push, where they live.

The store calls `update(keys, merged, stored, homes)` once per push with every key of
the call, and `update_rows(keys, merged, stored, homes)` with the merged `RowSparse`
gradients of row-sparse pushes. Per key the updater keeps its state arrays (and, for
float16/bfloat16 weights, a float32 master copy) on the key's home device, created on the
key's first update. GPU-homed keys are grouped by (home, dtype) and each group is updated
by one multi-tensor kernel launch.

On the host the rule's `host_chunk` (in-place ufuncs only) runs over pieces of `CHUNK`
elements, so its several passes find their operands in cache, with scratch buffers the
updater keeps. The states of keys first updated together are views into one flat buffer
per state; keys smaller than `SMALL` that share their scalars are gathered into one piece
(their states, when adjacent in that buffer, are used in place), so a push of many small
keys costs a few ufunc calls per piece instead of per key.

Row-sparse gradients: when the rule updates lazily (`Optimizer.lazy_rows`), the rows of
the weight and of each state named by the gradient are gathered, updated with the rule's
sparse form and scattered back; no other row is read or written. Otherwise the gradient
is made dense and every row gets the standard update, as MXNet 1.9.1 does.

Optimizer state is saved as an archive (`gpukv.api.checkpoint`): a JSON header with the
format version, the optimizer's name, per-key kind, shape, dtype, state names and update
count (plus the hyper-parameters when asked), and one array per state tensor.
"""
from __future__ import annotations

import copy
import logging
import math
import numbers
import typing
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._dtypes import NARROW_FLOATS
from .._errors import CheckpointError, DTypeError, GpukvError
from . import lr_scheduler as _sched
from ._base import Optimizer, check_number

if TYPE_CHECKING:
    from ._rules import LAMB

log = logging.getLogger("gpukv")

STATE_KIND = "gpukv.optimizer-states"
STATE_VERSION = 1
_FLOATS = frozenset(["float16", "bfloat16", "float32", "float64"])
_FLOAT_DTYPES: dict = {}  # dtype -> whether an optimizer can update it

#: elements per piece of a host step (the rule's operands stay in L2 while it runs)
CHUNK = 1 << 15
#: keys below this many elements are gathered with others into one piece
SMALL = 1 << 14


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


def _flat(a) -> np.ndarray:
    return a.reshape(-1)


class _Scratch:
    """The host scratch of one compute dtype: pieces of CHUNK elements, grown on demand."""

    __slots__ = ("dtype", "rows", "wide")

    def __init__(self, dtype):
        self.dtype = dtype
        self.rows = np.empty((0, CHUNK), dtype)
        self.wide = [np.empty(0, dtype), np.empty(0, np.float64)]

    def take(self, n: int) -> np.ndarray:
        """`n` scratch arrays of CHUNK elements (rows of one buffer, made once)."""
        if self.rows.shape[0] < n:
            self.rows = np.empty((n, CHUNK), self.dtype)
        return self.rows

    def full(self, size: int, slot: int = 0) -> np.ndarray:
        """A flat scratch array of `size` elements: slot 0 of this dtype (LAMB's
        direction), slot 1 of float64 (its squares, for the norms)."""
        if self.wide[slot].size < size:
            self.wide[slot] = np.empty(size, self.wide[slot].dtype)
        return self.wide[slot][:size]


class OptimizerUpdater:
    """The batch updater `KVStore.set_optimizer` installs."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.states: dict = {}
        self._scratch: dict = {}
        self._typed: tuple = (None, {})

    # ------------------------------------------------------------------ states
    def _new_state(self, stored, home) -> KeyState:
        """The state of one key, its arrays made on `home` (on its stream)."""
        names = self.optimizer.state_names()
        ct = compute_dtype(stored.dtype)
        narrow = stored.dtype.name in NARROW_FLOATS
        with home.activate():
            xp = home.xp
            arrays = tuple(xp.zeros(stored.shape, ct) for _ in names)
            master = stored.astype(np.float32) if narrow else None
        return KeyState(arrays, master, home)

    def _new_host_states(self, keys, stored) -> None:
        """States of new host keys of one compute dtype: views into shared flat buffers."""
        names = self.optimizer.state_names()
        by_type: dict = {}
        for key, s in zip(keys, stored):
            by_type.setdefault((compute_dtype(s.dtype), s.dtype.name in NARROW_FLOATS),
                               []).append((key, s))
        for (ct, narrow), group in by_type.items():
            total = sum(s.size for _, s in group)
            arena = tuple(np.zeros(total, ct) for _ in names)
            if narrow:
                arena = arena + (np.empty(total, np.float32),)
            offset = 0
            for key, s in group:
                end = offset + s.size
                arrays = tuple(a[offset:end].reshape(s.shape) for a in arena[:len(names)])
                master = None
                if narrow:
                    master = arena[-1][offset:end].reshape(s.shape)
                    np.copyto(master, s, casting="unsafe")
                self.states[key] = KeyState(arrays, master, None, arena, offset)
                offset = end

    def _ensure_states(self, keys, stored, homes) -> None:
        states = self.states
        new_host: tuple[list, list, list] | None = None
        for key, s, home in zip(keys, stored, homes):
            state = states.get(key)
            if state is not None:
                continue
            if not home.host_memory:
                states[key] = self._new_state(s, home)
            else:
                if new_host is None:
                    new_host = ([], [], [])
                new_host[0].append(key)
                new_host[1].append(s)
                new_host[2].append(home)
        if new_host is not None:
            self._new_host_states(new_host[0], new_host[1])
            for key, home in zip(new_host[0], new_host[2]):
                states[key].home = home

    def check(self, keys, stored) -> None:
        """DTypeError naming the first key whose value this optimizer cannot update."""
        known = _FLOAT_DTYPES
        for key, s in zip(keys, stored):
            ok = known.get(s.dtype)
            if ok is None:  # dtype.name is slow in NumPy: read once per dtype
                ok = known[s.dtype] = s.dtype.name in _FLOATS
            if not ok:
                raise DTypeError(f"key {key!r}: optimizer {self.optimizer.name!r} needs a "
                                 f"floating-point value, the key holds {s.dtype}")

    def _hyper(self, hp: dict, ct) -> dict:
        """`hp` with every value as a `ct` scalar (cached while `hp` stays the same)."""
        base, typed = self._typed
        if base != hp:
            typed = {}
            self._typed = (hp, typed)
        out = typed.get(ct)
        if out is None:
            out = typed[ct] = {k: ct(v) for k, v in hp.items()}
        return out

    def _scratch_for(self, ct) -> _Scratch:
        sc = self._scratch.get(ct)
        if sc is None:
            sc = self._scratch[ct] = _Scratch(np.dtype(ct))
        return sc

    # ------------------------------------------------------------------ update
    def update(self, keys, merged, stored, homes) -> None:
        self.check(keys, stored)
        opt = self.optimizer
        hp = opt.hyper()
        self._ensure_states(keys, stored, homes)
        states = self.states
        host: list = []
        gpu: dict = {}
        for key, m, s, home in zip(keys, merged, stored, homes):
            state = states[key]
            scalars = opt.next_scalars(key)
            if home.host_memory:
                host.append((s, m, state, scalars))
            else:
                gpu.setdefault((home, s.dtype), []).append(
                    (s, m, state.master, state.arrays, scalars))
        if host:
            self._host(host, hp)
        if gpu:
            self._gpu(gpu, hp)

    def _gpu(self, gpu, hp, body=None) -> None:
        """Update the keys of device homes, one multi-tensor step per (home, dtype)."""
        opt = self.optimizer
        for (home, _), items in gpu.items():
            with home.activate():
                items = [self._gpu_item(home, it) for it in items]
                home.optimizer_step(opt, items, hp, body=body)

    # ------------------------------------------------------------- host steps
    def _host(self, items, hp, chunk_fn=None) -> None:
        """Update host `items` [(stored, grad, KeyState, scalars)] in place."""
        opt = self.optimizer
        lamb = getattr(opt, "per_key_norms", False)
        if chunk_fn is None:
            chunk_fn = opt.host_chunk
        batch: list = []
        bkey, btotal = None, 0
        for item in items:
            stored = item[0]
            n = stored.size
            if lamb or n >= SMALL or not stored.flags.c_contiguous:
                if batch:
                    self._host_batch(batch, hp, chunk_fn)
                    batch, bkey, btotal = [], None, 0
                if lamb:
                    self._host_lamb(item, hp)
                else:
                    self._host_key(item, hp, chunk_fn)
                continue
            key = (stored.dtype, item[3])
            if batch and (key != bkey or btotal + n > CHUNK):
                self._host_batch(batch, hp, chunk_fn)
                batch, btotal = [], 0
            batch.append(item)
            bkey = key
            btotal += n
        if batch:
            self._host_batch(batch, hp, chunk_fn)

    def _key_setup(self, item, hp):
        """(stored, grad, state, w, hyper, scalars) of a host item: `w` is what the rule
        updates (the float32 master copy, if the key has one), hyper and scalars in its type."""
        stored, grad, state, scalars = item
        w = stored if state.master is None else state.master
        ct = w.dtype.type
        return stored, grad, state, w, self._hyper(hp, ct), tuple(ct(v) for v in scalars)

    @staticmethod
    def _whole_key(stored, grad, state, w, step) -> bool:
        """For a key with a strided weight or state: run `step(g)` on it at once (`g`: the
        gradient in w's dtype), copy the master back into `stored`, and return True.
        False (nothing done) when everything is C-contiguous: go piece by piece."""
        if w.flags.c_contiguous and all(a.flags.c_contiguous for a in state.arrays):
            return False
        step(grad if grad.dtype == w.dtype else grad.astype(w.dtype))
        if state.master is not None:
            np.copyto(stored, state.master, casting="unsafe")
        return True

    def _host_key(self, item, hp, chunk_fn) -> None:
        """One key, piece by piece, in place."""
        stored, grad, state, w, hpc, sc = self._key_setup(item, hp)
        ntmp = self.optimizer.host_scratch
        if self._whole_key(stored, grad, state, w, lambda g: chunk_fn(
                w, g, state.arrays, sc, hpc, [np.empty_like(w) for _ in range(ntmp)])):
            return
        self._run_pieces(_flat(w), _flat(grad), [_flat(a) for a in state.arrays], sc, hpc,
                         chunk_fn, None if state.master is None else _flat(stored))

    def _run_pieces(self, wf, gf, sf, sc, hpc, chunk_fn, stored_flat=None) -> None:
        n = wf.size
        scratch = self._scratch_for(wf.dtype.type)
        ntmp = self.optimizer.host_scratch
        cast = gf.dtype != wf.dtype
        rows = scratch.take(ntmp + (1 if cast else 0))
        if n <= CHUNK:
            m = n
            tmp = [rows[i, :m] for i in range(ntmp)]
            if cast:
                np.copyto(rows[ntmp, :m], gf, casting="unsafe")
                gf = rows[ntmp, :m]
            chunk_fn(wf, gf, sf, sc, hpc, tmp)
            if stored_flat is not None:
                np.copyto(stored_flat, wf, casting="unsafe")
            return
        for a in range(0, n, CHUNK):
            b = min(a + CHUNK, n)
            m = b - a
            tmp = [rows[i, :m] for i in range(ntmp)]
            g = gf[a:b]
            if cast:
                np.copyto(rows[ntmp, :m], g, casting="unsafe")
                g = rows[ntmp, :m]
            w = wf[a:b]
            chunk_fn(w, g, [s[a:b] for s in sf], sc, hpc, tmp)
            if stored_flat is not None:
                np.copyto(stored_flat[a:b], w, casting="unsafe")

    def _host_batch(self, batch, hp, chunk_fn) -> None:
        """Small keys sharing a dtype and scalars: gathered into one piece."""
        if len(batch) == 1:
            self._host_key(batch[0], hp, chunk_fn)
            return
        opt = self.optimizer
        first = batch[0][2]
        narrow = first.master is not None
        ct = compute_dtype(batch[0][0].dtype).type
        hpc = self._hyper(hp, ct)
        sc = tuple(ct(v) for v in batch[0][3])
        sizes = [it[0].size for it in batch]
        n = sum(sizes)
        nstates = len(first.arrays)
        arena, start = first.arena, first.offset
        adjacent = arena is not None
        if adjacent:
            end = start
            for it, size in zip(batch, sizes):
                st = it[2]
                if st.arena is not arena or st.offset != end:
                    adjacent = False
                    break
                end += size
        ntmp = opt.host_scratch
        # scratch rows: tmp..., grad, weight, states... (the last two when not adjacent)
        need = ntmp + 1 + (0 if adjacent and narrow else 1) + (0 if adjacent else nstates)
        rows = self._scratch_for(ct).take(need)
        tmp = [rows[i, :n] for i in range(ntmp)]
        g = rows[ntmp, :n]
        np.concatenate([_flat(it[1]) for it in batch], out=g, casting="unsafe")
        row = ntmp + 1
        if adjacent:
            states = [a[start:start + n] for a in arena[:nstates]]
        else:
            states = []
            for j in range(nstates):
                buf = rows[row, :n]
                row += 1
                np.concatenate([_flat(it[2].arrays[j]) for it in batch], out=buf)
                states.append(buf)
        if narrow and adjacent:
            w = arena[-1][start:start + n]
        else:
            w = rows[row, :n]
            np.concatenate([_flat(it[2].master if narrow else it[0]) for it in batch],
                           out=w)
        chunk_fn(w, g, states, sc, hpc, tmp)
        a = 0
        for it, size in zip(batch, sizes):
            b = a + size
            stored, _, st, _ = it
            if narrow:
                np.copyto(_flat(stored), w[a:b], casting="unsafe")
                if not adjacent:
                    np.copyto(_flat(st.master), w[a:b])
            else:
                np.copyto(_flat(stored), w[a:b])
            if not adjacent:
                for arr, buf in zip(st.arrays, states):
                    np.copyto(_flat(arr), buf[a:b])
            a = b

    def _host_lamb(self, item, hp) -> None:
        """LAMB: the direction piece by piece, the whole key's norms, then the step."""
        opt = typing.cast("LAMB", self.optimizer)  # only LAMB sets per_key_norms
        stored, grad, state, w, hpc, sc = self._key_setup(item, hp)
        if self._whole_key(stored, grad, state, w, lambda g: opt.host_step(
                w, g, state.arrays, sc, hpc, stored=stored)):
            return
        master = state.master
        ct = w.dtype.type
        n = w.size
        scratch = self._scratch_for(ct)
        d = scratch.full(n)
        wf, gf = _flat(w), _flat(grad)
        sf = [_flat(a) for a in state.arrays]
        cast = gf.dtype != wf.dtype
        rows = scratch.take(opt.host_scratch + 1)
        for a in range(0, n, CHUNK):
            b = min(a + CHUNK, n)
            m = b - a
            g = gf[a:b]
            if cast:
                np.copyto(rows[opt.host_scratch, :m], g, casting="unsafe")
                g = rows[opt.host_scratch, :m]
            opt.host_direction_chunk(wf[a:b], g, [s[a:b] for s in sf], sc, hpc, d[a:b],
                                     [rows[i, :m] for i in range(opt.host_scratch)])
        sq = scratch.full(n, 1).reshape(w.shape)
        np.square(stored, dtype=np.float64, out=sq)
        sumsq_w = float(np.sum(sq))
        sumsq_d = float(np.sum(np.square(d.reshape(w.shape), dtype=np.float64, out=sq)))
        lr = opt.trust_lr(sc[0], sumsq_w, sumsq_d, hpc, ct)
        sflat = None if master is None else _flat(stored)
        for a in range(0, n, CHUNK):
            b = min(a + CHUNK, n)
            piece = d[a:b]
            np.multiply(piece, lr, out=piece)
            np.subtract(wf[a:b], piece, out=wf[a:b])
            if sflat is not None:
                np.copyto(sflat[a:b], wf[a:b], casting="unsafe")

    # ----------------------------------------------------------- row-sparse
    def update_rows(self, keys, merged, stored, homes) -> None:
        """Apply row-sparse gradients (`RowSparse`, sorted unique rows, on each home).

        A lazy rule reads and writes only the gradient's rows of each weight and state;
        otherwise every row is updated, absent rows with a zero gradient.
        """
        self.check(keys, stored)
        opt = self.optimizer
        hp = opt.hyper()
        self._ensure_states(keys, stored, homes)
        lazy = opt.lazy_rows()
        host: list = []
        host_rows: list = []
        gpu: dict = {}
        gpu_rows: dict = {}
        for key, m, s, home in zip(keys, merged, stored, homes):
            state = self.states[key]
            scalars = opt.next_scalars(key)
            on_gpu = not home.host_memory
            if lazy:
                item = (s, m, state, scalars)
                if on_gpu:
                    gpu_rows.setdefault((home, s.dtype), []).append(item)
                else:
                    host_rows.append(item)
            elif on_gpu:
                with home.activate():
                    dense = m.todense()
                gpu.setdefault((home, s.dtype), []).append(
                    (s, dense, state.master, state.arrays, scalars))
            else:
                host.append((s, m.todense(), state, scalars))
        if host:
            self._host(host, hp, chunk_fn=opt.sparse_chunk)
        if gpu:
            self._gpu(gpu, hp, body=opt.sparse_cuda_body)
        if host_rows:
            self._host_rows(host_rows, hp)
        if gpu_rows:
            self._gpu_rows(gpu_rows, hp)

    def _host_rows(self, items, hp) -> None:
        """Gather the gradient's rows of weights and states, update them, scatter back."""
        work, scatter = [], []
        for stored, rs, state, scalars in items:
            idx = rs.indices
            if idx.size == 0:
                continue
            master = state.master
            w = stored if master is None else master
            nrows = w.shape[0]
            w2 = w.reshape(nrows, -1)
            wr = np.take(w2, idx, axis=0)
            srows = tuple(np.take(a.reshape(nrows, -1), idx, axis=0) for a in state.arrays)
            # the gathered rows are updated as a key of their own (weights in compute type)
            work.append((wr, rs.data.reshape(idx.size, -1), KeyState(srows, None, None),
                         scalars))
            scatter.append((w2, idx, wr, state.arrays, srows, stored, master))
        if work:
            self._host(work, hp, chunk_fn=self.optimizer.sparse_chunk)
        for w2, idx, wr, arrays, srows, stored, master in scatter:
            nrows = w2.shape[0]
            w2[idx] = wr
            for a, r in zip(arrays, srows):
                a.reshape(nrows, -1)[idx] = r
            if master is not None:
                stored.reshape(nrows, -1)[idx] = wr.astype(stored.dtype)

    def _gpu_rows(self, groups, hp) -> None:
        """As `_host_rows`, with gathers and scatters on the home around one step."""
        opt = self.optimizer
        for (home, _), group in groups.items():
            with home.activate():
                launch, scatter = [], []
                for stored, rs, state, scalars in group:
                    idx = home.to_local(rs.indices)
                    if idx.size == 0:
                        continue
                    master = state.master
                    nrows = stored.shape[0]
                    ct = compute_dtype(stored.dtype)
                    g = home.to_local(rs.data).reshape(idx.size, -1).astype(ct, copy=False)
                    sr = stored.reshape(nrows, -1)[idx]
                    mr = None if master is None else master.reshape(nrows, -1)[idx]
                    srows = tuple(a.reshape(nrows, -1)[idx] for a in state.arrays)
                    launch.append(self._gpu_item(home, (sr, g, mr, srows, scalars)))
                    scatter.append((stored, master, state.arrays, idx, sr, mr, srows))
                if launch:
                    home.optimizer_step(opt, launch, hp, body=opt.sparse_cuda_body)
                for stored, master, arrays, idx, sr, mr, srows in scatter:
                    nrows = stored.shape[0]
                    stored.reshape(nrows, -1)[idx] = sr
                    if master is not None:
                        master.reshape(nrows, -1)[idx] = mr
                    for a, r in zip(arrays, srows):
                        a.reshape(nrows, -1)[idx] = r

    @staticmethod
    def _gpu_item(home, item):
        stored, grad, master, states, scalars = item
        xp = home.xp
        ct = compute_dtype(stored.dtype)
        if not home.owns(grad) or grad.dtype != ct or not grad.flags.c_contiguous:
            local = xp.empty(grad.shape, ct)
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
        """A NumPy copy of state array `arr`, which lives on `home`."""
        fetched = home.to_host(arr)
        return fetched.copy() if fetched is arr else fetched

    def import_state(self, header, arrays, entries, *, check_only=False, path="") -> None:
        """Replace every state with the saved ones; `entries`: {key: (value, home)}.

        `check_state`, then `apply_state`: everything is checked before anything changes,
        and any mismatch is a CheckpointError. `check_only`: check, change nothing.
        """
        plan = self.check_state(header, arrays, {k: v for k, (v, _) in entries.items()},
                                path=path)
        if not check_only:
            self.apply_state(plan, {k: home for k, (_, home) in entries.items()})

    def check_state(self, header, arrays, weights, *, path="") -> StatePlan:
        """Check saved state (`export_state`'s header and arrays) against this optimizer.

        `weights`: {key: the key's value as it will be when the plan is applied}; only
        shapes and dtypes are read. Returns the `StatePlan` that `apply_state` installs.
        Raises CheckpointError, changing nothing, for another optimizer or version, a key
        not in `weights`, states of the wrong names, shape or dtype, bad update counts,
        unknown or invalid options, multipliers that are not numbers >= 0, or a schedule
        with missing, unknown or wrong-typed attributes. When the file holds options the
        states are checked against the optimizer as those options will make it.
        """
        where = f"{path}: " if path else ""
        opt = self.optimizer
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
            return self._checked_plan(header, arrays, weights, where)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{where}damaged optimizer-state header: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def apply_state(self, plan: StatePlan, homes: dict) -> None:
        """Install a plan `check_state` made; `homes`: {key: its home device}.

        Every state array is made first (running out of memory changes nothing), then the
        states, update counts, options, multipliers and schedule are swapped in at once.
        """
        states = self._loaded_states(plan.keys, homes)
        opt = self.optimizer
        if plan.options is not None:
            for attr, value in plan.options.items():
                setattr(opt, attr, value)
            opt.lr_mult = dict(plan.lr_mult or {})
            opt.wd_mult = dict(plan.wd_mult or {})
            if plan.schedule is not None:
                opt.lr_scheduler = plan.schedule
        self.states = states
        opt._index_update_count = dict(plan.counts)
        opt.num_update = plan.num_update

    def _checked_plan(self, header, arrays, weights, where) -> StatePlan:
        options, rule = self._checked_options(header.get("options"), where)
        num_update = _checked_count(header.get("num_update"), "num_update", where)
        lr_mult = self._checked_mults(header.get("lr_mult"), "lr_mult", where)
        wd_mult = self._checked_mults(header.get("wd_mult"), "wd_mult", where)
        schedule = _checked_schedule(header.get("lr_scheduler"), num_update, where)
        keys = self._checked_keys(header.get("keys"), arrays, weights,
                                  tuple(rule.state_names()), where)
        raw_counts = header.get("counts", [])
        if not isinstance(raw_counts, list):
            raise CheckpointError(f"{where}damaged optimizer-state header (counts)")
        counts = {}
        for entry in raw_counts:
            key = self._key(entry, where)
            counts[key] = _checked_count(entry.get("count"), f"the update count of key "
                                         f"{_brief(key)}", where)
        for loaded in keys:
            counts.setdefault(loaded.key, loaded.count)
        return StatePlan(keys, counts, num_update, options, lr_mult, wd_mult, schedule)

    def _checked_options(self, raw, where):
        """({attribute: value} the file's options give, the optimizer they make), or
        (None, this optimizer) when the file holds none."""
        opt = self.optimizer
        if raw is None:
            return None, opt
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where}damaged optimizer options {_brief(raw)}")
        known = type(opt)._options
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

    def _checked_mults(self, raw, name, where):
        """{key: multiplier} of the file's `name` section, or None when it has none."""
        if raw is None:
            return None
        if not isinstance(raw, list):
            raise CheckpointError(f"{where}damaged {name} section {_brief(raw)}")
        table = {}
        for entry in raw:
            key = self._key(entry, where)
            try:
                table[key] = check_number(f"{name}[{_brief(key)}]", entry.get("mult"), low=0)
            except GpukvError as exc:
                raise CheckpointError(f"{where}{exc}") from exc
        return table

    def _checked_keys(self, infos, arrays, weights, names, where) -> list:
        """The `_LoadedKey` of every key of the file, checked against `weights`."""
        if not isinstance(infos, list):
            raise CheckpointError(f"{where}damaged optimizer-state header (keys)")
        opt = self.optimizer
        loaded: list = []
        seen: set = set()
        names_of: dict = {}
        for i, info in enumerate(infos):
            key = self._key(info, where)
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
            if name_of not in _FLOATS:
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
                raise CheckpointError(f"{where}key {_brief(key)}: the file's master copy "
                                      f"({_brief(info.get('master'))}) does not fit a "
                                      f"{dtype} weight")
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

    def _loaded_states(self, keys, homes) -> dict:
        """{key: KeyState} holding copies of the checked arrays of `keys`, on each home;
        host states of one compute dtype share flat buffers, as states made together do."""
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

    @staticmethod
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
    """Saved optimizer state checked by `OptimizerUpdater.check_state`, ready to apply."""
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

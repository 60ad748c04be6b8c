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

Row-sparse gradients: when the rule updates a key of its dtype lazily
(`Optimizer.lazy_rows_for`), the rows of the weight and of each state named by the
gradient are gathered, updated with the rule's sparse form and scattered back; no other
row is read or written. Otherwise the gradient is made dense and every row gets the
standard update, as MXNet 1.9.1 does.

Saving and loading the state is `_state.py`'s (`export_state`, `check_state`,
`loaded_states`, `apply_plan`); the updater's methods of those names hand it its states
and optimizer.
"""
from __future__ import annotations

import typing
from typing import TYPE_CHECKING

import numpy as np

from .._dtypes import NARROW_FLOATS
from .._errors import ArgumentError, DTypeError
from . import _state
from ._base import Optimizer
from ._state import FLOATS, KeyState, StatePlan, compute_dtype

if TYPE_CHECKING:
    from ._rules import LAMB

__all__ = ["OptimizerUpdater", "KeyState", "StatePlan", "compute_dtype", "CHUNK", "SMALL"]

_FLOAT_DTYPES: dict = {}  # dtype -> whether an optimizer can update it

#: elements per piece of a host step (the rule's operands stay in L2 while it runs)
CHUNK = 1 << 15
#: keys below this many elements are gathered with others into one piece
SMALL = 1 << 14


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
    """The batch updater `KVStore.set_optimizer` installs: it runs `optimizer` over the
    keys of a push, keeping each key's state (`states`) on the key's home device."""

    def __init__(self, optimizer: Optimizer):
        optimizer.check_rule()
        self.optimizer = optimizer
        self.states: dict = {}
        self._scratch: dict = {}
        self._typed: tuple = (None, {})
        #: the optimizer's state_names() at the first push: what the states are made of
        self._layout: tuple | None = None

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
        """DTypeError naming the first of `keys` whose value in `stored` (the keys'
        values, in the same order) this optimizer cannot update."""
        known = _FLOAT_DTYPES
        for key, s in zip(keys, stored):
            ok = known.get(s.dtype)
            if ok is None:  # dtype.name is slow in NumPy: read once per dtype
                ok = known[s.dtype] = s.dtype.name in FLOATS
            if not ok:
                raise DTypeError(f"key {key!r}: optimizer {self.optimizer.name!r} needs a "
                                 f"floating-point value, the key holds {s.dtype}")
        if keys:
            self._check_layout(keys[0])

    def _check_layout(self, key) -> None:
        """ArgumentError (naming `key`) when the optimizer's options have changed which
        state arrays it keeps since the first push (SGD's momentum turned on, RMSProp's
        `centered`): the keys' states were made of the others."""
        names = self.optimizer.state_names()
        if self._layout is None:
            self._layout = names
        elif names != self._layout:
            raise ArgumentError(
                f"key {key!r}: optimizer {self.optimizer.name!r} now keeps the states "
                f"{list(names)}, but the keys' states were made as {list(self._layout)}: "
                f"an option that decides them (momentum turned on or off, centered) cannot "
                f"change after the first push; set it before, or call set_optimizer with a "
                f"new optimizer (its states start afresh)")

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
        """Update the values `stored` of `keys` in place from their summed gradients
        `merged`, each on its home device (`homes`, in the same order): one multi-tensor
        step per (GPU, dtype), vectorised NumPy on the host."""
        self.check(keys, stored)
        opt = self.optimizer
        hp = opt.hyper()
        self._ensure_states(keys, stored, homes)
        states = self.states
        host: list = []
        gpu: dict = {}
        with opt.counted(keys) as per_key:  # a step that fails has not counted
            for key, m, s, home, scalars in zip(keys, merged, stored, homes, per_key):
                state = states[key]
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
        """Apply row-sparse gradients `merged` (`RowSparse`, sorted unique rows, on each
        of `homes`) to the values `stored` of `keys`, as `update` does.

        A lazy rule reads and writes only the gradient's rows of each weight and state;
        otherwise every row is updated, absent rows with a zero gradient.
        """
        self.check(keys, stored)
        opt = self.optimizer
        hp = opt.hyper()
        self._ensure_states(keys, stored, homes)
        lazy_of: dict = {}  # dtype -> whether its keys update lazily
        host: list = []
        host_rows: list = []
        gpu: dict = {}
        gpu_rows: dict = {}
        # a step that fails (a gradient that cannot densify, ...) has not counted
        with opt.counted(keys) as per_key:
            for key, m, s, home, scalars in zip(keys, merged, stored, homes, per_key):
                state = self.states[key]
                on_gpu = not home.host_memory
                lazy = lazy_of.get(s.dtype)
                if lazy is None:
                    lazy = lazy_of[s.dtype] = opt.lazy_rows_for(s.dtype)
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
    def export_state(self, dump_optimizer: bool = False, fetch=None,
                     keys=None) -> tuple[dict, dict]:
        """(header, {name: NumPy array}) holding every state tensor and update count
        (`fetch(home, array)`: where each goes on the host; default a copy), of the keys
        in `keys` only when given; the header holds the optimizer's options too with
        `dump_optimizer`."""
        states = self.states if keys is None else {
            k: v for k, v in self.states.items() if k in keys}
        return _state.export_state(self.optimizer, states, dump_optimizer, fetch)

    def import_state(self, header, arrays, entries, *, check_only=False, path="") -> None:
        """Replace every state with the saved ones (`export_state`'s `header` and
        `arrays`); `entries`: {key: (value, home)}; `path` names the file in errors.

        `check_state`, then `apply_state`: everything is checked before anything changes,
        and any mismatch is a CheckpointError. `check_only`: check, change nothing.
        """
        plan = self.check_state(header, arrays, {k: v for k, (v, _) in entries.items()},
                                path=path)
        if not check_only:
            self.apply_state(plan, {k: home for k, (_, home) in entries.items()})

    def check_state(self, header, arrays, weights, *, path="") -> StatePlan:
        """Check saved state (`export_state`'s `header` and `arrays`) against this
        optimizer and `weights` ({key: its value}), changing nothing; the `StatePlan`
        that `apply_state` installs. `path` names the file in errors."""
        return _state.check_state(self.optimizer, header, arrays, weights, path=path)

    def value_replaced(self, key, stored, home) -> None:
        """`key`'s value on `home` was replaced by `stored` (a load): its float32 master
        copy, if it has one, becomes `stored`, as at the key's first step (else the next
        step would start from the old weights and write them over the new)."""
        state = self.states.get(key)
        if state is not None and state.master is not None:
            home.copy(state.master, stored)

    def value_written(self, key, stored, home) -> None:
        """The program wrote some elements of `key`'s value `stored` on `home` in place:
        its float32 master copy, if it has one, takes the elements that no longer are
        the master's rounded (the others keep the master's precision, so that writing
        the weights they hold changes nothing)."""
        state = self.states.get(key)
        if state is None or state.master is None:
            return
        master = state.master
        rounded = home.empty(stored.shape, stored.dtype)
        home.copy(rounded, master)
        widened = home.empty(master.shape, master.dtype)
        home.copy(widened, stored)
        bits = f"uint{8 * stored.dtype.itemsize}"  # (NaNs compare by their bits too)
        written = rounded.reshape(-1).view(bits) != stored.reshape(-1).view(bits)
        flat = master.reshape(-1)
        flat[written] = widened.reshape(-1)[written]

    def apply_state(self, plan: StatePlan, homes: dict) -> None:
        """Install a plan `check_state` made; `homes`: {key: its home device}.

        Every state array is made first (running out of memory changes nothing), then the
        states, update counts, options, multipliers and schedule are swapped in at once.
        """
        states = _state.loaded_states(plan, homes)
        _state.apply_plan(self.optimizer, plan)
        self.states = states
        self._layout = self.optimizer.state_names()  # what the loaded states hold

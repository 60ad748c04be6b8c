"""The plan and run phases of a push: what comes after `check` and before the updater.

`plan_push` checks what `check.all_sources` could not (row ids, mixed kinds, what the
updater takes), makes the allocations (casts, merge buffers, row merges) and turns the call
into jobs; `run_push` has the strategies of `gpukv.comm` reduce them (`Route` picks which
strategy runs which job), then runs the updater in the documented order. Nothing after the
plan fails on the caller's input, except the caller's own updater. A store keeps its state
(its entries, updater, compression) and passes it in: nothing here holds any.
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import numpy as np

from .. import timeline
from .._errors import ArgumentKindError, OutOfMemoryError
from ..comm import HostStrategy, ReduceJob
from ..device import device_of, host_device
from ..device.host_sum import accumulate_dtype
from ..encoding.compression import GradientCompression
from ..encoding.compressors import compressible
from ..encoding.sparse import RowSparse
from ..encoding.sparse import merge as _merge_rows
from . import check, rows

#: the plain host sum: host-homed keys of a store without a strategy of the user's
HOST_STRATEGY = HostStrategy()


class _SplitStrategy:
    """Sends GPU-homed jobs to the GPU strategy and host-homed ones to the host strategy."""

    def __init__(self, gpu_strategy, host_strategy):
        self._gpu = gpu_strategy
        self._host = host_strategy

    def _split(self, jobs):
        return ([j for j in jobs if not j.home.host_memory],
                [j for j in jobs if j.home.host_memory])

    def reduce_many(self, jobs):
        on_gpu, on_host = self._split(jobs)
        self._gpu.reduce_many(on_gpu)
        self._host.reduce_many(on_host)

    def broadcast_many(self, jobs):
        on_gpu, on_host = self._split(jobs)
        self._gpu.broadcast_many(on_gpu)
        self._host.broadcast_many(on_host)


class Route:
    """Which strategy runs a store's jobs: its own, the host sum, or both split by home.

    `route_host`: the store's strategy (one the user gave) also runs host-homed keys;
    `host_only`: every key lives on the host and takes the host sum, `host` (the plain
    HOST_STRATEGY, or a `Canonical` one in a deterministic store). `canonical`: every sum
    the store makes follows the canonical order (row-sparse merges too).
    """

    __slots__ = ("strategy", "route_host", "host_only", "host", "canonical")

    def __init__(self, strategy, route_host: bool, host_only: bool, host=HOST_STRATEGY,
                 canonical: bool = False):
        self.strategy = strategy
        self.route_host = route_host
        self.host_only = host_only
        self.host = host
        self.canonical = canonical

    def strategy_for(self, jobs):
        """The store's strategy, or the host one for keys whose home is the host."""
        if self.route_host:
            return self.strategy
        if self.host_only:
            return self.host
        if not any(job.home.host_memory for job in jobs):
            return self.strategy
        if not all(job.home.host_memory for job in jobs):
            return _SplitStrategy(self.strategy, self.host)
        return self.host


def out_of_memory(key, op: str, exc: MemoryError) -> OutOfMemoryError:
    return OutOfMemoryError(f"key {key!r}: {op} needs more memory than its device has "
                            f"free; nothing was changed ({exc})")


class _PushKind:
    """How one key of a push is reduced."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return self.name


_DENSE, _COMPRESSED, _ROWS = _PushKind("dense"), _PushKind("compressed"), _PushKind("rows")


class PushPlan(NamedTuple):
    """A checked push, as jobs: nothing of the store has changed yet."""
    jobs: list        # ReduceJobs of the dense keys
    compressed: list  # (key, sources, devices, home, out, entry) of the compressed keys
    rows: list        # (key, entry, merged rows at home) of the row-sparse keys
    updates: list     # (key, entry, merged out, or _ROWS) for the updater, in call order
    host_outs: list   # a host store's NumPy call as columns: out i = sum of host_sources[i]
    host_sources: list


@functools.cache
def host_slots(n: int) -> tuple:
    """The devices of `n` host arrays given for one key: host slots 0..n-1."""
    return tuple(host_device(i) for i in range(n))


def devices_of(arrays) -> list:
    """The logical device of each array: the n-th array on one memory is its n-th slot."""
    seen: dict = {}
    devices = []
    for a in arrays:
        where = None if isinstance(a, np.ndarray) else a.device.id
        slot = seen.get(where, 0)
        seen[where] = slot + 1
        devices.append(device_of(a, slot))
    return devices


def settles_pulls(updater) -> bool:
    """Whether `updater` (None, a FunctionUpdater or an OptimizerUpdater) is an optimizer
    whose compressed pulls settle the value (`Optimizer.settles_compressed_pulls`)."""
    optimizer = getattr(updater, "optimizer", None)
    return optimizer is not None and optimizer.settles_compressed_pulls


class FunctionUpdater:
    """Adapts `fn(key, merged, stored)` to the batch protocol optimizers implement."""

    def __init__(self, fn):
        self.fn = fn

    def update(self, keys, merged, stored, homes):
        for key, m, s, home in zip(keys, merged, stored, homes):
            with home.activate():
                self.fn(key, m, s)

    def check(self, keys, stored) -> None:
        """Any key and value: what a function takes is its own business."""


# ------------------------------------------------------------------------- plan
def plan_push(groups: check.Groups, entries: list, updater,
              compression: GradientCompression | None, route: Route,
              cast: bool = True) -> PushPlan:
    """The checked jobs of a push of `groups` into `entries` (the store's, under its lock)
    with `updater` (None: assign) and `compression`; raises (changing nothing) on any bad
    part of it."""
    if cast:
        try:
            groups = cast_to_keys(groups, entries)
        except MemoryError as exc:
            raise out_of_memory(groups.keys[0], "push (a dtype conversion)", exc) from exc
    if (groups.all_host and route.host_only and not groups.sparse
            and compression is None):
        # NumPy arrays of dense keys in a host store (the hot loop of many small keys):
        # the outs as a column beside `groups.arrays`, no job per key. (tuple.__new__:
        # without NamedTuple's Python-level __new__, a hot spot with one small key.)
        outs: list = []
        updates: list = []
        plan = tuple.__new__(PushPlan, ((), (), (), updates, outs, groups.arrays))
        try:
            for key, entry in zip(groups.keys, entries):
                if updater is None and not entry.narrow:  # summed straight into it
                    outs.append(entry.value)
                else:
                    out = entry.merge_buffer()
                    outs.append(out)
                    updates.append((key, entry, out))
        except MemoryError as exc:
            raise out_of_memory(key, "push", exc) from exc
    else:
        plan = PushPlan([], [], [], [], [], [])
        _plan_keys(plan, groups, entries, updater, compression, route.canonical)
    if updater is not None and plan.updates:
        updater.check([u[0] for u in plan.updates], [u[1].value for u in plan.updates])
    return plan


def _plan_keys(plan: PushPlan, groups: check.Groups, entries: list, updater,
               comp: GradientCompression | None, canonical: bool = False) -> None:
    """`plan_push` for keys of every kind: dense, compressed, row-sparse."""
    special = groups.sparse or comp is not None
    assign = updater is None
    try:
        for key, entry, sources in zip(groups.keys, entries, groups.arrays):
            kind = _push_kind(key, entry, sources, comp) if special else _DENSE
            if kind is _ROWS:
                plan.rows.append((key, entry, _merged_rows(key, entry, sources, updater,
                                                           canonical)))
                plan.updates.append((key, entry, _ROWS))
                continue
            devices = (host_slots(len(sources)) if groups.all_host
                       else devices_of(sources))
            if kind is _COMPRESSED:
                assert comp is not None  # `_push_kind` said so
                out = (entry.merge_buffer() if entry.value.dtype == np.float32
                       or entry.narrow else comp.buffer(key, entry.home, entry.value.shape))
                comp.reserve(key, sources, devices)
                if comp.pulls is not None and not assign:  # the updater's value apart
                    entry.keep()
                plan.compressed.append((key, sources, devices, entry.home, out, entry))
            elif assign and not entry.narrow:
                plan.jobs.append(ReduceJob(key, sources, devices, entry.home, entry.value))
                continue
            else:
                out = entry.merge_buffer()
                plan.jobs.append(ReduceJob(key, sources, devices, entry.home, out))
            plan.updates.append((key, entry, out))
    except MemoryError as exc:
        raise out_of_memory(key, "push", exc) from exc


def _merged_rows(key, entry, sources, updater, canonical: bool = False) -> RowSparse:
    """The row-wise sum of checked RowSparse `sources` at home: what the updater gets
    (made dense for an updater that takes dense gradients only); `canonical`: each row
    summed over the sources in the canonical tree (see `gpukv.encoding.sparse.merge`)."""
    sources = [s.checked(f"key {key!r}: push") for s in sources]
    merged = _merge_rows(sources, entry.home, accumulate_dtype(entry.value.dtype),
                         canonical)
    takes_rows = (updater is None or type(updater) is FunctionUpdater
                  or hasattr(updater, "update_rows"))
    # An updater without `update_rows` gets the standard (non-lazy) dense gradient.
    return merged if takes_rows else rows.dense_gradient(merged, entry.home)


def _push_kind(key, entry, sources, comp):
    """How one key of a push is reduced: dense, compressed or row-sparse."""
    n_rows = sum(type(s) is RowSparse for s in sources)
    if n_rows:
        if n_rows != len(sources):
            raise ArgumentKindError(f"key {key!r}: push mixes RowSparse and dense values; "
                                    f"give every device the same kind")
        return _ROWS
    if (comp is not None and compressible(entry.value.dtype)
            and comp.compressor.compresses(entry.value.shape)):
        return _COMPRESSED
    return _DENSE


def cast_to_keys(groups: check.Groups, entries: list) -> check.Groups:
    """`groups` with every dense source of another dtype converted to its key's dtype.

    MXNet converts a pushed array to the key's dtype before summing; so does gpukv (on
    the source's own device). The common case, every dtype right, returns `groups` itself.
    """
    for entry, sources in zip(entries, groups.arrays):  # quick pass: every dtype the key's
        dtype = entry.value.dtype
        for s in sources:
            if s.dtype is not dtype:
                break
        else:
            continue
        break
    else:
        return groups
    arrays = None
    for i, (entry, sources) in enumerate(zip(entries, groups.arrays)):
        dtype = entry.value.dtype
        if all(isinstance(s, RowSparse) or s.dtype == dtype for s in sources):
            continue
        if arrays is None:
            arrays = list(groups.arrays)
        arrays[i] = [s if isinstance(s, RowSparse) or s.dtype == dtype
                     else device_of(s).cast(s, dtype) for s in sources]
    return groups if arrays is None else groups._replace(arrays=arrays)


# -------------------------------------------------------------------------- run
def run_push(plan: PushPlan, updater, compression: GradientCompression | None,
             route: Route) -> None:
    """Reduce every job of a checked push (`route` picks the strategies), then run
    `updater` (None: assign) in MXNet's order."""
    if plan.host_outs:
        with timeline.span("reduce"):
            route.host.reduce_columns(plan.host_outs, plan.host_sources)
        if not plan.updates:  # summed straight into the values: done
            return
    jobs = plan.jobs
    comp = compression
    if plan.compressed:  # compressed keys: the strategy sums the encoded terms
        assert comp is not None  # they were planned with it
        with timeline.span("encode"):
            if comp.compressor.low_rank:  # its sums are its own
                for key, sources, devices, home, out, _ in plan.compressed:
                    comp.low_rank_sum(key, sources, devices, home, out)
            else:
                jobs = jobs + [ReduceJob(key, comp.encode(key, sources, devices), devices,
                                         home, out) for key, sources, devices, home, out, _
                               in plan.compressed]
    with timeline.span("reduce"):
        if jobs:
            route.strategy_for(jobs).reduce_many(jobs)
        for key, _, _, home, out, _ in plan.compressed:
            assert comp is not None
            comp.finish(key, out, home)
    with timeline.span("update" if updater is not None else "assign"):
        _apply(plan, updater)
    served_apart = [(entry, merged) for _, entry, merged in plan.rows if entry.kept is not None]
    if served_apart:
        optimizer = updater.optimizer if _optimizer_takes_rows(updater) else None
        for entry, merged in served_apart:
            rows.serve_rows(entry, merged, optimizer is not None
                            and optimizer.lazy_rows_for(entry.stored.dtype))
    if plan.compressed and comp is not None and comp.pulls is not None:
        assigns, settles = updater is None, settles_pulls(updater)
        with timeline.span("serve"):  # what pulls read: moved on by one payload each
            for key, _, _, home, out, entry in plan.compressed:
                comp.serve(key, out if assigns else entry.kept, entry.value, home, assigns,
                           settles)


def _optimizer_takes_rows(updater) -> bool:
    """Whether `updater` (not None) takes row-sparse gradients as rows (an optimizer's:
    its rule then updates the rows only, or every row)."""
    return type(updater) is not FunctionUpdater and hasattr(updater, "update_rows")


def _apply(plan: PushPlan, updater) -> None:
    """Run `updater` (None: assign) on a push's sums, in MXNet's order."""
    merged_rows: dict = {}
    assigned: dict = {}  # the homes written without an updater (insertion-ordered set)
    for key, entry, merged in plan.rows:
        if updater is None:
            rows.assign_rows(entry, merged)
            assigned[entry.home] = None
        else:
            merged_rows[key] = merged
    if updater is None:  # narrow floats and compressed sums: assigned with one cast
        for key, entry, out in plan.updates:
            if out is not _ROWS:
                entry.home.copy(entry.value, out)
                assigned[entry.home] = None
        for home in assigned:  # the caller's current stream sees the new values
            home.leave()
        return
    updates = plan.updates
    if len(updates) > 1:  # MXNet's order: int keys ascending, str keys as initialised
        rank = ((lambda u: u[0]) if type(updates[0][0]) is int else (lambda u: u[1].seq))
        updates = sorted(updates, key=rank)
    # Runs of one kind go to the updater together (optimizers batch them).
    rows_to_optimizer = _optimizer_takes_rows(updater)
    for is_rows, group in itertools.groupby(updates, key=lambda u: u[2] is _ROWS):
        run = list(group)
        keys = [u[0] for u in run]
        stored = [u[1].stored for u in run]
        homes = [u[1].home for u in run]
        if not is_rows:
            updater.update(keys, [u[2] for u in run], stored, homes)
        elif rows_to_optimizer:
            updater.update_rows(keys, [merged_rows[k] for k in keys], stored, homes)
        else:  # fn(key, RowSparse, stored), or an updater taking dense gradients only
            updater.update(keys, [merged_rows[k] for k in keys], stored, homes)

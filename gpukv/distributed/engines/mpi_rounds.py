"""The data path of the sharded rounds on host arrays, over MPI (`sharded.ShardedRounds`
runs it for keys in host memory).

A sync round is a reduce-scatter of the round's gradients to their owners, the update there
(on the owner's shard only: optimizer state is sharded, never replicated), and an all-gather
of the new values into every process's copy, so a round costs what an allreduce costs. Big
keys are split into one contiguous piece per process and move in their own collectives,
without packing, in chunks over point-to-point messages (`exchange`: sums in rank order,
pipelined); small keys go whole to an owner picked by a hash of the key and travel packed,
one collective per dtype. Without an updater a round is an allreduce.

A deterministic round gets each process's node partials of the canonical tree
(`engine.Partials`) and every sum goes through the exchange, whose owners merge them as
the tree does: MPI's own reductions have no fixed order. Keys compressed on the wire move
as payloads by one all-to-all, each owner decoding and summing what it got; with a
compressor that compresses pulls too ('sign'), the new values of those keys come back as
payloads as well, one all-gather of each owner's (`gpukv.encoding.pulls`), which every
process decodes into its copy alike.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from ...canonical.arrays import node_ranges
from ...encoding.compressors import Ctx, compresses_key
from ..mpi.fused import FusedSum, fusible
from ..mpi.transport import as_bytes
from . import exchange, low_rank
from .layout import displacements, even
from .partials import decode_leaves, sum_leaves
from .protocol import RoundState


class _Packed(NamedTuple):
    """The small keys of one wire dtype in a round: where each sits in the packed buffers."""
    wire: np.dtype
    keys: list         # (key, offset in `send`), ordered by owner
    counts: list       # elements per owner
    send: np.ndarray
    recv: np.ndarray   # this process's part: the keys it owns
    mine: list         # (key, offset in `recv`) of the keys this process owns


class _Gather(NamedTuple):
    """The all-gather of a round's new values from their owners."""
    split: list        # (key, layout) of every split key (each all-gathered on its own)
    keys: list         # small keys in owner order: (key, byte offset, nbytes)
    counts: list
    send: np.ndarray
    recv: np.ndarray
    mine_small: list   # small keys this process owns, in gather order


class _Round(NamedTuple):
    compressed: list   # (key, layout) of keys compressed on the wire
    low_rank: list     # (key, layout) of keys a low-rank compressor sums (PowerSGD)
    big: list          # (key, layout, send buffer or None, recv buffer, counts, starts,
    #                    scratch) of the split keys summed by an exchange of their own
    packed: list       # _Packed per wire dtype
    gather: _Gather


class _SumPlan(NamedTuple):
    """A round without an updater: allreduces."""
    alone: list        # keys summed each by an allreduce of its own
    split: list        # (key, counts, starts, scratch, wire buffers or None) of the split
    #                    keys summed by an exchange
    packed: list       # ([(key, offset, elements)], send, recv) per wire dtype


class _Exchanged(NamedTuple):
    """One sum of a canonical round: a key, or small keys packed, through the exchange."""
    keys: list         # (key, offset in the buffers, elements)
    counts: list       # elements of the piece each rank sums
    starts: list
    tree: exchange.Tree
    scratch: list
    send: np.ndarray | None  # (nodes, elements) the partials are packed into, or None
    out: np.ndarray | None   # where the sums land (the whole, or the piece owned here),
    #                          or None: into the key's copy itself


class _CanonicalPlan(NamedTuple):
    """A round of a deterministic engine: every sum goes through the exchange, but those
    of the keys compressed on the wire (their leaves' payloads go to the owners)."""
    sums: list         # _Exchanged
    compressed: list   # (key, layout, count) of the keys compressed on the wire
    low_rank: list     # (key, layout, count) of the keys a low-rank compressor sums
    gather: _Gather | None  # with an updater or compressed keys: the all-gather of the
    #                         new values (of every key, or of the compressed ones)


#: keys of at least this many bytes (and no narrow type) are summed on their own
_ALONE_BYTES = 64 << 10
#: round plans kept (a training loop repeats a few sets of keys), and the bytes their
#: buffers may hold, per byte of every key the store has
_PLANS_KEPT = 256
_PLAN_BYTES_PER_KEY_BYTE = 8


def _bytes_held(plan) -> int:
    """The bytes of the arrays a plan holds (in its fields, lists and tuples)."""
    if isinstance(plan, np.ndarray):
        return plan.nbytes
    if isinstance(plan, (list, tuple)):
        return sum(_bytes_held(item) for item in plan)
    return 0


class MpiRounds:
    """A sharded engine's rounds on host arrays (see the module's docstring)."""

    def __init__(self, state: RoundState):
        self.state = state
        self.t = state.t
        self._plans: dict = {}      # (keys in canonical order, compression) -> plan
        self._plan_bytes: dict = {}  # the same -> the bytes its buffers hold
        self._plan_limit: int | None = None  # the bytes the plans kept may hold
        self._buffers: dict = {}    # scratch buffers of compressed rounds

    def forget(self) -> None:
        """Drop the plans made so far (new keys, another updater or compression)."""
        self._plans.clear()
        self._plan_bytes.clear()
        self._plan_limit = None

    def refuse(self, compressor) -> None:
        """Any compressor goes: its payloads travel as bytes."""

    def share_values(self, pending, what: str) -> None:
        """Rank 0's value of each new key into every process's copy."""
        comm = self.t.comm
        self.state.agree.wait([comm.Ibcast(as_bytes(r), root=0) for _, r in pending], what)

    def openers(self, keys, by_key: dict) -> tuple:
        """What starts with a push round's agreement (`Agreement.check`'s `alongside`
        and `fused`), for a round without an updater whose sums are allreduces: the
        call that starts them, and the round as a sum that may carry its agreement when
        it is one small allreduce; (None, None) for the others."""
        if not (self.state.assigns and self.state.compressor is None):
            return None, None
        summed = self._sum_plan_of(keys)
        if not (summed.alone or summed.packed):
            return None, None
        fused = (self._fused_sum(summed, by_key)
                 if not summed.split and len(summed.alone) + len(summed.packed) == 1
                 else None)
        return (lambda: self._start_allreduce(summed, by_key)), fused

    @staticmethod
    def _fused_sum(summed: _SumPlan, by_key: dict) -> FusedSum | None:
        """The one small allreduce of `summed` as a FusedSum, or None if too big."""
        if summed.packed:
            placed, send, recv = summed.packed[0]

            def fill(buffer):
                for key, offset, n in placed:
                    buffer[offset:offset + n] = by_key[key][0].reshape(-1)

            def take(sums):
                recv[...] = sums  # (the round unpacks it into the keys' copies)
                return []
            dtype, count = recv.dtype, recv.size
        else:
            grad, replica = by_key[summed.alone[0]]

            def fill(buffer):
                buffer[...] = grad.reshape(-1)

            def take(sums):
                replica.reshape(-1)[...] = sums
                return []
            dtype, count = replica.dtype, replica.size
        if not fusible(dtype, count):
            return None
        return FusedSum((np.dtype(dtype), int(count)), fill, take)

    def round(self, keys, by_key: dict, what: str, started=None) -> None:
        """A push round once agreed on: `by_key` maps each key (in canonical order) to
        (this process's sum, its copy of the value); `started`: the requests of what
        `openers` started."""
        comp = self.state.compressor
        if self.state.assigns and comp is None:  # the sum is the new value, everywhere
            summed = self._sum_plan_of(keys)
            if started is None:
                started = self._start_allreduce(summed, by_key)
            self._allreduce(summed, by_key, started, what)
            return
        wire = None if comp is None else tuple(sorted(comp.params().items()))
        plan = self._planned((keys, wire), lambda: self._plan(keys))
        sums = self._exchange_compressed(plan, by_key, what)
        merged = sums + self._reduce_scatter(plan, by_key, what)
        merged += self._low_rank(plan.low_rank, by_key, what)
        self.state.update(merged, what)
        self._all_gather(plan.gather, by_key, what)
        if self.state.pulls is not None:
            self._serve(plan.compressed, dict(sums), by_key, what)

    def canonical_round(self, keys, counts: tuple, by_key: dict, what: str) -> None:
        """A push round of a deterministic engine once agreed on: `by_key` maps each key
        (in canonical order) to (this process's Partials, or Leaves of a key compressed
        on the wire, and its copy of the value); every sum is the exchange's merge of the
        ranks' node partials, or the owner's of every leaf's decoded payload."""
        comp = self.state.compressor
        wire = None if comp is None else tuple(sorted(comp.params().items()))
        plan = self._planned((keys, counts, wire, "canonical"),
                             lambda: self._canonical_plan(keys, counts))
        splits = []
        for item in plan.sums:
            send = item.send
            if send is None:
                send = by_key[item.keys[0][0]][0].sums
            else:
                for key, offset, n in item.keys:
                    send[:, offset:offset + n] = by_key[key][0].sums
            out = item.out if item.out is not None else by_key[item.keys[0][0]][1].reshape(-1)
            splits.append(exchange.Split(send, out, item.counts, item.starts, item.scratch,
                                         item.tree))
        merged = self._exchange_leaves(plan.compressed, by_key, what)
        sums = list(merged)  # of the compressed keys' pieces owned here
        merged += self._low_rank([(key, layout) for key, layout, _ in plan.low_rank],
                                 by_key, what, [count for _, _, count in plan.low_rank])
        served = [(key, layout) for key, layout, _ in plan.compressed]
        if self.state.assigns:  # no updater: the sums are the new values
            if splits:
                exchange.allreduce(self.t, splits, f"{what}: allreduce")
            for item in plan.sums:
                if item.out is not None:  # the key's dtype, rounded once
                    for key, offset, n in item.keys:
                        by_key[key][1].reshape(-1)[...] = item.out[offset:offset + n]
            if served:  # the compressed keys: assigned, then gathered or served
                self.state.update(merged, what)
                self._serve_or_gather(plan.gather, served, sums, by_key, what)
            return
        if splits:
            exchange.reduce_scatter(self.t, splits, f"{what}: reduce-scatter")
        rank = self.t.rank
        for item in plan.sums:
            assert item.out is not None
            start, stop = item.starts[rank], item.starts[rank] + item.counts[rank]
            for key, offset, n in item.keys:
                layout = self.state.layouts[key]
                if layout.split:
                    if item.counts[rank]:
                        merged.append((key, item.out))
                elif start <= offset < stop:
                    merged.append((key, item.out[offset - start:offset - start + n]
                                   .reshape(layout.shape)))
        self.state.update(merged, what)
        self._serve_or_gather(plan.gather, served, sums, by_key, what)

    def _serve_or_gather(self, gather: _Gather | None, served: list, sums: list,
                         by_key: dict, what: str) -> None:
        """Bring a round's new values to every process: the compressed keys (`served`:
        (key, layout); `sums`: (key, float32 sum) of the pieces owned here) as pull
        payloads when the compressor compresses pulls, the others all-gathered."""
        if gather is not None:
            self._all_gather(gather, by_key, what)
        if self.state.pulls is not None:
            self._serve(served, dict(sums), by_key, what)

    def _canonical_plan(self, keys, counts: tuple) -> _CanonicalPlan:
        """Every key's sum through the exchange: a split key in its pieces; without an
        updater, a key summed alone split evenly; the small keys of one wire dtype and
        count packed, each in the piece of its owner. Keys compressed on the wire go
        their own way (`_exchange_leaves`), in their pieces, and a low-rank compressor's
        matrices theirs (`_low_rank`)."""
        rank, size = self.t.rank, self.t.size
        sums: list = []
        small: list = []
        compressed: list = []
        low_rank: list = []
        comp = self.state.compressor
        for key, count in zip(keys, counts):
            layout = self.state.layouts[key]
            n, wire = layout.size, layout.wire
            if compresses_key(comp, layout.dtype, layout.shape):
                assert comp is not None
                (low_rank if comp.low_rank else compressed).append((key, layout, count))
                continue
            if layout.split:
                per, starts = layout.per_rank(size)
            elif self.state.assigns and self._alone(key):
                per, starts = even(n, size)
            else:
                small.append((layout.pieces[0].server, key, layout, count))
                continue
            tree = exchange.Tree(node_ranges(size, count), size * count)
            out = (np.empty(per[rank], wire) if not self.state.assigns else
                   None if wire == layout.dtype else np.empty(n, wire))
            sums.append(_Exchanged([(key, 0, n)], per, starts, tree,
                                   exchange.tree_scratch(per, rank, tree, wire), None, out))
        small.sort(key=lambda s: (s[2].wire.str, s[3], s[0]))  # stable: by owner, in order
        for (wire, count), run in itertools.groupby(small, key=lambda s: (s[2].wire, s[3])):
            per, placed, offset = [0] * size, [], 0
            for owner, key, layout, _ in run:
                n = layout.size
                placed.append((key, offset, n))
                per[owner] += n
                offset += n
            tree = exchange.Tree(node_ranges(size, count), size * count)
            sums.append(_Exchanged(placed, per, displacements(per), tree,
                                   exchange.tree_scratch(per, rank, tree, wire),
                                   np.empty((len(tree.nodes[rank]), offset), wire),
                                   np.empty(offset if self.state.assigns else per[rank], wire)))
        gathered = [k for k, _, _ in compressed] if self.state.assigns else keys
        if self.state.pulls is not None:  # the compressed keys are served instead
            served = {k for k, _, _ in compressed}
            gathered = [k for k in gathered if k not in served]
        return _CanonicalPlan(sums, compressed, low_rank,
                              self._gather_plan(gathered) if gathered else None)

    def _plan(self, keys) -> _Round:
        rank, size = self.t.rank, self.t.size
        big: list = []
        small: list = []
        compressed: list = []
        low_rank: list = []
        comp = self.state.compressor
        for key in keys:
            layout = self.state.layouts[key]
            if not layout.split:
                small.append((layout.pieces[0].server, key, layout))
            if compresses_key(comp, layout.dtype, layout.shape):
                assert comp is not None
                (low_rank if comp.low_rank else compressed).append((key, layout))
            elif layout.split:
                counts, starts = layout.per_rank(size)
                send = None if layout.wire == layout.dtype else np.empty(
                    sum(counts), layout.wire)
                # Without an updater the sum is the new value: received where it is kept.
                recv = (self.state.shard.stored(key) if self.state.assigns and send is None
                        and counts[rank] else np.empty(counts[rank], layout.wire))
                big.append((key, layout, send, recv, counts, starts,
                            exchange.scratch_for(counts, rank, layout.wire)))
        small.sort(key=lambda s: s[0])  # stable: keys stay in order within an owner
        packed = []
        summed = {k for k, _ in compressed + low_rank}
        by_wire = sorted((s for s in small if s[1] not in summed), key=lambda s: s[2].wire.str)
        for wire, run in itertools.groupby(by_wire, key=lambda s: s[2].wire):
            counts = [0] * size
            placed, mine, offset = [], [], 0
            for owner, key, layout in sorted(run, key=lambda s: s[0]):
                n = int(np.prod(layout.shape, dtype=np.int64))
                if owner == rank:
                    mine.append((key, counts[rank]))
                placed.append((key, offset))
                counts[owner] += n
                offset += n
            packed.append(_Packed(wire, placed, counts, np.empty(offset, wire),
                                  np.empty(counts[rank], wire), mine))
        skipped: set = set()
        if self.state.pulls is not None:  # the compressed keys are served instead
            skipped.update(k for k, _ in compressed)
        if self.state.assigns:  # every process decodes the low-rank sums itself
            skipped.update(k for k, _ in low_rank)
        gathered = [k for k in keys if k not in skipped]
        return _Round(compressed, low_rank, big, packed, self._gather_plan(gathered))

    def _gather_plan(self, keys) -> _Gather:
        """How a round with an updater brings the new values of `keys` to everyone."""
        rank = self.t.rank
        small = sorted(((layout.pieces[0].server, key, layout) for key in keys
                        for layout in [self.state.layouts[key]] if not layout.split),
                       key=lambda s: s[0])  # stable: keys stay in order within an owner
        gather_keys, gather_counts, offset = [], [0] * self.t.size, 0
        for owner, key, layout in small:
            nbytes = int(np.prod(layout.shape, dtype=np.int64)) * layout.dtype.itemsize
            gather_keys.append((key, offset, nbytes))
            gather_counts[owner] += nbytes
            offset += nbytes
        mine_small = [key for owner, key, _ in small if owner == rank]
        split = [(key, self.state.layouts[key]) for key in keys if self.state.layouts[key].split]
        return _Gather(split, gather_keys, gather_counts,
                       np.empty(gather_counts[rank], np.uint8), np.empty(offset, np.uint8),
                       mine_small)

    def _sum_plan(self, keys) -> _SumPlan:
        alone, split, packed = [], [], []
        small = sorted((k for k in keys if not self._alone(k) and not self.state.layouts[k].split),
                       key=lambda k: self.state.layouts[k].wire.str)
        for key in keys:
            layout = self.state.layouts[key]
            if layout.split:
                counts, starts = layout.per_rank(self.t.size)
                wire = None if layout.wire == layout.dtype else (  # summed in float32
                    np.empty(sum(counts), layout.wire), np.empty(sum(counts), layout.wire))
                split.append((key, counts, starts,
                              exchange.scratch_for(counts, self.t.rank, layout.wire), wire))
            elif self._alone(key):
                alone.append(key)
        for wire, group in itertools.groupby(small, key=lambda k: self.state.layouts[k].wire):
            run = list(group)
            if len(run) == 1 and self.state.layouts[run[0]].dtype == wire:
                alone.append(run[0])  # nothing to pack: straight into its copy
                continue
            placed, offset = [], 0
            for key in run:
                n = int(np.prod(self.state.layouts[key].shape, dtype=np.int64))
                placed.append((key, offset, n))
                offset += n
            packed.append((placed, np.empty(offset, wire), np.empty(offset, wire)))
        return _SumPlan(alone, split, packed)

    def _sum_plan_of(self, keys) -> _SumPlan:
        return self._planned((keys, "sum"), lambda: self._sum_plan(keys))

    def _planned(self, name: tuple, make):
        """The plan of `name` (a round's keys and what shapes it), made by `make()` the
        first time. A job whose rounds push ever other sets of keys (those that had
        gradients) does not keep a plan and its buffers for each: the oldest go once the
        plans kept would hold more than a few times the bytes of every key (the plans of
        a loop over all its keys, bucket by bucket, stay), or number `_PLANS_KEPT`."""
        plan = self._plans.get(name)
        if plan is None:
            plan = make()
            held = _bytes_held(plan)
            if self._plan_limit is None:
                self._plan_limit = _PLAN_BYTES_PER_KEY_BYTE * sum(
                    layout.size * layout.wire.itemsize
                    for layout in self.state.layouts.values())
            while self._plans and (len(self._plans) >= _PLANS_KEPT or
                                   sum(self._plan_bytes.values()) + held > self._plan_limit):
                oldest = next(iter(self._plans))
                del self._plans[oldest], self._plan_bytes[oldest]
            self._plans[name], self._plan_bytes[name] = plan, held
        return plan

    def _alone(self, key) -> bool:
        """Whether a key is summed by an allreduce of its own, straight into its copy,
        whatever else the round holds (a big key of its wire dtype)."""
        layout = self.state.layouts[key]
        return (layout.wire == layout.dtype
                and int(np.prod(layout.shape, dtype=np.int64)) * layout.dtype.itemsize
                >= _ALONE_BYTES)

    def _start_allreduce(self, plan: _SumPlan, by_key: dict) -> list:
        """The allreduces of a round without an updater: one per big key (and per small
        key alone of its dtype in the round), from the gradient into this process's
        copy, and one per dtype of the other small keys, packed; their requests."""
        comm, SUM = self.t.comm, self.t.MPI.SUM
        requests = []
        for key in plan.alone:
            grad, replica = by_key[key]
            requests.append(comm.Iallreduce(np.ascontiguousarray(grad).reshape(-1),
                                            replica.reshape(-1), op=SUM))
        for placed, send, recv in plan.packed:
            for key, offset, n in placed:
                send[offset:offset + n] = by_key[key][0].reshape(-1)
            requests.append(comm.Iallreduce(send, recv, op=SUM))
        return requests

    def _allreduce(self, plan: _SumPlan, by_key: dict, requests: list, what: str) -> None:
        """A round without an updater, its allreduces started (`requests`): the split
        keys' exchange (which holds the pieces this process serves in its copy), then
        every sum in its key's copy."""
        splits = []
        for key, counts, starts, scratch, wire in plan.split:
            grad, replica = by_key[key]
            if wire is None:
                send, out = np.ascontiguousarray(grad).reshape(-1), replica.reshape(-1)
            else:
                send, out = wire
                send[...] = grad.reshape(-1)
            splits.append(exchange.Split(send, out, counts, starts, scratch))
        if splits:
            exchange.allreduce(self.t, splits, f"{what}: allreduce")
        self.state.agree.wait(requests, f"{what}: allreduce")
        for key, _, _, _, wire in plan.split:
            if wire is not None:
                by_key[key][1].reshape(-1)[...] = wire[1]
        for placed, _, recv in plan.packed:
            for key, offset, n in placed:
                by_key[key][1].reshape(-1)[...] = recv[offset:offset + n]

    def _reduce_scatter(self, plan: _Round, by_key: dict, what: str) -> list:
        """Sum the uncompressed keys over the processes; (key, sum) of the pieces owned
        here."""
        comm, SUM = self.t.comm, self.t.MPI.SUM
        requests, splits = [], []
        for key, layout, send, recv, counts, starts, scratch in plan.big:
            grad = by_key[key][0]
            if send is None and grad.flags.c_contiguous:
                send = grad.reshape(-1)  # the gradient itself: no copy
            elif send is None:
                send = np.ascontiguousarray(grad).reshape(-1)
            else:
                send[...] = grad.reshape(-1)
            splits.append(exchange.Split(send, recv, counts, starts, scratch))
        for group in plan.packed:
            send = group.send
            for key, offset in group.keys:
                grad = by_key[key][0]
                send[offset:offset + grad.size] = grad.reshape(-1)
            requests.append(comm.Ireduce_scatter(send, group.recv, group.counts, op=SUM))
        exchange.reduce_scatter(self.t, splits, f"{what}: reduce-scatter")
        self.state.agree.wait(requests, f"{what}: reduce-scatter")
        merged = [(key, recv) for key, _, _, recv, *_ in plan.big if recv.size]
        for group in plan.packed:
            for key, offset in group.mine:
                shape = self.state.layouts[key].shape
                n = int(np.prod(shape, dtype=np.int64))
                merged.append((key, group.recv[offset:offset + n].reshape(shape)))
        return merged

    def _exchange_compressed(self, plan: _Round, by_key: dict, what: str) -> list:
        """The compressed keys: each process encodes every piece (with its own residual)
        for the piece's owner, one all-to-all moves the payloads, and each owner decodes
        and sums what it got; (key, float32 sum) of the pieces owned here."""
        if not plan.compressed:
            return []
        comp, rank, size = self.state.compressor, self.t.rank, self.t.size
        assert comp is not None  # the plan has compressed keys
        outgoing: list = [[] for _ in range(size)]
        mine = []
        for key, layout in plan.compressed:
            flat = by_key[key][0].reshape(-1)
            for p in layout.pieces:
                payload, _ = self._encode((key, p.start), flat[p.start:p.stop])
                outgoing[p.server].append(as_bytes(np.ascontiguousarray(payload)))
                if p.server == rank:
                    mine.append((key, layout, p))
        formats = [self._payload_format(p.stop - p.start) for _, _, p in mine]
        per_source = sum(nbytes for _, nbytes in formats)
        recv = self._all_to_all(outgoing, per_source, "payloads", what)
        merged, offset = [], 0
        for (key, layout, p), (dtype, nbytes) in zip(mine, formats):
            n = p.stop - p.start
            total = self._scratch((key, p.start), np.float32, n)
            for source in range(size):
                start = source * per_source + offset
                payload = recv[start:start + nbytes].view(dtype)
                comp.decompress(payload, Ctx(n, (n,)), total, accumulate=source > 0)
            merged.append((key, total if layout.split else total.reshape(layout.shape)))
            offset += nbytes
        return merged

    def _exchange_leaves(self, compressed: list, by_key: dict, what: str) -> list:
        """The keys compressed on the wire of a deterministic round: each process
        compresses each of its leaves' pieces on its own (with the leaf's own residual),
        one all-to-all moves every payload to the piece's owner, and each owner decodes
        the payloads of every leaf and sums them as one process does (`sum_leaves`);
        (key, float32 sum) of the pieces owned here."""
        if not compressed:
            return []
        comp, rank, size = self.state.compressor, self.t.rank, self.t.size
        assert comp is not None  # the plan has compressed keys
        outgoing: list = [[] for _ in range(size)]
        mine = []
        for key, layout, count in compressed:
            values = by_key[key][0].values
            for p in layout.pieces:
                for j in range(count):
                    payload, _ = self._encode((key, p.start, j), values[j, p.start:p.stop])
                    outgoing[p.server].append(as_bytes(np.ascontiguousarray(payload)))
                if p.server == rank:
                    mine.append((key, layout, p, count))
        formats = [self._payload_format(p.stop - p.start) for _, _, p, _ in mine]
        per_source = sum(nbytes * count for (_, nbytes), (*_, count) in zip(formats, mine))
        recv = self._all_to_all(outgoing, per_source, "leaf payloads", what)
        merged, offset = [], 0
        for (key, layout, p, count), (dtype, nbytes) in zip(mine, formats):
            n = p.stop - p.start
            payloads = []  # every leaf's, in the tree's order: source-major, then j
            for source in range(size):
                first = source * per_source + offset
                payloads += [recv[first + j * nbytes:first + (j + 1) * nbytes].view(dtype)
                             for j in range(count)]
            terms = self._scratch(("terms", key, p.start), np.float32, size * count * n)
            terms = terms.reshape(size * count, n)
            decode_leaves(comp, payloads, n, terms)
            total = self._scratch((key, p.start), np.float32, n)
            sum_leaves(comp, terms, total)
            merged.append((key, total if layout.split else total.reshape(layout.shape)))
            offset += count * nbytes
        return merged

    def _serve(self, compressed: list, sums: dict, by_key: dict, what: str) -> None:
        """Compressed pulls (`gpukv.encoding.pulls`): the owner of each piece of the
        `compressed` keys ((key, layout)) encodes its new value (`sums`: the float32 sum
        of each piece owned here, for a round that assigns), one all-gather moves every
        payload, and every process decodes each into its copy, the owner's included."""
        pulls, rank, size = self.state.pulls, self.t.rank, self.t.size
        assert pulls is not None  # a compressor that compresses pulls
        if not compressed:  # every process has the same plan: none calls the all-gather
            return
        assigns, settles = self.state.assigns, self.state.shard.settles_pulls()
        pieces = [(key, p, by_key[key][1].reshape(-1)[p.start:p.stop])
                  for key, layout in compressed for p in layout.pieces]
        counts = [0] * size
        for _, p, _ in pieces:
            counts[p.server] += self._payload_format(p.stop - p.start)[1]
        outgoing = []
        for key, p, copy in pieces:
            if p.server == rank:
                value = sums[key] if assigns else self.state.shard.stored(key)
                payload = pulls.payload((key, p.start), value, copy, assigns)
                outgoing.append(as_bytes(np.ascontiguousarray(payload)))
        send = np.concatenate(outgoing) if outgoing else np.empty(0, np.uint8)
        recv = self._scratch("pull payloads", np.uint8, sum(counts))
        starts = displacements(counts)
        request = self.t.comm.Iallgatherv(send, [recv, counts, starts, self.t.MPI.BYTE])
        self.state.agree.wait([request], f"{what}: compressed all-gather")
        at = list(starts)
        for key, p, copy in pieces:  # each owner's payloads, in the order it sent them
            dtype, nbytes = self._payload_format(p.stop - p.start)
            payload = recv[at[p.server]:at[p.server] + nbytes].view(dtype)
            at[p.server] += nbytes
            pulls.apply(payload, copy, assigns)
            if p.server == rank:
                pulls.settle(self.state.shard.stored(key), copy, assigns, settles)

    def _low_rank(self, keys: list, by_key: dict, what: str, counts=None) -> list:
        """The keys a low-rank compressor sums (`keys`: (key, layout); PowerSGD): their
        sums, as `low_rank.sums` makes them in every process alike (`counts`: the
        values per process of each, in a deterministic round). Without an updater
        each is the new value, written into every copy; else (key, piece of the sum) of
        the pieces owned here."""
        if not keys:
            return []
        state = self.state
        rank, assigns = self.t.rank, state.assigns
        totals = low_rank.sums(state.agree, state.compressor, state.feedback, keys,
                               [by_key[key][0] for key, _ in keys],
                               [by_key[key][1] if assigns else None for key, _ in keys], what,
                               counts)
        if assigns:
            return []
        merged = []
        for (key, layout), total in zip(keys, totals):
            for piece in layout.served_by(rank):
                merged.append((key, total.reshape(-1)[piece.start:piece.stop]
                               if layout.split else total.reshape(layout.shape)))
        return merged

    def _all_to_all(self, outgoing: list, per_source: int, name: str, what: str):
        """Every rank's payloads for each owner (`outgoing[owner]`: byte arrays) moved by
        one all-to-all; what came here, `per_source` bytes from each rank in rank order,
        in a buffer kept under `name`."""
        size = self.t.size
        send_counts = [sum(b.size for b in out) for out in outgoing]
        send = np.concatenate([b for out in outgoing for b in out])
        recv = self._scratch(name, np.uint8, per_source * size)
        BYTE = self.t.MPI.BYTE
        request = self.t.comm.Ialltoallv(
            [send, send_counts, displacements(send_counts), BYTE],
            [recv, [per_source] * size, [per_source * s for s in range(size)], BYTE])
        self.state.agree.wait([request], f"{what}: compressed all-to-all")
        return recv

    def _scratch(self, name, dtype, n: int) -> np.ndarray:
        """A buffer kept from round to round (a new one would fault in every page)."""
        buf = self._buffers.get(name)
        if buf is None or buf.size != n:
            buf = self._buffers[name] = np.empty(n, dtype)
        return buf

    def _encode(self, slot: tuple, values):
        """(payload, ctx) of one piece of a key, with this process's residual of `slot`:
        (key, piece start), or (key, piece start, value) in a deterministic round, where
        each value has its own."""
        feedback = self.state.feedback
        assert feedback is not None  # only a compressed key comes here
        return feedback.compress(slot, values)

    def _payload_format(self, n: int) -> tuple:
        """(dtype, bytes) of the payload of `n` elements under the compressor."""
        comp = self.state.compressor
        assert comp is not None  # only a compressed key comes here
        return comp.payload_format(n)

    def _all_gather(self, plan: _Gather, by_key: dict, what: str) -> None:
        comm, BYTE = self.t.comm, self.t.MPI.BYTE
        requests, splits = [], []
        for key, layout in plan.split:  # this process's piece is already in place
            itemsize = layout.dtype.itemsize
            counts, starts = layout.per_rank(self.t.size)
            splits.append(exchange.Split(None, as_bytes(by_key[key][1]),
                                         [c * itemsize for c in counts],
                                         [s * itemsize for s in starts], None))
        if plan.keys:
            send = plan.send
            offset = 0
            for key in plan.mine_small:  # after the update: the new values
                stored = as_bytes(self.state.shard.stored(key))
                send[offset:offset + stored.size] = stored
                offset += stored.size
            requests.append(comm.Iallgatherv(send, [plan.recv, plan.counts,
                                                    displacements(plan.counts), BYTE]))
        exchange.all_gather(self.t, splits, f"{what}: all-gather")
        self.state.agree.wait(requests, f"{what}: all-gather")
        recv = plan.recv
        for key, offset, nbytes in plan.keys:
            as_bytes(by_key[key][1])[...] = recv[offset:offset + nbytes]

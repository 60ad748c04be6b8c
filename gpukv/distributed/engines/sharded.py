"""`num_servers=0`: every process is a worker and serves a shard of the keys.

A sync round is a reduce-scatter of the round's gradients to their owners, the update there
(on the owner's shard only: optimizer state is sharded, never replicated), and an all-gather
of the new values into every process's copy, so a round costs what an allreduce costs. Big
keys are split into one contiguous piece per process and move in their own collectives,
without packing, in chunks over point-to-point messages (`exchange`: sums in rank order,
pipelined); small keys go whole to an owner picked by a hash of the key and travel packed,
one collective per dtype. Every round is first agreed on (`agree.Agreement`), so
processes that call different things fail with a PeerMismatchError instead of mixing data.

A deterministic engine gets each process's node partials of the canonical tree
(`engine.Partials`) and every sum goes through the exchange, whose owners merge them as
the tree does: MPI's own reductions have no fixed order.
"""
from __future__ import annotations

import itertools
import zlib
from typing import NamedTuple

import numpy as np

from ..._errors import CheckpointError, GpukvError, PeerError
from ...device.host_sum import accumulate_dtype
from ...encoding.compressors import Compressor, Ctx, ErrorFeedback, compressible
from ...layout.pieces import pieces
from ...layout.state import cut, mark_starts, merge
from ..mpi.agree import Agreement, from_rank0, refuse_split, to_rank0
from ..mpi.transport import Transport, as_bytes
from . import exchange
from .canonical_sum import check_partials, decode_leaves, node_ranges, sum_leaves
from .protocol import Shard


class KeyLayout(NamedTuple):
    shape: tuple
    dtype: np.dtype
    pieces: tuple      # sharding.Piece, one per owner
    wire: np.dtype     # the dtype it is summed in on the wire

    @property
    def split(self) -> bool:
        return len(self.pieces) > 1


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
    gather: _Gather | None  # with an updater or compressed keys: the all-gather of the
    #                         new values (of every key, or of the compressed ones)


#: keys of at least this many bytes (and no narrow type) are summed on their own
_ALONE_BYTES = 64 << 10


class ShardedRounds:
    """The S = 0 engine of a dist store (see the module's docstring).

    `shard` is this process's part of the store (see `engine.Shard`): it adopts the pieces
    this process serves, inside its copies, and updates them. Pieces of split keys are
    stored flat. Implements `engine.Engine`.
    """

    #: a round leaves every process's copy of its keys current
    round_updates_replicas = True
    compressor: Compressor | None

    def __init__(self, transport: Transport, shard: Shard, bound: int,
                 deterministic: bool = False):
        self.t = transport
        self.deterministic = deterministic  # push gets Partials, summed as the tree does
        self.compressor = None
        self.shard = shard
        self.bound = bound
        self.agree = Agreement(transport)
        self.layouts: dict = {}
        self._pending: list = []    # (key, replica) made here, not agreed on yet
        self._rounds: dict = {}     # (keys in canonical order, compression) -> _Round
        self.feedback: ErrorFeedback | None = None  # residuals per (key, piece start)
        self._formats: dict = {}    # elements -> compressed payload (dtype, bytes)
        self._assigns = True        # no updater yet: a round assigns the sum
        self._rule = ""             # the updater, as the agreement of a round names it
        self._settings = None       # the options of the optimizer that `_rule` names
        self._buffers: dict = {}    # scratch buffers of compressed rounds

    @property
    def num_workers(self) -> int:
        return self.t.size

    def check(self) -> None:
        """Raise the failure an earlier call met, if any."""
        self.t.check()

    @property
    def pending(self) -> bool:
        """Whether keys made here wait for the next collective call to be agreed on."""
        return bool(self._pending)

    @property
    def rank(self) -> int:
        return self.t.rank

    # ------------------------------------------------------------------- init
    def init(self, keys, replicas) -> None:
        """Queue new keys (`replicas`: this process's copies, holding its init value):
        they are agreed on, and take rank 0's value, before the next collective call,
        so processes may create keys in any order between two calls."""
        self.t.check()
        self._pending.extend(zip(keys, replicas))

    def flush(self, during: str) -> None:
        """Agree on the queued keys: same shapes and dtypes everywhere, rank 0's values;
        the first step of the collective call `during` names (and its errors name it)."""
        if not self._pending:
            return
        pending = sorted(self._pending, key=lambda p: p[0])
        self._pending = []
        signature = ("init", tuple((k, r.shape, r.dtype.name) for k, r in pending))
        what = f"{during}: first the keys made before it (init of key {pending[0][0]!r})"
        self.agree.check(signature, what)
        self._share_values(pending, f"{what}: rank 0's values")
        keys, views = [], []
        for key, replica in pending:
            layout = KeyLayout(replica.shape, replica.dtype,
                               pieces(key, replica.size, self.t.size, self.bound),
                               accumulate_dtype(replica.dtype))
            self.layouts[key] = layout
            for piece in layout.pieces:
                if piece.server == self.t.rank:  # served in place, inside this copy
                    keys.append(key)
                    views.append(replica.reshape(-1)[piece.start:piece.stop] if layout.split
                                 else replica)
        self.shard.adopt(keys, views)
        self._rounds.clear()

    def _share_values(self, pending, what: str) -> None:
        """Rank 0's value of each new key into every process's copy."""
        comm = self.t.comm
        self.t.wait_all([comm.Ibcast(as_bytes(r), root=0) for _, r in pending], what)

    # ------------------------------------------------------------------- push
    def push(self, keys, grads, replicas) -> None:
        """One sync round: the sum over processes of each key's `grads` updates the key at
        its owner(s); every process's `replicas` then hold the new values."""
        if not keys:
            self.flush("push")
            return
        order = sorted(range(len(keys)), key=keys.__getitem__)
        keys = tuple(keys[i] for i in order)
        grads = [grads[i] for i in order]
        replicas = [replicas[i] for i in order]
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        what = f"push of key {keys[0]!r}{more}"
        comp = self.compressor
        counts = (check_partials(keys, grads, [(r.size, r.dtype) for r in replicas],
                                 self.t.rank, self.t.size,
                                 [comp is not None and compressible(r.dtype) for r in replicas])
                  if self.deterministic else None)
        self.flush(what)
        wire = None if comp is None else tuple(sorted(comp.params().items()))
        # Every process must round alike: the same compression, updater or not, and the
        # same optimizer options (each process runs its own on its shard).
        op = ("push" + ("" if wire is None else f" compressed with {dict(wire)}")
              + (" assigning the sum" if self._assigns else f" updating with {self._rule}"))
        if counts is None:
            self.agree.check((op, keys), what)
            self.round(keys, dict(zip(keys, zip(grads, replicas))), what)
            return
        # the count of values each process pushes shapes the tree: every one must agree
        self.agree.check((op + " in the canonical order", tuple(zip(keys, counts))), what)
        self.canonical_round(keys, tuple(counts), dict(zip(keys, zip(grads, replicas))),
                             what)

    def round(self, keys, by_key: dict, what: str) -> None:
        """A push round once agreed on: `by_key` maps each key (in canonical order) to
        (this process's sum, its copy of the value)."""
        comp = self.compressor
        if self._assigns and comp is None:  # the sum is the new value, everywhere
            summed = self._rounds.get((keys, "sum"))
            if summed is None:
                summed = self._rounds[keys, "sum"] = self._sum_plan(keys)
            self._allreduce(summed, by_key, what)
            return
        wire = None if comp is None else tuple(sorted(comp.params().items()))
        plan = self._rounds.get((keys, wire))
        if plan is None:
            plan = self._rounds[keys, wire] = self._plan(keys)
        merged = self._exchange_compressed(plan, by_key, what)
        merged += self._reduce_scatter(plan, by_key, what)
        self.update(merged, what)
        self._all_gather(plan.gather, by_key, what)

    def canonical_round(self, keys, counts: tuple, by_key: dict, what: str) -> None:
        """A push round of a deterministic engine once agreed on: `by_key` maps each key
        (in canonical order) to (this process's Partials, or Leaves of a key compressed
        on the wire, and its copy of the value); every sum is the exchange's merge of the
        ranks' node partials, or the owner's of every leaf's decoded payload."""
        comp = self.compressor
        wire = None if comp is None else tuple(sorted(comp.params().items()))
        plan = self._rounds.get((keys, counts, wire, "canonical"))
        if plan is None:
            plan = self._canonical_plan(keys, counts)
            self._rounds[keys, counts, wire, "canonical"] = plan
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
        if self._assigns:  # no updater: the sums are the new values
            if splits:
                exchange.allreduce(self.t, splits, f"{what}: allreduce")
            for item in plan.sums:
                if item.out is not None:  # the key's dtype, rounded once
                    for key, offset, n in item.keys:
                        by_key[key][1].reshape(-1)[...] = item.out[offset:offset + n]
            if plan.gather is not None:  # the compressed keys: assigned, then gathered
                self.update(merged, what)
                self._all_gather(plan.gather, by_key, what)
            return
        if splits:
            exchange.reduce_scatter(self.t, splits, f"{what}: reduce-scatter")
        rank = self.t.rank
        for item in plan.sums:
            assert item.out is not None
            start, stop = item.starts[rank], item.starts[rank] + item.counts[rank]
            for key, offset, n in item.keys:
                layout = self.layouts[key]
                if layout.split:
                    if item.counts[rank]:
                        merged.append((key, item.out))
                elif start <= offset < stop:
                    merged.append((key, item.out[offset - start:offset - start + n]
                                   .reshape(layout.shape)))
        self.update(merged, what)
        assert plan.gather is not None  # an updater's round gathers every key
        self._all_gather(plan.gather, by_key, what)

    def _canonical_plan(self, keys, counts: tuple) -> _CanonicalPlan:
        """Every key's sum through the exchange: a split key in its pieces; without an
        updater, a key summed alone split evenly; the small keys of one wire dtype and
        count packed, each in the piece of its owner. Keys compressed on the wire go
        their own way (`_exchange_leaves`), in their pieces."""
        rank, size = self.t.rank, self.t.size
        sums, small, compressed = [], [], []
        comp = self.compressor
        for key, count in zip(keys, counts):
            layout = self.layouts[key]
            n, wire = layout_size(layout), layout.wire
            if comp is not None and compressible(layout.dtype):
                compressed.append((key, layout, count))
                continue
            if layout.split:
                per, starts = _per_rank(layout, size)
            elif self._assigns and self._alone(key):
                per, starts = _even(n, size)
            else:
                small.append((layout.pieces[0].server, key, layout, count))
                continue
            tree = exchange.Tree(node_ranges(size, count), size * count)
            out = (np.empty(per[rank], wire) if not self._assigns else
                   None if wire == layout.dtype else np.empty(n, wire))
            sums.append(_Exchanged([(key, 0, n)], per, starts, tree,
                                   exchange.tree_scratch(per, rank, tree, wire), None, out))
        small.sort(key=lambda s: (s[2].wire.str, s[3], s[0]))  # stable: by owner, in order
        for (wire, count), run in itertools.groupby(small, key=lambda s: (s[2].wire, s[3])):
            per, placed, offset = [0] * size, [], 0
            for owner, key, layout, _ in run:
                n = layout_size(layout)
                placed.append((key, offset, n))
                per[owner] += n
                offset += n
            tree = exchange.Tree(node_ranges(size, count), size * count)
            sums.append(_Exchanged(placed, per, _displacements(per), tree,
                                   exchange.tree_scratch(per, rank, tree, wire),
                                   np.empty((len(tree.nodes[rank]), offset), wire),
                                   np.empty(offset if self._assigns else per[rank], wire)))
        gathered = [k for k, _, _ in compressed] if self._assigns else keys
        return _CanonicalPlan(sums, compressed,
                              self._gather_plan(gathered) if gathered else None)

    def update(self, merged: list, what: str) -> None:
        """Run the updater (or assign) on the pieces served here: (key, summed piece)."""
        if not merged:
            return
        try:
            self.shard.update([k for k, _ in merged], [m for _, m in merged])
        except Exception as exc:  # the updater's: the others wait for this process
            self.t.fail(PeerError(f"rank {self.t.rank}: the update of {what} failed: "
                                  f"{type(exc).__name__}: {exc}"))
            raise

    def _plan(self, keys) -> _Round:
        rank, size = self.t.rank, self.t.size
        big: list = []
        small: list = []
        compressed: list = []
        comp = self.compressor
        for key in keys:
            layout = self.layouts[key]
            if not layout.split:
                small.append((layout.pieces[0].server, key, layout))
            if comp is not None and compressible(layout.dtype):
                compressed.append((key, layout))
            elif layout.split:
                counts, starts = _per_rank(layout, size)
                send = None if layout.wire == layout.dtype else np.empty(
                    sum(counts), layout.wire)
                # Without an updater the sum is the new value: received where it is kept.
                recv = (self.shard.stored(key) if self._assigns and send is None
                        and counts[rank] else np.empty(counts[rank], layout.wire))
                big.append((key, layout, send, recv, counts, starts,
                            exchange.scratch_for(counts, rank, layout.wire)))
        small.sort(key=lambda s: s[0])  # stable: keys stay in order within an owner
        packed = []
        summed = {k for k, _ in compressed}
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
        return _Round(compressed, big, packed, self._gather_plan(keys))

    def _gather_plan(self, keys) -> _Gather:
        """How a round with an updater brings the new values of `keys` to everyone."""
        rank = self.t.rank
        small = sorted(((layout.pieces[0].server, key, layout) for key in keys
                        for layout in [self.layouts[key]] if not layout.split),
                       key=lambda s: s[0])  # stable: keys stay in order within an owner
        gather_keys, gather_counts, offset = [], [0] * self.t.size, 0
        for owner, key, layout in small:
            nbytes = int(np.prod(layout.shape, dtype=np.int64)) * layout.dtype.itemsize
            gather_keys.append((key, offset, nbytes))
            gather_counts[owner] += nbytes
            offset += nbytes
        mine_small = [key for owner, key, _ in small if owner == rank]
        split = [(key, self.layouts[key]) for key in keys if self.layouts[key].split]
        return _Gather(split, gather_keys, gather_counts,
                       np.empty(gather_counts[rank], np.uint8), np.empty(offset, np.uint8),
                       mine_small)

    def _sum_plan(self, keys) -> _SumPlan:
        alone, split, packed = [], [], []
        small = sorted((k for k in keys if not self._alone(k) and not self.layouts[k].split),
                       key=lambda k: self.layouts[k].wire.str)
        for key in keys:
            layout = self.layouts[key]
            if layout.split:
                counts, starts = _per_rank(layout, self.t.size)
                wire = None if layout.wire == layout.dtype else (  # summed in float32
                    np.empty(sum(counts), layout.wire), np.empty(sum(counts), layout.wire))
                split.append((key, counts, starts,
                              exchange.scratch_for(counts, self.t.rank, layout.wire), wire))
            elif self._alone(key):
                alone.append(key)
        for wire, run in itertools.groupby(small, key=lambda k: self.layouts[k].wire):
            placed, offset = [], 0
            for key in run:
                n = int(np.prod(self.layouts[key].shape, dtype=np.int64))
                placed.append((key, offset, n))
                offset += n
            packed.append((placed, np.empty(offset, wire), np.empty(offset, wire)))
        return _SumPlan(alone, split, packed)

    def _alone(self, key) -> bool:
        """Whether a key is summed by an allreduce of its own, straight into its copy."""
        layout = self.layouts[key]
        return (layout.wire == layout.dtype
                and int(np.prod(layout.shape, dtype=np.int64)) * layout.dtype.itemsize
                >= _ALONE_BYTES)

    def _allreduce(self, plan: _SumPlan, by_key: dict, what: str) -> None:
        """A round without an updater: one allreduce per big key, from the gradient into
        this process's copy (which holds the pieces it serves; an exchange for a split
        key), and one per dtype of the small keys, packed."""
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
        splits = []
        for key, counts, starts, scratch, wire in plan.split:
            grad, replica = by_key[key]
            if wire is None:
                send, out = np.ascontiguousarray(grad).reshape(-1), replica.reshape(-1)
            else:
                send, out = wire
                send[...] = grad.reshape(-1)
            splits.append(exchange.Split(send, out, counts, starts, scratch))
        exchange.allreduce(self.t, splits, f"{what}: allreduce")
        self.t.wait_all(requests, f"{what}: allreduce")
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
        self.t.wait_all(requests, f"{what}: reduce-scatter")
        merged = [(key, recv) for key, _, _, recv, *_ in plan.big if recv.size]
        for group in plan.packed:
            for key, offset in group.mine:
                shape = self.layouts[key].shape
                n = int(np.prod(shape, dtype=np.int64))
                merged.append((key, group.recv[offset:offset + n].reshape(shape)))
        return merged

    def _exchange_compressed(self, plan: _Round, by_key: dict, what: str) -> list:
        """The compressed keys: each process encodes every piece (with its own residual)
        for the piece's owner, one all-to-all moves the payloads, and each owner decodes
        and sums what it got; (key, float32 sum) of the pieces owned here."""
        if not plan.compressed:
            return []
        comp, rank, size = self.compressor, self.t.rank, self.t.size
        assert comp is not None  # the plan has compressed keys
        outgoing: list = [[] for _ in range(size)]
        mine = []
        for key, layout in plan.compressed:
            flat = by_key[key][0].reshape(-1)
            for p in layout.pieces:
                payload, _ = self._compress((key, p.start), flat[p.start:p.stop])
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
        comp, rank, size = self.compressor, self.t.rank, self.t.size
        assert comp is not None  # the plan has compressed keys
        outgoing: list = [[] for _ in range(size)]
        mine = []
        for key, layout, count in compressed:
            values = by_key[key][0].values
            for p in layout.pieces:
                for j in range(count):
                    payload, _ = self._compress((key, p.start, j), values[j, p.start:p.stop])
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
            [send, send_counts, _displacements(send_counts), BYTE],
            [recv, [per_source] * size, [per_source * s for s in range(size)], BYTE])
        self.t.wait_all([request], f"{what}: compressed all-to-all")
        return recv

    def _scratch(self, name, dtype, n: int) -> np.ndarray:
        """A buffer kept from round to round (a new one would fault in every page)."""
        buf = self._buffers.get(name)
        if buf is None or buf.size != n:
            buf = self._buffers[name] = np.empty(n, dtype)
        return buf

    def _compress(self, slot: tuple, values):
        """(payload, ctx) of one piece of a key, with this process's residual of `slot`:
        (key, piece start), or (key, piece start, value) in a deterministic round, where
        each value has its own."""
        assert self.feedback is not None  # only a compressed key comes here
        return self.feedback.compress(slot, values)

    def _payload_format(self, n: int) -> tuple:
        """(dtype, bytes) of the payload of `n` elements under the compressor."""
        found = self._formats.get(n)
        if found is None:
            assert self.compressor is not None
            residual = np.zeros(n, np.float32) if self.compressor.uses_residual else None
            payload, _ = self.compressor.compress(np.zeros(n, np.float32), residual)
            found = self._formats[n] = (payload.dtype, payload.nbytes)
        return found

    def set_compression(self, compressor) -> None:
        """Compress on the wire from now on (every process must set the same: a push
        of processes that differ fails as a mismatch)."""
        self.compressor = compressor
        self.feedback = ErrorFeedback(compressor) if compressor is not None else None
        self._formats = {}

    def _all_gather(self, plan: _Gather, by_key: dict, what: str) -> None:
        comm, BYTE = self.t.comm, self.t.MPI.BYTE
        requests, splits = [], []
        for key, layout in plan.split:  # this process's piece is already in place
            itemsize = layout.dtype.itemsize
            counts, starts = _per_rank(layout, self.t.size)
            splits.append(exchange.Split(None, as_bytes(by_key[key][1]),
                                         [c * itemsize for c in counts],
                                         [s * itemsize for s in starts], None))
        if plan.keys:
            send = plan.send
            offset = 0
            for key in plan.mine_small:  # after the update: the new values
                stored = as_bytes(self.shard.stored(key))
                send[offset:offset + stored.size] = stored
                offset += stored.size
            requests.append(comm.Iallgatherv(send, [plan.recv, plan.counts,
                                                    _displacements(plan.counts), BYTE]))
        exchange.all_gather(self.t, splits, f"{what}: all-gather")
        self.t.wait_all(requests, f"{what}: all-gather")
        recv = plan.recv
        for key, offset, nbytes in plan.keys:
            as_bytes(by_key[key][1])[...] = recv[offset:offset + nbytes]

    # ------------------------------------------------------- updaters, barrier
    def set_optimizer(self, optimizer) -> None:
        """Every process runs its own `optimizer` on its shard (they must agree), so that
        changes made to it on every process (the learning rate, ...) count."""
        self.flush("set_optimizer")
        self.agree.check((f"set_optimizer({optimizer.name}, {optimizer.settings()!r})", ()),
                         "set_optimizer")
        refuse_split(optimizer, {k: (layout.split, layout.shape)
                                 for k, layout in self.layouts.items()}, "processes")
        self.shard.set_optimizer(optimizer)
        self._assigns = False
        self._rounds.clear()
        self.follow(optimizer)

    def follow(self, optimizer) -> None:
        """Nothing to send: each process's own optimizer runs its shard; what it is now
        goes into the next round's agreement, so processes whose options differ (a
        learning rate, a batch size) fail instead of updating their shards unlike."""
        settings = optimizer.settings()
        if settings != self._settings:
            self._settings = settings
            self._rule = (f"{optimizer.name} "
                          f"#{zlib.crc32(repr(settings).encode()):08x}")

    def set_updater(self, updater) -> None:
        """Each process runs its own `updater` on the pieces it owns (every process sets
        one: the rounds differ with and without)."""
        self.flush("set_updater")
        self.agree.check(("set_updater", ()), "set_updater")
        self.shard.set_updater(updater)
        self._assigns = False
        self._rule = "a function"
        self._settings = None  # a later optimizer, even of the same options, is named again
        self._rounds.clear()

    def barrier(self) -> None:
        self.collective("barrier")

    def collective(self, op: str) -> None:
        """Every process makes call `op` (a barrier, a checkpoint call) now: agreed on
        before anything of it moves, so a process on another call fails, naming both."""
        self.flush(op)
        self.agree.check((op, ()), op)

    def workers_max(self, values: np.ndarray, what: str) -> np.ndarray:
        self.flush(what)
        return self.agree.maximum(values, what)

    def pull(self, keys, replicas) -> None:
        """The replicas are current after every round: only queued inits need a round."""
        self.flush(f"pull of key {keys[0]!r}" if keys else "pull")

    # ------------------------------------------------------------- checkpoints
    def optimizer_state(self, dump: bool):
        """Every shard's optimizer state merged, on rank 0 (None elsewhere, and without
        an optimizer)."""
        self.flush("saving the optimizer state")
        self.agree.check(("optimizer_state", ()), "saving the optimizer state")
        starts = {k: p.start for k, layout in self.layouts.items() for p in layout.pieces
                  if p.server == self.t.rank}
        export = mark_starts(self.shard.export_state(dump), starts)
        exports = to_rank0(self.t, export, "saving the optimizer state")
        if exports is None:
            return None
        return merge(exports, {k: layout.shape for k, layout in self.layouts.items()})

    def restore(self, values: dict, state) -> None:
        """Load `values` ({key: full array}, on every rank) and the optimizer `state`
        ((header, arrays) of the whole store, or None): each shard checks its part
        first; any failure changes nothing and raises CheckpointError on every rank."""
        self.flush("load")
        self.agree.check(("restore", tuple(sorted(values))), "load")
        t = self.t
        checked, error = None, None
        if state is not None:
            sizes = {k: int(np.prod(layout.shape)) for k, layout in self.layouts.items()}
            try:
                checked = self.shard.check_state(cut(state, t.rank, t.size, self.bound,
                                                     sizes))
            except GpukvError as exc:
                error = str(exc) if isinstance(exc, CheckpointError) else (
                    f"{type(exc).__name__}: {exc}")
        errors = to_rank0(t, error, "load")
        failed = from_rank0(t, None if errors is None else next(
            (e for e in errors if e is not None), None), "load")
        if failed is not None:
            raise CheckpointError(failed)
        for key, value in values.items():
            for p in self.layouts[key].pieces:
                if p.server == t.rank:
                    self.shard.assign(key, value.reshape(-1)[p.start:p.stop])
        if checked is not None:
            self.shard.apply_state(checked)

    def share(self, obj, what: str):
        """Rank 0's `obj` on every rank."""
        return from_rank0(self.t, obj, what)

    # --------------------------------------------------------------- snapshots
    def write_snapshot(self, request: dict) -> str | None:
        """Every rank writes the pieces its shard serves (shard `rank` of `size`)."""
        self.flush("snapshot")
        rank = self.t.rank
        pieces = {key: (p.start, p.stop, layout.shape) for key, layout in self.layouts.items()
                  for p in layout.pieces if p.server == rank}
        return self._alike(self.shard.write_part(
            dict(request, index=rank, count=self.t.size, pieces=pieces)), "snapshot")

    def finish_snapshots(self) -> str | None:
        return self._alike(self.shard.finish_part(), "finishing the snapshots")

    def _alike(self, error: str | None, what: str) -> str | None:
        """The first rank's error (rank order), on every rank."""
        errors = to_rank0(self.t, error, what)
        first = None if errors is None else next((e for e in errors if e is not None), None)
        return from_rank0(self.t, first, what)


def _displacements(counts: list) -> list:
    return [0] + list(itertools.accumulate(counts))[:-1]


def _even(n: int, size: int) -> tuple[list, list]:
    """(elements, first element) of `size` pieces of `n` elements, as even as can be."""
    per = [n // size + (r < n % size) for r in range(size)]
    return per, _displacements(per)


def _per_rank(layout: KeyLayout, size: int) -> tuple[list, list]:
    """(elements, first element) of a split key's piece on each of `size` ranks (0 and
    the key's end for a rank without a piece)."""
    counts, starts = [0] * size, [layout_size(layout)] * size
    for p in layout.pieces:
        counts[p.server], starts[p.server] = p.stop - p.start, p.start
    return counts, starts


def layout_size(layout: KeyLayout) -> int:
    return int(np.prod(layout.shape, dtype=np.int64))

"""Sums of split keys over point-to-point messages, in chunks: a direct exchange.

Every process sends each owner its piece of a key, chunk by chunk; the owner sums the
contributions to a chunk as soon as all have arrived, always in rank order (so a sum is
the same bits whichever process ran ahead or whose message came first), or, for a key
with a `Tree`, each rank's node partials merged as the canonical tree adds them, and in an
allreduce sends the summed chunk on to every other process at once. Sending, summing and
receiving overlap, and each link carries what it must, 2(N-1)/N of the key, near its rate
(MPI's own collectives, one step after another, leave a network link idle part of the
time). Every wait is the transport's: bounded by its timeout, and a peer that does not
answer is named in the PeerError.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..._errors import PeerError
from ...canonical.arrays import merge_into
from ..mpi.chunks import CHUNK_BYTES, chunk_ranges
from ..mpi.transport import TAG_GATHER, TAG_SCATTER, Transport, as_bytes


class Tree(NamedTuple):
    """A key summed in the canonical order (`gpukv.canonical`)."""
    nodes: list  # per rank, the [lo, hi) leaf ranges of the node partials it sends
    total: int   # leaves of the tree


class Split(NamedTuple):
    """One split key in an exchange (flat, contiguous arrays of its wire dtype)."""
    send: np.ndarray | None  # this process's contribution, the whole key (to reduce); with
    #                          a tree, (its nodes, the whole key): a row per node partial
    out: np.ndarray          # the whole key (gathered into), or only the piece owned here
    counts: list             # elements of the piece of each rank
    starts: list             # first element of the piece of each rank
    scratch: np.ndarray | list | None  # (ranks - 1, piece owned here): the others'
    #                          contributions; with a tree, per rank (None: this one) its
    #                          rows of the piece owned here
    tree: Tree | None = None


def tree_scratch(counts: list, rank: int, tree: Tree, wire: np.dtype) -> list:
    """The buffers an owner receives the other ranks' node partials into."""
    return [None if s == rank else np.empty((len(nodes), counts[rank]), wire)
            for s, nodes in enumerate(tree.nodes)]


def scratch_for(counts: list, rank: int, wire: np.dtype) -> np.ndarray:
    """The buffers an owner receives the other ranks' contributions into."""
    return np.empty((len(counts) - 1, counts[rank]), wire)


def chunks(n: int, itemsize: int, chunk_bytes: int | None = None) -> list:
    """[start, stop) of the chunks of a piece of `n` elements (none when the piece is
    empty: nothing to send): `chunk_bytes` long (the job's GPUKV_DIST_CHUNK_BYTES,
    `Transport.chunk_bytes`) when given, else CHUNK_BYTES, on one machine too (the
    owner's sum of a chunk overlaps the others' transfers)."""
    if not n:
        return []
    return chunk_ranges(n, itemsize, chunk_bytes or CHUNK_BYTES)


def allreduce(t: Transport, keys: list, what: str) -> None:
    """Each key's `out` becomes the sum over the ranks of their `send`."""
    direct, mine = _by_mpi(t, keys, summed=True)
    t.wait_all([t.comm.Iallreduce(k.send.copy() if np.may_share_memory(k.send, k.out)
                                  else k.send, k.out, op=t.MPI.SUM) for k in mine],
               what, on_timeout=_peer_silent(t, what))
    _Exchange(t, what).run(direct, reduce=True, gather=True)


def reduce_scatter(t: Transport, keys: list, what: str) -> None:
    """Each key's `out` (the piece owned here) becomes the sum of that piece of `send`."""
    direct, mine = _by_mpi(t, keys, summed=True, in_rank_order=True)
    t.wait_all([t.comm.Ireduce_scatter(k.send, k.out, k.counts, op=t.MPI.SUM)
                for k in mine], what, on_timeout=_peer_silent(t, what))
    _Exchange(t, what).run(direct, reduce=True, gather=False)


def all_gather(t: Transport, keys: list, what: str) -> None:
    """Each key's `out` gets every other rank's piece (its own piece is in place)."""
    direct, mine = _by_mpi(t, keys)
    t.wait_all([t.comm.Iallgatherv(t.MPI.IN_PLACE, [k.out, (k.counts, k.starts)])
                for k in mine], what, on_timeout=_peer_silent(t, what))
    _Exchange(t, what).run(direct, reduce=False, gather=True)


def _peer_silent(t: Transport, what: str):
    """The PeerError of a timeout in MPI's collective between two processes: the other."""
    return lambda: PeerError(f"rank {t.rank}: {what}: no data from rank(s) {1 - t.rank} "
                             f"within {t.timeout:g} s (GPUKV_DIST_TIMEOUT)")


#: whether two processes' split keys take MPI's own collectives (`_by_mpi`); False keeps
#: the exchange's messages between two as well (benchmarks/model_hosts.py times them so)
MPI_FOR_TWO = True
#: the dtypes MPI's own sums take here (its SUM on them is NumPy's add)
_MPI_SUMS = {np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32),
             np.dtype(np.int64)}


def _by_mpi(t: Transport, keys: list, summed: bool = False,
            in_rank_order: bool = False) -> tuple[list, list]:
    """(the keys for the exchange, those MPI's own collective takes). Between two
    processes MPI's collectives keep the link as busy as the exchange does (a tie at
    1 Gb/s) and take less of the CPU (at 10 Gb/s the exchange reaches 60-80% of the
    link, MPI 90-95%; benchmarks/bench_cluster.py), and a sum of two terms is the same
    bits in either order; with more processes the exchange, which keeps every link
    busy at once, is faster (4 hosts at 1 Gb/s: 87% of the link against MPI's 62%).
    A key summed in the canonical order (`tree`) always takes the exchange; so does a
    sum of a dtype MPI does not add as NumPy does, or a reduce-scatter of a key whose
    pieces are not in rank order."""
    if t.size != 2 or not MPI_FOR_TWO:
        return keys, []
    direct: list = []
    mine: list = []
    for key in keys:
        ordered = key.starts[0] == 0 and key.starts[1] == key.counts[0]
        takes = (key.tree is None and (ordered or not in_rank_order)
                 and (not summed or (key.send is not None and key.send.dtype in _MPI_SUMS)))
        (mine if takes else direct).append(key)
    return direct, mine


class _Chunk(NamedTuple):
    key: Split
    start: int     # in the piece owned here
    stop: int
    waiting: list  # [contributions still to come]


class _Exchange:
    """The messages of one exchange, and what to do as each arrives."""

    def __init__(self, t: Transport, what: str):
        self.t = t
        self.what = what
        self.recvs: list = []    # requests, and for each the rank it comes from and
        self.sources: list = []  # the chunk it feeds (None: a gathered chunk)
        self.feeds: list = []
        self.sends: list = []
        self.chunks: list = []   # chunks to sum, in the order their sums are sent on
        self.summed = 0          # chunks summed so far
        self.gather = False
        self.others: list = []   # the ranks a summed chunk goes on to
        self.arrived = 0         # messages received so far
        self.scratch: list = []  # temporaries of the canonical merges
        self.chunk = t.chunk_bytes  # the job's chunk size (None: CHUNK_BYTES)

    def run(self, keys: list, reduce: bool, gather: bool) -> None:
        if not keys:
            return
        t, rank, size = self.t, self.t.rank, self.t.size
        self.gather = gather
        comm = t.comm
        others = [(rank + j) % size for j in range(1, size)]  # each rank sends first
        self.others = others if gather else []                 # to a different one
        for key in keys:
            mine = key.counts[rank]
            if reduce:
                per = [1] * size if key.tree is None else list(map(len, key.tree.nodes))
                for a, b in chunks(mine, key.out.itemsize, self.chunk):
                    chunk = _Chunk(key, a, b, [sum(per) - per[rank]])
                    self.chunks.append(chunk)
                    for i, source in enumerate(s for s in range(size) if s != rank):
                        if key.tree is None:
                            self._recv(key.scratch[i, a:b], source, TAG_SCATTER, chunk)
                            continue
                        for row in key.scratch[source]:  # one message per node partial
                            self._recv(row[a:b], source, TAG_SCATTER, chunk)
            if gather:
                for source in others:
                    start = key.starts[source]
                    for a, b in chunks(key.counts[source], key.out.itemsize, self.chunk):
                        self._recv(key.out[start + a:start + b], source, TAG_GATHER, None)
        for key in keys:
            if reduce:
                assert key.send is not None
                rows = [key.send] if key.tree is None else list(key.send)
                pieces = [chunks(key.counts[o], key.send.itemsize, self.chunk)
                          for o in range(size)]
                for c in range(max(map(len, pieces))):  # chunk by chunk, to every owner
                    for owner in others:
                        if c < len(pieces[owner]):
                            a, b = pieces[owner][c]
                            start = key.starts[owner]
                            for row in rows:
                                self.sends.append(comm.Isend(
                                    as_bytes(row[start + a:start + b]), dest=owner,
                                    tag=TAG_SCATTER))
            elif gather:
                start = key.starts[rank]
                for a, b in chunks(key.counts[rank], key.out.itemsize, self.chunk):
                    self._send_on(key.out[start + a:start + b], others)
        self._sum_ready()
        t.poll(self._progress, self.what, on_timeout=self._silent,
               moved=lambda: self.arrived)

    def _recv(self, buf: np.ndarray, source: int, tag: int, chunk) -> None:
        self.recvs.append(self.t.comm.Irecv(as_bytes(buf), source=source, tag=tag))
        self.sources.append(source)
        self.feeds.append(chunk)

    def _send_on(self, buf: np.ndarray, ranks: list) -> None:
        for rank in ranks:
            self.sends.append(self.t.comm.Isend(as_bytes(buf), dest=rank, tag=TAG_GATHER))

    def _progress(self):
        """True once every message has moved; sums (and sends on) what has arrived."""
        test_some, test_all = self.t.MPI.Request.Testsome, self.t.MPI.Request.Testall
        arrived = test_some(self.recvs) if self.recvs else None
        if arrived:
            self.arrived += len(arrived)
            for i in arrived:
                chunk = self.feeds[i]
                self.sources[i] = None
                if chunk is not None:
                    chunk.waiting[0] -= 1
            self._sum_ready()
        if any(s is not None for s in self.sources):
            return None
        return True if test_all(self.sends) else None

    def _sum_ready(self) -> None:
        """Sum the chunks whose contributions are all in, in order (the sums are sent on
        in the order the others receive them)."""
        rank = self.t.rank
        while self.summed < len(self.chunks) and self.chunks[self.summed].waiting[0] == 0:
            key, a, b, _ = self.chunks[self.summed]
            self.summed += 1
            start = key.starts[rank]
            assert key.send is not None and key.scratch is not None
            out = key.out[start + a:start + b] if self.gather else key.out[a:b]
            if key.tree is not None:
                self._merge(key, a, b, out)
                if self.others:
                    self._send_on(out, self.others)
                continue
            own = key.send[start + a:start + b]
            if np.may_share_memory(own, out):
                own = own.copy()
            parts = [key.scratch[s - (s > rank), a:b] if s != rank else own
                     for s in range(len(key.counts))]
            np.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                np.add(out, part, out=out)
            if self.others:
                self._send_on(out, self.others)

    def _merge(self, key: Split, a: int, b: int, out: np.ndarray) -> None:
        """`out` becomes the sum of chunk [a, b) of the piece owned here: every rank's
        node partials of it, merged as the canonical tree adds them."""
        rank, start = self.t.rank, key.starts[self.t.rank]
        assert key.tree is not None and key.send is not None and key.scratch is not None
        parts: list = []
        for s, nodes in enumerate(key.tree.nodes):
            rows = key.send[:, start + a:start + b] if s == rank else key.scratch[s][:, a:b]
            parts += zip(nodes, rows)
        merge_into(out, parts, key.tree.total, self.scratch)

    def _silent(self) -> PeerError:
        """The PeerError of a timeout: who has not sent what this rank waits for."""
        # the ranks whose contributions are missing first: the others may only be
        # waiting for them before they send their sums on
        silent = sorted({s for s, f in zip(self.sources, self.feeds)
                         if s is not None and f is not None}) or sorted(
            {s for s in self.sources if s is not None})
        waiting = (f"no data from rank(s) {', '.join(map(str, silent))}" if silent else
                   "its messages were not taken by the other ranks")
        return PeerError(f"rank {self.t.rank}: {self.what}: {waiting} within "
                         f"{self.t.timeout:g} s (GPUKV_DIST_TIMEOUT)")

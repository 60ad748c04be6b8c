"""`num_servers=S >= 1`: the first S processes serve, the others are workers (MXNet's layout);
this is the servers' side (`client.ServerClient` is the workers').

A worker sends each piece of a key (see `sharding`) to its server: a small pickled request,
then the raw bytes in chunks (see `chunks`). The server receives from every worker at once:
it posts the receives of a request's chunks as soon as it reads the request, and keeps, per
key, a queue of incoming pushes per worker. In sync mode a round's chunk is summed as soon
as every worker's copy of it is in, always in worker order (so the sum's bits do not depend
on who came first); without an updater the sum is the key's new value, and a pull waiting
for that round is sent each summed chunk at once, while later chunks still arrive. With an
updater the chunks are summed into a merge buffer and the updater runs once on the whole
piece. When every chunk is in, the key's version goes up; a pull names the version it
needs (the number of its worker's pushes of that key) and is answered when the key has
reached it. In async mode each push is applied whole as it comes. Nothing waits without a
bound: a key whose round misses some workers for the timeout fails on the server, which
tells every worker which ones.

A deterministic worker sends its node partials of the canonical tree (`engine.Partials`)
and their count instead: the server checks every worker pushed the same count and merges
each chunk's partials as the tree does (`gpukv.canonical.arrays.merge_into`), in place of
the worker-order sum.
A key it compresses comes as its values' payloads, a row each (the leaves of the tree):
once every worker's are in, the server decodes them all and sums them as one process
sums its sources' (`partials.sum_leaves`), then updates.

A key pushed with a compressor that compresses pulls too ('sign') is served as
`gpukv.encoding.pulls` says: the server moves what its workers pull on by one payload
after each round, from the updated value kept apart (with an updater) or from the sum;
a pull from a worker that holds the version before is sent that round's payload alone
(`send_change`), which it decodes as every worker does; one further behind is sent the
served value whole, as float32.

A key a low-rank compressor sums (PowerSGD's) comes as every worker's share of a sum they
made together (`low_rank`): once all are in, laid end to end in worker order, they are the
round's sum, which the updater gets or which becomes the value.

On the timeline (GPUKV_TIMELINE), each step of a key's round the server takes (the chunks
that came summed, the round finished, an async push applied) is a `serve` span naming the
key, with its `sum`, the update's own spans (the shard's store) and `encode pulls` (the
payload a compressed pull is sent) inside.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import timeline
from ..._errors import CheckpointError, GpukvError, PeerError, PeerMismatchError
from ...canonical.arrays import merge_into, own_sum
from ...canonical.tree import rank_nodes
from ...checkpoints import snapshots
from ...device.host_sum import accumulate_dtype, host_sum
from ...encoding.compressors import make_compressor
from ...encoding.pulls import PullCodec
from ...layout.state import mark_starts
from ..mpi import job_exit
from ..mpi.chunks import chunk_bytes, chunk_ranges
from ..mpi.transport import TAG_ERROR, TAG_PUSH_DATA, TAG_REPLY, TAG_REQUEST, Transport, worker_comm
from .partials import decode_leaves, sum_leaves
from .protocol import Shard
from .requests import (
    CheckState,
    Command,
    FinishSnapshots,
    Flush,
    Init,
    OptimizerState,
    Pull,
    Push,
    ResetCompression,
    Restore,
    RestoreCompression,
    SetOptimizer,
    Settings,
    SetUpdater,
    Stop,
    WriteSnapshot,
)


class _Incoming:
    """One worker's push of one key's piece: its buffer, arriving chunk by chunk (node
    partials: a row each, every row's chunk by chunk)."""

    def __init__(self, buffer: np.ndarray, comp, chunk: int, count=None, nodes=None,
                 share: bool = False, num_update: int | None = None):
        self.buffer = buffer
        self.share = share             # a share of the round's whole sum (PushPiece.share)
        self.num_update = num_update   # the worker's count for the update (PushPiece's)
        self.comp = comp               # (compressor params, size) of a compressed payload
        self.count = count             # the values of a push of node partials (or of
        #                                leaves' payloads, when compressed), else None
        self.nodes = nodes             # and the worker's nodes (or leaves), one per row
        self.rows = len(nodes) if nodes else 1
        self.ranges = chunk_ranges(buffer.size // self.rows, buffer.itemsize, chunk)
        self.arrived = [0] * len(self.ranges)  # rows in, per chunk
        self.missing = len(self.ranges) * self.rows

    @property
    def complete(self) -> bool:
        return self.missing == 0

    def ready(self, chunk: int) -> bool:
        """Whether every row of `chunk` is in."""
        return self.arrived[chunk] == self.rows


class _Key:
    """What a server knows of one key (its piece of it)."""

    def __init__(self, workers: int):
        self.inits: dict = {}          # worker -> (start, stop, shape, dtype)
        self.initialised = False
        self.version = 0
        self.queues: list = [collections.deque() for _ in range(workers)]
        self.summed = 0                # chunks of the oldest round summed so far
        self.summed_to = 0             # and the elements they end at
        self.merged = None             # where chunks are summed when an updater runs
        self.leaf_sum = None           # where compressed leaves are summed (float32)
        self.leaf_terms = None         # and their decoded terms, a row per leaf
        self.since = None              # when the oldest incomplete round began
        self.spec = None               # (start, stop, shape, dtype)
        self.serving = None            # the compressor params its pulls are compressed by
        self.change = None             # (version, payload) that moved the served value
        #                                to that version (compressed pulls)


class _Pull:
    """A pull not fully answered: its keys go out in order, each in chunks."""

    def __init__(self, worker: int, tag: int, wanted: list, changes: list):
        self.worker = worker
        self.tag = tag
        self.wanted = wanted           # [(key, version)]
        self.changes = changes         # per wanted: send the payload of its last round
        self.key = 0                   # the index in `wanted` being sent
        self.chunk = 0                 # the next chunk of that key


#: seconds a round still waits for a worker once its word that its program ended is seen
#: (as `agree._ENDED_GRACE`), before the worker is named as ended without making it
ENDED_GRACE = 1.0


class _Server:
    def __init__(self, transport: Transport, servers: int, shard: Shard, asynchronous: bool):
        self.t = transport
        self.servers = servers
        self.workers = transport.size - servers
        self.shard = shard
        self.asynchronous = asynchronous
        self.chunk = chunk_bytes(transport)  # the workers cut their pieces alike
        self.keys: dict = {}
        self.scratch: list = []        # temporaries of the canonical merges
        self.pulls: list = []          # _Pull not answered yet
        self.sending: list = []        # requests of replies on their way
        self.kept: list = []           # the buffers they send, alive until then
        self.receiving: list = []      # requests of pushed chunks not in yet
        self.arrivals: list = []       # (key, _Incoming, chunk) of each of them
        self.updating = False          # whether an optimizer or updater runs here
        self.stopped: set = set()
        self.ended_since: dict = {}    # worker -> when its word that it ended was seen
        self.failure: PeerError | None = None
        self.compressors: dict = {}
        self.pull_codecs: dict = {}    # compressor params -> PullCodec (compressed pulls)
        self.checked = None            # the state plan op_check_state made
        self.init_waits: list = []     # (worker, reply tag, keys) of inits not answered
        self.free: dict = {}           # (dtype, size) -> push buffers to reuse
        self.handlers: dict[Command, Callable[[int, int, Any], None]] = {
            Command.INIT: self.op_init, Command.PUSH: self.op_push,
            Command.PULL: self.op_pull, Command.FLUSH: self.op_flush,
            Command.SETTINGS: self.op_settings,
            Command.SET_OPTIMIZER: self.op_set_optimizer,
            Command.SET_UPDATER: self.op_set_updater,
            Command.OPTIMIZER_STATE: self.op_optimizer_state,
            Command.WRITE_SNAPSHOT: self.op_write_snapshot,
            Command.FINISH_SNAPSHOTS: self.op_finish_snapshots,
            Command.CHECK_STATE: self.op_check_state, Command.RESTORE: self.op_restore,
            Command.RESTORE_COMPRESSION: self.op_restore_compression,
            Command.RESET_COMPRESSION: self.op_reset_compression}

    def worker_rank(self, w: int) -> int:
        return self.servers + w

    def run(self) -> None:
        t = self.t
        last_check = last_message = time.monotonic()
        pause = t.pacer()
        while len(self.stopped) < self.workers or self.receiving:
            message = t.try_recv_object(t.MPI.ANY_SOURCE, TAG_REQUEST)
            if message is not None:
                self.handle(*message)
                last_message = time.monotonic()
                pause = t.pacer()
                continue
            if self.progress():
                last_message = time.monotonic()
                pause = t.pacer()
                continue
            self.prune_sending()
            now = time.monotonic()
            if now - last_check > min(1.0, t.timeout / 4):
                last_check = now
                self.check_stalls(now)
            pause(now - last_message)  # idle a while: a server costs little
        t.wait_all(self.sending, "sending the last replies")

    def progress(self) -> bool:
        """Take in the pushed chunks that arrived, sum and answer what they complete;
        whether any did."""
        if not self.receiving:
            return False
        try:
            done = self.t.completed(self.receiving, "receiving pushed data")
        except PeerError as exc:
            self.fail(exc)
            raise
        if not done:
            return False
        keys: dict = {}
        for i in done:
            key, incoming, chunk = self.arrivals[i]
            incoming.arrived[chunk] += 1
            incoming.missing -= 1
            keys[key] = None
        finished = set(done)
        self.receiving = [r for i, r in enumerate(self.receiving) if i not in finished]
        self.arrivals = [a for i, a in enumerate(self.arrivals) if i not in finished]
        if self.failure is None:
            for key in keys:
                self.guarded("push", lambda key=key: self.advance(key, self.keys[key]))
            self.answer_pulls()
        return True

    def send(self, request, buffer=None) -> None:
        """Keep `request` (and the `buffer` it sends) until it completes."""
        self.sending.append(request)
        self.kept.append(buffer)

    def prune_sending(self) -> None:
        if not self.sending:
            return
        done = set(self.t.completed(self.sending, "sending replies"))
        if done:
            self.sending = [r for i, r in enumerate(self.sending) if i not in done]
            self.kept = [b for i, b in enumerate(self.kept) if i not in done]

    # ---------------------------------------------------------------- requests
    def handle(self, message, source: int) -> None:
        worker, request = message
        if isinstance(request, Stop):
            self.stopped.add(worker)
            return
        if self.failure is not None:
            if isinstance(request, Push):
                self.post(source, request)  # taken in and dropped: the sender is not stuck
            elif isinstance(request, Init):
                self.receive_data(source, request)
            self.tell(worker, self.failure)
            return
        handler = self.handlers[request.command]
        self.guarded(f"{request.command.value} from worker {worker}",
                     lambda: handler(worker, source, request))

    def guarded(self, what: str, call) -> None:
        """`call()`; a failure in it fails the server (every worker hears of it)."""
        try:
            call()
        except PeerError as exc:
            self.fail(exc)
        except Exception as exc:  # the updater's own error, say: the job cannot go on
            self.fail(PeerError(f"server rank {self.t.rank}: {what} failed: "
                                f"{type(exc).__name__}: {exc}"))

    def post(self, source: int, request: Push) -> list:
        """Start receiving the chunks of a push from `source`: an _Incoming per piece (of
        `elements`, or per node partial of a count of values)."""
        incomings = []
        for entry in request.pieces:
            key, count, n = entry.key, entry.pushed, entry.elements
            worker = source - self.servers
            if count is None:
                nodes = None
            elif entry.comp is None:
                nodes = rank_nodes(worker, count, self.workers)
            else:  # compressed: every value's payload is a leaf of its own
                nodes = [(worker * count + j, worker * count + j + 1) for j in range(count)]
            rows = len(nodes) if nodes else 1
            incoming = _Incoming(self.buffer(np.dtype(entry.dtype), n * rows), entry.comp,
                                 self.chunk, count, nodes, entry.share, entry.num_update)
            for chunk, (lo, hi) in enumerate(incoming.ranges):
                for row in range(rows):
                    self.receiving.append(self.t.recv_array(
                        incoming.buffer[row * n + lo:row * n + hi], source, TAG_PUSH_DATA))
                    self.arrivals.append((key, incoming, chunk))
            incomings.append(incoming)
        return incomings

    def receive_data(self, source: int, request: Init) -> list:
        """The values (as bytes) that follow an init from `source` (worker 0's)."""
        arrays = [self.buffer(np.dtype(np.uint8), n) for n in request.nbytes]
        self.t.wait_all([self.t.recv_array(a, source, TAG_PUSH_DATA) for a in arrays],
                        f"data of a request from worker {source - self.servers}")
        return arrays

    def buffer(self, dtype: np.dtype, n: int) -> np.ndarray:
        """An array for a push, reused once its push is applied: a new one each time
        would cost a page fault per page as it is first written."""
        free = self.free.get((dtype, n))
        return free.pop() if free else np.empty(n, dtype)

    def release(self, arrays) -> None:
        for a in arrays:
            self.free.setdefault((a.dtype, a.size), []).append(a)

    def op_init(self, worker, source, request: Init) -> None:
        arrays = self.receive_data(source, request)
        self.init_waits.append((worker, request.tag, [p.key for p in request.pieces]))
        for (key, start, stop, shape, dtype), value in zip(request.pieces, arrays or
                                                           itertools.repeat(None)):
            state = self.keys.setdefault(key, _Key(self.workers))
            if state.initialised or worker in state.inits:
                continue
            state.inits[worker] = (start, stop, tuple(shape), dtype)
            if value is not None:
                state.value = value
            if state.since is None:
                state.since = time.monotonic()
            if len(state.inits) == self.workers:
                self.finish_init(key, state)
        self.answer_inits()

    def answer_inits(self) -> None:
        """Tell each worker when every key of an init it sent exists everywhere."""
        waiting = []
        for worker, tag, keys in self.init_waits:
            if all(self.keys[k].initialised for k in keys):
                self.reply(worker, "ok", tag)
            else:
                waiting.append((worker, tag, keys))
        self.init_waits = waiting

    def finish_init(self, key, state) -> None:
        specs = set(state.inits.values())
        if len(specs) > 1:
            by_spec: dict = {}
            for w, spec in sorted(state.inits.items()):
                by_spec.setdefault(spec, []).append(w)
            told = "; ".join(f"worker(s) {', '.join(map(str, ws))}: shape {spec[2]} "
                             f"{np.dtype(spec[3]).name}" for spec, ws in by_spec.items())
            raise PeerMismatchError(f"init of key {key!r}: workers disagree: {told}")
        start, stop, shape, dtype = specs.pop()
        state.spec = (start, stop, shape, np.dtype(dtype))
        value = state.value.view(np.dtype(dtype))
        self.shard.init(key, value if stop - start != int(np.prod(shape)) else
                        value.reshape(shape))
        del state.value
        state.initialised = True
        state.since = None
        self.advance(key, state)
        self.answer_pulls()

    def op_push(self, worker, source, request: Push) -> None:
        """Queue the push of each key and start receiving its chunks: they are summed as
        they come (see `advance`)."""
        for entry, incoming in zip(request.pieces, self.post(source, request)):
            key = entry.key
            state = self.keys.setdefault(key, _Key(self.workers))
            state.queues[worker].append(incoming)
            if state.since is None:
                state.since = time.monotonic()

    def compressor(self, params):
        """The compressor of `params` (a worker's, sorted items)."""
        compressor = self.compressors.get(params)
        if compressor is None:
            compressor = self.compressors[params] = make_compressor(dict(params))
        assert compressor is not None  # the params of a compressor at work
        return compressor

    def decode(self, comp, payload) -> np.ndarray:
        params, size = comp
        from ...encoding.compressors import Ctx
        return self.compressor(params).decompress(payload, Ctx(size, (size,)),
                                                  self.buffer(np.dtype(np.float32), size))

    def leaf_terms(self, heads: list, terms: np.ndarray | None = None) -> np.ndarray:
        """The decoded leaves of pushes of payloads `heads` (the leaves in order), a row
        each, as one process sums them (see `partials.decode_leaves`), in `terms`
        when it is given (and of their shape)."""
        params, size = heads[0].comp
        shape = (sum(h.rows for h in heads), size)
        if terms is None or terms.shape != shape:
            terms = np.empty(shape, np.float32)
        payloads = [row for h in heads for row in h.buffer.reshape(h.rows, -1)]
        decode_leaves(self.compressor(params), payloads, size, terms)
        return terms

    def sum_leaves(self, key, state, heads: list) -> None:
        """A round of every worker's leaves' payloads: decoded and summed as one process
        does, then the update (or the assignment)."""
        same_compression(key, heads)
        stored = self.shard.stored(key)
        if state.leaf_sum is None:
            state.leaf_sum = np.empty(stored.size, np.float32)
        # kept from round to round, as leaf_sum is (a new one would fault in every page)
        with timeline.span("sum", "server"):
            state.leaf_terms = self.leaf_terms(heads, state.leaf_terms)
            sum_leaves(self.compressor(heads[0].comp[0]), state.leaf_terms, state.leaf_sum)
        self.serve_as(key, state, heads[0].comp)
        with self.shard.counted_as(told_num_update(key, heads)):
            self.shard.update([key], [state.leaf_sum.reshape(stored.shape)])
        self.serve(key, state, state.leaf_sum)
        state.version += 1
        self.release([h.buffer for h in heads])

    def serve_as(self, key, state, comp) -> None:
        """Before a round of `key` pushed with `comp` ((params, size), or None): its pulls
        compressed from now on if its compressor compresses both ways; a key whose
        compression changed is served its value again (its residual afresh), as a
        worker's store does when the compression is set."""
        params = None if comp is None else comp[0]
        if params is not None and not self.compressor(params).compresses_pulls:
            params = None
        if state.serving is not None and state.serving != params:
            self.shard.rejoin([key])
            self.pull_codecs[state.serving].forget(key)
        state.serving = params
        if params is not None:
            if params not in self.pull_codecs:
                self.pull_codecs[params] = PullCodec(self.compressor(params))
            if self.updating:  # the updater's value apart from what workers hold
                self.shard.keep_apart([key])

    def serve(self, key, state, total=None) -> None:
        """After a round of `key`: move what its workers pull on by one payload (see
        `gpukv.encoding.pulls`), from the float32 `total` a round without an updater
        assigns (None: the value as stored) or from the updated value."""
        if state.serving is None:
            return
        codec = self.pull_codecs[state.serving]
        assigns = not self.updating
        value = self.shard.stored(key) if total is None or not assigns else total
        served = self.shard.served(key)
        with timeline.span("encode pulls", "server"):
            payload = codec.payload(key, value, served, assigns)
            codec.apply(payload, served, assigns)
            codec.settle(value, served, assigns, self.shard.settles_pulls())
        # kept for the workers whose copy is one round behind (a new array each round:
        # a send of the last may still be on its way)
        state.change = (state.version + 1, np.ascontiguousarray(payload).copy())

    def whole(self, incoming: _Incoming) -> np.ndarray:
        """The gradient a complete push carries (decompressed if it was compressed, its
        node partials merged if it has several, its leaves decoded and summed over
        the nodes they make alone)."""
        if incoming.comp is not None and incoming.nodes is not None:
            terms = self.leaf_terms([incoming])
            grad = own_sum(terms, incoming.nodes, incoming.count * self.workers)
            self.compressor(incoming.comp[0]).finish(grad)
            self.release([incoming.buffer])
            return grad
        if incoming.nodes is not None and incoming.rows > 1:
            rows = incoming.buffer.reshape(incoming.rows, -1)
            grad = own_sum(rows, incoming.nodes, incoming.count * self.workers)
            self.release([incoming.buffer])
            return grad
        if incoming.comp is None:
            return incoming.buffer
        grad = self.decode(incoming.comp, incoming.buffer)
        self.release([incoming.buffer])
        return grad

    def advance(self, key, state) -> None:
        """Apply what the pushes that arrived complete: in async mode each whole push,
        in sync mode each chunk every worker has sent, then each complete round."""
        if not state.initialised:
            return
        queues = state.queues
        before = (state.version, state.summed)
        if self.asynchronous:
            for q in queues:
                while q and q[0].complete:
                    with timeline.span("serve", "server", key=key):
                        self.serve_as(key, state, q[0].comp)
                        self.apply(key, state, [self.whole(q.popleft())])
        while not self.asynchronous and all(queues):
            heads = [q[0] for q in queues]
            same_counts(key, heads)
            if any(h.share for h in heads):
                if not all(h.complete for h in heads):
                    break
                with timeline.span("serve", "server", key=key):
                    self.serve_as(key, state, None)
                    self.assemble_shares(key, state, [q.popleft() for q in queues])
                continue
            if any(h.comp is not None for h in heads):
                if not all(h.complete for h in heads):
                    break
                with timeline.span("serve", "server", key=key):
                    if heads[0].count is not None:  # leaves' payloads, in canonical order
                        self.sum_leaves(key, state, [q.popleft() for q in queues])
                        continue
                    self.serve_as(key, state, heads[0].comp)
                    with self.shard.counted_as(told_num_update(key, heads)):
                        self.apply(key, state, [self.whole(q.popleft()) for q in queues])
            else:
                if state.serving is not None:  # compressed no more: its value served again
                    self.serve_as(key, state, None)
                if not self.chunk_ready(state, heads):
                    break
                with timeline.span("serve", "server", key=key):
                    whole = self.sum_chunks(key, state, heads)
                    if whole:
                        for q in queues:
                            q.popleft()
                        state.summed = state.summed_to = 0
                        self.finish_round(key, state, heads)
                if not whole:
                    break
        # the stall clock restarts only when the oldest round moved on
        if not any(queues):
            state.since = None
        elif state.since is None or (state.version, state.summed) != before:
            state.since = time.monotonic()

    def round_target(self, key, state) -> np.ndarray:
        """Where a round's sum of `key` goes (flat): the stored value itself without an
        updater, else the merge buffer the updater gets once the round is whole."""
        stored = self.shard.stored(key).reshape(-1)
        if not self.updating:
            return stored
        if state.merged is None:
            state.merged = np.empty(stored.size, accumulate_dtype(stored.dtype))
        return state.merged

    def assemble_shares(self, key, state, heads: list) -> None:
        """A round whose every worker sent its share of the whole sum (PushPiece.share):
        the shares laid end to end in worker order are the sum, which the updater gets,
        or which becomes the value."""
        same_shares(key, heads, self.shard.stored(key).size)
        target = self.round_target(key, state)
        at = 0
        for h in heads:
            target[at:at + h.buffer.size] = h.buffer
            at += h.buffer.size
        self.finish_round(key, state, heads)

    @staticmethod
    def chunk_ready(state, heads: list) -> bool:
        """Whether `sum_chunks` has a chunk to sum (or the round's sum is whole): the
        oldest round's next chunk has come from every worker."""
        return state.summed == len(heads[0].ranges) or all(
            h.ready(state.summed) for h in heads)

    def sum_chunks(self, key, state, heads: list) -> bool:
        """Sum, in worker order, each next chunk of the oldest round that every worker's
        push has; whether the round's every chunk is summed. Without an updater the sum
        lands in the stored value itself (a pull may send it at once), else in the merge
        buffer the updater gets once the round is whole."""
        ranges = heads[0].ranges
        if state.summed == len(ranges):
            return True
        target = self.round_target(key, state)
        first = state.summed
        while state.summed < len(ranges) and all(h.ready(state.summed) for h in heads):
            state.summed += 1
        if state.summed > first:
            lo, hi = ranges[first][0], ranges[state.summed - 1][1]
            state.summed_to = hi
            with timeline.span("sum", "server"):
                if heads[0].nodes is None:
                    host_sum(target[lo:hi], [h.buffer[lo:hi] for h in heads])
                else:  # every worker's node partials, merged as the canonical tree does
                    parts = [(node, row[lo:hi]) for h in heads for node, row in
                             zip(h.nodes, h.buffer.reshape(h.rows, -1))]
                    merge_into(target[lo:hi], parts, heads[0].count * self.workers,
                               self.scratch)
        return state.summed == len(ranges)

    def finish_round(self, key, state, heads: list) -> None:
        if self.updating:
            shape = self.shard.stored(key).shape
            with self.shard.counted_as(told_num_update(key, heads)):
                self.shard.update([key], [state.merged.reshape(shape)])
        state.version += 1
        self.release([h.buffer for h in heads])

    def apply(self, key, state, grads) -> None:
        stored = self.shard.stored(key)
        total = None
        if state.serving is not None and not self.updating and stored.dtype != np.float32:
            # what a compressed pull serves is the float32 sum, in worker order, as with
            # num_servers=0: the value stored in a 16-bit dtype is rounded, or inf
            total = np.array(grads[0], np.float32).reshape(-1)
            for g in grads[1:]:
                total += g.reshape(-1)
        self.shard.push(key, [g.reshape(stored.shape) for g in grads])
        self.serve(key, state, total)
        state.version += 1
        self.release(grads)

    def op_pull(self, worker, source, request: Pull) -> None:
        self.pulls.append(_Pull(worker, request.tag, request.wanted, request.changes))
        self.answer_pulls()

    def answer_pulls(self) -> None:
        """Send every pull what is ready of it: its keys in order, each key's chunks in
        order (the worker's receives match them so), a chunk of the round a pull waits
        for as soon as it is summed when no updater runs."""
        self.pulls = [p for p in self.pulls if not self.send_ready(p)]

    def send_ready(self, pull: _Pull) -> bool:
        """Send the chunks of `pull` that are ready; whether it is answered whole."""
        dest = self.worker_rank(pull.worker)
        while pull.key < len(pull.wanted):
            key, version = pull.wanted[pull.key]
            state = self.keys.get(key)
            if state is None or not state.initialised:
                return False
            if pull.changes and pull.changes[pull.key]:  # the round's payload alone
                if state.version < version:
                    return False
                self.send_change(key, state, version, dest, pull.tag)
                pull.key += 1
                continue
            value = self.shard.served(key).reshape(-1)
            ranges = chunk_ranges(value.size, value.itemsize, self.chunk)
            if self.asynchronous or state.version >= version:
                ready = len(ranges)
            elif state.version == version - 1 and not self.updating:
                # the round it waits for, summed this far: the chunks of the value (of
                # its dtype) that end within the elements summed (the pushes' chunks are
                # of the wire's, for a 16-bit key twice as wide)
                ready = bisect.bisect_right([hi for _, hi in ranges], state.summed_to)
            else:
                return False
            if self.asynchronous:  # the next push may change it before it is sent
                value = value.copy()
            while pull.chunk < ready:
                lo, hi = ranges[pull.chunk]
                self.send(self.t.send_array(value[lo:hi], dest, pull.tag), value)
                pull.chunk += 1
            if pull.chunk < len(ranges):
                return False
            pull.key, pull.chunk = pull.key + 1, 0
        return True

    def send_change(self, key, state, version: int, dest: int, tag: int) -> None:
        """Send the payload that moved `key`'s served value to `version` (the worker
        holds the version before: a sync round waits for each worker's push, so none
        can have gone further)."""
        if state.change is None or state.change[0] != version:
            have = "none" if state.change is None else f"version {state.change[0]}'s"
            raise PeerError(f"server rank {self.t.rank}: a pull of key {key!r} asks for "
                            f"the payload of version {version}, but the server kept {have}")
        payload = state.change[1]
        self.send(self.t.send_array(payload, dest, tag), payload)

    def op_settings(self, worker, source, request: Settings) -> None:
        """Worker 0 changed its optimizer's options: so does this server's."""
        self.shard.apply_settings(request.settings)

    def op_flush(self, worker, source, request: Flush) -> None:
        """Every earlier request of `worker` is done (requests of one worker are handled
        in order): say so."""
        self.reply(worker, "ok", request.tag)

    def op_set_optimizer(self, worker, source, request: SetOptimizer) -> None:
        loaded, optimizer = self._loaded(worker, request.optimizer)
        if loaded:
            self.shard.set_optimizer(optimizer)
            self.updating = True
            self.reply(worker, "ok")

    def op_set_updater(self, worker, source, request: SetUpdater) -> None:
        loaded, updater = self._loaded(worker, request.updater)
        if loaded:
            self.shard.set_updater(updater)
            self.updating = updater is not None
            self.reply(worker, "ok")

    def _loaded(self, worker, blob: bytes) -> tuple[bool, Any]:
        """(True, the object pickled in `blob`); (False, None) when this process cannot
        load it (a function the script defines after `gpukv.create`, which a server never
        passes), the error sent to `worker` as the reply: a refusal that changes nothing."""
        try:
            return True, pickle.loads(blob)
        except Exception as exc:
            self.reply(worker, f"{type(exc).__name__}: {exc}")
            return False, None

    def op_optimizer_state(self, worker, source, request: OptimizerState) -> None:
        """This server's optimizer state (None without one), each key's start marked."""
        starts = {k: s.spec[0] for k, s in self.keys.items() if s.initialised}
        self.reply(worker, mark_starts(self.shard.export_state(request.dump), starts))

    def op_write_snapshot(self, worker, source, request: WriteSnapshot) -> None:
        """Stage this server's pieces for a snapshot (written in the background), with
        the residuals of the pieces whose pulls the store's compression ("params")
        compresses (`engines.residuals`); the error of an earlier write that failed, or
        None."""
        params = request.part.get("params")
        items = []
        if params is not None:
            serving = tuple(sorted(params.items()))
            codec = self.pull_codecs.get(serving)
            for key, state in self.keys.items():
                found = None if codec is None else codec.feedback.residuals.get(key)
                if state.serving == serving and found is not None:
                    items.append(({"what": "pull", "key": key, "slot": [state.spec[0]]},
                                  found))
        self.reply(worker, self.shard.write_part(dict(request.part,
                                                      compression=(params, items))))

    def op_finish_snapshots(self, worker, source, request: FinishSnapshots) -> None:
        self.reply(worker, self.shard.finish_part())

    def op_check_state(self, worker, source, request: CheckState) -> None:
        """Check this server's part of a loaded state; kept for `op_restore`."""
        try:
            self.checked = (self.shard.check_state(request.state) if request.state
                            else None)
        except GpukvError as exc:
            self.reply(worker, str(exc) if isinstance(exc, CheckpointError)
                       else f"{type(exc).__name__}: {exc}")
            return
        self.reply(worker, None)

    def op_restore(self, worker, source, request: Restore) -> None:
        """Assign loaded values to their pieces and install the checked state."""
        for key, piece in request.values.items():
            self.shard.assign(key, piece)
        if self.checked is not None:
            self.shard.apply_state(self.checked)
        self.checked = None
        self.reply(worker, "ok")

    def op_restore_compression(self, worker, source, request: RestoreCompression) -> None:
        """Put back the pull residuals and served values of this server's pieces, and
        serve them compressed as before the snapshot (every worker checked the file)."""
        try:
            saved = snapshots.read_compression(
                request.path, snapshots.shard_file(request.index, request.count))
        except CheckpointError as exc:
            self.reply(worker, str(exc))
            return
        params = request.params
        if not self.compressor(params).compresses_pulls:
            self.reply(worker, None)
            return
        codec = self.pull_codecs.get(params)
        if codec is None:
            codec = self.pull_codecs[params] = PullCodec(self.compressor(params))
        for record, array in zip(saved.records, saved.arrays):
            key = record["key"]
            state = self.keys[key]
            if record["what"] == "pull":
                np.copyto(codec.feedback.residual(key, array.size), array.reshape(-1))
            elif record["what"] == "served":
                self.shard.keep_apart([key])
                served = self.shard.served(key)
                served.reshape(-1)[...] = array.reshape(-1)
            state.serving, state.change = params, None
        self.reply(worker, None)

    def op_reset_compression(self, worker, source, request: ResetCompression) -> None:
        """Every key served compressed is served its value again, its residual afresh
        (the payload of its last round stays, for a worker a round behind)."""
        for key, state in self.keys.items():
            if state.serving is not None:
                self.shard.rejoin([key])
                self.pull_codecs[state.serving].forget(key)
                state.serving = None
        self.reply(worker, "ok")

    def reply(self, worker, obj, tag: int = TAG_REPLY) -> None:
        self.send(self.t.send_object(obj, self.worker_rank(worker), tag))

    # ------------------------------------------------------------------ failures
    def check_stalls(self, now: float) -> None:
        if self.failure is not None:
            return
        # An init some worker never made holds up that worker's requests after it, so
        # its keys are named first: the key at fault, not one waiting behind it.
        in_order = sorted(self.keys.items(), key=lambda item: item[1].initialised)
        ended = self.ended_workers(now)
        for key, state in in_order:
            if state.since is None:
                continue
            if not state.initialised:
                came = sorted(state.inits)
                what = "init"
            else:  # a push whose data stopped arriving is one that did not come
                came = [w for w, q in enumerate(state.queues) if q and q[0].complete]
                what = "push"
            late = [w for w in range(self.workers) if w not in came]
            gone = [w for w in late if w in ended]
            if gone:  # (it will never come: no need to wait out the timeout)
                why = (f"worker(s) {', '.join(map(str, gone))} ended (reached the "
                       f"program's end or sys.exit) without making it")
            elif now - state.since > self.t.timeout:
                why = (f"worker(s) {', '.join(map(str, late))} did not {what} it within "
                       f"{self.t.timeout:g} s (GPUKV_DIST_TIMEOUT)")
            else:
                continue
            self.fail(PeerError(f"{what} of key {key!r}: {why}; worker(s) "
                                f"{', '.join(map(str, came)) or 'none'} did"))
            return

    def ended_workers(self, now: float) -> set:
        """The workers whose word that their program ended came at least `ENDED_GRACE`
        seconds ago (a quarter of the timeout at most): their last messages, sent before
        it on another communicator, may overtake it by a little."""
        grace = min(ENDED_GRACE, self.t.timeout / 4)
        for w in range(self.workers):
            if w not in self.ended_since and job_exit.ended(self.worker_rank(w)):
                self.ended_since[w] = now
        return {w for w, since in self.ended_since.items() if now - since >= grace}

    def fail(self, error: PeerError) -> None:
        """Tell every worker, and answer everything from now on with the same failure
        (which says how its worker numbers map to the job's ranks, which `gpukv run`'s
        lines name: the servers are the first ranks)."""
        if "worker" in str(error):
            error = type(error)(f"{error} (worker W is rank {self.servers}+W of the job)")
        self.failure = error
        for w in range(self.workers):
            self.tell(w, error)

    def tell(self, worker: int, error: PeerError) -> None:
        """Send `error` to `worker` (as its kind and message: `client.reported` rebuilds it)."""
        report = ("mismatch" if isinstance(error, PeerMismatchError) else "peer", str(error))
        self.send(self.t.send_object(report, self.worker_rank(worker), TAG_ERROR))


def told_num_update(key, heads: list) -> dict:
    """{key: the num_update its update in the round of `heads` takes}: the largest any
    worker counted (workers that make the same calls count alike; workers that group
    keys into calls otherwise differ, and the count furthest on wins), or {} where
    none told one (no optimizer on the workers' side, or dist_async)."""
    told = [h.num_update for h in heads if h.num_update is not None]
    return {key: max(told)} if told else {}


def same_counts(key, heads: list) -> None:
    """PeerMismatchError unless every worker pushed the same count of values of `key`
    in the round of `heads` (None: a push of one sum, not of node partials)."""
    counts = [h.count for h in heads]
    if len(set(counts)) == 1:
        return
    by_count: dict = {}
    for w, count in enumerate(counts):
        by_count.setdefault(count, []).append(w)
    told = "; ".join(f"worker(s) {', '.join(map(str, ws))}: "
                     + ("one sum, not node partials" if count is None else
                        f"{count} value(s)") for count, ws in by_count.items())
    raise PeerMismatchError(f"push of key {key!r}: workers pushed different numbers of "
                            f"values, where the canonical order needs the same: {told}")


def same_shares(key, heads: list, size: int) -> None:
    """PeerMismatchError unless every worker sent a share of `key`'s whole sum in the round
    of `heads`, the shares together its piece's `size` elements."""
    if all(h.share for h in heads) and sum(h.buffer.size for h in heads) == size:
        return
    told = "; ".join(
        f"worker {w}: " + (f"a share of {h.buffer.size} of the whole sum" if h.share
                           else "a sum of its own")
        for w, h in enumerate(heads))
    raise PeerMismatchError(f"push of key {key!r}: workers pushed it differently ({size} "
                            f"elements here): {told}")


def same_compression(key, heads: list) -> None:
    """PeerMismatchError unless every worker compressed `key` alike in the round of
    `heads` (pushes of leaves' payloads)."""
    kinds = [None if h.comp is None else dict(h.comp[0]) for h in heads]
    if all(k == kinds[0] for k in kinds):
        return
    by_kind: dict = {}
    for w, kind in enumerate(kinds):
        by_kind.setdefault(repr(kind), []).append(w)
    told = "; ".join(f"worker(s) {', '.join(map(str, ws))}: "
                     + ("no compression" if kind == "None" else kind)
                     for kind, ws in by_kind.items())
    raise PeerMismatchError(f"push of key {key!r}: workers compressed it differently: "
                            f"{told}")


def serve(transport: Transport, servers: int, shard: Shard, asynchronous: bool) -> None:
    """Run a server until every worker has stopped (its `create` then exits)."""
    worker_comm(transport, servers)
    _Server(transport, servers, shard, asynchronous).run()

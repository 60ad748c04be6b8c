"""A worker's end of the dedicated servers (`num_servers=S >= 1`): the engine of a dist store
on the worker ranks. It sends each piece of a key to its server (see `server` for what the
servers do with them) and waits, each wait bounded, for their replies; a failure a server
reports ends the wait at once. A deterministic client sends each piece's node partials of
the canonical tree (`engine.Partials`), a row each, and their count: the server merges
them as the tree does. A key it compresses goes as each of its values' payloads (of
`engine.Leaves`, each compressed with its own residual), a row each, and their count:
the server decodes and sums every worker's leaves as one process does. A key a low-rank
compressor sums (PowerSGD's matrices) goes as this worker's share of the sum the workers
made together (`low_rank`): the server lays the shares end to end.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import pickle

import numpy as np

from ..._errors import ArgumentError, CheckpointError, PeerError, PeerMismatchError
from ...encoding.compressors import (
    Compressor,
    ErrorFeedback,
    compresses_key,
    compressible,
    make_compressor,
)
from ...encoding.pulls import PullCodec
from ...layout.state import cut, merge, update_counts
from ...optim._state import take_saved
from ..mpi.agree import optimizer_named, refuse_split
from ..mpi.chunks import chunk_bytes, chunk_ranges
from ..mpi.transport import (
    TAG_DATA,
    TAG_ERROR,
    TAG_PUSH_DATA,
    TAG_REPLY,
    TAG_REQUEST,
    Transport,
    worker_comm,
)
from . import low_rank, residuals
from .control import WorkerControl
from .layout import KeyLayout
from .partials import check_partials
from .requests import (
    CheckState,
    FinishSnapshots,
    Flush,
    Init,
    InitPiece,
    OptimizerState,
    Pull,
    Push,
    PushPiece,
    ResetCompression,
    Restore,
    RestoreCompression,
    SetOptimizer,
    Settings,
    SetUpdater,
    Stop,
    WriteSnapshot,
)
from .update_order import UpdateOrder

#: reply tags cycle through this many values above TAG_DATA (MPI guarantees tags up to
#: 32767 at least)
_REPLY_TAGS = 30000


def in_chunks(arrays, chunk: int) -> list:
    """The chunks of `chunk` bytes each of `arrays` crosses in (see `chunks`), in order;
    a 2-D array (node partials, a row each) chunk by chunk of its rows, each row's in turn."""
    out = []
    for a in arrays:
        rows = [a] if a.ndim == 1 else list(a)
        for lo, hi in chunk_ranges(a.shape[-1], a.itemsize, chunk):
            out += [row[lo:hi] for row in rows]
    return out


def reported(report) -> PeerError:
    """The error a server's `tell` sent (as its kind and message)."""
    kind, message = report
    return (PeerMismatchError if kind == "mismatch" else PeerError)(message)


class ServerClient:
    """A worker's end of the dedicated servers: the engine of a dist store with S >= 1
    (an `engine.Engine`)."""

    #: pulls fetch the values; a push leaves this process's copies as they are
    round_updates_replicas = False
    compressor: Compressor | None
    control: WorkerControl

    def __init__(self, transport: Transport, servers: int, bound: int,
                 deterministic: bool = False, asynchronous: bool = False):
        self.t = transport
        self.asynchronous = asynchronous  # a pull gets whatever the value is by then
        self.servers = servers
        self.deterministic = deterministic  # push gets Partials, merged as the tree does
        self.bound = bound
        self.chunk = chunk_bytes(transport)  # the servers cut the pieces alike
        self.workers = Transport(worker_comm(transport, servers), transport.timeout,
                                 transport.local_size, first_rank=servers)
        self.control = WorkerControl(self.workers, self._settle, self._drain, self._reported)
        self.agree = self.control.agree
        self.layouts: dict = {}     # key -> KeyLayout
        self.pushes: dict = {}      # key -> pushes this worker made
        # Compressed pulls (sync only): key -> the version of the served value its copy
        # holds (None: unknown), and how its last push was served (the compressor and
        # whether an updater ran), for a pull to ask for the payload of one round.
        self.held: dict = {}
        self.served_by: dict = {}
        # key -> the push whose low-rank sum, the key's value then, was decoded into its
        # copy (PowerSGD without an updater): a pull of that round fetches nothing
        self.decoded: dict = {}
        self.updating = False       # an optimizer or updater runs on the servers
        # the optimizer the servers run, whose copy here counts every key of a sync
        # push as one process does: each piece tells its server the num_update its
        # key's update takes (see `update_order`)
        self._optimizer = None
        self._order = UpdateOrder()
        self.compressor = None
        self.feedback: ErrorFeedback | None = None  # residuals per (key, piece start[, value])
        self._tags = itertools.count()
        self._unsettled: list = []  # (server, reply tag, first key) of inits not answered
        self._sent_settings = None  # the optimizer options the servers have
        self._stopped = False
        import atexit
        atexit.register(self.stop)

    @property
    def rank(self) -> int:
        return self.workers.rank

    def _reported(self) -> None:
        """Raise a failure the job's transport met, or one a server reported since."""
        self.t.check()
        self._raise_reported()

    def _raise_reported(self, requests=()) -> None:
        """Raise the failure a server reported, if one did (cancelling `requests`)."""
        error = self.t.try_recv_object(self.t.MPI.ANY_SOURCE, TAG_ERROR)
        if error is not None:
            for r in requests:
                self.t.cancel(r)
            raise self.t.fail(reported(error[0]))

    def _request(self, server: int, request, data=()) -> list:
        """Start sending `request` (of `requests`) and its raw arrays to `server`; their
        MPI requests."""
        t = self.t
        requests = [t.send_object((self.rank, request), server, TAG_REQUEST)]
        requests += [t.send_array(a, server, TAG_PUSH_DATA) for a in data]
        return requests

    def _wait(self, requests, what: str) -> None:
        """Complete `requests`, failing at once if a server reports a failure."""
        t = self.t

        def done():
            if t.done(requests, what):
                return True
            self._raise_reported(requests)
            return None
        t.poll(done, what, timeout=t.timeout * 1.5 + 1,
               on_timeout=lambda: PeerError(f"worker {self.rank}: {what}: no answer from the "
                                            f"server(s) within {t.timeout * 1.5 + 1:g} s"))

    def _reply(self, server: int, what: str, tag: int = TAG_REPLY):
        """The next reply of `server` (on `tag`), failing at once on a reported failure."""
        t = self.t

        def arrived():
            got = t.try_recv_object(server, tag)
            if got is None:
                self._raise_reported()
            return got
        reply, _ = t.poll(arrived, what, timeout=t.timeout * 1.5 + 1)
        return reply

    # ------------------------------------------------------------------- calls
    def check_new_keys(self, keys: list, values: list) -> None:
        """What the optimizer set refuses of keys about to be made (`refuse_split`)."""
        refuse_split(self._optimizer, {k: KeyLayout.of(k, v.shape, v.dtype, self.servers,
                                                       self.bound)
                                       for k, v in zip(keys, values)}, "servers")

    def refused_keys(self, op: str, error: Exception) -> bool:
        """Nothing to tell: the inits go to the servers, which name a worker's that
        never came once the timeout has passed."""
        return False

    def init(self, keys, replicas) -> None:
        """Send the keys to their servers (worker 0 with its values); the servers agree
        on them once every worker has sent them, in whatever order."""
        self.control.check()
        if not keys:
            return
        self._order.made(keys)
        by_server: dict = collections.defaultdict(lambda: ([], []))
        for key, value in zip(keys, replicas):
            layout = self.layouts[key] = KeyLayout.of(key, value.shape, value.dtype,
                                                      self.servers, self.bound)
            self.pushes[key] = 0
            self.held[key] = None  # worker 0's value may not be this copy's
            flat = value.reshape(-1)
            for p in layout.pieces:
                made, data = by_server[p.server]
                made.append(InitPiece(key, p.start, p.stop, value.shape, value.dtype))
                if self.rank == 0:
                    data.append(np.ascontiguousarray(flat[p.start:p.stop]))
        requests = []
        for server, (made, data) in by_server.items():
            tag = self._tag()
            requests += self._request(server, Init(tag, made, [a.nbytes for a in data]),
                                      [a.view(np.uint8) for a in data])
            self._unsettled.append((server, tag, keys[0]))
        self._wait(requests, f"init of key {keys[0]!r}")

    def _tag(self) -> int:
        return TAG_DATA + next(self._tags) % _REPLY_TAGS

    def _settle(self, during: str) -> None:
        """Wait until the servers made every key this worker created: they answer once
        all workers have sent theirs (a mismatch between workers is raised here); the
        first step of the call `during` names (and its errors name it)."""
        self.control.check()
        while self._unsettled:
            server, tag, key = self._unsettled[0]
            self._reply(server, f"{during}: first the keys made before it (init of key "
                                f"{key!r}): waiting for every worker's init", tag)
            self._unsettled.pop(0)

    def push(self, keys, grads, replicas) -> None:
        counts = None
        if self.deterministic:  # checked whole before anything moves
            layouts = [self.layouts[k] for k in keys]
            counts = check_partials(keys, grads, [(lay.size, lay.dtype) for lay in layouts],
                                    self.rank, self.workers.size,
                                    [compresses_key(self.compressor, lay.dtype, lay.shape)
                                     for lay in layouts])
        self._settle(f"push of key {keys[0]!r}" if keys else "push")
        if not keys:
            return
        with self._counted(keys) as num_updates:
            self._push(keys, grads, replicas, counts, num_updates)

    def _counted(self, keys) -> contextlib.AbstractContextManager[dict]:
        """Around a sync push of `keys` with an optimizer on the servers: its copy here
        counts them as one process does, and yields {key: the num_update its update
        takes}, which the pieces carry to their servers; else {} (nothing told: in
        dist_async each push is counted where it is applied)."""
        if self._optimizer is None or self.asynchronous:
            return contextlib.nullcontext({})
        return self._optimizer.counting_round(self._order.of(keys))

    def _push(self, keys, grads, replicas, counts, num_updates: dict) -> None:
        by_server: dict = collections.defaultdict(lambda: ([], []))
        shares = self._low_rank_shares(keys, grads, replicas, by_server, counts,
                                       num_updates)
        if counts is not None:
            self._push_partials(keys, grads, counts, shares, by_server, num_updates)
            return
        for key, grad in zip(keys, grads):
            if key in shares:
                continue
            layout = self.layouts[key]
            flat = grad.reshape(-1)
            for p in layout.pieces:
                entries, data = by_server[p.server]
                piece = flat[p.start:p.stop]
                comp = None
                if self._compresses(layout):
                    piece, comp = self._compress(key, p, piece)
                piece = np.ascontiguousarray(piece)
                entries.append(PushPiece(key, piece.dtype, piece.size, comp,
                                         num_update=num_updates.get(key)))
                data.append(piece)
            self._pushed(key, layout)
        requests = []
        for server, (entries, data) in by_server.items():
            requests += self._request(server, Push(entries), in_chunks(data, self.chunk))
        self._wait(requests, f"push of key {keys[0]!r}")

    def _low_rank_shares(self, keys, grads, replicas, by_server: dict,
                         counts: list | None = None, num_updates: dict | None = None) -> set:
        """The keys a low-rank compressor sums (PowerSGD's matrices): their sums, made by
        the workers together (`low_rank.sums`; with `counts`, each key's values per
        worker, a deterministic push of `Leaves`), each worker's share of every piece
        queued in `by_server` (with its key's num_update of `num_updates`); the set of
        those keys. Without an updater on the servers
        each sum is the key's new value, which this worker then holds: it is decoded
        into the key's copy (`replicas`), and the pull of this round fetches nothing."""
        comp = self.compressor
        if comp is None or not comp.low_rank:
            return set()
        per_key = counts if counts is not None else [None] * len(keys)
        chosen = sorted(((key, self.layouts[key], grad, replica, count)
                         for key, grad, replica, count in zip(keys, grads, replicas, per_key)
                         if self._low_rank(self.layouts[key])), key=lambda c: c[0])
        if not chosen:  # no sums among the workers: the push is the servers' alone
            return set()
        what = f"push of key {keys[0]!r}"
        # every worker must take part in the allreduces of the same keys (in key order,
        # whatever the order of the call)
        self.agree.check(("low-rank push", tuple((c[0], c[1].shape, np.dtype(c[1].dtype).name)
                                                 for c in chosen)), what)
        holds = not self.updating
        totals = low_rank.sums(self.agree, comp, self.feedback,
                               [(c[0], c[1]) for c in chosen], [c[2] for c in chosen],
                               [c[3] if holds else None for c in chosen], what,
                               None if counts is None else [c[4] for c in chosen])
        rank, workers = self.rank, self.workers.size
        for (key, layout, *_), total in zip(chosen, totals):
            flat = total.reshape(-1)
            for p in layout.pieces:
                entries, data = by_server[p.server]
                n = p.stop - p.start
                lo, hi = p.start + n * rank // workers, p.start + n * (rank + 1) // workers
                entries.append(PushPiece(key, flat.dtype, hi - lo, share=True,
                                         num_update=(num_updates or {}).get(key)))
                data.append(flat[lo:hi])
            self._pushed(key, layout)
            if holds:  # its copy holds this round's value, as the servers store it
                self.held[key] = self.decoded[key] = self.pushes[key]
        return {c[0] for c in chosen}

    def _low_rank(self, layout) -> bool:
        """Whether a key of `layout` is summed by the low-rank compressor set."""
        comp = self.compressor
        return (comp is not None and comp.low_rank
                and compresses_key(comp, layout.dtype, layout.shape))

    def _push_partials(self, keys, grads, counts: list, shares: set,
                       by_server: dict, num_updates: dict) -> None:
        """Send each piece's rows of this worker's node partials (or of its leaves'
        payloads, for a key it compresses), and their `counts` (the servers check every
        worker pushed the same), beside what `by_server` holds: the `shares` of the
        keys a low-rank compressor summed. Each piece carries its key's num_update of
        `num_updates`."""
        for key, grad, count in zip(keys, grads, counts):
            if key in shares:
                continue
            layout = self.layouts[key]
            for p in layout.pieces:
                entries, data = by_server[p.server]
                if self._compresses(layout):
                    rows = [self._compress(key, p, grad.values[j, p.start:p.stop], j)
                            for j in range(count)]
                    payloads = np.stack([payload for payload, _ in rows])
                    entries.append(PushPiece(key, payloads.dtype, payloads.shape[1],
                                             rows[0][1], count,
                                             num_update=num_updates.get(key)))
                    data.append(payloads)
                    continue
                sums = grad.sums[:, p.start:p.stop]  # rows cross one by one
                entries.append(PushPiece(key, sums.dtype, sums.shape[1], None, count,
                                         num_update=num_updates.get(key)))
                data.append(sums)
            self._pushed(key, layout)
        requests = []
        for server, (entries, data) in by_server.items():
            requests += self._request(server, Push(entries), in_chunks(data, self.chunk))
        self._wait(requests, f"push of key {keys[0]!r}")

    def _pushed(self, key, layout) -> None:
        """Count a push of `key`, and say how its round is served: compressed pulls
        (the compressor and whether an updater runs), or None."""
        self.pushes[key] += 1
        comp = self.compressor
        both = (not self.asynchronous and comp is not None and comp.compresses_pulls
                and compressible(layout.dtype))
        self.served_by[key] = (comp, self.updating) if both else None

    def _compresses(self, layout) -> bool:
        """Whether a key of `layout` is compressed on the wire, payload by payload (a
        low-rank compressor's keys cross as shares of their sums, or as they are)."""
        comp = self.compressor
        return comp is not None and not comp.low_rank and compressible(layout.dtype)

    def _compress(self, key, piece, grad, leaf: int | None = None):
        """(payload, (params, elements)) of one piece of a key (of its `leaf`-th value,
        whose residual is its own, in a deterministic push)."""
        feedback = self.feedback
        assert feedback is not None  # only a key it compresses comes here
        slot = (key, piece.start) if leaf is None else (key, piece.start, leaf)
        payload, ctx = feedback.compress(slot, grad)
        return payload, (tuple(sorted(feedback.compressor.params().items())), ctx.size)

    def pull(self, keys, replicas) -> None:
        self._settle(f"pull of key {keys[0]!r}" if keys else "pull")
        if not keys:
            return
        t = self.t
        by_server: dict = collections.defaultdict(lambda: ([], []))
        requests = []
        tags: dict = {}
        changes = []  # (payload buffer, piece of the copy, how it was served)
        for key, replica in zip(keys, replicas):
            if self.decoded.get(key) == self.pushes[key] == self.held[key]:
                continue  # its copy holds the round's low-rank sum, decoded here
            flat = replica.reshape(-1)
            served = self.served_by.get(key)
            if self.held[key] != self.pushes[key] - 1:
                served = None  # the copy missed more than a round, or is unknown
            for p in self.layouts[key].pieces:
                tag = tags.get(p.server)
                if tag is None:
                    tag = tags[p.server] = self._tag()
                wanted, asked = by_server[p.server]
                wanted.append((key, self.pushes[key]))
                asked.append(served is not None)
                if served is not None:  # one payload moves this copy on by the round
                    dtype, nbytes = served[0].payload_format(p.stop - p.start)
                    payload = np.empty(nbytes, np.uint8)
                    requests.append(t.recv_array(payload, p.server, tag))
                    changes.append((payload.view(dtype), flat[p.start:p.stop], served))
                    continue
                requests += [t.recv_array(chunk, p.server, tag)
                             for chunk in in_chunks([flat[p.start:p.stop]], self.chunk)]
        for server, (wanted, asked) in by_server.items():
            requests += self._request(server, Pull(tags[server], wanted, asked))
        self._wait(requests, f"pull of key {keys[0]!r}")
        for payload, piece, (comp, updating) in changes:
            PullCodec(comp).apply(payload, piece, assigns=not updating)
        for key in keys:
            self.held[key] = self.pushes[key]

    def set_optimizer(self, optimizer) -> None:
        """Worker 0's optimizer goes to the servers (every worker's must agree)."""
        self._settle("set_optimizer")
        self.agree.check((f"set_optimizer({optimizer_named(optimizer.name, optimizer.settings())})",
                          ()), "set_optimizer")
        refuse_split(optimizer, self.layouts, "servers")
        self._to_servers(SetOptimizer(pickle.dumps(optimizer)), "set_optimizer")
        self.updating = True
        self._optimizer = optimizer  # (its counts went with it)
        self._sent_settings = optimizer.settings()

    def follow(self, optimizer) -> None:
        """Send worker 0's optimizer options to the servers when they changed (before
        its next push, which they handle after them)."""
        if self.rank != 0:
            return
        settings = optimizer.settings()
        if settings != self._sent_settings:
            requests = []
            for server in range(self.servers):
                requests += self._request(server, Settings(settings))
            self._wait(requests, "sending the optimizer's options")
            self._sent_settings = settings

    def refused(self, op: str, error: Exception) -> None:
        """Pushes to servers are no collective call: nothing to agree on (docs/limits.md
        says what a push refused on one worker alone does)."""

    def set_updater(self, updater) -> None:
        try:
            blob = pickle.dumps(updater)
        except Exception as exc:
            raise ArgumentError(f"updater {updater!r}: the servers run it, so it must pickle "
                                f"(a function defined at module level): {exc}") from exc
        self._to_servers(SetUpdater(blob), "set_updater")
        self.updating = updater is not None
        self._optimizer = None

    def _to_servers(self, request, what: str) -> None:
        """Worker 0 sends `request` to every server, after every worker's earlier pushes;
        every worker returns once all servers have it."""
        op = request.command.value
        self._flush_servers(what, op=op)
        refused = None
        if self.rank == 0:
            requests = []
            for server in range(self.servers):
                requests += self._request(server, request)
            self._wait(requests, what)
            for server in range(self.servers):
                reply = self._reply(server, what)
                if reply != "ok" and refused is None:
                    refused = reply
        refused = self.control.share(refused, what)  # every worker raises alike
        if refused is not None:
            raise ArgumentError(
                f"{what}: the servers cannot load what worker 0 sent ({refused}); a server "
                f"runs the script only up to gpukv.create, so define the function or class "
                f"at module level before gpukv.create, or in a module the script imports")
        self.agree.check((op + " done", ()), what)

    def set_compression(self, compressor) -> None:
        low_rank.refuse(compressor, self.asynchronous)
        # the servers' pull residuals start afresh too, whatever the compression was
        self._to_servers(ResetCompression(), "set_gradient_compression")
        self.compressor = compressor
        self.decoded.clear()
        self.feedback = ErrorFeedback(compressor) if compressor is not None else None

    @property
    def pending(self) -> bool:
        """Keys are sent to the servers as they are made: none waits here."""
        return False

    def _drain(self, what: str) -> None:
        """Return once this worker's earlier requests are handled by every server
        (requests of one worker are handled in order; in dist_async too: each server
        answers a flush after the pushes before it)."""
        tags = {server: self._tag() for server in range(self.servers)}
        requests = []
        for server, tag in tags.items():
            requests += self._request(server, Flush(tag))
        self._wait(requests, what)
        for server, tag in tags.items():
            self._reply(server, f"{what}: waiting for the servers", tag)

    def _flush_servers(self, what: str, op: str = "flush") -> None:
        """Return once every worker's earlier requests are handled by every server: each
        worker drains its own, then the workers agree on `op`."""
        self._settle(what)
        self._drain(what)
        self.agree.check((op, ()), what)

    def call_servers(self, request_for) -> list:
        """Send every server its request (request_for(server)) and return their replies."""
        self.control.check()
        requests, what = [], ""
        for server in range(self.servers):
            request = request_for(server)
            what = request.command.value
            requests += self._request(server, request)
        self._wait(requests, what)
        return [self._reply(server, what) for server in range(self.servers)]

    # ------------------------------------------------------------- checkpoints
    def optimizer_state(self, dump: bool):
        """Every server's optimizer state merged, on worker 0 (None elsewhere, and
        without an optimizer)."""
        self._flush_servers("saving the optimizer state")
        if self.rank != 0:
            return None
        exports = self.call_servers(lambda server: OptimizerState(dump))
        return merge(exports, {k: layout.shape for k, layout in self.layouts.items()})

    def restore(self, values: dict, state) -> None:
        """Load `values` ({key: full array}) and the optimizer `state` ((header, arrays)
        of the whole store, or None) onto the servers: every part is checked on its
        server first; any failure changes nothing and raises CheckpointError everywhere.
        This worker's copy of the optimizer takes the state's update counts, which it
        goes on counting for the servers, and the options, multipliers and schedule the
        state holds (saved with `dump_optimizer`), as the servers' optimizers do."""
        self._flush_servers("load")
        self.agree.check(("restore", tuple(sorted(values))), "load")
        outcome = None
        if self.rank == 0:
            sizes = {k: layout.size for k, layout in self.layouts.items()}
            errors = self.call_servers(lambda server: CheckState(
                None if state is None else cut(state, server, self.servers, self.bound,
                                               sizes)))
            outcome = next((e for e in errors if e is not None), None)
            if outcome is None:
                self.call_servers(lambda server: Restore({
                    key: value.reshape(-1)[p.start:p.stop]
                    for key, value in values.items()
                    for p in self.layouts[key].served_by(server)}))
        outcome = self.control.share(outcome, "load")
        if outcome is not None:
            raise CheckpointError(outcome)
        optimizer = self._optimizer
        if state is not None and optimizer is not None:  # what the servers took
            counts, num_update, _ = update_counts(state)
            take_saved(optimizer, state[0], counts, num_update)
            self._sent_settings = optimizer.settings()  # (the servers have them)
        for key in values:  # the next pull brings the loaded value whole
            self.held[key] = None

    # --------------------------------------------------------------- snapshots
    def write_snapshot(self, request: dict) -> str | None:
        """Each server writes the pieces it serves (shard `server` of `servers`), once
        every worker's earlier pushes are applied; worker 0 asks them."""
        self._flush_servers("snapshot")
        error = None
        if self.rank == 0:
            comp = self.compressor
            errors = self.call_servers(lambda server: WriteSnapshot(dict(
                request, index=server, count=self.servers,
                params=None if comp is None else comp.params(), pieces={
                    key: (p.start, p.stop, layout.shape) for key, layout
                    in self.layouts.items() for p in layout.served_by(server)})))
            error = next((e for e in errors if e is not None), None)
        return self.control.share(error, "snapshot")

    def finish_snapshots(self) -> str | None:
        error = None
        if self.rank == 0:
            errors = self.call_servers(lambda server: FinishSnapshots())
            error = next((e for e in errors if e is not None), None)
        return self.control.share(error, "finishing the snapshots")

    # ------------------------------------------------------ compression state
    # (see `residuals`): each worker's residuals in its worker file; each server's pull
    # residuals and served values in its shard file.
    def worker_compression(self) -> tuple | None:
        """(params, [(record, live array)]) of this worker's compression state."""
        return residuals.worker_items(self.compressor, self.feedback)

    def restore_compression(self, found, replica) -> list:
        """After a resume loaded the snapshot `found`: put back every worker's residuals
        and every server's pull residuals and served values when they fit (see
        `residuals.saved`), else start them afresh and say why at INFO, alike on every
        worker. The next pull brings each served value whole: no copy changes here."""
        self._settle("resume")
        comp = self.compressor
        mine = None if comp is None else comp.params()
        if comp is not None:  # afresh, whatever follows
            self.set_compression(make_compressor(mine))
        reason, state = residuals.saved(found, mine, self.rank, self.workers.size,
                                        self.servers, self.layouts)
        agreed = self.control.alike(reason, "resume: the compression state")
        if agreed is not None:
            if agreed:
                residuals.log.info(residuals.NOT_RESTORED, agreed)
            return []
        assert state is not None and mine is not None  # it fits
        residuals.restore_worker(state.worker, self.compressor, self.feedback)
        error = None
        if self.rank == 0:
            params = tuple(sorted(mine.items()))
            errors = self.call_servers(lambda server: RestoreCompression(
                found.path, server, self.servers, params))
            error = next((e for e in errors if e is not None), None)
        error = self.control.share(error, "resume: the compression state")
        if error is not None:
            raise CheckpointError(error)
        return []

    def stop(self) -> None:
        """Tell the servers this worker is done (at exit; once)."""
        if self._stopped or self.t.failure is not None:
            return
        self._stopped = True
        try:
            requests = []
            for server in range(self.servers):
                requests += self._request(server, Stop())
            # settle: a wait that may end short without failing the transport (a failure
            # recorded now would abort the job at exit)
            self.t.settle(requests, 10)
        except PeerError:
            pass  # the servers are gone already: nothing is waiting for this worker

"""`num_servers=S >= 1`: the first S processes serve, the others are workers (MXNet's layout);
this is the servers' side (`client.ServerClient` is the workers').

A worker sends each piece of a key (see `sharding`) to its server: a small pickled request,
then the raw bytes. The server keeps, per key, a queue of pushed gradients per worker. In
sync mode a round completes when every worker has one queued: their sum goes to the updater
once, and the key's version goes up; a pull names the version it needs (the number of its
worker's pushes of that key) and is answered when the key has reached it. In async mode each
push is applied as it comes. Nothing waits without a bound: a key whose round misses some
workers for the timeout fails on the server, which tells every worker which ones.
"""
from __future__ import annotations

import collections
import itertools
import pickle
import time

import numpy as np

from .._errors import CheckpointError, GpukvError, PeerError, PeerMismatchError
from ..encoding.compression import make_compressor
from .engine import Shard
from .state import mark_starts
from .transport import TAG_ERROR, TAG_PUSH_DATA, TAG_REPLY, TAG_REQUEST, Transport, worker_comm


class _Key:
    """What a server knows of one key (its piece of it)."""

    def __init__(self, workers: int):
        self.inits: dict = {}          # worker -> (start, stop, shape, dtype)
        self.initialised = False
        self.version = 0
        self.queues: list = [collections.deque() for _ in range(workers)]
        self.since = None              # when the oldest incomplete round began
        self.spec = None               # (start, stop, shape, dtype)


class _Server:
    def __init__(self, transport: Transport, servers: int, shard: Shard, asynchronous: bool):
        self.t = transport
        self.servers = servers
        self.workers = transport.size - servers
        self.shard = shard
        self.asynchronous = asynchronous
        self.keys: dict = {}
        self.pulls: list = []          # (worker, tag, [(key, version)]) not answered yet
        self.sending: list = []        # (request, buffer kept alive)
        self.stopped: set = set()
        self.failure: PeerError | None = None
        self.compressors: dict = {}
        self.checked = None            # the state plan op_check_state made
        self.init_waits: list = []     # (worker, reply tag, keys) of inits not answered
        self.free: dict = {}           # (dtype, size) -> push buffers to reuse

    def worker_rank(self, w: int) -> int:
        return self.servers + w

    def run(self) -> None:
        t = self.t
        last_check = last_message = time.monotonic()
        pause = t.pacer()
        while len(self.stopped) < self.workers:
            message = t.try_recv_object(t.MPI.ANY_SOURCE, TAG_REQUEST)
            if message is not None:
                self.handle(*message)
                last_message = time.monotonic()
                pause = t.pacer()
                continue
            self.sending = [(r, b) for r, b in self.sending
                            if not t.done([r], "sending replies")]
            now = time.monotonic()
            if now - last_check > min(1.0, t.timeout / 4):
                last_check = now
                self.check_stalls(now)
            pause(now - last_message)  # idle a while: a server costs little
        t.wait_all([r for r, _ in self.sending], "sending the last replies")

    # ---------------------------------------------------------------- requests
    def handle(self, request, source: int) -> None:
        op, worker, body = request
        if op == "stop":
            self.stopped.add(worker)
            return
        if self.failure is not None:
            self.receive_data(source, body if op in ("init", "push") else None)
            self.tell(worker, self.failure)
            return
        try:
            getattr(self, "op_" + op)(worker, source, body)
        except PeerError as exc:
            self.fail(exc)
        except Exception as exc:  # the updater's own error, say: the job cannot go on
            self.fail(PeerError(f"server rank {self.t.rank}: {op} from worker {worker} "
                                f"failed: {type(exc).__name__}: {exc}"))

    def receive_data(self, source: int, body) -> list:
        """The raw arrays that follow a request from `source` (described in `body`)."""
        if not body:
            return []
        arrays = [self.buffer(np.dtype(dtype), n) for _, dtype, n in body["data"]]
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

    def op_init(self, worker, source, body) -> None:
        arrays = self.receive_data(source, body)
        self.init_waits.append((worker, body["tag"], [spec[0] for spec in body["keys"]]))
        for (key, start, stop, shape, dtype), value in zip(body["keys"], arrays or
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
        self.complete_rounds(key, state)
        self.answer_pulls()

    def op_push(self, worker, source, body) -> None:
        arrays = self.receive_data(source, body)
        for entry, array in zip(body["keys"], arrays):
            key, comp = entry[0], entry[1]
            state = self.keys.setdefault(key, _Key(self.workers))
            if comp is not None:
                payload, array = array, self.decode(comp, array)
                self.release([payload])
            if self.asynchronous and state.initialised:
                self.apply(key, state, [array])
                continue
            state.queues[worker].append(array)
            if state.since is None:
                state.since = time.monotonic()
            self.complete_rounds(key, state)
        self.answer_pulls()

    def decode(self, comp, payload) -> np.ndarray:
        params, size = comp
        compressor = self.compressors.get(params)
        if compressor is None:
            compressor = self.compressors[params] = make_compressor(dict(params))
        assert compressor is not None  # the params of a compressor at work
        from ..encoding.compression import Ctx
        return compressor.decompress(payload, Ctx(size, (size,)),
                                     self.buffer(np.dtype(np.float32), size))

    def complete_rounds(self, key, state) -> None:
        if not state.initialised:
            return
        queues = state.queues
        if self.asynchronous:  # pushes that came before the key was made
            for q in queues:
                while q:
                    self.apply(key, state, [q.popleft()])
            return
        while all(queues):
            self.apply(key, state, [q.popleft() for q in queues])
        state.since = time.monotonic() if any(queues) else None

    def apply(self, key, state, grads) -> None:
        shape = self.shard.stored(key).shape
        self.shard.push(key, [g.reshape(shape) for g in grads])
        state.version += 1
        self.release(grads)

    def op_pull(self, worker, source, body) -> None:
        self.pulls.append((worker, body["tag"], body["keys"]))
        self.answer_pulls()

    def answer_pulls(self) -> None:
        waiting = []
        for worker, tag, wanted in self.pulls:
            ready = all(key in self.keys and self.keys[key].initialised
                        and (self.asynchronous or self.keys[key].version >= version)
                        for key, version in wanted)
            if not ready:
                waiting.append((worker, tag, wanted))
                continue
            for key, _ in wanted:
                value = self.shard.stored(key)
                if self.asynchronous:  # the next push may change it before it is sent
                    value = value.copy()
                request = self.t.send_array(value, self.worker_rank(worker), tag)
                self.sending.append((request, value))
        self.pulls = waiting

    def op_settings(self, worker, source, body) -> None:
        """Worker 0 changed its optimizer's options: so does this server's."""
        self.shard.apply_settings(body["settings"])

    def op_flush(self, worker, source, body) -> None:
        """Every earlier request of `worker` is done (requests of one worker are handled
        in order): say so."""
        self.reply(worker, "ok", body["tag"])

    def op_set_optimizer(self, worker, source, body) -> None:
        self.shard.set_optimizer(pickle.loads(body["optimizer"]))
        self.reply(worker, "ok")

    def op_set_updater(self, worker, source, body) -> None:
        self.shard.set_updater(pickle.loads(body["updater"]))
        self.reply(worker, "ok")

    def op_snapshot(self, worker, source, body) -> None:
        """This server's optimizer state (None without one), each key's start marked."""
        starts = {k: s.spec[0] for k, s in self.keys.items() if s.initialised}
        self.reply(worker, mark_starts(self.shard.export_state(body["dump"]), starts))

    def op_check_state(self, worker, source, body) -> None:
        """Check this server's part of a loaded state; kept for `op_restore`."""
        try:
            self.checked = self.shard.check_state(body["state"]) if body["state"] else None
        except GpukvError as exc:
            self.reply(worker, str(exc) if isinstance(exc, CheckpointError)
                       else f"{type(exc).__name__}: {exc}")
            return
        self.reply(worker, None)

    def op_restore(self, worker, source, body) -> None:
        """Assign loaded values to their pieces and install the checked state."""
        for key, piece in body["values"].items():
            self.shard.assign(key, piece)
        if self.checked is not None:
            self.shard.apply_state(self.checked)
        self.checked = None
        self.reply(worker, "ok")

    def reply(self, worker, obj, tag: int = TAG_REPLY) -> None:
        request = self.t.send_object(obj, self.worker_rank(worker), tag)
        self.sending.append((request, None))

    # ------------------------------------------------------------------ failures
    def check_stalls(self, now: float) -> None:
        if self.failure is not None:
            return
        for key, state in self.keys.items():
            if state.since is None or now - state.since <= self.t.timeout:
                continue
            if not state.initialised:
                came = sorted(state.inits)
                what = "init"
            else:
                came = [w for w, q in enumerate(state.queues) if q]
                what = "push"
            late = [w for w in range(self.workers) if w not in came]
            self.fail(PeerError(
                f"{what} of key {key!r}: worker(s) {', '.join(map(str, late))} did not "
                f"{what} it within {self.t.timeout:g} s (GPUKV_DIST_TIMEOUT); "
                f"worker(s) {', '.join(map(str, came)) or 'none'} did"))
            return

    def fail(self, error: PeerError) -> None:
        """Tell every worker, and answer everything from now on with the same failure."""
        self.failure = error
        for w in range(self.workers):
            self.tell(w, error)

    def tell(self, worker: int, error: PeerError) -> None:
        """Send `error` to `worker` (as its kind and message: `client.reported` rebuilds it)."""
        report = ("mismatch" if isinstance(error, PeerMismatchError) else "peer", str(error))
        request = self.t.send_object(report, self.worker_rank(worker), TAG_ERROR)
        self.sending.append((request, None))


def serve(transport: Transport, servers: int, shard: Shard, asynchronous: bool) -> None:
    """Run a server until every worker has stopped (its `create` then exits)."""
    worker_comm(transport, servers)
    _Server(transport, servers, shard, asynchronous).run()

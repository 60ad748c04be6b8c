"""`cupy.cuda.nccl` for the GPUs of one process, or one GPU in each process of an MPI job,
checking every call as NCCL would need it.

A collective is queued on every rank's stream once every rank of its communicator has
issued it, and runs when all those streams have reached it (across processes, it runs as it
is issued, after its stream's queued work). Calls made between
`groupStart()` and `groupEnd()` are matched at `groupEnd`: the k-th call of every rank
forms the k-th collective. Each collective is checked before it runs: every rank issued
one (real NCCL would hang), with the same operation, count, data type, reduction and
root; every buffer lies inside one allocation on the rank's own GPU, large enough for
`count` elements of the data type (so a wrong dtype code or count fails here); and the
stream belongs to the rank's GPU. A call outside a group on a communicator whose ranks
all live in this process could never complete (NCCL deadlocks): it is refused.

A communicator made with `NcclCommunicator(nranks, unique_id, rank)`, one rank in each
process (the id made by `get_unique_id` in one process and passed to the others, as
NCCL is bootstrapped), runs its collectives across the processes with mpi4py: every
process of the MPI job must create it (they are found by splitting COMM_WORLD by the id).
Before each collective the ranks compare what they called; a difference is an error
(real NCCL would hang or mix data).
"""
from __future__ import annotations

import itertools
import threading
import zlib

import numpy as np

from . import memory, runtime, streams

__all__ = ["available", "NcclCommunicator", "NcclError", "groupStart", "groupEnd",
           "get_unique_id", "get_version", "get_build_version", "NCCL_INT8", "NCCL_CHAR",
           "NCCL_UINT8", "NCCL_INT32", "NCCL_INT", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64",
           "NCCL_FLOAT16", "NCCL_HALF", "NCCL_FLOAT32", "NCCL_FLOAT", "NCCL_FLOAT64",
           "NCCL_DOUBLE", "NCCL_BFLOAT16", "NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN",
           "NCCL_AVG"]

available = True

NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4


def _bfloat16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


_DTYPES = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32,
           NCCL_UINT32: np.uint32, NCCL_INT64: np.int64, NCCL_UINT64: np.uint64,
           NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
_OPS = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}


class NcclError(RuntimeError):
    """A failed NCCL call (CuPy's `cupy_backends.cuda.libs.nccl.NcclError`)."""

    def __init__(self, status: int, detail: str):
        self.status = status
        super().__init__(f"NCCL_ERROR_INVALID_USAGE: {detail}" if status == 5
                         else f"NCCL_ERROR_INVALID_ARGUMENT: {detail}")


def _usage(detail):
    return NcclError(5, detail)


def _argument(detail):
    return NcclError(4, detail)


def get_version() -> int:
    return 22105


get_build_version = get_version
_ids = itertools.count(1)


def get_unique_id() -> bytes:
    return next(_ids).to_bytes(8, "little") + bytes(120)


# ------------------------------------------------------------------- communicators
class _Clique:
    """The ranks of one communicator, and the calls each has issued but not yet run."""

    remote = False

    def __init__(self, devices):
        self.devices = list(devices)
        self.size = len(self.devices)
        self.pending = [[] for _ in self.devices]
        self.lock = threading.Lock()
        self.stalled = self.aborted = False

    def device_of(self, rank: int) -> int:
        return self.devices[rank]

    def run_ready(self) -> None:
        _run_ready(self)


class _Remote:
    """A communicator with one rank in each of several processes (see the module's
    docstring): this process's rank, its GPU, and the calls it issued but not yet run."""

    remote = True

    def __init__(self, ndev: int, unique_id, rank: int, device: int):
        from mpi4py import MPI
        color = zlib.crc32(bytes(unique_id) if isinstance(unique_id, (bytes, bytearray))
                           else repr(tuple(unique_id)).encode()) & 0x7FFFFFFF
        self.comm = MPI.COMM_WORLD.Split(color, rank)
        if self.comm.Get_size() != ndev or self.comm.Get_rank() != rank:
            raise _argument(f"communicator of {ndev} ranks: {self.comm.Get_size()} processes "
                            f"joined it, this one as rank {self.comm.Get_rank()} (asked {rank})")
        self.size, self.rank, self.device = ndev, rank, device
        self.pending: list = [[] for _ in range(ndev)]
        self.lock = threading.Lock()
        self.stalled = self.aborted = False

    def device_of(self, rank: int) -> int:
        if rank != self.rank:
            raise _usage(f"rank {rank} of this communicator lives in another process")
        return self.device

    def run_ready(self) -> None:
        with self.lock:
            calls, self.pending[self.rank] = self.pending[self.rank], []
        for k, call in enumerate(calls):
            # Across processes a collective runs as it is issued, after the work queued
            # before it on its stream (deferred, the processes could deadlock in MPI).
            lane = _lane(call)
            streams.eager(lane, f"NCCL {call.kind}", [
                (lane, p, n, w, memory.find(p)) for p, n, w in call.ranges(self.size)])
            _run_remote(self.comm, call, k)


class NcclCommunicator:
    """One rank of a communicator (made with `initAll` for every GPU of this process)."""

    def __init__(self, ndev: int, commId=None, rank: int = 0, *, _clique=None):
        if _clique is None:
            if commId is None:
                raise _usage("a communicator of several ranks in one process needs initAll "
                             "(creating ranks one by one from one thread would hang)")
            _clique = (_Clique([runtime.current_device()]) if ndev == 1 and rank == 0
                       else _Remote(ndev, commId, rank, runtime.current_device()))
        self._clique, self._rank = _clique, rank
        self._alive = True

    @staticmethod
    def initAll(devices):  # noqa: N802 - NCCL's name
        if _group_depth() > 0:
            raise _usage("initAll inside groupStart()/groupEnd(): the communicators are "
                         "initialised only at groupEnd")
        if isinstance(devices, int):
            devices = list(range(devices))
        elif not isinstance(devices, list):
            raise ValueError('"devices" should be an int or a list of int.')
        devices = [int(d) for d in devices]
        if len(set(devices)) != len(devices):
            raise _argument(f"initAll: a GPU appears twice in {devices}")
        for d in devices:
            runtime._check_device(d)
        clique = _Clique(devices)
        return [NcclCommunicator(len(devices), None, r, _clique=clique)
                for r in range(len(devices))]

    def device_id(self) -> int:
        return self._clique.device_of(self._rank)

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._clique.size

    def destroy(self) -> None:
        self._alive = False

    def abort(self) -> None:
        """ncclCommAbort: its queued collectives are dropped (they run as nothing)."""
        self._alive = False
        self._clique.aborted = True

    # ------------------------------------------------------------ collectives
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        self._issue("allReduce", dict(send=sendbuf, recv=recvbuf, count=count,
                                      datatype=datatype, op=op), stream)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._issue("reduce", dict(send=sendbuf, recv=recvbuf, count=count,
                                   datatype=datatype, op=op, root=root), stream)

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        self._issue("broadcast", dict(send=sendbuf, recv=recvbuf, count=count,
                                      datatype=datatype, root=root), stream)

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        self._issue("reduceScatter", dict(send=sendbuf, recv=recvbuf, count=recvcount,
                                          datatype=datatype, op=op), stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
        self._issue("allGather", dict(send=sendbuf, recv=recvbuf, count=count,
                                      datatype=datatype), stream)

    def _issue(self, kind: str, args: dict, stream) -> None:
        for name, value in list(args.items()) + [("stream", stream)]:
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"an integer is required ({kind} {name}: "
                                f"{type(value).__name__})")
        if not self._alive:
            raise _usage("the communicator was destroyed")
        device = self.device_id()
        stream_gpu = runtime.stream_device(int(stream))
        if stream_gpu != device:
            raise _argument(f"{kind} of rank {self._rank} (GPU {device}) on a stream of "
                            f"GPU {stream_gpu}")
        call = _Call(kind, self._rank, device, dict(args, stream=stream))
        call.clique = self._clique
        call.check_buffers(self.size())
        clique = self._clique
        with clique.lock:
            clique.pending[self._rank].append(call)
        if _group_depth() == 0:
            if self.size() > 1 and not clique.remote:
                raise _usage(f"{kind} outside groupStart()/groupEnd() on a communicator of "
                             f"{self.size()} ranks in one process would hang")
            clique.run_ready()
        else:
            _group_cliques().add(clique)


class _Call:
    def __init__(self, kind, rank, device, args):
        self.kind, self.rank, self.device = kind, rank, device
        self.count = int(args["count"])
        self.datatype = int(args["datatype"])
        self.op = args.get("op")
        self.root = args.get("root")
        self.send, self.recv = int(args["send"]), int(args["recv"])
        self.stream = int(args.get("stream", 0))
        if self.datatype == NCCL_BFLOAT16:
            self.dtype = _bfloat16()
        elif self.datatype in _DTYPES:
            self.dtype = np.dtype(_DTYPES[self.datatype])
        else:
            raise _argument(f"{kind}: unknown data type {self.datatype}")
        if self.count < 0:
            raise _argument(f"{kind}: count {self.count}")

    def sizes(self, nranks: int) -> tuple:
        """(elements read from send, elements written to recv) on this rank."""
        if self.kind == "reduceScatter":
            return self.count * nranks, self.count
        if self.kind == "allGather":
            return self.count, self.count * nranks
        return self.count, self.count

    def ranges(self, nranks: int) -> list:
        """[(ptr, nbytes, write)] this rank's buffers the collective reads and writes."""
        n_send, n_recv = self.sizes(nranks)
        item = self.dtype.itemsize
        is_root = self.root is None or self.root == self.rank
        out = []
        if self.kind != "broadcast" or self.rank == self.root:
            out.append((self.send, n_send * item, False))
        if self.kind != "reduce" or is_root:
            out.append((self.recv, n_recv * item, True))
        return [r for r in out if r[1]]

    def check_buffers(self, nranks: int) -> None:
        n_send, n_recv = self.sizes(nranks)
        item = self.dtype.itemsize
        is_root = self.root is None or self.root == self.rank
        reads = self.kind != "broadcast" or self.rank == self.root
        writes = self.kind != "reduce" or is_root
        for what, ptr, n, used in (("send", self.send, n_send, reads),
                                   ("recv", self.recv, n_recv, writes)):
            if used and n:
                try:
                    memory.check_range(ptr, n * item, f"NCCL {self.kind} {what} buffer of "
                                                      f"rank {self.rank}", place=self.device)
                except runtime.CUDARuntimeError as exc:
                    raise _argument(str(exc)) from None

    def view(self, ptr: int, n: int) -> np.ndarray:
        mem = memory.find(ptr)
        raw = memory.host_bytes(ptr, n * self.dtype.itemsize, mem)
        return raw.view(self.dtype)


def _run_ready(clique: _Clique) -> None:
    """Run every collective all ranks have issued; complain when one is incomplete."""
    with clique.lock:
        ready = min(len(p) for p in clique.pending)
        waiting = [r for r, p in enumerate(clique.pending) if len(p) > ready]
        calls = [[clique.pending[r][k] for r in range(len(clique.devices))]
                 for k in range(ready)]
        for p in clique.pending:  # an incomplete collective is reported, then dropped
            p.clear()
    for k, ranks in enumerate(calls):
        _queue(ranks, k)
    if waiting:
        raise _usage(f"ranks {waiting} of communicator {clique.devices} issued a "
                     f"collective the other ranks never joined (NCCL would hang)")


def _lane(call):
    stream = (runtime.Stream.null if call.stream == 0
              else runtime.ExternalStream(call.stream, call.device))
    return runtime.lane_of(stream, call.device)


def _queue(ranks: list, k: int) -> None:
    """Queue collective #k on every rank's stream: it runs once each has reached it, and
    each rank's stream is then ordered after every rank's work before it."""
    lanes = [_lane(c) for c in ranks]
    for c in ranks:
        c.check_buffers(len(ranks))
    accesses = []
    for lane, c in zip(lanes, ranks):
        for ptr, nbytes, write in c.ranges(len(ranks)):
            accesses.append((lane, ptr, nbytes, write, memory.find(ptr)))
    keep = [a[4] for a in accesses]
    clique = ranks[0].clique
    streams.issue(lanes, lambda: None if clique.aborted else _run(ranks, k),
                  f"NCCL {ranks[0].kind}", accesses=accesses, keep=keep,
                  blocked=lambda: clique.stalled and not clique.aborted)


def _run(ranks: list, k: int) -> None:
    first = ranks[0]
    for c in ranks:
        for field in ("kind", "count", "datatype", "op", "root"):
            if getattr(c, field) != getattr(first, field):
                raise _argument(f"collective #{k}: rank {c.rank} called {c.kind}(count="
                                f"{c.count}, datatype={c.datatype}, op={c.op}, root={c.root})"
                                f" where rank {first.rank} called {first.kind}(count="
                                f"{first.count}, datatype={first.datatype}, op={first.op}, "
                                f"root={first.root})")
    n = len(ranks)
    if first.root is not None and not 0 <= first.root < n:
        raise _argument(f"{first.kind}: root {first.root} of {n} ranks")
    for c in ranks:
        c.check_buffers(n)
    count = first.count
    if first.kind in ("allReduce", "reduce", "reduceScatter"):
        op = _OPS.get(first.op)
        if op is None and first.op != NCCL_AVG:
            raise _argument(f"{first.kind}: unknown reduction {first.op}")
        n_in = count * n if first.kind == "reduceScatter" else count
        inputs = [c.view(c.send, n_in).copy() for c in ranks]
        total = inputs[0].copy()
        for x in inputs[1:]:
            np.add(total, x, out=total) if op is None else op(total, x, out=total)
        if op is None:
            total = (total / n).astype(first.dtype)
        if first.kind == "allReduce":
            for c in ranks:
                c.view(c.recv, count)[...] = total
        elif first.kind == "reduce":
            root = ranks[first.root]
            root.view(root.recv, count)[...] = total
        else:
            for r, c in enumerate(ranks):
                c.view(c.recv, count)[...] = total[r * count:(r + 1) * count]
    elif first.kind == "broadcast":
        root = ranks[first.root]
        data = root.view(root.send, count).copy()
        for c in ranks:
            c.view(c.recv, count)[...] = data
    elif first.kind == "allGather":
        parts = np.concatenate([c.view(c.send, count) for c in ranks])
        for c in ranks:
            c.view(c.recv, count * n)[...] = parts


def _run_remote(comm, call: _Call, k: int) -> None:
    """One collective across the processes, once every rank says it calls the same."""
    said = (call.kind, call.count, call.datatype, call.op, call.root)
    everyone = comm.allgather(said)
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            raise _argument(f"collective #{k} across processes: rank {rank} called "
                            f"{other} where rank 0 called {everyone[0]} (kind, count, "
                            f"datatype, op, root): NCCL would hang or mix data")
    n, count = comm.Get_size(), call.count
    if call.root is not None and not 0 <= call.root < n:
        raise _argument(f"{call.kind}: root {call.root} of {n} ranks")
    call.check_buffers(n)
    if call.kind in ("allReduce", "reduce", "reduceScatter"):
        op = _OPS.get(call.op)
        if op is None and call.op != NCCL_AVG:
            raise _argument(f"{call.kind}: unknown reduction {call.op}")
        n_in = count * n if call.kind == "reduceScatter" else count
        inputs = comm.allgather(call.view(call.send, n_in).copy())
        total = inputs[0].copy()
        for x in inputs[1:]:
            np.add(total, x, out=total) if op is None else op(total, x, out=total)
        if op is None:
            total = (total / n).astype(call.dtype)
        if call.kind == "allReduce" or (call.kind == "reduce" and call.rank == call.root):
            call.view(call.recv, count)[...] = total
        elif call.kind == "reduceScatter":
            call.view(call.recv, count)[...] = total[call.rank * count:(call.rank + 1) * count]
    elif call.kind == "broadcast":
        data = comm.bcast(call.view(call.send, count).copy() if call.rank == call.root
                          else None, root=call.root)
        call.view(call.recv, count)[...] = data
    elif call.kind == "allGather":
        parts = comm.allgather(call.view(call.send, count).copy())
        call.view(call.recv, count * n)[...] = np.concatenate(parts)


def stall(comm: NcclCommunicator) -> None:
    """Tests of timeouts: the collectives of `comm`'s communicator (in this process)
    never complete, as when a peer never joins them, until it is aborted."""
    comm._clique.stalled = True


# --------------------------------------------------------------------------- groups
_thread = threading.local()


def _group_depth() -> int:
    return getattr(_thread, "depth", 0)


def _group_cliques() -> set:
    cliques = getattr(_thread, "cliques", None)
    if cliques is None:
        cliques = _thread.cliques = set()
    return cliques


def groupStart() -> None:  # noqa: N802 - NCCL's name
    _thread.depth = _group_depth() + 1


def groupEnd() -> None:  # noqa: N802 - NCCL's name
    if _group_depth() == 0:
        raise _usage("groupEnd without groupStart")
    _thread.depth = _group_depth() - 1
    if _thread.depth:
        return
    cliques, _thread.cliques = _group_cliques(), set()
    for clique in cliques:
        clique.run_ready()

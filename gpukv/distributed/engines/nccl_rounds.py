"""`dist_device_sync` with `num_servers=0` on GPUs: the sharded rounds' data through NCCL.

Every key lives on this process's GPU (its copy, and the pieces it serves inside that
copy), and one NCCL communicator joins the processes' GPUs, bootstrapped over MPI (rank
0's unique id is shared with `agree.from_rank0`). A round is what `MpiRounds` does on
the host, with NCCL's collectives: without an updater an allreduce straight into each
key's copy; with one, a reduce-scatter of each split key (NCCL wants equal counts: the
buffers are padded to `piece_length * processes`, which is how `layout.pieces` cuts) or
a reduce of a whole key to its owner, the update on the owner's GPU, then an all-gather
(in place when the key divides evenly) or a broadcast from the owner. 16-bit floats are
summed in float32. Each round is agreed on first (over MPI), so the NCCL calls that
follow are the same, in the same order, on every process; their completion is waited
for with the same bound as every other wait, and a timeout aborts the communicator.
"""
from __future__ import annotations

from ..._errors import ArgumentError, PeerError
from ...device.nccl import nccl_dtype, nccl_module
from ...layout.pieces import piece_length
from ..mpi.agree import from_rank0
from ..mpi.transport import Transport
from .protocol import RoundState


class NcclLink:
    """An NCCL communicator with one rank per process, on `device` (a CUDA device)."""

    def __init__(self, transport: Transport, device):
        self.t = transport
        self.device = device
        self.nccl = nccl_module()
        uid = self.nccl.get_unique_id() if transport.rank == 0 else None
        uid = from_rank0(transport, uid, "bootstrapping NCCL")
        with device.cuda_device:
            self.comm = self.nccl.NcclCommunicator(transport.size, uid, transport.rank)

    def run(self, calls: list, what: str) -> None:
        """Issue `calls` (each `call(comm, nccl, stream_ptr)`) as one NCCL group on the
        device's stream, after the caller's work there, and wait until they are done."""
        if not calls:
            return
        device, nccl = self.device, self.nccl
        device.enter()
        with device.cuda_device:
            stream = device.stream
            nccl.groupStart()
            try:
                for call in calls:
                    call(self.comm, nccl, stream.ptr)
            finally:
                nccl.groupEnd()
            self.t.poll(lambda: True if stream.done else None, what,
                        on_timeout=self._abort(what))
        device.leave()

    def _abort(self, what: str):
        def abort():
            self.comm.abort()  # NCCL would wait for the missing ranks forever
            return PeerError(f"rank {self.t.rank}: {what}: NCCL did not finish within "
                             f"{self.t.timeout:g} s (GPUKV_DIST_TIMEOUT)")
        return abort


def _ptr(array, start: int = 0) -> int:
    """The address of element `start` of contiguous device `array`."""
    return array.data.ptr + start * array.dtype.itemsize


def all_reduce(send, recv):
    return lambda comm, nccl, s: comm.allReduce(
        _ptr(send), _ptr(recv), send.size, nccl_dtype(nccl, send.dtype), nccl.NCCL_SUM, s)


def reduce_scatter(send, recv):
    return lambda comm, nccl, s: comm.reduceScatter(
        _ptr(send), _ptr(recv), recv.size, nccl_dtype(nccl, send.dtype), nccl.NCCL_SUM, s)


def all_gather(buffer, count: int, rank: int):
    """In place: this rank's `count` elements at `rank * count` of `buffer` to everyone."""
    return lambda comm, nccl, s: comm.allGather(
        _ptr(buffer, rank * count), _ptr(buffer), count, nccl_dtype(nccl, buffer.dtype), s)


def reduce(send, recv, root: int):
    return lambda comm, nccl, s: comm.reduce(
        _ptr(send), _ptr(recv), send.size, nccl_dtype(nccl, send.dtype), nccl.NCCL_SUM,
        root, s)


def broadcast(buffer, root: int):
    return lambda comm, nccl, s: comm.broadcast(
        _ptr(buffer), _ptr(buffer), buffer.size, nccl_dtype(nccl, buffer.dtype), root, s)


class NcclRounds:
    """A sharded engine's rounds for a store whose keys live on `device`, this process's
    GPU (see the module's docstring)."""

    def __init__(self, state: RoundState, device):
        self.state = state
        self.t = state.t
        self.device = device
        self.link = NcclLink(state.t, device)
        self._scratch_gpu: dict = {}

    def forget(self) -> None:
        """Nothing is planned ahead: the buffers are kept by key and size."""

    def refuse(self, compressor) -> None:
        """ArgumentError for a compressor: NCCL moves the float32 sums."""
        if compressor is not None:
            raise ArgumentError("gradient compression on the wire goes with the host path: "
                                "create the dist_device_sync store with nccl=False to "
                                "compress what crosses processes (NCCL moves the float32 "
                                "sums on the GPUs)")

    def share_values(self, pending, what: str) -> None:
        """Rank 0's value of each new key into every process's copy."""
        self.link.run([broadcast(r.reshape(-1), 0) for _, r in pending], what)

    def _buffer(self, name, dtype, n: int):
        """A device buffer kept from round to round."""
        buf = self._scratch_gpu.get(name)
        if buf is None or buf.size != n or buf.dtype != dtype:
            buf = self._scratch_gpu[name] = self.device.zeros(n, dtype)  # padding: zeros
        return buf

    def _wire(self, key, grad):
        """`grad` flat, in its key's wire dtype (a float32 copy for 16-bit floats)."""
        layout = self.state.layouts[key]
        flat = grad.reshape(-1)
        if layout.wire == layout.dtype:
            return flat
        buf = self._buffer(("wire", key), layout.wire, flat.size)
        self.device.copy(buf, flat)
        return buf

    def openers(self, keys, by_key: dict) -> tuple[None, None]:
        """Nothing starts with the agreement, and no sum carries it: NCCL's calls
        follow it."""
        return None, None

    def round(self, keys, by_key: dict, what: str, started=None) -> None:
        """A push round once agreed on: `by_key` maps each key to (this process's sum,
        its copy of the value)."""
        if self.state.assigns:
            self._sum_everywhere(keys, by_key, what)
        else:
            self._update_at_owners(keys, by_key, what)

    def _sum_everywhere(self, keys, by_key: dict, what: str) -> None:
        """No updater: each key's sum, straight into every process's copy."""
        calls, narrow = [], []
        for key in keys:
            grad, replica = by_key[key]
            send = self._wire(key, grad)
            if send.dtype == replica.dtype:
                calls.append(all_reduce(send, replica.reshape(-1)))
            else:  # summed in float32 in place, then cast into the copy
                calls.append(all_reduce(send, send))
                narrow.append((send, replica))
        self.link.run(calls, f"{what}: NCCL allreduce")
        for total, replica in narrow:
            self.device.copy(replica.reshape(-1), total)

    def _update_at_owners(self, keys, by_key: dict, what: str) -> None:
        rank, size = self.t.rank, self.t.size
        calls, merged = [], []
        for key in keys:
            layout = self.state.layouts[key]
            send = self._wire(key, by_key[key][0])
            n = layout.size
            if layout.split:
                step = piece_length(n, size)
                padded = send
                if n != step * size:
                    padded = self._buffer(("padded", key), layout.wire, step * size)
                    self.device.copy(padded[:n], send)
                recv = self._buffer(("piece", key), layout.wire, step)
                calls.append(reduce_scatter(padded, recv))
                mine = layout.served_by(rank)
                if mine:
                    merged.append((key, recv[:mine[0].stop - mine[0].start]))
            else:
                owner = layout.pieces[0].server
                recv = self._buffer(("sum", key), layout.wire, n) if owner == rank else send
                calls.append(reduce(send, recv, owner))
                if owner == rank:
                    merged.append((key, recv.reshape(layout.shape)))
        self.link.run(calls, f"{what}: NCCL reduce")
        self.state.update(merged, what)
        calls, padded_copies = [], []
        for key in keys:
            layout = self.state.layouts[key]
            replica = by_key[key][1].reshape(-1)
            n = layout.size
            if not layout.split:
                calls.append(broadcast(replica, layout.pieces[0].server))
                continue
            step = piece_length(n, size)
            if n == step * size:
                calls.append(all_gather(replica, step, rank))
                continue
            gathered = self._buffer(("gathered", key), layout.dtype, step * size)
            mine = layout.served_by(rank)
            if mine:
                self.device.copy(gathered[mine[0].start:mine[0].stop],
                                 replica[mine[0].start:mine[0].stop])
            calls.append(all_gather(gathered, step, rank))
            padded_copies.append((replica, gathered[:n]))
        self.link.run(calls, f"{what}: NCCL all-gather")
        for replica, gathered in padded_copies:
            self.device.copy(replica, gathered)


def nccl_device(local_rank: int):
    """The GPU this process joins the NCCL communicator with (its local rank's, among the
    GPUs it sees), or None without GPUs or NCCL."""
    from ...device import gpu_count, gpu_devices
    from ...device.nccl import nccl_available
    if not gpu_count() or not nccl_available():
        return None
    gpus = [g for g in gpu_devices() if g.slot == 0]
    return gpus[local_rank % len(gpus)] if gpus else None

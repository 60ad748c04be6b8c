"""PowerSGD's round among the workers of a dist store, as both engines run it: every
worker's P, then Q, summed by one allreduce each, of every key at once, and each key's
sum P Q^T decoded alike in every worker (see `encoding.compressors.powersgd`). With
num_servers=0 (`mpi_rounds`) the processes then hold each key's new sum; with servers
(`client`) each worker sends a share of it to the key's server(s)."""
from __future__ import annotations

import numpy as np

from ..._errors import ArgumentError
from ..mpi.agree import Agreement


def refuse(compressor, deterministic: bool, asynchronous: bool = False) -> None:
    """ArgumentError for a low-rank compressor a store cannot run: a deterministic one
    (its sums are allreduces, in no fixed order) or dist_async (its workers push apart)."""
    if compressor is None or not compressor.low_rank:
        return
    if deterministic:
        raise ArgumentError(f"gradient compression {compressor.params()}: its sums (two "
                            f"allreduces) have no canonical order; a deterministic store "
                            f"takes another compressor")
    if asynchronous:
        raise ArgumentError(f"gradient compression {compressor.params()}: its two sums per "
                            f"push run among the workers together, which dist_async's "
                            f"workers do not; use dist_sync")


def sums(agree: Agreement, comp, feedback, keys: list, grads: list, copies: list,
         what: str) -> list:
    """Each key's sum over the workers of `agree`'s communicator, which agreed on this
    round, of its gradient (`grads`, one per key, of
    `keys`: (key, layout)), as PowerSGD carries it: P Q^T, float32 rows x cols. Where
    `copies[k]` is given (not None) the sum is also that copy's new value: decoded
    straight into it when it is a float32 contiguous array, else written into it after.
    Each worker's residual (`feedback`, slot (key,)) keeps what its own P Q_i^T missed."""
    from ...encoding.compressors import powersgd
    assert isinstance(comp, powersgd.PowerSGD) and feedback is not None
    ms, outs = [], []
    for (key, layout), grad, copy in zip(keys, grads, copies):
        found = comp.matrix(layout.shape)
        assert found is not None  # the callers pick the matrices
        m = feedback.residual((key,), layout.size)
        m += grad.reshape(-1)  # this worker's M
        ms.append([m.reshape(found)])
        outs.append(None if copy is None else _decodable_into(copy, found))
    totals = powersgd.step(comp, [key for key, _ in keys], ms,
                           lambda lists, name: summed(agree, [a for a, in lists], name, what),
                           outs)
    for copy, out, total in zip(copies, outs, totals):
        if copy is not None and out is None:
            copy.reshape(-1)[...] = total.reshape(-1)
    return totals


def summed(agree: Agreement, arrays: list, name: str, what: str) -> list:
    """`arrays` (float32) summed over the processes of `agree`'s communicator by one
    allreduce: new arrays of their shapes, the same bits in every process. A process
    that does not join it in time is named on every other (`Agreement.wait`)."""
    t = agree.t
    flat = np.concatenate([a.reshape(-1) for a in arrays])
    request = t.comm.Iallreduce(t.MPI.IN_PLACE, flat, op=t.MPI.SUM)
    agree.wait([request], f"{what}: allreduce of the low-rank {name}")
    out, at = [], 0
    for a in arrays:
        out.append(flat[at:at + a.size].reshape(a.shape))
        at += a.size
    return out


def _decodable_into(copy, shape):
    """`copy` seen as a float32 matrix of `shape` a sum can be decoded into, or None (its
    sum is decoded apart, then written into it)."""
    if (isinstance(copy, np.ndarray) and copy.dtype == np.float32
            and copy.flags.c_contiguous and copy.size == int(np.prod(shape))):
        return copy.reshape(shape)
    return None

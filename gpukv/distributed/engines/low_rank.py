"""PowerSGD's round among the workers of a dist store, as both engines run it: every
worker's P, then Q, summed by one collective each, of every key at once, and each key's
sum P Q^T decoded alike in every worker (see `encoding.compressors.powersgd`). With
num_servers=0 (`mpi_rounds`) the processes then hold each key's new sum; with servers
(`client`) each worker sends a share of it to the key's server(s).

In a deterministic store each value a worker pushes is a leaf of the canonical tree with
a residual of its own, as each source of a one-process store: each worker sums its
leaves' P (then Q) into its nodes of the tree, one all-gather moves every worker's
nodes, and every worker merges them as the tree does (`canonical_summed`), so the sums,
and the key's decoded sum, have the bits of one process given every leaf. Elsewhere
each worker's M is its own sum, and the sums are allreduces (`summed`)."""
from __future__ import annotations

import numpy as np

from ..._errors import ArgumentError
from ...canonical.tree import leaves_sum, merge, rank_nodes
from ..mpi.agree import Agreement
from .layout import displacements


def refuse(compressor, asynchronous: bool) -> None:
    """ArgumentError for a low-rank compressor in dist_async (its workers push apart)."""
    if compressor is None or not compressor.low_rank:
        return
    if asynchronous:
        raise ArgumentError(f"gradient compression {compressor.params()}: its two sums per "
                            f"push run among the workers together, which dist_async's "
                            f"workers do not; use dist_sync")


def sums(agree: Agreement, comp, feedback, keys: list, grads: list, copies: list,
         what: str, counts: list | None = None) -> list:
    """Each key's sum over the workers of `agree`'s communicator, which agreed on this
    round, of its gradient (`grads`, one per key, of
    `keys`: (key, layout)), as PowerSGD carries it: P Q^T, float32 rows x cols. Where
    `copies[k]` is given (not None) the sum is also that copy's new value: decoded
    straight into it when it is a float32 contiguous array, else written into it after.
    Each worker's residual (`feedback`, slot (key,)) keeps what its own P Q_i^T missed.
    With `counts` (a deterministic store: each key's values per worker, the same in
    every worker) each grad is the worker's `Leaves`, each leaf with its residual (slot
    (key, 0, leaf)), and the sums follow the canonical tree."""
    from ...encoding.compressors import powersgd
    assert isinstance(comp, powersgd.PowerSGD) and feedback is not None
    ms, outs = [], []
    for k, ((key, layout), grad, copy) in enumerate(zip(keys, grads, copies)):
        found = comp.matrix(layout.shape)
        assert found is not None  # the callers pick the matrices
        if counts is None:
            m = feedback.residual((key,), layout.size)
            m += grad.reshape(-1)  # this worker's M
            ms.append([m.reshape(found)])
        else:
            leaves = []
            for j in range(counts[k]):  # each leaf's M
                m = feedback.residual((key, 0, j), layout.size)
                m += grad.values[j]
                leaves.append(m.reshape(found))
            ms.append(leaves)
        outs.append(None if copy is None else _decodable_into(copy, found))

    def over_workers(lists, name):
        if counts is None:
            return summed(agree, [a for a, in lists], name, what)
        return canonical_summed(agree, lists, counts, name, what)

    totals = powersgd.step(comp, [key for key, _ in keys], ms, over_workers, outs)
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


def canonical_summed(agree: Agreement, lists: list, counts: list, name: str,
                     what: str) -> list:
    """The canonical tree's sum of each list of `lists` (this worker's `counts[k]`
    float32 arrays of one shape, its leaves rank * count .. of the key's rank-major tree
    over every worker's): arrays of this call's own (a lone node is a view of the
    all-gather's buffer), the same bits in every process and as one
    process's `leaves_sum` of every leaf. Each worker sums its nodes of each tree, one
    all-gather moves them, and every worker merges them as the tree adds them."""
    t = agree.t
    rank, size = t.rank, t.size
    trees = [[rank_nodes(r, count, size) for r in range(size)] for count in counts]
    mine = []
    for arrays, count, nodes in zip(lists, counts, trees):
        first = rank * count
        mine += [leaves_sum(arrays[lo - first:hi - first], np.add).reshape(-1)
                 for lo, hi in nodes[rank]]
    per_rank = [sum(len(nodes[r]) * arrays[0].size for arrays, nodes in zip(lists, trees))
                for r in range(size)]
    send = np.concatenate(mine) if mine else np.empty(0, np.float32)
    recv = np.empty(sum(per_rank), np.float32)
    starts = displacements(per_rank)
    request = t.comm.Iallgatherv(send, [recv, per_rank, starts, t.MPI.FLOAT])
    agree.wait([request], f"{what}: all-gather of the low-rank {name}'s nodes")
    parts: list = [[] for _ in lists]
    for r in range(size):  # each rank sent its nodes key by key, in tree order
        at = starts[r]
        for k, (arrays, nodes) in enumerate(zip(lists, trees)):
            shape, n = arrays[0].shape, arrays[0].size
            for node in nodes[r]:
                parts[k].append((node, recv[at:at + n].reshape(shape)))
                at += n
    return [merge(found, size * count, np.add) for found, count in zip(parts, counts)]


def _decodable_into(copy, shape):
    """`copy` seen as a float32 matrix of `shape` a sum can be decoded into, or None (its
    sum is decoded apart, then written into it)."""
    if (isinstance(copy, np.ndarray) and copy.dtype == np.float32
            and copy.flags.c_contiguous and copy.size == int(np.prod(shape))):
        return copy.reshape(shape)
    return None

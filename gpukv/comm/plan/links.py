"""The link matrix of a job's devices: read from the hardware for GPUs, all links equal
between host slots, or taken from a matrix the caller gives."""
from __future__ import annotations

import numpy as np

from . import topology


def measured_links(nodes) -> bool:
    """Whether the links between `nodes` are read from the hardware (all GPUs)."""
    return all(d.peer_links for d in nodes)


def link_matrix(nodes) -> np.ndarray:
    """The link matrix of logical devices `nodes` (host slots: all equal links)."""
    if measured_links(nodes):  # GPUs: the ranks the CUDA device layer reads from the driver
        from ...device import p2p_ranks
        ids = [d.link_index for d in nodes]
        return topology.link_matrix_from_ranks(ids, p2p_ranks(ids))
    n = len(nodes)
    w = np.full((n, n), topology.SAME_DEVICE_WEIGHT)
    np.fill_diagonal(w, 0.0)
    return w


def link_matrix_for(nodes, matrix=None) -> np.ndarray:
    """The link matrix of `nodes`: `link_matrix`'s without `matrix`; else `matrix(nodes)`
    for a callable, or the rows and columns of `nodes` (host slot or physical GPU) of a
    full matrix."""
    if matrix is None:
        return link_matrix(nodes)
    if callable(matrix):
        return matrix(nodes)
    full = np.asarray(matrix, dtype=float)
    ids = [d.link_index for d in nodes]
    return full[np.ix_(ids, ids)]

"""Frozen parameters and buffers start alike everywhere, as trainable parameters do.

The store starts every replica's trainable weights from worker 0's replica 0; frozen
parameters (requires_grad=False when the Trainer is made) and buffers (BatchNorm's
running statistics, spectral_norm's vectors) are not in the store, so a Trainer copies
them here: replica 0's to the other replicas of its process, then, on a dist store,
worker 0's to every worker where they differ (as DDP's constructor broadcasts rank 0's
parameters and buffers). Workers compare a checksum of each tensor first, so values that
already agree (the same seed, the same pretrained file) cost one small collective; only
the ones that differ travel, as their bits, through `workers_max`.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..store.base import KVStore

log = logging.getLogger("gpukv")

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NOBODY = np.iinfo(np.int64).min  # what a worker but 0 offers: any value of 0's is larger


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bit patterns as signed integers of its item size, flat."""
    return tensor.detach().contiguous().reshape(-1).view(_BITS[tensor.element_size()])


def checksum(tensor: torch.Tensor, chunk: int = 1 << 24) -> int:
    """A position-sensitive checksum of `tensor`'s bits, in [0, 2**62), computed where
    the tensor lives, `chunk` elements at a time (int64 arithmetic, wrapping)."""
    bits = _bits(tensor)
    total = 0
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=part.device,
                               dtype=torch.int64) % 65521 + 1
        total += int((part * weights).sum())
    return (total * 1000003 + bits.numel()) % (1 << 62)


def replica_buffers(modules) -> list:
    """(name, replica, tensor) of every buffer of every replica that replica 0 has too,
    alike in shape and dtype (a replica's own extra buffers are left as they are)."""
    first = dict(modules[0].named_buffers())
    return [(name, r, b) for r, module in enumerate(modules)
            for name, b in module.named_buffers()
            if name in first and b.shape == first[name].shape
            and b.dtype == first[name].dtype and b.element_size() in _BITS]


def start_alike(kv: KVStore, frozen: list) -> list[str]:
    """Every replica's frozen parameters and buffers (`frozen`: (name, replica,
    tensor)) set to replica 0's, and on a dist store to worker 0's; the names whose
    values differed between workers."""
    first = {name: tensor for name, replica, tensor in frozen if replica == 0}
    with torch.no_grad():
        for name, replica, tensor in frozen:
            if replica and tensor is not first[name]:
                tensor.copy_(first[name])
    if kv.num_workers == 1 or not first:
        return []
    names = list(first)
    sums = np.array([checksum(first[n]) for n in names], np.int64)
    extremes = kv.workers_max(np.concatenate([sums, -sums]), "Trainer: frozen parameters")
    differ = [n for i, n in enumerate(names)
              if extremes[i] != -extremes[len(names) + i]]  # the largest is not the smallest
    if not differ:
        return []
    offered = [_bits(first[n]).to(torch.int64).cpu().numpy() if kv.rank == 0
               else np.full(first[n].numel(), _NOBODY, np.int64) for n in differ]
    sizes = np.cumsum([0] + [o.size for o in offered])
    worker0 = kv.workers_max(np.concatenate(offered), "Trainer: frozen parameters' values")
    with torch.no_grad():
        for i, name in enumerate(differ):
            mine = first[name]
            values = torch.from_numpy(worker0[sizes[i]:sizes[i + 1]]).to(_BITS[mine.element_size()])
            whole = values.view(mine.dtype).reshape(mine.shape).to(mine.device)
            for n, _, tensor in frozen:
                if n == name:
                    tensor.copy_(whole)
    log.warning("gpukv Trainer: frozen parameter(s) or buffer(s) %s differed between "
                "workers; every worker now has worker 0's (as DDP broadcasts rank 0's)",
                ", ".join(differ))
    return differ

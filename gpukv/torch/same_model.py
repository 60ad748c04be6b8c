"""Every worker of a dist store trains the same model: the same trainable parameters, in
the same order, of the same shapes and dtypes. Checked when a Trainer is made, before any
key is: otherwise the first sign is a bucket's key of another size on some worker, which
names no parameter."""
from __future__ import annotations

import zlib

import numpy as np

from .._errors import PeerMismatchError
from ..store.base import KVStore


def check_same_model(kv: KVStore, names: list, params: list) -> None:
    """A PeerMismatchError on every worker where their trainable parameters (`names`, and
    `params`, replica 0's tensors) differ, naming the first that does: two collective
    calls, none with one worker."""
    if kv.num_workers == 1:
        return
    n = len(names)
    most, fewest = kv.workers_max(np.array([n, -n]), "Trainer: the model's parameters")
    if most != -fewest:
        raise PeerMismatchError(
            f"Trainer: the workers' models differ: they have {-fewest} to {most} trainable "
            f"parameters (this worker, rank {kv.rank}: {n}); every worker must build the "
            f"same model")
    digests = np.array([zlib.crc32(repr(_described(name, p)).encode())
                        for name, p in zip(names, params)], np.int64)
    extremes = kv.workers_max(np.concatenate([digests, -digests]),
                              "Trainer: the model's parameters, one by one")
    differ = [i for i in range(n) if extremes[i] != -extremes[n + i]]
    if differ:
        name, shape, dtype = _described(names[differ[0]], params[differ[0]])
        raise PeerMismatchError(
            f"Trainer: the workers' models differ at parameter {name!r} (the first of "
            f"{len(differ)} that differ): this worker (rank {kv.rank}) has it of shape "
            f"{shape}, {dtype}, another has another parameter there or another shape or "
            f"dtype; every worker must build the same model")


def _described(name: str, param) -> tuple:
    return name, tuple(param.shape), str(param.dtype).replace("torch.", "")

"""Error feedback around any compressor: the residual each compressed value carries from
one push to the next, kept here whoever compresses (a one-process store per (key,
device), the sharded rounds and the servers' client per (key, piece[, value])).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

from .base import Compressor


def _host_zeros(size: int):
    return np.zeros(size, np.float32)


class ErrorFeedback:
    """A compressor and its residuals, one per slot (any hashable the caller picks).

    `zeros(size)` makes a new residual where the values live (NumPy zeros by default; a
    GPU's zeros on its stream for device values). Setting another compressor means a new
    ErrorFeedback: residuals start afresh.
    """

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self.residuals: dict = {}

    def residual(self, slot: Hashable, size: int,
                 zeros: Callable[[int], object] = _host_zeros):
        """The residual of `slot` (zeros the first time, or when its size changed); None
        for a compressor without error feedback."""
        if not self.compressor.uses_residual:
            return None
        r = self.residuals.get(slot)
        if r is None or r.size != size:
            r = self.residuals[slot] = zeros(size)
        return r

    def compress(self, slot: Hashable, x, zeros: Callable[[int], object] = _host_zeros):
        """`compressor.compress(x, residual of slot)`: (payload, ctx); moves the residual on."""
        return self.compressor.compress(x, self.residual(slot, x.size, zeros))

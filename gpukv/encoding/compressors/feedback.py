"""Error feedback around any compressor: the residual each compressed value carries from
one push to the next, kept here whoever compresses (a one-process store per (key,
device), the sharded rounds and the servers' client per (key, piece[, value])).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import numpy as np

from .base import Compressor

log = logging.getLogger("gpukv")

#: a residual is checked against its compressor's bound at its first push and every
#: CHECK_EVERY-th one (a pass over it, and on a GPU a wait for its stream)
CHECK_EVERY = 16


def _host_zeros(size: int):
    return np.zeros(size, np.float32)


class ErrorFeedback:
    """A compressor and its residuals, one per slot (any hashable the caller picks).

    `zeros(size)` makes a new residual where the values live (None: NumPy zeros; a
    GPU's zeros on its stream for device values). Setting another compressor means a new
    ErrorFeedback: residuals start afresh.
    """

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self.residuals: dict = {}
        self._pushes: dict = {}      # slot -> compressions so far
        self._warned: set = set()    # keys whose residual passed the bound

    def residual(self, slot: Hashable, size: int,
                 zeros: Callable[[int], object] | None = None):
        """The residual of `slot` (zeros the first time, or when its size changed); None
        for a compressor without error feedback."""
        if not self.compressor.uses_residual:
            return None
        r = self.residuals.get(slot)
        if r is None or r.size != size:
            r = self.residuals[slot] = (zeros or _host_zeros)(size)
        return r

    def compress(self, slot: Hashable, x, zeros: Callable[[int], object] | None = None):
        """`compressor.compress(x, residual of slot)`: (payload, ctx); moves the residual on."""
        residual = self.residual(slot, x.size, zeros)
        compressed = self.compressor.compress(x, residual)
        bound = self.compressor.residual_bound
        if bound is not None and residual is not None:
            count = self._pushes.get(slot, 0)
            self._pushes[slot] = count + 1
            if count % CHECK_EVERY == 0:
                self._check(slot, residual, bound)
        return compressed

    def _check(self, slot: Hashable, residual, bound: float) -> None:
        """Warn once per key whose residual passed `bound`: the rule is not keeping up."""
        key = slot[0] if isinstance(slot, tuple) else slot
        if key in self._warned or not residual.size:
            return
        largest = float(abs(residual).max())
        if not largest <= bound:  # (NaN too: a NaN residual is past any bound)
            self._warned.add(key)
            # (float32 options as the user wrote them: 0.01, not 0.009999999776482582)
            params = {k: float(f"{v:.7g}") if isinstance(v, float) else v
                      for k, v in self.compressor.params().items()}
            log.warning("gradient compression %s: the residual of key %r reached %.4g, "
                        "past %.4g: its gradients outgrow what the rule sends each push, "
                        "and accuracy suffers; {'type': 'sign'} keeps accuracy without "
                        "tuning", params, key, largest, bound)

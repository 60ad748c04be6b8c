"""Compressed pulls: what every worker holds of a key whose compressor compresses both
ways (`Compressor.compresses_pulls`, e.g. 'sign').

Whoever owns a key (a one-process store's home, the process serving a piece with
num_servers=0, a server) keeps two things apart: the key's value, which the updater
updates, and the served value, which every worker holds and a pull returns. After each
push it sends one payload per piece, which every worker decodes alike, so every copy of
the served value stays the same bits:

- with an updater on the store, the payload is C(value - served), the step compressed,
  and every worker adds its decoded value to the served value. What the codec did not
  send of a step must not be lost, and either of two things carries it:
  - a heavy-ball momentum on the step (SGD's, centered RMSProp's:
    `Optimizer.settles_compressed_pulls`) carries it on, so the owner's value becomes
    the served value (`settle`): the store takes the step every worker took, and every
    copy holds its value, bit for bit;
  - otherwise (Nesterov's momentum, the Adam-like rules, no momentum, an updater
    function) the owner keeps the value apart: the served value follows it, and differs
    from it by what the codec has not sent yet (the owner's residual: error feedback of
    its own, kept as that difference).
  The served value trails a value kept apart by a few steps. On top of SGD's momentum
  that staleness cost 'sign' 4.2 and 9.9 points of accuracy after 5 epochs on the
  accuracy benchmark's MLP and CNN (10 seeds; 1.1 and 2.0 settled); with the other
  rules settling cost more than it saved (`benchmarks/bench_accuracy.py`, the table
  in docs/optimizers.md);
- without one (a push assigns the sum), the payload is C(sum + residual) and the served
  value becomes its decoded value; the residual of each piece is kept here, as a
  worker keeps the residual of what it pushes.

A blockwise codec cuts a piece of a key where it cuts the whole key (pieces start at
multiples of its block), so the served value is the same bits whatever the layout.
"""
from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from ..device import codecs
from .compressors import Compressor, Ctx, ErrorFeedback


class PullCodec:
    """The owner's side of compressed pulls, for one compressor: `payload` makes what a
    piece's workers are sent, `apply` is what each of them does with it (the owner
    included)."""

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self.feedback = ErrorFeedback(compressor)  # residuals of assigned sums, per slot

    def payload(self, slot: Hashable, value, served, assigns: bool, zeros=None):
        """The payload that moves `served` on after a push: of the float32 `value` (the
        sum, with `slot`'s residual) when the push `assigns`, else of `value - served`.
        `zeros(n)`: a new residual where the values live (NumPy's by default)."""
        if assigns:
            payload, _ = self.feedback.compress(slot, codecs.flat_f32(value), zeros)
            return payload
        payload, _ = self.compressor.compress(codecs.difference_f32(value, served))
        return payload

    def apply(self, payload, served, assigns: bool) -> None:
        """Decode `payload` into `served` (any floating dtype), or add it there."""
        n = served.size
        if served.dtype == np.float32:
            self.compressor.decompress(payload, Ctx(n, (n,)), served.reshape(-1),
                                       accumulate=not assigns)
            return
        decoded = self.compressor.decompress(payload, Ctx(n, (n,)))
        codecs.write_f32(served, decoded, accumulate=not assigns)

    @staticmethod
    def settle(value, served, assigns: bool, settles: bool) -> None:
        """The owner's value after a round, once its `served` value is moved on: where
        the optimizer `settles` compressed pulls (`Optimizer.settles_compressed_pulls`),
        that served value, the step every worker took; else (a round that `assigns`,
        any other updater) as it is."""
        if settles and not assigns:
            value.reshape(-1)[...] = served.reshape(-1)

    def forget(self, slot: Hashable) -> None:
        """Start the residual of `slot` afresh."""
        self.feedback.residuals.pop(slot, None)

"""A key as the engines see it: its shape and dtype, the pieces its processes serve (see
`gpukv.layout.pieces`) and the dtype its sums cross in. Every engine describes a key so,
whoever serves the pieces (every process, or dedicated servers)."""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from ...device.host_sum import accumulate_dtype
from ...layout.pieces import pieces


class KeyLayout(NamedTuple):
    shape: tuple
    dtype: np.dtype
    pieces: tuple      # layout.pieces.Piece, one per serving process
    wire: np.dtype     # the dtype it is summed in on the wire

    @classmethod
    def of(cls, key, shape: tuple, dtype, servers: int, bound: int) -> KeyLayout:
        """The layout of `key` (of `shape` and `dtype`) served by `servers` processes."""
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        return cls(tuple(shape), dtype, pieces(key, size, servers, bound),
                   accumulate_dtype(dtype))

    @property
    def split(self) -> bool:
        return len(self.pieces) > 1

    @property
    def size(self) -> int:
        """The key's elements."""
        return int(np.prod(self.shape, dtype=np.int64))

    def served_by(self, server: int) -> list:
        """The pieces `server` serves (one at most)."""
        return [p for p in self.pieces if p.server == server]

    def per_rank(self, size: int) -> tuple[list, list]:
        """(elements, first element) of the piece of each of `size` ranks (0 and the
        key's end for a rank without a piece)."""
        counts, starts = [0] * size, [self.size] * size
        for p in self.pieces:
            counts[p.server], starts[p.server] = p.stop - p.start, p.start
        return counts, starts


def displacements(counts: list) -> list:
    """Where each of `counts` consecutive runs starts."""
    return [0] + list(itertools.accumulate(counts))[:-1]


def even(n: int, size: int) -> tuple[list, list]:
    """(elements, first element) of `size` pieces of `n` elements, as even as can be."""
    per = [n // size + (r < n % size) for r in range(size)]
    return per, displacements(per)

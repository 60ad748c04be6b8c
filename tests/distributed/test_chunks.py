"""How a piece of a key is cut into the chunks it crosses to and from a server in."""
from __future__ import annotations

import pytest

from gpukv.distributed.chunks import CHUNK_BYTES, chunk_ranges


@pytest.mark.parametrize("n,itemsize,chunk,want", [
    (0, 4, 16, [(0, 0)]),
    (1, 4, 16, [(0, 1)]),
    (4, 4, 16, [(0, 4)]),
    (5, 4, 16, [(0, 4), (4, 5)]),
    (12, 4, 16, [(0, 4), (4, 8), (8, 12)]),
    (13, 2, 16, [(0, 8), (8, 13)]),
    (3, 8, 4, [(0, 1), (1, 2), (2, 3)]),
])
def test_chunks_cover_the_piece_in_order(n, itemsize, chunk, want):
    """Every chunk but the last has chunk // itemsize elements (at least one); together
    they cover [0, n) in order; an empty piece is one empty chunk."""
    assert chunk_ranges(n, itemsize, chunk) == want


def test_default_chunk_is_what_both_ends_use():
    """Without a size given, a piece is cut at CHUNK_BYTES."""
    step = CHUNK_BYTES // 4
    assert chunk_ranges(2 * step + 1, 4) == [(0, step), (step, 2 * step), (2 * step, 2 * step + 1)]

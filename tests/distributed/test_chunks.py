"""How a piece of a key is cut into the chunks it crosses to and from a server in."""
from __future__ import annotations

import pytest

import gpukv
from gpukv.distributed.engines import exchange
from gpukv.distributed.mpi.chunks import CHUNK_BYTES, WHOLE, chunk_bytes, chunk_ranges


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


class _Job:
    def __init__(self, local_size: int, size: int):
        self.local_size, self.size = local_size, size


@pytest.mark.parametrize("local_size, size, chosen, want", [
    (1, 4, None, CHUNK_BYTES),      # across machines: chunks
    (4, 4, None, WHOLE),            # one machine: pieces whole
    (4, 4, "4096", 4096),           # set: that size anywhere
])
def test_a_job_across_machines_moves_chunks_and_one_on_a_machine_whole_pieces(
        local_size, size, chosen, want, monkeypatch):
    """Chunks pay where a network is the limit; on one machine their fixed costs showed
    (a 16 MB push and pull with a server took twice as long), so pieces move whole there,
    unless GPUKV_DIST_CHUNK_BYTES says otherwise."""
    if chosen is None:
        monkeypatch.delenv("GPUKV_DIST_CHUNK_BYTES", raising=False)
    else:
        monkeypatch.setenv("GPUKV_DIST_CHUNK_BYTES", chosen)
    assert chunk_bytes(_Job(local_size, size)) == want


@pytest.mark.parametrize("chosen", ["0", "-1", "lots"])
def test_a_bad_chunk_size_is_refused(chosen, monkeypatch):
    """GPUKV_DIST_CHUNK_BYTES must be a positive number of bytes."""
    monkeypatch.setenv("GPUKV_DIST_CHUNK_BYTES", chosen)
    with pytest.raises(gpukv.ArgumentError, match="GPUKV_DIST_CHUNK_BYTES"):
        chunk_bytes(_Job(1, 2))


@pytest.mark.parametrize("chosen, step", [(None, CHUNK_BYTES // 4), (4096, 1024)])
def test_the_exchange_cuts_pieces_as_the_job_says(chosen, step):
    """With num_servers=0 the owners' pieces cross in CHUNK_BYTES chunks, on one machine
    too, or in the job's GPUKV_DIST_CHUNK_BYTES (read once, at `create`: its transport's
    `chunk_bytes`); an empty piece sends nothing."""
    assert exchange.chunks(2 * step + 1, 4, chosen) == [(0, step), (step, 2 * step),
                                                        (2 * step, 2 * step + 1)]
    assert exchange.chunks(0, 4, chosen) == []

"""How a piece of a key crosses between processes: in chunks of about `CHUNK_BYTES`,
each its own message, so that a server (or, with num_servers=0, a piece's owner, see
`exchange`) sums a chunk while the next ones are on the wire and sends a summed chunk on
while later ones still arrive.

Both ends cut a piece of `n` elements of one dtype alike, from `n` and the item size
alone, so a receiver's receives match a sender's sends one for one.
"""
from __future__ import annotations

from ..._env import positive_int

#: bytes per chunk: large enough that a message's fixed cost is small against its bytes,
#: small enough that summing and sending overlap the transfer of the rest
CHUNK_BYTES = 1 << 20
#: "no chunks": a piece moves whole
WHOLE = 1 << 62


def chunk_bytes(transport) -> int:
    """The chunk size of a job: GPUKV_DIST_CHUNK_BYTES when set (every process of the job
    sets the same), else CHUNK_BYTES when the job spans several machines, and pieces
    whole when every process shares one machine, where a message costs memory bandwidth
    alone and each chunk's fixed costs (a message, its tests, a sum call) are what show."""
    chosen = chosen_chunk_bytes()
    if chosen is not None:
        return chosen
    return CHUNK_BYTES if transport.local_size < transport.size else WHOLE


def chosen_chunk_bytes() -> int | None:
    """GPUKV_DIST_CHUNK_BYTES, or None when it is not set."""
    return positive_int("GPUKV_DIST_CHUNK_BYTES", expected="a positive number of bytes")


def chunk_ranges(n: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> list:
    """The [lo, hi) element ranges of a piece of `n` elements: every one `chunk_bytes`
    long (at least one element) but the last; one empty range for an empty piece."""
    step = max(1, chunk_bytes // max(1, itemsize))
    if n <= step:
        return [(0, n)]
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

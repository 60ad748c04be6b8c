"""How a piece of a key crosses to and from its server: in chunks of about `CHUNK_BYTES`,
each its own message, so that a server sums a chunk while the next ones are on the wire
and sends a summed chunk back while later ones still arrive.

Both ends cut a piece of `n` elements of one dtype alike, from `n` and the item size
alone, so a worker's receives match a server's sends one for one.
"""
from __future__ import annotations

#: bytes per chunk: large enough that a message's fixed cost is small against its bytes,
#: small enough that summing and sending overlap the transfer of the rest
CHUNK_BYTES = 1 << 20


def chunk_ranges(n: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> list:
    """The [lo, hi) element ranges of a piece of `n` elements: every one `chunk_bytes`
    long (at least one element) but the last; one empty range for an empty piece."""
    step = max(1, chunk_bytes // max(1, itemsize))
    if n <= step:
        return [(0, n)]
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

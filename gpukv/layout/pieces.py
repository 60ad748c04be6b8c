"""Which process serves which part of a key: small keys whole, spread by a hash of the key,
big keys split into one contiguous piece per server.

The hash is of the key itself (never of the order keys were made in), so processes that
create their keys in different orders still agree on every key's servers.
"""
from __future__ import annotations

import zlib
from typing import NamedTuple

#: MXNet's MXNET_KVSTORE_BIGARRAY_BOUND: keys of at least this many elements are split
DEFAULT_BIGARRAY_BOUND = 1_000_000


class Piece(NamedTuple):
    """Elements [start, stop) of a key's flattened value, served by `server`."""
    server: int
    start: int
    stop: int


def key_hash(key) -> int:
    """A hash of `key` that every process computes alike (Python's `hash` of a str
    differs between processes)."""
    text = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else str(key).encode()
    return zlib.crc32(text)


def pieces(key, size: int, servers: int, bound: int) -> tuple:
    """The pieces of a key of `size` elements over `servers` servers.

    A split key is cut every `piece_length` elements, a multiple of CODEC_BLOCK (the
    last pieces may be shorter, or empty and left out), so that a
    collective with equal counts per rank (NCCL's reduce-scatter and all-gather, over a
    buffer padded to `servers * piece_length`) hands each rank exactly its piece."""
    if size >= bound and size >= servers > 1:
        step = piece_length(size, servers)
        return tuple(Piece(s, s * step, min((s + 1) * step, size)) for s in range(servers)
                     if s * step < size)
    return (Piece(key_hash(key) % servers, 0, size),)


#: pieces start at multiples of this: a codec that works in blocks of values (sign's
#: 64, ternary's 128) then cuts each piece where it cuts the whole key, and compressed
#: pieces give the bits of the whole key compressed in one process
CODEC_BLOCK = 128
#: shares of at least this many values are rounded to multiples of it
PIECE_ALIGN = 256


def piece_length(size: int, servers: int) -> int:
    """The length of every full piece of a split key: an even share, rounded up to a
    multiple of PIECE_ALIGN when it is at least that long, else of CODEC_BLOCK (a key of
    at most CODEC_BLOCK values is one piece)."""
    share = -(-size // servers)
    align = PIECE_ALIGN if share >= PIECE_ALIGN else CODEC_BLOCK
    return -(-share // align) * align

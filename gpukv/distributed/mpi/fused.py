"""A small sum that carries its own agreement: one allreduce where a round would post two.

A collective call is agreed on before its data is summed (`agree.Agreement`). For a small
round the agreement's own allreduce costs as much as the data's, so when every rank can
tell in advance that the call will be a small sum of a known dtype and length, the
agreement travels inside the sum: the first 16 elements of the buffer carry each rank's
stamp (its call's checksum in 8 four-bit digits, and their squares), the rest its data.
After the SUM every rank can check that all sent the same stamp (for each digit, the sum
of squares is N times the squared mean only when every rank sent the same digit), and
that it is the one foretold; the data then holds the round's sum. (The call's number,
which an agreement also checks, needs no check here: every call so far was agreed, one
collective call for one, so the calls being matched have the same number.)

MPI needs every rank to post the same count, so the dtype and length come from what every
rank knows alike: the calls agreed so far. A `Forecast` foretells the next call from the
one before it once the same call has followed it twice in a row (a training loop repeats
its calls). A rank whose call is not the one foretold still posts the foretold sum
(stamped as no rank making the foretold call stamps, and zeros), and every rank then
agrees the usual way, so a rank calling something else is named as it always was.
Digit sums are exact small integers in every dtype taken here, whatever order MPI sums
them in.
"""
from __future__ import annotations

import typing

import numpy as np

#: rounds of at most this many bytes carry their agreement
FUSE_BYTES = 64 << 10
#: dtypes whose sums of small integers are exact (the digits' sums must be)
FUSIBLE = frozenset(np.dtype(d) for d in ("float32", "float64", "int32", "int64"))
#: the checksum's 4-bit digits
_DIGITS = 8
#: elements the stamp takes at the front of the buffer: the digits, then their squares
STAMP = 2 * _DIGITS
#: calls a forecast remembers what followed (a loop repeats a few)
_KEPT = 4096


class FusedSum(typing.NamedTuple):
    """A call's sum that may carry its agreement: `spec` = (dtype, count), which every
    rank must post alike; `fill(buffer)` writes this rank's `count` values into
    `buffer`; `take(sums)` delivers the round's sums and returns what the call's own
    collectives would have (no requests left to wait for)."""
    spec: tuple
    fill: typing.Callable
    take: typing.Callable


def fusible(dtype, count: int) -> bool:
    """Whether a sum of `count` values of `dtype` may carry its agreement."""
    dtype = np.dtype(dtype)
    return dtype in FUSIBLE and 0 < count * dtype.itemsize <= FUSE_BYTES


class Forecast:
    """What the next collective call will be, foretold alike on every rank from the calls
    agreed so far: (checksum, spec) of the call that followed the last one the last two
    times, when that call was a fused sum."""

    def __init__(self) -> None:
        self._last: int | None = None
        self._after: dict = {}  # checksum -> [next checksum, its spec, times in a row]

    def guess(self) -> tuple | None:
        """(checksum, spec) foretold for the next call, or None."""
        seen = self._after.get(self._last)
        if seen is None or seen[2] < 2:
            return None
        return seen[0], seen[1]

    def learn(self, crc: int, spec: tuple | None) -> None:
        """Every rank agreed on the call of checksum `crc` (its fused spec, or None)."""
        seen = self._after.get(self._last)
        if spec is None:
            self._after.pop(self._last, None)
        elif seen is not None and seen[0] == crc and seen[1] == spec:
            seen[2] += 1
        else:
            if seen is None and len(self._after) >= _KEPT:
                self._after.clear()  # (every rank alike: a loop is learned again)
            self._after[self._last] = [crc, spec, 1]
        self._last = crc


class Stamps:
    """The stamps of checksums (and what N ranks' stamps sum to), kept for the few a
    loop repeats."""

    def __init__(self, ranks: int, kept: int = 64) -> None:
        self._ranks = ranks
        self._kept = kept
        self._made: dict = {}

    def of(self, crc: int) -> tuple:
        """(`crc`'s stamp: its int64 digits, then their squares; {dtype: the bytes of N
        ranks' stamps summed in it}, filled as `sent_by_all` meets each dtype)."""
        made = self._made.get(crc)
        if made is None:
            digits = np.array([(crc >> (4 * i)) & 15 for i in range(_DIGITS)], np.int64)
            made = (np.concatenate([digits, digits * digits]), {})
            if len(self._made) < self._kept:
                self._made[crc] = made
        return made

    def write(self, buffer: np.ndarray, crc: int) -> None:
        """Stamp `buffer[:STAMP]` with `crc`."""
        buffer[:STAMP] = self.of(crc)[0]

    def sent_by_all(self, sums: np.ndarray, crc: int) -> bool:
        """Whether every rank stamped `crc`, from the summed stamps `sums[:STAMP]`: each
        digit sums to N times itself and its square to N times its square, which, for
        digits of 0-15, holds only when every rank sent that digit (the squares' spread
        about their mean is then 0)."""
        stamp, summed = self.of(crc)
        expected = summed.get(sums.dtype)
        if expected is None:
            expected = summed[sums.dtype] = (stamp * self._ranks).astype(sums.dtype).tobytes()
        return sums[:STAMP].tobytes() == expected


class Buffers:
    """The send and sum buffers of fused sums, by spec, reused: a sum is waited for
    before its call returns, and a failed transport is never used again."""

    def __init__(self, kept: int = 16) -> None:
        self._kept = kept
        self._pairs: dict = {}

    def of(self, spec: tuple) -> tuple:
        """(send, sums) for `spec` = (dtype, count): `STAMP + count` elements each."""
        pair = self._pairs.get(spec)
        if pair is None:
            dtype, count = spec
            pair = (np.empty(STAMP + count, dtype), np.empty(STAMP + count, dtype))
            if len(self._pairs) < self._kept:
                self._pairs[spec] = pair
        return pair

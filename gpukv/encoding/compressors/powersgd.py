"""``{'type': 'powersgd', 'rank': R}`` (R: a positive int, default 4): PowerSGD (Vogels,
Karimireddy and Jaggi, NeurIPS 2019; PyTorch DDP's ``powerSGD_hook``), low-rank with
warm start and error feedback.

A key of two or more dimensions is viewed as a matrix M of shape[0] rows. Each source
adds its residual to its gradient (M_i), and one push is two sums:
``P = orth(sum_i M_i Q)``, then ``Q' = sum_i M_i^T P``; the key's sum is ``P Q'^T`` and
each source keeps ``M_i - P Q_i^T`` as its residual. Q' is the next push's Q (warm
start; the first comes from a seed of the key, the same in every process), but for its
columns that are zero or not finite, drawn afresh from that seed: a sum of rank below R
(all zeros, a single row) would otherwise leave them zero for good. P and Q cross
instead of M: R * (rows + cols) values instead of rows * cols.

Keys of one dimension, and matrices it would not cut at least 2x (R * (rows + cols) * 2
> rows * cols, as PyTorch's ``min_compression_rate``), are sent as they are,
uncompressed.

The sums are the engine's (a one-process store's home, or in a dist store two
allreduces among the workers of every key's P and Q; with servers each worker then sends
a share of the decoded sum), so nothing here is a payload on its own. The parts
every process must compute to the same bits, the orthogonalisation and ``P Q^T``, use
exact dot products (`math.fsum`) and elementwise float32 operations in a fixed order,
never a BLAS reduction, whose order depends on the CPU: every worker decodes the sum
itself, so the pull costs nothing when no updater runs on the store.
"""
from __future__ import annotations

import math
import numbers
import re
import zlib

import numpy as np

from ..._errors import ArgumentError, ArgumentKindError
from ...device import host_jit
from .base import Compressor, short
from .registry import register

#: a matrix is compressed only when P and Q are at most 1/MIN_RATE of its values
MIN_RATE = 2
#: the largest rank taken (beyond it, low-rank is not what is wanted)
MAX_RANK = 1024


@register("powersgd")
class PowerSGD(Compressor):
    """Low-rank compression of matrices with warm start and error feedback; see the
    module's docstring. The stores and engines run its two sums (`low_rank` says so)."""

    name = "powersgd"
    options = {"rank": 4}
    uses_residual = True
    low_rank = True

    def __init__(self, rank: int = 4):
        self.rank = rank
        self._q: dict = {}  # key -> the Q of its last push (warm start)

    @classmethod
    def build(cls, kind: str, params: dict) -> Compressor:
        value = params.get("rank", 4)
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            value = int(value)  # MXNet passes options as strings
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise ArgumentKindError(f"gradient compression {kind!r}: option 'rank' must be "
                                    f"an int (or its digits, as MXNet passes options), got "
                                    f"{type(value).__name__} {short(value)}")
        rank = int(value)
        if not 1 <= rank <= MAX_RANK:
            raise ArgumentError(f"gradient compression {kind!r}: option 'rank' must be "
                                f"between 1 and {MAX_RANK}, got {short(value)}")
        return cls(rank)

    def params(self):
        return {"type": "powersgd", "rank": self.rank}

    def matrix(self, shape) -> tuple | None:
        """(rows, cols) of a key of `shape` viewed as a matrix, or None: sent as it is."""
        if len(shape) < 2:
            return None
        rows, cols = int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))
        if self.rank * (rows + cols) * MIN_RATE > rows * cols:
            return None
        return rows, cols

    def compresses(self, shape) -> bool:
        return self.matrix(shape) is not None

    def warm_q(self, key, cols: int) -> np.ndarray:
        """The Q of `key`'s next push: its last push's, or the first, drawn from a seed
        of the key and its size (the same in every process)."""
        q = self._q.get(key)
        if q is None or q.shape != (cols, self.rank):
            q = self._seeded(key, cols)
        return q

    def _seeded(self, key, cols: int) -> np.ndarray:
        seed = zlib.crc32(repr((key, cols, self.rank)).encode())
        return np.random.default_rng(seed).standard_normal((cols, self.rank)).astype(np.float32)

    def keep_q(self, key, q: np.ndarray) -> None:
        """Keep `q` as `key`'s next warm start. A column of it that is zero (a sum of
        rank below R: all zeros, one row) or not finite is drawn afresh from the key's
        seed: kept, it would stay so in every later push, and the key would cross at a
        lower rank, or as zeros, for good."""
        spent = ~(np.isfinite(q).all(axis=0) & q.any(axis=0))
        if spent.any():
            q = q.copy()
            q[:, spent] = self._seeded(key, q.shape[0])[:, spent]
        self._q[key] = q

    def warm_starts(self) -> dict:
        """key -> the Q its next push starts from, for every key pushed so far (what a
        snapshot keeps; `keep_q` puts one back)."""
        return dict(self._q)

    def nbytes(self, shape) -> int:
        """Bytes one source sends for a key of `shape`: P and Q, or the float32 values."""
        found = self.matrix(shape)
        if found is None:
            return 4 * int(np.prod(shape, dtype=np.int64))
        rows, cols = found
        return 4 * self.rank * (rows + cols)


def exact_dot(a: np.ndarray, b: np.ndarray) -> float:
    """a . b, correctly rounded (every float32 product is exact in float64, and fsum
    adds them exactly): the same bits on every machine, unlike a BLAS dot."""
    return math.fsum((a.astype(np.float64) * b).tolist())


def orthogonalize(p: np.ndarray) -> None:
    """Gram-Schmidt on the columns of float32 `p`, in place, in a fixed order of exact
    dot products and float32 operations; a column that comes out zero stays zero.

    Each column is taken out of the earlier ones twice ("twice is enough"): once leaves
    rounding noise where a column lay in the span of the others (a gradient of rank below
    R), and that noise, normalised, would not be orthogonal to them."""
    for i in range(p.shape[1]):
        col = p[:, i]
        for _ in range(2):
            for j in range(i):
                col -= np.float32(exact_dot(p[:, j], col)) * p[:, j]
        norm = math.sqrt(exact_dot(col, col))
        if norm > 0:
            col /= np.float32(norm)


def decode(p: np.ndarray, q: np.ndarray, out: np.ndarray, scratch=None) -> None:
    """out = P Q^T (float32, rows x cols) as rank-one terms added in order: elementwise
    float32 operations, the same bits on every machine (on the host, compiled by Numba
    when it is installed: the same operations in one pass). `scratch`: an array like
    `out` for a term, None to make one when needed."""
    if isinstance(out, np.ndarray) and host_jit.enabled():
        host_jit.low_rank_product(p, q, out)
        return
    if scratch is None:
        scratch = np.empty_like(out)
    np.multiply(p[:, 0:1], q[:, 0], out=out)
    for k in range(1, p.shape[1]):
        np.multiply(p[:, k:k + 1], q[:, k], out=scratch)
        out += scratch


def step(comp: PowerSGD, keys: list, sources: list, summed, outs=None) -> list:
    """One push of `keys` (PowerSGD's rule, see the module): `sources[k]` holds key k's
    matrices M_i (gradient plus residual, float32, rows x cols), left as their new
    residuals M_i - P Q_i^T; `summed(lists, name)` turns one list of arrays per key into
    each list's sum over every source (in this process, or across processes), `name`
    saying which ('P', then 'Q'). Returns each
    key's sum P Q'^T, decoded in a fixed order: the same bits wherever P and Q' are;
    into `outs[k]` (float32, rows x cols, contiguous) where given and not None. An inf
    or NaN makes its matrix's sum NaN, without NumPy's warnings on the way."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return _step(comp, keys, sources, summed, outs)


def _step(comp: PowerSGD, keys: list, sources: list, summed, outs) -> list:
    ps = summed([[m @ comp.warm_q(key, m.shape[1]) for m in ms]
                 for key, ms in zip(keys, sources)], "P")
    for p in ps:
        orthogonalize(p)
    q_parts = [[m.T @ p for m in ms] for ms, p in zip(sources, ps)]
    for ms, p, parts in zip(sources, ps, q_parts):
        for m, q_i in zip(ms, parts):  # each source keeps what P Q_i^T misses of its M
            m -= p @ q_i.T  # its own: BLAS's order is fine
    qs = summed(q_parts, "Q")
    totals = []
    for k, (key, p, q) in enumerate(zip(keys, ps, qs)):
        total = outs[k] if outs is not None and outs[k] is not None else None
        if total is None:
            total = np.empty((p.shape[0], q.shape[0]), np.float32)
        decode(p, q, total)
        comp.keep_q(key, q)
        totals.append(total)
    return totals

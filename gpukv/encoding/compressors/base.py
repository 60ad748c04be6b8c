"""What every compressor is: `compress(x, residual) -> (payload, ctx)` and
`decompress(payload, ctx, out, accumulate=False)`, Horovod's shape, wrapped around a
reduction rather than replacing it; with the options it takes and how they are checked.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from ..._errors import ArgumentError, ArgumentKindError
from ...device import codecs

_F32 = np.finfo(np.float32)


class Ctx(NamedTuple):
    """What `decompress` needs besides the payload: the size and shape of the value."""
    size: int
    shape: tuple


class KernelTraffic(NamedTuple):
    """One CUDA kernel of a compressor, as `gpukv info --kernels` reports it: the bytes
    it reads and writes per element, and for which case."""
    label: str
    function: str
    read: float
    written: float
    traffic: str


class Compressor:
    """compress(x, residual) -> (payload, ctx); decompress(payload, ctx, out) -> out.

    Around a reduction: with `sums_payload` the strategy sums the payloads themselves
    (into a float32 out) and `finish(total)` turns that sum into the sum of the decoded
    values; otherwise each source's decoded float32 value is the term it sums. A
    compressor that `uses_residual` is given the residual of error feedback of the value
    it compresses (`ErrorFeedback` keeps them) and moves it on.

    A subclass registers under its type names (`registry.register`), and declares its
    `options` (name -> default), those that must be `positive`, and its CUDA `kernels`.
    """

    name = ""
    uses_residual = False
    sums_payload = False
    compresses_pulls = False
    low_rank = False  # PowerSGD: two sums per push, run by the store or engine
    options: dict = {}
    positive: tuple = ()
    kernels: tuple = ()

    @classmethod
    def build(cls, kind: str, params: dict) -> Compressor:
        """The compressor of type `kind` with the options of `params`, checked (the
        option names already are): each a float32 number, and > 0 where `positive`."""
        values = {option: number(kind, option, params.get(option, default))
                  for option, default in cls.options.items()}
        for option in cls.positive:
            if values[option] <= 0:
                given = params.get(option, values[option])
                raise ArgumentError(f"gradient compression {kind!r}: option {option!r} must "
                                    f"be greater than 0, got {short(given)}")
        return cls.made(kind, values)

    @classmethod
    def made(cls, kind: str, values: dict) -> Compressor:
        return cls(**values)

    def compress(self, x, residual=None):
        raise NotImplementedError

    def compresses(self, shape) -> bool:
        """Whether a floating-point key of `shape` is compressed (else sent as it is)."""
        return True

    def payload_format(self, n: int) -> tuple:
        """(dtype, bytes) of the payload of `n` float32 values (kept per size: a receiver
        posts its buffer before the payload comes)."""
        formats = self.__dict__.setdefault("_formats", {})
        found = formats.get(n)
        if found is None:
            residual = np.zeros(n, np.float32) if self.uses_residual else None
            payload, _ = self.compress(np.zeros(n, np.float32), residual)
            found = formats[n] = (payload.dtype, payload.nbytes)
        return found

    @property
    def residual_bound(self) -> float | None:
        """A magnitude the residual of error feedback stays within while the rule keeps
        up with the gradients (None: no bound to watch); past it, the rule is losing
        accuracy, and `ErrorFeedback` warns once per key."""
        return None

    def decompress(self, payload, ctx: Ctx, out=None, accumulate: bool = False):
        """The float32 value of `payload`, written into `out` (or added to it)."""
        raise NotImplementedError

    @property
    def finishes(self) -> bool:
        """Whether `finish` has anything to do."""
        return False

    def finish(self, total) -> None:
        """Turn the strategy's sum of the payloads into the sum of their values, in place."""

    def _out(self, payload, ctx, out):
        if out is None:
            out = codecs.empty_f32(payload, ctx.shape)
        return out

    def params(self) -> dict:
        raise NotImplementedError

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"<gpukv compressor {opts}>"


class ResidualCodec(Compressor):
    """A codec with error feedback: `_quantize(g, residual)` packs the flat float32
    gradient plus its residual (and leaves the residual moved on), `_dequantize` decodes
    a payload into a flat float32 out, or adds it there."""

    uses_residual = True

    def compress(self, x, residual=None):
        g = codecs.flat_f32(x)
        if residual is None:
            residual = codecs.empty_f32(g, g.size)
            residual.fill(0)
        return self._quantize(g, residual), Ctx(g.size, tuple(x.shape))

    def decompress(self, payload, ctx, out=None, accumulate=False):
        out = self._out(payload, ctx, out)
        self._dequantize(payload, ctx.size, out.reshape(-1), accumulate)
        return out

    def _quantize(self, g, residual):
        raise NotImplementedError

    def _dequantize(self, payload, size, out, accumulate):
        raise NotImplementedError


class Quantizer(ResidualCodec):
    """MXNet's quantisers: bits packed from the gradient plus its residual, by a
    threshold."""

    options = {"threshold": 0.5}

    def __init__(self, threshold: float = 0.5):
        self.threshold = float(np.float32(threshold))

    def params(self):
        return {"type": self.name, "threshold": self.threshold}


def short(value) -> str:
    """repr(value), cut short: an int such as 10**400 has hundreds of digits."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def number(kind, option, value) -> float:
    """`value` as a float that float32, the precision the kernels run in, keeps as it
    means it: finite once rounded to float32, and zero or at least float32's smallest
    normal in magnitude (a GPU flushes smaller values to zero)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, str)):
        raise ArgumentKindError(f"gradient compression {kind!r}: option {option!r} must be a "
                                f"number, got {type(value).__name__}")
    prefix = f"gradient compression {kind!r}: option {option!r}"
    try:
        result = float(value)  # MXNet passes options as strings; accept '0.5' too
    except (ValueError, OverflowError):
        raise ArgumentError(f"{prefix} must be a float32 number, got {short(value)}") from None
    with np.errstate(over="ignore"):
        rounded = abs(float(np.float32(result)))
    if not math.isfinite(rounded):
        raise ArgumentError(f"{prefix} must be a finite float32 number (magnitude at most "
                            f"{str(_F32.max)}), got {short(value)}")
    if result != 0 and rounded < _F32.tiny:
        raise ArgumentError(f"{prefix} is {short(value)}: in float32 a magnitude below "
                            f"{str(_F32.tiny)} (its smallest normal number) is 0 on a GPU")
    return result


def compressible(dtype) -> bool:
    """Whether values of `dtype` are compressed (floating point) or sent as they are."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def compresses_key(comp: Compressor | None, dtype, shape) -> bool:
    """Whether `comp` (None: no compression set) compresses a key of `dtype` and `shape`:
    a floating-point key of a shape it takes (PowerSGD: matrices it cuts)."""
    return comp is not None and compressible(dtype) and comp.compresses(shape)

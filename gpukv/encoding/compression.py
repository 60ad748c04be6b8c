"""Gradient compression: what a pushed value looks like on its way to the key's home.

`kv.set_gradient_compression({'type': ..., ...})` picks one of:

- ``{'type': '2bit', 'threshold': t}`` (t > 0, default 0.5): MXNet's rule with error
  feedback. Each source keeps a residual r per (key, source device): r += g; where
  r >= t the source sends +t and r -= t; where r <= -t it sends -t and r += t; else 0.
  Sixteen values travel in one 32-bit word, packed exactly as MXNet packs them.
- ``{'type': '1bit', 'threshold': t}`` (any t, default 0.5): MXNet master's rule:
  r += g; where r > t the bit is 1 and r -= 1, else the bit is 0 and r += 1. Bits decode
  to +1 / -1; 32 values per word.
- ``{'type': 'fp16'}`` / ``{'type': 'bf16'}``, optional ``'pre_divide': f`` (f > 0,
  default 1): each source is divided by f, rounded to the 16-bit type, and multiplied by
  f again at home, so values up to f times the type's range survive the trip.
- ``None`` or ``{'type': 'none'}``: no compression (the default).

Options are numbers (or strings of numbers, as MXNet passes them) checked in float32,
the precision the kernels run in: one that is inf there, or nonzero but below float32's
smallest normal number (0 or flushed to 0 on a GPU), is refused.

Every source of a dense floating-point key is compressed, the home device's own source
too, so no device is favoured, and the updater sees the float32 sum of the trips.
Integer keys and row-sparse pushes travel uncompressed; init and pull are never
compressed (as in MXNet).

Compressors have Horovod's shape: ``compress(x, residual) -> (payload, ctx)`` and
``decompress(payload, ctx, out, accumulate=False)``, wrapped around the reduction rather
than replacing it. A compressed push is an ordinary reduce job for whichever strategy
the store picks::

    terms = comp.encode(key, sources, devices)    # one array per source, on its device
    strategy.reduce_many([ReduceJob(key, terms, devices, home, out)])
    comp.finish(key, out, home)                   # e.g. the pre_divide scale, at home

`out` is a float32 array on `home` (`comp.buffer(key, home, shape)` keeps one for keys
whose own dtype is wider). The strategies add terms of another dtype than `out` in
float32. The 'home' strategy adds them in source order (on a GPU, those it reads
directly, then those it stages), so its sum is each source's decoded value added in
turn, bit for bit; fp16 payloads are summed first and scaled once (see `Cast`).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from .._errors import ArgumentError, ArgumentKindError
from ..device import codecs as _k

__all__ = ["Compressor", "TwoBit", "OneBit", "Cast", "GradientCompression", "make_compressor"]

_OPTIONS = {
    "2bit": ("threshold",),
    "1bit": ("threshold",),
    "fp16": ("pre_divide",),
    "bf16": ("pre_divide",),
    "none": (),
}


class Ctx(NamedTuple):
    """What `decompress` needs besides the payload: the size and shape of the value."""
    size: int
    shape: tuple


class Compressor:
    """compress(x, residual) -> (payload, ctx); decompress(payload, ctx, out) -> out.

    Around a reduction: with `sums_payload` the strategy sums the payloads themselves
    (into a float32 out) and `finish(total)` turns that sum into the sum of the decoded
    values; otherwise each source's decoded float32 value is the term it sums.
    """

    name = ""
    uses_residual = False
    sums_payload = False

    def compress(self, x, residual=None):
        raise NotImplementedError

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
            out = _k.empty_f32(payload, ctx.shape)
        return out

    def params(self) -> dict:
        raise NotImplementedError

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"<gpukv compressor {opts}>"


class _Threshold(Compressor):
    """A quantiser with error feedback: bits packed from the gradient plus its residual."""

    uses_residual = True

    def __init__(self, threshold: float = 0.5):
        self.threshold = float(np.float32(threshold))

    def compress(self, x, residual=None):
        g = _k.flat_f32(x)
        if residual is None:
            residual = _k.empty_f32(g, g.size)
            residual.fill(0)
        return self._quantize(g, residual), Ctx(g.size, tuple(x.shape))

    def decompress(self, payload, ctx, out=None, accumulate=False):
        out = self._out(payload, ctx, out)
        self._dequantize(payload, ctx.size, out.reshape(-1), accumulate)
        return out

    def params(self):
        return {"type": self.name, "threshold": self.threshold}


class TwoBit(_Threshold):
    """MXNet's 2-bit quantisation with error feedback (bytes identical to MXNet's)."""

    name = "2bit"

    def _quantize(self, g, residual):
        return _k.quantize_2bit(g, residual, self.threshold)

    def _dequantize(self, payload, size, out, accumulate):
        _k.dequantize_2bit(payload, size, self.threshold, out, accumulate)


class OneBit(_Threshold):
    """MXNet master's 1-bit quantisation with error feedback: bits decode to +1 / -1."""

    name = "1bit"

    def _quantize(self, g, residual):
        return _k.quantize_1bit(g, residual, self.threshold)

    def _dequantize(self, payload, size, out, accumulate):
        _k.dequantize_1bit(payload, size, out, accumulate)


class Cast(Compressor):
    """A cast to float16 or bfloat16 on the way, with an optional pre-divide factor.

    fp16 payloads are the terms a strategy sums: every strategy adds float16 sources
    into a float32 out exactly (each float16 is a float32), so the float32 sum of the
    payloads, times pre_divide once at home, is as accurate as the sum of the decoded
    values (the same bits for a power-of-two pre_divide, one rounding fewer per source
    otherwise), and half the bytes cross the links. bf16 payloads are bit patterns
    (uint16): NumPy has no bfloat16 type without the optional ml_dtypes, nor CuPy one at
    all, so a strategy would add them as integers; their decoded float32 values are the
    terms instead.
    """

    def __init__(self, kind: str = "fp16", pre_divide: float = 1.0):
        self.name = kind
        self.pre_divide = float(pre_divide)
        self.sums_payload = kind == "fp16"
        self._cast = _k.cast_fp16 if kind == "fp16" else _k.cast_bf16
        self._uncast = _k.uncast_fp16 if kind == "fp16" else _k.uncast_bf16

    def compress(self, x, residual=None):
        g = _k.flat_f32(x)
        return self._cast(g, self.pre_divide), Ctx(g.size, tuple(x.shape))

    def decompress(self, payload, ctx, out=None, accumulate=False):
        out = self._out(payload, ctx, out)
        self._uncast(payload, self.pre_divide, out.reshape(-1), accumulate)
        return out

    @property
    def finishes(self) -> bool:
        return self.sums_payload and self.pre_divide != 1.0

    def finish(self, total) -> None:
        if self.finishes:
            _k.scale_in_place(total, self.pre_divide)

    def params(self):
        return {"type": self.name, "pre_divide": self.pre_divide}


_F32 = np.finfo(np.float32)


def _short(value) -> str:
    """repr(value), cut short: an int such as 10**400 has hundreds of digits."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def _number(kind, option, value) -> float:
    """`value` as a float that float32, the precision the kernels run in, keeps as it
    means it: finite once rounded to float32, and zero or at least float32's smallest
    normal in magnitude (a GPU flushes smaller values to zero)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, str)):
        raise ArgumentKindError(f"gradient compression {kind!r}: option {option!r} must be a "
                                f"number, got {type(value).__name__}")
    prefix = f"gradient compression {kind!r}: option {option!r}"
    try:
        number = float(value)  # MXNet passes options as strings; accept '0.5' too
    except (ValueError, OverflowError):
        raise ArgumentError(f"{prefix} must be a float32 number, got {_short(value)}") from None
    with np.errstate(over="ignore"):
        rounded = abs(float(np.float32(number)))
    if not math.isfinite(rounded):
        raise ArgumentError(f"{prefix} must be a finite float32 number (magnitude at most "
                            f"{str(_F32.max)}), got {_short(value)}")
    if number != 0 and rounded < _F32.tiny:
        raise ArgumentError(f"{prefix} is {_short(value)}: in float32 a magnitude below "
                            f"{str(_F32.tiny)} (its smallest normal number) is 0 on a GPU")
    return number


def make_compressor(params) -> Compressor | None:
    """Validate a compression dict and build its compressor (None: no compression)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ArgumentKindError(
            f"gradient compression: expected a dict such as {{'type': '2bit', "
            f"'threshold': 0.5}}, got {type(params).__name__}")
    if "type" not in params:
        raise ArgumentError(f"gradient compression {params!r}: option 'type' is missing; "
                            f"valid types are {', '.join(sorted(_OPTIONS))}")
    kind = params["type"]
    if not isinstance(kind, str) or kind.lower() not in _OPTIONS:
        raise ArgumentError(f"gradient compression: option 'type' is {kind!r}; valid types "
                            f"are {', '.join(sorted(_OPTIONS))}")
    kind = kind.lower()
    allowed = _OPTIONS[kind]
    for option in params:
        if option != "type" and option not in allowed:
            valid = ", ".join(("type",) + allowed)
            raise ArgumentError(f"gradient compression {kind!r}: unknown option {option!r}; "
                                f"valid options are {valid}")
    if kind == "none":
        return None
    if kind in ("2bit", "1bit"):
        threshold = _number(kind, "threshold", params.get("threshold", 0.5))
        if kind == "2bit":
            if threshold <= 0:
                raise ArgumentError(f"gradient compression '2bit': option 'threshold' must "
                                    f"be greater than 0, got {_short(params['threshold'])}")
            return TwoBit(threshold)
        return OneBit(threshold)
    pre_divide = _number(kind, "pre_divide", params.get("pre_divide", 1.0))
    if pre_divide <= 0:
        raise ArgumentError(f"gradient compression {kind!r}: option 'pre_divide' must be "
                            f"greater than 0, got {_short(params['pre_divide'])}")
    return Cast(kind, pre_divide)


def compressible(dtype) -> bool:
    """Whether values of `dtype` are compressed (floating point) or sent as they are."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


class GradientCompression:
    """A store's compressor plus what it keeps per (key, source device): the residuals
    of error feedback, and the buffers the sources' decoded values are written into."""

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self._residuals: dict = {}
        self._decoded: dict = {}
        self._buffers: dict = {}

    def params(self) -> dict:
        return self.compressor.params()

    def residual(self, key, device, size: int):
        """The residual of `key` on `device` (zeros the first time)."""
        slot = (key, device)
        r = self._residuals.get(slot)
        if r is None or r.size != size:
            with device.activate():  # zero-filled on the stream the kernels use it on
                r = device.zeros(size, np.float32)
            self._residuals[slot] = r
        return r

    def buffer(self, key, home, shape):
        """A float32 buffer on `home` for the sum of `key`'s terms (for keys whose own
        dtype is neither float32 nor a 16-bit float, which have a merge buffer)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tuple(shape):
            buf = home.empty(shape, np.float32)
            self._buffers[key] = buf
        return buf

    def _decoded_buffer(self, key, device, nth: int, shape):
        """The float32 buffer for the decoded value of `key`'s `nth` source on `device`
        (allocated inside the device's `activate`)."""
        slot = (key, device, nth)
        buf = self._decoded.get(slot)
        if buf is None or buf.shape != tuple(shape):
            buf = device.empty(shape, np.float32)
            self._decoded[slot] = buf
        return buf

    def reserve(self, key, sources, devices) -> None:
        """Allocate now what `encode` keeps for `key` (residuals, decoded buffers), so that
        a push short of memory fails while it is still checked, before anything moved."""
        comp = self.compressor
        seen: dict = {}
        for source, device in zip(sources, devices):
            nth = seen[device] = seen.get(device, -1) + 1
            if comp.uses_residual:
                self.residual(key, device, source.size)
            if not comp.sums_payload:
                with device.activate():
                    self._decoded_buffer(key, device, nth, source.shape)

    def encode(self, key, sources, devices) -> list:
        """One term per source, on that source's device, for a strategy to sum into
        `key`'s float32 out at home; `finish` follows the reduction.

        Call it once every check has passed: it moves the residuals on. The terms are
        the decoded values (2bit, 1bit, bf16), kept in per-(key, device) buffers that the
        next push reuses, or the payloads themselves (fp16). Each device's work is queued
        on its stream after the caller's work on CuPy's current stream; the strategy's
        own join then orders the next push's reuse of the buffers after every read.
        """
        comp = self.compressor
        for device in dict.fromkeys(devices):
            device.enter()
        terms: list = []
        seen: dict = {}
        for source, device in zip(sources, devices):
            nth = seen[device] = seen.get(device, -1) + 1
            residual = self.residual(key, device, source.size) if comp.uses_residual else None
            with device.activate():
                payload, ctx = comp.compress(source, residual)
                if comp.sums_payload:
                    terms.append(payload.reshape(ctx.shape))
                else:
                    decoded = self._decoded_buffer(key, device, nth, ctx.shape)
                    terms.append(comp.decompress(payload, ctx, decoded))
        return terms

    def finish(self, key, out, home) -> None:
        """The step at `home` after a strategy summed `key`'s terms into `out` (fp16 with
        a pre_divide: the scale); the caller's current stream then sees `out`."""
        comp = self.compressor
        if not comp.finishes:
            return
        with home.activate():
            comp.finish(out)
        home.leave()

"""Gradient compression: what a pushed value looks like on its way to the key's home.

`kv.set_gradient_compression({'type': ..., ...})` picks one of:

- ``{'type': '2bit', 'threshold': t}`` (t > 0, default 0.5): MXNet's rule with error
  feedback. Each source keeps a residual r per (key, source device): r += g; where
  r >= t the source sends +t and r -= t; where r <= -t it sends -t and r += t; else 0.
  Sixteen values travel in one 32-bit word, packed exactly as MXNet packs them.
- ``{'type': '1bit', 'threshold': t}`` (any finite t, default 0.5): MXNet master's rule:
  r += g; where r > t the bit is 1 and r -= 1, else the bit is 0 and r += 1. Bits decode
  to +1 / -1; 32 values per word.
- ``{'type': 'fp16'}`` / ``{'type': 'bf16'}``, optional ``'pre_divide': f`` (f > 0,
  default 1): each source is divided by f, rounded to the 16-bit type, and multiplied by
  f again at home, so values up to f times the type's range survive the trip.
- ``None`` or ``{'type': 'none'}``: no compression (the default).

Every source of a dense floating-point key is compressed, the home device's own source
too, so no device is favoured; the payloads are decompressed on the home device and
summed in float32 there, and the updater sees that float32 sum. Integer keys and
row-sparse pushes travel uncompressed; init and pull are never compressed (as in MXNet).

Compressors have Horovod's shape: ``compress(x, residual) -> (payload, ctx)`` and
``decompress(payload, ctx, out, accumulate=False)``.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from ..device.cuda import compression_kernels as _k
from .._errors import ArgumentError, ArgumentKindError

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


def _flat_f32(x):
    """`x` as a flat, contiguous float32 array (a view when it already is one)."""
    xp = _k._xp(x)
    return xp.ascontiguousarray(x, dtype=xp.float32).reshape(-1)


class Compressor:
    """compress(x, residual) -> (payload, ctx); decompress(payload, ctx, out) -> out."""

    name = ""
    uses_residual = False

    def compress(self, x, residual=None):
        raise NotImplementedError

    def decompress(self, payload, ctx: Ctx, out=None, accumulate: bool = False):
        """The float32 value of `payload`, written into `out` (or added to it)."""
        raise NotImplementedError

    def _out(self, payload, ctx, out):
        if out is None:
            out = _k._xp(payload).empty(ctx.shape, np.float32)
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
        g = _flat_f32(x)
        if residual is None:
            residual = _k._xp(g).zeros(g.size, np.float32)
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
    """A cast to float16 or bfloat16 on the way, with an optional pre-divide factor."""

    def __init__(self, kind: str = "fp16", pre_divide: float = 1.0):
        self.name = kind
        self.pre_divide = float(pre_divide)
        self._cast = _k.cast_fp16 if kind == "fp16" else _k.cast_bf16
        self._uncast = _k.uncast_fp16 if kind == "fp16" else _k.uncast_bf16

    def compress(self, x, residual=None):
        g = _flat_f32(x)
        return self._cast(g, self.pre_divide), Ctx(g.size, tuple(x.shape))

    def decompress(self, payload, ctx, out=None, accumulate=False):
        out = self._out(payload, ctx, out)
        self._uncast(payload, self.pre_divide, out.reshape(-1), accumulate)
        return out

    def params(self):
        return {"type": self.name, "pre_divide": self.pre_divide}


def _number(kind, option, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, str)):
        raise ArgumentKindError(f"gradient compression {kind!r}: option {option!r} must be a "
                                f"number, got {type(value).__name__}")
    try:
        number = float(value)  # MXNet passes options as strings; accept '0.5' too
    except ValueError:
        raise ArgumentError(f"gradient compression {kind!r}: option {option!r} must be a "
                            f"number, got {value!r}") from None
    if not math.isfinite(number):
        raise ArgumentError(
            f"gradient compression {kind!r}: option {option!r} must be finite, got {value!r}")
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
                                    f"be greater than 0, got {params['threshold']!r}")
            return TwoBit(threshold)
        return OneBit(threshold)
    pre_divide = _number(kind, "pre_divide", params.get("pre_divide", 1.0))
    if pre_divide <= 0:
        raise ArgumentError(f"gradient compression {kind!r}: option 'pre_divide' must be "
                            f"greater than 0, got {params['pre_divide']!r}")
    return Cast(kind, pre_divide)


def compressible(dtype) -> bool:
    """Whether values of `dtype` are compressed (floating point) or sent as they are."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


class GradientCompression:
    """A store's compressor plus the residuals it keeps per (key, source device)."""

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self._residuals: dict = {}
        self._buffers: dict = {}

    def params(self) -> dict:
        return self.compressor.params()

    def residual(self, key, device, size: int):
        """The residual of `key` on `device` (zeros the first time)."""
        slot = (key, device)
        r = self._residuals.get(slot)
        if r is None or r.size != size:
            if device.kind == "gpu":
                # zero-filled on the stream the kernels that use it run on
                with device.cuda_device, device.stream:
                    r = device.zeros(size, np.float32)
            else:
                r = device.zeros(size, np.float32)
            self._residuals[slot] = r
        return r

    def buffer(self, key, home, shape):
        """A float32 buffer on `home` for the decompressed sum of `key`."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tuple(shape):
            buf = home.empty(shape, np.float32)
            self._buffers[key] = buf
        return buf

    def _compress_on(self, key, source, device):
        comp = self.compressor
        residual = self.residual(key, device, source.size) if comp.uses_residual else None
        if device.kind == "gpu":
            with device.cuda_device, device.stream:
                return comp.compress(source, residual)
        return comp.compress(source, residual)

    def reduce(self, key, sources, devices, home, out) -> None:
        """Compress every source on its device, decompress on `home`, sum into `out`.

        `out` is a float32 array on `home`. Payloads are summed in source order.
        """
        from ..comm.execute import begin, finish
        comp = self.compressor
        begin(list(devices) + [home])  # after the caller's work on its current streams
        for i, (source, device) in enumerate(zip(sources, devices)):
            payload, ctx = self._compress_on(key, source, device)
            if home.kind == "gpu":
                home.wait_for(device)
                with home.cuda_device, home.stream:
                    local = home.to_local(payload)
                    comp.decompress(local, ctx, out, accumulate=i > 0)
            else:
                if not isinstance(payload, np.ndarray):
                    with device.cuda_device:
                        payload = payload.get(stream=device.stream)
                comp.decompress(payload, ctx, out, accumulate=i > 0)
        # A source may be overwritten only after it was read, and the caller's current
        # streams see `out`.
        finish(devices, home)

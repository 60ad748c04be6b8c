"""``{'type': 'fp16'}`` / ``{'type': 'bf16'}``, optional ``'pre_divide': f`` (f > 0,
default 1): each value is divided by f, rounded to the 16-bit type, and multiplied by f
again at home, so values up to f times the type's range survive the trip."""
from __future__ import annotations

from ...device import codecs
from .base import Compressor, Ctx, KernelTraffic
from .registry import register


@register("fp16", "bf16")
class Cast(Compressor):
    """A cast to float16 or bfloat16 on the way, with an optional pre-divide factor.

    fp16 payloads are the terms a strategy sums: every strategy adds float16 sources
    into a float32 out exactly (each float16 is a float32), so the float32 sum of the
    payloads, times pre_divide once at home, is as accurate as the sum of the decoded
    values (the same bits for a power-of-two pre_divide, one rounding fewer per source
    otherwise), and half the bytes cross the links. bf16 payloads are bit patterns
    (uint16): NumPy has no bfloat16 type without the optional ml_dtypes, nor CuPy one at
    all, so a strategy would add them as integers; their decoded float32 values are the
    terms instead. On a GPU each direction is one kernel of gpukv's, four values a thread.
    """

    options = {"pre_divide": 1.0}
    kernels = tuple(
        KernelTraffic(f"{verb} {kind}", f"gpukv_{verb}_{kind}", read, written, why)
        for kind in ("fp16", "bf16")
        for verb, read, written, why in (("cast", 4, 2, "float32 in, codes out"),
                                         ("uncast", 2, 4, "without accumulate")))
    positive = ("pre_divide",)

    def __init__(self, kind: str = "fp16", pre_divide: float = 1.0):
        self.name = kind
        self.pre_divide = float(pre_divide)
        self.sums_payload = kind == "fp16"
        self._cast = codecs.cast_fp16 if kind == "fp16" else codecs.cast_bf16
        self._uncast = codecs.uncast_fp16 if kind == "fp16" else codecs.uncast_bf16

    @classmethod
    def made(cls, kind: str, values: dict) -> Compressor:
        return cls(kind, **values)

    def compress(self, x, residual=None):
        g = codecs.flat_f32(x)
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
            codecs.scale_in_place(total, self.pre_divide)

    def params(self):
        return {"type": self.name, "pre_divide": self.pre_divide}

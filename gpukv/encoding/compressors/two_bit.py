"""``{'type': '2bit', 'threshold': t}`` (t > 0, default 0.5): MXNet's rule with error
feedback. The residual r of each value: r += g; where r >= t the value sends +t and
r -= t; where r <= -t it sends -t and r += t; else 0. Sixteen values travel in one 32-bit
word, packed exactly as MXNet packs them."""
from __future__ import annotations

from ...device import codecs
from .base import KernelTraffic, Quantizer
from .registry import register


@register("2bit")
class TwoBit(Quantizer):
    """MXNet's 2-bit quantisation with error feedback (bytes identical to MXNet's)."""

    name = "2bit"
    positive = ("threshold",)
    kernels = (KernelTraffic("quantize 2bit", "gpukv_quantize_2bit", 8, 4.25,
                             "grad+residual in, out"),
               KernelTraffic("dequantize 2bit", "gpukv_dequantize_2bit", 0.25, 4,
                             "without accumulate"))

    @property
    def residual_bound(self) -> float:
        """8x the threshold: a residual past it grows because the gradients exceed the
        threshold, which sends at most t a push."""
        return 8 * self.threshold

    def _quantize(self, g, residual):
        return codecs.quantize_2bit(g, residual, self.threshold)

    def _dequantize(self, payload, size, out, accumulate):
        codecs.dequantize_2bit(payload, size, self.threshold, out, accumulate)

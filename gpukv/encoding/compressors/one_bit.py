"""``{'type': '1bit', 'threshold': t}`` (any t, default 0.5): MXNet master's rule with
error feedback: r += g; where r > t the bit is 1 and r -= 1, else the bit is 0 and r += 1.
Bits decode to +1 / -1; 32 values per word."""
from __future__ import annotations

from ...device import codecs
from .base import KernelTraffic, Quantizer
from .registry import register


@register("1bit")
class OneBit(Quantizer):
    """MXNet master's 1-bit quantisation with error feedback: bits decode to +1 / -1."""

    name = "1bit"
    kernels = (KernelTraffic("quantize 1bit", "gpukv_quantize_1bit", 8, 4.125,
                             "grad+residual in, out"),
               KernelTraffic("dequantize 1bit", "gpukv_dequantize_1bit", 0.125, 4,
                             "without accumulate"))

    @property
    def residual_bound(self) -> float:
        """8x the larger of 1 and |threshold|: each push moves the residual by 1 only,
        whatever the gradients' size."""
        return 8 * max(1.0, abs(self.threshold))

    def _quantize(self, g, residual):
        return codecs.quantize_1bit(g, residual, self.threshold)

    def _dequantize(self, payload, size, out, accumulate):
        codecs.dequantize_1bit(payload, size, out, accumulate)

"""``{'type': 'ternary'}``: thresholded ternary with error feedback (after TernGrad, Wen et
al. 2017, with the error feedback of EF-SignSGD). In each block of 128 values, those whose
magnitude exceeds 0.7 times the block's mean magnitude cross as +-the mean magnitude of
those sent, the others as 0; what the decoded value misses of gradient plus residual is
the next push's residual. A value costs a base-3 digit (five to a byte) and a block a
float32 scale: 128 float32 values cross in 30 bytes (a 17x cut). A block of finite
values whose magnitudes' float32 sum would overflow to inf (their mean past about
2.6e36) takes them divided by the largest, m, for the whole rule, its scale then
multiplied by m, so that it crosses finite. A block holding an inf or a NaN crosses as
NaN (every value +, the scale NaN), so that it shows where it lands.

Like 'sign' it has nothing to tune, and it compresses both ways: what workers pull crosses
as ternary payloads too (`gpukv.encoding.pulls`).
Where 'sign' moves every value by its block's scale each step, ternary leaves the small
ones in the residual until they count, which keeps early training closer to
uncompressed: on the accuracy benchmark's digits, after 5 epochs, it is within 1.1 pp of
uncompressed PyTorch on the MLP and the CNN, where 'sign' is within 2.0 (10 seeds,
benchmarks/bench_accuracy.py)."""
from __future__ import annotations

from ...device import codecs
from ...device.host_codecs import TERNARY_BLOCK, TERNARY_CODE_BYTES
from .base import KernelTraffic, ResidualCodec
from .registry import register

_BYTES = (4 + TERNARY_CODE_BYTES) / TERNARY_BLOCK  # payload bytes per value


@register("ternary")
class Ternary(ResidualCodec):
    """Thresholded ternary, 0 or +-a block's scale per value, with error feedback."""

    name = "ternary"
    compresses_pulls = True
    kernels = (KernelTraffic("quantize ternary", "gpukv_quantize_ternary", 8, 4 + _BYTES,
                             "grad+residual in, residual+payload out"),
               KernelTraffic("dequantize ternary", "gpukv_dequantize_ternary", _BYTES, 4,
                             "without accumulate"))

    def _quantize(self, g, residual):
        return codecs.quantize_ternary(g, residual)

    def _dequantize(self, payload, size, out, accumulate):
        codecs.dequantize_ternary(payload, size, out, accumulate)

    def params(self):
        return {"type": "ternary"}

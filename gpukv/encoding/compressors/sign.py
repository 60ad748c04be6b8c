"""``{'type': 'sign'}``: scaled sign with error feedback (after EF-SignSGD, Karimireddy et
al., "Error Feedback Fixes SignSGD", 2019). Each value crosses as one bit, its sign, and
each block of 64 values as one float32, the root mean square of the block; what the
decoded value misses of gradient plus residual is the next push's residual. A block of
finite values whose float32 sum of squares would overflow to inf (one value past about
1.8e19 does) or fall below float32's smallest normal (all its values about 1e-20 or
less) takes its root mean square as m * sqrt(mean((v / m)**2)), m its largest
magnitude: it crosses finite (a block of one repeated value as that value). A block
holding an inf or a NaN crosses with an inf or NaN scale.

Unlike 2bit/1bit it has nothing to tune: the scale follows the gradient's own size, so
the residual stays bounded whatever the gradients' scale, and 64 float32 values cross in
12 bytes (a 21x cut). It compresses both ways: what workers pull crosses as sign
payloads too (`gpukv.encoding.pulls`: with an optimizer on the store, its step is
compressed; with SGD's momentum the store then takes the step the workers take).

The root mean square, rather than the paper's mean absolute value,
sends a block's largest values sooner (the overshoot of the small ones comes back through
the residual): on the accuracy benchmark's CNN it keeps epoch 5 within 2 pp of
uncompressed training where the mean loses 10 (benchmarks/bench_accuracy.py)."""
from __future__ import annotations

from ...device import codecs
from .base import KernelTraffic, ResidualCodec
from .registry import register

_BITS = 0.125 + 4 / 64  # payload bytes per value: its bit and its share of a scale


@register("sign")
class Sign(ResidualCodec):
    """Scaled sign, 1 bit per value plus a float32 scale per 64 values, with error
    feedback: decodes to +-the block's root mean square."""

    name = "sign"
    compresses_pulls = True
    kernels = (KernelTraffic("quantize sign", "gpukv_quantize_sign", 8, 4 + _BITS,
                             "grad+residual in, residual+payload out"),
               KernelTraffic("dequantize sign", "gpukv_dequantize_sign", _BITS, 4,
                             "without accumulate"))

    def _quantize(self, g, residual):
        return codecs.quantize_sign(g, residual)

    def _dequantize(self, payload, size, out, accumulate):
        codecs.dequantize_sign(payload, size, out, accumulate)

    def params(self):
        return {"type": "sign"}

"""Gradient compressors, one module each, made by type name:
`set_gradient_compression({'type': T, ...})` builds the class registered as T.

- `two_bit` ('2bit'), `one_bit` ('1bit'), `cast` ('fp16', 'bf16'): MXNet's rules;
- `sign` ('sign'): scaled sign with error feedback, accurate without tuning;
- `ternary` ('ternary'): thresholded ternary with error feedback, closer to uncompressed
  training early on;
- `powersgd` ('powersgd'): low-rank with warm start and error feedback, its two sums run
  by the store or engine (`low_rank`);
- `base`: what a compressor is (`Compressor`, `Ctx`) and how options are checked;
- `registry`: `register`, `make_compressor`, `low_rank_compressor`, `registered`;
- `feedback`: `ErrorFeedback`, the residuals of error feedback around any compressor.

Adding a compressor: a module here with a `@register('name')` class (its options, its
`compress`/`decompress`, its kernels' traffic), its kernels in `gpukv.device.codecs`, and
its tests; `gpukv info --kernels` and the option checks follow from the registry.
"""
# each module registers its types
from . import cast, one_bit, powersgd, sign, ternary, two_bit  # noqa: F401
from .base import Compressor, Ctx, KernelTraffic, compresses_key, compressible
from .cast import Cast
from .feedback import ErrorFeedback
from .one_bit import OneBit
from .powersgd import PowerSGD
from .registry import low_rank_compressor, make_compressor, register, registered, type_names
from .sign import Sign
from .ternary import Ternary
from .two_bit import TwoBit

__all__ = ["Compressor", "Ctx", "KernelTraffic", "compressible", "compresses_key", "Cast",
           "OneBit", "PowerSGD", "Sign", "Ternary", "TwoBit",
           "ErrorFeedback", "low_rank_compressor", "make_compressor", "register", "registered",
           "type_names"]

"""The gradient-compression kernels, on host and GPU arrays alike: a NumPy array runs the
NumPy twin, a CuPy array the CUDA kernel (`cuda/compression_kernels.py` holds both; CuPy
is imported only for a GPU array)."""
from __future__ import annotations

from .cuda.compression_kernels import (
    cast_bf16,
    cast_fp16,
    dequantize_1bit,
    dequantize_2bit,
    empty_f32,
    flat_f32,
    quantize_1bit,
    quantize_2bit,
    scale_in_place,
    uncast_bf16,
    uncast_fp16,
)

__all__ = ["quantize_2bit", "dequantize_2bit", "quantize_1bit", "dequantize_1bit",
           "flat_f32", "empty_f32", "scale_in_place", "cast_fp16", "uncast_fp16",
           "cast_bf16", "uncast_bf16"]

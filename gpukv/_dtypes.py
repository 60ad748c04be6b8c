"""The dtypes the store takes, and which of them are summed in float32."""

# MXNet's dtypes plus bfloat16 (NumPy's via ml_dtypes, when a caller uses it).
SUPPORTED_DTYPES = frozenset(
    ["float16", "bfloat16", "float32", "float64", "uint8", "int8", "int32", "int64"])

#: 16-bit floats: summed and updated in float32, so a sum never overflows them.
NARROW_FLOATS = frozenset(["float16", "bfloat16"])

"""`cupy._util`: the warning CuPy gives for slow but valid use."""
from cudaemu.array import PerformanceWarning  # noqa: F401

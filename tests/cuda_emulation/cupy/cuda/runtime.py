"""`cupy.cuda.runtime` of the emulation."""
from cudaemu.runtime import runtime as _runtime

globals().update(vars(_runtime))

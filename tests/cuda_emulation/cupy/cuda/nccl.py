"""`cupy.cuda.nccl` of the emulation (see cudaemu/nccl.py)."""
from cudaemu.nccl import *  # noqa: F401,F403

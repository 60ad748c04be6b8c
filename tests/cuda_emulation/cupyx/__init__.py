"""`cupyx` of the emulation: scatter_add and pinned host arrays."""
from cudaemu.api import empty_pinned, scatter_add, zeros_pinned  # noqa: F401

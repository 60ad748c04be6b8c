"""`cupy.cuda` of the emulation: devices, streams, events, memory, runtime, NCCL."""
from cudaemu.errors import CUDARuntimeError  # noqa: F401
from cudaemu.memory import (  # noqa: F401
    BaseMemory,
    Memory,
    MemoryAsyncPool,
    MemoryPointer,
    MemoryPool,
    PinnedMemory,
    UnownedMemory,
    alloc,
    alloc_pinned_memory,
    get_allocator,
    set_allocator,
    using_allocator,
)
from cudaemu.runtime import (  # noqa: F401
    Device,
    Event,
    ExternalStream,
    Stream,
    get_current_stream,
    get_device_id,
    get_elapsed_time,
)

from . import runtime  # noqa: F401


def is_available() -> bool:
    return runtime.getDeviceCount() > 0


def __getattr__(name):
    if name == "nccl":  # imported on first use, as CuPy's is
        import importlib
        return importlib.import_module("cupy.cuda.nccl")
    raise AttributeError(f"module 'cupy.cuda' has no attribute {name!r}")

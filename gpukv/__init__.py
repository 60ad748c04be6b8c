"""gpukv: a key-value store for tensors shared by several devices and machines."""
from ._errors import (ArgumentError, ArgumentKindError, BackendError, CheckpointError,
                      DeviceError, DTypeError, DuplicateKeyError, GpukvError, KeyKindError,
                      ReadOnlyError, ShapeError, TransportError, UnknownKeyError)
from .store import KVStore, create

__version__ = "0.1.0"

__all__ = [
    "create", "KVStore", "GpukvError", "UnknownKeyError", "DuplicateKeyError",
    "KeyKindError", "ArgumentError", "ArgumentKindError", "ShapeError", "DTypeError",
    "ReadOnlyError", "DeviceError", "BackendError", "TransportError", "CheckpointError",
]

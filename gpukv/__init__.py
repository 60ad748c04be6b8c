"""gpukv: a key-value store for tensors shared by several devices and machines."""
from ._errors import (ArgumentError, ArgumentKindError, BackendError, CheckpointError,
                      DeviceError, DTypeError, DuplicateKeyError, GpukvError, KeyKindError,
                      OutOfMemoryError, ReadOnlyError, ShapeError, UnknownKeyError)
from .update.sparse import RowSparse
from .api.store import KVStore, create
from . import optim  # noqa: E402,F401  (gpukv.optim: optimizers for set_optimizer)

__version__ = "0.1.0"

__all__ = [
    "create", "KVStore", "RowSparse", "GpukvError", "UnknownKeyError", "DuplicateKeyError",
    "KeyKindError", "ArgumentError", "ArgumentKindError", "ShapeError", "DTypeError",
    "ReadOnlyError", "OutOfMemoryError", "DeviceError", "BackendError", "CheckpointError",
]

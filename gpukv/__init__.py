"""gpukv: a key-value store for tensors shared by several devices and machines."""
import logging

from . import optim  # noqa: E402,F401  (gpukv.optim: optimizers for set_optimizer)
from ._errors import (
                      ArgumentError,
                      ArgumentKindError,
                      BackendError,
                      CheckpointError,
                      DeviceError,
                      DTypeError,
                      DuplicateKeyError,
                      GpukvError,
                      KeyKindError,
                      OutOfMemoryError,
                      PeerError,
                      PeerMismatchError,
                      ReadOnlyError,
                      ShapeError,
                      UnknownKeyError,
)
from .api.factory import create
from .checkpoints.snapshots import Snapshot, latest_snapshot
from .encoding.sparse import RowSparse
from .store.base import KVStore

__version__ = "0.1.0"

# A library's notices go where the program's logging config sends them, and nowhere (not
# to stderr through logging's last resort) when the program configured none.
logging.getLogger("gpukv").addHandler(logging.NullHandler())

__all__ = [
    "create", "KVStore", "RowSparse", "Snapshot", "latest_snapshot", "GpukvError",
    "UnknownKeyError", "DuplicateKeyError",
    "KeyKindError", "ArgumentError", "ArgumentKindError", "ShapeError", "DTypeError",
    "ReadOnlyError", "OutOfMemoryError", "DeviceError", "BackendError", "CheckpointError",
    "PeerError", "PeerMismatchError",
]

"""gpukv: a key-value store for tensors shared by several devices and machines."""

from . import optim  # noqa: F401  (gpukv.optim: optimizers for set_optimizer)
from ._errors import (
                      ArgumentError,
                      ArgumentKindError,
                      BackendError,
                      CheckpointError,
                      CheckpointPathKindError,
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

# A library's notices go where the program's logging config sends them. The `gpukv`
# logger has no handler of its own: with no config, its warnings (a residual that grows
# without bound, a schedule a file cannot hold, frozen parameters that differed) reach
# stderr through logging's last resort, and its INFO lines stay quiet.

__all__ = [
    "create", "KVStore", "RowSparse", "Snapshot", "latest_snapshot", "GpukvError",
    "UnknownKeyError", "DuplicateKeyError",
    "KeyKindError", "ArgumentError", "ArgumentKindError", "ShapeError", "DTypeError",
    "ReadOnlyError", "OutOfMemoryError", "DeviceError", "BackendError", "CheckpointError",
    "CheckpointPathKindError", "PeerError", "PeerMismatchError",
]

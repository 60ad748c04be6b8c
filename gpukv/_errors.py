"""The exception hierarchy: one base, and subclasses that are also the built-in a user catches."""


class GpukvError(Exception):
    """Base of every error gpukv raises on purpose."""


class UnknownKeyError(GpukvError, KeyError):
    """A key that was never initialised."""

    def __str__(self):  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DuplicateKeyError(GpukvError, ValueError):
    """A key initialised twice."""


class KeyKindError(GpukvError, TypeError):
    """A key that is neither int nor str, or a kind other than the store's."""


class ArgumentError(GpukvError, ValueError):
    """A value out of range or lists of the wrong length."""


class ArgumentKindError(GpukvError, TypeError):
    """An argument of the wrong kind: not an array, or lists nested wrongly."""


class ShapeError(GpukvError, ValueError):
    """Arrays whose shapes do not agree."""


class DTypeError(GpukvError, ValueError):
    """A dtype the store does not take, or one that differs from the key's."""


class ReadOnlyError(GpukvError, ValueError):
    """An `out` array that cannot be written in place: read-only, a copy of the caller's
    object, or a tensor its library would not let be written there."""


class DeviceError(GpukvError, ValueError):
    """A device that does not exist."""


class OutOfMemoryError(GpukvError, MemoryError):
    """Memory a call needs that its device cannot give (the call changed nothing)."""


class BackendError(GpukvError, RuntimeError):
    """A backend (CuPy, NCCL, MPI) that is missing or failed."""


class CheckpointError(GpukvError, ValueError):
    """A checkpoint file that is missing, damaged or does not match the store."""


class CheckpointPathKindError(CheckpointError, TypeError):
    """A checkpoint path that is no path at all: not a str, bytes or os.PathLike."""


class PeerError(GpukvError, RuntimeError):
    """Another process of a `dist_*` store that died, stalled or failed: the store is
    broken from then on (every later call raises this again)."""


class PeerMismatchError(PeerError, ValueError):
    """Processes of a `dist_*` store that disagree on a call: another key, shape or dtype."""

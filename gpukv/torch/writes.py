"""Writes a program makes to the parameters between two steps. Where the store holds the
weights (update_on_kvstore=True) the step replaces them by the store's weights, so the
first one seen gets a warning that says so; where the replicas update in place, a 16-bit
parameter's float32 master copy follows the write."""
from __future__ import annotations

import warnings

from .buckets import Bucket


class WeightWritesLost(UserWarning):
    """A write to a parameter between steps that the next step replaces."""


class WeightWrites:
    """Watches the version counters of replica 0's parameters, which every in-place
    PyTorch write moves (`copy_`, `load_state_dict`, `torch.nn.init`, an operation under
    `no_grad`), but a write through `.data` or NumPy does not. A program writes every
    replica alike, so replica 0 stands for them all; the Trainer's own writes go through
    the bucket buffers and leave the counters alone. A check reads one attribute per
    parameter (about 60 ns), until the first warning; then none."""

    def __init__(self, buckets: list[Bucket]) -> None:
        #: (name, replica 0's parameter) of every parameter
        self._params = [(name, bucket.params[0][i]) for bucket in buckets
                        for i, name in enumerate(bucket.names)]
        self._seen: list[int] | None = self._versions()

    def _versions(self) -> list[int]:
        # (`_version` is how PyTorch shows a tensor's counter; autograd checks it so)
        return [p._version for _, p in self._params]  # noqa: SLF001

    def check(self) -> None:
        """Warn if a parameter was written since the last check (once: then stop)."""
        if self._seen is None:
            return
        now = self._versions()
        if now == self._seen:
            return
        name = next(n for (n, _), a, b in zip(self._params, now, self._seen) if a != b)
        self._seen = None
        warnings.warn(
            f"parameter {name!r} was written since the last step; with "
            f"update_on_kvstore=True the store holds the weights, and this step replaces "
            f"the write by the store's updated weights. Make the Trainer with "
            f"update_on_kvstore=False to write the parameters between steps (its "
            f"optimizer updates them in place, as a PyTorch optimizer does)",
            WeightWritesLost, stacklevel=4)


class ReplicaWrites:
    """Writes a program makes to 16-bit parameters between two steps of a Trainer whose
    replicas update in place (update_on_kvstore=False): their optimizer keeps a float32
    master copy of each, which must follow a write. Seen through the version counters of
    every replica's float16/bfloat16 parameters (a write through `.data` or NumPy does not
    move them)."""

    def __init__(self, buckets: list[Bucket]) -> None:
        #: (bucket, replica, its parameters) of every 16-bit bucket
        self._watched = [(bucket, r, params) for bucket in buckets if bucket.narrow
                         for r, params in enumerate(bucket.params)]
        self._seen = self._versions()

    def _versions(self) -> list[tuple[int, ...]]:
        return [tuple(p._version for p in params)  # noqa: SLF001
                for _, _, params in self._watched]

    def written(self) -> list[tuple[Bucket, int]]:
        """(bucket, replica) of each 16-bit bucket written since `seen`."""
        if not self._watched:
            return []
        return [(bucket, r) for (bucket, r, _), now, then
                in zip(self._watched, self._versions(), self._seen) if now != then]

    def seen(self) -> None:
        """The parameters as they are now are the optimizer's (after an update)."""
        if self._watched:
            self._seen = self._versions()

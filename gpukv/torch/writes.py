"""Writes a program makes to the parameters between two steps of a Trainer whose store
holds the weights (update_on_kvstore=True): the step replaces them by the store's
weights, so the first one seen gets a warning that says so."""
from __future__ import annotations

import warnings

from .buckets import Bucket


class WeightWritesLost(UserWarning):
    """A write to a parameter between steps that the next step replaces."""


class WeightWrites:
    """Watches the parameters' version counters, which every in-place PyTorch write moves
    (`copy_`, `load_state_dict`, `torch.nn.init`, an operation under `no_grad`), but a
    write through `.data` or NumPy does not. The Trainer's own writes go through the
    bucket buffers and leave them alone. Reading them costs an attribute per parameter."""

    def __init__(self, buckets: list[Bucket]) -> None:
        self._buckets = buckets
        self._warned = False
        self._seen = self._versions()

    def _versions(self) -> list[int]:
        # (`_version` is how PyTorch shows a tensor's counter; autograd checks it so)
        return [p._version for bucket in self._buckets  # noqa: SLF001
                for params in bucket.params for p in params]

    def check(self) -> None:
        """Warn (once) if a parameter was written since the last check."""
        now = self._versions()
        if now != self._seen and not self._warned:
            self._warned = True
            name, replica = self._first_written(now)
            warnings.warn(
                f"parameter {name!r} of replica {replica} was written since the last step; "
                f"with update_on_kvstore=True the store holds the weights, and this step "
                f"replaces the write by the store's updated weights. Make the Trainer with "
                f"update_on_kvstore=False to write the parameters between steps (its "
                f"optimizer updates them in place, as a PyTorch optimizer does)",
                WeightWritesLost, stacklevel=4)
        self._seen = now

    def _first_written(self, now: list[int]) -> tuple[str, int]:
        where = [(name, r) for bucket in self._buckets
                 for r, params in enumerate(bucket.params) for name in bucket.names]
        return next(w for w, a, b in zip(where, now, self._seen) if a != b)

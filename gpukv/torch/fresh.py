"""Which gradients backward has written since the last step (gluon's `fresh_grad`)."""
from __future__ import annotations

import weakref

from .buckets import Bucket


class FreshGrads:
    """A post-accumulate-grad hook on every parameter of every replica marks its gradient
    fresh; the Trainer clears the marks once a step has used them.

    Hooks, not the gradients' version counters: the gradients of a bucket are views of one
    buffer and share one counter, so a counter cannot tell which of them backward reached.
    """

    def __init__(self, buckets: list[Bucket]) -> None:
        # A gradient already there when the Trainer is made counts as fresh (there was
        # no step before it).
        self._marks = [[[p.grad is not None for p in params] for params in bucket.params]
                       for bucket in buckets]
        handles = []
        for bucket, rows in zip(buckets, self._marks):
            for params, row in zip(bucket.params, rows):
                for i, p in enumerate(params):
                    handles.append(p.register_post_accumulate_grad_hook(_mark(row, i)))
        # The hooks hold the marks only: a Trainer dropped takes its hooks with it.
        weakref.finalize(self, _unhook, handles)

    def marks(self, b: int, r: int) -> list[bool]:
        """Whether backward wrote each parameter of bucket b in replica r since `clear`
        (the list the hooks write: read it, do not keep it)."""
        return self._marks[b][r]

    def clear(self) -> None:
        for rows in self._marks:
            for row in rows:
                row[:] = [False] * len(row)


def _mark(row: list, i: int):
    def hook(_param) -> None:
        row[i] = True
    return hook


def _unhook(handles: list) -> None:
    for handle in handles:
        handle.remove()

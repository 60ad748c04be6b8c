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
        # A gradient already there when the Trainer is made is fresh unless a Trainer
        # still alive (the one this replaces, say) has stepped it since backward wrote it.
        self._marks = [[[_known_mark(p) for p in params] for params in bucket.params]
                       for bucket in buckets]
        #: id(parameter) -> (marks row, index), for the Trainers made after this one
        self._where = {id(p): (row, i) for bucket, rows in zip(buckets, self._marks)
                       for params, row in zip(bucket.params, rows)
                       for i, p in enumerate(params)}
        _LIVE.add(self)
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

    def mark_of(self, param) -> bool | None:
        """This Trainer's mark of `param` (None: not one of its parameters)."""
        place = self._where.get(id(param))
        return None if place is None else place[0][place[1]]

    def clear(self) -> None:
        for rows in self._marks:
            for row in rows:
                row[:] = [False] * len(row)


#: the marks of every Trainer alive (its hooks keep them current)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _known_mark(param) -> bool:
    """Whether `param`'s gradient is fresh, as a live Trainer's hooks saw it; without
    one, whether it has a gradient at all."""
    for other in list(_LIVE):
        mark = other.mark_of(param)
        if mark is not None:
            return mark
    return param.grad is not None


def _mark(row: list, i: int):
    def hook(_param) -> None:
        row[i] = True
    return hook


def _unhook(handles: list) -> None:
    for handle in handles:
        handle.remove()

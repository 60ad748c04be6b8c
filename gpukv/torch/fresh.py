"""Which gradients backward has written since the last step (gluon's `fresh_grad`)."""
from __future__ import annotations

import weakref

from .buckets import Bucket


class FreshGrads:
    """A post-accumulate-grad hook on every parameter of every replica marks its gradient
    fresh; the Trainer clears the marks once a step has used them. The hooks also count
    what backward adds to a gradient buffer that holds the replicas' sum a step left
    there (`hold_sums`): a step would sum that sum again (`added_to_sums`).

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
        self._buckets = buckets
        self._index = {id(bucket): b for b, bucket in enumerate(buckets)}
        #: [bucket][replica]: [the version of the replica's gradient buffer when a step
        #: left the replicas' sum in it (update_on_kvstore=False), the accumulations into
        #: it backward made since], or None
        self._sums: list = [[None] * len(bucket.params) for bucket in buckets]
        handles = []
        for bucket, rows, sums in zip(buckets, self._marks, self._sums):
            for r, (params, row) in enumerate(zip(bucket.params, rows)):
                for i, p in enumerate(params):
                    handles.append(p.register_post_accumulate_grad_hook(
                        _mark(row, i, sums, r, bucket.views)))
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
        for rows, sums in zip(self._marks, self._sums):
            for row in rows:
                row[:] = [False] * len(row)
            sums[:] = [None] * len(sums)

    def hold_sums(self, buckets: list[Bucket]) -> None:
        """A step (after `clear`) left the replicas' sum in the gradients of `buckets`:
        from now on, a backward adding to it is counted (`added_to_sums`)."""
        for bucket in buckets:
            held = [[_writes(grads), 0] for grads in bucket.grads]
            self._sums[self._index[id(bucket)]][:] = held

    def added_to_sums(self) -> tuple[str, int] | None:
        """(name, replica) of a parameter whose gradient backward added to the sum a step
        left in it, where nothing else wrote into its bucket since (each accumulation
        moves the buffer's version counter by one, a zero_() or a clipping once more);
        else None."""
        for bucket, rows, sums in zip(self._buckets, self._marks, self._sums):
            for r, held in enumerate(sums):
                if held is None or not held[1] \
                        or _writes(bucket.grads[r]) != held[0] + held[1]:
                    continue
                for i, (fresh, view) in enumerate(zip(rows[r], bucket.views[r])):
                    if fresh and bucket.params[r][i].grad is view:
                        return bucket.names[i], r
        return None


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


def _writes(tensor) -> int:
    """The in-place writes into `tensor`'s memory so far (its views' included): PyTorch's
    version counter, which has no public name."""
    return tensor._version  # noqa: SLF001


def _mark(row: list, i: int, sums: list, r: int, views: list):
    """The hook of parameter i of replica r (`views`: its bucket's, [replica][i], filled
    once the bucket's buffers are made)."""
    def hook(param) -> None:
        row[i] = True
        held = sums[r]
        if held is not None:
            if param.grad is views[r][i]:  # added into the buffer, in place
                held[1] += 1
            else:  # a .grad set afresh (set_to_none): no sum to add to
                sums[r] = None
    return hook


def _unhook(handles: list) -> None:
    for handle in handles:
        handle.remove()

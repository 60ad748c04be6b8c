"""Start each bucket's gradient reduction while backward is still running.

A post-accumulate-grad hook on every parameter of every replica records the gradients
backward has produced since the last step. When a bucket has all of them, its reduction
(`reduce(bucket)`: a push of its gradients to a store that runs no optimizer) goes to one
background thread. Buckets start in a fixed order, the reverse of the parameters' (about
the order backward produces them): a ready bucket waits for the ones before it, so every
process of a dist store issues the same pushes in the same order. The step waits for the
started reductions and does the rest itself.

A reduction pushes a snapshot of the bucket's gradients (one more gradient-sized buffer
per replica). A gradient that differs from its snapshot at the step makes that reduction
stale, and the step reduces the bucket again: a second backward before the step (gradient
accumulation), clipping, or any other write, through `.data` or NumPy included.
`paused()` (the Trainer's `no_sync()`) keeps the reductions from starting on backward
passes whose gradients are not final.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .buckets import Bucket
from .gradients import copy_gradient

#: marks the threads that run reductions (their pushes need no wait for themselves)
_REDUCING = threading.local()


class EarlyReduction:
    """The hooks and the background thread of one Trainer."""

    def __init__(self, buckets: list[Bucket],
                 reduce: Callable[[Bucket, list[torch.Tensor]], None]) -> None:
        self._buckets = buckets
        self._reduce = reduce  # reduce(bucket, grads): push those as the bucket's
        #: what each bucket's reduction pushes: a copy of every replica's gradients
        self._snapshots = [[torch.empty_like(grad) for grad in bucket.grads]
                           for bucket in buckets]
        #: the order reductions start in (and the step reduces the rest in)
        self.order = list(reversed(range(len(buckets))))
        self._sizes = [len(b.names) * len(b.params) for b in buckets]
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpukv-reduce")
        self._paused = 0
        self._clear()
        # The hooks hold this object weakly, and a parameter answers to the last
        # EarlyReduction made on it: a Trainer dropped or replaced starts nothing more.
        me = weakref.ref(self)
        handles = []
        for b, bucket in enumerate(buckets):
            for r, params in enumerate(bucket.params):
                for i, p in enumerate(params):
                    setattr(p, OWNER, me)
                    handles.append(p.register_post_accumulate_grad_hook(
                        _hook(me, b, r, i, bucket.views[r][i])))
        weakref.finalize(self, _unhook, handles, self._worker)

    def _clear(self) -> None:
        """Forget every gradient seen and every reduction started (under the lock or alone)."""
        self._seen: list[set] = [set() for _ in self._buckets]
        self._events: list[list] = [[] for _ in self._buckets]
        self._next = 0  # position in `order` of the next bucket to start
        self._started: dict[int, Future] = {}

    # ------------------------------------------------------------------ the hooks
    def on_gradient(self, b: int, r: int, i: int, param: torch.Tensor,
                    view: torch.Tensor) -> None:
        """Backward has accumulated replica r's gradient of parameter i of bucket b."""
        with self._lock:
            grad = param.grad
            if grad is not None and grad is not view:  # new since set_to_none: adopt it
                if grad.requires_grad:  # backward(create_graph=True): the program may
                    return  # differentiate through it; the step takes it as it is then
                with torch.no_grad():
                    copy_gradient(view, grad)
                param.grad = view
            if b in self._started or self._paused:  # stale (finish sees it), or not yet
                return
            self._seen[b].add((r, i))
            if view.is_cuda:  # backward's kernels may still be running
                self._events[b].append(torch.cuda.current_stream(view.device).record_event())
            self._start_ready()

    def _start_ready(self) -> None:
        """Hand every complete bucket whose predecessors have started to the worker."""
        while self._next < len(self.order):
            b = self.order[self._next]
            if len(self._seen[b]) < self._sizes[b]:
                return
            self._started[b] = self._worker.submit(self._run, b, self._events[b])
            self._next += 1

    def _run(self, b: int, events: list) -> None:
        _REDUCING.active = True  # (this pool's one thread runs reductions only)
        for event in events:
            event.synchronize()
        bucket, snapshots = self._buckets[b], self._snapshots[b]
        with torch.no_grad():
            for snapshot, grad in zip(snapshots, bucket.grads):
                snapshot.copy_(grad)
        for device in {s.device for s in snapshots if s.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the copies, for the store
        self._reduce(bucket, snapshots)

    # ------------------------------------------------------------------ the step
    def reducing(self) -> bool:
        """Whether the calling thread is one that runs reductions."""
        return getattr(_REDUCING, "active", False)

    def wait(self) -> None:
        """Wait for the reductions started so far to end, forgetting nothing (their
        errors are `finish`'s to raise): a collective call of the step may then follow
        their pushes in the same order on every process."""
        with self._lock:
            started = list(self._started.values())
        futures.wait(started)

    def finish(self) -> tuple[set[int], set[int]]:
        """Wait for the started reductions and start afresh. Returns the buckets whose
        reduction started, and those of them that reduced their gradients as they are now.
        The first error a reduction raised is raised here."""
        with self._lock:
            started = self._started
            self._clear()
        error = None
        for future in started.values():
            exc = future.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error
        return set(started), {b for b in started if all(
            _same_bits(s, g) for s, g in zip(self._snapshots[b], self._buckets[b].grads))}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No reduction starts inside, and the gradients backward produces inside do not
        count towards starting one (as DDP's `no_sync`)."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1


#: the attribute naming, on a parameter, the EarlyReduction its hooks serve
OWNER = "_gpukv_early_reduction"


def _hook(me: weakref.ref, b: int, r: int, i: int, view: torch.Tensor):
    def hook(param: torch.Tensor) -> None:
        early = me()
        if early is not None and getattr(param, OWNER, None) is me:
            early.on_gradient(b, r, i, param, view)
    return hook


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN equal to itself, 0.0 not to -0.0)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        a.element_size())
    return torch.equal(a, b) if bits is None else torch.equal(a.view(bits), b.view(bits))


def _unhook(handles: list, worker: ThreadPoolExecutor) -> None:
    for handle in handles:
        handle.remove()
    worker.shutdown(wait=False)

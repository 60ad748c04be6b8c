"""The dist store's lock, which first lets background work started before a call end.

A dist store's calls are collective: every process must make them in the same order. A
layer above may hand pushes to a thread of its own (the Trainer's reductions, started
from backward); a call the program makes meanwhile on another thread (a barrier, a
`workers_max`, a snapshot) would then meet those pushes in an order that differs from
process to process. Each call made outside such a thread first waits for the work it
registered (`settle_before_calls`): the pushes started before the call come first
everywhere, as DDP's reductions are queued before a later collective of the same group.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

from .._errors import ArgumentError


class CallLock:
    """A reentrant lock whose outermost acquisition, by a thread that is no registered
    background thread, first waits for the registered background work."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = threading.local()
        self._settlers: list = []  # (weak wait, weak background) of the live registrations
        self._updating = threading.local()

    def settle_before_calls(self, wait: Callable[[], None],
                            background: Callable[[], bool]) -> None:
        """Before a call from a thread for which `background()` is False, `wait()` (both
        bound methods, held weakly: a dropped owner waits for nothing)."""
        self._settlers = [s for s in self._settlers if s[0]() is not None]
        self._settlers.append((weakref.WeakMethod(wait), weakref.WeakMethod(background)))

    @contextlib.contextmanager
    def running_updater(self) -> Iterator[None]:
        """While the program's updater runs inside a call: a call it makes of the store
        is an ArgumentError (it would start a collective call inside another)."""
        self._updating.on = True
        try:
            yield
        finally:
            self._updating.on = False

    def __enter__(self) -> CallLock:
        if getattr(self._updating, "on", False):
            raise ArgumentError(
                "a dist store's updater called the store: its calls are collective, and "
                "one started inside another would cross the messages of both; an updater "
                "on a dist store updates the values it is given only (as MXNet's, which "
                "runs on its servers)")
        depth = getattr(self._depth, "value", 0)
        if depth == 0:
            self._settle()
        self._lock.acquire()
        self._depth.value = depth + 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth.value -= 1
        self._lock.release()

    def _settle(self) -> None:
        for wait_ref, background_ref in list(self._settlers):
            wait, background = wait_ref(), background_ref()
            if wait is not None and background is not None and not background():
                wait()

"""Which live store of this process holds each of some things, one store a thing: the
registry behind `gpukv.checkpoints.claims` (snapshot folders) and `gpukv.optim.claims`
(optimizer objects).

Stores are held weakly, so a store dropped frees what it held; a store dropped but kept
by a reference cycle (a Trainer's) is collected before a refusal. Things kept by
identity (`weak_things`: optimizer objects, keyed by id) are held weakly too: an entry
goes with its thing, and an id reused by another is not taken for it.
"""
from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable

from ._errors import ArgumentError


class Holders:
    """{thing: the live store holding it}, keyed by `key(thing)`; `refusal(thing, held)`
    is the error for a store that would take a thing the store `held` holds;
    `weak_things`: things are kept by identity (see the module's docstring)."""

    def __init__(self, key: Callable[[object], Hashable],
                 refusal: Callable[[object, object], ArgumentError],
                 weak_things: bool = False) -> None:
        self._key = key
        self.refusal = refusal
        self._weak_things = weak_things
        self._lock = threading.Lock()
        #: key -> (the thing, weakly, or None where it cannot be; the store, weakly)
        self._held: dict = {}

    def _live(self, thing):
        """The live store that holds `thing` (None: none); stale entries are dropped."""
        key = self._key(thing)
        entry = self._held.get(key)
        if entry is None:
            return None
        same, store = entry[0] is None or entry[0]() is thing, entry[1]()
        if not same or store is None:  # (an id reused, or a store dropped)
            del self._held[key]
            return None
        return store

    def _other(self, thing, store, passing: list):
        """The live store holding `thing`, unless it is `store` or one of `passing`."""
        held = self._live(thing)
        if held is None or held is store or any(held is s for s in passing):
            return None
        return held

    def holder(self, thing, store=None, passing: Iterable = ()) -> object | None:
        """The live store of this process that holds `thing`, unless it is `store` or
        one of `passing` (stores whose things go to `store`); None when there is none."""
        passing = list(passing)
        with self._lock:
            held = self._other(thing, store, passing)
        if held is None:
            return None
        del held
        gc.collect()  # (rarely needed: a store in a cycle, e.g. of a Trainer dropped)
        with self._lock:
            return self._other(thing, store, passing)

    def claim(self, thing, store, passing: Iterable = ()):
        """Hold `thing` for `store`; the refusal, changing nothing, when another live
        store of this process holds it. A store of `passing` hands it over. Returns what
        held it before (None: nothing), for `give_back`."""
        passing = list(passing)
        held = self.holder(thing, store, passing)
        if held is not None:
            raise self.refusal(thing, held)
        with self._lock:
            held = self._other(thing, store, passing)
            if held is not None:  # (another thread took it meanwhile)
                raise self.refusal(thing, held)
            before = self._live(thing)
            self._held[self._key(thing)] = (self._weak(thing), weakref.ref(store))
        return before

    def give_back(self, thing, store, before) -> None:
        """Undo `claim(thing, store)`, which returned `before`: it goes back to that."""
        with self._lock:
            if self._live(thing) is store:
                key = self._key(thing)
                if before is None:
                    del self._held[key]
                else:
                    self._held[key] = (self._weak(thing), weakref.ref(before))

    def release(self, thing, store) -> None:
        """`store` holds `thing` no more: another store may take it."""
        self.give_back(thing, store, None)

    def _weak(self, thing):
        return weakref.ref(thing) if self._weak_things else None


def store_kind(held) -> str:
    """'a 'local' store', or 'another store', for a refusal's words."""
    kind = getattr(held, "type", None)
    return f"a {kind!r} store" if isinstance(kind, str) else "another store"

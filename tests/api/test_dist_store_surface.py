"""The dist store is a KVStore that runs none of KVStore's machinery: every public member
it has is its own, so none reads the state KVStore's constructor (which it skips) makes."""
from __future__ import annotations

import pytest

from gpukv import KVStore
from gpukv.api.dist_store import DistKVStore

#: inherited as they are: `type` reads the name the dist store sets itself
INHERITED = {"type"}


def _public(cls) -> list[str]:
    return sorted(n for c in cls.__mro__[:-1] for n in vars(c)
                  if not n.startswith("_") or n in ("__len__", "__contains__", "__repr__"))


def test_the_dist_store_is_a_kvstore():
    """`create` returns a KVStore for every store name, the dist ones included."""
    assert issubclass(DistKVStore, KVStore)


@pytest.mark.parametrize("name", [n for n in _public(KVStore) if n not in INHERITED])
def test_the_dist_store_defines_each_public_member_itself(name):
    """Each public member of KVStore (but `type`) is defined anew by DistKVStore."""
    assert name in vars(DistKVStore), f"DistKVStore inherits KVStore.{name}"

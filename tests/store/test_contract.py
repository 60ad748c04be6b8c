"""One store contract: `KVStore` declares every public call, and the one-process store
and the dist store each implement all of it, neither deriving from the other."""
from __future__ import annotations

import inspect

import pytest

import gpukv
from gpukv import KVStore
from gpukv.distributed.store import DistKVStore
from gpukv.store.local import LocalStore


def test_both_stores_are_kvstores_and_neither_derives_from_the_other():
    """`create` returns a KVStore for every store name: both classes implement it."""
    for cls in (LocalStore, DistKVStore):
        assert issubclass(cls, KVStore)
    assert not issubclass(DistKVStore, LocalStore)
    assert not issubclass(LocalStore, DistKVStore)
    assert isinstance(gpukv.create("local"), KVStore)


@pytest.mark.parametrize("cls", [LocalStore, DistKVStore], ids=lambda c: c.__name__)
def test_each_store_implements_every_call_of_the_contract(cls):
    """No abstract member is left: the class could be made (KVStore itself cannot)."""
    assert not inspect.isabstract(cls), sorted(cls.__abstractmethods__)
    assert inspect.isabstract(KVStore)


def _public(cls) -> set:
    return {n for n in vars(cls) if not n.startswith("_")
            or n in ("__len__", "__contains__", "__repr__")}


@pytest.mark.parametrize("cls", [LocalStore, DistKVStore], ids=lambda c: c.__name__)
def test_the_contract_documents_every_call_of_each_store(cls):
    """Every public call a store has is declared (and documented) by KVStore, but for
    the few a store has beyond it: the one-process store's surface for dist stores, the
    dist store's collective options."""
    beyond = {LocalStore: {"pin", "key_kind", "optimizer", "entries", "lookup",
                           "init_checked", "push_checked", "pull_checked", "adopt",
                           "keep_apart", "settles_pulls", "rejoin", "update_merged",
                           "optimizer_updater", "write_part", "speak_as", "values_written",
                           "run_optimizers_for",
                           "__repr__"},
              DistKVStore: {"nccl", "__repr__"}}[cls]
    assert _public(cls) - _public(KVStore) == beyond
    for name in _public(KVStore) - {"__len__", "__contains__"}:
        assert inspect.getdoc(getattr(cls, name)), name

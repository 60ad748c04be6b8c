"""One store of a process runs an optimizer object (gpukv.optim.claims): its update counts
and per-step options are that store's alone."""
from __future__ import annotations

import copy
import gc

import numpy as np
import pytest

import gpukv
from gpukv import optim
from gpukv._errors import ArgumentError
from gpukv.optim import claims

STORES = ["local", "device"]


def _store(kind, optimizer=None):
    kv = gpukv.create(kind)
    kv.init(0, np.ones(3, np.float32))
    if optimizer is not None:
        kv.set_optimizer(optimizer)
    return kv


def _pushed(kv, times=1) -> np.ndarray:
    for _ in range(times):
        kv.push(0, np.ones(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull(0, out=out)
    return out


@pytest.mark.parametrize("kind", STORES)
def test_an_optimizer_another_store_runs_is_refused_changing_nothing(kind):
    """A second live store given an optimizer the first runs is an ArgumentError saying
    what to do; it keeps its own optimizer (or none), and the first's counts are its
    own pushes'."""
    opt = optim.create("adam", learning_rate=0.1)
    first = _store(kind, opt)
    mine = optim.create("sgd", learning_rate=0.5)
    second, bare = _store(kind, mine), _store(kind)
    for other in (second, bare):
        with pytest.raises(ArgumentError, match=r"optimizer 'adam': a '\w+' store of this "
                                                r"process .* runs this optimizer object "
                                                r"already.*gpukv\.optim\.create\(\.\.\.\) "
                                                r"again, or copy\.deepcopy\(optimizer\)"):
            other.set_optimizer(opt)
    assert not bare.has_updater
    assert _pushed(bare).tolist() == [1.0] * 3  # (no optimizer: the sum is assigned)
    assert _pushed(second).tolist() == [0.5] * 3  # (its own SGD)
    _pushed(first, 2)
    assert dict(opt.update_counts) == {0: 2} and dict(mine.update_counts) == {0: 1}


@pytest.mark.parametrize("kind", STORES)
def test_copies_count_apart(kind):
    """A copy (`copy.deepcopy`) runs on another store with counts of its own: two stores
    pushed alike end alike."""
    opt = optim.create("adam", learning_rate=0.1)
    first = _store(kind, opt)
    copied = copy.deepcopy(opt)
    second = _store(kind, copied)
    a, b = _pushed(first, 3), _pushed(second, 3)
    assert np.array_equal(a, b)
    assert dict(opt.update_counts) == dict(copied.update_counts) == {0: 3}


def test_the_same_store_may_set_it_again():
    """set_optimizer with the optimizer the store runs already is taken (states afresh,
    counts kept), as before."""
    opt = optim.create("adam", learning_rate=0.1)
    kv = _store("local", opt)
    _pushed(kv)
    kv.set_optimizer(opt)
    _pushed(kv)
    assert dict(opt.update_counts) == {0: 2}


@pytest.mark.parametrize("let_go", ["dropped", "another optimizer", "an updater"])
def test_a_store_that_runs_it_no_more_frees_it(let_go):
    """The optimizer of a store dropped, or given another optimizer or an updater, may
    go to another store."""
    opt = optim.create("sgd", learning_rate=0.5)
    first = _store("local", opt)
    if let_go == "dropped":
        del first
        gc.collect()
    elif let_go == "another optimizer":
        first.set_optimizer(optim.create("sgd"))
    else:
        first.set_updater(lambda key, merged, stored: None)
    second = _store("local", opt)
    assert _pushed(second).tolist() == [0.5] * 3


def test_a_refused_optimizer_stays_with_its_store():
    """A store refused an optimizer keeps none of it: the first store goes on holding
    it, and a third store is refused too."""
    opt = optim.create("sgd")
    first = _store("local", opt)
    with pytest.raises(ArgumentError):
        _store("local", opt)
    assert claims.holder(opt) is first
    with pytest.raises(ArgumentError):
        _store("device", opt)

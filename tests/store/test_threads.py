"""Thread safety: concurrent pushes and pulls lose no update and never see torn values."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import gpukv

THREADS = 8
ROUNDS = 200
SHAPE = (64,)


def run_threads(target, n=THREADS):
    """Start n threads on target(i) together and re-raise the first error any of them hit."""
    errors = []
    barrier = threading.Barrier(n)

    def body(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


@pytest.fixture(params=["local", "device"])
def name(request):
    return request.param


@pytest.fixture(autouse=True)
def eager_switching():
    """Switch threads as often as the interpreter allows, so races show up quickly."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("devices", [1, 3])
def test_concurrent_pushes_with_summing_updater_lose_nothing(name, devices):
    """8 threads pushing one key through a summing updater lose no push."""
    kv = gpukv.create(name)
    kv.init("w", np.zeros(SHAPE, np.float64))
    kv.set_updater(lambda k, merged, stored: stored.__iadd__(merged))

    def worker(i):
        for _ in range(ROUNDS):
            kv.push("w", [np.full(SHAPE, i + 1.0)] * devices)

    run_threads(worker)
    out = np.zeros(SHAPE)
    kv.pull("w", out=out)
    assert (out == devices * ROUNDS * sum(range(1, THREADS + 1))).all()


def test_concurrent_pushpull_results_are_whole(name):
    """pushpull from many threads returns values some serial order could give (never torn)."""
    kv = gpukv.create(name)
    kv.init(0, np.zeros(SHAPE))
    kv.set_updater(lambda k, merged, stored: stored.__iadd__(merged))
    seen = [[] for _ in range(THREADS)]

    def worker(i):
        for _ in range(50):
            v = np.ones(SHAPE)
            kv.pushpull(0, v)
            assert (v == v[0]).all(), "a pull saw a half-updated value"
            seen[i].append(v[0])

    run_threads(worker)
    for values in seen:  # each thread's own results only grow
        assert values == sorted(values)
    everything = sorted(x for values in seen for x in values)
    assert everything == list(range(1, THREADS * 50 + 1))


def test_concurrent_push_pull_of_different_keys(name):
    """Threads pushing and pulling their own keys each see exactly their own updates."""
    kv = gpukv.create(name)
    kv.init(list(range(THREADS)), [np.zeros(SHAPE, np.float32)] * THREADS)

    def worker(i):
        out = np.zeros(SHAPE, np.float32)
        for r in range(ROUNDS):
            kv.push(i, [np.full(SHAPE, i, np.float32), np.full(SHAPE, r, np.float32)])
            kv.pull(i, out=out)
            assert (out == i + r).all()

    run_threads(worker)


def test_concurrent_init_of_distinct_keys(name):
    """Threads initialising distinct keys at once all succeed and keep their values."""
    kv = gpukv.create(name)

    def worker(i):
        for r in range(20):
            kv.init(i * 100 + r, np.full(SHAPE, i * 100 + r, np.float32))

    run_threads(worker)
    for i in range(THREADS):
        for r in range(20):
            out = np.zeros(SHAPE, np.float32)
            kv.pull(i * 100 + r, out=out)
            assert (out == i * 100 + r).all()


def test_concurrent_duplicate_init_only_one_wins(name):
    """When every thread inits the same key, exactly one succeeds."""
    kv = gpukv.create(name)
    wins, losses = [], []

    def worker(i):
        try:
            kv.init("k", np.full(SHAPE, i, np.float32))
            wins.append(i)
        except gpukv.DuplicateKeyError:
            losses.append(i)

    run_threads(worker)
    assert len(wins) == 1 and len(losses) == THREADS - 1
    out = np.zeros(SHAPE, np.float32)
    kv.pull("k", out=out)
    assert (out == wins[0]).all()


def test_settle_before_calls_takes_bound_methods_only(name):
    """A registration the store could not hold weakly is an ArgumentKindError naming
    the argument, on a one-process store too (where it waits for nothing)."""
    kv = gpukv.create(name)
    owner = _Settler()
    with pytest.raises(gpukv.ArgumentKindError, match="wait must be a bound method"):
        kv.settle_before_calls(lambda: None, owner.background)
    with pytest.raises(gpukv.ArgumentKindError, match="background must be a bound method"):
        kv.settle_before_calls(owner.wait, lambda: False)
    kv.settle_before_calls(owner.wait, owner.background)


class _Settler:
    """A layer's background work as CallLock sees it: `wait` counts the waits."""

    def __init__(self, background: bool = False):
        self.waits = 0
        self.in_background = background

    def wait(self) -> None:
        self.waits += 1

    def background(self) -> bool:
        return self.in_background


def test_call_lock_waits_once_per_outermost_call_from_the_program():
    """A dist store's lock waits for the registered work before a call from the
    program's thread, once however deeply the call nests, never before a call from the
    background thread, and not after the owner of the work is dropped."""
    from gpukv.distributed.call_lock import CallLock
    lock, settler = CallLock(), _Settler()
    lock.settle_before_calls(settler.wait, settler.background)
    with lock:
        with lock:
            pass
    assert settler.waits == 1
    settler.in_background = True
    with lock:
        pass
    assert settler.waits == 1
    settler.in_background = False
    del settler
    with lock:  # (a dropped owner's registration waits for nothing)
        pass
    later = _Settler()
    lock.settle_before_calls(later.wait, later.background)
    with lock:
        pass
    assert later.waits == 1 and len(lock._settlers) == 1  # (the dropped one is gone)

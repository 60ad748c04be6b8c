"""How a process of a job with a dist store ends: the wait for the others at exit, with a
stand-in for MPI (the real one is in test_split_exchange.py)."""
from __future__ import annotations

import time

import pytest

from gpukv.distributed.mpi import job_exit


class _Barrier:
    def __init__(self, completes_after: int | None):
        self.tests = 0
        self.completes_after = completes_after

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.tests += 1
        return self.completes_after is not None and self.tests >= self.completes_after


class _MPI:
    """mpi4py's MPI, as much of it as the wait uses."""
    Exception = RuntimeError

    def __init__(self, barrier: _Barrier, size: int = 2, finalized: bool = False):
        self.barrier = barrier
        self.finalized = finalized
        world = type("World", (), {})()
        world.Get_size = lambda: size
        world.Ibarrier = lambda: barrier
        self.COMM_WORLD = world

    def Is_finalized(self) -> bool:  # noqa: N802
        return self.finalized


@pytest.fixture
def job(monkeypatch):
    def make(barrier: _Barrier, timeout: float, **kwargs):
        monkeypatch.setattr(job_exit, "_mpi", [_MPI(barrier, **kwargs)])
        monkeypatch.setattr(job_exit, "_together", [timeout])
        monkeypatch.setattr(job_exit, "_failed", [])
    return make


def test_the_wait_at_exit_tests_the_barrier_until_every_process_is_there(job):
    """MPI moves messages on only while it is called: the barrier is tested again and
    again, and the wait ends as soon as it completes."""
    barrier = _Barrier(completes_after=50)
    job(barrier, timeout=30.0)
    start = time.monotonic()
    job_exit._wait_for_the_others()
    assert barrier.tests == 50
    assert time.monotonic() - start < 5


def test_the_wait_at_exit_is_bounded_by_the_timeout(job):
    """A process that never reaches its exit is waited for no longer than the store's
    timeout (MPI_Finalize follows, as it did without the wait)."""
    barrier = _Barrier(completes_after=None)
    job(barrier, timeout=0.3)
    start = time.monotonic()
    job_exit._wait_for_the_others()
    took = time.monotonic() - start
    assert 0.3 <= took < 3, took
    assert barrier.tests > 1


@pytest.mark.parametrize("case", ["failed", "finalized", "alone"])
def test_no_wait_where_there_is_nobody_to_wait_for(job, case):
    """A failed process aborts the job instead (job_exit's other hook); after
    MPI_Finalize, or in a job of one process, there is nothing to wait for."""
    barrier = _Barrier(completes_after=None)
    job(barrier, timeout=30.0, finalized=case == "finalized", size=1 if case == "alone" else 2)
    if case == "failed":
        job_exit._failed.append((0, RuntimeError("lost")))
    job_exit._wait_for_the_others()
    assert barrier.tests == 0


def test_the_longest_timeout_of_the_stores_bounds_the_wait(monkeypatch):
    """Several stores: the wait is bounded by the longest of their timeouts, registered
    once."""
    registered = []
    monkeypatch.setattr(job_exit, "_together", [])
    monkeypatch.setattr(job_exit.atexit, "register", registered.append)
    job_exit.end_together(5.0)
    job_exit.end_together(60.0)
    job_exit.end_together(10.0)
    assert registered == [job_exit._wait_for_the_others]
    assert job_exit._together == [60.0]

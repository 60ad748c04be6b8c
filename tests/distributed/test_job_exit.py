"""How a process of a job with a dist store ends: its word to the others at exit and the
wait for theirs, with a stand-in for MPI (the real one is in test_split_exchange.py)."""
from __future__ import annotations

import time

import pytest

from gpukv.distributed.mpi import job_exit

_NULL = None


class _Request:
    def __init__(self, mpi, kind: str, peer: int):
        self.mpi, self.kind, self.peer = mpi, kind, peer
        self.active = True
        self.cancelled = self.freed = False

    def __eq__(self, other):  # a completed request is MPI's null request
        return other is _NULL and not self.active

    def Cancel(self):  # noqa: N802 - mpi4py's names
        self.cancelled = True

    def Free(self):  # noqa: N802
        self.freed = True


class _Comm:
    def __init__(self, mpi, size: int):
        self.mpi, self.size = mpi, size

    def Get_rank(self):  # noqa: N802
        return 0

    def Get_size(self):  # noqa: N802
        return self.size

    def Irecv(self, buf, source, tag):  # noqa: N802
        assert tag == 13
        return self.mpi.made(_Request(self.mpi, "recv", source))

    def Isend(self, buf, dest, tag):  # noqa: N802
        assert tag == 13
        return self.mpi.made(_Request(self.mpi, "send", dest))


class _MPI:
    """mpi4py's MPI, as much of it as the wait uses: the other ranks' words arrive
    after `arrive_after` tests (None: never; `late`: ranks whose word never comes)."""
    Exception = RuntimeError
    REQUEST_NULL = _NULL
    BYTE = "byte"

    def __init__(self, arrive_after: int | None, late=(), finalized=False):
        self.arrive_after, self.late, self.finalized = arrive_after, set(late), finalized
        self.requests: list = []
        self.tests = 0
        mpi = self

        class Request:
            @staticmethod
            def Testall(requests):  # noqa: N802
                mpi.tests += 1
                for r in requests:
                    if r.kind == "send" or (mpi.arrive_after is not None
                                            and mpi.tests >= mpi.arrive_after
                                            and r.peer not in mpi.late):
                        r.active = False
                return not any(r.active for r in requests)

            @staticmethod
            def Waitall(requests):  # noqa: N802
                for r in requests:
                    assert r.cancelled or not r.active, "a wait on a receive never to come"
                    r.active = False
        self.Request = Request

    def made(self, request):
        self.requests.append(request)
        return request

    def Is_finalized(self):  # noqa: N802
        return self.finalized


@pytest.fixture
def job(monkeypatch):
    def make(mpi: _MPI, size: int, timeout: float):
        monkeypatch.setattr(job_exit, "_mpi", [mpi])
        monkeypatch.setattr(job_exit, "_together", [_Comm(mpi, size), 13, timeout])
        monkeypatch.setattr(job_exit, "_failed", [])
        return mpi
    return make


def test_each_process_tells_every_other_and_waits_for_their_words(job):
    """A word to each other rank and a receive from each; MPI moves messages on only
    while it is called, so the wait tests again and again, and ends once all are in."""
    mpi = job(_MPI(arrive_after=50), size=4, timeout=30.0)
    start = time.monotonic()
    job_exit._wait_for_the_others()
    assert time.monotonic() - start < 5
    assert mpi.tests == 50
    assert sorted((r.kind, r.peer) for r in mpi.requests) == sorted(
        [("recv", p) for p in (1, 2, 3)] + [("send", p) for p in (1, 2, 3)])


def test_the_wait_is_bounded_and_leaves_no_receive_behind(job):
    """A rank whose word never comes is waited for no longer than the store's timeout;
    the receive still waiting is cancelled (MPI_Finalize must not find it), and the words
    sent go on alone."""
    mpi = job(_MPI(arrive_after=1, late={2}), size=3, timeout=0.3)
    start = time.monotonic()
    job_exit._wait_for_the_others()
    took = time.monotonic() - start
    assert 0.3 <= took < 3, took
    late = [r for r in mpi.requests if r.kind == "recv" and r.peer == 2]
    assert [r.cancelled for r in late] == [True]
    assert not any(r.cancelled for r in mpi.requests if r not in late)


@pytest.mark.parametrize("case", ["failed", "finalized", "alone"])
def test_no_wait_where_there_is_nobody_to_wait_for(job, case):
    """A failed process aborts the job instead (job_exit's other hook); after
    MPI_Finalize, or in a job of one process, there is nothing to wait for."""
    mpi = job(_MPI(arrive_after=None, finalized=case == "finalized"),
              size=1 if case == "alone" else 2, timeout=30.0)
    if case == "failed":
        job_exit._failed.append((0, RuntimeError("lost")))
    job_exit._wait_for_the_others()
    assert mpi.requests == [] and mpi.tests == 0


def test_the_first_store_registers_the_wait_and_the_longest_timeout_bounds_it(monkeypatch):
    """Several stores: the words go on the first store's communicator, registered once,
    and the wait is bounded by the longest of their timeouts."""
    registered = []
    monkeypatch.setattr(job_exit, "_together", [])
    monkeypatch.setattr(job_exit.atexit, "register", registered.append)
    job_exit.end_together("first", 13, 5.0)
    job_exit.end_together("second", 13, 60.0)
    job_exit.end_together("third", 13, 10.0)
    assert registered == [job_exit._wait_for_the_others]
    assert job_exit._together == ["first", 13, 60.0]

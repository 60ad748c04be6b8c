"""MPI through mpi4py, with every wait bounded.

Each wait polls nonblocking requests against a deadline instead of blocking in MPI, so a
peer that died or stalls becomes a `PeerError` naming what was waited for and who did not
answer. An error MPI raises (a peer that died, a link that broke) becomes a `PeerError`
too, wherever it comes from: every call on a transport's communicator, every test of a
request and every receive go through here. Once a transport has failed it stays failed:
the messages still in flight make the communicator unusable, and at exit the process
aborts the MPI job (a non-zero exit, the reason on stderr; see `job_exit`) rather than
hang in `MPI_Finalize`. A rank that loses a peer (a timeout, a broken connection) tells
every other rank, so that each raises at once, naming the ranks lost, where it would
otherwise wait out its own timeout.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import time
from collections.abc import Iterator

import numpy as np

from ... import timeline
from ..._errors import BackendError, PeerError
from . import job_exit

#: message tags: requests to a server, its small replies, errors, agreement (and its roll
#: call), the raw bytes of pushes, what rank 0 shares, the chunks of split keys on their
#: way to their owner and back, a rank's word that it lost a peer, and its word at exit
#: that it is done (`job_exit`)
TAG_REQUEST = 1
TAG_REPLY = 2
TAG_ERROR = 3
TAG_DIGEST = 4
TAG_VERDICT = 5
TAG_SIGNATURE = 6
TAG_PUSH_DATA = 7
TAG_SHARE = 8
TAG_ROLL = 9
TAG_SCATTER = 10
TAG_GATHER = 11
TAG_LOST = 12
TAG_EXIT = 13
#: data replies use their own tags from here on (one per outstanding request; below this,
#: the agreements of `create` use theirs)
TAG_DATA = 2048


def mpi():
    """mpi4py's MPI module, or BackendError saying how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendError("dist stores need mpi4py and an MPI library: pip install "
                           "'gpukv[mpi]' (mpi4py and the mpich wheel, which brings "
                           f"mpiexec), then launch with `mpiexec -n N python prog.py` ({exc})"
                           ) from exc
    if not MPI.Is_initialized() and not MPI.Is_finalized():
        # imported without starting MPI (`gpukv info` asks for the library's version so,
        # in a process that may make a dist store later): started as mpi4py would
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(_finalize, MPI)
    return MPI


def _finalize(MPI) -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


class _Checked:
    """A communicator whose every call turns an MPI error into its transport's failure."""

    def __init__(self, comm, transport: Transport):
        self._comm = comm
        self._transport = transport

    def __getattr__(self, name: str):
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr
        transport = self._transport

        def checked(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except transport.MPI.Exception as exc:
                raise transport.broken(f"MPI {name}", exc) from exc
        # kept: the next call finds it without __getattr__ (a round makes several)
        setattr(self, name, checked)
        return checked


class Transport:
    """A communicator, its rank and size, and the timeout every wait is bounded by.

    `comm` is the communicator with every call checked: an MPI error raises PeerError
    and marks the transport failed."""

    def __init__(self, comm, timeout: float, local_size: int = 1,
                 chunk_bytes: int | None = None, first_rank: int = 0):
        self.MPI = mpi()
        self.comm = _Checked(comm, self)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self.failure: PeerError | None = None
        self._raw = comm
        self._telling: list = []  # the notices of a failure, on their way to the others
        self._cause: Exception | None = None  # this rank's own error behind a failure
        #: the ranks on this machine (they share its cores)
        self.local_size = local_size
        #: the chunk size every process agreed on (GPUKV_DIST_CHUNK_BYTES at `create`);
        #: None: each layout's own
        self.chunk_bytes = chunk_bytes
        self.oversubscribed = local_size > _usable_cpus()
        #: the job's rank of this communicator's rank 0 (the workers' own communicator
        #: starts after the servers): a PeerError names the ranks `gpukv run` shows
        self.first_rank = first_rank
        _short_naps()
        job_exit.install(self.MPI)

    def job_rank(self, rank: int) -> int:
        """The job's rank of `rank` of this communicator."""
        return rank + self.first_rank

    def ranks(self, ranks) -> str:
        """`ranks` of this communicator as the job's ranks, for a message."""
        return ", ".join(str(self.job_rank(r)) for r in ranks) or "none"

    # ------------------------------------------------------------------ failures
    def check(self) -> None:
        """Raise the failure this transport already had, if any."""
        if self.failure is not None:
            raise type(self.failure)(str(self.failure))

    def fail(self, error: PeerError) -> PeerError:
        """Record `error` as this transport's failure and return it (to raise)."""
        if self.failure is None:
            self.failure = error
            job_exit.failed(self.job_rank(self.rank), error if self._cause is None
                            else self._cause)
        return error

    @contextlib.contextmanager
    def caused_by(self, error: Exception) -> Iterator[None]:
        """A failure met inside is this rank's own `error`'s doing (a call it refused
        where the others did not): the launcher is told of `error`, the cause, not of
        the PeerError it brings."""
        self._cause = error
        try:
            yield
        finally:
            self._cause = None

    def broken(self, what: str, exc: Exception) -> PeerError:
        """Record MPI's error `exc` (met in `what`) as this transport's failure."""
        try:
            detail = exc.Get_error_string()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the words are a courtesy; the failure is not
            detail = str(exc)
        return self.lost(PeerError(
            f"rank {self.job_rank(self.rank)}: {what}: MPI failed, as it does when another "
            f"process of the job died or a connection broke: {detail.strip()}"))

    def lost(self, error: PeerError) -> PeerError:
        """`fail(error)` for a peer that is gone or silent, and word of it to every other
        rank: those still waiting on the same round raise it at once, each naming the
        ranks this one lost, instead of each waiting out its own timeout (or being killed
        by the abort that follows before it could say why). The notices are never waited
        for: a rank that cannot be reached does not get one."""
        if self.failure is None and self.size > 1:
            text = str(error)
            for peer in range(self.size):
                if peer != self.rank:
                    try:
                        self._telling.append(self._raw.isend(text, dest=peer, tag=TAG_LOST))
                    except self.MPI.Exception:
                        pass  # that peer's connection is broken: it learns by itself
        return self.fail(error)

    def _told(self, what: str) -> PeerError | None:
        """The failure another rank told this one of, if a notice has come."""
        status = self.MPI.Status()
        notice = self._raw.improbe(source=self.MPI.ANY_SOURCE, tag=TAG_LOST, status=status)
        if notice is None:
            return None
        # (the notice says why: a peer gone or silent, or an update that failed there)
        return self.fail(PeerError(f"rank {self.job_rank(self.rank)}: {what}: rank "
                                   f"{self.job_rank(status.Get_source())} stopped the job: "
                                   f"{notice.recv()}"))

    def _checked(self, call, what: str):
        """`call()`, an MPI error in it raised as this transport's PeerError."""
        try:
            return call()
        except self.MPI.Exception as exc:
            raise self.broken(what, exc) from exc

    # --------------------------------------------------------------------- waits
    def poll(self, done, what: str, timeout: float | None = None, on_timeout=None,
             moved=None):
        """Call `done()` until it returns something other than None, and return that.

        Spins (yielding the CPU to any other runnable process) for the first tens of
        milliseconds, so an answer is seen at once, then sleeps a little longer each time,
        so a long wait costs little. `moved()`, if given, counts the messages moved so
        far: each time it changes the spin starts again, so a transfer in progress, which
        MPI moves on only while it is tested, is not left idle by the naps. After
        `timeout` seconds (the transport's by default): `on_timeout()` if given (which may
        return a PeerError to raise), else a PeerError naming `what`.
        """
        try:
            with timeline.span("wait", "mpi", on=what):
                return self._poll(done, what, timeout, on_timeout, moved)
        except self.MPI.Exception as exc:  # a test of a request, a receive, a roll call
            raise self.broken(what, exc) from exc

    def _poll(self, done, what: str, timeout: float | None, on_timeout, moved=None):
        result = done()
        if result is not None:
            return result
        start = time.monotonic()
        limit = self.timeout if timeout is None else timeout
        pause = self.pacer()
        count = moved() if moved is not None else None
        idle_since = start  # the last time a message moved
        while True:
            result = done()
            if result is not None:
                return result
            now = time.monotonic()
            waited = now - start
            if moved is not None and moved() != count:
                count, idle_since = moved(), now
            if waited > _NOTICE_AFTER:  # (a wait this long can afford a probe each time)
                told = self._told(what)
                if told is not None:
                    raise told
            if waited > limit:
                error = on_timeout() if on_timeout is not None else None
                if error is None:
                    error = PeerError(f"rank {self.job_rank(self.rank)}: {what}: no answer "
                                      f"within {limit:g} s (GPUKV_DIST_TIMEOUT)")
                raise self.lost(error)
            pause(now - idle_since)

    def pacer(self):
        """`pause(waited)`: how a wait spends the time between two tests.

        MPI moves a nonblocking call on only while it is tested, so a process with a
        core of its own tests again at once (yielding the CPU; `time.sleep(0)` would sleep
        the timer slack each time) for the first tens of milliseconds. When this machine
        runs more ranks than it has cores, the ranks being waited for need the CPU: past
        a short spin, the wait sleeps, a little longer each time, up to a millisecond.
        """
        spin = 0.0002 if self.oversubscribed else 0.05
        naps = [0.0]
        yield_cpu, sleep = os.sched_yield, time.sleep

        def pause(waited: float) -> None:
            if waited < spin:
                naps[0] = 0.0  # (after a message moved, the naps start short again)
                yield_cpu()
            else:
                naps[0] = min(0.001, naps[0] + 0.00002)
                sleep(naps[0])
        return pause

    def wait_all(self, requests: list, what: str, timeout: float | None = None,
                 on_timeout=None) -> None:
        """Complete every MPI request of `requests` (see `poll`)."""
        if not requests:
            return
        test_all = self.MPI.Request.Testall  # (poll turns its MPI errors into PeerError)
        self.poll(lambda: True if test_all(requests) else None, what, timeout, on_timeout)

    def settle(self, requests: list, seconds: float) -> bool:
        """Wait up to `seconds` for `requests`; whether they all completed (a wait that
        may end short, and is no failure when it does)."""
        start = time.monotonic()
        pause = self.pacer()
        while not self.done(requests, "settling requests"):
            waited = time.monotonic() - start
            if waited > seconds:
                return False
            pause(waited)
        return True

    def done(self, requests: list, what: str) -> bool:
        """Whether every request of `requests` completed (a test that does not wait)."""
        return self._checked(lambda: self.MPI.Request.Testall(requests), what)

    def completed(self, requests: list, what: str) -> list:
        """The indices of the requests of `requests` that completed since the last test
        (a test that does not wait; completed ones become null requests in the list)."""
        done = self._checked(lambda: self.MPI.Request.Testsome(requests), what)
        return done or []

    def cancel(self, request) -> None:
        """Cancel a request that will not be completed (its peer failed)."""
        self._checked(request.Cancel, "cancelling a request")

    def recv_object(self, source: int, tag: int, what: str, timeout: float | None = None,
                    on_timeout=None):
        """(object, its source) of the next pickled message from `source` with `tag`."""
        status = self.MPI.Status()
        message = self.poll(lambda: self.comm.improbe(source=source, tag=tag, status=status),
                            what, timeout, on_timeout)
        return self._checked(message.recv, what), status.Get_source()

    def try_recv_object(self, source: int, tag: int):
        """(object, source) of a waiting pickled message, or None when there is none."""
        status = self.MPI.Status()
        message = self.comm.improbe(source=source, tag=tag, status=status)
        if message is None:
            return None
        return self._checked(message.recv, "receiving a message"), status.Get_source()

    # ------------------------------------------------------------------ sending
    def send_object(self, obj, dest: int, tag: int):
        """Start sending pickled `obj`; the request (complete it with `wait_all`)."""
        return self.comm.isend(obj, dest=dest, tag=tag)

    def send_array(self, array: np.ndarray, dest: int, tag: int):
        """Start sending the bytes of contiguous `array` (kept alive by the caller)."""
        return self.comm.Isend(as_bytes(array), dest=dest, tag=tag)

    def recv_array(self, array: np.ndarray, source: int, tag: int):
        """Start receiving bytes into contiguous `array`."""
        return self.comm.Irecv(as_bytes(array), source=source, tag=tag)


#: seconds a wait runs before it also looks for another rank's word of a lost peer
_NOTICE_AFTER = 0.01


def worker_comm(transport: Transport, servers: int):
    """The workers' own communicator (every process of the job must call this)."""
    is_worker = transport.rank >= servers
    return transport.comm.Split(0 if is_worker else 1, transport.rank)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _short_naps() -> None:
    """Let a sleep of tens of microseconds last about that (Linux's default timer slack
    of 50 us would stretch each one): the waits above nap that short."""
    timer_slack(1000)  # (not Linux: naps are what the system makes them)


@functools.cache
def _libc():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def timer_slack(nanoseconds: int = 0) -> int:
    """This process's timer slack in ns (Linux's prctl), first set to `nanoseconds` when
    that is > 0, which a transport does (1 us, for its naps) for the whole process; the
    slack before; 0 where it cannot be asked."""
    libc = _libc()
    try:
        before = libc.prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
        if nanoseconds > 0:
            libc.prctl(29, nanoseconds, 0, 0, 0)  # PR_SET_TIMERSLACK
    except AttributeError:  # no libc, or one without prctl
        return 0
    return max(before, 0)


def as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of contiguous `array` (MPI has no 16-bit float type to move them as)."""
    assert array.flags.c_contiguous, "MPI buffers are contiguous"  # a copy would be lost
    return array.reshape(-1).view(np.uint8)

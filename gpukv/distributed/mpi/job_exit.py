"""How a process of an MPI job ends once it has a dist store: never by hanging.

A process whose transport failed aborts the job at exit instead of waiting in
`MPI_Finalize` for messages that will never match. A process that ends with an uncaught
exception (a gpukv error or any other) aborts the job as soon as its traceback is printed,
as `python -m mpi4py` does, so that under a bare `mpiexec -n N python prog.py` the other
processes end at once instead of waiting out their timeout for it. A `sys.exit(1)` is no
exception a hook sees: under a bare `mpiexec` the others wait for it up to their timeout
(under `python -m mpi4py`, a non-zero exit aborts the job too).

Under `gpukv run`, both are also reported to the launcher at once (`run_report`), which
ends the job even where mpiexec cannot.

A job whose processes all made a dist store ends together: at exit each tells every
other it is done and waits (bounded by the store's timeout) for their word before
`MPI_Finalize`. A process that received the last messages of a round may still owe their
senders MPICH's word that they were read (a single-copy transfer between processes of one
machine acks its sender after the copy, and the ack waits in a queue when the queue is
full); in `MPI_Finalize`, MPICH waits for the others first and never sends it, and the
sender, still waiting for its send to complete, would time out: the job's end would be a
PeerError. Waiting for the others' words, MPI moves the ack on. The words are
point-to-point, not a barrier: a process that gave up waiting has sent its own, so one
that reaches its exit later (after a long evaluation, say) finds every word there and
ends at once, where a barrier's later rounds would wait on processes already in
`MPI_Finalize`.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

from ... import timeline
from ...launcher import run_report

#: seconds a failed rank waits at exit before it aborts the job
ABORT_GRACE = 1.0
#: seconds a rank ended by an uncaught exception gives its traceback to reach mpiexec
OUTPUT_GRACE = 0.5
#: seconds an abort may take before the process ends without it
ABORT_BOUND = 5

_failed: list = []  # (rank, failure) of each transport that failed
_mpi: list = []  # mpi4py's MPI module, once installed
_together: list = []  # [communicator, its tag for the words at exit, the longest timeout
#                        of a dist store's], once one was made
_pid: list = []  # the process that installed them: a child it forks is no rank of the job


def forked() -> bool:
    """Whether this process is a child forked from the rank that installed the handlers
    (a data loader's worker): the job's MPI state is its parent's, so at its exit it
    neither waits for the others nor aborts the job."""
    return bool(_pid) and os.getpid() != _pid[0]


def install(MPI) -> None:
    """Set both up, once per process (the hook only in a job of several processes)."""
    if _mpi:
        return
    _mpi.append(MPI)
    _pid.append(os.getpid())
    atexit.register(_abort_if_failed)
    if MPI.COMM_WORLD.Get_size() > 1:
        sys.excepthook = _aborting(sys.excepthook, MPI)


def end_together(comm, tag: int, timeout: float) -> None:
    """Make this process tell every other of the job it is done at exit, on `comm` (the
    first dist store's communicator: every process of the job) with `tag`, and wait up to
    `timeout` seconds for their word (every process calls this at the same point: a dist
    store's creation; a later store may lengthen the wait)."""
    if not _together:
        _together.extend([comm, tag, timeout])
        atexit.register(_wait_for_the_others)
    _together[2] = max(_together[2], timeout)


def waits_on(comm) -> bool:
    """Whether the words at exit travel on `comm` (a store's, which it must not free)."""
    return bool(_together) and _together[0] is comm


def ended(rank: int) -> bool:
    """Whether the job's process `rank` has said it reached its exit (the end of the
    program, or `sys.exit`): its word is waiting here (looked at, left for the exit)."""
    if not _together or forked():
        return False
    comm, tag, _ = _together
    try:
        return bool(comm.Iprobe(source=rank, tag=tag))
    except _mpi[0].Exception:
        return False


def _wait_for_the_others() -> None:
    """Each other process's word that it reached its exit, tested until all are in or the
    timeout passes (then MPI_Finalize waits as it would have; a failed process aborts the
    job instead)."""
    if _failed or not _mpi or forked() or _mpi[0].Is_finalized():
        return
    MPI = _mpi[0]
    comm, tag, timeout = _together
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return
    try:
        others = [r for r in range(size) if r != rank]
        words = [comm.Irecv([bytearray(1), MPI.BYTE], source=r, tag=tag) for r in others]
        sent = [comm.Isend([bytearray(1), MPI.BYTE], dest=r, tag=tag) for r in others]
        deadline = time.monotonic() + timeout
        nap = 0.0
        while not MPI.Request.Testall(words + sent):
            if time.monotonic() > deadline:  # the late ones end at once on their own
                _give_up(MPI, words, sent)
                return
            nap = min(0.001, nap + 0.00002)  # (naps grow: a late peer costs little CPU)
            time.sleep(nap)
    except (MPI.Exception, KeyboardInterrupt):
        pass  # a peer is gone, or the user is: MPI_Finalize (or an abort) follows


def _give_up(MPI, words: list, sent: list) -> None:
    """Leave no receive behind for MPI_Finalize: cancel those still waiting; the words
    sent go on by themselves (a send may be freed before it completes)."""
    for request in words:
        if request != MPI.REQUEST_NULL:
            request.Cancel()
    MPI.Request.Waitall(words)  # (a cancelled receive completes at once)
    for request in sent:
        if request != MPI.REQUEST_NULL:
            request.Free()


def failed(rank: int, failure) -> None:
    """Record a transport's failure: the process aborts the job at exit (and tells the
    launcher now)."""
    _failed.append((rank, failure))
    run_report.send(type(failure).__name__, str(failure), rank=rank)


def _abort_if_failed() -> None:
    """At exit, after a moment's grace in which the other ranks (told of the same
    failure) report it too."""
    if not _failed or not _mpi or forked():
        return
    MPI = _mpi[0]
    # The world communicator as MPI made it (no transport's wrapper, which could turn an
    # error into an exception here); nothing to abort once MPI is finalized, and no peer
    # to hang on in a job of one process.
    if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    rank, failure = _failed[0]
    sys.stderr.write(f"gpukv: rank {rank}: aborting the MPI job: {failure}\n")
    sys.stderr.flush()
    time.sleep(ABORT_GRACE)
    _abort(MPI.COMM_WORLD)


def _aborting(previous, MPI):
    """`previous` (which prints the traceback), then an abort of the whole job."""
    def hook(kind, value, traceback) -> None:
        if threading.current_thread() is threading.main_thread():
            run_report.send(f"uncaught {kind.__name__}", str(value), status=1)
        previous(kind, value, traceback)
        # A thread's uncaught exception (should a program send it here) does not end the
        # process, nor does a forked child's end the job; and once MPI is finalized, or
        # the interpreter torn down past it, there is no job left to abort.
        if threading.current_thread() is not threading.main_thread() or forked():
            return
        try:
            if not MPI.Is_initialized() or MPI.Is_finalized():
                return
            world = MPI.COMM_WORLD
            sys.stderr.write(f"gpukv: rank {world.Get_rank()}: aborting the MPI job: an "
                             f"uncaught {kind.__name__} ended this process\n")
            sys.stdout.flush()
            sys.stderr.flush()
            # mpiexec forwards each process's output through its proxies, and the abort
            # kills them: a moment first, or the traceback can be cut short on its way.
            time.sleep(OUTPUT_GRACE)
        except Exception:  # noqa: BLE001 - shutting down: abort without the words
            world = MPI.COMM_WORLD
        _abort(world)
    return hook


def _abort(world) -> None:
    """`MPI_Abort`, and the process's end ABORT_BOUND seconds later should the abort itself
    hang: on a host cut off from the network, the abort waits for a `mpiexec` it cannot
    reach, and the process (with its GPU and memory) would stay forever. The alarm is the
    kernel's (SIGALRM's default action ends the process), since the abort holds on to
    the interpreter while it waits."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(ABORT_BOUND)
    timeline.write_before_exit()  # (the abort ends the process before exit's handlers)
    world.Abort(1)

"""What ends a job on this host when its launcher ends without ending it (`kill -9`, the
out-of-memory killer): a process forked from the launcher before mpiexec starts, in a
session of its own so that no terminal's signal reaches it, holding only the read end of a
pipe from the launcher. The launcher tells it once the job has ended, and it goes; when the
pipe closes untold, the launcher is gone: it kills (SIGKILL) every process on this host
whose environment carries the job's mark ($GPUKV_RUN_JOB, drawn for each attempt: mpiexec,
its proxy, the ranks, their watchers and their children; `process_tree.marked`) until none
is left, and removes the files MPICH left (`leftovers`) as the launcher would have.

mpiexec itself is killed with the launcher by the kernel (`process_tree.die_with_parent`),
and mpiexec's proxies, on this host and the others, kill their ranks when it is gone: the
guard ends what the kernel and the proxies do not reach, and cleans up after them.
"""
from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

from . import leftovers, process_tree

#: set in the environment of every process of an attempt's job: its mark
ENV = "GPUKV_RUN_JOB"
#: what the launcher writes before closing the pipe: the job has ended, nothing to do
_ENDED = b"ended"
#: seconds the guard keeps killing what it finds of the job
_LIMIT = 10.0


class Guard:
    """The guard of one attempt's job, whose processes are to be started with `env`;
    `before`: MPICH's files there before the job started (`leftovers`)."""

    def __init__(self, before: set[Path]):
        self.env = {ENV: secrets.token_hex(8)}  # the job's mark, for its environment
        self.pid: int | None = None
        self._pipe: int | None = None
        if not Path("/proc").is_dir():
            return  # (no way to find the job's processes)
        read, write = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(read)
            os.close(write)
            return  # no guard: mpiexec still dies with the launcher
        if pid == 0:
            try:
                _watch(read, self.env[ENV], before)
            finally:
                os._exit(0)  # never the launcher's atexit handlers nor its output
        os.close(read)
        self.pid, self._pipe = pid, write

    def release(self) -> None:
        """Tell the guard the job has ended (it goes at once), and reap it."""
        if self._pipe is not None:
            try:
                os.write(self._pipe, _ENDED)
            except OSError:  # (it is gone already)
                pass
            os.close(self._pipe)
            self._pipe = None
        if self.pid is not None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:  # reaped already
                pass
            self.pid = None


def _watch(pipe: int, mark: str, before: set[Path]) -> None:
    """The guard's life: wait for the pipe to close; end the job if the launcher did not
    say it had."""
    os.setsid()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the launcher's output stays the launcher's: none is held open
        os.dup2(null, fd)
    os.closerange(3, pipe)
    os.closerange(pipe + 1, os.sysconf("SC_OPEN_MAX"))
    told = b""
    while True:
        chunk = os.read(pipe, 64)
        if not chunk:
            break
        told += chunk
    if told == _ENDED:
        return
    me, end = os.getpid(), time.monotonic() + _LIMIT
    while time.monotonic() < end:
        found = [p for p in process_tree.marked(ENV, mark) if p != me]
        if not found:
            break
        process_tree.signal_all(found, signal.SIGKILL)
        time.sleep(0.05)
    leftovers.remove_new(before)

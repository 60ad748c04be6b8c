"""How `gpukv run` starts each rank's program: `python -m gpukv.launcher.run_rank PROG ARGS`.

Before PROG runs, the process gets torchrun's variables, `RANK`, `LOCAL_RANK`, `WORLD_SIZE`
and `LOCAL_WORLD_SIZE`, from those mpiexec set (MPICH's PMI_RANK, MPI_LOCALRANKID, PMI_SIZE,
MPI_LOCALNRANKS, or Open MPI's OMPI_COMM_WORLD_*); it tells the launcher its rank, local
rank, host and pid (`run_report`), and forks a watcher that tells the launcher once this
process has ended, however it ended (kill -9 included, and mpiexec's proxy killing the
rank's process group: the watcher has a group of its own). The watcher keeps this process's
connections to mpiexec open the moment it takes to say so: mpiexec, which ends every other
rank as soon as one's connections close, hears of the end after the launcher has.

Then:
- PROG.py, `python PROG ...` and `python -m MODULE ...` (`python` being this interpreter,
  as the launcher passes it) run in this process as `__main__`, as `python PROG ARGS`
  would. A non-zero exit or an uncaught exception is reported to the launcher before the
  exit goes on as usual: the launcher then ends the job at once, where mpiexec would wait
  for the other ranks (possibly forever). The traceback of an uncaught exception shows the
  program's frames, without this wrapper's and with gpukv's own left out (the count said);
  Ctrl-C ends the program with status 130 and no traceback. GPUKV_RUN_VERBOSE=1 (`gpukv run
  --verbose`) prints both as Python would.
- any other PROG replaces this process (exec), keeping its pid and the variables.
"""
from __future__ import annotations

import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from .._env import MPI_RANK_VARIABLES, flag
from . import run_report

#: set to 1 for whole tracebacks (gpukv's frames included) and Ctrl-C's
VERBOSE_ENV = "GPUKV_RUN_VERBOSE"
#: torchrun's variables, each from where an MPI launcher puts it (MPICH's Hydra, Open MPI)
TORCHRUN_VARIABLES = {
    "RANK": MPI_RANK_VARIABLES,
    "LOCAL_RANK": ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "WORLD_SIZE": ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"),
    "LOCAL_WORLD_SIZE": ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"),
}
_HERE = Path(__file__).resolve()
_PACKAGE = _HERE.parents[1]  # gpukv/


def exit_status(code) -> int:
    """The status of a process that ends on `sys.exit(code)`."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def torchrun_env(env) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from the MPI launcher's variables in
    `env` (those it did not set are left out)."""
    found = {}
    for name, sources in TORCHRUN_VARIABLES.items():
        for source in sources:
            value = env.get(source, "").strip()
            if value.isdigit():
                found[name] = value
                break
    return found


def verbose() -> bool:
    """Whether $GPUKV_RUN_VERBOSE asks for every line; anything but blank, 1 or 0 is an
    ArgumentError naming it (`gpukv run` refuses it before starting a process)."""
    return bool(flag(VERBOSE_ENV))


# ------------------------------------------------------------------ the watcher
def _wait_for_end(pid: int) -> None:
    """Return once process `pid` (this watcher's parent) has ended."""
    if os.getppid() != pid:
        return  # ended already: this watcher was handed to another parent
    try:
        handle = os.pidfd_open(pid)  # Linux 5.3+: readable once the process has ended
    except (AttributeError, OSError):
        while os.getppid() == pid:
            time.sleep(0.05)
        return
    try:
        select.select([handle], [], [])
    finally:
        os.close(handle)


def _leave_a_watcher(rank: int) -> None:
    """Fork the process that tells the launcher when this one has ended. It ignores Ctrl-C
    and SIGTERM (mpiexec passes them to the rank's process group), holds on to nothing but
    what it inherits, and ends right after its rank."""
    me = os.getpid()
    try:
        child = os.fork()
    except OSError:
        return  # no watcher: mpiexec's own word is all the launcher gets
    if child:
        return
    try:  # the watcher
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        try:  # out of its rank's process group, which mpiexec's proxy kills as a whole
            os.setpgid(0, 0)  # when it ends a job (an MPI_Abort): it outlives its rank
        except OSError:
            pass
        _wait_for_end(me)
        run_report.send_ended(run_report.Ended(rank, me))
    finally:
        os._exit(0)  # never the parent's atexit handlers nor its buffered output


# -------------------------------------------------------------- the tracebacks
def _wrapper_frame(filename: str) -> bool:
    return filename.startswith("<frozen runpy") or filename in (str(_HERE), runpy.__file__)


def _inside_gpukv(filename: str, program: str) -> bool:
    path = os.path.abspath(filename)
    return path != program and path.startswith(str(_PACKAGE) + os.sep)


def program_traceback(exc: BaseException, program: str = "") -> str:
    """The traceback of `exc` as `python PROG` prints it, without this wrapper's frames and
    with gpukv's own left out (the count said on a last line), chained exceptions too."""
    shown = traceback.TracebackException.from_exception(exc)
    left_out = 0
    todo, seen = [shown], set()
    while todo:
        each = todo.pop()
        if id(each) in seen:
            continue
        seen.add(id(each))
        kept = []
        for frame in each.stack:
            if _wrapper_frame(frame.filename):
                continue
            if _inside_gpukv(frame.filename, program):
                left_out += 1
                continue
            kept.append(frame)
        each.stack = traceback.StackSummary.from_list(kept)
        todo += [e for e in (each.__cause__, each.__context__) if e is not None]
        todo += getattr(each, "exceptions", None) or []
    text = "".join(shown.format())
    if left_out:
        text += (f"({left_out} frame{'s' if left_out > 1 else ''} inside gpukv left out: "
                 f"gpukv run --verbose or {VERBOSE_ENV}=1 shows them)\n")
    return text


def _printing_hook(program: str):
    """A sys.excepthook that prints `program_traceback` (gpukv's dist stores chain theirs
    after it, to abort the job)."""
    def hook(kind: type[BaseException], value: BaseException, tb) -> None:
        sys.stderr.write(program_traceback(value, program))
        sys.stderr.flush()
    return hook


# --------------------------------------------------------------------- the run
def _is_this_python(word: str) -> bool:
    if word == sys.executable:
        return True
    try:
        return os.path.samefile(word, sys.executable)
    except OSError:
        return False


def _run_python(argv: list[str]) -> None:
    """Run a Python program in this process: `PROG.py ARGS`, `PYTHON SCRIPT ARGS` or
    `PYTHON -m MODULE ARGS`, as `python` would."""
    if _is_this_python(argv[0]):
        argv = argv[1:]
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()  # as `python -m` sets it
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python PROG` sets it
    runpy.run_path(argv[0], run_name="__main__")


def runs_here(argv: list[str]) -> bool:
    """Whether `argv` is a Python program this process runs itself (else it is exec'd)."""
    if argv[0].endswith(".py"):
        return True
    if not _is_this_python(argv[0]) or len(argv) < 2:
        return False
    return (argv[1] == "-m" and len(argv) > 2) or not argv[1].startswith("-")


def main(argv: list[str]) -> None:
    """Run `argv[0]` with `argv[1:]` as its arguments."""
    if not argv:
        sys.exit("usage: python -m gpukv.launcher.run_rank PROG [ARGS]")
    os.environ.update(torchrun_env(os.environ))
    rank = run_report.world_rank()
    if rank is not None and os.environ.get(run_report.ENV):
        local = os.environ.get("LOCAL_RANK", "")
        host = os.environ.get("PMI_HOSTNAME") or socket.gethostname()
        run_report.send_started(run_report.Started(
            rank, int(local) if local.isdigit() else None, host, os.getpid()))
        _leave_a_watcher(rank)
    if not runs_here(argv):
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            run_report.send(f"cannot run {argv[0]}", exc.strerror or str(exc), status=127)
            sys.exit(f"gpukv run: cannot run {argv[0]!r}: {exc.strerror or exc}")
    script = argv[1:] if _is_this_python(argv[0]) else argv
    program = "" if script[0] == "-m" else os.path.abspath(script[0])
    if not verbose():
        sys.excepthook = _printing_hook(program)
    ends = _EndWords(rank)
    try:
        _run_python(argv)
    except SystemExit as exc:
        ends.ended(exit_status(exc.code), "exit status {}")
        raise
    except KeyboardInterrupt:
        ends.said("interrupted (KeyboardInterrupt)", 130)
        if verbose():
            raise
        raise SystemExit(130) from None  # the launcher says it in one line
    except BaseException as exc:
        ends.said(f"uncaught {type(exc).__name__}", 1, str(exc))
        raise
    ends.ended(0, "")


class _EndWords:
    """How this rank's Python program ends, said to the launcher: that it will say so (at
    its start), then a clean end (`Done`) or a failure (a report). `os._exit` says it too,
    and an `os.exec*` that replaces the program withdraws the promise (the program run
    then says nothing). Only this process speaks for the rank: a forked child (a data
    loader's worker) that ends, by `os._exit` or through this module, says nothing."""

    def __init__(self, rank: int | None):
        self.rank, self.pid = rank, os.getpid()
        if rank is None or not os.environ.get(run_report.ENV):
            return
        run_report.send_says(run_report.Says(rank))
        real_exit, real_execv, real_execve = os._exit, os.execv, os.execve

        def _exit(status):
            self.ended(status if isinstance(status, int) else 1, "exit status {} (os._exit)")
            real_exit(status)

        def execv(path, args):
            self.withdrawn()
            real_execv(path, args)

        def execve(path, args, env):
            self.withdrawn()
            real_execve(path, args, env)
        # (os.execl*, execvp* and execvpe go through these two)
        os._exit, os.execv, os.execve = _exit, execv, execve

    def _mine(self) -> int | None:
        """The rank, when this process speaks for it (else None)."""
        return self.rank if os.getpid() == self.pid else None

    def ended(self, status: int, words: str) -> None:
        """The program ends with `status` (words: its report's, `{}` the status)."""
        rank = self._mine()
        if rank is None:
            return
        if status:
            run_report.send(words.format(status), status=status)
        else:
            run_report.send_done(run_report.Done(rank))

    def said(self, what: str, status: int, message: str = "") -> None:
        if self._mine() is not None:
            run_report.send(what, message, status=status)

    def withdrawn(self) -> None:
        rank = self._mine()
        if rank is not None:
            run_report.send_execs(run_report.Execs(rank))


if __name__ == "__main__":
    main(sys.argv[1:])

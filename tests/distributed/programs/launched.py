"""Jobs `gpukv run` starts in tests/distributed/test_launch.py: `launched.py MODE DIR`.

Every rank first writes its pid to DIR/rank-R.pid (once its signal handlers are set), so
the test can check that no process of the job is left. A rank that fails on purpose writes
the time it does to DIR/failed-at first. The ranks that do not fail wait forever.
Modes: `clean` (each rank prints a line and ends), `raise` (rank 1 ends on an uncaught
ValueError), `exit` (rank 1 calls sys.exit(3)), `kill` (rank 1 is SIGKILLed), `os-exit`
(rank 1 calls os._exit(3)), `native-exit` (rank 1 calls C's _exit(0), past Python's exit
and its reports), `stuck`
(rank 1 ignores SIGTERM and stops its MPI proxy, so mpiexec can never end the job, and
rank 0 gets a PeerError from the store it creates), `interrupt` and `deaf` (each rank
writes a line to DIR/rank-R.signals for each SIGINT or SIGTERM it gets, and ends; in `deaf`
it goes on instead, so mpiexec cannot end the job). `exit-once` and `kill-once` are `exit`
and `kill` on the first attempt of a `gpukv run --max-restarts` job and `clean` on the next
ones. A rank of a later attempt A writes its pid to DIR/attempt-A-rank-R.pid instead, and
rank 0 of every attempt the time it starts to DIR/attempt-A-started; `clean` lines say the
attempt and the most restarts (GPUKV_RUN_ATTEMPT, GPUKV_RUN_MAX_RESTARTS).
`late-uncaught`: rank 0's store reports a PeerError (rank 1 never comes), which rank 0
catches and raises again, uncaught, half a second later. `two-raise`: rank 0 ends on an
uncaught ValueError, rank 2 on a TypeError 0.3 s later.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

from mpi4py import MPI


def wait_forever() -> None:
    while True:
        time.sleep(60)


def failing(folder: Path) -> None:
    (folder / "failed-at").write_text(repr(time.time()))


def main(mode: str, folder: Path) -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    attempt = int(os.environ.get("GPUKV_RUN_ATTEMPT", "0"))
    if rank == 0:
        (folder / f"attempt-{attempt}-started").write_text(repr(time.time()))
    if mode.endswith("-once"):
        mode = mode[:-len("-once")] if attempt == 0 else "clean"
    if mode in ("interrupt", "deaf"):
        def interrupted(signum, _frame):
            with open(folder / f"rank-{rank}.signals", "a") as out:
                out.write(f"{signal.Signals(signum).name}\n")
            if mode == "interrupt":
                os._exit(1)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, interrupted)
    if mode == "stuck" and rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pid_file = f"rank-{rank}.pid" if attempt == 0 else f"attempt-{attempt}-rank-{rank}.pid"
    (folder / pid_file).write_text(str(os.getpid()))
    if mode == "clean":
        restarts = os.environ.get("GPUKV_RUN_MAX_RESTARTS")
        print(f"rank {rank} of {world.Get_size()} ran"
              + (f" in attempt {attempt} of at most {restarts} restarts" if attempt else ""),
              flush=True)
        return
    if mode == "stuck":
        world.Barrier()  # MPI is set up between the ranks: the proxy is not needed
        if rank == 1:
            os.kill(os.getppid(), signal.SIGSTOP)  # mpiexec cannot reach this host any more
            wait_forever()
        import gpukv
        try:
            gpukv.create("dist_sync")
        except gpukv.PeerError as exc:
            failing(folder)
            print(f"CAUGHT PeerError: {exc}", flush=True)
        wait_forever()
    if mode == "late-uncaught":
        world.Barrier()
        if rank == 0:
            import gpukv
            try:
                gpukv.create("dist_sync")
            except gpukv.PeerError:
                failing(folder)
                time.sleep(0.5)  # its report and the uncaught one reach the launcher apart
                raise
        wait_forever()
    if mode == "two-raise":
        world.Barrier()
        if rank == 0:
            failing(folder)
            raise ValueError("rank 0 fails first")
        if rank == 2:
            time.sleep(0.3)
            raise TypeError("rank 2 fails next")
        wait_forever()
    failures = ("raise", "exit", "kill", "os-exit", "native-exit")
    if mode in failures:
        world.Barrier()  # every rank has written its pid file: none is killed before it
    if rank == 1 and mode in failures:
        failing(folder)
        if mode == "raise":
            raise ValueError("rank 1 fails on purpose")
        if mode == "exit":
            sys.exit(3)
        if mode == "os-exit":
            os._exit(3)
        if mode == "native-exit":  # no word on its end, and a status saying nothing failed
            ctypes.CDLL(None)._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    wait_forever()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))

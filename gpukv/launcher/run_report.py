"""The one-line reports the ranks of a `gpukv run` job send their launcher.

`gpukv run` listens on a UDP socket and names it in GPUKV_RUN_REPORT (`ADDR:PORT`). Three
kinds of datagram go there, one line each:
- a failure (`Report`): a rank whose transport fails, or which ends on an uncaught
  exception or a non-zero exit, says so, so that the launcher can end the job even where
  mpiexec cannot (a host cut off);
- a start (`Started`): each rank's entry (`run_rank`) says, before the program runs, its
  rank, local rank, host and pid, which the launcher's failure lines name;
- an end (`Ended`): the watcher `run_rank` leaves beside each rank says when the rank's
  process has ended, however it ended (kill -9 included), before mpiexec learns of it: the
  first of these tells which rank a process that "ended badly" was;
- a word on the end (`Says`, `Done`, `Execs`): a Python program run in the rank's own
  process says at its start that it will say how it ends, and at a clean end that it is
  done (a failed end is a `Report`; `os._exit` says either), or, replacing itself by
  `os.exec*`, that it will not: its process ending without a word (a crash in native code,
  a C-level `_exit`) is a failure the launcher acts on at once, where mpiexec may not.
Sending never blocks nor raises; nothing is sent when the variable is unset.
"""
from __future__ import annotations

import os
import socket
from typing import NamedTuple

ENV = "GPUKV_RUN_REPORT"
_TAG = "gpukv-run-report"
_STARTED = "gpukv-run-started"
_ENDED = "gpukv-run-ended"
_SAYS = "gpukv-run-says-its-end"
_DONE = "gpukv-run-done"
_EXECS = "gpukv-run-execs"
_LIMIT = 1024  # bytes: small enough to cross any link in one piece
# where MPI launchers put a process's rank in the world (MPICH's Hydra, Open MPI, PMIx)
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


class Report(NamedTuple):
    """What a rank said: its rank (None if unknown), its exit status if it is ending with
    one, what failed (`PeerError`, `exit status 3`, `uncaught ValueError`) and the words."""
    rank: int | None
    status: int | None
    what: str
    message: str


class Started(NamedTuple):
    """A rank that started: its rank, its rank on its host (None if unknown), its host (as
    mpiexec names it) and its process id."""
    rank: int
    local_rank: int | None
    host: str
    pid: int


class Ended(NamedTuple):
    """A rank's process that ended, told by the watcher beside it: its rank and pid."""
    rank: int
    pid: int


class Says(NamedTuple):
    """A rank whose program will say how it ends (`Done`, or a failure `Report`)."""
    rank: int


class Done(NamedTuple):
    """A rank whose program ended cleanly (status 0), said before its process ends."""
    rank: int


class Execs(NamedTuple):
    """A rank whose program replaced itself (`os.exec*`): its end will not be said."""
    rank: int


def world_rank(default: int | None = None) -> int | None:
    """This process's rank in the job, as the MPI launcher set it; else `default`."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def _send(fields: list) -> bool:
    """One datagram of `fields` (each flattened to one line without tabs) to the launcher
    named in GPUKV_RUN_REPORT; whether it was sent."""
    target = os.environ.get(ENV, "").strip()
    if not target:
        return False
    line = "\t".join(" ".join(str(field).split()) for field in fields)  # one line, no tabs
    try:
        host, _, port = target.rpartition(":")
        # numeric only: a name to look up could block
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_DGRAM,
            flags=socket.AI_NUMERICHOST)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setblocking(False)
            sock.sendto(line.encode()[:_LIMIT], address)
    except (OSError, ValueError, IndexError):  # a report is a courtesy: never a new failure
        return False
    return True


def send(what: str, message: str = "", status: int | None = None,
         rank: int | None = None) -> bool:
    """Send one failure report to the launcher; whether it was sent."""
    rank = world_rank(rank)
    return _send([_TAG, "-" if rank is None else rank, "-" if status is None else status,
                  what, message])


def send_started(started: Started) -> bool:
    """Tell the launcher a rank started; whether it was sent."""
    local = "-" if started.local_rank is None else started.local_rank
    return _send([_STARTED, started.rank, local, started.host or "-", started.pid])


def send_ended(ended: Ended) -> bool:
    """Tell the launcher a rank's process ended; whether it was sent."""
    return _send([_ENDED, ended.rank, ended.pid])


def send_says(says: Says) -> bool:
    """Tell the launcher a rank's program will say how it ends; whether it was sent."""
    return _send([_SAYS, says.rank])


def send_done(done: Done) -> bool:
    """Tell the launcher a rank's program ended cleanly; whether it was sent (twice: a
    lost one would make a clean end look like a failure)."""
    return any([_send([_DONE, done.rank]) for _ in range(2)])


def send_execs(execs: Execs) -> bool:
    """Tell the launcher a rank's program is replacing itself; whether it was sent."""
    return _send([_EXECS, execs.rank])


def _number(text: str) -> int | None:
    return int(text) if text.lstrip("-").isdigit() else None


def parse(data: bytes) -> Report | Started | Ended | Says | Done | Execs | None:
    """The report in a datagram, or None when it is not one."""
    fields = data.decode(errors="replace").rstrip("\n").split("\t")
    if len(fields) == 5 and fields[0] == _TAG:
        _, rank, status, what, message = fields
        return Report(int(rank) if rank.isdigit() else None, _number(status), what, message)
    if len(fields) == 5 and fields[0] == _STARTED and fields[1].isdigit() \
            and fields[4].isdigit():
        _, rank, local, host, pid = fields
        return Started(int(rank), int(local) if local.isdigit() else None, host, int(pid))
    if len(fields) == 3 and fields[0] == _ENDED and fields[1].isdigit() \
            and fields[2].isdigit():
        return Ended(int(fields[1]), int(fields[2]))
    if len(fields) == 2 and fields[1].isdigit():
        number = int(fields[1])
        if fields[0] == _SAYS:
            return Says(number)
        if fields[0] == _DONE:
            return Done(number)
        if fields[0] == _EXECS:
            return Execs(number)
    return None

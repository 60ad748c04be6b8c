"""The one-line reports a rank of a `gpukv run` job sends its launcher when it fails.

`gpukv run` listens on a UDP socket and names it in GPUKV_RUN_REPORT (`ADDR:PORT`). A rank
whose transport fails, or which ends on an uncaught exception or a non-zero exit, sends one
datagram there, so that the launcher can end the job even where mpiexec cannot (a host cut
off). Sending never blocks nor raises; nothing is sent when the variable is unset.
"""
from __future__ import annotations

import os
import socket
from typing import NamedTuple

ENV = "GPUKV_RUN_REPORT"
_TAG = "gpukv-run-report"
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


def world_rank(default: int | None = None) -> int | None:
    """This process's rank in the job, as the MPI launcher set it; else `default`."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def send(what: str, message: str = "", status: int | None = None,
         rank: int | None = None) -> bool:
    """Send one report to the launcher named in GPUKV_RUN_REPORT; whether it was sent."""
    target = os.environ.get(ENV, "").strip()
    if not target:
        return False
    rank = world_rank(rank)
    fields = [_TAG, "-" if rank is None else str(rank), "-" if status is None else str(status),
              what, message]
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


def parse(data: bytes) -> Report | None:
    """The report in a datagram, or None when it is not one."""
    fields = data.decode(errors="replace").rstrip("\n").split("\t")
    if len(fields) != 5 or fields[0] != _TAG:
        return None
    _, rank, status, what, message = fields
    return Report(int(rank) if rank.isdigit() else None,
                  int(status) if status.lstrip("-").isdigit() else None, what, message)

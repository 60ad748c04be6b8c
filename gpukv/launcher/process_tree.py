"""The processes a launcher started, found and ended through /proc (Linux).

MPICH's mpiexec puts each proxy and each rank in a session of its own, so a process group
does not hold a job: the launcher walks its descendants instead. As a child subreaper it
adopts those whose parent died (an mpiexec or a proxy killed first), so none slips out of
reach. Should the launcher itself end without ending its job (a `kill -9`), mpiexec is
killed with it (`die_with_parent`), and the job's processes on this host are found by a
variable of their environment (`marked`). Elsewhere (no /proc) there are no descendants to
find: only the process group of mpiexec is signalled.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
_PROC = Path("/proc")


def adopt_orphans() -> bool:
    """Make this process the one that orphaned descendants are handed to (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def ending() -> list[int]:
    """The signals that end a launcher's job: Ctrl-C, SIGTERM and a hang-up (the terminal
    closed, an ssh connection dropped), unless hang-ups are ignored here (`nohup`)."""
    caught: list[int] = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        caught.append(signal.SIGHUP)
    return caught


def die_with_parent(signum: int):
    """A `preexec_fn` for `subprocess.Popen` that has the child sent `signum` when the
    process that starts it ends, however it ends (Linux's parent-death signal, kept across
    exec); None elsewhere. A parent that is already gone when the child asks has it send
    `signum` to itself at once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0 and os.getppid() != parent:
            os.kill(os.getpid(), signum)
    return preexec


def marked(name: str, value: str) -> list[int]:
    """The living processes whose environment has `name` set to `value` (as they were
    started: a change a process makes to its own environment is not seen), among those
    this user may read."""
    entry_of = f"{name}={value}".encode()
    found = []
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes()  # a zombie's is empty
        except OSError:  # ended meanwhile, or another user's
            continue
        if entry_of in environment.split(b"\0"):
            found.append(int(entry.name))
    return found


def _parents() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process visible in /proc."""
    table = {}
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        table[int(entry.name)] = (int(ppid), state)
    return table


def descendants(root: int) -> tuple[list[int], list[int]]:
    """The living descendants of `root`, and its children that are zombies to reap."""
    table = _parents()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    living, zombies, todo = [], [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if table[pid][1] == "Z":
            if table[pid][0] == root:
                zombies.append(pid)
        else:
            living.append(pid)
        todo.extend(children.get(pid, []))
    return living, zombies


def signal_all(pids: list[int], signum: int) -> None:
    """Send `signum` to each of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(pgid: int, signum: int) -> None:
    """Send `signum` to the process group `pgid`, if it still has members."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def reap(zombies: list[int]) -> None:
    """Collect the exit status of adopted children that ended (they would stay zombies)."""
    for pid in zombies:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass

"""The lines a failed `gpukv run` attempt ends with: one per failed rank.

Each names the rank, its local rank, its host and its pid (from the rank's start report,
`run_report.Started`) and what happened: the exception (type and message) or the exit status
a rank reported itself, or, for a process that ended without a word (kill -9, a crash), how
it ended as mpiexec saw it: `rank 2 (local rank 2) on host vm, pid 9110: killed by signal 9
(SIGKILL)`.

Which rank that was is not what mpiexec's box says: the box names the first process of its
host (in rank order) whose status is not 0 once mpiexec has ended them all, and its cleanup
kills every other process with SIGKILL, so it mostly names another rank. The rank is the
first whose end its watcher reported (the watcher speaks before mpiexec hears of the end),
and how it ended is its status among mpiexec's exit codes (`-print-all-exitcodes`: each
host's statuses in local-rank order); without them, the box's. A non-zero exit of an exec'd
PROG (a shell script, `python -c`) has no box, and no word of the rank's: the exit codes
alone say which rank it was (the first rank to end may well have ended with 0).
"""
from __future__ import annotations

import re
import signal
from typing import NamedTuple

from .run_report import Ended, Report, Started

_BOX_START = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES")
_BOX_WHO = re.compile(r"^=\s+(?:RANK (\d+) )?PID (\d+) RUNNING AT (\S+)")
_BOX_HOW = re.compile(r"^=\s+(EXIT CODE|KILLED BY SIGNAL): (\d+)")
_ABORT = re.compile(r"^Abort\((-?\d+)\) on node \d+ \(rank (\d+) in comm \d+\): (.*?)"
                    r"(?: - process \d+)?$")
_CODES = re.compile(r"^\[mpiexec@[^\]]*\] Exit codes: (.*)$")
_HOST_CODES = re.compile(r"\[([^\]]+)\]\s*(-?\d+(?:\s*,\s*-?\d+)*)")
# each further host's codes, on a line of its own right after the first host's
_MORE_CODES = re.compile(r"^\s*\[[^\]]+\]\s*-?\d+(?:\s*,\s*-?\d+)*\s*$")


class Box(NamedTuple):
    """mpiexec's box: the host and pid it names (and rank, where it says one), the number
    it gives and whether it calls it a signal."""
    host: str
    pid: int
    rank: int | None
    code: int
    signalled: bool


class Abort(NamedTuple):
    """MPI's word that a rank called MPI_Abort: the rank, its error code and the words."""
    rank: int
    code: int
    words: str


class Failure(NamedTuple):
    """One line's words (without `gpukv run: `) and the exit status it stands for."""
    words: str
    status: int | None


class MpiexecWords:
    """What mpiexec said about the ends, read line by line: its first box, the first rank
    that called MPI_Abort, its exit codes."""

    def __init__(self) -> None:
        self.box: Box | None = None
        self.abort: Abort | None = None
        self.codes: dict[str, list[int]] = {}
        self._who: tuple[int | None, int, str] | None = None
        self._in_box = False
        self._in_codes = False  # the last line of mpiexec's was one of its exit codes

    def read(self, text: str) -> bool:
        """Take in one of mpiexec's lines; whether it was the first word of a failure (the
        first box, or the first MPI_Abort)."""
        abort = _ABORT.match(text)
        if abort:
            if self.abort is not None:
                return False
            self.abort = Abort(int(abort[2]), int(abort[1]), abort[3])
            return self.box is None
        codes = _CODES.match(text)
        if codes:
            self._take_codes(codes[1])
            self._in_codes = True
            return False
        if _BOX_START.search(text):
            self._in_box, self._who = True, None
            return False
        if not self._in_box:
            return False
        who = _BOX_WHO.match(text)
        if who:
            self._who = (int(who[1]) if who[1] else None, int(who[2]), who[3])
            return False
        how = _BOX_HOW.match(text)
        if how and self._who is not None:
            self._in_box = False
            if self.box is None:
                rank, pid, host = self._who
                self.box = Box(host, pid, rank, int(how[2]), how[1] == "KILLED BY SIGNAL")
                return self.abort is None
        return False

    def more_codes(self, text: str) -> bool:
        """Whether a line of mpiexec's own (not a rank's) is one more host's exit codes,
        which follow the first host's a line each; if so they are taken in."""
        if self._in_codes and _MORE_CODES.match(text):
            self._take_codes(text)
            return True
        self._in_codes = False
        return False

    def _take_codes(self, text: str) -> None:
        for host, numbers in _HOST_CODES.findall(text):
            self.codes[host] = [int(n) for n in numbers.split(",")]

    def status_of(self, started: Started | None) -> int | None:
        """The wait status mpiexec gives the rank of `started`, if it gave one."""
        if started is None or started.local_rank is None:
            return None
        codes = self.codes.get(started.host, [])
        return codes[started.local_rank] if started.local_rank < len(codes) else None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def how_it_ended(wait_status: int) -> Failure:
    """A wait status in words, with the exit status mpiexec gives it: the signal's number
    for a process a signal ended, else its exit status."""
    if wait_status & 0x7F:
        number = wait_status & 0x7F
        return Failure(f"killed by signal {number} ({signal_name(number)})", number)
    return Failure(f"exit status {wait_status >> 8}", wait_status >> 8)


def who(rank: int | None, started: dict[int, Started]) -> str:
    """`rank R (local rank L) on host H, pid P`, as much of it as is known."""
    if rank is None:
        return "a rank"
    known = started.get(rank)
    if known is None:
        return f"rank {rank}"
    local = "" if known.local_rank is None else f" (local rank {known.local_rank})"
    return f"rank {rank}{local} on host {known.host}, pid {known.pid}"


def of_report(report: Report, started: dict[int, Started]) -> Failure:
    """The line of a rank's own report."""
    words = f"{who(report.rank, started)}: {report.what}"
    if report.message:
        words += f": {report.message[:300]}"
    return Failure(words, report.status)


def of_reports(reports: list[Report], started: dict[int, Started]) -> list[Failure]:
    """One line per rank of the ranks' own reports, in the order the ranks first spoke.

    A rank can report one failure twice: its transport's `PeerError` when it happens, and
    the same exception again (`uncaught PeerError`, with its status) when it ends the
    program. The line is the later report when it is the same exception, as it says more
    (that it ended the rank, and how); otherwise the first, the cause, with the status of
    the rank's end where a later report gives one."""
    kept: dict[object, Report] = {}  # rank -> its report (without a rank: the report)
    for report in reports:
        who = report if report.rank is None else report.rank
        first = kept.get(who)
        kept[who] = report if first is None else _one_of_two(first, report)
    return [of_report(report, started) for report in kept.values()]


def _one_of_two(first: Report, later: Report) -> Report:
    """What a rank's line says of its two reports (`of_reports`)."""
    if later.what == f"uncaught {first.what}" and later.message == first.message:
        return later
    return first if first.status is not None else first._replace(status=later.status)


def of_mpiexec(said: MpiexecWords, started: dict[int, Started],
               ended: list[Ended], wordless: set | frozenset = frozenset()) -> Failure:
    """The line of the first failure mpiexec told of: a rank's MPI_Abort, or a process that
    ended badly (the first rank whose end was reported and whose status, where mpiexec
    gave them, is not 0, or which ended without its program's word: `wordless`, a C-level
    `_exit(0)` that mpiexec then ends the others for)."""
    if said.abort is not None:
        abort = said.abort
        words = abort.words or f"called MPI_Abort with error code {abort.code}"
        return Failure(f"{who(abort.rank, started)}: {words}", abort.code)
    box = said.box
    assert box is not None
    first: int | None = None
    for end in ended:
        status = said.status_of(started.get(end.rank))
        if (status != 0 or end.rank in wordless) and end.rank in started:
            first = end.rank
            break
    if first is not None:
        status = said.status_of(started[first])
        if status == 0:  # wordless
            return Failure(f"{who(first, started)}: ended without a word: its process "
                           f"ended past Python's own exit, with status 0", 1)
        how = how_it_ended(status) if status is not None else _how_of_box(box)
        return Failure(f"{who(first, started)}: {how.words}", how.status)
    how = _how_of_box(box)
    if box.rank is not None:  # a later MPICH's box names the rank
        return Failure(f"{who(box.rank, started)}: {how.words}", how.status)
    return Failure(f"a process on host {box.host} ended badly: {how.words}", how.status)


def of_silence(status: int, started: dict[int, Started], ended: list[Ended],
               said: MpiexecWords | None = None,
               clean: set | frozenset = frozenset()) -> Failure:
    """The line of a job mpiexec ended with `status` (its exit status) without a box: a
    non-zero exit of an exec'd PROG (a shell script, `python -c`), which mpiexec tells only
    in its exit codes, or a job whose proxy ended before it forwarded what a rank printed
    last (MPICH's banner of an MPI_Abort).

    The rank is the first whose end its watcher reported among those mpiexec's exit codes
    (`said`) give a status other than 0, with how it ended; without a code, the first whose
    end was reported and that is not known to have ended well (a code of 0, or its
    program's word in `clean`): `ended first, without a word`; else mpiexec's status alone.
    """
    words = f"mpiexec ended with status {status}"
    order = [end.rank for end in ended if end.rank in started]
    order += sorted(set(started) - set(order))  # (a watcher that never spoke)
    codes = {rank: said.status_of(started[rank]) if said else None for rank in order}
    for rank, code in codes.items():
        if code:
            how = how_it_ended(code)
            return Failure(f"{who(rank, started)}: {how.words}", how.status)
    ended_ranks = {end.rank for end in ended}
    first = next((rank for rank in order if rank in ended_ranks and codes[rank] is None
                  and rank not in clean), None)
    if first is not None:
        words = f"{who(first, started)}: ended first, without a word; {words}"
    return Failure(words, status)


def _how_of_box(box: Box) -> Failure:
    if box.signalled:
        return Failure(f"killed by signal {box.code} ({signal_name(box.code)})", box.code)
    return Failure(f"exit code {box.code}", box.code)

"""What a `gpukv run` job writes, rank by rank.

Each whole line of a rank's stdout and stderr goes to the launcher's own stdout and stderr
after `[R] ` (R the rank), and with --log-dir also to that rank's file of the attempt
(`DIR/attemptA/rankR.log`, both streams, without the prefix). mpiexec prefixes each piece of
a rank's output it forwards with a pattern holding the rank (-prepend-pattern, with a token
drawn for the job so that no program's output is taken for it); pieces of several ranks
arrive interleaved, and a line may come in several pieces, so each rank's text is gathered
until a line ends (`\\n`, or `\\r` for a progress bar) before it is written, whole, after
one prefix: two ranks' partial lines are never joined. A line that never ends is written
when the job ends; one longer than `LONGEST` (16 MiB: a rank printing without newlines
holds no more than that of the launcher's memory a stream) is written in lines of
`LONGEST` bytes, each after its prefix.

mpiexec's own words (the box it prints when a process ends badly, its exit codes, its notes
on Ctrl-C, and, once the launcher is ending the job, its complaints about the processes it
killed) and the ranks' MPI abort banners are the launcher's to explain in its own lines:
they are written only with --verbose (GPUKV_RUN_VERBOSE=1), and always to
`DIR/attemptA/mpiexec.log` (the banners to the rank's file). Anything else mpiexec or ssh
says (a host it cannot reach) is written as it comes.
"""
from __future__ import annotations

import re
import secrets
import sys
from pathlib import Path
from typing import BinaryIO, NamedTuple

#: the longest piece of a line kept waiting for its end before it is written as a line
LONGEST = 16 << 20
#: mpiexec options under which the ranks' output is not the launcher's to prefix
PREFIXING_OPTIONS = ("-prepend-rank", "-l", "-prepend-pattern", "-outfile-pattern",
                     "-errfile-pattern")

# mpiexec's (Hydra's) words about the ends, which the launcher's lines say instead
_HYDRA_ENDS = re.compile(
    r"^(={83}$|=\s+(BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES|(RANK \d+ )?PID \d+ "
    r"RUNNING AT|EXIT CODE:|KILLED BY SIGNAL:|CLEANING UP REMAINING PROCESSES|YOU CAN IGNORE "
    r"THE BELOW CLEANUP MESSAGES)|\[mpiexec@[^\]]*\] (Exit codes:|Sending Ctrl-C|Press Ctrl-C)"
    r"|Abort\(-?\d+\) on node \d+ \(rank \d+ in comm \d+\): |YOUR APPLICATION TERMINATED "
    r"WITH THE EXIT STRING:|This typically refers to a problem with your application\.|Please "
    r"see the FAQ page for debugging suggestions)")
# the rest of what mpiexec and its proxies say, hidden once the launcher ends the job
_HYDRA = re.compile(r"^\[(mpiexec|proxy:[^@\]]*)@[^\]]*\] ")
# where mpiexec starts a message of its own (its box: an empty line, then a border of 83
# `=` written in pieces, the first of 50)
_MPIEXEC_STARTS = re.compile(
    rb"\n={50}|\[mpiexec@|\[proxy:|YOUR APPLICATION TERMINATED W|Abort\(-?\d+\) on node \d+ \(")
# what a rank prints as the job is aborted: MPICH's banner, gpukv's dist stores' note
_ABORTING = re.compile(r"^(Abort\(\d+\) on node \d+|gpukv: rank \d+: aborting the MPI job)")


def new_token() -> str:
    return secrets.token_hex(6)


def pattern(token: str) -> str:
    """mpiexec's -prepend-pattern for the job's `token` (letters and digits only, so that it
    crosses ssh and the remote shell as it is)."""
    return f"GKV{token}R%rK"


class Line(NamedTuple):
    """A line of a stream: its rank (None: mpiexec's own), its text and how it ended."""
    rank: int | None
    text: bytes
    end: bytes


class Demux:
    """One of mpiexec's output streams (stdout or stderr), cut into `Line`s; without a
    token (the ranks' output prefixed by mpiexec as the user asked) all lines are None's."""

    def __init__(self, token: str | None):
        self._head = b"GKV" + token.encode() + b"R" if token else b""
        self._marker = re.compile(re.escape(self._head) + rb"(\d+)K") if token else None
        self._tail = b""  # what may be the start of a marker cut by the read
        self._owner: int | None = None
        self._pieces: dict[int | None, bytearray] = {}

    def feed(self, data: bytes) -> list[Line]:
        """The lines `data` completes, in order."""
        lines: list[Line] = []
        data, self._tail = self._tail + data, b""
        if self._marker is None:
            self._add(None, data, lines)
            return lines
        at = 0
        for found in self._marker.finditer(data):
            self._take(data[at:found.start()], lines)
            self._owner, at = int(found[1]), found.end()
        rest = data[at:]
        cut = self._marker_start(rest)
        self._take(rest[:cut], lines)
        self._tail = rest[cut:]
        return lines

    def _take(self, data: bytes, lines: list[Line]) -> None:
        """Give `data` to the rank whose piece it is, up to where mpiexec starts a message
        of its own (it may do so right after a rank's unfinished line); from there on until
        the next marker it is mpiexec's."""
        if self._owner is not None:
            own = _MPIEXEC_STARTS.search(data)
            if own:
                self._add(self._owner, data[:own.start()], lines)
                self._owner, data = None, data[own.start():]
        self._add(self._owner, data, lines)

    def _marker_start(self, data: bytes) -> int:
        """Where an unfinished marker starts at the end of `data` (else its length)."""
        start = data.rfind(self._head[:1], max(0, len(data) - len(self._head) - 12))
        while start != -1:
            tail = data[start:]
            if self._head.startswith(tail) or (tail.startswith(self._head)
                                               and tail[len(self._head):].isdigit()):
                return start
            start = data.find(self._head[:1], start + 1)
        return len(data)

    def _add(self, owner: int | None, data: bytes, lines: list[Line]) -> None:
        if not data:
            return
        piece = self._pieces.setdefault(owner, bytearray())
        # what is held has no line end but maybe a last \r: only the new data is searched,
        # each byte once (a long line comes in many reads)
        searched = max(0, len(piece) - 1)
        piece += data
        start = 0
        newline, cr = piece.find(b"\n", searched), piece.find(b"\r", searched)
        while newline != -1 or cr != -1:
            if cr == -1 or (newline != -1 and newline < cr):  # \n
                lines.append(Line(owner, bytes(piece[start:newline]), b"\n"))
                start = newline + 1
            elif cr + 1 == len(piece):
                break  # maybe the \r of a \r\n cut by the read
            elif newline == cr + 1:  # \r\n
                lines.append(Line(owner, bytes(piece[start:cr]), b"\n"))
                start = newline + 1
            else:  # \r alone (a progress bar)
                lines.append(Line(owner, bytes(piece[start:cr]), b"\r"))
                start = cr + 1
            if newline != -1 and newline < start:
                newline = piece.find(b"\n", start)
            if cr != -1 and cr < start:
                cr = piece.find(b"\r", start)
        del piece[:start]
        while len(piece) >= LONGEST:
            lines.append(Line(owner, bytes(piece[:LONGEST]), b"\n"))
            del piece[:LONGEST]

    def flush(self) -> list[Line]:
        """The lines left unfinished (the job has ended), each ended here."""
        lines: list[Line] = []
        if self._tail:
            self._add(self._owner, self._tail, lines)
            self._tail = b""
        lines += [Line(owner, bytes(piece).rstrip(b"\r"), b"\n")
                  for owner, piece in self._pieces.items() if piece]
        self._pieces.clear()
        return lines


def about_the_ends(text: str) -> bool:
    """Whether a line is mpiexec's word about how the processes ended."""
    return bool(_HYDRA_ENDS.match(text))


def from_mpiexec(text: str) -> bool:
    """Whether a line is said by mpiexec or one of its proxies."""
    return bool(_HYDRA.match(text))


def aborting(text: str) -> bool:
    """Whether a rank's line is its MPI abort banner (or gpukv's note that it aborts)."""
    return bool(_ABORTING.match(text))


def start_logs(folder: Path, ranks: int | None) -> None:
    """An attempt's folder of logs with an empty file for each of its `ranks` (one that
    prints nothing has its file too; None: unknown, none made), and none left of an
    earlier run's, which would mix with these when the folder is used again."""
    for old in [*folder.glob("rank*.log"), *folder.glob("mpiexec.log")]:
        old.unlink()
    for rank in range(ranks or 0):
        open(folder / f"rank{rank}.log", "wb").close()


class Console:
    """Where the lines go: the launcher's stdout and stderr (the ranks' lines after `[R] `),
    and with `log_dir` the files of the attempt."""

    def __init__(self, verbose: bool, log_dir: Path | None = None):
        self.verbose = verbose
        self.log_dir = log_dir
        self._files: dict[str, BinaryIO] = {}

    def write(self, line: Line, stream: int, ending: bool, about_ends: bool = False) -> None:
        """Write `line` of mpiexec's stream `stream` (1 or 2); `ending`: the launcher is
        ending the job (mpiexec's complaints are then its consequences); `about_ends`: a
        line of mpiexec's about the ends that only what came before tells (more exit
        codes)."""
        text = line.text.decode(errors="replace")
        if about_ends or about_the_ends(text) or (line.rank is None and (
                (from_mpiexec(text) and ending) or not line.text.strip())):
            self._log("mpiexec", line.text + line.end)
            if self.verbose:
                self._out(2, line.text + line.end)
            return
        if line.rank is not None and aborting(text) and not self.verbose:
            self._log(f"rank{line.rank}", line.text + line.end)
            return
        self._show(line, stream)

    def _show(self, line: Line, stream: int) -> None:
        if line.rank is None:
            self._out(stream, line.text + line.end)
            self._log("mpiexec", line.text + line.end)
            return
        self._out(stream, b"[%d] " % line.rank + line.text + line.end)
        self._log(f"rank{line.rank}", line.text + line.end)

    def finish(self) -> None:
        """Write what is held and close the files."""
        for file in self._files.values():
            file.close()
        self._files.clear()

    def _out(self, stream: int, data: bytes) -> None:
        target = sys.stdout if stream == 1 else sys.stderr
        try:
            target.flush()
            target.buffer.write(data)
            target.flush()
        except (BrokenPipeError, OSError, AttributeError, ValueError):
            pass  # nobody reads our output: the job still runs to its end

    def _log(self, name: str, data: bytes) -> None:
        if self.log_dir is None:
            return
        file = self._files.get(name)
        if file is None:
            try:
                file = self._files[name] = open(self.log_dir / f"{name}.log", "wb")
            except OSError:
                return
        try:
            file.write(data)
            file.flush()
        except OSError:
            pass

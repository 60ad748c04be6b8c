"""A hydra host file (`mpiexec -f FILE`) read as mpiexec reads it, so that `gpukv run` can
restart a job given one on the hosts of the file that still answer.

One host a line, `HOST` or `HOST:N` (N slots: processes the host takes before mpiexec moves
on to the next); `#` starts a comment; blank lines are ignored.
"""
from __future__ import annotations

from .._errors import ArgumentError

#: the mpiexec options that name a host file
OPTIONS = ("-f", "-hostfile", "-machinefile")


def parse(text: str, name: str) -> list[str]:
    """The `HOST[:N]` entries of host file `name` holding `text`, in order; ArgumentError
    naming the file (and the line) when a line is not one `HOST[:N]` with N >= 1, or when
    the file names no host."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 1 or not _is_entry(words[0]):
            raise ArgumentError(f"host file {name!r}, line {number}: expected HOST or "
                                f"HOST:N (N >= 1 slots), got {line.strip()!r}")
        entries.append(words[0])
    if not entries:
        raise ArgumentError(f"host file {name!r} names no host")
    return entries


def _is_entry(word: str) -> bool:
    """Whether `word` is HOST or HOST:N with N >= 1 (an IPv6 address, with its many colons,
    is a HOST)."""
    if word.count(":") != 1:
        return True
    host, slots = word.split(":")
    return bool(host) and slots.isdigit() and int(slots) >= 1


def read(path: str) -> list[str]:
    """The entries of the host file at `path` (see `parse`); ArgumentError naming the file
    when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ArgumentError(f"host file {path!r} cannot be read: {reason}") from None
    return parse(text, path)


def given(mpiexec_options: list[str]) -> list[tuple[str, str]]:
    """The (option, file) pairs among mpiexec's options that name a host file."""
    return [(word, value) for word, value in zip(mpiexec_options, mpiexec_options[1:])
            if word in OPTIONS]


def without(mpiexec_options: list[str]) -> list[str]:
    """mpiexec's options less those naming a host file (and their files)."""
    kept: list[str] = []
    skip = False
    for word in mpiexec_options:
        if skip:
            skip = False
        elif word in OPTIONS:
            skip = True
        else:
            kept.append(word)
    return kept

"""Settings read from environment variables, refused with a typed error when malformed
(named instead where they only annotate a log line)."""
from __future__ import annotations

import os

from ._errors import ArgumentError


def positive_int(name: str, error: type = ArgumentError) -> int | None:
    """`$name` as a positive int, None when unset or blank; `error` names it when malformed."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise error(f"{name}={raw!r}: expected a positive integer")
    return n


def flag(name: str, error: type = ArgumentError) -> bool | None:
    """`$name` as a bool ('1': True, '0': False), None when unset or blank; `error` names
    it when it is anything else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw not in ("0", "1"):
        raise error(f"{name}={raw!r}: expected 1 (on) or 0 (off)")
    return raw == "1"


#: set by `gpukv run --max-restarts K` in every attempt's environment (gpukv.launcher.restarts,
#: which imports nothing of the stores): the attempt (0 the first) and K
RUN_ATTEMPT = "GPUKV_RUN_ATTEMPT"
RUN_MAX_RESTARTS = "GPUKV_RUN_MAX_RESTARTS"


def restart_note() -> str:
    """'restart A of at most K (GPUKV_RUN_ATTEMPT=A)' when this process runs in attempt
    A > 0 of `gpukv run --max-restarts K`, '' otherwise, for a log line. A malformed value
    is named, not refused: a note in a log line must not stop a store from being made."""
    attempt, bad = _count(RUN_ATTEMPT)
    if bad or not attempt:
        return bad
    bound, bad = _count(RUN_MAX_RESTARTS)
    of = "" if bound is None else f" of at most {bound}"
    return f"restart {attempt}{of} ({RUN_ATTEMPT}={attempt}{', ' + bad if bad else ''})"


def _count(name: str) -> tuple[int | None, str]:
    """`$name` as an int >= 0 (None when unset or blank), or None and words naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None, ""
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        return None, f"{name}={raw!r}: not a count"
    return n, ""

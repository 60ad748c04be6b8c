"""Settings read from environment variables, refused with a typed error when malformed."""
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

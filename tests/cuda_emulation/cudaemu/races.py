"""A happens-before checker over every allocation of the emulated GPUs, after PyTorch's
CUDA sanitizer (`torch.cuda._sanitizer`).

Each stream carries a vector clock (streams.Lane): an operation ticks its stream's own
entry, an event carries the clock of its stream when recorded, and a wait joins it into
the waiting stream's clock. Each allocation keeps the accesses not yet superseded (byte
range, read or write, the stream and its tick, what did it and where). A new access that
conflicts with a kept one (both touch a byte, one writes) from another stream whose tick
the new access's clock has not reached is a race: `StreamRaceError` names both
operations, their streams, the allocation and the source line that issued each. A
device allocation freed by the host goes back to its stream's pool, which may hand it to
that stream's next allocation at once: the free counts as a write of the whole
allocation on that stream. Pinned host memory freed while a copy of a stream may still
use it (the host never saw that copy complete) is the same error, and so is pinned memory
the host rewrote while a copy from it was still queued.

`GPUKV_EMU_RACES=0` turns the checker off; every race found is also kept in `found`,
which the test suite checks after each test.
"""
from __future__ import annotations

import os
import sys
import threading

ENABLED = os.environ.get("GPUKV_EMU_RACES", "1") != "0"
_EMULATION_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: source lines named per operation (GPUKV_EMU_RACES_STACK: more, callers after)
_STACK = max(1, int(os.environ.get("GPUKV_EMU_RACES_STACK", "1")))
_MAX_KEPT = 512  # accesses kept per allocation (the oldest go first past it)

#: every race found so far (messages), for the test suite's after-test check
found: list = []
_found_lock = threading.Lock()


class StreamRaceError(RuntimeError):
    """Two accesses to device memory, at least one a write, that no stream order, event
    or host synchronisation puts one after the other."""


class Access:
    __slots__ = ("lo", "hi", "write", "lane", "tick", "label", "site", "stream")

    def __init__(self, lo, hi, write, lane, tick, label, site):
        self.lo, self.hi, self.write, self.lane, self.tick = lo, hi, write, lane.id, tick
        self.label, self.site, self.stream = label, site, lane.name()


def site() -> str:
    """The source line that issued the current operation: the innermost frame outside
    the emulation (and outside the standard library's threading and contextlib)."""
    frame = sys._getframe(1)
    lines: list = []
    while frame is not None and len(lines) < _STACK:
        name = frame.f_code.co_filename
        if not name.startswith(_EMULATION_DIR) and not name.endswith(
                ("contextlib.py", "threading.py", "functools.py")):
            lines.append(f"{os.path.relpath(name)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(lines) or "?"


def _describe(info: dict, lo: int) -> str:
    place = info["place"]
    where = "pinned host memory" if place == "pinned" else f"GPU {place}"
    made = f", allocated at {info['site']}" if info.get("site") else ""
    return (f"the {info['size']}-byte allocation at {info['ptr']:#x} on {where} "
            f"(byte {lo - info['ptr']}{made})")


def _report(message: str) -> None:
    with _found_lock:
        found.append(message)
    raise StreamRaceError(message)


def _words(a) -> str:
    return (f"{'write' if a.write else 'read'} by {a.label} on {a.stream}, "
            f"issued at {a.site}")


def record(mem, ptr: int, nbytes: int, write: bool, lane, clock: dict, label: str,
           where: str) -> None:
    """Check an access of [ptr, ptr + nbytes) of `mem` on `lane` (clock `clock`) against
    the kept ones, then keep it."""
    info = getattr(mem, "info", None)
    if not ENABLED or info is None or nbytes <= 0:
        return
    lo, hi = int(ptr), int(ptr) + int(nbytes)
    new = Access(lo, hi, write, lane, clock.get(lane.id, 0), label, where)
    kept = info["accesses"]
    for a in kept:
        if a.hi <= lo or hi <= a.lo or not (write or a.write) or a.lane == new.lane:
            continue
        if clock.get(a.lane, 0) >= a.tick:
            continue
        _report(f"unordered accesses to {_describe(info, max(lo, a.lo))}: "
                f"{_words(new)}, and {_words(a)}; no event orders them")
    if write:
        kept[:] = [a for a in kept if not (lo <= a.lo and a.hi <= hi)]
    else:
        kept[:] = [a for a in kept if a.write or a.lane != new.lane
                   or not (lo <= a.lo and a.hi <= hi)]
    kept.append(new)
    if len(kept) > _MAX_KEPT:
        del kept[:len(kept) - _MAX_KEPT]


def freed(info: dict, ptr: int, size: int, place, lane, clock) -> None:
    """The host let go of an allocation: a device one returns to `lane`'s pool (clock
    `clock`); a pinned one (lane None) may be handed out again at once."""
    if not ENABLED:
        return
    from .streams import HOST_CLOCK
    kept, info["accesses"] = info["accesses"], []
    for a in kept:
        if lane is None:
            if HOST_CLOCK.get(a.lane, 0) < a.tick:
                _report(f"{_describe(info, a.lo)} freed by the host while a stream may "
                        f"still use it: {_words(a)}, which the host never waited for")
        elif a.lane != lane.id and clock.get(a.lane, 0) < a.tick:
            _report(f"{_describe(info, a.lo)} freed on {lane.name()} (its pool may hand it "
                    f"to that stream's next allocation) while another stream may still "
                    f"use it: {_words(a)}; no event orders it before the free")


def host_overwrote(info: dict, ptr: int, nbytes: int, where: str) -> None:
    """A queued copy from pinned memory found, when it ran, other bytes there than when
    it was issued: the host wrote the buffer while the copy was in flight."""
    if ENABLED:
        _report(f"the host wrote {_describe(info, ptr)} ({nbytes} bytes) while a copy "
                f"from it to a GPU, issued at {where}, had not run yet (the copy reads it "
                f"when it runs)")

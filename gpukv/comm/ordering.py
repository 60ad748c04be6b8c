"""The events that order a strategy's call, written against device verbs.

`begin` orders a call after the caller's work, `wait_all` each device after the devices it
reads, and `finish` the caller's later work after the call, with no host synchronisation
between devices that queue their work.
"""
from __future__ import annotations


def unique(devices) -> list:
    """`devices` without repeats, in first-seen order."""
    seen, out = set(), []
    for d in devices:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def begin(devices) -> None:
    """Order every device's later work after the caller's work on its current stream."""
    for d in unique(devices):
        d.enter()


def wait_all(device, others) -> None:
    """Order `device`'s later work after the work queued so far on each of `others`.

    A device that queues no work waits on the host (it synchronises the others)."""
    for other in unique(others):
        if other is not device:
            device.wait_for(other)


def finish(devices, home) -> None:
    """Join: `home` waits for every device, every device waits for `home`.

    Afterwards a source may be overwritten, a temporary freed to the stream it was
    allocated on, and the caller's current stream of every GPU sees the result. Only
    devices that queue their work take part: the others are done already.
    """
    queued = [d for d in unique(list(devices) + [home]) if d.asynchronous]
    if not queued:
        return
    hub = home if home.asynchronous else queued[0]
    wait_all(hub, queued)
    for d in queued:
        if d is not hub:
            d.wait_for(hub)
    for d in queued:
        d.leave()

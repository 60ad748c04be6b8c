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
    marks: dict = {}  # (the virtual GPUs of one GPU wait for one event of its stream)
    for d in unique(devices):
        d.enter(marks)


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
    devices that queue their work take part: the others are done already. One event
    of the hub, recorded once it has waited for every device, stands for the whole
    call: each other device waits for it, and the caller's current stream of each GPU
    follows it through a device whose work is queued there, or else one `leave`.
    """
    queued = [d for d in unique(list(devices) + [home]) if d.asynchronous]
    if not queued:
        return
    hub = home if home.asynchronous else queued[0]
    wait_all(hub, queued)
    if len(queued) > 1:
        done = hub.record()
        for d in queued:
            if d is not hub:
                d.wait_event(done)
    followed = {d.physical for d in queued if d.on_current_stream}
    for d in queued:
        if d.physical not in followed:
            followed.add(d.physical)
            d.leave()

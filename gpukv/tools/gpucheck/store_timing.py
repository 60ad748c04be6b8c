"""gpucheck's store section: the 'device' store on the GPU against bare CuPy.

Small keys (4 KB of float32, four values on GPU 0): push, pull and pushpull, microseconds
per call (host time of many calls, then one synchronisation: what a training loop pays),
against a bare CuPy loop doing the same arithmetic (sum the four values into the stored
array, copy it into the four outs). The calls are timed in turns, medians of a few
rounds. Large keys: push + pull of four values, CUDA events, as a fraction of the
device-to-device copy bandwidth measured in the same run (bytes = read + written: a push
reads four values and writes the stored one, a pull reads it and writes four).
Goal (on a real GPU): the 4 KB pushpull within 1.5x the bare loop. Then the CUDA events each
small call makes (the host pays for each), and a profile of the 4 KB pushpull's host time
(`host_profile`): where a small call's time goes.
"""
from __future__ import annotations

import statistics
import time

from . import host_profile
from .budget import Deadline
from .section import Section
from .timing import seconds_per_call

VALUES = 4
SMALL_BYTES = 4 << 10
LARGE_BYTES, QUICK_LARGE_BYTES = 256 << 20, 1 << 20
SMALL_GOAL = 1.5
ROUNDS = 5


SUM = VALUES * (VALUES + 1) / 2  # values 1, 2, ... summed


def _sums_right(cp, values, step) -> bool:
    """After the values are set to 1, 2, ... and `step` sums them, does each hold SUM?"""
    for i, v in enumerate(values):
        v.fill(float(i + 1))
    step()
    return all(bool(cp.all(v == SUM)) for v in values)


def per_call(call, sync, calls: int) -> float:
    """Seconds per call of `calls` back-to-back calls, the work finished."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    sync()
    return (time.perf_counter() - start) / calls


def small_ways(cp, kv, key, values) -> dict:
    """{(operation, way): call} for the small key: gpukv's calls and their bare twins."""
    stored = cp.empty_like(values[0])

    def bare_push():
        cp.add(values[0], values[1], out=stored)
        for v in values[2:]:
            cp.add(stored, v, out=stored)

    def bare_pull():
        for o in values:
            cp.copyto(o, stored)

    def bare_pushpull():
        bare_push()
        bare_pull()

    return {("push", "gpukv"): lambda: kv.push(key, values),
            ("push", "cupy"): bare_push,
            ("pull", "gpukv"): lambda: kv.pull(key, out=values),
            ("pull", "cupy"): bare_pull,
            ("pushpull", "gpukv"): lambda: kv.pushpull(key, values),
            ("pushpull", "cupy"): bare_pushpull}


def events_made(cp, call) -> int:
    """The CUDA events one `call()` makes (gpukv makes one per ordering event)."""
    made = []
    real = cp.cuda.Event

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)
    cp.cuda.Event = counted
    try:
        call()
    finally:
        cp.cuda.Event = real
    return len(made)


def run(deadline: Deadline, *, quick: bool, emulated: bool) -> Section:
    from ...device.cuda.device import cuda_device
    from ...device.cuda.probe import release_cached_memory
    section = Section("store")
    device = cuda_device(0)
    with device.xp.cuda.Device(device.physical):
        for name, part in (("small", _small), ("large", _large)):
            section.progress(running=f"the {name} key")
            try:
                section.data[name] = part(section, device, deadline, quick)
            except Exception as exc:  # the other part still runs (the rounds done stand)
                section.crashed(exc)
    small_rows, large = section.data.get("small") or [], section.data.get("large") or {}
    release_cached_memory()
    section.data.update(small=small_rows, large=large,
                        method="small: host seconds per call over back-to-back calls with "
                        "one synchronisation, medians of rounds in turns; large: CUDA "
                        "events, minimal bytes (a push reads 4 values and writes 1, a pull "
                        "reads 1 and writes 4) over the device-to-device copy's")
    by_op = {r["operation"]: r for r in small_rows}
    if "pushpull" in by_op:
        section.goal("4 KB pushpull, gpukv / bare CuPy loop", by_op["pushpull"]["ratio"],
                     SMALL_GOAL, at_most=True, unit="x", judged=not emulated and not quick)
    parts = [f"4 KB {r['operation']} {r['gpukv_us']:.0f} us ({r['ratio']:.2f}x CuPy)"
             for r in small_rows]
    if large:
        parts.append(f"{large['bytes'] >> 20} MiB push+pull at "
                     f"{large['copy_fraction']:.0%} of the copy")
    if "events_per_call" in section.data:
        parts.append(f"{section.data['events_per_call']['pushpull']} CUDA events a "
                     f"pushpull")
    if "pushpull_host_profile" in section.data:
        parts.append("pushpull's host time: "
                     + host_profile.summary(section.data["pushpull_host_profile"]))
    section.line = "; ".join(parts) or "; ".join(section.failed)
    return section


def _small(section: Section, device, deadline: Deadline, quick: bool) -> list:
    import gpukv
    cp = device.xp
    sync = device.synchronize
    kv = gpukv.create("device")
    small = [cp.full(SMALL_BYTES // 4, float(i + 1), cp.float32) for i in range(VALUES)]
    kv.init("small", small[0])
    ways = small_ways(cp, kv, "small", small)
    calls = 20 if quick else 200
    for call in ways.values():  # warm: compiles, plans, pools
        per_call(call, sync, 3)
    found: dict = {k: [] for k in ways}
    rows: list = []
    for done in range(2 if quick else ROUNDS):
        if deadline.passed():
            section.cut = "the budget ran out during the small keys"
            break
        for k, call in ways.items():
            found[k].append(per_call(call, sync, calls))
        rows = _small_rows(found)
        section.data["small"] = rows  # the medians so far
        section.progress(running=f"the small key, after round {done + 1}")
    if not _sums_right(cp, small, lambda: kv.pushpull("small", small)):
        section.fail(f"the 4 KB key's pushpull did not give {SUM} in every value")
    # each CUDA event made costs the host an event's creation, record and destruction
    section.data["events_per_call"] = {op: events_made(cp, ways[(op, "gpukv")])
                                       for op in ("push", "pull", "pushpull")}
    if not deadline.passed():  # where the host time of a small call goes
        section.data["pushpull_host_profile"] = host_profile.profile(
            lambda: kv.pushpull("small", small), 5 if quick else 100)
        sync()
    return rows


def _small_rows(found: dict) -> list:
    """Per operation: the medians of gpukv's and the bare loop's times per call."""
    rows = []
    for op in ("push", "pull", "pushpull"):
        if not found[(op, "gpukv")]:
            continue
        mine = statistics.median(found[(op, "gpukv")])
        bare = statistics.median(found[(op, "cupy")])
        rows.append({"operation": op, "bytes": SMALL_BYTES, "values": VALUES,
                     "gpukv_us": mine * 1e6, "cupy_us": bare * 1e6, "ratio": mine / bare})
    return rows


def _large(section: Section, device, deadline: Deadline, quick: bool) -> dict:
    import gpukv
    if deadline.passed():
        section.cut = "the budget ran out before the large key"
        return {}
    cp = device.xp
    nbytes = QUICK_LARGE_BYTES if quick else LARGE_BYTES
    values = [cp.full(nbytes // 4, float(i + 1), cp.float32) for i in range(VALUES)]
    kv = gpukv.create("device")
    kv.init("large", values[0])

    def step():
        kv.push("large", values)
        kv.pull("large", out=values)

    iters = 2 if quick else 10
    copy_s = seconds_per_call(device, lambda: device.copy(values[1], values[0]), iters)
    step_s = seconds_per_call(device, step, iters)
    copy_gbps = 2 * nbytes / copy_s / 1e9
    minimal = 2 * nbytes * (VALUES + 1)
    gbps = minimal / step_s / 1e9
    if not _sums_right(cp, values, step):
        section.fail(f"the large key's push+pull did not give {SUM} in every value")
    return {"bytes": nbytes, "values": VALUES, "seconds": step_s, "minimal_bytes": minimal,
            "GBps": gbps, "copy_GBps": copy_gbps, "copy_fraction": gbps / copy_gbps}

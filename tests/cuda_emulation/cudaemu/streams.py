"""Stream order: the work issued to the emulated GPUs' streams, queued and run later.

Every operation on a stream (a kernel launch, a copy, a memset, an NCCL collective, an
event record or wait) becomes a node of a graph: it depends on the node before it on its
stream (on each of its streams, for a collective), on the event a wait waits for, and,
for CUDA's legacy default stream, on the blocking streams of its GPU and they on it. A
node runs when something forces it (a host synchronisation, a copy to the host, the host
asking an event or a stream a second time, a free that needs its memory back) or when the
schedule chooses to, in any order these dependencies allow.

The schedule comes from `GPUKV_EMU_SCHEDULE`:
- `issue` (the default): every node runs as it is issued (the order a program reads in);
- `seed:N`: nodes run when forced and, at each operation, a few ready nodes picked by a
  random generator seeded with N (the same N, the same schedule);
- `adversarial`: nothing runs before it must, and what must runs latest-issued first
  (other streams before the forcing one), so a missing wait shows up as stale data.

Every node also stamps the vector clock of its stream, which `races` uses to check that
conflicting accesses to device memory are ordered. All of it is guarded by one lock, so
the host threads of the code under test issue and force work safely.
"""
from __future__ import annotations

import collections
import itertools
import os
import random
import threading

from . import memory, races

_lock = threading.RLock()


def _parse_schedule(text: str) -> tuple:
    text = (text or "issue").strip().lower()
    if text == "issue":
        return "issue", 0
    if text == "adversarial":
        return "adversarial", 0
    if text.startswith("seed:") and text[5:].lstrip("-").isdigit():
        return "seed", int(text[5:])
    raise ValueError(f"GPUKV_EMU_SCHEDULE={text!r}: expected issue, seed:N or adversarial")


MODE, SEED = _parse_schedule(os.environ.get("GPUKV_EMU_SCHEDULE", ""))
_rng = random.Random(SEED)
_seq = itertools.count(1)


def set_schedule(text: str) -> None:
    """Switch the schedule (tests of the emulation); pending work is run first."""
    global MODE, SEED, _rng
    drain_all()
    MODE, SEED = _parse_schedule(text)
    _rng = random.Random(SEED)


# -------------------------------------------------------------------------- lanes
class Lane:
    """One stream of one GPU: its queue of nodes not yet run, and its vector clock."""

    _ids = itertools.count(1)

    def __init__(self, device: int, handle: int, blocking: bool):
        self.device, self.handle, self.blocking = device, handle, blocking
        self.id = next(Lane._ids)
        self.queue: collections.deque = collections.deque()
        self.last = None  # the last node issued here
        self.clock: dict = {}  # lane id -> ticks of that lane this one is ordered after
        self.legacy = handle == 0
        self.host_seen = -1  # the HOST_CLOCK version last joined into `clock`

    def name(self) -> str:
        what = {0: "the default stream", 2: "the per-thread default stream"}.get(
            self.handle, f"stream {self.handle:#x}")
        return f"{what} of GPU {self.device}"

    def tick(self) -> dict:
        self.clock[self.id] = self.clock.get(self.id, 0) + 1
        return dict(self.clock)


_lanes: dict = {}  # (device, handle) -> Lane
_blocking: dict = {}  # device -> its lanes that take part in legacy default-stream order
HOST_CLOCK: dict = {}  # what the host has seen completed, as a vector clock
_host_version = [0]  # bumped when HOST_CLOCK grows, so lanes join it only then


def lane(device: int, handle: int, blocking: bool = True) -> Lane:
    key = (int(device), int(handle))
    found = _lanes.get(key)
    if found is None:
        with _lock:
            found = _lanes.get(key)
            if found is None:
                found = _lanes[key] = Lane(key[0], key[1], blocking)
                if blocking or found.legacy:
                    _blocking.setdefault(key[0], []).append(found)
    return found


def join(clock: dict, other: dict) -> None:
    for k, v in other.items():
        if clock.get(k, 0) < v:
            clock[k] = v


def _host_join(target: dict) -> None:
    """HOST_CLOCK joins a clock the host has seen completed."""
    for k, v in target.items():
        if HOST_CLOCK.get(k, 0) < v:
            HOST_CLOCK[k] = v
            _host_version[0] += 1


def _after_host(lane_: Lane) -> None:
    """Work issued now comes after everything the host has seen completed."""
    if lane_.host_seen != _host_version[0]:
        join(lane_.clock, HOST_CLOCK)
        lane_.host_seen = _host_version[0]


# -------------------------------------------------------------------------- nodes
class Node:
    """One operation on one or more lanes."""

    __slots__ = ("seq", "lanes", "deps", "fn", "done", "label", "clock", "keep", "blocked")

    def __init__(self, lanes, deps, fn, label, keep, blocked=None):
        self.seq = next(_seq)
        self.lanes, self.deps, self.fn, self.label, self.keep = lanes, deps, fn, label, keep
        self.done = False
        self.clock: dict = {}
        self.blocked = blocked  # None, or a function: True while the node cannot run


class HangError(RuntimeError):
    """The host waits for work that can never run (an NCCL collective a peer never
    joins): a GPU would wait forever."""

    def __repr__(self):
        return f"<node {self.seq} {self.label}>"


def _legacy_deps(target: Lane) -> list:
    """CUDA's legacy default stream: it waits for the blocking streams of its GPU, and
    they wait for it."""
    deps = []
    if not (target.legacy or target.blocking):
        return deps
    for other in _blocking.get(target.device, ()):
        if other is target:
            continue
        if (target.legacy and other.blocking) or (other.legacy and target.blocking):
            if other.last is not None:
                deps.append(other.last)
            # the lane's clock, not its last node's: work run at once (CuPy's own
            # kernels, `eager`) moves the clock and queues no node
            join(target.clock, other.clock)
    return deps


def issue(lanes, fn, label: str, *, accesses=(), keep=None, extra_deps=(),
          extra_clock=None, blocked=None):
    """Queue `fn` on `lanes` (one Lane, or several for a collective) after their work so
    far; `accesses` [(lane, ptr, nbytes, write, mem)] are checked and recorded now."""
    if isinstance(lanes, Lane):
        lanes = (lanes,)
    with _lock:
        settle_frees()
        deps = [ln.last for ln in lanes if ln.last is not None]
        for ln in lanes:
            deps += _legacy_deps(ln)
            _after_host(ln)  # issued after all the host has seen completed
            if extra_clock:
                join(ln.clock, extra_clock)
        deps += [d for d in extra_deps if d is not None]
        node = Node(tuple(lanes), [d for d in deps if not d.done], fn, label, keep, blocked)
        clocks = {ln.id: ln.tick() for ln in lanes}
        if len(lanes) > 1:  # a collective: every rank's stream is after every rank's work
            merged: dict = {}
            for c in clocks.values():
                join(merged, c)
            for ln in lanes:
                join(ln.clock, merged)
            node.clock = merged
        else:
            node.clock = clocks[lanes[0].id]
        for ln in lanes:
            ln.last = node
            ln.queue.append(node)
        if accesses:
            site = races.site()
            for ln, ptr, nbytes, write, mem in accesses:
                races.record(mem, ptr, nbytes, write, ln, clocks[ln.id], label, site)
        if MODE == "issue":
            _try_force(node)
        elif MODE == "seed":
            wander()
        return node


def eager(lane_: Lane, label: str, accesses=()) -> None:
    """For work run at once on `lane_` (CuPy's own kernels, synchronous copies): the
    lane's queued work runs first, and the accesses are checked on the lane's clock."""
    with _lock:
        settle_frees()
        if lane_.last is not None:
            force(lane_.last)
        for dep in _legacy_deps(lane_):
            force(dep)
        _after_host(lane_)
        clock = lane_.tick()
        if accesses:
            site = races.site()
            for ln, ptr, nbytes, write, mem in accesses:
                races.record(mem, ptr, nbytes, write, ln or lane_, clock, label, site)
        if MODE == "seed":
            wander()


def _run(node: Node) -> None:
    for ln in node.lanes:
        head = ln.queue.popleft()
        assert head is node, f"{node} run before {head} of its stream"
    node.done = True
    fn, keep = node.fn, node.keep  # what it uses stays alive until it has run
    node.fn, node.keep, node.deps = None, None, ()
    if fn is not None:
        fn()
    del keep


def force(node) -> None:
    """Run `node` and everything it depends on (in the order the schedule picks)."""
    if node is None or node.done:
        return
    with _lock:
        stack = [node]
        while stack:
            top = stack[-1]
            if top.done:
                stack.pop()
                continue
            waiting = [d for d in top.deps if not d.done]
            if waiting:  # the last one pushed runs first
                if MODE == "seed":
                    _rng.shuffle(waiting)
                elif MODE == "adversarial":  # other streams first, the latest first
                    waiting.sort(key=lambda n: (n.lanes != top.lanes, n.seq))
                else:
                    waiting.sort(key=lambda n: -n.seq)
                stack.extend(waiting)
                continue
            if top.blocked is not None and top.blocked():
                raise HangError(f"the host waits for {top.label}, which cannot run (a peer "
                                f"never joins it): a GPU would wait forever")
            stack.pop()
            _run(top)


def wander() -> None:
    """Seeded schedules: run a few nodes whose dependencies are done, picked at random."""
    for _ in range(_rng.choice((0, 0, 1, 1, 2, 3))):
        ready = [ln.queue[0] for ln in _lanes.values()
                 if ln.queue and all(d.done for d in ln.queue[0].deps)
                 and not (ln.queue[0].blocked and ln.queue[0].blocked())
                 and all(o.queue and o.queue[0] is ln.queue[0] for o in ln.queue[0].lanes)]
        if not ready:
            return
        _run(_rng.choice(ready))


def synchronize(lane_: Lane) -> None:
    """The host waits for everything issued to `lane_` so far."""
    with _lock:
        settle_frees()
        force(lane_.last)
        _host_join(lane_.clock)  # its queued work and the work run at once on it


def synchronize_device(device: int) -> None:
    with _lock:
        for ln in list(_lanes.values()):
            if ln.device == device:
                synchronize(ln)


def drain_all() -> None:
    """Run every queued node (the end of a test, a device reset)."""
    with _lock:
        settle_frees()
        for ln in list(_lanes.values()):
            synchronize(ln)
        settle_frees()
        for ln in list(_lanes.values()):
            synchronize(ln)


# ------------------------------------------------------------------------- events
class Mark:
    """What an event recorded: the node it completes with, and the clock it carries."""

    __slots__ = ("node", "clock", "lane", "asked")

    def __init__(self, node, clock, lane_):
        self.node, self.clock, self.lane, self.asked = node, clock, lane_, 0


def record(lane_: Lane) -> Mark:
    with _lock:
        node = issue(lane_, None, "event record")
        return Mark(node, dict(node.clock), lane_)


def wait(lane_: Lane, mark: Mark) -> None:
    with _lock:
        issue(lane_, None, "event wait", extra_deps=(mark.node,), extra_clock=mark.clock)


def query(mark: Mark) -> bool:
    """Whether the marked work has run. A GPU gets on without the host: asked twice about
    the same pending work, the emulation runs it (a poll loop always ends)."""
    with _lock:
        settle_frees()
        if not mark.node.done:
            if MODE == "seed":
                wander()
            mark.asked += 1
            if mark.asked >= 2 or MODE == "issue":
                _try_force(mark.node)
        if mark.node.done:
            _host_join(mark.clock)
        return mark.node.done


def has_run(event) -> bool:
    """Whether the work before a recorded event has run, without asking the event (which
    may make it run): for tests of code in flight."""
    return event.mark is None or event.mark.node.done


def wait_host(mark: Mark) -> None:
    """cudaEventSynchronize."""
    with _lock:
        force(mark.node)
        _host_join(mark.clock)


_lane_asked: dict = {}  # lane id -> (its last node when asked, times asked)


def lane_done(lane_: Lane) -> bool:
    """cudaStreamQuery: as `query`, for everything issued to the stream so far."""
    with _lock:
        last = lane_.last
        if last is None:
            _host_join(lane_.clock)
            return True
        if not last.done:
            if MODE == "seed":
                wander()
            seen, times = _lane_asked.get(lane_.id, (None, 0))
            times = times + 1 if seen is last else 1
            _lane_asked[lane_.id] = (last, times)
            if times >= 2 or MODE == "issue":
                _try_force(last)
        if last.done:
            _host_join(lane_.clock)
        return last.done


_busy = [0]  # > 0: the GPUs are busy, queries run nothing (see `busy`)


class busy:  # noqa: N801 - used as a context manager
    """Tests of code in flight: inside, asking an event or a stream whether it is done runs
    nothing (as if the GPUs were busy for long); synchronisations still wait."""

    def __enter__(self):
        _busy[0] += 1
        return self

    def __exit__(self, *exc):
        _busy[0] -= 1
        return False


def _try_force(node) -> None:
    """A query runs what it asks about, unless that cannot run yet (it stays not done)."""
    if _busy[0] and MODE != "issue":
        return
    try:
        force(node)
    except HangError:
        pass


# -------------------------------------------------------------------------- frees
def settle_frees() -> None:
    """Device allocations the host has let go of return to their stream's pool: each is
    unmapped by a node on the stream it was allocated on, after that stream's work (the
    free is checked like a write of the whole allocation); pinned memory, which no
    queued node holds any more, is unmapped now."""
    global _settling
    if _settling or not memory.frees:
        return
    with _lock:
        _settling = True  # a free's own node must not settle the next one
        try:
            while memory.frees:
                _settle(*memory.frees.popleft())
        finally:
            _settling = False


_settling = False


def _settle(base, length, ptr, size, place, info) -> None:
    home = info.get("lane")
    if place == "pinned" or home is None or size == 0:
        races.freed(info, ptr, size, place, None, None)
        memory.unmap(base, length, ptr, size, place)
        return
    node = issue(home, lambda: memory.unmap(base, length, ptr, size, place), "free")
    races.freed(info, ptr, size, place, home, node.clock)

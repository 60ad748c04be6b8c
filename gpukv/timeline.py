"""`GPUKV_TIMELINE=DIR`: a timeline of every store call and its phases, per process.

Each process writes `DIR/gpukv-timeline-rank<R>-pid<P>.json`, a Chrome trace (a JSON
object whose "traceEvents" are complete events, "ph": "X") that Perfetto
(ui.perfetto.dev) and chrome://tracing open: the store calls (init, push, pull, ...),
their phases (check, plan, reduce, update; in a dist store the agreements, the engine's
round and every wait on other processes), snapshot writes (on their own thread) and the
Trainer's steps, nested as they ran, one row per thread. R is the MPI or torchrun rank
(PMI_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK or RANK), else 0, and also the trace's "pid", so that
the files of a job's ranks can be put together; "ts" counts microseconds since the Unix
epoch, so that those of several hosts line up (as far as their clocks agree). The file
is made when recording starts and written on at exit (a job that aborts included), by
`flush()`, on SIGTERM before it acts (`_write_on_sigterm`), and on the way every
`FLUSH_EVERY` events and, by a thread of its own, `FLUSH_SECONDS` after the last write,
whatever the program does meanwhile: the new events only each time (a process killed
outright, SIGKILL, loses only the events of its last `FLUSH_SECONDS`, and the spans still
open). A forked child (a data loader's worker) records nothing. A GPUKV_TIMELINE where no
file can be made (a file's path, a folder that cannot be created or written) records
nothing and says so in one RuntimeWarning: a diagnostic never stops the program it
watches; nor does a write that fails on the way or at exit (one RuntimeWarning; the events
are kept for the next), nor a span argument JSON cannot hold (written as its str).
`gpukv run`'s launcher records nothing of its own (`discard`): only its ranks do; nor do the
other commands that call no store (`gpukv info`, `cluster`, `gpucheck`, `export`, and any
command asked for its `--help`).

While it runs, in a process that imported PyTorch, each span is also a
`torch.profiler.record_function` (named gpukv.<span>), so while `torch.profiler` records,
the store's work shows in its trace beside the model's. Off (no GPUKV_TIMELINE, the
default), a span is one global read: nothing measurable (benchmarks/bench_timeline.py);
no thread, no signal handler, no hook at fork.
"""
from __future__ import annotations

import atexit
import errno
import functools
import inspect
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from ._env import launched_rank
from ._errors import ArgumentError

ENV = "GPUKV_TIMELINE"
#: the values of GPUKV_TIMELINE that name no folder (stripped, lower-cased): off
OFF = ("", "0", "off", "none")
#: events written out every this many, or every FLUSH_SECONDS (the new ones only)
FLUSH_EVERY = 50_000
FLUSH_SECONDS = 5.0
#: seconds SIGTERM's write waits for a write under way on another thread
TERM_WAIT = 1.0
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # gpukv/

F = TypeVar("F", bound=Callable[..., Any])


def _plain(value) -> Any:
    """A span argument JSON has no form for, as one it has: a NumPy scalar's value, or
    else its str (a diagnostic never fails on what it was shown)."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            found = item()
            json.dumps(found)
            return found
        except (TypeError, ValueError):
            pass
    return str(value)


class _Recorder:
    """The events of this process, and the file they go to.

    The file is a Chrome trace, valid JSON after every write: the first write makes it
    (which shows at once whether the folder takes it), each later one writes the events
    since the last over the closing part and puts it back after them, in one system
    call. A write costs the new events alone, and written events leave memory."""

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        self.rank, self.pid = launched_rank() or 0, os.getpid()
        self.path = os.path.join(folder, f"gpukv-timeline-rank{self.rank}-pid{self.pid}.json")
        # (reentrant: a signal handler that interrupts this thread just before or after a
        # write, when `owner` does not name it, writes in full: no half-made write is there)
        self.lock = threading.RLock()
        # (name, category, start ns, end ns, thread, args): a tuple is the cheapest to
        # keep; list.append is atomic, so spans of several threads need no lock
        self.spans: list = []
        # native thread id -> its name, for the threads that recorded spans; a thread
        # gone is dropped once the file holds its name (threads come and go in a long
        # job: a data loader's, a program's own)
        self.threads: dict = {}
        self.named: set = set()  # the (id, name) the file holds
        self.size = 0  # the file's bytes once written (0: not yet)
        # ts in microseconds since the Unix epoch, so the files of several hosts line up
        self.epoch_ns = time.time_ns() - time.perf_counter_ns()
        self.last_write_ns = time.perf_counter_ns()
        self.warned = False  # about a write nobody asked for that failed
        self.tail = json.dumps({"displayTimeUnit": "ms", "otherData": {
            "rank": self.rank, "pid": self.pid, "ts": "microseconds since the Unix epoch"}})
        self.tail = "]," + self.tail[1:]
        self.owner: int | None = None  # the thread writing now (a signal handler may
        #                                 interrupt it)
        self.after_write: list = []  # (signum, frame) of SIGTERMs that came during it
        self.write()
        # The writer thread: what is buffered reaches the file FLUSH_SECONDS after it was
        # recorded at the latest, whatever the program's threads do next (a rank that
        # stalls, then is killed, keeps what it recorded before).
        self.stopping = threading.Event()
        self.writer = threading.Thread(target=self._write_on_time, daemon=True,
                                       name="gpukv timeline writer")
        self.writer.start()

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, args: dict) -> None:
        tid = threading.get_native_id()
        thread = threading.current_thread().name
        if self.threads.get(tid) != thread:  # (new, renamed, or a gone one's id again)
            self.threads[tid] = thread
        self.spans.append((name, cat, start_ns, end_ns, tid, args))
        if len(self.spans) >= FLUSH_EVERY:
            self.write_or_warn()

    def _write_on_time(self) -> None:
        """The writer thread's loop: FLUSH_SECONDS after the last write or the last look
        (whichever came later), the events buffered since, if any; until `end()`."""
        looked = time.perf_counter_ns()
        while True:
            since = max(self.last_write_ns, looked)
            due = (since + FLUSH_SECONDS * 1e9 - time.perf_counter_ns()) / 1e9
            # (an hour at most: a lock's wait has a bound, and FLUSH_SECONDS may be inf)
            if self.stopping.wait(min(max(due, 0.0), 3600.0)):
                return
            now = time.perf_counter_ns()
            if now - max(self.last_write_ns, looked) < FLUSH_SECONDS * 1e9:
                continue  # written meanwhile (a flush(), FLUSH_EVERY events)
            looked = now
            if self.spans:
                self.write_or_warn()

    def end(self) -> None:
        """Stop the writer thread (the last write is the caller's)."""
        self.stopping.set()

    def write_or_warn(self, wait: float = -1) -> None:
        """`write()` for the writes nobody asked for (on the way, at exit): a failure is a
        RuntimeWarning, once, not an error in the store call or at exit."""
        try:
            self.write(wait)
        except OSError as exc:
            if not self.warned:
                self.warned = True
                _warn(f"cannot write {self.path} ({exc})")

    def _events(self, spans: list) -> tuple[list, list]:
        """(The trace events of `spans`, after the names the file does not hold yet; the
        threads those name)."""
        events: list = []
        if self.size == 0:
            events += [{"name": "process_name", "ph": "M", "pid": self.rank,
                        "args": {"name": f"rank {self.rank} (pid {self.pid})"}},
                       {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                        "args": {"sort_index": self.rank}}]
        naming = [(tid, name) for tid, name in list(self.threads.items())
                  if (tid, name) not in self.named]
        events += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                    "args": {"name": name}} for tid, name in naming]
        epoch = self.epoch_ns
        for name, cat, start, end, tid, args in spans:
            event = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
                     "ts": (start + epoch) / 1000, "dur": (end - start) / 1000}
            if args:
                event["args"] = args
            events.append(event)
        return events, naming

    def _forget_gone_threads(self) -> None:
        """Drop the threads that ended whose names the file holds (their spans name
        them by id), so that threads started and ended all along keep nothing here."""
        alive = {t.native_id for t in threading.enumerate()}
        for tid, name in list(self.threads.items()):
            if tid not in alive and (tid, name) in self.named:
                del self.threads[tid]
        self.named &= set(self.threads.items())

    def write(self, wait: float = -1) -> str:
        """Write the events since the last write (a reader never sees half a file: a
        write that fails puts the file back as it was). `wait`: the most seconds to wait
        for a write under way on another thread (then nothing is written; -1: as long as
        it takes); a write under way on this thread (interrupted by a signal's handler)
        is left to finish."""
        if os.getpid() != self.pid:  # a forked child: the file is its parent's
            return self.path
        me = threading.get_ident()
        if self.owner == me or not self.lock.acquire(timeout=wait):
            return self.path
        self.owner = me
        try:
            self._write_new()
        finally:
            self.owner = None
            self.lock.release()
            while self.after_write:  # (on the main thread: signals are handled there)
                _write_on_sigterm(*self.after_write.pop(0))
        return self.path

    def _write_new(self) -> None:
        """`write()`'s work, under the lock."""
        taken = len(self.spans)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != self.size:  # removed (or cut) since: anew
                self.size, self.named = 0, set()
            events, naming = self._events(self.spans[:taken])
            if not events:
                return
            body = ",".join(json.dumps(e, default=_plain) for e in events)
            tail = self.tail.encode()
            at = 0 if self.size == 0 else self.size - len(tail)
            data = (('{"traceEvents":[' if self.size == 0 else ",") + body).encode() + tail
            try:
                if os.pwrite(fd, data, at) != len(data):
                    raise OSError(errno.ENOSPC, "a short write")
                if at == 0:  # begun anew: nothing of a file there before stays after it
                    os.ftruncate(fd, len(data))
            except BaseException:  # (a full disk): the file as it was, or none
                if self.size:
                    os.pwrite(fd, tail, at)
                    os.ftruncate(fd, self.size)
                else:
                    os.unlink(self.path)
                raise
        finally:
            os.close(fd)
        self.size = at + len(data)
        self.named.update(naming)
        del self.spans[:taken]  # (other threads only append after them)
        self._forget_gone_threads()
        self.last_write_ns = time.perf_counter_ns()


_active: _Recorder | None = None


def _warn(message: str) -> None:
    """A RuntimeWarning about GPUKV_TIMELINE, shown at the program's line that led here
    (its `import gpukv`, its store call) rather than at gpukv's own."""
    frame = inspect.currentframe()
    assert frame is not None  # (CPython has frames)
    while frame.f_back is not None and _in_gpukv_or_import(frame.f_code.co_filename):
        frame = frame.f_back
    warnings.warn_explicit(f"{ENV}: {message}", RuntimeWarning, frame.f_code.co_filename,
                           frame.f_lineno)


def _in_gpukv_or_import(filename: str) -> bool:
    return filename.startswith((_PACKAGE, "<frozen importlib"))


def start(folder: str | os.PathLike) -> None:
    """Record from now on into `folder`, made if missing (what GPUKV_TIMELINE=folder does
    at import). This process's file there, from an earlier recording, is begun anew. A
    folder that cannot be made or written in is an ArgumentError naming it and the OS
    error, where the variable only warns; a recording already running goes on into its
    own file then."""
    global _active
    path = os.fspath(folder)
    try:
        recorder = _Recorder(path)
    except OSError as exc:
        raise ArgumentError(f"timeline folder {path!r}: cannot write in it ({exc})") from exc
    if _active is not None:
        _active.end()
        _active.write()
    _active = recorder
    _install_process_hooks()


def _start_from_environment(environ) -> None:
    """Record into the folder `environ` names in GPUKV_TIMELINE, if it names one (blank,
    '0', 'off' or 'none', in any case, name none: off, as GPUKV_CALIBRATION's); a folder
    or file that cannot be made is a RuntimeWarning (naming the variable, the path and the
    OS error) and nothing is recorded: a diagnostic never stops an import."""
    folder = environ.get(ENV, "")
    if folder.strip().lower() in OFF:
        return
    try:
        start(folder)
    except ArgumentError as exc:
        _warn(f"cannot write in the folder {folder!r} ({exc.__cause__}): recording nothing")


def discard() -> None:
    """Stop recording, and remove the file begun: the events so far are dropped (`gpukv
    run`'s launcher, whose ranks write the traces that matter, and the other commands
    that call no store)."""
    global _active
    recorder, _active = _active, None
    _remove_process_hooks()
    if recorder is not None:
        recorder.end()
        try:
            os.unlink(recorder.path)
        except OSError:
            pass


def stop() -> str | None:
    """Write the timeline and stop recording; the file's path (None when off)."""
    global _active
    recorder, _active = _active, None
    if recorder is None:
        return None
    _remove_process_hooks()
    recorder.end()
    return recorder.write()


def flush() -> str | None:
    """Write the events so far; the file's path (None when off)."""
    recorder = _active
    return None if recorder is None else recorder.write()


def enabled() -> bool:
    """Whether a timeline is being recorded."""
    return _active is not None


def _torch_profiling() -> bool:
    """Whether this process imported PyTorch and its profiler records now. The check is
    the one record_function makes itself (a tenth of a microsecond against its five)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    return enabled is None or bool(enabled())


class _Span:
    __slots__ = ("name", "cat", "args", "start", "torch_span")

    def __init__(self, name: str, cat: str, args: dict):
        self.name, self.cat, self.args = name, cat, args
        self.torch_span = None

    def __enter__(self):
        if _torch_profiling():
            torch = sys.modules["torch"]
            self.torch_span = torch.profiler.record_function(f"gpukv.{self.name}")
            self.torch_span.__enter__()
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> None:
        end = time.perf_counter_ns()
        if self.torch_span is not None:
            self.torch_span.__exit__(*exc)
        recorder = _active
        if recorder is not None:
            recorder.add(self.name, self.cat, self.start, end, self.args)


class _Off:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_OFF = _Off()


def span(name: str, cat: str = "gpukv", **args):
    """A context manager timing `name` (with `args` shown beside it) on the timeline,
    in the trace's category `cat`."""
    if _active is None:
        return _OFF
    return _Span(name, cat, args)


def traced(name: str, cat: str = "store") -> Callable[[F], F]:
    """Decorator: every call of the function is a span `name` (in the trace's category
    `cat`) on the timeline."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*a, **k):
            if _active is None:
                return fn(*a, **k)
            with _Span(name, cat, {}):
                return fn(*a, **k)
        return call  # type: ignore[return-value]
    return wrap


def write_before_exit() -> None:
    """Write the events so far, a failure a RuntimeWarning: at exit, and before an abort
    of the MPI job, which ends the process before exit's handlers run. The writer thread
    stops first (the interpreter's end would freeze it wherever it is)."""
    recorder = _active
    if recorder is not None:
        recorder.end()
        recorder.write_or_warn()


atexit.register(write_before_exit)

# Set up by a recording (off, a process has none of them).
_fork_hooked: list = []  # True once the hook at fork is in (it cannot be taken out)
_term_previous: list = []  # [SIGTERM's handler before `_write_on_sigterm`], while it is set


def _install_process_hooks() -> None:
    """A forked child records nothing (`_forget_in_child`), and SIGTERM writes the
    timeline first (`_write_on_sigterm`), where it ends the process (its default) or
    runs a handler the program set in Python before the recording began: a SIGTERM
    ignored, or handled outside Python, is left alone, and so is one the program
    handles from the time after (its handler replaces this one). Only the main thread
    may set a handler: a recording begun on another leaves SIGTERM as it was."""
    if not _fork_hooked:
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_hooked.append(True)
    if _term_previous or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL or callable(previous):
        signal.signal(signal.SIGTERM, _write_on_sigterm)
        _term_previous.append(previous)


def _remove_process_hooks() -> None:
    """Once the recording stops, SIGTERM's handler as it was before it (unless the program
    set its own since: SIGTERM stays as the program left it)."""
    if not _term_previous or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _write_on_sigterm:
        signal.signal(signal.SIGTERM, _term_previous.pop())


def _forget_in_child() -> None:
    """After a fork, in the child (a data loader's worker): record nothing. The events
    buffered and the file are the parent's, and so is the writer thread (the child has
    none): spans recorded here would only pile up."""
    global _active
    _active = None


def _write_on_sigterm(signum, frame) -> None:
    """SIGTERM's handler while a timeline records: the events so far, then what SIGTERM
    did before (the process ends as by SIGTERM, or the program's handler runs). It runs
    when the main thread next runs Python: at once in a sleep or a wait of the store's,
    once it returns from a call in native code."""
    recorder = _active
    if recorder is not None:
        if recorder.owner == threading.get_ident():
            # this handler interrupted a write of this thread (a flush(), an earlier
            # SIGTERM's): the rest once that write is done, its events in the file
            recorder.after_write.append((signum, frame))
            return
        recorder.write_or_warn(TERM_WAIT)
    previous = _term_previous[0] if _term_previous else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


_start_from_environment(os.environ)

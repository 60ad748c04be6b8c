"""The environment step and the measuring sections, each run in a child process of its own.

A kernel that hangs, a driver call that never returns (CUDA's first start, libnccl), a
crash or a sticky CUDA error (after an illegal address CuPy and PyTorch fail every later
call) then costs that section alone: the parent waits for the child's deadline plus a
grace, ends it, and records why, with the Python frames the child was in (faulthandler
prints them before the end); the other sections run in fresh processes. CuPy's on-disk
kernel cache carries compiled kernels from one child to the next.

The child keeps what it has measured as it goes (each `Section.progress()`: every kernel
case, every bandwidth row, every step), in a partial result beside RESULT, replaced whole
each time; a section ended at its deadline, or dead, keeps what it had, marked cut and
naming what it was running. While it runs the parent hands each new partial result to
`on_progress`, which keeps the run's record up to date.

Child side: `python -m gpukv.tools.gpucheck.isolated SECTION SECONDS QUICK RESULT` runs the
section and writes its record to RESULT (JSON), and its partial record as it goes to
`partial_path(RESULT)`.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import processes
from .budget import Deadline
from .section import Section, keep_progress

#: seconds past its deadline before a section's process counts as hung
GRACE_S = 20.0
#: how often the parent looks for a new partial result of the section running
POLL_S = 1.0
NAMES = ("environment", "kernels", "bandwidth", "store", "trainer")


def run(name: str, deadline: Deadline, *, quick: bool, work: Path,
        on_progress=None) -> Section:
    """Run section `name` in a child process, which gets until `deadline` (plus a grace).
    `on_progress(section, running)`, when given, gets each partial result the child
    keeps, and the last one when the run ends meanwhile (a signal)."""
    work.mkdir(parents=True, exist_ok=True)
    result, log_path = work / f"{name}.json", work / f"{name}.log"
    partial = partial_path(result)
    result.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    seconds = deadline.left()
    package_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = processes.start(child_command(name, seconds, quick, result), env=env,
                               stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait(proc, name, seconds + GRACE_S, partial, on_progress)
        except subprocess.TimeoutExpired:
            processes.stop([proc])
            return _ended(name, partial, started,
                          f"still running {seconds + GRACE_S:.0f} s after it started (its "
                          f"share of the budget and {GRACE_S:.0f} s more): ended",
                          f"it was in {_frames(log_path)}")
        except BaseException:  # the run is ending: hand on what the section had
            processes.stop([proc])
            found = read_partial(name, partial)
            if on_progress is not None and found is not None:
                on_progress(*found)
            raise
    if result.exists():
        return Section.from_dict(name, json.loads(result.read_text()))
    status = proc.returncode
    how = (f"signal {signal.Signals(-status).name}" if status < 0
           else f"exit status {status}")
    return _ended(name, partial, started, f"its process ended ({how}) without a result",
                  _tail(log_path))


def partial_path(result: Path) -> Path:
    """Where the child keeps its partial record, beside RESULT."""
    return result.with_name(result.stem + ".partial.json")


def read_partial(name: str, path: Path) -> tuple | None:
    """(section `name`, what it was running or None) from a partial record in `path`;
    None without one."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        return Section.from_dict(name, kept["section"]), kept["running"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _wait(proc, name: str, seconds: float, partial: Path, on_progress) -> None:
    """Wait up to `seconds` for `proc` (TimeoutExpired past them), handing each new
    partial record to `on_progress` meanwhile."""
    end = time.monotonic() + seconds
    seen = None
    while True:
        try:
            proc.wait(max(0.0, min(POLL_S, end - time.monotonic())))
            return
        except subprocess.TimeoutExpired:
            if time.monotonic() >= end:
                raise
        if on_progress is None:
            continue
        try:
            stat = partial.stat()
        except OSError:
            continue
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if stamp != seen:
            seen = stamp
            found = read_partial(name, partial)
            if found is not None:
                on_progress(*found)


def _ended(name: str, partial: Path, started: float, what: str, where: str) -> Section:
    """The section of a child that ended without its result: what it had kept (cut,
    naming what it was running), and why it ended, as a failure."""
    found = read_partial(name, partial)
    section, running = found if found is not None else (Section(name), None)
    during = f" during {running}" if running else ""
    section.fail(f"{what}{during}; {where}")
    if found is not None:
        section.cut = "; ".join(filter(None, [
            section.cut, f"its process ended{during}: what it measured before is kept"]))
    section.line = "; ".join(filter(None, [section.failed[-1],
                                           section.line and f"before that: {section.line}"]))
    section.seconds = round(time.monotonic() - started, 2)
    return section


def child_command(name: str, seconds: float, quick: bool, result: Path) -> list:
    return [sys.executable, "-m", "gpukv.tools.gpucheck.isolated", name, f"{seconds:.1f}",
            "1" if quick else "0", str(result)]


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    return " | ".join(line.strip() for line in text[-lines:]) or "no output"


def _frames(path: Path) -> str:
    """The innermost frames of the main thread, from faulthandler's dump in the log."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    frames = [line.strip() for line in text if line.strip().startswith("File ")]
    return " <- ".join(frames[:4]) if frames else _tail(path)


def _section(name: str, deadline: Deadline, quick: bool, machine) -> Section:
    emulated = machine.emulated
    if name == "environment":
        from .machine import describe
        return describe(machine)
    if name == "kernels":
        from . import goldens
        return goldens.run(deadline)
    if name == "bandwidth":
        from . import bandwidth
        return bandwidth.run(deadline, quick=quick, emulated=emulated)
    if name == "store":
        from . import store_timing
        return store_timing.run(deadline, quick=quick, emulated=emulated)
    from . import trainer_timing
    return trainer_timing.run(deadline, quick=quick, emulated=emulated)


class PartialWriter:
    """A `keep_progress` sink that keeps the section's partial record in `path`, replaced
    whole (a parent reading it never sees half a file), and the section it was last given."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.latest: Section | None = None

    def __call__(self, section: Section, running: str | None) -> None:
        self.latest = section
        try:
            self.tmp.write_text(json.dumps({"running": running, "section": section.to_dict()},
                                           default=str), encoding="utf-8")
            os.replace(self.tmp, self.path)
        except OSError:  # a full disk costs the partial record, never the measure
            pass


def child(argv: list) -> int:
    name, seconds, quick, result = argv[0], float(argv[1]), argv[2] == "1", Path(argv[3])
    faulthandler.dump_traceback_later(max(1.0, seconds + GRACE_S - 5), exit=False)
    writer = PartialWriter(partial_path(result))
    keep_progress(writer)
    from .machine import open_machine
    machine = open_machine()
    section = Section(name)
    if isinstance(machine, str):
        section.fail(machine)
        section.line = machine
        if name == "environment":  # no GPU to check: the run ends here
            section.data["unusable"] = machine
    else:
        deadline = Deadline(time.monotonic, time.monotonic() + seconds)
        try:
            section = _section(name, deadline, quick, machine)
        except Exception as exc:  # the section's own failure: recorded, not raised
            if writer.latest is not None:  # with what it had measured before
                section = writer.latest
            section.crashed(exc)
            section.line = "; ".join(filter(None, [
                section.failed[-1], section.line and f"before that: {section.line}"]))
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(section.finish().to_dict(), default=str))
    os.replace(tmp, result)
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]))

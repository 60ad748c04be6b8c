"""The measuring sections, each run in a child process of its own.

A kernel that hangs, a driver call that never returns, a crash or a sticky CUDA error
(after an illegal address CuPy and PyTorch fail every later call) then costs that section
alone: the parent waits for the child's deadline plus a grace, ends it, and records why,
with the Python frames the child was in (faulthandler prints them before the end); the
other sections run in fresh processes. CuPy's on-disk kernel cache carries compiled
kernels from one child to the next.

Child side: `python -m gpukv.tools.gpucheck.isolated SECTION SECONDS QUICK RESULT` runs the
section and writes its record to RESULT (JSON).
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
from .section import Section

#: seconds past its deadline before a section's process counts as hung
GRACE_S = 20.0
NAMES = ("kernels", "bandwidth", "store", "trainer")


def run(name: str, deadline: Deadline, *, quick: bool, work: Path) -> Section:
    """Run section `name` in a child process, which gets until `deadline` (plus a grace)."""
    work.mkdir(parents=True, exist_ok=True)
    result, log_path = work / f"{name}.json", work / f"{name}.log"
    result.unlink(missing_ok=True)
    seconds = deadline.left()
    package_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with open(log_path, "w", encoding="utf-8") as log:
        proc = processes.start(child_command(name, seconds, quick, result), env=env,
                               stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(seconds + GRACE_S)
        except subprocess.TimeoutExpired:
            processes.stop([proc])
            section = Section(name)
            section.fail(f"still running {seconds + GRACE_S:.0f} s after it started (its "
                         f"share of the budget and {GRACE_S:.0f} s more): ended; it was in "
                         f"{_frames(log_path)}")
            section.line = section.failed[0]
            return section
    if result.exists():
        return Section.from_dict(name, json.loads(result.read_text()))
    section = Section(name)
    status = proc.returncode
    how = (f"signal {signal.Signals(-status).name}" if status < 0
           else f"exit status {status}")
    section.fail(f"its process ended ({how}) without a result: {_tail(log_path)}")
    section.line = section.failed[0]
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


def _section(name: str, deadline: Deadline, quick: bool, emulated: bool) -> Section:
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


def child(argv: list) -> int:
    name, seconds, quick, result = argv[0], float(argv[1]), argv[2] == "1", Path(argv[3])
    faulthandler.dump_traceback_later(max(1.0, seconds + GRACE_S - 5), exit=False)
    from .machine import open_machine
    machine = open_machine()
    section = Section(name)
    if isinstance(machine, str):
        section.fail(machine)
    else:
        deadline = Deadline(time.monotonic, time.monotonic() + seconds)
        try:
            section = _section(name, deadline, quick, machine.emulated)
        except Exception as exc:  # the section's own failure: recorded, not raised
            section.crashed(exc)
            section.line = section.failed[-1]
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(section.finish().to_dict(), default=str))
    os.replace(tmp, result)
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]))

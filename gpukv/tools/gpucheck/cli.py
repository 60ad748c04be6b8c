"""`python -m gpukv gpucheck`: the one command that checks and measures gpukv on a GPU.

Sections, in the order they run (each gets a share of the budget left when it starts; the
tests take whatever remains):
- environment: the GPUs, driver, CUDA runtime, CuPy, NCCL, PyTorch and peer access;
- kernels: every CUDA kernel on fixed inputs, bit for bit against golden digests made on
  the CUDA emulation, NaN payloads and flush-to-zero edges told apart (goldens.py);
- bandwidth: each kernel family at 1, 16 and 256 MiB against the device-to-device copy;
- store: small-key calls against a bare CuPy loop, large keys against the copy;
- trainer: gpukv.torch.Trainer against PyTorch's own optimizer step, weights compared;
- tests: the checkout's gpu-marked tests, multi-GPU ones on virtual GPUs (suite.py).
The environment and the four measuring sections each run in a process of their own
(isolated.py), so a hang, a crash or a sticky CUDA error costs one section, and keeps
what that section had measured before it; SIGTERM ends every process the run started
and keeps the record of what finished, and what the section it was in had measured.
Exit status: 0 when no section failed, 1 when one did or the run was interrupted, 2 when
there is no GPU (and no emulation asked for with GPUKV_CUDA_EMULATION=1) or an option is
wrong.

With --out DIR it writes three files there, and no more (a copy that takes back only a
few files gets them all):
- gpucheck_<device>.json: the record, written first as the run starts (the command, the
  host, "environment: running"), then rewritten after every section and, while one runs,
  whenever it has measured more (at most every second or so), so a run stopped from
  outside, even by SIGKILL, keeps what it found; each failed test with the tail of its
  traceback and captured output. Until the environment has named the GPU, <device> is
  "unknown-gpu"; that file is then replaced by the GPU's;
- gpucheck_<device>.txt: the summary printed at the end;
- gpucheck-work.tar.gz: the sections' logs and results (gpucheck-work/<section>.log and
  .json; tests/: each pytest process's log, test ids and event lines), packed at the end
  from a temporary folder, which is then removed (a run killed outright leaves it there).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import sys
import tarfile
import tempfile
import traceback
from pathlib import Path

from ..._errors import ArgumentError
from .. import benchutil
from . import isolated, processes, suite
from . import machine as _machine
from .budget import Budget
from .section import Section

SECTIONS = ("kernels", "bandwidth", "store", "trainer", "tests")
#: share of the budget left that each section may take when it starts
SHARES = {"environment": 0.25, "kernels": 0.35, "bandwidth": 0.25, "store": 0.15,
          "trainer": 0.25, "tests": 1.0}
DEFAULT_BUDGET_S = 480.0
QUICK_BUDGET_S = 90.0
#: seconds the tests leave at the end of the budget, to stop their processes and write
TESTS_KEEP_S = 15.0
#: the sections' logs, packed into one file under --out
WORK_ARCHIVE = "gpucheck-work.tar.gz"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpukv gpucheck",
        description="Check and measure gpukv on this machine's GPU(s) in one command: "
                    "what is there, the GPU tests, every kernel bit for bit against the "
                    "emulation's goldens, kernel bandwidth against the copy, the store and "
                    "the Trainer against bare CuPy and PyTorch.")
    p.add_argument("--out", metavar="DIR", help="write gpucheck_<device>.json and .txt here")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and the device layer's tests only (a minute or two)")
    p.add_argument("--budget", type=benchutil.nonnegative_float, metavar="SECONDS",
                   help=f"the most the whole run may take (default {DEFAULT_BUDGET_S:.0f}, "
                        f"{QUICK_BUDGET_S:.0f} with --quick); later sections are cut "
                        "short, saying so")
    p.add_argument("--sections", type=benchutil.name_list(SECTIONS, "section"),
                   default=list(SECTIONS), metavar="LIST",
                   help=f"which to run, comma-separated (default all: {','.join(SECTIONS)})")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="pytest processes for the tests (default: one per 4 cores, at most "
                        "4; 1 on the emulation)")
    return p


def default_jobs(emulated: bool) -> int:
    """pytest processes: one per 4 cores, at most 4 (one on the emulation)."""
    if emulated:
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class Interrupted(Exception):
    """SIGTERM (or SIGHUP) reached the run: it ends its children and writes what it has."""


def _interrupt(signum, frame):
    if processes.held(signum):  # raised again once the starting process is remembered
        return
    raise Interrupted(signal.Signals(signum).name)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        build_parser().error(f"--jobs {args.jobs}: expected 1 or more")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        build_parser().error(f"--out {args.out}: is a file; the results need a folder")
    budget = Budget(args.budget if args.budget is not None
                    else (QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S))
    record = Record(_machine.Machine(False, _machine.checkout_root(), []), args, budget,
                    Path(args.out) if args.out else None)
    # a record exists from the start: a first step that hangs or dies leaves the command,
    # the host and the step it was in
    record.progress(Section("environment"), None)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    unusable = None
    try:
        unusable = _run_sections(record, args, budget)
    except (Interrupted, KeyboardInterrupt) as exc:
        record.interrupted = f"{type(exc).__name__} {exc}".strip()
    except Exception as exc:  # the run's own failure: the record still says what it found
        traceback.print_exc()
        record.interrupted = f"{type(exc).__name__}: {exc}"
    finally:
        processes.stop_all()
    # the run is over: a second signal must not cut the record's last writes short
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    record.keep_running()
    if unusable is not None:
        print(f"gpukv gpucheck: {unusable}")
        record.write(final=True)
        record.pack_work(keep=False)
        return 2
    print(record.summary())
    record.write(final=True)
    record.pack_work()
    if record.interrupted:
        return 1
    return 1 if any(s.ok is False for s in record.sections) else 0


def _run_sections(record: Record, args, budget: Budget) -> str | None:
    """Run the sections in turn; the line saying why there is nothing to check, if so."""
    root = record.machine.root
    try:
        emulated = _machine.wants_emulation()
    except ArgumentError as exc:
        environment = Section("environment")
        environment.fail(str(exc))
        environment.line = str(exc)
        environment.data["unusable"] = str(exc)
        record.add(environment.finish(), show=False)
        return str(exc)
    record.set_machine(_machine.Machine(emulated, root, []))
    work = record.work_dir()
    record.current = "environment"
    environment = isolated.run(
        "environment", budget.share(SHARES["environment"], keep=isolated.GRACE_S),
        quick=args.quick, work=work, on_progress=record.progress)
    unusable = environment.data.get("unusable")
    if environment.data.get("gpus"):
        record.set_machine(_machine.Machine(emulated, root, environment.data["gpus"]))
    record.add(environment.finish(), show=unusable is None)
    if unusable is not None:
        return str(unusable)
    machine = record.machine
    for name in SECTIONS:
        if name not in args.sections:
            continue
        record.current = name
        record.progress(Section(name), None)  # the record names it before it reports
        if name == "tests":
            # the last section keeps time to stop its processes and write the record
            deadline = budget.share(SHARES[name], keep=TESTS_KEEP_S)
            section = suite.run(machine.root, machine.emulated, deadline, quick=args.quick,
                                jobs=args.jobs or default_jobs(machine.emulated),
                                work_dir=work / "tests", on_progress=record.progress)
            section.data["logs"] = record.logs_of("tests")
        else:
            deadline = budget.share(SHARES[name], keep=isolated.GRACE_S)
            section = isolated.run(name, deadline, quick=args.quick, work=work,
                                   on_progress=record.progress)
        record.add(section.finish())
    record.current = None
    return None


class Record:
    """The run's JSON record and text summary, rewritten as sections finish."""

    def __init__(self, machine, args, budget: Budget, out: Path | None):
        self.machine, self.args, self.budget, self.out = machine, args, budget, out
        self.sections: list[Section] = []
        self.current: str | None = None  # the section running now
        #: (what the section running now has measured so far, what it is running)
        self.running: tuple | None = None
        self.interrupted: str | None = None
        self.finished = False
        self.work: Path | None = None
        self.created = datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        self.json_path, self.text_path = self._paths()

    def _paths(self) -> tuple:
        if self.out is None:
            return None, None
        stem = f"gpucheck_{benchutil.slug(self.machine.name)}"
        return self.out / f"{stem}.json", self.out / f"{stem}.txt"

    def set_machine(self, machine) -> None:
        """The machine as the environment found it: the record moves to its GPU's name."""
        before = self.json_path
        self.machine = machine
        self.json_path, self.text_path = self._paths()
        if before is not None and before != self.json_path and before.exists():
            self.write()
            before.unlink(missing_ok=True)

    def work_dir(self) -> Path:
        """Where the sections' processes keep their logs: a temporary folder, packed into
        WORK_ARCHIVE under --out at the end, so that --out holds three files at most."""
        if self.work is None:
            self.work = Path(tempfile.mkdtemp(prefix="gpukv-gpucheck-"))
        return self.work

    def logs_of(self, name: str) -> str:
        """Where section `name`'s logs are once the run has ended."""
        if self.out is None:
            return str(self.work_dir() / name)
        return f"{self.out / WORK_ARCHIVE}: gpucheck-work/{name}/"

    def pack_work(self, keep: bool = True) -> None:
        """With --out, pack the work folder into WORK_ARCHIVE there and remove it; without,
        leave it where it is (`keep`) or remove it."""
        if self.work is None or not self.work.exists():
            return
        if self.out is None:
            if not keep:
                shutil.rmtree(self.work, ignore_errors=True)
            return
        archive = self.out / WORK_ARCHIVE
        tmp = archive.with_name(archive.name + ".tmp")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            with tarfile.open(tmp, "w:gz") as tar:
                tar.add(self.work, arcname="gpucheck-work")
            os.replace(tmp, archive)
        except OSError as exc:  # the record is written already: the logs stay where they are
            tmp.unlink(missing_ok=True)
            print(f"gpukv gpucheck: could not write {archive} ({exc}); the logs are in "
                  f"{self.work}")
            return
        shutil.rmtree(self.work, ignore_errors=True)

    def add(self, section: Section, show: bool = True) -> None:
        self.running = None
        self.sections.append(section)
        if show:
            print(f"[{self.budget.elapsed():5.0f} s] {section.name:<11} {_status(section):<7} "
                  f"{section.line}", flush=True)
        self.write()

    def progress(self, section: Section, running: str | None) -> None:
        """What the section running now has measured so far (and is running): written
        at once, so that a run killed outright keeps it."""
        self.running = (section, running)
        self.write()

    def keep_running(self) -> None:
        """The run was interrupted: the section it was in is kept, cut, with what it had."""
        if self.running is None:
            return
        section, running = self.running
        during = f" ({running})" if running else ""
        section.cut = section.cut or (f"the run was interrupted while it ran{during}: what "
                                      "it had measured by then is kept")
        self.add(section.finish(), show=False)

    def payload(self) -> dict:
        from ... import __version__
        head = {"gpukv": __version__, "created_utc": self.created,
                "command": command_line(), "host": platform.node(),
                "device": self.machine.name, "emulated": self.machine.emulated,
                "quick": self.args.quick, "budget_s": round(self.budget.end
                                                            - self.budget.start, 1),
                "elapsed_s": round(self.budget.elapsed(), 1),
                "finished": self.finished,
                "running": self.running[0].name if self.running else None,
                "ok": (self.finished and not self.interrupted
                       and not any(s.ok is False for s in self.sections)),
                "interrupted": self.interrupted and f"{self.interrupted} during {self.current}"}
        sections = {s.name: s.to_dict() for s in self.sections}
        if self.running is not None:
            section, running = self.running
            entry = section.to_dict()
            entry.update(ok=False, running=running or True, summary=entry["summary"] or "running",
                         cut=entry["cut"] or ("still running when this record was written: "
                                              "what it had measured by then"))
            sections[section.name] = entry
        return {"gpucheck": head, **sections}

    def write(self, final: bool = False) -> None:
        self.finished = self.finished or final
        if self.json_path is None:
            return
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.payload(), indent=1, default=str) + "\n")
        os.replace(tmp, self.json_path)
        if final and self.text_path is not None:
            self.text_path.write_text(self.summary() + "\n")

    def summary(self) -> str:
        m = self.machine
        budget = self.budget.end - self.budget.start
        lines = [f"gpukv gpucheck on {m.name}" + (" (quick)" if self.args.quick else "")
                 + f": {self.budget.elapsed():.0f} s of a {budget:.0f} s budget"]
        if self.interrupted:
            lines.append(f"  INTERRUPTED ({self.interrupted}) during {self.current}: the "
                         "sections below are all it did")
        for s in self.sections:
            lines.append(f"  {s.name:<11} {_status(s):<7} {s.line}")
            for failure in s.failed[:5]:
                lines.append(f"      failed: {failure}")
            if len(s.failed) > 5:
                lines.append(f"      ... {len(s.failed) - 5} more in the JSON")
            if s.cut:
                lines.append(f"      cut: {s.cut}")
        goals = [(s.name, g) for s in self.sections for g in s.goals]
        judged = [g for _, g in goals if g["met"] is not None]
        if goals:
            why = ("the emulation's speeds say nothing of a GPU's" if m.emulated
                   else "--quick sizes, or not measured")
            head = (f"{sum(g['met'] for g in judged)} of {len(judged)} met" if judged
                    else "none judged")
            if len(judged) < len(goals):
                head += f" ({len(goals) - len(judged)} not judged: {why})"
            lines.append(f"  goals: {head}")
            for name, g in goals:
                mark = {True: "met", False: "MISSED", None: "-"}[g["met"]]
                value = "n/a" if g["value"] is None else f"{g['value']:.3g}{g['unit']}"
                sign = "<=" if g["at_most"] else ">="
                lines.append(f"    {mark:<6} {g['goal']}: {value} (goal {sign} "
                             f"{g['target']:g}{g['unit']})")
        if self.json_path:
            lines.append(f"  written: {self.json_path}, {self.text_path}"
                         + (f", {self.json_path.with_name(WORK_ARCHIVE)}" if self.work else ""))
        return "\n".join(lines)


def command_line() -> str:
    """This run's command as a user would type it."""
    argv = sys.argv[1:]
    if Path(sys.argv[0]).name == "__main__.py":  # python -m gpukv ...
        return " ".join([Path(sys.executable).name, "-m", "gpukv", *argv])
    return " ".join([Path(sys.argv[0]).name, *argv])


def _status(section: Section) -> str:
    if section.ok is None:
        return "skipped"
    if section.cut and not section.failed:
        return "cut"
    return "ok" if section.ok else "FAILED"

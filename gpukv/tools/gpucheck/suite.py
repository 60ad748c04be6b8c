"""gpucheck's test section: the checkout's GPU tests, run on this machine's GPU(s).

The `gpu`- and `multi_gpu`-marked tests of the checkout run under pytest with
`GPUKV_TEST_GPU=1` (a GPU test that cannot run fails instead of skipping) and, on a real
GPU, `GPUKV_CUDA_EMULATION=0` (a broken GPU is a failure, never a silent fall back to the
emulation). A `multi_gpu(n)` test on a machine with fewer GPUs runs on n virtual GPUs over
the ones there are (the test suite's gate sets `GPUKV_VIRTUAL_GPUS`). The tests are shared
out, file by file, between a few pytest processes that run side by side; a plugin
(`pytest_plugin.py`) records every outcome as it happens, so a run stopped at its deadline
still names what passed, what failed and what never ran. Each failure keeps the tail of
its traceback and captured output in the record (`details`), and a test that took its
process down the tail of that process's log, so the record alone shows why.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from . import processes
from .budget import Deadline
from .pytest_plugin import tail
from .section import Section

PLUGIN = "gpukv.tools.gpucheck.pytest_plugin"
MARKERS = "gpu or multi_gpu"
#: what --quick runs: the device layer's GPU tests (kernels, streams, tree sums)
QUICK_PATHS = ("tests/device",)
#: gpucheck's own tests: their GPU cases are the kernels section's, run there already
OWN_TESTS = "tests/tools/test_gpucheck.py"
COLLECT_TIMEOUT_S = 120
#: how often the outcomes so far go to the run's record
PROGRESS_EVERY_S = 5.0
MAX_FAILURES_LISTED = 50
#: the failures' details in the record, all together: past it, only their messages stay
MAX_DETAILS_CHARS = 200_000
#: how much of a crashed process's log a test it took down keeps
LOG_LINES, LOG_CHARS = 60, 6000


def pytest_command(paths) -> list:
    """The pytest command line of one process of the section."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", PLUGIN, "-p", "no:cacheprovider",
               "-m", MARKERS, *paths]
    if importlib.util.find_spec("pytest_timeout") is None:
        # setup.cfg sets pytest-timeout's `timeout`; without that plugin --strict-config
        # stops pytest before any test runs, so the checks keep only --strict-markers.
        command += ["-o", "addopts=--strict-markers -ra"]
    return command


def child_environment(root: Path, emulated: bool) -> dict:
    env = dict(os.environ)
    env["GPUKV_TEST_GPU"] = "1"
    env["GPUKV_CUDA_EMULATION"] = "1" if emulated else "0"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in paths if p != str(root)])
    return env


def read_events(path: Path) -> list:
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a process killed mid-write
            continue
    return events


def shards(ids: list, jobs: int) -> list:
    """`ids` shared out between at most `jobs` lists, whole files each, largest first."""
    by_file: dict = {}
    for nodeid in ids:
        by_file.setdefault(nodeid.split("::", 1)[0], []).append(nodeid)
    groups: list = [[] for _ in range(max(1, min(jobs, len(by_file))))]
    for _, members in sorted(by_file.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        min(groups, key=len).extend(members)
    return [g for g in groups if g]


def outcomes(events: list) -> dict:
    """Per test id: {'outcome': passed|failed|error|skipped|interrupted, 'message',
    'details'} (details: the failure's traceback tail, else empty)."""
    found: dict = {}
    for e in events:
        if e.get("event") == "start":
            found.setdefault(e["id"], {"outcome": "interrupted", "message": "",
                                       "details": "", "phases": set()})
        elif e.get("event") == "report":
            entry = found.setdefault(e["id"], {"outcome": "interrupted", "message": "",
                                               "details": "", "phases": set()})
            entry["phases"].add(e["when"])
            bad = {"failed": "failed" if e["when"] == "call" else "error"}
            if e["outcome"] in bad and entry["outcome"] not in ("failed", "error"):
                entry["outcome"] = bad[e["outcome"]]
                entry["message"] = f"{e['when']}: {e['message']}"
                entry["details"] = e.get("details", "")
            elif e["outcome"] == "skipped" and entry["outcome"] == "interrupted":
                entry["outcome"] = "skipped"
                entry["message"] = e["message"]
            elif (e["when"] == "call" and e["outcome"] == "passed"
                  and entry["outcome"] == "interrupted"):
                entry["outcome"] = "passed"
    for entry in found.values():
        if entry["outcome"] == "passed" and "teardown" not in entry["phases"]:
            entry["outcome"] = "interrupted"
        del entry["phases"]
    return found


class _Shard:
    def __init__(self, index: int, ids: list, work: Path, root: Path, env: dict):
        self.index, self.ids = index, ids
        self.select = work / f"shard-{index}.ids"
        self.report = work / f"shard-{index}.jsonl"
        self.log = work / f"shard-{index}.log"
        self.select.write_text("\n".join(ids) + "\n", encoding="utf-8")
        files = sorted({i.split("::", 1)[0] for i in ids})
        env = dict(env, GPUCHECK_SELECT=str(self.select), GPUCHECK_REPORT=str(self.report))
        with open(self.log, "w", encoding="utf-8") as log:
            self.proc = processes.start(pytest_command(files), cwd=root, env=env,
                                        stdout=log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 3) -> str:
        last = self.log_text().strip().splitlines()[-lines:]
        return " | ".join(line.strip() for line in last)


def collect(root: Path, env: dict, paths, work: Path, deadline: Deadline) -> tuple:
    """(test ids, error text or None) of the GPU tests under `paths`."""
    report = work / "collect.jsonl"
    env = dict(env, GPUCHECK_REPORT=str(report))
    try:
        proc = subprocess.run(pytest_command(paths) + ["--collect-only"], cwd=root, env=env,
                              capture_output=True, text=True,
                              timeout=max(5.0, min(COLLECT_TIMEOUT_S, deadline.left())))
    except subprocess.TimeoutExpired:
        return [], "collecting the tests took longer than the time left"
    collected = [e for e in read_events(report) if e.get("event") == "collected"]
    if proc.returncode not in (0, 5) or not collected:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        return [], f"pytest --collect-only exited with status {proc.returncode}: {tail}"
    return [i for i in collected[-1]["ids"] if not i.startswith(OWN_TESTS + "::")], None


def run(root: Path | None, emulated: bool, deadline: Deadline, *, quick: bool, jobs: int,
        work_dir: Path | None = None, on_progress=None) -> Section:
    """Run the section: collect, shard, run side by side until done or the deadline.
    `on_progress(section, None)`, when given, gets the outcomes so far every
    PROGRESS_EVERY_S, and once more when the run ends meanwhile (a signal)."""
    section = Section("tests")
    if root is None:
        section.skipped = ("no tests/ folder beside the gpukv package (an installed wheel): "
                           "run gpucheck from a checkout")
        section.line = "skipped: " + section.skipped
        return section
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="gpukv-gpucheck-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_environment(root, emulated)
    paths = list(QUICK_PATHS) if quick else []
    ids, error = collect(root, env, paths, work, deadline)
    section.data.update(selection=" ".join(paths) or "every test", markers=MARKERS,
                        collected=len(ids), jobs=0, logs=str(work))
    if error:
        section.fail(error)
        section.line = error
        return section
    running = [_Shard(i, group, work, root, env) for i, group in enumerate(shards(ids, jobs))]
    section.data["jobs"] = len(running)
    shown = time.monotonic()
    try:
        while any(s.proc.poll() is None for s in running) and not deadline.passed():
            time.sleep(0.2)
            if on_progress is not None and time.monotonic() - shown >= PROGRESS_EVERY_S:
                shown = time.monotonic()
                still = [s for s in running if s.proc.poll() is None]
                on_progress(_so_far(section, ids, running, still, "still running when this "
                                    "record was written"), None)
    except BaseException:  # the run is ending: hand on what finished
        still = [s for s in running if s.proc.poll() is None]
        processes.stop([s.proc for s in still])
        if on_progress is not None:
            on_progress(_so_far(section, ids, running, still, "the run was interrupted"),
                        None)
        raise
    stopped = [s for s in running if s.proc.poll() is None]
    processes.stop([s.proc for s in stopped])  # with what their tests started
    _judge(section, ids, _found(running), running, stopped)
    return section


def _found(running: list) -> dict:
    found: dict = {}
    for s in running:
        found.update(outcomes(read_events(s.report)))
    return found


def _so_far(section: Section, ids: list, running: list, stopped: list, why: str) -> Section:
    """The section as it stands: the outcomes so far, the tests of the processes in
    `stopped` (still running, or ended by the run's end) counted as cut (`why`)."""
    now = Section(section.name)
    now.data = dict(section.data)
    _judge(now, ids, _found(running), running, stopped, why=why)
    return now


def _judge(section: Section, ids: list, found: dict, running: list, stopped: list,
           why: str = "the budget ran out") -> None:
    counts = Counter(found[i]["outcome"] if i in found else "not run" for i in ids)
    # a test that never finished in a process the deadline ended was cut, not failed; in
    # one that ended by itself, it took the process down (a crash)
    cut_short = {i for s in stopped for i in s.ids}
    bad = [(i, found[i]) for i in ids if i in found
           and (found[i]["outcome"] in ("failed", "error")
                or (found[i]["outcome"] == "interrupted" and i not in cut_short))]
    for nodeid, entry in bad[:MAX_FAILURES_LISTED]:
        what = ("the process running it ended" if entry["outcome"] == "interrupted"
                else entry["message"])
        section.fail(f"{nodeid}: {what}")
    if len(bad) > MAX_FAILURES_LISTED:
        section.fail(f"... and {len(bad) - MAX_FAILURES_LISTED} more (see the logs)")
    for s in running:
        status = s.proc.returncode
        mine = [found.get(i, {}).get("outcome") for i in s.ids]
        if s not in stopped and status not in (0, 1) and not any(
                o in ("failed", "error") for o in mine):
            section.fail(f"pytest process {s.index} exited with status {status}: "
                         f"{s.log_tail()}")
    # collected, yet a process that ended by itself never ran them: nothing says they pass
    orphans = [i for i in ids if i not in found and i not in cut_short]
    if orphans:
        section.fail(f"{len(orphans)} collected tests never ran (first {orphans[0]})")
    if stopped:
        midway = [i for i in cut_short if found.get(i, {}).get("outcome") == "interrupted"]
        never = [i for i in cut_short if i not in found]
        section.cut = (f"{why}: {len(never)} of {len(ids)} tests never ran, "
                       f"{len(midway)} cut while running"
                       + (f" ({', '.join(sorted(midway)[:4])})" if midway else ""))
    skipped = Counter(found[i]["message"] for i in ids
                      if i in found and found[i]["outcome"] == "skipped")
    section.data.update(
        passed=counts["passed"], failed=counts["failed"] + counts["error"],
        skipped=counts["skipped"], interrupted=counts["interrupted"],
        not_run=counts["not run"],
        skip_reasons=[{"reason": r, "tests": n} for r, n in skipped.most_common(10)])
    listed = bad[:MAX_FAILURES_LISTED]
    section.data["failures"], section.data["details_cut"] = failure_records(
        listed, _crash_logs(listed, running))
    section.line = (f"{counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
                    f"{counts['skipped']} skipped"
                    + (f", {counts['not run'] + counts['interrupted']} not run"
                       if counts["not run"] + counts["interrupted"] else "")
                    + f" of {len(ids)} ({len(running)} pytest process"
                    + ("es" if len(running) != 1 else "") + ")")


def _crash_logs(bad: list, running: list) -> dict:
    """Per test that took its process down: the tail of that process's log (faulthandler's
    frames, the last output), the only trace such a test leaves."""
    shard_of = {i: s for s in running for i in s.ids}
    return {i: tail(shard_of[i].log_text(), LOG_LINES, LOG_CHARS) for i, e in bad
            if e["outcome"] == "interrupted" and i in shard_of}


def failure_records(bad: list, logs: dict) -> tuple:
    """(the record's failures, each with its details, a note of what was left out or None):
    details stop at MAX_DETAILS_CHARS in all, so a run with many failures stays readable."""
    records, used, left_out = [], 0, 0
    for nodeid, entry in bad:
        text = entry.get("details") or logs.get(nodeid, "")
        if used + len(text) > MAX_DETAILS_CHARS:
            text, left_out = "", left_out + 1
        used += len(text)
        records.append({"id": nodeid, "outcome": entry["outcome"],
                        "message": entry["message"], "details": text})
    note = (f"the details of {left_out} failures left out: over {MAX_DETAILS_CHARS} "
            "characters in all" if left_out else None)
    return records, note

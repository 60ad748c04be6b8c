"""A pytest plugin for gpucheck's test section (`pytest -p gpukv.tools.gpucheck.pytest_plugin`).

`GPUCHECK_SELECT=FILE` keeps only the test ids listed in FILE (one per line), so several
pytest processes can share one run's tests. `GPUCHECK_REPORT=FILE` appends one JSON line
per event as it happens (flushed at once): the ids collected, each test's start, each
phase's outcome with its message, and the end, so a run killed at its deadline still
says which tests passed, failed, or were running. A failed phase also carries `details`:
the tail of its traceback and of the output pytest captured, enough to diagnose it from
the record alone.

SIGTERM (how gpucheck ends a pytest process at its deadline) is raised as
KeyboardInterrupt, as Ctrl-C would be: the running test's `finally` blocks and fixtures'
teardowns run (ending the MPI jobs and GPU work they started) and pytest ends its session,
where SIGTERM's default would end the process at once.
"""
from __future__ import annotations

import json
import os
import signal

_MESSAGE_CHARS = 400
#: how much of a failure's traceback, and of each captured output, `details` keeps
_DETAIL_LINES, _DETAIL_CHARS = 60, 6000
_CAPTURED_LINES, _CAPTURED_CHARS = 20, 1500


def _write(event: dict) -> None:
    path = os.environ.get("GPUCHECK_REPORT")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")


def message(report) -> str:
    """The one line that says why a test failed or skipped."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        text = str(longrepr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = getattr(crash, "message", None) or str(longrepr).strip().splitlines()[-1]
    text = " ".join(str(text).split())
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS - 3] + "..."


def tail(text: str, lines: int, chars: int) -> str:
    """The last `lines` lines of `text`, at most `chars` characters, saying when cut."""
    kept = text.rstrip().splitlines()
    short = "\n".join(kept[-lines:])[-chars:]
    return short if len(short) == len("\n".join(kept)) else "[... cut]\n" + short


def details(report) -> str:
    """The tail of a failed phase's traceback, then of what the test printed: the end of
    each says most about why it failed."""
    captured = [f"----- {title} -----\n" + tail(content, _CAPTURED_LINES, _CAPTURED_CHARS)
                for title, content in report.sections  # stdout, stderr and log, per phase
                if content.strip()]
    # the traceback keeps at least half the room, whatever the tests printed
    room = max(_DETAIL_CHARS // 2, _DETAIL_CHARS - len("\n".join(captured)))
    text = "\n".join([tail(report.longreprtext, _DETAIL_LINES, room), *captured])
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + "\n[... cut]"


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} (gpucheck's deadline)")


def pytest_configure(config):
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("GPUCHECK_SELECT")
    if not path:
        return
    with open(path, encoding="utf-8") as f:
        keep = {line.strip() for line in f if line.strip()}
    selected = [item for item in items if item.nodeid in keep]
    dropped = [item for item in items if item.nodeid not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = selected


def pytest_collection_finish(session):
    _write({"event": "collected", "ids": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "id": nodeid})


def pytest_runtest_logreport(report):
    event = {"event": "report", "id": report.nodeid, "when": report.when,
             "outcome": report.outcome, "seconds": round(report.duration, 3),
             "message": message(report) if report.outcome != "passed" else ""}
    if report.failed:
        event["details"] = details(report)
    _write(event)


def pytest_sessionfinish(session, exitstatus):
    _write({"event": "finish", "status": int(exitstatus)})

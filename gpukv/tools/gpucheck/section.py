"""One section of a gpucheck run and what it found, as the JSON record holds it."""
from __future__ import annotations

import time
import traceback

#: in a section's own process, what keeps its partial results (`keep_progress`)
_progress_sinks: list = []


def keep_progress(sink) -> None:
    """Have every `Section.progress()` of this process call `sink(section, running)`: a
    section's process keeps what it has measured so far, for a parent that may have to
    end it mid-way."""
    _progress_sinks[:] = [sink]


class Section:
    """The result of one section: what failed, the goals it judged, and its data.

    `ok` is None for a section that was skipped (nothing to run here, e.g. no PyTorch),
    False when something failed or the budget cut it short before it checked everything,
    True otherwise. Goals (speed targets) are reported beside `ok`, not folded into it:
    a slow kernel is a finding, not a broken one.
    """

    def __init__(self, name: str):
        self.name = name
        self.failed: list[str] = []
        self.goals: list[dict] = []
        self.cut: str | None = None
        self.skipped: str | None = None
        self.data: dict = {}
        self.line = ""  # the one-line summary of the text report
        self._start = time.monotonic()
        self.seconds: float | None = None

    def fail(self, what: str) -> None:
        self.failed.append(what)

    def progress(self, running: str | None = None) -> None:
        """The section has measured something more (and is about to run `running`, when
        given): kept at once where its process keeps partial results, else nothing."""
        for sink in _progress_sinks:
            sink(self, running)

    def goal(self, what: str, value: float | None, target: float, *, at_most: bool = False,
             unit: str = "", judged: bool = True) -> None:
        """Record a goal: `value` against `target` (at least it, or `at_most`). A goal
        that is not `judged` (the emulation's speeds say nothing of a GPU's) is listed
        with its value but counts neither way."""
        met = None
        if judged and value is not None:
            met = value <= target if at_most else value >= target
        self.goals.append({"goal": what, "value": value, "target": target,
                           "at_most": at_most, "unit": unit, "met": met})

    def crashed(self, exc: BaseException) -> None:
        """The section itself raised: record the error and where, and go on."""
        frames = traceback.extract_tb(exc.__traceback__)[-3:]
        where = "; ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                          for f in frames)
        self.fail(f"{type(exc).__name__}: {exc} (at {where})")

    @property
    def ok(self) -> bool | None:
        if self.skipped and not self.failed:
            return None
        return not self.failed and self.cut is None

    def finish(self) -> Section:
        if self.seconds is None:
            self.seconds = round(time.monotonic() - self._start, 2)
        return self

    @classmethod
    def from_dict(cls, name: str, record: dict) -> Section:
        """The section `to_dict` wrote (in another process)."""
        section = cls(name)
        rest = dict(record)
        rest.pop("ok", None)
        section.failed = list(rest.pop("failed", []))
        section.goals = list(rest.pop("goals", []))
        section.cut = rest.pop("cut", None)
        section.skipped = rest.pop("skipped", None)
        section.seconds = rest.pop("seconds", None)
        section.line = rest.pop("summary", "")
        section.data = rest
        return section

    def to_dict(self) -> dict:
        return {"ok": self.ok, "failed": self.failed, "cut": self.cut,
                "skipped": self.skipped, "seconds": self.seconds, "goals": self.goals,
                "summary": self.line, **self.data}

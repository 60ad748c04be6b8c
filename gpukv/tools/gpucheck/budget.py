"""The time a gpucheck run may take, shared out between its sections.

A lent GPU is held for minutes, all of them counted, so the run keeps to one budget: each
section is given a share of what is left when it starts and stops early, saying so, when
that share is spent, and the last section takes whatever remains.
"""
from __future__ import annotations

import time


class Budget:
    """`seconds` of wall-clock time from now (monotonic)."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.clock = clock
        self.start = clock()
        self.end = self.start + float(seconds)

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds left of the whole budget (never below zero)."""
        return max(0.0, self.end - self.clock())

    def share(self, fraction: float, at_least: float = 0.0, keep: float = 0.0) -> Deadline:
        """A deadline `fraction` of what is left from now, less `keep` seconds kept for
        what must follow (at least `at_least` seconds, never past the budget's end)."""
        left = max(0.0, self.left() - keep)
        return Deadline(self.clock, self.clock() + min(left, max(at_least, fraction * left)))


class Deadline:
    """The end of one section's share: `passed()` says when it is time to stop."""

    def __init__(self, clock, end: float):
        self.clock = clock
        self.end = end

    def left(self) -> float:
        return max(0.0, self.end - self.clock())

    def passed(self) -> bool:
        return self.clock() >= self.end

"""A file stand-in for checkpoint tests: its writes fail once a byte budget is spent."""
from __future__ import annotations

import errno
import os


class FailingFile:
    """Wraps file `f`; a write that would take it past `budget` bytes raises OSError(`err`)
    (ENOSPC: a full disk) instead of writing."""

    def __init__(self, f, budget: int, err: int = errno.ENOSPC):
        self.f, self.budget, self.err, self.written = f, budget, err, 0

    def write(self, data):
        size = memoryview(data).nbytes
        if self.written + size > self.budget:
            raise OSError(self.err, os.strerror(self.err))
        self.written += size
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

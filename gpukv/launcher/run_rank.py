"""How `gpukv run` starts a Python program on each rank.

`python -m gpukv.launcher.run_rank PROG ARGS` runs PROG as `__main__`, as `python PROG
ARGS` would, and when it ends on a non-zero exit or an uncaught exception, reports that to
the launcher (`run_report`) before the exit goes on as usual: the launcher then ends the job
at once, where mpiexec would wait for the other ranks (possibly forever).
"""
from __future__ import annotations

import os
import runpy
import sys

from . import run_report


def exit_status(code) -> int:
    """The status of a process that ends on `sys.exit(code)`."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def main(argv: list[str]) -> None:
    """Run `argv[0]` with `argv[1:]` as its arguments."""
    if not argv:
        sys.exit("usage: python -m gpukv.launcher.run_rank PROG.py [ARGS]")
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python PROG` sets it
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        status = exit_status(exc.code)
        if status:
            run_report.send(f"exit status {status}", status=status)
        raise
    except BaseException as exc:
        run_report.send(f"uncaught {type(exc).__name__}", str(exc), status=1)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])

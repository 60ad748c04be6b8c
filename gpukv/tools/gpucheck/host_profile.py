"""Where a call's host time goes: cProfile over a number of calls, per call.

A small call on a GPU is bound by the host (Python, CuPy's launches and events), not by
the GPU, so its remedy is found in a profile of the host, taken where the call runs. The
record holds the Python function calls per call, each library's own time per call (gpukv,
CuPy, NumPy, PyTorch, the others: time inside each library's functions, not counting what they
call in other libraries; C functions count with the library that called them), and the
functions that take the most of it. cProfile slows every Python call, so the times are
larger than the unprofiled ones: they say where the time goes, not how long it takes.
"""
from __future__ import annotations

import cProfile
import pstats

#: functions listed in a profile, the most own time first
TOP = 25
#: the libraries a profile tells apart (by a folder of that name in a function's path)
LIBRARIES = ("gpukv", "cupy", "numpy", "torch")


def library(filename: str) -> str:
    """The library of LIBRARIES a function's file belongs to, or other."""
    parts = filename.replace("\\", "/").split("/")
    for name in LIBRARIES:
        if name in parts[:-1]:
            return name
    return "other"


def _where(filename: str, line: int, name: str) -> str:
    """A short name of a function: its file from the library's folder on, line, name."""
    parts = filename.replace("\\", "/").split("/")
    for lib in LIBRARIES:
        if lib in parts[:-1]:
            parts = parts[len(parts) - 1 - parts[::-1].index(lib):]
            break
    else:
        parts = parts[-1:]
    return f"{'/'.join(parts)}:{line} {name}" if filename != "~" else name


def profile(call, calls: int, before=None, top: int = TOP) -> dict:
    """Profile `calls` calls of `call()` (each after an unprofiled `before()`, if given):
    calls and microseconds per call, by library and for the `top` functions with the
    most own time."""
    profiler = cProfile.Profile()
    for _ in range(calls):
        if before is not None:
            before()
        profiler.enable()
        call()
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    by_library: dict = {}
    rows = []
    python_calls = 0
    for (filename, line, name), (_, ncalls, own, total, callers) in stats.items():
        python_calls += ncalls if filename != "~" else 0
        # a C function ("~") counts with the library of its first caller
        lib = library(filename if filename != "~" else next(iter(callers), ("~",))[0])
        by_library[lib] = by_library.get(lib, 0.0) + own
        rows.append((own, ncalls, total, _where(filename, line, name)))
    rows.sort(reverse=True)
    per = 1e6 / calls
    return {
        "calls": calls,
        "python_calls_per_call": python_calls / calls,
        "own_us_per_call": {lib: round(t * per, 2) for lib, t in sorted(by_library.items())},
        "top": [{"function": where, "calls_per_call": round(n / calls, 2),
                 "own_us_per_call": round(own * per, 2),
                 "cumulative_us_per_call": round(total * per, 2)}
                for own, n, total, where in rows[:top]],
    }


def summary(found: dict) -> str:
    """One line: Python calls per call and each library's share of the own time."""
    own = found["own_us_per_call"]
    total = sum(own.values()) or 1.0
    shares = ", ".join(f"{lib} {t / total:.0%}" for lib, t in
                       sorted(own.items(), key=lambda item: -item[1]))
    return f"{found['python_calls_per_call']:.0f} Python calls per call ({shares})"

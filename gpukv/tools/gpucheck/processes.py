"""The child processes of a gpucheck run: started in sessions of their own, so that each
can be ended with everything it started, and all ended together when the run ends early
(a signal, an error) rather than left holding the GPU."""
from __future__ import annotations

import os
import signal
import subprocess
import time

_running: list = []
_starting = [False]  # whether `start` is between its fork and remembering the process
_held: list = []     # signals that came meanwhile


def start(command, **options) -> subprocess.Popen:
    """Popen(command) in a new session, remembered until `stop`. A signal the run ends on
    that comes while the process starts is held (`held`) and raised again once the
    process is remembered: raised inside Popen, it would leave the process running
    with no one to end it."""
    _starting[0] = True
    try:
        proc = subprocess.Popen(command, start_new_session=True, **options)
        _running.append(proc)
    finally:
        _starting[0] = False
        if _held:  # the first one ends the run
            signum = _held[0]
            _held.clear()
            signal.raise_signal(signum)
    return proc


def held(signum: int) -> bool:
    """For a signal handler: whether the signal is held for now (a process is starting)."""
    if _starting[0]:
        _held.append(signum)
        return True
    return False


def stop(procs, grace_s: float = 5.0) -> None:
    """End `procs` and their children: SIGTERM to all, `grace_s` for all to go, then
    SIGKILL to the rest."""
    procs = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + grace_s
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.05)
        procs = [p for p in procs if p.poll() is None]
        if not procs:
            break
    for p in procs:
        p.wait()


def stop_all() -> None:
    stop(_running)
    _running.clear()

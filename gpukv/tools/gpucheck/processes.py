"""The child processes of a gpucheck run: started in sessions of their own, so that each
can be ended with everything it started, and all ended together when the run ends early
(a signal, an error) rather than left holding the GPU."""
from __future__ import annotations

import os
import signal
import subprocess
import time

_running: list = []


def start(command, **options) -> subprocess.Popen:
    """Popen(command) in a new session, remembered until `stop`."""
    proc = subprocess.Popen(command, start_new_session=True, **options)
    _running.append(proc)
    return proc


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

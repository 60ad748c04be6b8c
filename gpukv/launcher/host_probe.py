"""Which of a job's hosts still answer, asked as mpiexec would reach them.

`gpukv run` restarts a failed job on the hosts that answer. A host answers when the launcher
mpiexec uses (HYDRA_LAUNCHER_EXEC, else ssh) runs `true` there within the probe timeout; a
host that is this machine (the loopback, or an address of this machine's network namespace)
answers without being asked, as mpiexec starts its processes without ssh. Every host is
asked at once, so a dead host costs one timeout whatever their number.
"""
from __future__ import annotations

import ipaddress
import math
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping


def host_name(entry: str) -> str:
    """The host of a -hosts entry: `node1:4` -> `node1` (hydra's HOST:N); an IPv6
    address, with its many colons, stays whole."""
    return entry.rsplit(":", 1)[0] if entry.count(":") == 1 else entry


def slots(entry: str) -> int:
    """The processes a -hosts entry takes before mpiexec moves on: N of `node1:N`, else 1."""
    if entry.count(":") != 1:
        return 1
    count = entry.rsplit(":", 1)[1]
    return int(count) if count.isdigit() and int(count) > 0 else 1


def is_this_machine(name: str) -> bool:
    """Whether `name` is the loopback or an address of this machine (one this process can
    bind to); a name that does not resolve is not."""
    if name == socket.gethostname():
        return True
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, address in found:
        text = str(address[0]).split("%")[0]
        try:
            if ipaddress.ip_address(text).is_loopback:
                return True
        except ValueError:
            continue
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.bind((address[0], 0, *address[2:]))
            return True
        except OSError:  # not an address of ours
            continue
    return False


def probe_command(name: str, timeout: float, env: Mapping[str, str],
                  launcher_exec: str | None = None) -> list[str]:
    """The command that runs `true` on host `name` the way mpiexec reaches it."""
    chosen = launcher_exec or env.get("HYDRA_LAUNCHER_EXEC")
    if chosen:
        return [chosen, name, "true"]
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, math.ceil(timeout))}",
            name, "true"]


def _asks(command: list[str], timeout: float, env: Mapping[str, str]) -> bool:
    """Whether `command` exits 0 within `timeout` s (past it, it is killed, with whatever
    it started)."""
    try:
        process = subprocess.Popen(command, env=dict(env), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
    except OSError:
        return False
    try:
        return process.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        return False


def answering(entries: list[str], timeout: float, env: Mapping[str, str],
              launcher_exec: str | None = None) -> list[str]:
    """The entries of `entries` (HOST or HOST:N) whose host answers within `timeout` s,
    in their order; all are asked at once."""
    answers: dict[int, bool] = {}

    def ask(index: int, entry: str) -> None:
        name = host_name(entry)
        answers[index] = is_this_machine(name) or _asks(
            probe_command(name, timeout, env, launcher_exec), timeout, env)

    threads = [threading.Thread(target=ask, args=(i, e), daemon=True)
               for i, e in enumerate(entries)]
    for thread in threads:
        thread.start()
    # a name lookup that hangs past the timeout counts as no answer
    deadline = time.monotonic() + timeout + 1
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [e for i, e in enumerate(entries) if answers.get(i)]

"""Emulated hosts for the tests (gpukv.tools.cluster), and jobs started across them.

Without root, `ip` or `tc` the cluster tests skip, unless GPUKV_TEST_CLUSTER=1 (as in CI),
where they fail: a run meant to test several hosts cannot pass without them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpukv.tools.cluster import EmulatedCluster, unavailable

from ..distributed.mpirun import NUMPY_CODECS, PROGRAMS, communicate, dies_with_us, require_mpi

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def require_cluster() -> None:
    """Skip (fail with GPUKV_TEST_CLUSTER=1) where hosts cannot be emulated."""
    why = unavailable()
    if why:
        if os.environ.get("GPUKV_TEST_CLUSTER") == "1":
            pytest.fail(f"{why}; GPUKV_TEST_CLUSTER=1 asks for the cluster tests to run")
        pytest.skip(why)
    require_mpi()


def cluster(hosts: int, rate: str = "10gbit", **rates) -> EmulatedCluster:
    """A cluster to start with `with` (`rates`: h1="100mbit" sets host 1's link)."""
    require_cluster()
    return EmulatedCluster(hosts, rate, {int(k[1:]): v for k, v in rates.items()})


def host_list(made: EmulatedCluster, hosts: list[int] | None = None, slots: int = 0) -> str:
    """The `-hosts` value: the chosen hosts' addresses (with ':slots' to place the ranks
    round-robin, `slots` per host in turn)."""
    chosen = range(made.hosts) if hosts is None else hosts
    suffix = f":{slots}" if slots else ""
    return ",".join(made.addresses[h] + suffix for h in chosen)


def program_command(program: str | Path, *args: str, bare: bool = False) -> list[str]:
    """python [-m mpi4py] PROGRAM ARGS, PROGRAM a file of tests/distributed/programs or of
    this folder's programs/, or a path."""
    path = Path(program)
    if not path.is_absolute():
        path = HERE / "programs" / path if (HERE / "programs" / path).exists() \
            else PROGRAMS / path
    return [sys.executable, *([] if bare else ["-m", "mpi4py"]), str(path), *args]


def job_env(made: EmulatedCluster, timeout: float = 30, **extra: str) -> dict:
    """The cluster's environment, gpukv importable from this checkout, and the options."""
    env = made.env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["GPUKV_DIST_TIMEOUT"] = str(timeout)
    env.setdefault(*NUMPY_CODECS)
    env.update(extra)
    return env


def start(made: EmulatedCluster, n: int, hosts: str, command: list[str], env: dict,
          launcher: str = "mpiexec", options: tuple[str, ...] = (),
          hostfile: Path | None = None) -> subprocess.Popen:
    """Start the job from host 0: `mpiexec` or `gpukv run` with -n N -hosts HOSTS (or
    -f HOSTFILE) and `options` before the program."""
    where = ["-f", str(hostfile)] if hostfile else ["-hosts", hosts]
    if launcher == "mpiexec":
        head = [require_mpi(), *where, "-n", str(n), *options]
    else:  # gpukv run, which runs a .py program under this Python itself
        head = [sys.executable, "-m", "gpukv", "run", "-n", str(n), *where, *options]
        if command[:3] == [sys.executable, "-m", "mpi4py"]:
            command = command[3:]
    return made.popen(0, [*head, *command], env=env, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                      start_new_session=True, preexec_fn=dies_with_us())


def finish(process: subprocess.Popen, limit: float) -> tuple[int, str, str, float]:
    """Wait for the job (fail the test past `limit` s, killing it): status, stdout,
    stderr and the seconds it took from now."""
    began = time.monotonic()
    stdout, stderr = communicate(process, limit, "the job")
    return process.returncode, stdout, stderr, time.monotonic() - began


def passes(status: int, stdout: str, stderr: str, workers: int) -> str:
    """stdout of a job that succeeded with a PASS line from each worker."""
    assert status == 0, f"exit status {status}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    for w in range(workers):
        assert f"PASS worker {w} of {workers}" in stdout, (stdout, stderr)
    return stdout


class Watched:
    """A started job whose output lines are read as they come, each with its time."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.lines: list[tuple[float, str]] = []
        self._readers = [threading.Thread(target=self._read, args=(stream,), daemon=True)
                         for stream in (process.stdout, process.stderr)]
        for reader in self._readers:
            reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, count: int = 1, limit: float = 60) -> float:
        """When `text` has come `count` times (fails past `limit` s). Counted in the text,
        not by line: the ranks' lines may run into each other on their way."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            seen = [t for t, line in list(self.lines) for _ in range(line.count(text))]
            if len(seen) >= count:
                return seen[count - 1]
            if self.process.poll() is not None and not any(r.is_alive()
                                                           for r in self._readers):
                break
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"no {count} line(s) with {text!r} within {limit} s:\n{self.text()}")

    def end(self, limit: float) -> tuple[int, float]:
        """The exit status and when it came (fails past `limit` s, killing the job)."""
        try:
            self.process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {limit} s:\n{self.text()}")
        ended = time.monotonic()
        for reader in self._readers:
            reader.join(timeout=10)
        return self.process.returncode, ended

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def text(self) -> str:
        return "\n".join(line for _, line in list(self.lines))

    def matching(self, text: str) -> list[tuple[float, str]]:
        return [(t, line) for t, line in list(self.lines) if text in line]

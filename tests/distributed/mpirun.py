"""Launching a program under `mpiexec -n N python -m mpi4py ...` (or bare `python`) from a
test, with a timeout, so that a hang fails one test instead of the run.

Without mpi4py or mpiexec the MPI tests skip, unless GPUKV_TEST_MPI=1 (as in CI), where
they fail: a run that was meant to test several processes cannot pass without them.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpukv.launcher import leftovers, process_tree
from gpukv.launcher.launch import find_mpiexec, is_open_mpi

PROGRAMS = Path(__file__).resolve().parent / "programs"
#: The host's codecs run as their NumPy twins in every process of a job, unless a test
#: asks for Numba's (GPUKV_HOST_JIT=1): Numba's start takes each process about a second,
#: which the jobs' processes would spend on a few kilobytes. The twins are held to
#: Numba's bytes in one process (tests/encoding, tests/device/test_host_codecs.py), and
#: test_deterministic_compression's jobs to the bits of one process that compiles them.
NUMPY_CODECS = ("GPUKV_HOST_JIT", "0")


def mpiexec() -> str | None:
    """The mpiexec `gpukv run` calls: beside this interpreter (the mpich wheel's), else the
    one on PATH."""
    return find_mpiexec()


def require_mpi() -> str:
    """mpiexec's path; skips (fails with GPUKV_TEST_MPI=1) when MPI is missing."""
    launcher = mpiexec()
    missing = [name for name, ok in (("mpi4py", importlib.util.find_spec("mpi4py")),
                                     ("mpiexec", launcher)) if not ok]
    if missing:
        message = (f"needs {' and '.join(missing)} (pip install 'gpukv[mpi]')")
        if os.environ.get("GPUKV_TEST_MPI") == "1":
            pytest.fail(message + "; GPUKV_TEST_MPI=1 asks for the MPI tests to run")
        pytest.skip(message)
    assert launcher is not None
    return launcher


def run(program: str | Path, n: int, *args: str, env: dict | None = None,
        timeout: float = 120, module: bool = False, bare: bool = False,
        options: tuple = ()) -> subprocess.CompletedProcess:
    """Run `program` (a file in tests/distributed/programs, a path, or with `module` a module
    name for `python -m`) on `n` processes; the finished process, stdout and stderr as text.
    `bare` runs `python prog.py` as a user may (without `-m mpi4py`, which aborts the job on
    an uncaught exception); `options` go to mpiexec.

    Fails the test (with both outputs) when the job does not end within `timeout` s.
    """
    launcher = require_mpi()
    if module:
        target = ["-m", str(program)]
    else:
        path = Path(program)
        target = [str(path if path.is_absolute() else PROGRAMS / path)]
    full_env = dict(os.environ)
    full_env.update(_launcher_env(launcher))
    full_env.update(env or {})
    full_env.setdefault("GPUKV_DIST_TIMEOUT", "30")
    full_env.setdefault(*NUMPY_CODECS)
    python = [sys.executable] + ([] if bare else ["-m", "mpi4py"])
    command = [launcher, *options, "-n", str(n), *python, *target, *args]
    # A session of its own: on timeout the whole job (mpiexec and every rank) is killed.
    # Outside the test process's group, mpiexec dies with that process however it ends
    # (gpucheck ending a pytest process at its deadline), and its proxies end the ranks.
    before = leftovers.present()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, text=True, env=full_env,
                               start_new_session=True, preexec_fn=dies_with_us())
    try:
        stdout, stderr = communicate(process, timeout, " ".join(command))
    finally:  # (many tests end ranks on purpose: what MPICH leaves of them goes, as
        # `gpukv run` removes it)
        leftovers.remove_new(before)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def dies_with_us():
    """A `preexec_fn` for a job a test starts (mpiexec, `gpukv run`), in a session of its
    own: the job's launcher is killed when the test process ends, however it ends (a
    deadline's SIGKILL included), and it ends its ranks."""
    return process_tree.die_with_parent(signal.SIGKILL)


@functools.cache
def _launcher_env(launcher: str) -> dict:
    """What `launcher` needs in the environment here: Open MPI's mpiexec refuses to run
    as root (a container's user) unless told it may; MPICH's needs nothing."""
    if os.geteuid() == 0 and is_open_mpi(launcher):
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}


def communicate(process: subprocess.Popen, timeout: float, what: str) -> tuple:
    """stdout and stderr of `process` (started in a session of its own) once it ends; past
    `timeout` s, its whole session is killed and the test fails with both outputs."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{what} did not end within {timeout} s\n"
                    f"stdout:\n{_text(stdout)}\nstderr:\n{_text(stderr)}")


def _text(raw) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")


def ok(result: subprocess.CompletedProcess) -> str:
    """stdout of a job that must have succeeded (else fail with its outputs)."""
    assert result.returncode == 0, (f"exit status {result.returncode}\nstdout:\n"
                                    f"{result.stdout}\nstderr:\n{result.stderr}")
    return result.stdout

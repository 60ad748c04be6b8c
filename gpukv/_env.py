"""Settings read from environment variables, refused with a typed error when malformed
(named instead where they only annotate a log line)."""
from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping

from ._errors import ArgumentError, GpukvError

#: every GPUKV_* variable gpukv reads, each described in docs/settings.md
SETTINGS = (
    # the stores
    "GPUKV_STRATEGY", "GPUKV_DETERMINISTIC", "GPUKV_VIRTUAL_GPUS", "GPUKV_HOST_THREADS",
    "GPUKV_HOST_JIT", "GPUKV_CALIBRATION", "GPUKV_TREE_ARRAY_BOUND",
    "GPUKV_TREE_LINK_USAGE_PENALTY", "GPUKV_TREE_BACKTRACK", "GPUKV_TIMELINE",
    # several processes
    "GPUKV_NUM_SERVERS", "GPUKV_DIST_TIMEOUT", "GPUKV_BIGARRAY_BOUND",
    "GPUKV_DIST_CHUNK_BYTES",
    # set by `gpukv run` and `gpukv cluster` for the processes they start
    "GPUKV_RUN_VERBOSE", "GPUKV_RUN_ATTEMPT", "GPUKV_RUN_MAX_RESTARTS", "GPUKV_RUN_REPORT",
    "GPUKV_RUN_JOB",
    "GPUKV_CLUSTER", "GPUKV_CLUSTER_HOSTS",
    # the GPU tools (`gpukv gpucheck`, the kernels' resource check)
    "GPUKV_CUDA_EMULATION", "GPUKV_NVRTC_LIB", "GPUKV_PTXAS",
)
#: the test suite's own switches (docs/testing.md)
TEST_PREFIXES = ("GPUKV_TEST_", "GPUKV_EMU_")


def unknown_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{variable: the setting it most resembles, or ''} for each GPUKV_* variable in
    `environ` (default os.environ) that gpukv does not read: a misspelled setting is
    otherwise silently without effect."""
    environ = os.environ if environ is None else environ
    unknown = {}
    for name in sorted(environ):
        if (name.startswith("GPUKV_") and name not in SETTINGS
                and not name.startswith(TEST_PREFIXES)):
            close = difflib.get_close_matches(name.upper(), SETTINGS, n=1, cutoff=0.75)
            unknown[name] = close[0] if close else ""
    return unknown


def malformed(checks: Mapping[str, Callable[[], object]]) -> dict[str, GpukvError]:
    """{variable: the typed error its reader raises} for each of `checks` (a variable and
    a call reading it) whose value is malformed."""
    errors = {}
    for name, check in checks.items():
        try:
            check()
        except GpukvError as exc:
            errors[name] = exc
    return errors


def refuse_malformed(checks: Mapping[str, Callable[[], object]]) -> None:
    """Raise the reader's own error when one of `checks` is malformed, an ArgumentError
    naming each when several are: all are said at once, not one per try."""
    errors = list(malformed(checks).values())
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ArgumentError("malformed settings: " + "; ".join(map(str, errors)))


#: where an MPI launcher puts a process's rank (MPICH's Hydra, Open MPI, PMIx)
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
#: where a launched process finds its rank: an MPI launcher's variables, then torchrun's
#: (which `gpukv run` sets too)
RANK_VARIABLES = (*MPI_RANK_VARIABLES, "RANK")


def launched_rank() -> int | None:
    """This process's rank as its launcher set it (RANK_VARIABLES), None when none is."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def first_process() -> bool:
    """Whether this process is a job's rank 0, or runs alone (no launcher's rank set):
    where a word said alike by every rank is said once."""
    return launched_rank() in (None, 0)


def name_unknown(unknown: Mapping[str, str]) -> str:
    """`unknown_settings()`'s dict in words: each name, with '(did you mean ...?)' after
    those that resemble a setting, joined by '; '."""
    return "; ".join(f"{name} (did you mean {close}?)" if close else name
                     for name, close in unknown.items())


def positive_int(name: str, error: type = ArgumentError,
                 expected: str = "a positive integer") -> int | None:
    """`$name` as a positive int, None when unset or blank; `error` names it when malformed,
    saying what is `expected`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise error(f"{name}={raw!r}: expected {expected}")
    return n


def flag(name: str, error: type = ArgumentError) -> bool | None:
    """`$name` as a bool ('1': True, '0': False), None when unset or blank; `error` names
    it when it is anything else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw not in ("0", "1"):
        raise error(f"{name}={raw!r}: expected 1 (on) or 0 (off)")
    return raw == "1"


#: set by `gpukv run --max-restarts K` in every attempt's environment (gpukv.launcher.restarts,
#: which imports nothing of the stores): the attempt (0 the first) and K
RUN_ATTEMPT = "GPUKV_RUN_ATTEMPT"
RUN_MAX_RESTARTS = "GPUKV_RUN_MAX_RESTARTS"


def restart_note() -> str:
    """'restart A of at most K (GPUKV_RUN_ATTEMPT=A)' when this process runs in attempt
    A > 0 of `gpukv run --max-restarts K`, '' otherwise, for a log line. A malformed value
    is named, not refused: a note in a log line must not stop a store from being made."""
    attempt, bad = _count(RUN_ATTEMPT)
    if bad or not attempt:
        return bad
    bound, bad = _count(RUN_MAX_RESTARTS)
    of = "" if bound is None else f" of at most {bound}"
    return f"restart {attempt}{of} ({RUN_ATTEMPT}={attempt}{', ' + bad if bad else ''})"


def _count(name: str) -> tuple[int | None, str]:
    """`$name` as an int >= 0 (None when unset or blank), or None and words naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None, ""
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        return None, f"{name}={raw!r}: not a count"
    return n, ""

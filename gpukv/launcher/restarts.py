"""The attempts of a `gpukv run` job started with `--max-restarts K`.

An attempt that fails (anything the launcher ends a job for, or a non-zero exit) is followed
by another on the hosts that still answer, with as many processes per host as before, while
restarts remain and at least `--min-workers` processes fit; Ctrl-C, SIGTERM or a hang-up
(SIGHUP) ends it all.
Each attempt ends with one line on stderr: its number, processes and hosts, how long it ran,
why it ended and what comes next. The exit status is the last attempt's.
"""
from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from . import host_probe, process_tree

#: set in every attempt's environment: 0 for the first, 1 for the first restart...
ATTEMPT_ENV = "GPUKV_RUN_ATTEMPT"
#: set in every attempt's environment: the --max-restarts of the run
MAX_RESTARTS_ENV = "GPUKV_RUN_MAX_RESTARTS"


class Plan(NamedTuple):
    """What was asked: -n, the hosts (of --hosts or the host file; None: this machine
    only), --ppn, --min-workers and --max-restarts."""
    processes: int
    hosts: list[str] | None
    ppn: int | None
    min_workers: int
    max_restarts: int


class Outcome(NamedTuple):
    """How an attempt ended: its exit status, why (the words of the launcher's failure
    line; None when every process ended well) and whether Ctrl-C or SIGTERM ended it."""
    status: int
    reason: str | None
    interrupted: bool


#: runs attempt A with N processes on HOSTS (None: this machine) to its end
Start = Callable[[int, int, "list[str] | None"], Outcome]
#: the hosts of a list that answer
Probe = Callable[[list[str]], list[str]]


def attempt_env(attempt: int, max_restarts: int) -> dict[str, str]:
    """The variables that tell a program which attempt it runs in."""
    return {ATTEMPT_ENV: str(attempt), MAX_RESTARTS_ENV: str(max_restarts)}


def processes_on(plan: Plan, alive: list[str]) -> int:
    """The processes a restart on `alive` (the plan's hosts that answer) gets: as many per
    host as the first attempt had: --ppn, else -n spread evenly over the hosts' slots
    (HOST:N has N, a plain HOST one; rounded up), at most -n."""
    if plan.hosts is None:
        return plan.processes
    if plan.ppn:
        return min(plan.processes, plan.ppn * len(alive))
    per_slot = math.ceil(plan.processes / sum(map(host_probe.slots, plan.hosts)))
    return min(plan.processes, per_slot * sum(map(host_probe.slots, alive)))


def _where(hosts: list[str] | None) -> str:
    return "this machine" if hosts is None else ",".join(hosts) or "no host"


def _processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")


class _Signals:
    """Ctrl-C, SIGTERM and a hang-up between attempts (an attempt's job takes them over
    while it runs): remembered, so that no new attempt starts."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._before: dict = {}

    def __enter__(self) -> _Signals:
        for signum in process_tree.ending():
            self._before[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._before.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        self.received = signum


def run(plan: Plan, start: Start, probe: Probe) -> int:
    """Run attempts until one ends well, is interrupted, or no restart may follow; the
    last attempt's exit status."""
    processes, hosts = plan.processes, plan.hosts
    with _Signals() as signals:
        for attempt in range(plan.max_restarts + 1):
            began = time.monotonic()
            outcome = start(attempt, processes, hosts)
            ran = time.monotonic() - began
            line = (f"attempt {attempt} ({_processes(processes)} on {_where(hosts)}) ended "
                    f"after {ran:.1f} s: {outcome.reason or 'every process ended well'}")
            if outcome.status == 0:
                _say(f"{line}; done")
                return outcome.status
            if outcome.interrupted or signals.received is not None:
                _say(f"{line}; interrupted, not restarting")
                return outcome.status
            if attempt == plan.max_restarts:
                _say(f"{line}; giving up: no restart left (--max-restarts "
                     f"{plan.max_restarts})")
                return outcome.status
            alive = None if plan.hosts is None else probe(plan.hosts)
            if signals.received is not None:
                _say(f"{line}; interrupted, not restarting")
                return 128 + signals.received
            fits = plan.processes if alive is None else processes_on(plan, alive)
            if fits < plan.min_workers:
                _say(f"{line}; giving up: the hosts that answer ({_where(alive)}) take "
                     f"{_processes(fits)}, fewer than --min-workers {plan.min_workers}")
                return outcome.status
            processes, hosts = fits, alive
            _say(f"{line}; restarting with {_processes(processes)} on {_where(hosts)} "
                 f"(restart {attempt + 1} of at most {plan.max_restarts})")
    raise AssertionError("unreachable: the last attempt returns")


def _say(what: str) -> None:
    try:
        sys.stderr.write(f"gpukv run: {what}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a terminal that hung up: the status says it
        pass

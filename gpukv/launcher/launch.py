"""`python -m gpukv run`: start an MPI job with MPICH's mpiexec and make sure it ends.

mpiexec alone can hang for good: a rank that exits non-zero is waited for by the others, and
when a host is cut off mpiexec cannot reach its proxy and never exits. The launcher watches
the job and ends every process it can reach in bounded time (see `DESCRIPTION`).
"""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .._errors import ArgumentError
from . import host_probe, hostfile, process_tree, restarts, run_report

#: seconds mpiexec has to end the job itself after a failure or a signal
GRACE = 3.0
#: seconds between SIGTERM and SIGKILL to every process of the job
TERM_WAIT = 1.0
#: seconds a host has to answer before a restart
PROBE_TIMEOUT = 5.0

DESCRIPTION = f"""\
Run PROG on N processes with MPICH's mpiexec (the one beside this Python, else on PATH),
passing -n, -hosts, -ppn and any other mpiexec option given before PROG; the environment
passes through (HYDRA_LAUNCHER, HYDRA_LAUNCHER_EXEC, HYDRA_IFACE ...). A PROG ending in .py
runs under this Python. The job runs in a session of its own, and the launcher watches:
  - reports from the ranks (a UDP socket named in {run_report.ENV}): a rank whose
    transport fails (PeerError), or a .py PROG that ends on an uncaught exception or a
    non-zero exit;
  - mpiexec's own word that a process ended badly, and mpiexec's exit.
On the first failure it prints one line naming the rank(s) and why, gives mpiexec --grace
seconds to end the job, then sends SIGTERM and {TERM_WAIT:g} s later SIGKILL to every process
of the job it can reach (mpiexec, proxies, ranks, the ssh clients of remote hosts): it
returns about grace + {TERM_WAIT:g} s after the failure at the latest, even where mpiexec
would hang (a host cut off). Ctrl-C or SIGTERM goes to mpiexec once, with the same grace
and the same end; a second one ends the job at once.
Exit status: mpiexec's when the job ends by itself; after a failure the failed rank's
status, else 1; 130 after Ctrl-C (143 after SIGTERM); 2 for a usage error.

Restarts (--max-restarts K, default 0: none): after a failure or a non-zero exit (not after
Ctrl-C or SIGTERM) the job starts again, at most K times, on the hosts that still answer:
those of --hosts, or of the host file (-f, -hostfile or -machinefile FILE: one HOST or
HOST:N a line, `#` starting a comment), which the first attempt gets as given and a restart
replaces with -hosts of the entries that answer, slots kept. Each is asked to run `true`
through HYDRA_LAUNCHER_EXEC, else ssh, all at once, within --probe-timeout seconds; this
machine always answers: a job without hosts restarts on it whole. A restart keeps the
processes per host: --ppn, else -n spread evenly over the slots (HOST:N has N, a plain HOST
one; rounded up), at most -n. Below --min-workers processes (default -n) it gives up. The
processes of each attempt see {restarts.ATTEMPT_ENV} (0, 1, ...) and
{restarts.MAX_RESTARTS_ENV}. Instead of the failure line, each attempt ends with one line
saying its processes and hosts, how long it ran, why it ended and what comes next. The exit
status is the last attempt's. The hosts are given once: --hosts and a host file together
are a usage error (mpiexec refuses them), as is, under --max-restarts, a host file that
cannot be read, names no host or has a line other than HOST[:N]."""

#: mpiexec options that take values (the others are passed on as flags)
_MPIEXEC_VALUES = {"-genv": 2, "-env": 2}
_MPIEXEC_VALUES.update(dict.fromkeys(
    ["-genvlist", "-envlist", "-f", "-hostfile", "-machinefile", "-launcher",
     "-launcher-exec", "-iface", "-bind-to", "-binding", "-map-by", "-wdir", "-configfile",
     "-rmk", "-demux", "-outfile-pattern", "-errfile-pattern", "-gpus-per-proc"], 1))
# hydra's box on stdout when a process dies; its exit status or signal follows
_BAD_END = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\s*\n"
                      r"=\s*(.*?)\s*\n=\s*(EXIT CODE|KILLED BY SIGNAL): (\d+)")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _restarts(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _timeout(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _hosts(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",")]
    if not all(hosts):
        raise argparse.ArgumentTypeError(f"expected H1,H2,..., got {text!r}")
    return hosts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpukv run", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="gpukv run -n N [--hosts H1,H2,...] [--ppn K] [--grace S] "
              "[--max-restarts K [--min-workers M] [--probe-timeout S]] "
              "[MPIEXEC OPTIONS] PROG [ARGS]",
        epilog="Example: gpukv run -n 4 --hosts 198.18.0.2,198.18.0.3 --ppn 2 "
               "--max-restarts 3 --min-workers 2 train.py")
    parser.add_argument("-n", "-np", dest="n", type=_count, required=True,
                        help="number of processes")
    parser.add_argument("--hosts", "-hosts", type=_hosts,
                        help="hosts to run on (names or addresses); the ranks report to "
                             "the address of this machine that routes to the first remote one")
    parser.add_argument("--ppn", "-ppn", type=_count, help="processes per host")
    parser.add_argument("--grace", type=_seconds, default=GRACE,
                        help=f"seconds mpiexec has to end a failed or interrupted job "
                             f"before it is killed (default {GRACE:g})")
    parser.add_argument("--max-restarts", type=_restarts, default=0, metavar="K",
                        help="start a failed job again at most K times, on the hosts that "
                             "answer (default 0)")
    parser.add_argument("--min-workers", type=_count, metavar="M",
                        help="give up when fewer than M processes fit on the hosts that "
                             "answer (default -n)")
    parser.add_argument("--probe-timeout", type=_timeout, default=PROBE_TIMEOUT,
                        metavar="S", help=f"seconds a host has to answer before a restart "
                                          f"(default {PROBE_TIMEOUT:g})")
    return parser


def split(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """`argv` as (this command's options, mpiexec's other options, PROG and its ARGS)."""
    ours_with_value = {"-n", "-np", "--hosts", "-hosts", "--ppn", "-ppn", "--grace",
                       "--max-restarts", "--min-workers", "--probe-timeout"}
    ours: list[str] = []
    theirs: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            i += 1
            break
        if not word.startswith("-"):
            break
        if word in ours_with_value:
            ours += argv[i:i + 2]
            i += 2
        elif word.split("=")[0] in ours_with_value or word in ("-h", "--help"):
            ours.append(word)
            i += 1
        else:
            step = 1 + _MPIEXEC_VALUES.get(word, 0)
            theirs += argv[i:i + step]
            i += step
    return ours, theirs, argv[i:]


def find_mpiexec() -> str | None:
    """The mpiexec beside this interpreter (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.is_file() else shutil.which("mpiexec")


def report_address(hosts: list[str] | None) -> str:
    """The address of this machine the ranks can reach: the one that routes to the first
    remote host, else the loopback."""
    for host in hosts or ():
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host  # hydra's HOST:N
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                name, 9, type=socket.SOCK_DGRAM)[0]
            remote = str(address[0])
            if ipaddress.ip_address(remote.split("%")[0]).is_loopback:
                continue
            with socket.socket(family, kind, proto) as probe:
                probe.connect(address)  # UDP: picks the route, sends nothing
                own = probe.getsockname()[0]
        except (OSError, ValueError, IndexError):
            continue
        if own != remote:  # else the host is this machine
            return own
    return "127.0.0.1"


def main(argv: list[str]) -> int:
    """Parse, check, start and watch; the exit status."""
    parser = _parser()
    ours, theirs, command = split(list(argv))
    args = parser.parse_args(ours)
    if not command:
        parser.error("PROG missing: name the program to run")
    mpiexec = find_mpiexec()
    if mpiexec is None:
        parser.error("no mpiexec found beside this Python nor on PATH "
                     "(pip install mpich, or install MPICH)")
    prog = command[0]
    if prog.endswith(".py"):
        if not os.path.isfile(prog):
            parser.error(f"PROG {prog!r}: no such file")
        command = [sys.executable, "-m", "gpukv.launcher.run_rank", *command]
    elif shutil.which(prog) is None:
        parser.error(f"PROG {prog!r}: no such program")
    min_workers = args.n if args.min_workers is None else args.min_workers
    if min_workers > args.n:
        parser.error(f"--min-workers {min_workers} is more than the -n {args.n} processes")
    files = hostfile.given(theirs)
    named = (["--hosts"] if args.hosts else []) + [f"{o} {f}" for o, f in files]
    if len(named) > 1:
        parser.error(f"the hosts are given more than once ({', '.join(named)}): give one "
                     f"of --hosts, {', '.join(hostfile.OPTIONS)}")
    hosts = args.hosts
    if files and args.max_restarts:  # a restart runs on those of the file that answer
        try:
            hosts = hostfile.read(files[0][1])
        except ArgumentError as exc:
            parser.error(str(exc))
    plan = restarts.Plan(args.n, hosts, args.ppn, min_workers, args.max_restarts)

    def start(attempt: int, n: int, hosts: list[str] | None) -> restarts.Outcome:
        options = ["-n", str(n)]
        passed = theirs
        if hosts and (attempt or not files):
            options += ["-hosts", ",".join(hosts)]
            passed = hostfile.without(theirs)  # a restart runs on the hosts that answer
        if args.ppn:
            options += ["-ppn", str(args.ppn)]
        job = Job([mpiexec, *options, *passed, *command], report_address(hosts), args.grace,
                  restarts.attempt_env(attempt, args.max_restarts),
                  announce=not args.max_restarts)
        status = job.run()
        return restarts.Outcome(status, job.reason, job.signal is not None)

    if not args.max_restarts:
        return start(0, args.n, args.hosts).status

    def probe(hosts: list[str]) -> list[str]:
        return host_probe.answering(hosts, args.probe_timeout, os.environ,
                                    _option(theirs, "-launcher-exec"))

    return restarts.run(plan, start, probe)


def _option(words: list[str], name: str) -> str | None:
    """The value of mpiexec option `name` among `words`, if given."""
    for i, word in enumerate(words[:-1]):
        if word == name:
            return words[i + 1]
    return None


class Job:
    """One mpiexec and everything it starts, watched until it has all ended; `announce`:
    the line that says why the job is being ended goes to stderr (else only to `reason`)."""

    def __init__(self, command: list[str], address: str, grace: float,
                 env: dict[str, str] | None = None, announce: bool = True):
        self.command = command
        self.address = address
        self.grace = grace
        self.extra_env = env or {}
        self.announce = announce
        self.reason: str | None = None  # the words of the first line said
        self.failures: list[run_report.Report] = []
        self.signal: int | None = None
        self.deadline: float | None = None  # when the job is ended by force
        self.seen = ""  # the end of mpiexec's output, for hydra's box
        self.process: subprocess.Popen | None = None

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        process_tree.adopt_orphans()
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as reports:
            reports.bind((self.address, 0))
            reports.setblocking(False)
            port = reports.getsockname()[1]
            where = f"[{self.address}]" if family == socket.AF_INET6 else self.address
            env = {**os.environ, **self.extra_env, run_report.ENV: f"{where}:{port}"}
            handlers = {s: signal.signal(s, self._on_signal)
                        for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                self.process = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE,
                                                start_new_session=True)
                status = self._watch(reports)
            finally:
                if self.process is not None:
                    self._end_all()
                for s, handler in handlers.items():
                    signal.signal(s, handler)
        return status

    def _watch(self, reports: socket.socket) -> int:
        """Forward the output and read the reports until mpiexec ends or is overdue."""
        assert self.process is not None and self.process.stdout is not None
        output = self.process.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(reports, selectors.EVENT_READ)
            selector.register(output, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select(timeout=0.1):
                    if key.fileobj is reports:
                        self._read_reports(reports)
                    elif not self._forward(output):
                        selector.unregister(output)
                status = self.process.poll()
                if status is not None:
                    break
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    status = None
                    break
        if status is not None:
            self._drain(output, TERM_WAIT)  # hydra's box may follow its exit
        self._read_reports(reports)  # those that came with mpiexec's exit
        if status and not self.failures and self.signal is None:
            code = status if status > 0 else 128 - status
            self._fail([run_report.Report(None, code, "mpiexec", "")],
                       f"mpiexec ended with status {code}")
        if self.signal is not None:
            return 128 + self.signal
        if self.failures:
            known = [f.status for f in self.failures if f.status]
            return (known[0] if known else 1) & 0xFF or 1
        assert status is not None
        return status if status >= 0 else 128 - status

    def _read_reports(self, reports: socket.socket) -> None:
        found = []
        while True:
            try:
                data = reports.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            report = run_report.parse(data)
            if report is not None:
                found.append(report)
        if found:
            self._fail(found)

    def _forward(self, output: int) -> bool:
        """Copy what mpiexec wrote to stdout; whether there may be more."""
        try:
            chunk = os.read(output, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        try:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        except (BrokenPipeError, OSError):
            pass  # nobody reads our output: the job still runs to its end
        if not self.failures:
            self.seen = (self.seen + chunk.decode(errors="replace"))[-4096:]
            bad = _BAD_END.search(self.seen)
            if bad:
                code = int(bad[3]) + (128 if bad[2] == "KILLED BY SIGNAL" else 0)
                self._fail([run_report.Report(None, code, "a process ended badly",
                                              f"{bad[1]}, {bad[2].lower()} {bad[3]}")])
        return True

    # ------------------------------------------------------------ failures, signals
    def _fail(self, reports: list[run_report.Report], line: str = "") -> None:
        """Record failures; the first ones start the grace and are said in one line."""
        first = not self.failures and self.signal is None
        self.failures += reports
        if not first:
            return
        if line:
            self._say(line)
            return
        said = []
        for r in reports:
            who = "" if r.rank is None else f"rank {r.rank}: "
            said.append(f"{who}{r.what}" + (f": {r.message[:200]}" if r.message else ""))
        self._say("; ".join(dict.fromkeys(said)))

    def _on_signal(self, signum: int, _frame) -> None:
        if self.signal is not None:  # a second one: no more waiting
            self.deadline = time.monotonic()
            return
        self.signal = signum
        if self.process is not None:
            process_tree.signal_all([self.process.pid], signum)
        if not self.failures:
            self._say(f"{signal.Signals(signum).name}, passed on to mpiexec")

    def _say(self, what: str) -> None:
        if self.reason is None:
            self.reason = what
        if self.process is not None and self.process.poll() is None:
            self.deadline = min(self.deadline or math.inf, time.monotonic() + self.grace)
            what += f"; ending the job (mpiexec has {self.grace:g} s)"
        if self.announce:
            sys.stderr.write(f"gpukv run: {what}\n")
            sys.stderr.flush()

    # ------------------------------------------------------------------- the end
    def _end_all(self) -> None:
        """SIGTERM, then SIGKILL, to every process of the job still there."""
        assert self.process is not None
        me, pgid = os.getpid(), self.process.pid
        for signum, wait in ((signal.SIGTERM, TERM_WAIT), (signal.SIGKILL, TERM_WAIT)):
            living, _ = process_tree.descendants(me)
            if not living and self.process.poll() is not None:
                break
            process_tree.signal_group(pgid, signum)
            process_tree.signal_all(living, signum)
            end = time.monotonic() + wait
            while time.monotonic() < end:
                self.process.poll()
                living, zombies = process_tree.descendants(me)
                process_tree.reap([z for z in zombies if z != self.process.pid])
                if not living:
                    break
                time.sleep(0.02)
        self.process.wait(timeout=TERM_WAIT)
        if self.process.stdout is not None:
            self._drain(self.process.stdout.fileno(), 0)
            self.process.stdout.close()

    def _drain(self, output: int, seconds: float) -> None:
        """Forward what is left of mpiexec's output, waiting for more up to `seconds`
        (a process the job left behind may hold the pipe open)."""
        end = time.monotonic() + seconds
        with selectors.DefaultSelector() as selector:
            selector.register(output, selectors.EVENT_READ)
            while selector.select(timeout=max(0.0, end - time.monotonic())):
                if not self._forward(output):
                    break

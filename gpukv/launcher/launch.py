"""`python -m gpukv run`: start an MPI job with MPICH's mpiexec and make sure it ends.

mpiexec alone can hang for good: a rank that exits non-zero is waited for by the others, and
when a host is cut off mpiexec cannot reach its proxy and never exits. The launcher watches
the job, ends every process it can reach in bounded time, and says which rank failed and how
(see `DESCRIPTION`).
"""
from __future__ import annotations

import argparse
import difflib
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
from . import (
    failures,
    guard,
    host_probe,
    hostfile,
    leftovers,
    output,
    process_tree,
    restarts,
    run_rank,
    run_report,
)

#: seconds mpiexec has to end the job itself after a failure or a signal
GRACE = 3.0
#: seconds between SIGTERM and SIGKILL to every process of the job
TERM_WAIT = 1.0
#: seconds a rank's end may come before its program's word on it (`run_report.Done`)
WORD_WAIT = 0.5
#: seconds a host has to answer before a restart
PROBE_TIMEOUT = 5.0
#: seconds `nvidia-smi -L` has to list the GPUs (for -n's default)
GPU_QUERY_TIMEOUT = 10.0
#: the names of a PROG that means this Python
PYTHONS = ("python", "python3", f"python3.{sys.version_info.minor}")
#: how the line after a signal names it (SIGTERM's: terminated (SIGTERM))
_SIGNALLED: dict[int, str] = {
    signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGHUP: "hung up (SIGHUP)"}
#: what failed first, when mpiexec said it (a process ended badly, a rank's MPI_Abort)
_BOX = "mpiexec's word"
#: what a rank that ended without its program's word failed of, and the words of its line
_ENDED_WORDLESS = "ended without a word"
_WORDLESS = "its process ended past Python's own exit (a crash in native code, or C's _exit)"

_MIB = output.LONGEST >> 20
DESCRIPTION = f"""\
Run PROG on N processes with MPICH's mpiexec, as torchrun runs a training script, and make
sure the job ends. In torchrun's terms:
  torchrun --nproc-per-node K     gpukv run -n N (N processes in all; --ppn K a host)
  torchrun --nnodes, --rdzv-*     gpukv run --hosts H1,H2,... or -f HOSTFILE
  torchrun --log-dir DIR --tee    gpukv run --log-dir DIR (the console keeps every line)
  torchrun --max-restarts K       gpukv run --max-restarts K [--min-workers M]
  RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE: set in every rank, whatever PROG is
  OMP_NUM_THREADS=1 with several processes a host, unless set (OPENBLAS_, MKL_ too;
  --verbose says so)
  torchrun's other options (--master-addr, --tee, --redirects, --no-python, --run-path,
  --monitor-interval, --start-method, --role ...; with '_' or =VALUE too) are usage errors
  saying what to write instead
-n defaults to torchrun's --nproc-per-node gpu: this machine's GPUs (as many as
CUDA_VISIBLE_DEVICES names, else as `nvidia-smi -L` lists, else 1) on each host (--ppn K:
K on each), times the hosts. mpiexec (the one beside this Python, else on PATH) gets -n,
-hosts, -ppn and any other mpiexec option given before PROG; the environment passes through
(HYDRA_LAUNCHER, HYDRA_LAUNCHER_EXEC, HYDRA_IFACE ...). A PROG ending in .py, and a bare
`python`/`python3` PROG (`gpukv run -n 2 python train.py`), run under this Python.
Output: each whole line of a rank's stdout and stderr comes out on the launcher's after
`[R] ` (R the rank; lines of two ranks are never joined; one longer than {_MIB} MiB comes
out in lines of {_MIB} MiB); --log-dir DIR also writes DIR/attemptA/rankR.log for each rank
R of attempt A (0, then one per restart), and mpiexec's own words to
DIR/attemptA/mpiexec.log. Given -prepend-rank (-l), -prepend-pattern, -outfile-pattern or
-errfile-pattern, mpiexec's output passes as it is.
The job runs in a session of its own, and the launcher watches:
  - reports from the ranks (a UDP socket named in {run_report.ENV}): a rank whose
    transport fails (PeerError), a Python PROG that ends on an uncaught exception or a
    non-zero exit, and each rank's start (rank, local rank, host, pid) and end;
  - mpiexec's own word that a process ended badly, and mpiexec's exit.
On the first failure it gives mpiexec --grace seconds to end the job, then sends SIGTERM
and {TERM_WAIT:g} s later SIGKILL to every process of the job it can reach (mpiexec,
proxies, ranks, the ssh clients of remote hosts): it returns about grace + {TERM_WAIT:g} s
after the failure at the latest, even where mpiexec would hang (a host cut off). It then
prints one line per failed rank: rank, local rank, host, pid and what happened, e.g.
  gpukv run: rank 2 (local rank 2) on host vm, pid 9110: killed by signal 9 (SIGKILL)
  gpukv run: rank 1 (local rank 1) on host vm, pid 9109: uncaught ValueError: bad batch
(a rank's traceback shows its program's frames; gpukv's are counted, not shown). mpiexec's
box and exit codes and MPI's Abort banners are left out, and whole tracebacks and
KeyboardInterrupt's kept back, unless --verbose (or {run_rank.VERBOSE_ENV}=1). Ctrl-C or
SIGTERM goes to mpiexec once, with the same grace and the same end, and one line (after
those of the ranks that failed before it, if any):
  gpukv run: interrupted (Ctrl-C): ended N processes
a second one ends the job at once. A hang-up (SIGHUP: the terminal closed, an ssh
connection dropped; unless ignored, as under nohup) does as SIGTERM (mpiexec gets SIGTERM),
its line saying `hung up (SIGHUP)`. Should the launcher itself be killed (kill -9),
mpiexec dies with it (its proxies then kill their ranks), and a process it forks for each
attempt, in a session of its own, kills what is left of the job on this host (every
process whose environment has the attempt's {guard.ENV}) and removes MPICH's files.
Exit status: mpiexec's when the job ends by itself; after a failure the failed rank's
status (a signal's number for a rank a signal ended, as mpiexec gives it), else 1; 130
after Ctrl-C, 143 after SIGTERM, 129 after a hang-up, a failure before it or not; 2 for
a usage error.

Restarts (--max-restarts K, default 0: none): after a failure or a non-zero exit (not after
Ctrl-C, SIGTERM or a hang-up) the job starts again, at most K times, on the hosts that
still answer: those of --hosts, or of the host file (-f, -hostfile or -machinefile FILE:
one HOST or HOST:N a line, `#` starting a comment), which the first attempt gets as given
and a restart replaces with -hosts of the entries that answer, slots kept. Each is asked to
run `true` through HYDRA_LAUNCHER_EXEC, else ssh, all at once, within --probe-timeout
seconds; this machine always answers: a job without hosts restarts on it whole. A restart
keeps the processes per host: --ppn, else -n spread evenly over the slots (HOST:N has N, a
plain HOST one; rounded up), at most -n. Below --min-workers processes (default -n) it
gives up. The processes of each attempt see {restarts.ATTEMPT_ENV} (0, 1, ...) and
{restarts.MAX_RESTARTS_ENV}. Instead of the failure lines, each attempt ends with one line
saying its processes and hosts, how long it ran, why it ended (the failed ranks' words) and
what comes next. The exit status is the last attempt's. The hosts are given once: --hosts
and a host file together are a usage error (mpiexec refuses them), as is, under
--max-restarts, a host file that cannot be read, names no host or has a line other than
HOST[:N]."""

#: mpiexec options that take values (the others are passed on as flags)
_MPIEXEC_VALUES = {"-genv": 2, "-env": 2}
_MPIEXEC_VALUES.update(dict.fromkeys(
    ["-genvlist", "-envlist", "-f", "-hostfile", "-machinefile", "-launcher",
     "-launcher-exec", "-iface", "-bind-to", "-binding", "-map-by", "-wdir", "-configfile",
     "-rmk", "-demux", "-outfile-pattern", "-errfile-pattern", "-gpus-per-proc",
     "-prepend-pattern", "-rankmap", "-topolib", "-membind", "-localhost", "-nameserver",
     "-order-nodes", "-usize", "-memory-alloc-kinds"], 1))
#: this command's own options: those that take a value, and flags
_OURS_WITH_VALUE = frozenset({"-n", "-np", "--hosts", "-hosts", "--ppn", "-ppn", "--grace",
                              "--max-restarts", "--min-workers", "--probe-timeout",
                              "--log-dir"})
_OURS_FLAGS = frozenset({"-h", "--help", "--verbose"})
#: torchrun's options (which it takes with '_' for '-' too, and as --opt=value), and what
#: gpukv run takes instead (its --log-dir and --max-restarts are gpukv run's own)
_MEET = "nothing: gpukv's processes meet through MPI"
_HOSTS = "--hosts H1,H2,... (or a host file, -f FILE)"
_LINES = ("nothing: every rank's lines reach the console, each after [R] (--log-dir DIR: "
          "also a file per rank)")
_TORCHRUN = {"--nproc-per-node": "-n N (processes; with --hosts, --ppn K per host)",
             "--nnodes": _HOSTS,
             "--node-rank": "one gpukv run for every host (it starts them all)",
             "--master-addr": _MEET,
             "--master-port": _MEET,
             "--rdzv-endpoint": f"{_HOSTS} for the hosts, and no endpoint: gpukv's "
                                f"processes meet through MPI",
             "--rdzv-backend": _MEET,
             "--rdzv-id": _MEET,
             "--rdzv-conf": _MEET,
             "--local-addr": f"{_MEET} (mpiexec's -iface NAME picks their network)",
             "--standalone": "nothing: one machine is the default",
             "--monitor-interval": "nothing: a rank's failure is told as it happens "
                                   "(--grace S: how long a failed job has to end)",
             "--start-method": "nothing: mpiexec starts each process",
             "--role": "nothing: every process runs PROG",
             "--tee": _LINES,
             "-t": _LINES,
             "--redirects": _LINES,
             "-r": _LINES,
             "--local-ranks-filter": _LINES,
             "--logs-specs": "--log-dir DIR (DIR/attemptA/rankR.log)",
             "--no-python": "PROG as it is (only a PROG ending in .py, or python ..., "
                            "runs under Python)",
             "--run-path": "PROG.py (a .py PROG runs as `python PROG.py` runs it)",
             "-m": "PROG python -m MODULE (python runs the module)",
             "--module": "PROG python -m MODULE (python runs the module)"}


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
        usage="gpukv run [-n N] [--hosts H1,H2,...] [--ppn K] [--grace S] [--log-dir DIR] "
              "[--verbose] [--max-restarts K [--min-workers M] [--probe-timeout S]] "
              "[MPIEXEC OPTIONS] PROG [ARGS]",
        epilog="Example: gpukv run -n 4 --hosts 198.18.0.2,198.18.0.3 --ppn 2 "
               "--max-restarts 3 --min-workers 2 --log-dir logs train.py")
    parser.add_argument("-n", "-np", dest="n", type=_count,
                        help="number of processes (default: this machine's GPUs, else 1, "
                             "on each host; torchrun's --nproc-per-node gpu)")
    parser.add_argument("--hosts", "-hosts", type=_hosts,
                        help="hosts to run on (names or addresses); the ranks report to "
                             "the address of this machine that routes to the first remote one")
    parser.add_argument("--ppn", "-ppn", type=_count, help="processes per host")
    parser.add_argument("--grace", type=_seconds, default=GRACE,
                        help=f"seconds mpiexec has to end a failed or interrupted job "
                             f"before it is killed (default {GRACE:g})")
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="also write each rank's lines to DIR/attemptA/rankR.log "
                             "(torchrun's --log-dir with --tee)")
    parser.add_argument("--verbose", action="store_true",
                        help=f"show mpiexec's own messages, MPI's Abort banners and whole "
                             f"tracebacks (also {run_rank.VERBOSE_ENV}=1)")
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


def _mistaken_option(theirs: list[str]) -> str | None:
    """What is wrong with an option meant for this command that would go to mpiexec (a
    typo of one of ours, torchrun's own, `-n4` for `-n 4`), or None. Other options go
    to mpiexec as they are, which judges them."""
    ours = sorted(o for o in _OURS_WITH_VALUE | _OURS_FLAGS if o.startswith("--"))
    for word in theirs:
        name = word.split("=")[0]
        if not name.startswith("-") or name in _MPIEXEC_VALUES:
            continue
        instead = _TORCHRUN.get(name.replace("_", "-"))
        if instead is not None:
            return f"{name} is torchrun's option; gpukv run takes {instead}"
        if name.replace("_", "-") in ours:
            return f"unknown option {name}: did you mean {name.replace('_', '-')}?"
        if re.fullmatch(r"-n(p)?\d+", word):
            return f"{word}: write -n {word.lstrip('-np')} (a space between)"
        close = difflib.get_close_matches(name, ours, n=1, cutoff=0.8)
        if close and name.startswith("--"):
            return f"unknown option {name}: did you mean {close[0]}?"
    return None


def split(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """`argv` as (this command's options, mpiexec's other options, PROG and its ARGS)."""
    ours_with_value, ours_flags = _OURS_WITH_VALUE, _OURS_FLAGS
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
        elif word.split("=")[0] in ours_with_value or word in ours_flags:
            ours.append(word)
            i += 1
        else:
            step = 1 + _MPIEXEC_VALUES.get(word, 0)
            theirs += argv[i:i + step]
            i += step
    return ours, theirs, argv[i:]


def gpus_here(env=None, timeout: float = GPU_QUERY_TIMEOUT) -> int:
    """The GPUs a process of this machine sees: as many as CUDA_VISIBLE_DEVICES names (up to
    its first entry that is not one: empty or negative), else the lines `nvidia-smi -L`
    lists; 0 when neither says (no CuPy nor torch is imported)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            count += 1
        return count
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL, env=dict(env))
    except (OSError, subprocess.SubprocessError):
        return 0
    if listed.returncode:
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def resolve_program(command: list[str]) -> list[str]:
    """PROG and its ARGS as the ranks run them: a bare `python`/`python3` is this Python;
    ArgumentError when PROG (or the script `python` is given) is not there."""
    prog = command[0]
    if prog in PYTHONS:
        command = [sys.executable, *command[1:]]
        script = command[1] if len(command) > 1 and not command[1].startswith("-") else None
        if script is not None and not os.path.isfile(script):
            raise ArgumentError(f"PROG {prog} {script!r}: no such file")
    elif prog.endswith(".py"):
        if not os.path.isfile(prog):
            raise ArgumentError(f"PROG {prog!r}: no such file")
    elif shutil.which(prog) is None:
        raise ArgumentError(f"PROG {prog!r}: no such program")
    return command


def find_mpiexec() -> str | None:
    """The mpiexec beside this interpreter (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.is_file() else shutil.which("mpiexec")


def is_open_mpi(mpiexec: str) -> bool:
    """Whether `mpiexec` is Open MPI's (whose options are not MPICH's Hydra's), by what
    its --version prints."""
    try:
        said = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    text = said.stdout + said.stderr
    return "Open MPI" in text or "OpenRTE" in text


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


#: the math libraries' thread counts, set to 1 when several processes share a host and the
#: user set none (torchrun sets OMP_NUM_THREADS so): each would start a thread per core
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_env(per_host: int) -> dict[str, str]:
    """{variable: '1'} for the THREAD_VARIABLES not set here (or set blank), with
    `per_host` processes on a host; {} for one process a host."""
    if per_host <= 1:
        return {}
    return {v: "1" for v in THREAD_VARIABLES if not os.environ.get(v, "").strip()}


def _note(text: str) -> None:
    sys.stderr.write(f"gpukv run: {text}\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    """Parse, check, start and watch; the exit status."""
    parser = _parser()
    ours, theirs, command = split(list(argv))
    mistaken = _mistaken_option(theirs)
    if mistaken:
        parser.error(mistaken)
    args = parser.parse_args(ours)
    if not command:
        taken = [h for h in args.hosts or [] if h.endswith(".py")]
        parser.error("PROG missing: name the program to run" + (
            f" (--hosts took {taken[0]!r}: it takes H1,H2,...)" if taken else ""))
    mpiexec = find_mpiexec()
    if mpiexec is None:
        parser.error("no mpiexec found beside this Python nor on PATH "
                     "(pip install 'gpukv[mpi]', which brings MPICH's, or install MPICH)")
    try:
        command = resolve_program(command)
    except ArgumentError as exc:
        parser.error(str(exc))
    try:
        verbose = run_rank.verbose() or args.verbose
    except ArgumentError as exc:
        parser.error(str(exc))
    prefixed = [o for o in theirs if o in output.PREFIXING_OPTIONS]
    if args.log_dir is not None and prefixed:
        parser.error(f"--log-dir needs the ranks' lines, which {prefixed[0]} leaves to "
                     f"mpiexec: give one of them")
    files = hostfile.given(theirs)
    named = (["--hosts"] if args.hosts else []) + [f"{o} {f}" for o, f in files]
    if len(named) > 1:
        parser.error(f"the hosts are given more than once ({', '.join(named)}): give one "
                     f"of --hosts, {', '.join(hostfile.OPTIONS)}")
    hosts = args.hosts
    if files and (args.max_restarts or args.n is None):  # read: restarts, -n's default
        try:
            hosts = hostfile.read(files[0][1])
        except ArgumentError as exc:
            parser.error(str(exc))
    if args.n is None:  # torchrun's --nproc-per-node gpu, on each host
        per_host = args.ppn or max(1, gpus_here())
        args.n = per_host * (len(hosts) if hosts else 1)
        if hosts:
            args.ppn = per_host
    min_workers = args.n if args.min_workers is None else args.min_workers
    if args.min_workers is not None and not args.max_restarts:
        parser.error("--min-workers counts the processes a restart may go on with: it "
                     "needs --max-restarts K")
    if min_workers > args.n:
        parser.error(f"--min-workers {min_workers} is more than the -n {args.n} processes")
    if args.log_dir is not None:
        try:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--log-dir {str(args.log_dir)!r} cannot be made: "
                         f"{exc.strerror or exc}")
    if is_open_mpi(mpiexec):  # asked last: the other usage errors need no process
        parser.error(f"{mpiexec} is Open MPI's mpiexec; gpukv run drives MPICH's (pip "
                     f"install mpich into this environment, with mpi4py built for it), or "
                     f"start the job with Open MPI's mpiexec yourself")
    plan = restarts.Plan(args.n, hosts, args.ppn, min_workers, args.max_restarts)
    threads = thread_env(args.ppn or -(-args.n // (len(hosts) if hosts else 1)))
    if threads and verbose:  # quiet otherwise, as the rest of the launcher's own words
        _note(f"{', '.join(f'{v}=1' for v in threads)} in every process (more than one "
              f"runs on a host: their math libraries would overload its cores, as torchrun "
              f"says); set them to choose")

    def start(attempt: int, n: int, hosts: list[str] | None) -> restarts.Outcome:
        options = ["-n", str(n)]
        passed = theirs
        if hosts and (attempt or not files):
            options += ["-hosts", ",".join(hosts)]
            passed = hostfile.without(theirs)  # a restart runs on the hosts that answer
        if args.ppn:
            options += ["-ppn", str(args.ppn)]
        head = [mpiexec, *options, *passed]
        job = Job([*head, *command], report_address(hosts), args.grace,
                  {**restarts.attempt_env(attempt, args.max_restarts), **threads},
                  announce=not args.max_restarts, program_at=len(head), processes=n,
                  verbose=verbose, log_dir=args.log_dir and args.log_dir / f"attempt{attempt}")
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
    the lines that say why the job ended go to stderr (else only to `reason`).

    With `program_at` (where PROG starts in `command`) each rank runs PROG through
    `run_rank` (torchrun's variables, its start and end told), and its lines come out after
    `[R] ` (unless mpiexec is asked to prefix them itself); `processes`: the ranks, for the
    line after Ctrl-C where no rank said it started; `verbose`: mpiexec's own words and
    whole tracebacks shown; `log_dir`: the attempt's folder for the ranks' files.
    """

    def __init__(self, command: list[str], address: str, grace: float,
                 env: dict[str, str] | None = None, announce: bool = True, *,
                 program_at: int | None = None, processes: int | None = None,
                 verbose: bool = False, log_dir: Path | None = None):
        self.token: str | None = None
        if program_at is not None:
            head, program = command[:program_at], command[program_at:]
            extra = []
            if not any(o in output.PREFIXING_OPTIONS for o in head):
                self.token = output.new_token()
                extra += ["-prepend-pattern", output.pattern(self.token)]
            if "-print-all-exitcodes" not in head:
                extra.append("-print-all-exitcodes")  # how each rank ended
            command = [*head, *extra, sys.executable, "-m", "gpukv.launcher.run_rank",
                       *program]
        self.command = command
        self.address = address
        self.grace = grace
        self.extra_env = dict(env or {})
        if verbose:
            self.extra_env[run_rank.VERBOSE_ENV] = "1"
        self.announce = announce
        self.verbose = verbose
        self.processes = processes
        if log_dir is not None:
            try:
                log_dir.mkdir(parents=True, exist_ok=True)
                output.start_logs(log_dir, processes)
            except OSError as exc:
                sys.stderr.write(f"gpukv run: --log-dir: {log_dir}: {exc.strerror or exc}\n")
                log_dir = None
        self.console = output.Console(verbose, log_dir)
        self.reason: str | None = None  # the words of the lines said
        self.failures: list[run_report.Report] = []  # every rank's report of a failure
        self.started: dict[int, run_report.Started] = {}
        self.ended: list[run_report.Ended] = []  # in the order they came
        self.says: set[int] = set()  # ranks whose program says how it ends
        self.done: set[int] = set()  # ranks whose program said it ended cleanly
        #: rank -> when its process's end came without its program's word yet
        self.unsaid: dict[int, float] = {}
        self.said = failures.MpiexecWords()
        self.first: list[run_report.Report] | str | None = None  # what failed first
        self.exited_badly = False  # mpiexec ended non-zero (its words may still come)
        self.signal: int | None = None
        self.running_at_signal = 0
        self.failed_at_signal = 0  # the reports of failures that came before the signal
        self.deadline: float | None = None  # when the job is ended by force
        self.process: subprocess.Popen | None = None
        self._streams: dict[int, tuple[int, output.Demux]] = {}  # fd -> (1 or 2, demux)
        self._reports: socket.socket | None = None  # the ranks' reports, while they come
        self._guard: guard.Guard | None = None

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        process_tree.adopt_orphans()
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as reports:
            reports.bind((self.address, 0))
            reports.setblocking(False)
            self._reports = reports
            port = reports.getsockname()[1]
            where = f"[{self.address}]" if family == socket.AF_INET6 else self.address
            left_before = leftovers.present()
            # forked before the handlers are set and before mpiexec starts (it holds none
            # of the job's pipes); it ends the job should this process end first
            self._guard = guard.Guard(left_before)
            env = {**os.environ, **self.extra_env, **self._guard.env,
                   run_report.ENV: f"{where}:{port}"}
            handlers = {s: signal.signal(s, self._on_signal) for s in process_tree.ending()}
            try:
                self.process = subprocess.Popen(
                    self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True,
                    # mpiexec is killed with this process (its proxies then kill the ranks)
                    preexec_fn=process_tree.die_with_parent(signal.SIGKILL))
                assert self.process.stdout is not None and self.process.stderr is not None
                for number, stream in ((1, self.process.stdout), (2, self.process.stderr)):
                    self._streams[stream.fileno()] = (number, output.Demux(self.token))
                status = self._watch(reports)
            finally:
                if self.process is not None:
                    self._end_all()
                    # what the job's processes wrote as they ended (a rank's abort banner
                    # under load may come after mpiexec's exit): read before concluding
                    self._drain(TERM_WAIT)
                    removed = leftovers.remove_new(left_before)
                    if removed and self.verbose:
                        _note(f"removed {len(removed)} file(s) MPICH left on this host "
                              f"(shared memory and topology of ranks that ended without "
                              f"MPI_Finalize)")
                self._guard.release()
                self._finish_output()
                self._reports = None  # (closed with this block)
                for s, handler in handlers.items():
                    signal.signal(s, handler)
        return self._conclude(status)

    def _watch(self, reports: socket.socket) -> int | None:
        """Forward the output and read the reports until mpiexec ends or is overdue;
        mpiexec's status (None: overdue)."""
        assert self.process is not None
        with selectors.DefaultSelector() as selector:
            selector.register(reports, selectors.EVENT_READ)
            for fd in self._streams:
                selector.register(fd, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select(timeout=0.1):
                    if key.fileobj is reports:
                        self._read_reports(reports)
                    elif not self._forward(key.fd):
                        selector.unregister(key.fd)
                self._check_unsaid()
                status = self.process.poll()
                if status is not None:
                    break
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    status = None
                    break
        if status is not None:
            self._drain(TERM_WAIT)  # mpiexec's box and exit codes may follow its exit
        self._read_reports(reports)  # those that came with mpiexec's exit
        self._check_unsaid(0.0)  # (mpiexec may have ended a job a rank left wordless)
        if status and self.first is None:  # ended badly, no word yet on why
            self._await_ends(reports, TERM_WAIT)
        self.exited_badly = bool(status)
        return status

    def _await_ends(self, reports: socket.socket, seconds: float) -> None:
        """Read reports until every rank that started has its end reported (which rank
        ended first names the failure), up to `seconds`."""
        end = time.monotonic() + seconds
        with selectors.DefaultSelector() as selector:
            selector.register(reports, selectors.EVENT_READ)
            while set(self.started) - {e.rank for e in self.ended}:
                left = end - time.monotonic()
                if left <= 0:
                    break
                if selector.select(timeout=left):
                    self._read_reports(reports)

    def _read_reports(self, reports: socket.socket | None = None) -> None:
        reports = reports or self._reports
        if reports is None:
            return
        found = []
        while True:
            try:
                data = reports.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # an ICMP error of an earlier send: nothing to read
                continue
            report = run_report.parse(data)
            if isinstance(report, run_report.Started):
                self.started[report.rank] = report
            elif isinstance(report, run_report.Says):
                self.says.add(report.rank)
            elif isinstance(report, run_report.Done):
                self.done.add(report.rank)
            elif isinstance(report, run_report.Execs):
                self.says.discard(report.rank)
            elif isinstance(report, run_report.Ended):
                self.ended.append(report)
                if report.rank in self.says:
                    self.unsaid.setdefault(report.rank, time.monotonic())
            elif report is not None:
                found.append(report)
        self.failures += found
        if found and self._failing(found):
            self._end_soon()

    def _said_its_end(self, rank: int) -> bool:
        """Whether `rank`'s program said how it ended: done, or a failure report."""
        return rank in self.done or any(r.rank == rank for r in self.failures)

    def _check_unsaid(self, wait: float = WORD_WAIT) -> None:
        """A rank whose program said it would say how it ends, whose process ended
        without a word after `wait` seconds (`os._exit`, a crash in native code) has
        failed: mpiexec may leave the others waiting on it until their timeout, or end
        them and say nothing (the rank's status 0)."""
        now = time.monotonic()
        for rank, since in list(self.unsaid.items()):
            if self.first is not None or self.signal is not None:
                return  # the job is being ended: its ranks end without a word
            if self._said_its_end(rank):
                del self.unsaid[rank]
            elif now - since >= wait:
                del self.unsaid[rank]
                report = run_report.Report(rank, None, _ENDED_WORDLESS, _WORDLESS)
                self.failures.append(report)
                if self._failing([report]):
                    self._end_soon()

    def _forward(self, fd: int) -> bool:
        """Write the lines of what mpiexec wrote to `fd`; whether there may be more."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            chunk = b""
        number, demux = self._streams[fd]
        self._write(demux.feed(chunk) if chunk else demux.flush(), number)
        return bool(chunk)

    def _write(self, lines: list[output.Line], number: int) -> None:
        for line in lines:
            text = line.text.decode(errors="replace")
            codes = line.rank is None and self.said.more_codes(text)
            if not codes and output.about_the_ends(text) and self.said.read(text):
                self._read_reports()  # (an end without a word may be what mpiexec saw)
                if self._failing(_BOX):
                    self._end_soon()
            self.console.write(line, number, self.first is not None or self.signal is not None
                               or self.exited_badly, about_ends=codes)

    def _finish_output(self) -> None:
        for number, demux in self._streams.values():
            self._write(demux.flush(), number)
        self.console.finish()

    # ------------------------------------------------------------ failures, signals
    def _failing(self, what: list[run_report.Report] | str) -> bool:
        """Record what failed first (reports, or mpiexec's box); whether it was first."""
        if self.first is not None or self.signal is not None:
            return False
        self.first = what
        return True

    def _end_soon(self) -> None:
        """mpiexec has the grace to end the job; then it is ended by force."""
        if self.process is not None and self.process.poll() is None:
            self.deadline = min(self.deadline or math.inf, time.monotonic() + self.grace)

    def _on_signal(self, signum: int, _frame) -> None:
        if self.signal is not None:  # a second one: no more waiting
            self.deadline = time.monotonic()
            return
        self.signal = signum
        self.failed_at_signal = len(self.failures)
        ended = {e.rank for e in self.ended}
        self.running_at_signal = (len(set(self.started) - ended) if self.started
                                  else self.processes or 0)
        if self.process is not None:  # (a hang-up as SIGTERM: mpiexec ends the job on it)
            process_tree.signal_all([self.process.pid], signal.SIGTERM
                                    if signum == signal.SIGHUP else signum)
        self._end_soon()

    def _conclude(self, status: int | None) -> int:
        """Say why the job ended (one line per failed rank, then the signal's, if any); its
        status (the signal's, when one came)."""
        if self.signal is not None:
            # a failure before the signal keeps its lines (a signal in the grace)
            lines = [] if self.first is None else self._failed(status)
            name = _SIGNALLED.get(self.signal,
                                  f"terminated ({signal.Signals(self.signal).name})")
            count = self.running_at_signal
            self._say([line.words for line in lines]
                      + [f"{name}: ended {count} process{'' if count == 1 else 'es'}"])
            return 128 + self.signal
        if self.first is None:
            assert status is not None
            if not status:
                return 0
        lines = self._failed(status)
        self._say([line.words for line in lines])
        known = [line.status for line in lines if line.status]
        return (known[0] if known else 1) & 0xFF or 1

    def _failed(self, status: int | None) -> list[failures.Failure]:
        """The lines of the failed ranks, the first first."""
        if self.first is None:
            # no report and no box (all of mpiexec's output is in by now, its last lines
            # too): the rank its exit codes say failed, else the first to end, and its status
            assert status is not None
            return [failures.of_silence(status if status > 0 else 128 - status,
                                        self.started, self.ended, self.said, self.done)]
        if isinstance(self.first, str) or (
                self._first_was_wordless() and self.said.abort is not None):
            # mpiexec's word; or a rank ended without one, then MPI's banner named the rank
            # that called MPI_Abort (the proxy ends every rank at once on an abort: the one
            # that aborted may not be the first whose end was reported)
            wordless = {e.rank for e in self.ended
                        if e.rank in self.says and not self._said_its_end(e.rank)}
            return [failures.of_mpiexec(self.said, self.started, self.ended, wordless)]
        if self._first_was_wordless() and status and status > 0 and self.signal is None:
            # a rank ended without a word and mpiexec ended the job itself with a status
            # of its own (an MPI_Abort's code, its banner lost with the proxy): that status
            return [failures.of_silence(status, self.started, self.ended)]
        reports = self.failures
        if self.signal is not None:  # what the signal made the others say is no failure
            before = self.failures[:self.failed_at_signal]
            failed = {r.rank for r in before}
            reports = before + [r for r in self.failures[self.failed_at_signal:]
                                if r.rank is not None and r.rank in failed]
        # every report, the first ones first: the later ones of the grace too
        return failures.of_reports(reports, self.started)

    def _first_was_wordless(self) -> bool:
        """Whether what failed first was only ranks' ends without a word (`_check_unsaid`)."""
        return isinstance(self.first, list) and all(
            r.what == _ENDED_WORDLESS for r in self.first)

    def _say(self, lines: list[str]) -> None:
        self.reason = "; ".join(lines)
        if self.announce:
            try:
                for line in lines:
                    sys.stderr.write(f"gpukv run: {line}\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # a terminal that hung up: the status says it
                pass

    # ------------------------------------------------------------------- the end
    def _end_all(self) -> None:
        """SIGTERM, then SIGKILL, to every process of the job still there."""
        assert self.process is not None
        pgid = self.process.pid
        for signum, wait in ((signal.SIGTERM, TERM_WAIT), (signal.SIGKILL, TERM_WAIT)):
            living, _ = self._descendants()
            if not living and self.process.poll() is not None:
                break
            process_tree.signal_group(pgid, signum)
            process_tree.signal_all(living, signum)
            end = time.monotonic() + wait
            while time.monotonic() < end:
                self.process.poll()
                living, zombies = self._descendants()
                process_tree.reap([z for z in zombies if z != self.process.pid])
                if not living:
                    break
                time.sleep(0.02)
        self.process.wait(timeout=TERM_WAIT)
        self._drain(0)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()

    def _descendants(self) -> tuple[list[int], list[int]]:
        """This process's living descendants but the guard (it goes once told), and its
        children that are zombies to reap."""
        living, zombies = process_tree.descendants(os.getpid())
        keep = self._guard.pid if self._guard is not None else None
        return [p for p in living if p != keep], [z for z in zombies if z != keep]

    def _drain(self, seconds: float) -> None:
        """Forward what is left of mpiexec's output, waiting for more up to `seconds`
        (a process the job left behind may hold a pipe open)."""
        end = time.monotonic() + seconds
        with selectors.DefaultSelector() as selector:
            for fd in self._streams:
                try:
                    selector.register(fd, selectors.EVENT_READ)
                except (ValueError, OSError):  # closed already
                    continue
            while selector.get_map():
                ready = selector.select(timeout=max(0.0, end - time.monotonic()))
                if not ready:
                    break
                for key, _ in ready:
                    if not self._forward(key.fd):
                        selector.unregister(key.fd)

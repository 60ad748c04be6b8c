"""`gpukv run` (gpukv/launcher/launch.py): a job that ends by itself keeps mpiexec's
status and output; a failed process, a rank's PeerError or uncaught exception, and Ctrl-C
end every process of the job within the grace and a few seconds, even where mpiexec would
wait or hang; usage errors start nothing. The jobs are tests/distributed/programs/launched.py.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpukv._errors import ArgumentError
from gpukv.launcher import (
    host_probe,
    hostfile,
    launch,
    leftovers,
    process_tree,
    restarts,
    run_report,
)

from ..distributed.mpirun import PROGRAMS, dies_with_us, require_mpi, run

GRACE = 2.0
#: seconds allowed past grace + TERM_WAIT for the launcher to notice, kill and reap
SLACK = 3.0
REPO = Path(__file__).resolve().parents[2]
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def _launch(mode: str, folder: Path, n: int = 3, env: dict | None = None,
            options: tuple[str, ...] = ()) -> subprocess.Popen:
    """`python -m gpukv run -n N --grace GRACE OPTIONS launched.py MODE FOLDER`, started."""
    require_mpi()
    full_env = {**os.environ, "GPUKV_DIST_TIMEOUT": "30", **(env or {})}
    command = [sys.executable, "-m", "gpukv", "run", "-n", str(n), "--grace", str(GRACE),
               *options, str(PROGRAMS / "launched.py"), mode, str(folder)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=full_env,
                            start_new_session=True, preexec_fn=dies_with_us())


def _finish(launcher: subprocess.Popen, limit: float = 90) -> tuple[int, str, str, float]:
    """Status, stdout, stderr and the time the launcher ended; fails (killing the launcher
    and every process under it) when it runs past `limit` seconds."""
    try:
        out, err = launcher.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process_tree.signal_all(process_tree.descendants(launcher.pid)[0], signal.SIGKILL)
        os.killpg(launcher.pid, signal.SIGKILL)
        out, err = launcher.communicate()
        pytest.fail(f"gpukv run did not end within {limit} s\nstdout:\n{out}\nstderr:\n{err}")
    return launcher.returncode, out, err, time.time()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has ended; its reaper is elsewhere


def _left(folder: Path, n: int, attempt: int = 0) -> list[int]:
    """The pids of the job's ranks (of that attempt) still running (after a moment for the
    last to go)."""
    pattern = "rank-*.pid" if attempt == 0 else f"attempt-{attempt}-rank-*.pid"
    pids = [int(p.read_text()) for p in sorted(folder.glob(pattern))]
    assert len(pids) == n, f"only {len(pids)} of {n} ranks started"
    end = time.monotonic() + 1
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _made_before(path: Path, when: float) -> bool:
    try:
        return path.stat().st_ctime <= when
    except OSError:  # removed meanwhile
        return False


def _said(err: str) -> list[str]:
    """The launcher's lines about the job (without --verbose's notes on math threads and
    on the files MPICH left)."""
    return [line for line in err.splitlines() if line.startswith("gpukv run:")
            and "_NUM_THREADS=1" not in line and "MPICH left on this host" not in line]


def _names(folder: Path, rank: int, attempt: int = 0) -> str:
    """How a failure line names `rank` of the job's attempt (the pid it wrote)."""
    name = f"rank-{rank}.pid" if attempt == 0 else f"attempt-{attempt}-rank-{rank}.pid"
    pid = (folder / name).read_text()
    return f"rank {rank} (local rank {rank}) on host {socket.gethostname()}, pid {pid}: "


def test_leftovers_removed_are_the_new_ones_no_process_holds(tmp_path, monkeypatch):
    """Of the files in MPICH's places, an attempt removes those that appeared while it ran
    and that no process has open or mapped: a running job's are held, older ones kept."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(leftovers, "PLACES", ((shm, "mpich_shm_*"),
                                              (tmp, "hydra_hwloc_xmlfile_*")))
    old = shm / "mpich_shm_old_0"
    old.write_bytes(b"\0" * 4096)
    before = leftovers.present()
    assert before == {old}
    left = [shm / "mpich_shm_ab_0", tmp / "hydra_hwloc_xmlfile_Ab12Cd"]
    opened, mapped = shm / "mpich_shm_cd_0", shm / "mpich_shm_ef_0"
    for path in (*left, opened, mapped):
        path.write_bytes(b"\0" * 4096)
    (shm / "other_file").write_bytes(b"")
    # one process holds a file open, another only has one mapped (its fd closed)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import mmap, sys, time\n"
         "f = open(sys.argv[1], 'rb')\n"
         "g = open(sys.argv[2], 'r+b'); m = mmap.mmap(g.fileno(), 0); g.close()\n"
         "print('ready', flush=True); time.sleep(60)", str(opened), str(mapped)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        removed = leftovers.remove_new(before)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(removed) == sorted(left)
    assert sorted(p.name for p in shm.iterdir()) == ["mpich_shm_cd_0", "mpich_shm_ef_0",
                                                     "mpich_shm_old_0", "other_file"]
    assert not list(tmp.iterdir())
    assert leftovers.remove_new(leftovers.present()) == []


@pytest.mark.mpi
def test_a_clean_job_returns_zero_and_its_output(tmp_path):
    """A job whose ranks all end well: status 0, every rank's output, no line of ours."""
    status, out, err, _ = _finish(_launch("clean", tmp_path))
    assert status == 0, err
    # (the ranks write at once: their lines may run into each other)
    assert sorted(re.findall(r"rank \d of 3 ran", out)) == [
        f"rank {r} of 3 ran" for r in range(3)], out
    assert not _said(err), err
    assert not _left(tmp_path, 3)


@pytest.mark.mpi
@pytest.mark.parametrize("mode,status,says", [
    ("raise", 1, "uncaught ValueError: rank 1 fails on purpose"),
    ("exit", 3, "exit status 3"),
    ("kill", 9, "killed by signal 9 (SIGKILL)"),
    ("os-exit", 3, "exit status 3 (os._exit)"),
    ("native-exit", 1, "ended without a word: its process ended past Python's own exit"),
])
def test_a_failed_rank_ends_the_job_within_the_grace(tmp_path, mode, status, says):
    """A rank that raises, exits non-zero (by sys.exit or os._exit), is SIGKILLed or ends
    past Python's exit (C's _exit, even with status 0, which mpiexec takes for no
    failure) while the others wait forever: one line names it, and every process is gone
    with the rank's status (1 for an exception, or when none was said) within the grace
    and a few seconds of the failure."""
    before = leftovers.present()
    code, _, err, ended = _finish(_launch(mode, tmp_path))
    failed_at = float((tmp_path / "failed-at").read_text())
    assert code == status, err
    lines = _said(err)
    assert len(lines) == 1 and _names(tmp_path, 1) + says in lines[0], err
    assert ended - failed_at < GRACE + launch.TERM_WAIT + SLACK, err
    assert not _left(tmp_path, 3)
    # what MPICH left of the ended ranks (shared memory, the proxy's topology file) is
    # gone: a new file made before the launcher ended is another job's, held by it
    busy = leftovers.held()
    assert not [p for p in leftovers.present() - before
                if str(p) not in busy and _made_before(p, ended)]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["os-exit", "exec"])
def test_a_clean_end_past_pythons_exit_is_no_failure(mode):
    """Ranks that end by os._exit(0) (to skip a slow teardown) or by exec'ing another
    program that ends well: status 0, no line of ours."""
    require_mpi()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpukv", "run", "-n", "3", "--grace", str(GRACE),
         str(PROGRAMS / "ends_past_python.py"), mode], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
        preexec_fn=dies_with_us())
    status, out, err, _ = _finish(launcher)
    assert status == 0, err
    assert sorted(re.findall(r"rank \d of 3 ran", out)) == [
        f"rank {r} of 3 ran" for r in range(3)], out
    assert not _said(err), err


@pytest.mark.mpi
def test_a_peer_error_then_raised_uncaught_is_one_line_saying_so(tmp_path):
    """A rank's transport reports its PeerError, and the rank ends on it, uncaught, half
    a second later (its second report comes in a later read): one line, the one that
    says the exception ended the rank."""
    code, _, err, _ = _finish(_launch("late-uncaught", tmp_path, n=2,
                                      env={"GPUKV_DIST_TIMEOUT": "2"}))
    assert code == 1, err
    lines = _said(err)
    assert len(lines) == 1 and _names(tmp_path, 0) + "uncaught PeerError: " in lines[0], err
    assert not _left(tmp_path, 2)


@pytest.mark.mpi
def test_every_rank_that_fails_within_the_grace_has_its_line(tmp_path):
    """Two ranks end on exceptions 0.3 s apart: a line for each, the first first."""
    code, _, err, _ = _finish(_launch("two-raise", tmp_path))
    assert code == 1, err
    lines = _said(err)
    assert len(lines) == 2, err
    assert _names(tmp_path, 0) + "uncaught ValueError: rank 0 fails first" in lines[0], err
    assert _names(tmp_path, 2) + "uncaught TypeError: rank 2 fails next" in lines[1], err
    assert not _left(tmp_path, 3)


@pytest.mark.mpi
def test_a_peer_error_ends_a_job_mpiexec_cannot_end(tmp_path):
    """Rank 1 stops its MPI proxy (as if its host were cut off) and ignores SIGTERM; rank 0
    reports its PeerError and then waits forever: mpiexec would never end this job, the
    launcher ends all of it within the grace and a few seconds, with status 1."""
    code, _, err, ended = _finish(_launch("stuck", tmp_path, n=2,
                                          env={"GPUKV_DIST_TIMEOUT": "2"}))
    failed_at = float((tmp_path / "failed-at").read_text())
    assert code == 1, err
    lines = _said(err)
    assert len(lines) == 1 and _names(tmp_path, 0) + "PeerError: " in lines[0], err
    assert ended - failed_at < GRACE + launch.TERM_WAIT + SLACK, err
    assert not _left(tmp_path, 2)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["interrupt", "deaf"])
def test_ctrl_c_ends_every_process_once(tmp_path, mode):
    """SIGINT to the launcher reaches each rank once (through mpiexec); ranks that go on
    regardless are killed after the grace; status 130 and nothing left."""
    launcher = _launch(mode, tmp_path, n=2)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank-*.pid"))) < 2 and time.monotonic() < deadline:
        if launcher.poll() is not None:
            break
        time.sleep(0.05)
    sent = time.time()
    launcher.send_signal(signal.SIGINT)
    code, _, err, ended = _finish(launcher)
    assert code == 130, err
    assert ended - sent < GRACE + launch.TERM_WAIT + SLACK, err
    for rank in range(2):
        heard = (tmp_path / f"rank-{rank}.signals").read_text().split()
        assert heard.count("SIGINT") == 1, (rank, heard)
    assert not _left(tmp_path, 2)


# ------------------------------------------------------------------ usage errors
@pytest.fixture
def nothing_starts(monkeypatch):
    """Makes any process the launcher would start fail the test."""
    def refuse(*args, **kwargs):
        pytest.fail(f"started {args}")
    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("argv,says", [
    (["-n", "0", "prog.py"], "argument -n/-np: expected a positive integer, got '0'"),
    (["-n", "two", "prog.py"], "argument -n/-np: expected a positive integer, got 'two'"),
    (["-n", "2"], "PROG missing"),
    (["-n", "2", "-genv", "A", "B"], "PROG missing"),
    (["-n", "2", "no-such-file.py"], "PROG 'no-such-file.py': no such file"),
    (["-n", "2", "no-such-program-of-gpukv"], "PROG 'no-such-program-of-gpukv': no such"),
    (["-n", "2", "--hosts", "a,,b", "prog.py"], "expected H1,H2,..., got 'a,,b'"),
    (["--max-restart", "1", "-n", "2", "prog.py"],
     "unknown option --max-restart: did you mean --max-restarts?"),
    (["--verbos", "-n", "2", "prog.py"], "unknown option --verbos: did you mean --verbose?"),
    (["--nproc-per-node", "2", "prog.py"],
     "--nproc-per-node is torchrun's option; gpukv run takes -n N"),
    (["--nproc_per_node=2", "prog.py"], "--nproc_per_node is torchrun's option"),
    (["-n2", "prog.py"], "-n2: write -n 2 (a space between)"),
    (["-n", "2", "-m", "gpukv", "demo"],
     "-m is torchrun's option; gpukv run takes PROG python -m MODULE"),
    (["-n", "2", "--min-workers", "1", "prog.py"],
     "--min-workers counts the processes a restart may go on with: it needs --max-restarts K"),
    (["-n", "2", "--hosts", "prog.py"],
     "PROG missing: name the program to run (--hosts took 'prog.py': it takes H1,H2,...)"),
    (["-n", "2", "--grace", "-1", "prog.py"], "expected seconds >= 0, got '-1'"),
    (["-n", "2", "--max-restarts", "-1", "prog.py"],
     "argument --max-restarts: expected a whole number >= 0, got '-1'"),
    (["-n", "2", "--max-restarts=two", "prog.py"],
     "argument --max-restarts: expected a whole number >= 0, got 'two'"),
    (["-n", "2", "--min-workers", "0", "prog.py"],
     "argument --min-workers: expected a positive integer, got '0'"),
    (["-n", "2", "--max-restarts", "1", "--min-workers", "3", "prog.py"],
     "--min-workers 3 is more than the -n 2 processes"),
    (["-n", "2", "--probe-timeout", "0", "prog.py"],
     "argument --probe-timeout: expected seconds > 0, got '0'"),
    (["-n", "2", "--hosts", "a,b", "-f", "hosts.txt", "prog.py"],
     "the hosts are given more than once (--hosts, -f hosts.txt): give one of --hosts, -f, "
     "-hostfile, -machinefile"),
    (["-n", "2", "-hostfile", "hosts.txt", "-machinefile", "hosts.txt", "prog.py"],
     "the hosts are given more than once (-hostfile hosts.txt, -machinefile hosts.txt)"),
    (["-n", "2", "--max-restarts", "1", "-f", "missing.txt", "prog.py"],
     "host file 'missing.txt' cannot be read: No such file or directory"),
    (["-n", "2", "--max-restarts", "1", "-machinefile", "empty.txt", "prog.py"],
     "host file 'empty.txt' names no host"),
    (["-n", "2", "--max-restarts", "1", "-hostfile", "hosts.txt", "prog.py"],
     "host file 'hosts.txt', line 2: expected HOST or HOST:N (N >= 1 slots), got 'b:x'"),
])
def test_usage_errors_start_nothing(argv, says, capsys, nothing_starts, tmp_path,
                                    monkeypatch):
    """Bad counts, hosts, grace or restart options, hosts given twice (mpiexec refuses
    them), a host file a restart cannot read, and a missing PROG: status 2 and the problem
    named."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.py").write_text("")
    (tmp_path / "hosts.txt").write_text("a\nb:x\n")
    (tmp_path / "empty.txt").write_text("# nobody\n")
    with pytest.raises(SystemExit) as exc:
        launch.main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("value", ["false", "yes", "2"])
def test_a_malformed_verbose_setting_is_a_usage_error(value, capsys, nothing_starts,
                                                      tmp_path, monkeypatch):
    """GPUKV_RUN_VERBOSE takes 1 or 0: 'false' must not turn every line on, nor any other
    word be guessed at. Status 2, naming it, with or without --verbose."""
    monkeypatch.setenv("GPUKV_RUN_VERBOSE", value)
    (tmp_path / "prog.py").write_text("")
    for verbose in ([], ["--verbose"]):
        with pytest.raises(SystemExit) as exc:
            launch.main([*verbose, "-n", "2", str(tmp_path / "prog.py")])
        assert exc.value.code == 2
        assert f"GPUKV_RUN_VERBOSE={value!r}: expected 1 (on) or 0 (off)" in \
            capsys.readouterr().err


def test_no_mpiexec_is_a_usage_error(capsys, nothing_starts, tmp_path, monkeypatch):
    """Without an mpiexec beside this Python nor on PATH: status 2, saying how to get one."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        launch.main(["-n", "2", "/bin/true"])
    assert exc.value.code == 2
    assert "no mpiexec found" in capsys.readouterr().err


def test_open_mpis_mpiexec_is_a_usage_error(capsys, tmp_path, monkeypatch):
    """Open MPI's mpiexec (found on PATH) takes other flags than MPICH's: status 2, naming
    it, before the job starts (asking its version is all it runs)."""
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.6'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        launch.main(["-n", "2", "/bin/true"])
    assert exc.value.code == 2
    assert f"{fake} is Open MPI's mpiexec; gpukv run drives MPICH's" in \
        capsys.readouterr().err


def test_mpiexec_options_before_prog_pass_through():
    """Options of mpiexec (with their values) stay before PROG; PROG's own go after it."""
    argv = ["-n", "2", "-genv", "A", "1", "-l", "--grace=1", "train.py", "-n", "5"]
    assert launch.split(argv) == (["-n", "2", "--grace=1"], ["-genv", "A", "1", "-l"],
                                  ["train.py", "-n", "5"])


@pytest.mark.parametrize("option", ["-usize", "-localhost", "-membind", "-topolib",
                                    "-nameserver", "-rankmap", "-order-nodes",
                                    "-memory-alloc-kinds"])
def test_every_mpiexec_option_with_a_value_keeps_it(option):
    """MPICH's mpiexec options that take a value (`mpiexec -h`) take it along: the value
    is not taken for PROG."""
    assert launch.split(["-n", "2", option, "x", "train.py"]) == (
        ["-n", "2"], [option, "x"], ["train.py"])


def test_help_says_what_is_watched_and_the_bound():
    """`gpukv run --help` names what the launcher watches and how long an end can take."""
    done = subprocess.run([sys.executable, "-m", "gpukv", "run", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for words in ("PeerError", "uncaught exception", "non-zero exit", "ended badly",
                  "grace + 1 s", "SIGKILL", "Ctrl-C", "130", "--max-restarts K",
                  "--min-workers", "GPUKV_RUN_ATTEMPT", "last attempt's"):
        assert words in " ".join(done.stdout.split()), words


# ---------------------------------------------------------------------- restarts
def _attempts(err: str) -> list[str]:
    return [line for line in _said(err) if line.startswith("gpukv run: attempt ")]


def _seconds_between(folder: Path, first: str, then: str) -> float:
    return float((folder / then).read_text()) - float((folder / first).read_text())


@pytest.mark.mpi
@pytest.mark.parametrize("mode,says", [
    ("exit-once", "exit status 3"),
    ("kill-once", "killed by signal 9 (SIGKILL)"),
])
def test_a_job_that_fails_once_is_restarted(tmp_path, mode, says):
    """Rank 1 exits 3 (or is SIGKILLed) on the first attempt: the job starts again on this
    machine with as many processes, which see GPUKV_RUN_ATTEMPT 1, complete, and status 0;
    one line per attempt, and no process of either is left."""
    code, out, err, _ = _finish(_launch(mode, tmp_path, options=("--max-restarts", "2")))
    assert code == 0, err
    assert sorted(re.findall(r"rank \d of 3 ran in attempt 1 of at most 2 restarts", out)) == [
        f"rank {r} of 3 ran in attempt 1 of at most 2 restarts" for r in range(3)], out
    assert _said(err) == _attempts(err), err  # no other line of ours
    first, second = _attempts(err)
    assert re.fullmatch(r"gpukv run: attempt 0 \(3 processes on this machine\) ended after "
                        r"\d+\.\d s: (.*); restarting with 3 processes on this machine "
                        r"\(restart 1 of at most 2\)", first), first
    assert _names(tmp_path, 1) + says in first, first
    assert re.fullmatch(r"gpukv run: attempt 1 \(3 processes on this machine\) ended after "
                        r"\d+\.\d s: every process ended well; done", second), second
    # the launcher waits for nothing but the end of the failed attempt
    gap = _seconds_between(tmp_path, "failed-at", "attempt-1-started")
    print(f"{mode}: failure -> rank 0 of the next attempt running after {gap:.2f} s "
          f"(grace {GRACE:g} s)")
    assert gap < GRACE + launch.TERM_WAIT + SLACK + 5, err
    assert not _left(tmp_path, 3) and not _left(tmp_path, 3, attempt=1)


@pytest.mark.mpi
def test_a_job_that_always_fails_ends_after_the_last_restart(tmp_path):
    """Rank 1 exits 3 on every attempt: 1 + --max-restarts attempts, one line each, the
    last giving up; the status is the last attempt's."""
    code, _, err, _ = _finish(_launch("exit", tmp_path, n=2, options=("--max-restarts", "2")))
    assert code == 3, err
    lines = _attempts(err)
    assert [line.split(" (")[0] for line in lines] == [
        f"gpukv run: attempt {a}" for a in range(3)], err
    assert all(_names(tmp_path, 1, a) + "exit status 3" in line
               for a, line in enumerate(lines)), err
    assert lines[0].endswith("restarting with 2 processes on this machine "
                             "(restart 1 of at most 2)"), lines
    assert lines[2].endswith("; giving up: no restart left (--max-restarts 2)"), lines
    assert (tmp_path / "attempt-2-started").exists()
    assert not _left(tmp_path, 2, attempt=2)


@pytest.mark.mpi
def test_ctrl_c_is_not_followed_by_a_restart(tmp_path):
    """SIGINT under --max-restarts ends the job as without it (status 130) and starts no
    other attempt; its one line says so."""
    launcher = _launch("interrupt", tmp_path, n=2, options=("--max-restarts", "2"))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank-*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    code, _, err, _ = _finish(launcher)
    assert code == 130, err
    lines = _attempts(err)
    assert len(lines) == 1 and lines[0].endswith("; interrupted, not restarting"), err
    assert not (tmp_path / "attempt-1-started").exists()


@pytest.mark.parametrize("n,hosts,ppn,alive,processes", [
    (6, None, None, 0, 6),          # this machine only: always all of them
    (6, ["a", "b", "c"], None, 2, 4),
    (5, ["a", "b", "c"], None, 2, 4),    # 2 a host (rounded up)
    (5, ["a", "b", "c"], None, 1, 2),
    (4, ["a:2", "b:2"], 3, 1, 3),   # --ppn wins
    (4, ["a", "b"], 3, 2, 4),       # never more than -n
    (4, ["a", "b"], None, 0, 0),
])
def test_a_restart_keeps_the_processes_per_host(n, hosts, ppn, alive, processes):
    """A restart on fewer hosts runs --ppn processes a host, else -n spread evenly over the
    first hosts (rounded up), at most -n."""
    plan = restarts.Plan(n, hosts, ppn, 1, 1)
    assert restarts.processes_on(plan, (hosts or [])[:alive]) == processes


@pytest.mark.parametrize("n,hosts,alive,processes", [
    (12, ["a:4", "b:4", "c:4"], ["a:4", "b:4"], 8),
    (6, ["a:4", "b:4", "c:4"], ["b:4", "c:4"], 6),   # -n fits the slots left: all of it
    (6, ["a:4", "b:4", "c:4"], ["c:4"], 4),
    (8, ["a:6", "b:2"], ["b:2"], 2),                 # as many as the host's slots
    (8, ["a:6", "b:2"], ["a:6"], 6),
    (4, ["a:1", "b:1"], ["b:1"], 2),                 # -n past the slots: spread over them
    (4, ["a:2", "b", "c"], ["b", "c"], 2),           # a plain HOST is one slot
])
def test_a_restart_keeps_the_processes_per_slot(n, hosts, alive, processes):
    """Hosts with slots (HOST:N) take -n spread evenly over the slots (rounded up), so a
    restart runs as many processes a slot on the slots of the hosts that answer, at most
    -n."""
    plan = restarts.Plan(n, hosts, None, 1, 1)
    assert restarts.processes_on(plan, alive) == processes


# -------------------------------------------------------------------- host files
@pytest.mark.parametrize("text,entries", [
    ("node1\nnode2:4\n", ["node1", "node2:4"]),
    ("# the rack\n\n  node1:2  \n\t\nnode2 # spare\n#node3\n", ["node1:2", "node2"]),
    ("10.0.0.1:2\nfe80::1", ["10.0.0.1:2", "fe80::1"]),
])
def test_a_host_file_is_read_as_hydra_reads_it(text, entries):
    """One HOST or HOST:N a line, in order; `#` starts a comment, blank lines are ignored."""
    assert hostfile.parse(text, "hosts.txt") == entries


@pytest.mark.parametrize("text,says", [
    ("", "host file 'hosts.txt' names no host"),
    ("# only\n\n   # comments\n", "host file 'hosts.txt' names no host"),
    ("node1\nnode2:0\n",
     "host file 'hosts.txt', line 2: expected HOST or HOST:N (N >= 1 slots), got 'node2:0'"),
    ("node1:two", "line 1: expected HOST or HOST:N (N >= 1 slots), got 'node1:two'"),
    ("node1:", "line 1: expected HOST or HOST:N"),
    (":4", "line 1: expected HOST or HOST:N"),
    ("node1 user=me", "line 1: expected HOST or HOST:N (N >= 1 slots), got 'node1 user=me'"),
])
def test_a_bad_host_file_is_refused(text, says):
    """A host file without a host, or with a line that is not one HOST[:N] (N >= 1), is an
    ArgumentError naming the file and the line."""
    with pytest.raises(ArgumentError) as exc:
        hostfile.parse(text, "hosts.txt")
    assert says in str(exc.value)


def test_the_host_file_options_are_found_and_left_out():
    """-f, -hostfile and -machinefile name a host file; a restart drops them (with their
    file) and keeps mpiexec's other options."""
    theirs = ["-genv", "A", "1", "-f", "h.txt", "-l", "-machinefile", "m.txt"]
    assert hostfile.given(theirs) == [("-f", "h.txt"), ("-machinefile", "m.txt")]
    assert hostfile.without(theirs) == ["-genv", "A", "1", "-l"]


class _FakeJob:
    """Stands for a launcher.Job: records each attempt's mpiexec command, and fails the
    first attempt (rank 1 exiting 3) and ends the others well."""
    commands: list[list[str]] = []

    def __init__(self, command, address, grace, env=None, announce=True, **settings):
        self.command = command
        self.signal = None
        self.reason = None if self.commands else "rank 1: exit status 3"
        self.commands.append(command)

    def run(self) -> int:
        return 3 if self.reason else 0


def _hosts_up_by_name(tmp_path, monkeypatch) -> Path:
    """A launcher exec (HYDRA_LAUNCHER_EXEC) that logs each host asked and reaches those
    named up*, and a stand-in Job recording the commands; the exec's path."""
    fake = tmp_path / "fake-ssh"
    fake.write_text('#!/bin/sh\necho "$1" >> "$0.log"\n'
                    'case "$1" in up*) exit 0 ;; *) exit 255 ;; esac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("HYDRA_LAUNCHER_EXEC", str(fake))
    monkeypatch.setattr(launch, "Job", _FakeJob)
    monkeypatch.setattr(_FakeJob, "commands", [])
    return fake


@pytest.mark.parametrize("option", hostfile.OPTIONS)
def test_a_job_given_a_host_file_restarts_on_the_hosts_that_answer(option, tmp_path,
                                                                   monkeypatch, capsys):
    """A job given a host file runs its first attempt with that file; after a failure each
    host of the file is asked through HYDRA_LAUNCHER_EXEC, and the restart runs with
    `-hosts` of those that answer (slots kept, the file dropped), as many processes a slot
    as before."""
    fake = _hosts_up_by_name(tmp_path, monkeypatch)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# the job's hosts\nup1:2\ndown1:2\n\nup2:2  # last\n")
    status = launch.main(["-n", "6", option, str(hosts), "-l", "--max-restarts", "2",
                          "--min-workers", "4", "true", "arg"])
    assert status == 0
    first, second = _FakeJob.commands
    assert first[1:] == ["-n", "6", option, str(hosts), "-l", "true", "arg"]
    assert second[1:] == ["-n", "4", "-hosts", "up1:2,up2:2", "-l", "true", "arg"]
    assert sorted(Path(f"{fake}.log").read_text().split()) == ["down1", "up1", "up2"]
    lines = _attempts(capsys.readouterr().err)
    assert lines[0].endswith("; restarting with 4 processes on up1:2,up2:2 "
                             "(restart 1 of at most 2)"), lines


def test_a_job_given_a_host_file_gives_up_below_min_workers(tmp_path, monkeypatch, capsys):
    """When the hosts of the file that answer take fewer than --min-workers processes, the
    launcher gives up after the first attempt, with its status."""
    _hosts_up_by_name(tmp_path, monkeypatch)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("up1\ndown1\ndown2\n")
    status = launch.main(["-n", "3", "-f", str(hosts), "--max-restarts", "2",
                          "--min-workers", "2", "true"])
    assert status == 3
    assert len(_FakeJob.commands) == 1
    lines = _attempts(capsys.readouterr().err)
    assert lines == [lines[0]] and lines[0].endswith(
        "; giving up: the hosts that answer (up1) take 1 process, fewer than "
        "--min-workers 2"), lines


@pytest.mark.parametrize("name,local", [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), (socket.gethostname(), True),
    ("192.0.2.1", False),  # TEST-NET-1: nobody's address
    ("no-such-host.invalid", False),
])
def test_this_machine_is_told_apart(name, local):
    """The loopback, this machine's name and its addresses need no probe; others do."""
    assert host_probe.is_this_machine(name) == local


@pytest.mark.parametrize("entry,name", [
    ("node1", "node1"), ("node1:4", "node1"), ("10.0.0.1:2", "10.0.0.1"), ("fe80::1", "fe80::1"),
])
def test_a_host_entry_names_its_host(entry, name):
    """hydra's HOST:N names HOST; an IPv6 address stays whole."""
    assert host_probe.host_name(entry) == name


def test_hosts_are_probed_at_once_through_the_launcher(tmp_path):
    """Each host is asked through HYDRA_LAUNCHER_EXEC (`EXEC HOST true`): those that answer
    0 in time are kept, in order, with their slots; a host that fails or hangs is left out,
    and two hanging hosts cost one timeout, not two."""
    fake = tmp_path / "fake-ssh"
    fake.write_text('#!/bin/sh\necho "$@" >> "$0.log"\n'
                    'case "$1" in up*) exit 0 ;; down*) exit 255 ;; *) sleep 30 ;; esac\n')
    fake.chmod(0o755)
    began = time.monotonic()
    found = host_probe.answering(["up1:2", "hung1", "down1", "hung2:2", "up2"], 1.0,
                                 {**os.environ, "HYDRA_LAUNCHER_EXEC": str(fake)})
    took = time.monotonic() - began
    assert found == ["up1:2", "up2"]
    assert took < 1.9, took
    asked = sorted(Path(f"{fake}.log").read_text().splitlines())
    assert asked == sorted(f"{h} true" for h in ("up1", "hung1", "down1", "hung2", "up2"))


def test_ssh_is_the_probe_without_a_launcher_exec():
    """Without HYDRA_LAUNCHER_EXEC (or -launcher-exec) a host is asked with ssh in batch
    mode, its connection bounded by the probe timeout."""
    assert host_probe.probe_command("node1", 2.5, {}) == [
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", "node1", "true"]
    assert host_probe.probe_command("node1", 2.5, {}, "/my/ssh") == [
        "/my/ssh", "node1", "true"]


# ---------------------------------------------------------------------- reports
@pytest.fixture
def listener(monkeypatch):
    """A UDP socket on the loopback named in GPUKV_RUN_REPORT (no launcher rank set)."""
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(30)
        monkeypatch.setenv(run_report.ENV, f"127.0.0.1:{sock.getsockname()[1]}")
        yield sock


def test_nothing_is_sent_without_a_launcher(monkeypatch):
    """Without GPUKV_RUN_REPORT (or with a malformed one) no report is sent."""
    monkeypatch.delenv(run_report.ENV, raising=False)
    assert not run_report.send("PeerError", "lost")
    monkeypatch.setenv(run_report.ENV, "not-an-address")
    assert not run_report.send("PeerError", "lost")


def test_a_report_arrives_on_one_line(listener):
    """What failed, the words (flattened to one line), the status and the rank arrive."""
    assert run_report.send("exit status 3", "two\nlines\tand a tab", status=3, rank=4)
    assert run_report.parse(listener.recv(4096)) == run_report.Report(
        4, 3, "exit status 3", "two lines and a tab")


@pytest.mark.mpi
def test_a_transport_failure_sends_a_report(listener):
    """A transport that fails (a wait that times out) reports its PeerError at once."""
    require_mpi()
    code = ("from mpi4py import MPI\n"
            "from gpukv import PeerError\n"
            "from gpukv.distributed.mpi.transport import Transport\n"
            "try:\n"
            "    Transport(MPI.COMM_SELF, 0.05).poll(lambda: None, 'a wait for nobody')\n"
            "except PeerError:\n"
            "    pass\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=os.environ)
    assert done.returncode == 0, done.stderr
    report = run_report.parse(listener.recv(4096))
    assert report is not None and report[:3] == (0, None, "PeerError"), report
    assert "a wait for nobody: no answer within 0.05 s" in report.message, report


@pytest.mark.mpi
def test_an_uncaught_exception_sends_a_report(listener):
    """Under a bare mpiexec, a rank of a dist store ending on an uncaught exception
    reports it with its rank, before the job is aborted."""
    result = run("scenarios.py", 2, "uncaught_error", "1", bare=True,
                 env={run_report.ENV: os.environ[run_report.ENV]}, timeout=90)
    assert result.returncode != 0, result.stdout
    reports = []
    listener.settimeout(1)
    while True:
        try:
            reports.append(run_report.parse(listener.recv(4096)))
        except TimeoutError:
            break
    assert any(r is not None and r[:3] == (1, 1, "uncaught ShapeError")
               for r in reports), reports

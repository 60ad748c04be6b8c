"""`gpukv run` in torchrun's conventions (gpukv/launcher/): one line per failed rank naming
its rank, local rank, host, pid and what happened (a `kill -9` included, and a failure the
rank reported twice); torchrun's RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE in every rank;
each whole line of a rank's output after `[R] `, and with --log-dir in a file per rank and
attempt; mpiexec's box, MPI's Abort banner, wrapper frames and KeyboardInterrupt tracebacks
kept back unless --verbose; -n's default (this machine's GPUs); a bare `python` PROG is this
interpreter. The jobs are tiny programs written to tmp_path.
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

from gpukv.launcher import failures, launch, output, restarts, run_report

from ..distributed.mpirun import dies_with_us, require_mpi
from .test_launch import _alive, _finish, _said

GRACE = 1.0
HOST = socket.gethostname()  # as mpiexec names this machine to its ranks (PMI_HOSTNAME)

# writes its pid to DIR/rankR.pid (R from torchrun's RANK), then waits
WAITING = """\
import os, sys, time
from pathlib import Path
Path(sys.argv[1], "rank" + os.environ["RANK"] + ".pid").write_text(str(os.getpid()))
time.sleep(60)
"""


def _program(folder: Path, text: str, name: str = "prog.py") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _start(*argv: str, env: dict | None = None) -> subprocess.Popen:
    """`python -m gpukv run --grace GRACE ARGV`, started in a session of its own."""
    require_mpi()
    full_env = {**os.environ, **(env or {})}
    full_env.pop("GPUKV_RUN_VERBOSE", None)
    full_env.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "gpukv", "run", "--grace", str(GRACE),
                             *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=full_env,
                            start_new_session=True, preexec_fn=dies_with_us())


def _pids(folder: Path, n: int, launcher: subprocess.Popen, limit: float = 30) -> list[int]:
    """The pids the n ranks wrote, once all have."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        files = [folder / f"rank{r}.pid" for r in range(n)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        if launcher.poll() is not None:
            break
        time.sleep(0.05)
    _, out, err, _ = _finish(launcher, 10)
    pytest.fail(f"the ranks did not all start\nstdout:\n{out}\nstderr:\n{err}")


# ------------------------------------------------------------- the failure line
@pytest.mark.mpi
@pytest.mark.parametrize("how", ["python", "shell"])
def test_a_rank_killed_by_signal_9_is_named_with_its_pid_and_signal(tmp_path, how):
    """`kill -9` of rank 2 of 4 (its pid as it reported it): one line naming rank 2, its
    local rank, host and pid, and SIGKILL, though mpiexec's box names another pid; status
    9 as mpiexec gives it; no box shown; no process left. A shell PROG (exec'd, pid kept)
    as a Python one."""
    if how == "python":
        prog = [str(_program(tmp_path, WAITING)), str(tmp_path)]
    else:
        prog = ["sh", "-c", f'echo $$ > {tmp_path}/rank$RANK.pid; exec sleep 60']
    launcher = _start("-n", "4", *prog)
    pids = _pids(tmp_path, 4, launcher)
    os.kill(pids[2], signal.SIGKILL)
    code, out, err, _ = _finish(launcher, 30)
    assert code == 9, err
    assert _said(err) == [f"gpukv run: rank 2 (local rank 2) on host {HOST}, pid {pids[2]}: "
                          f"killed by signal 9 (SIGKILL)"], err
    assert "BAD TERMINATION" not in out + err and "Exit codes" not in out + err
    time.sleep(0.2)
    assert not [p for p in pids if _alive(p)]


@pytest.mark.mpi
def test_a_job_over_two_host_names_keeps_mpiexecs_exit_codes_out(tmp_path):
    """Two names of this machine as two hosts: mpiexec writes each further host's exit
    codes on a line of its own; none of them shows, on a clean end or a failed one, and
    the failed rank's status is the one those codes give."""
    prog = _program(tmp_path, "import os, sys\n"
                              "print('rank', os.environ['RANK'], flush=True)\n"
                              "sys.exit(3 if os.environ['RANK'] == '3' else 0)\n")
    code, out, err, _ = _finish(_start("-n", "4", "--hosts", "localhost,127.0.0.1",
                                       str(prog)), 60)
    assert code == 3, err
    assert not re.search(r"^\s*\[[^\]]+\]\s*-?\d+", out + err, re.M), out + err
    assert sorted(re.findall(r"rank \d", out)) == [f"rank {r}" for r in range(4)], out
    lines = _said(err)
    assert len(lines) == 1 and lines[0].startswith("gpukv run: rank 3 (local rank 1) on "
                                                   "host 127.0.0.1") \
        and lines[0].endswith("exit status 3"), err


@pytest.mark.mpi
def test_a_crashed_rank_is_named_with_its_signal(tmp_path):
    """A rank that dies of SIGSEGV (no word of its own) is named with SIGSEGV, the others,
    which mpiexec kills, are not named."""
    prog = _program(tmp_path, "import os, signal, time\n"
                              "if os.environ['RANK'] == '1':\n"
                              "    time.sleep(0.3)\n"
                              "    os.kill(os.getpid(), signal.SIGSEGV)\n"
                              "time.sleep(60)\n")
    code, _, err, _ = _finish(_start("-n", "3", str(prog)), 30)
    assert code == 11, err
    lines = _said(err)
    assert len(lines) == 1 and re.fullmatch(
        rf"gpukv run: rank 1 \(local rank 1\) on host {re.escape(HOST)}, pid \d+: killed by "
        r"signal 11 \(SIGSEGV\)", lines[0]), err


# rank 1 fails a moment after rank 0 has ended well; each writes its pid to DIR/rankR.pid
_EXEC_FAILING = {
    "python -c exit": ["python", "-c", "import os, sys, time\n"
                       "r = os.environ['RANK']\n"
                       "open(sys.argv[1] + '/rank' + r + '.pid', 'w').write(str(os.getpid()))\n"
                       "if r == '1':\n"
                       "    time.sleep(0.5)\n"
                       "    sys.exit(4)\n"],
    "python -c raise": ["python", "-c", "import os, sys, time\n"
                        "r = os.environ['RANK']\n"
                        "open(sys.argv[1] + '/rank' + r + '.pid', 'w').write(str(os.getpid()))\n"
                        "if r == '1':\n"
                        "    time.sleep(0.5)\n"
                        "    1 / 0\n"],
    "sh -c": ["sh", "-c", 'echo $$ > "$0/rank$RANK.pid"; '
              '[ "$RANK" = 1 ] && sleep 0.5 && exit $((RANK * 4)); exit 0'],
}


@pytest.mark.mpi
@pytest.mark.parametrize("how,status", [("python -c exit", 4), ("python -c raise", 1),
                                        ("sh -c", 4)])
def test_an_exec_d_program_names_the_rank_that_failed(tmp_path, how, status):
    """`python -c` and a shell PROG (exec'd: no report of their own, and mpiexec's box only
    for a signal): rank 1 exits non-zero after rank 0 ended with 0; the line names rank 1
    (its pid as it wrote it) and its exit status, from mpiexec's exit codes, not rank 0,
    whose end came first."""
    code, _, err, _ = _finish(_start("-n", "2", *_EXEC_FAILING[how], str(tmp_path)), 30)
    assert code == status, err
    pid = (tmp_path / "rank1.pid").read_text().strip()
    assert _said(err) == [f"gpukv run: rank 1 (local rank 1) on host {HOST}, pid {pid}: "
                          f"exit status {status}"], err


@pytest.mark.mpi
def test_a_rank_that_refused_a_push_alone_is_named_with_its_own_error(tmp_path):
    """A worker whose push is refused (a wrong shape) where the others push: its line is
    its own ShapeError, the cause, not the PeerMismatchError the refusal brings on its
    transport; the others' lines name the disagreement."""
    prog = _program(tmp_path, "import numpy as np, gpukv\n"
                              "kv = gpukv.create('dist_sync', num_servers=0)\n"
                              "kv.init('w', np.zeros(4, np.float32))\n"
                              "kv.push('w', np.ones(4 if kv.rank == 0 else 5, np.float32))\n")
    code, _, err, _ = _finish(_start("-n", "2", sys.executable, str(prog),
                                     env={"GPUKV_DIST_TIMEOUT": "10"}), 60)
    assert code == 1, err
    lines = _said(err)
    refusing = [ln for ln in lines if ln.startswith("gpukv run: rank 1 ")]
    assert len(refusing) == 1 and refusing[0].endswith(
        "uncaught ShapeError: key 'w': push expects shape (4,), got (5,)"), err
    assert all("PeerMismatchError" in ln for ln in lines if ln not in refusing), err


# ----------------------------------------------------------- torchrun's variables
@pytest.mark.mpi
@pytest.mark.parametrize("how", ["script.py", "python script.py", "sh -c"])
def test_every_rank_sees_torchruns_variables(tmp_path, how):
    """RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE are set before the program runs,
    whatever PROG is."""
    script = _program(tmp_path, "import os\nprint(*(os.environ[v] for v in ('RANK', "
                                "'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE')))\n")
    prog = {"script.py": [str(script)], "python script.py": ["python", str(script)],
            "sh -c": ["sh", "-c", "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE"]}[how]
    code, out, err, _ = _finish(_start("-n", "3", *prog), 30)
    assert code == 0, err
    assert sorted(out.splitlines()) == [f"[{r}] {r} {r} 3 3" for r in range(3)], out


@pytest.mark.mpi
def test_several_processes_a_host_get_one_math_thread_each_unless_set(tmp_path):
    """As torchrun: with more than one process on a host, OMP_NUM_THREADS,
    OPENBLAS_NUM_THREADS and MKL_NUM_THREADS are 1 in each (said once with --verbose); a
    value the user set is kept; one process a host gets none."""
    prog = _program(tmp_path, "import os\nprint(*(os.environ.get(v, '-') for v in "
                              "('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', "
                              "'MKL_NUM_THREADS')))\n")
    clean = {v: "" for v in launch.THREAD_VARIABLES}
    code, out, err, _ = _finish(_start("--verbose", "-n", "2", str(prog), env=clean), 30)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[0] 1 1 1", "[1] 1 1 1"], out
    assert err.count("OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1, MKL_NUM_THREADS=1") == 1, err
    kept = dict(clean, OMP_NUM_THREADS="3")
    code, out, err, _ = _finish(_start("-n", "2", str(prog), env=kept), 30)
    assert sorted(out.splitlines()) == ["[0] 3 1 1", "[1] 3 1 1"], out
    assert "NUM_THREADS" not in err, err  # quiet without --verbose
    assert launch.thread_env(1) == {}


@pytest.mark.mpi
def test_a_bare_python_is_this_interpreter(tmp_path):
    """`gpukv run -n 2 python prog.py` runs this Python, not the `python` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        _program(bin_dir, "#!/bin/sh\necho WRONG PYTHON\nexit 7\n", name).chmod(0o755)
    prog = _program(tmp_path, "import sys\nprint(sys.executable)\n")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    code, out, err, _ = _finish(_start("-n", "2", "python", str(prog), env=env), 30)
    assert code == 0, err
    assert sorted(out.splitlines()) == [f"[{r}] {sys.executable}" for r in range(2)], out


def test_python_and_python3_resolve_to_this_interpreter(tmp_path, monkeypatch):
    """A bare python/python3 PROG is sys.executable; its script must be there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for name in ("python", "python3"):
        assert launch.resolve_program([name, "train.py", "--lr", "1"]) == [
            sys.executable, "train.py", "--lr", "1"]
    assert launch.resolve_program(["python", "-m", "json.tool"]) == [
        sys.executable, "-m", "json.tool"]
    with pytest.raises(Exception, match="PROG python 'missing.py': no such file"):
        launch.resolve_program(["python", "missing.py"])


# ------------------------------------------------------------------ the output
PIECES = """\
import os, sys, time
r = os.environ["RANK"]
for piece in ("a", "b", "c"):
    sys.stdout.write(f"r{r}-{piece} "); sys.stdout.flush(); time.sleep(0.03)
sys.stdout.write(f"end\\nsecond {r}\\nlast {r}"); sys.stdout.flush()
sys.stderr.write(f"err {r} x"); sys.stderr.flush(); time.sleep(0.03)
sys.stderr.write(" y\\n"); sys.stderr.flush()
"""


@pytest.mark.mpi
def test_each_whole_line_carries_its_rank(tmp_path):
    """Ranks writing their lines in pieces at once: each whole line of each rank's stdout
    and stderr comes out once, after `[R] `, never joined with another rank's; an
    unfinished last line comes out when the job ends."""
    prog = _program(tmp_path, PIECES)
    code, out, err, _ = _finish(_start("-n", "3", str(prog)), 30)
    assert code == 0, err
    assert sorted(out.splitlines()) == sorted(
        line for r in range(3) for line in (f"[{r}] r{r}-a r{r}-b r{r}-c end",
                                            f"[{r}] second {r}", f"[{r}] last {r}")), out
    assert sorted(err.splitlines()) == [f"[{r}] err {r} x y" for r in range(3)], err


@pytest.mark.mpi
def test_log_dir_keeps_a_file_per_rank_and_attempt(tmp_path):
    """--log-dir DIR: each rank's lines (stdout and stderr, without the prefix) in
    DIR/attemptA/rankR.log for each attempt, the console keeping them all."""
    prog = _program(tmp_path, "import os, sys\n"
                              "r, a = os.environ['RANK'], os.environ['GPUKV_RUN_ATTEMPT']\n"
                              "print(f'out {r} {a}', flush=True)\n"
                              "print(f'err {r} {a}', file=sys.stderr, flush=True)\n"
                              "sys.exit(3 if (r, a) == ('1', '0') else 0)\n")
    logs = tmp_path / "logs"
    code, out, err, _ = _finish(_start("-n", "2", "--log-dir", str(logs), "--max-restarts",
                                       "1", str(prog)), 30)
    assert code == 0, err
    for attempt in range(2):
        for rank in range(2):
            text = (logs / f"attempt{attempt}" / f"rank{rank}.log").read_text()
            assert sorted(text.splitlines()) == [f"err {rank} {attempt}",
                                                 f"out {rank} {attempt}"], text
            assert f"[{rank}] out {rank} {attempt}" in out.splitlines()
            assert f"[{rank}] err {rank} {attempt}" in err.splitlines()
    assert "Exit codes" in (logs / "attempt0" / "mpiexec.log").read_text()


def test_log_dir_used_again_holds_this_runs_files_alone(tmp_path):
    """A log folder used again: the earlier run's files of the attempt go (a rank of the
    earlier run that this one lacks left none behind to mix in), and a rank that prints
    nothing has its file, empty."""
    logs = tmp_path / "logs"
    prog = _program(tmp_path, "print('first', flush=True)\n")
    code, _, err, _ = _finish(_start("-n", "2", "--log-dir", str(logs), str(prog)), 30)
    assert code == 0, err
    quiet = _program(tmp_path, "import os\n"
                               "if os.environ['RANK'] == '1':\n"
                               "    print('second', flush=True)\n", "quiet.py")
    code, _, err, _ = _finish(_start("-n", "2", "--log-dir", str(logs), str(quiet)), 30)
    assert code == 0, err
    folder = logs / "attempt0"
    assert (folder / "rank0.log").read_text() == ""
    assert (folder / "rank1.log").read_text() == "second\n"
    code, _, err, _ = _finish(_start("-n", "1", "--log-dir", str(logs), str(prog)), 30)
    assert code == 0, err
    assert sorted(p.name for p in folder.glob("rank*.log")) == ["rank0.log"]


def test_log_dir_that_cannot_be_made_is_a_usage_error(tmp_path, capsys):
    """--log-dir under a file: status 2, the folder named."""
    (tmp_path / "file").write_text("")
    (tmp_path / "prog.py").write_text("")
    with pytest.raises(SystemExit) as exc:
        launch.main(["-n", "1", "--log-dir", str(tmp_path / "file" / "logs"),
                     str(tmp_path / "prog.py")])
    assert exc.value.code == 2
    assert "--log-dir" in capsys.readouterr().err


# ------------------------------------------------------- failures out of the way
RAISING = """\
import os, time
def load(batch):
    raise ValueError(f"bad batch {batch}")
if os.environ["RANK"] == "1":
    load(7)
time.sleep(60)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("verbose", [False, True])
def test_an_exception_shows_the_programs_frames_only(tmp_path, verbose):
    """A rank's uncaught exception: its traceback shows the program's frames (none of the
    wrapper's, unless --verbose), mpiexec's box is not shown, and one line names the rank,
    its host and pid, the exception's type and message."""
    prog = _program(tmp_path, RAISING)
    code, out, err, _ = _finish(_start("-n", "2", *(["--verbose"] if verbose else []),
                                       str(prog)), 30)
    assert code == 1, err
    assert "[1] ValueError: bad batch 7" in err.splitlines(), err
    assert f'[1]   File "{prog}", line 3, in load' in err.splitlines(), err
    assert ("run_rank.py" in err) == verbose, err
    assert ("BAD TERMINATION" in out + err) == verbose, out + err
    lines = _said(err)
    assert len(lines) == 1 and re.fullmatch(
        rf"gpukv run: rank 1 \(local rank 1\) on host {re.escape(HOST)}, pid \d+: uncaught "
        r"ValueError: bad batch 7", lines[0]), err


@pytest.mark.mpi
@pytest.mark.parametrize("verbose", [False, True])
def test_an_mpi_abort_is_one_line(tmp_path, verbose):
    """A rank calling MPI_Abort: MPI's `Abort(4) on node ...` banner only with --verbose
    (or GPUKV_RUN_VERBOSE=1); one line names the rank, its pid and the abort; status 4."""
    prog = _program(tmp_path, "import time\nfrom mpi4py import MPI\n"
                              "if MPI.COMM_WORLD.Get_rank() == 1:\n"
                              "    MPI.COMM_WORLD.Abort(4)\n"
                              "time.sleep(60)\n")
    env = {"GPUKV_RUN_VERBOSE": "1"} if verbose else {}
    code, out, err, _ = _finish(_start("-n", "2", str(prog), env=env), 30)
    assert code == 4, err
    lines = _said(err)
    rank = rf"gpukv run: rank 1 \(local rank 1\) on host {re.escape(HOST)}, pid \d+: "
    assert len(lines) == 1, err
    if "MPI_Abort" not in lines[0]:  # mpiexec's proxy ended before it forwarded the banner
        # the proxy kills every rank of the job at once, the one that aborted too: the
        # line names whichever end its watcher reported first
        anyone = rf"gpukv run: rank [01] \(local rank [01]\) on host {re.escape(HOST)}, pid \d+: "
        assert re.fullmatch(anyone + "ended first, without a word; mpiexec ended with status 4",
                            lines[0]), err
        assert "Abort(4) on node 1" not in out + err, out + err
        return
    assert ("Abort(4) on node 1" in out + err) == verbose, out + err
    assert re.fullmatch(rank + r"application called MPI_Abort\(MPI_COMM_WORLD, 4\)",
                        lines[0]), err


@pytest.mark.mpi
def test_a_rank_whose_process_group_is_killed_is_named(tmp_path):
    """Rank 1 of 3 kills its whole process group, as mpiexec's proxy does when it ends a
    job: its watcher, in a group of its own, still reports the end first, so the line
    names rank 1 (mpiexec's box names the first failed process of the host, rank 0)."""
    prog = _program(tmp_path, "import os, signal, sys, time\n"
                              "if os.environ['RANK'] == '1':\n"
                              "    time.sleep(1)\n"
                              "    os.killpg(os.getpgid(0), signal.SIGKILL)\n"
                              "time.sleep(60)\n")
    code, out, err, _ = _finish(_start("-n", "3", str(prog)), 30)
    assert code == 9, err
    assert len(_said(err)) == 1 and re.fullmatch(
        rf"gpukv run: rank 1 \(local rank 1\) on host {re.escape(HOST)}, pid \d+: killed by "
        r"signal 9 \(SIGKILL\)", _said(err)[0]), err


def test_an_mpi_abort_without_words_says_its_error_code():
    """MPICH's banner with its message suppressed (MPIR_CVAR_SUPPRESS_ABORT_MESSAGE=1):
    the line says the rank called MPI_Abort and with which code."""
    said = failures.MpiexecWords()
    assert said.read("Abort(4) on node 1 (rank 1 in comm 0): ")
    assert failures.of_mpiexec(said, {1: _started(1, 1)}, []) == failures.Failure(
        "rank 1 (local rank 1) on host vm, pid 9001: called MPI_Abort with error code 4", 4)


@pytest.mark.mpi
def test_ctrl_c_ends_with_one_line(tmp_path):
    """Ctrl-C to a job of Python ranks that do not handle it: status 130 and one line,
    `interrupted (Ctrl-C): ended 2 processes`; no KeyboardInterrupt traceback, none of
    mpiexec's notes."""
    prog = _program(tmp_path, WAITING)
    launcher = _start("-n", "2", str(prog), str(tmp_path))
    pids = _pids(tmp_path, 2, launcher)
    launcher.send_signal(signal.SIGINT)
    code, out, err, _ = _finish(launcher, 30)
    assert code == 130, err
    assert err.splitlines() == ["gpukv run: interrupted (Ctrl-C): ended 2 processes"], err
    assert not out, out
    time.sleep(0.2)
    assert not [p for p in pids if _alive(p)]


# ---------------------------------------------------------------- -n's default
class _Recorded:
    """Stands for a launcher.Job: records each command and ends well."""
    commands: list[list[str]] = []

    def __init__(self, command, address, grace, env=None, announce=True, **settings):
        self.commands.append(command)
        self.reason, self.signal = None, None

    def run(self) -> int:
        return 0


@pytest.mark.parametrize("visible,smi,options,expected", [
    ("0,1,2", None, [], ["-n", "3"]),
    ("GPU-5e1f,GPU-77aa", None, [], ["-n", "2"]),
    ("0,-1,2", None, [], ["-n", "1"]),       # CUDA stops at the first entry that is not one
    ("", None, [], ["-n", "1"]),             # no GPU: one process
    (None, 2, [], ["-n", "2"]),              # nvidia-smi -L lists two
    (None, None, [], ["-n", "1"]),           # no nvidia-smi: one process
    ("0,1", None, ["--hosts", "a,b,c"], ["-n", "6", "-hosts", "a,b,c", "-ppn", "2"]),
    ("0,1", None, ["--ppn", "3", "--hosts", "a,b"], ["-n", "6", "-hosts", "a,b", "-ppn", "3"]),
])
def test_n_defaults_to_this_machines_gpus(visible, smi, options, expected, tmp_path,
                                          monkeypatch):
    """Without -n: torchrun's --nproc-per-node gpu: as many processes a host as
    CUDA_VISIBLE_DEVICES names, else as `nvidia-smi -L` lists, else 1 (--ppn K: K), times
    the hosts."""
    monkeypatch.setattr(launch, "Job", _Recorded)
    monkeypatch.setattr(_Recorded, "commands", [])
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        listing = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(smi))
        _program(bin_dir, f"#!/bin/sh\n{listing}", "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert launch.main([*options, "true"]) == 0
    (command,) = _Recorded.commands
    assert command[1:] == [*expected, "true"]


# --------------------------------------------------------------------- pieces
def test_pieces_of_lines_are_gathered_per_rank():
    """mpiexec's stream, a marker before each rank's piece, read in pieces cut anywhere (in
    a marker too): each rank's lines whole; mpiexec's own box (one write), right after a
    rank's unfinished line, is mpiexec's; what is unfinished comes out at the end."""
    token = "abc123"
    mark = output.pattern(token).replace("%r", "{}").format
    ranks = (f"{mark(0)}r0-a {mark(1)}r1-a {mark(0)}end 0\nsec{mark(1)}end 1\r\n"
             f"{mark(0)}ond 0\r10%\r{mark(2)}tail").encode()
    box = ("\n" + "=" * 50 + "=" * 33 + "\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION "
           "PROCESSES\n").encode()
    for size in (1, 2, 5, len(ranks)):
        demux = output.Demux(token)
        lines = []
        for at in range(0, len(ranks), size):
            lines += demux.feed(ranks[at:at + size])
        lines += demux.feed(box) + demux.flush()
        got = [(line.rank, line.text.decode(), line.end.decode()) for line in lines]
        assert [g for g in got if g[0] == 0] == [
            (0, "r0-a end 0", "\n"), (0, "second 0", "\r"), (0, "10%", "\n")], (size, got)
        assert [g for g in got if g[0] == 1] == [(1, "r1-a end 1", "\n")], (size, got)
        assert [g for g in got if g[0] == 2] == [(2, "tail", "\n")], (size, got)
        assert [g[1] for g in got if g[0] is None] == [
            "", "=" * 83, "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"], got


def _started(rank: int, local: int, host: str = "vm") -> run_report.Started:
    return run_report.Started(rank, local, host, 9000 + rank)


def _job_with_a_wordless_end() -> launch.Job:
    """A job of 2 ranks whose programs would say how they end; rank 0's process ended
    first and rank 1's after it, neither said a word, and the launcher has called rank
    0's silence its failure (the proxy ends every rank at once on an MPI_Abort)."""
    job = launch.Job(["true"], "127.0.0.1", 1.0, announce=False)
    job.started = {0: _started(0, 0), 1: _started(1, 1)}
    job.says = {0, 1}
    job.ended = [run_report.Ended(0, 9000), run_report.Ended(1, 9001)]
    job.unsaid = {0: 0.0, 1: 0.0}
    job._check_unsaid(0.0)
    assert [r.rank for r in job.first] == [0]
    return job


@pytest.mark.parametrize("banner, status, code, line", [
    # the abort's banner came after rank 0's silence was called a failure: the abort
    (True, 4, 4, "rank 1 (local rank 1) on host vm, pid 9001: called MPI_Abort with "
                 "error code 4"),
    # no banner (the proxy ended first), but mpiexec's own status is the abort's code
    (False, 4, 4, "rank 0 (local rank 0) on host vm, pid 9000: ended first, without a "
                  "word; mpiexec ended with status 4"),
    # mpiexec ended by force after the grace (a C _exit(0) it took for no failure)
    (False, None, 1, "rank 0 (local rank 0) on host vm, pid 9000: ended without a word: "
                     "its process ended past Python's own exit (a crash in native code, "
                     "or C's _exit)"),
])
def test_what_mpiexec_says_after_a_wordless_end_wins(banner, status, code, line):
    job = _job_with_a_wordless_end()
    if banner:
        job.said.read("Abort(4) on node 1 (rank 1 in comm 0): ")
    assert job._conclude(status) == code
    assert job.reason == line


def test_the_failed_rank_is_the_first_that_ended_not_the_one_the_box_names():
    """mpiexec's box names rank 0's pid (its cleanup killed it too); the watchers said
    rank 2 ended first, and the exit codes say how: rank 2, SIGKILL."""
    said = failures.MpiexecWords()
    box = ["=" * 83, "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
           "=   PID 9000 RUNNING AT vm", "=   EXIT CODE: 9"]
    assert [said.read(line) for line in box] == [False, False, False, True]
    assert not said.read("[mpiexec@vm] Exit codes: [vm] 9,9,9,9")
    started = {r: _started(r, r) for r in range(4)}
    ended = [run_report.Ended(2, 9002), run_report.Ended(0, 9000)]
    assert failures.of_mpiexec(said, started, ended) == failures.Failure(
        "rank 2 (local rank 2) on host vm, pid 9002: killed by signal 9 (SIGKILL)", 9)


def test_exit_codes_are_read_per_host_in_local_rank_order():
    """Several hosts' exit codes (the first host's on mpiexec's line, each further host's
    on a line of its own, as Hydra writes them): each rank's by its host and local rank;
    a rank that ended 0 before the failed one is passed over."""
    said = failures.MpiexecWords()
    for line in ["=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
                 "=   PID 9000 RUNNING AT a", "=   EXIT CODE: 9",
                 "[mpiexec@vm] Exit codes: [a] 0,9"]:
        assert not said.more_codes(line)
        said.read(line)
    assert said.more_codes("[b] 9,11")
    assert not said.more_codes("[c] 0 and more words")
    assert not said.more_codes("[d] 0")  # not right after the codes any more
    started = {0: _started(0, 0, "a"), 1: _started(1, 1, "a"), 2: _started(2, 0, "b"),
               3: _started(3, 1, "b")}
    ended = [run_report.Ended(0, 9000), run_report.Ended(3, 9003), run_report.Ended(2, 9002)]
    assert failures.of_mpiexec(said, started, ended) == failures.Failure(
        "rank 3 (local rank 1) on host b, pid 9003: killed by signal 11 (SIGSEGV)", 11)
    assert failures.how_it_ended(3 << 8) == failures.Failure("exit status 3", 3)


def test_without_the_ranks_word_the_box_is_said_as_it_is():
    """No watcher spoke (a host beyond reach): the box's host and its number."""
    said = failures.MpiexecWords()
    for line in ["=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
                 "=   PID 77 RUNNING AT node2", "=   KILLED BY SIGNAL: 9 (Killed)"]:
        said.read(line)
    assert failures.of_mpiexec(said, {}, []) == failures.Failure(
        "a process on host node2 ended badly: killed by signal 9 (SIGKILL)", 9)


def test_a_silent_failure_names_the_rank_that_ended_first():
    """mpiexec ended non-zero without a word (its proxy lost a rank's last lines): the
    first rank whose watcher spoke, and mpiexec's status; with no watcher, the status."""
    started = {r: _started(r, r) for r in range(3)}
    ended = [run_report.Ended(7, 9007), run_report.Ended(1, 9001), run_report.Ended(0, 9000)]
    assert failures.of_silence(4, started, ended) == failures.Failure(
        "rank 1 (local rank 1) on host vm, pid 9001: ended first, without a word; "
        "mpiexec ended with status 4", 4)
    assert failures.of_silence(255, started, []) == failures.Failure(
        "mpiexec ended with status 255", 255)


def test_a_silent_failure_is_the_rank_mpiexecs_exit_codes_say():
    """mpiexec ended non-zero without a box (an exec'd PROG's exit): the first rank to end
    whose exit code is not 0, how it ended; with no code that is not 0, the first that
    ended and is not known to have ended well, else mpiexec's status alone."""
    started = {r: _started(r, r) for r in range(3)}
    ended = [run_report.Ended(0, 9000), run_report.Ended(2, 9002), run_report.Ended(1, 9001)]
    said = failures.MpiexecWords()
    said.read("[mpiexec@vm] Exit codes: [vm] 0,1024,9")
    assert failures.of_silence(4, started, ended, said) == failures.Failure(
        "rank 2 (local rank 2) on host vm, pid 9002: killed by signal 9 (SIGKILL)", 9)
    said.codes["vm"][2] = 0
    assert failures.of_silence(4, started, ended, said) == failures.Failure(
        "rank 1 (local rank 1) on host vm, pid 9001: exit status 4", 4)
    said.codes["vm"] = [0, 0, 0]
    assert failures.of_silence(4, started, ended, said) == failures.Failure(
        "mpiexec ended with status 4", 4)
    # no codes: a rank whose program said it ended well is not the one named
    assert failures.of_silence(4, started, ended, failures.MpiexecWords(),
                               clean={0}) == failures.Failure(
        "rank 2 (local rank 2) on host vm, pid 9002: ended first, without a word; "
        "mpiexec ended with status 4", 4)


def test_a_rank_that_reports_twice_gets_one_line():
    """A rank's transport reports its PeerMismatchError, and the same exception then ends
    the program (`uncaught PeerMismatchError`, status 1): one line for the rank, the one
    that says it ended the rank. A rank whose end is another report (a PeerError caught,
    then `exit status 3`) keeps the first, the cause, with the status of its end."""
    started = {r: _started(r, r) for r in range(3)}
    words = "pull of key 'w': processes disagree"
    uncaught = run_report.Report(0, 1, "uncaught PeerMismatchError", words)
    reports = [run_report.Report(0, None, "PeerMismatchError", words),
               run_report.Report(1, None, "PeerMismatchError", words), uncaught,
               run_report.Report(2, None, "PeerError", "rank 0 is lost"),
               run_report.Report(2, 3, "exit status 3", ""), uncaught]
    assert failures.of_reports(reports, started) == [
        failures.Failure(f"rank 0 (local rank 0) on host vm, pid 9000: uncaught "
                         f"PeerMismatchError: {words}", 1),
        failures.Failure(f"rank 1 (local rank 1) on host vm, pid 9001: PeerMismatchError: "
                         f"{words}", None),
        failures.Failure("rank 2 (local rank 2) on host vm, pid 9002: PeerError: rank 0 is "
                         "lost", 3)]


def test_start_and_end_reports_arrive_on_one_line(monkeypatch):
    """A rank's start (rank, local rank, host, pid) and end reach the launcher."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(30)
        monkeypatch.setenv(run_report.ENV, f"127.0.0.1:{sock.getsockname()[1]}")
        assert run_report.send_started(run_report.Started(3, 1, "node 2", 4242))
        assert run_report.parse(sock.recv(4096)) == run_report.Started(3, 1, "node 2", 4242)
        assert run_report.send_ended(run_report.Ended(3, 4242))
        assert run_report.parse(sock.recv(4096)) == run_report.Ended(3, 4242)
        assert run_report.send_says(run_report.Says(3))
        assert run_report.parse(sock.recv(4096)) == run_report.Says(3)
        assert run_report.send_done(run_report.Done(3))  # twice: one may be lost
        assert [run_report.parse(sock.recv(4096)) for _ in range(2)] == [
            run_report.Done(3)] * 2
        assert run_report.send_execs(run_report.Execs(3))
        assert run_report.parse(sock.recv(4096)) == run_report.Execs(3)


def test_a_rank_that_ended_without_a_word_is_the_failed_one_even_with_status_0():
    """mpiexec's box names rank 0, which it killed after rank 1 ended by C's _exit(0):
    rank 1, whose end came first and without its program's word, is the failed one."""
    said = failures.MpiexecWords()
    for line in ["=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
                 "=   PID 9000 RUNNING AT vm", "=   EXIT CODE: 9",
                 "[mpiexec@vm] Exit codes: [vm] 9,0"]:
        said.read(line)
    started = {r: _started(r, r) for r in range(2)}
    ended = [run_report.Ended(1, 9001), run_report.Ended(0, 9000)]
    assert failures.of_mpiexec(said, started, ended) == failures.Failure(
        "rank 0 (local rank 0) on host vm, pid 9000: killed by signal 9 (SIGKILL)", 9)
    assert failures.of_mpiexec(said, started, ended, wordless={1}) == failures.Failure(
        "rank 1 (local rank 1) on host vm, pid 9001: ended without a word: its process "
        "ended past Python's own exit, with status 0", 1)


def test_help_speaks_torchrun():
    """`gpukv run --help` puts torchrun's terms first and says the new conventions."""
    text = " ".join(launch.DESCRIPTION.split())
    for words in ("--nproc-per-node", "--log-dir DIR", "RANK LOCAL_RANK WORLD_SIZE "
                  "LOCAL_WORLD_SIZE", "nvidia-smi -L", "CUDA_VISIBLE_DEVICES", "`[R] `",
                  "DIR/attemptA/rankR.log", "--verbose", "GPUKV_RUN_VERBOSE=1",
                  "interrupted (Ctrl-C): ended N processes", "killed by signal 9 (SIGKILL)",
                  "python3"):
        assert words in text, words
    assert restarts.ATTEMPT_ENV in text

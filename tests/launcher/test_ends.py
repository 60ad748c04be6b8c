"""How a `gpukv run` job ends when the launcher is told to end, or is gone
(gpukv/launcher/launch.py, guard.py, process_tree.py): a hang-up (SIGHUP) ends it as
SIGTERM does; a launcher killed by SIGKILL leaves no process of its job and none of
MPICH's files; Ctrl-C or SIGTERM in the grace after a failure keeps the failed ranks'
lines. Also: a line of a rank's output longer than 64 KiB comes out whole, after one
prefix (gpukv/launcher/output.py), and torchrun's options are usage errors saying what to
write instead. The jobs are tiny programs written to tmp_path.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpukv.launcher import guard, launch, leftovers, output, process_tree, run_report

from .test_conventions import HOST, _pids, _program, _start
from .test_launch import _alive, _finish, _made_before, _said

# writes its pid to DIR/rankR.pid (R from torchrun's RANK), then waits; `mpi`: after MPI
# is set up (MPICH's files made); `deaf`: ignoring SIGTERM (mpiexec alone never ends it)
WAITING = """\
import os, signal, sys, time
from pathlib import Path
folder, how = Path(sys.argv[1]), sys.argv[2:]
if "mpi" in how:
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()
if "deaf" in how:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(folder / ("rank" + os.environ["RANK"] + ".pid")).write_text(str(os.getpid()))
time.sleep(120)
"""
#: set in a test's launcher, passed on to every process of its job: how they are found
MARK = "GPUKV_TEST_JOB"

# rank 1 fails (`exit`: sys.exit(7); `raise`: an uncaught ValueError) once every rank has
# written its pid, after writing DIR/failed-at; rank 0 waits
FAILING = """\
import os, sys, time
from pathlib import Path
folder, how = Path(sys.argv[1]), sys.argv[2]
(folder / ("rank" + os.environ["RANK"] + ".pid")).write_text(str(os.getpid()))
if os.environ["RANK"] == "1":
    while not (folder / "rank0.pid").exists():
        time.sleep(0.02)
    (folder / "failed-at").write_text("")
    if how == "raise":
        raise ValueError("bad batch 7")
    sys.exit(7)
time.sleep(120)
"""


def _marked(folder: Path) -> list[int]:
    """The living processes with MARK=`folder` in their environment (a zombie's is empty)."""
    entry = f"{MARK}={folder}".encode()
    found = []
    for each in Path("/proc").iterdir():
        try:
            if each.name.isdigit() and entry in (each / "environ").read_bytes().split(b"\0"):
                found.append(int(each.name))
        except OSError:  # ended meanwhile, or another user's
            continue
    return found


def _job_left(folder: Path, seconds: float) -> list[int]:
    """The processes of the job started with MARK=`folder` (the launcher's too, and all
    it started) still there after up to `seconds`."""
    end = time.monotonic() + seconds
    while True:
        left = _marked(folder)
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.05)


def _described(pids: list[int]) -> str:
    found = []
    for pid in pids:
        try:
            found.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()!r}")
        except OSError:
            continue
    return "\n".join(found)


# ------------------------------------------------------------------ the signals
@pytest.mark.mpi
def test_a_hang_up_ends_the_job_as_sigterm_does(tmp_path):
    """SIGHUP to the launcher (its terminal closed, ssh dropped): every process of the job
    ends, and the launcher says so in one line, with status 129."""
    prog = _program(tmp_path, WAITING)
    launcher = _start("-n", "2", str(prog), str(tmp_path), env={MARK: str(tmp_path)})
    pids = _pids(tmp_path, 2, launcher)
    launcher.send_signal(signal.SIGHUP)
    code, out, err, _ = _finish(launcher, 30)
    assert code == 129, err
    assert _said(err) == ["gpukv run: hung up (SIGHUP): ended 2 processes"], err
    left = _job_left(tmp_path, 1)
    assert not left, _described(left)
    assert not [p for p in pids if _alive(p)]


@pytest.mark.mpi
def test_a_launcher_killed_by_sigkill_leaves_nothing_of_its_job(tmp_path):
    """`kill -9` of the launcher while its ranks (which ignore SIGTERM) wait: within a few
    seconds no process of the job is left on this machine (mpiexec, its proxy, the ranks,
    their watchers), and MPICH's files of the ranks are gone."""
    before = leftovers.present()
    prog = _program(tmp_path, WAITING)
    launcher = _start("-n", "2", str(prog), str(tmp_path), "mpi", "deaf",
                      env={MARK: str(tmp_path)})
    pids = _pids(tmp_path, 2, launcher)
    # the launcher, mpiexec, its proxy, 2 ranks and their watchers
    assert len(_job_left(tmp_path, 0)) >= 6
    launcher.kill()
    code, _, err, killed = _finish(launcher, 30)
    assert code == -signal.SIGKILL, err
    left = _job_left(tmp_path, 5)
    assert not left, _described(left)
    assert not [p for p in pids if _alive(p)]
    # MPICH's files made before the launcher was killed (a later one is another job's)
    end = time.monotonic() + 5
    while True:
        busy = leftovers.held()
        ours = [p for p in leftovers.present() - before
                if str(p) not in busy and _made_before(p, killed)]
        if not ours or time.monotonic() >= end:
            break
        time.sleep(0.1)
    assert not ours, ours


@pytest.mark.mpi
@pytest.mark.parametrize("how,says", [("exit", "exit status 7"),
                                      ("raise", "uncaught ValueError: bad batch 7")])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_the_grace_keeps_the_failure_lines(tmp_path, how, says, signum):
    """Rank 1 fails while rank 0 waits; Ctrl-C (or SIGTERM) comes in the grace: the line
    naming rank 1 and how it failed, then the signal's, and the signal's status."""
    prog = _program(tmp_path, FAILING)
    launcher = _start("-n", "2", "--grace", "20", str(prog), str(tmp_path), how)
    pids = _pids(tmp_path, 2, launcher)
    deadline = time.monotonic() + 30
    while not (tmp_path / "failed-at").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.5)  # the failure is reported, and the grace runs
    launcher.send_signal(signum)
    code, _, err, _ = _finish(launcher, 30)
    assert code == 128 + signum, err
    name = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert _said(err) == [
        f"gpukv run: rank 1 (local rank 1) on host {HOST}, pid {pids[1]}: {says}",
        f"gpukv run: {name}: ended 1 process"], err
    assert not [p for p in pids if _alive(p)]


@pytest.mark.mpi
def test_ctrl_c_in_the_grace_under_restarts_says_the_failure(tmp_path):
    """Under --max-restarts the attempt's line says the failure, then the interruption,
    and no attempt follows."""
    prog = _program(tmp_path, FAILING)
    launcher = _start("-n", "2", "--grace", "20", "--max-restarts", "2", str(prog),
                      str(tmp_path), "exit")
    pids = _pids(tmp_path, 2, launcher)
    deadline = time.monotonic() + 30
    while not (tmp_path / "failed-at").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.5)
    launcher.send_signal(signal.SIGINT)
    code, _, err, _ = _finish(launcher, 30)
    assert code == 130, err
    lines = _said(err)
    assert len(lines) == 1, err
    assert (f"rank 1 (local rank 1) on host {HOST}, pid {pids[1]}: exit status 7; "
            f"interrupted (Ctrl-C): ended 1 process; interrupted, not restarting"
            in lines[0]), err


def _job(**state) -> launch.Job:
    job = launch.Job(["true"], "127.0.0.1", 1.0, announce=False, processes=2)
    job.started = {r: run_report.Started(r, r, "vm", 9000 + r) for r in range(2)}
    for name, value in state.items():
        setattr(job, name, value)
    return job


def test_reports_the_signal_made_are_no_failure_lines():
    """A failure before the signal keeps its line; what the ranks said after it (their
    interruption) adds none, but a later word of a rank that had failed is its own."""
    failed = run_report.Report(1, None, "PeerError", "rank 0 gone")
    job = _job(first=[failed])
    job.failures = [failed]
    job._on_signal(signal.SIGTERM, None)
    job.failures += [run_report.Report(0, 143, "exit status 143", ""),
                     run_report.Report(1, 1, "uncaught PeerError", "rank 0 gone")]
    assert job._conclude(None) == 143
    assert job.reason == ("rank 1 (local rank 1) on host vm, pid 9001: uncaught PeerError: "
                          "rank 0 gone; terminated (SIGTERM): ended 2 processes")
    quiet = _job()
    quiet._on_signal(signal.SIGHUP, None)
    quiet.failures = [run_report.Report(0, 130, "interrupted (KeyboardInterrupt)", "")]
    assert quiet._conclude(None) == 129
    assert quiet.reason == "hung up (SIGHUP): ended 2 processes"


def test_a_hang_up_ignored_here_stays_ignored():
    """Under nohup (SIGHUP ignored) the launcher leaves hang-ups ignored."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert signal.SIGHUP not in process_tree.ending()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert signal.SIGHUP in process_tree.ending()
    finally:
        signal.signal(signal.SIGHUP, before)


# --------------------------------------------------- what ends a job without launcher
_SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's prctl")
def test_a_child_started_to_die_with_its_parent_does():
    """A process started with `die_with_parent` is killed when the process that started it
    is (kill -9 included)."""
    code = ("import subprocess, sys\n"
            "from gpukv.launcher import process_tree\n"
            "import signal\n"
            "child = subprocess.Popen(sys.argv[1:], start_new_session=True,\n"
            "    preexec_fn=process_tree.die_with_parent(signal.SIGKILL))\n"
            "print(child.pid, flush=True)\n"
            "import time; time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, *_SLEEPER], stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        end = time.monotonic() + 5
        while _alive(child) and time.monotonic() < end:
            time.sleep(0.02)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("released", [False, True])
def test_the_guard_ends_the_marked_processes_unless_released(tmp_path, released):
    """A guard whose launcher's end of the pipe closes untold (the launcher gone) kills
    every process with its mark, in a session of its own or not, and removes the new
    files of MPICH's that no process holds; told the job ended, it goes and kills
    nothing."""
    shm = tmp_path / "shm"
    shm.mkdir()
    places = leftovers.PLACES
    leftovers.PLACES = ((shm, "mpich_shm_*"),)
    try:
        (shm / "mpich_shm_old_0").write_bytes(b"")
        keeper = guard.Guard(leftovers.present())
    finally:
        leftovers.PLACES = places
    marked = [subprocess.Popen(_SLEEPER, env={**os.environ, **keeper.env},
                               start_new_session=alone) for alone in (False, True)]
    other = subprocess.Popen(_SLEEPER)
    (shm / "mpich_shm_new_0").write_bytes(b"")
    try:
        assert keeper.pid is not None and _alive(keeper.pid)
        assert sorted(process_tree.marked(guard.ENV, keeper.env[guard.ENV])) == sorted(
            p.pid for p in marked)
        if released:
            keeper.release()
        else:  # as when the launcher is killed: the pipe closes, nothing said
            os.close(keeper._pipe)
            os.waitpid(keeper.pid, 0)
        time.sleep(0.1)
        assert [p.poll() is None for p in marked] == [released, released]
        assert other.poll() is None
        assert sorted(p.name for p in shm.iterdir()) == (
            ["mpich_shm_new_0", "mpich_shm_old_0"] if released else ["mpich_shm_old_0"])
    finally:
        for each in (*marked, other):
            each.kill()
            each.wait()


# ------------------------------------------------------------------ long lines
def test_a_long_line_stays_whole_after_one_prefix(tmp_path):
    """A 130 kB line of rank 1, in pieces between which rank 0 writes its own lines, comes
    out whole after one `[1] `, and whole in rank 1's file; a line that never ends is
    written in lines of output.LONGEST."""
    token = "abc"
    mark = output.pattern(token).replace("%r", "{}").encode()
    line = json.dumps({"rank": 1, "data": "x" * 130_000}).encode()
    demux = output.Demux(token)
    lines = []
    starts = range(0, len(line), 50_000)
    for at in starts:
        lines += demux.feed(mark.replace(b"{}", b"1") + line[at:at + 50_000])
        lines += demux.feed(mark.replace(b"{}", b"0") + b"short\n")
    lines += demux.feed(mark.replace(b"{}", b"1") + b"\n")
    assert len(starts) == 3
    assert lines == [output.Line(0, b"short", b"\n")] * 3 + [output.Line(1, line, b"\n")]
    console = output.Console(False, tmp_path)
    console.write(lines[-1], 1, False)
    console.finish()
    assert (tmp_path / "rank1.log").read_bytes() == line + b"\n"
    endless = output.Demux(None)
    got = []
    for _ in range(output.LONGEST // 65_536 + 1):
        got += endless.feed(b"y" * 65_536)
    assert got == [output.Line(None, b"y" * output.LONGEST, b"\n")]
    assert [len(x.text) for x in endless.flush()] == [65_536]


@pytest.mark.mpi
def test_a_rank_s_long_json_line_comes_out_whole(tmp_path):
    """A rank printing a 130 kB JSON line: one line after `[R] ` on the console, and one
    line in its --log-dir file, each a JSON document."""
    prog = _program(tmp_path, "import json, os\n"
                              "print(json.dumps({'rank': os.environ['RANK'], "
                              "'data': 'x' * 130_000}), flush=True)\n")
    logs = tmp_path / "logs"
    code, out, err, _ = _finish(_start("-n", "2", "--log-dir", str(logs), str(prog)), 60)
    assert code == 0, err
    lines = out.splitlines()
    assert sorted(line[:4] for line in lines) == ["[0] ", "[1] "], [x[:20] for x in lines]
    for line in lines:
        rank = line[1]
        assert json.loads(line[4:])["rank"] == rank
        logged = (logs / "attempt0" / f"rank{rank}.log").read_text().splitlines()
        assert logged == [line[4:]]


# ------------------------------------------------------------ torchrun's options
@pytest.fixture
def nothing_starts(monkeypatch):
    """Makes any process the launcher would start fail the test."""
    def refuse(*args, **kwargs):
        pytest.fail(f"started {args}")
    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("argv,says", [
    (["--rdzv-endpoint", "localhost:29500", "-n", "2", "prog.py"],
     "--rdzv-endpoint is torchrun's option; gpukv run takes --hosts H1,H2,..."),
    (["--rdzv_endpoint=localhost:29500", "-n", "2", "prog.py"],
     "--rdzv_endpoint is torchrun's option; gpukv run takes --hosts H1,H2,..."),
    (["--rdzv-id", "7", "prog.py"], "--rdzv-id is torchrun's option; gpukv run takes nothing"),
    (["--rdzv_backend=c10d", "prog.py"], "--rdzv_backend is torchrun's option"),
    (["--rdzv-conf", "timeout=9", "prog.py"], "--rdzv-conf is torchrun's option"),
    (["--local-addr", "10.0.0.1", "prog.py"], "-iface"),
    (["--tee", "3", "prog.py"], "--tee is torchrun's option; gpukv run takes nothing: every "
                                "rank's lines reach the console"),
    (["-t", "3", "prog.py"], "-t is torchrun's option"),
    (["--redirects=3", "prog.py"], "--redirects is torchrun's option"),
    (["-r", "3", "prog.py"], "-r is torchrun's option"),
    (["--local_ranks_filter", "0", "prog.py"], "--local_ranks_filter is torchrun's option"),
    (["--logs-specs", "x", "prog.py"], "gpukv run takes --log-dir DIR"),
    (["--monitor-interval", "1", "prog.py"], "--monitor-interval is torchrun's option"),
    (["--monitor_interval=0.5", "prog.py"], "--monitor_interval is torchrun's option"),
    (["--no-python", "-n", "2", "prog.py"],
     "--no-python is torchrun's option; gpukv run takes PROG as it is"),
    (["--no_python", "prog.py"], "--no_python is torchrun's option"),
    (["--role", "trainer", "prog.py"], "--role is torchrun's option"),
    (["--run-path", "prog.py"], "--run-path is torchrun's option"),
    (["--start_method=spawn", "prog.py"], "--start_method is torchrun's option"),
    (["--master_addr=10.0.0.1", "prog.py"], "--master_addr is torchrun's option"),
    (["--max_restarts", "3", "prog.py"], "unknown option --max_restarts: did you mean "
                                         "--max-restarts?"),
    (["--max_restarts=3", "prog.py"], "did you mean --max-restarts?"),
    (["--log_dir", "logs", "prog.py"], "did you mean --log-dir?"),
    (["--min_workers=1", "prog.py"], "did you mean --min-workers?"),
])
def test_torchruns_options_are_usage_errors(argv, says, capsys, nothing_starts, tmp_path,
                                            monkeypatch):
    """torchrun's options, with '-' or '_' and with their value apart or after '=', and
    gpukv run's own written with '_': status 2, saying what to write instead, and nothing
    reaches mpiexec."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.py").write_text("")
    with pytest.raises(SystemExit) as exc:
        launch.main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_gpukv_runs_own_options_take_the_equals_form():
    """--max-restarts=K is gpukv run's own option (torchrun's spelling too)."""
    assert launch.split(["--max-restarts=3", "-n", "2", "prog.py"]) == (
        ["--max-restarts=3", "-n", "2"], [], ["prog.py"])

"""GPUKV_TIMELINE: a Chrome trace per process of the store's calls and their phases, nested
as they ran; nothing when off; a folder it cannot write is a warning, never an error;
under `gpukv run`, the ranks' traces only."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gpukv
from gpukv import timeline

from .distributed.mpirun import dies_with_us, require_mpi
from .launcher.test_launch import _finish


@pytest.fixture
def recording(tmp_path):
    timeline.start(tmp_path)
    yield tmp_path
    timeline.stop()


def _events(path) -> list:
    with open(path) as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _inside(inner: dict, outer: dict) -> bool:
    return (inner["tid"] == outer["tid"] and outer["ts"] <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3)


def test_store_calls_and_their_phases_are_nested_spans(recording):
    kv = gpukv.create("device")
    kv.init("w", np.zeros(1000, np.float32))
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.1))
    kv.push("w", [np.ones(1000, np.float32), np.ones(1000, np.float32)])
    kv.pull("w", out=np.zeros(1000, np.float32))
    kv.pushpull("w", [np.ones(1000, np.float32)] * 2, out=np.zeros(1000, np.float32))
    path = timeline.stop()
    assert path is not None and os.path.basename(path).startswith("gpukv-timeline-rank0-")
    events = _events(path)
    names = [e["name"] for e in events]
    assert {"init", "push", "pull", "check", "plan", "reduce", "update"} <= set(names)
    push = next(e for e in events if e["name"] == "push")
    for phase in ("plan", "reduce", "update"):
        assert any(_inside(e, push) for e in events if e["name"] == phase), phase
    pull = next(e for e in events if e["name"] == "pull")
    for phase in ("check", "broadcast"):
        assert any(_inside(e, pull) for e in events if e["name"] == phase), phase
    pushpull = next(e for e in events if e["name"] == "pushpull")
    for phase in ("check", "plan", "reduce", "update", "broadcast"):
        assert any(_inside(e, pushpull) for e in events if e["name"] == phase), phase
    assert all(e["dur"] >= 0 and e["pid"] == 0 for e in events)  # (the rank)
    with open(path) as f:
        trace = json.load(f)
    assert trace["otherData"] == {"rank": 0, "pid": os.getpid(),
                                  "ts": "microseconds since the Unix epoch"}
    assert abs(push["ts"] / 1e6 - time.time()) < 60  # on the wall clock, not the boot's


def test_a_write_that_fails_leaves_the_file_as_it_was(recording, monkeypatch):
    """A timeline write that fails half way (a full disk) raises, and leaves the file as
    the write before left it (valid JSON, no temporary file); the next write that
    succeeds writes the events of both."""
    kv = gpukv.create("local")
    kv.init(0, np.zeros(3))
    path = timeline.flush()
    before = open(path, "rb").read()
    kv.push(0, np.ones(3))
    real = os.pwrite

    def full_disk(fd, data, offset):  # bytes over those the file has: no room
        room = os.fstat(fd).st_size - offset
        if len(data) <= room:
            return real(fd, data, offset)
        real(fd, data[:room + (len(data) - room) // 2], offset)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(timeline.os, "pwrite", full_disk)
    with pytest.raises(OSError):
        timeline.flush()
    assert open(path, "rb").read() == before and os.listdir(recording) == [
        os.path.basename(path)]
    monkeypatch.undo()
    timeline.flush()
    names = [e["name"] for e in _events(path)]
    assert names[0] == "init" and names.count("push") == 1


def test_each_write_adds_the_new_events_only(recording):
    """A write keeps what the file holds and adds the events since the last one, which
    leave memory: a long run's writes cost its new events, not the whole trace again."""
    kv = gpukv.create("local")
    kv.init(0, np.zeros(3))
    path = timeline.flush()
    first = open(path, "rb").read()
    recorder = timeline._active
    assert recorder is not None and recorder.spans == []
    kv.push(0, np.ones(3))
    timeline.flush()
    second = open(path, "rb").read()
    tail = len(recorder.tail)
    assert second[:len(first) - tail] == first[:len(first) - tail]
    assert second.endswith(first[-tail:])
    assert recorder.spans == []
    names = [e["name"] for e in _events(path)]
    assert names.count("init") == 1 and names.count("push") == 1


def test_writes_come_by_count(recording, monkeypatch):
    """Every FLUSH_EVERY events, the events go to the file on their own."""
    kv = gpukv.create("local")
    kv.init(0, np.zeros(3))
    recorder = timeline._active
    timeline.flush()
    monkeypatch.setattr(timeline, "FLUSH_EVERY", 3)
    kv.pull(0, out=np.zeros(3))
    assert recorder.spans  # (a pull's spans: fewer than 3)
    for _ in range(3):
        kv.pull(0, out=np.zeros(3))
    assert len(recorder.spans) < 3
    assert [e["name"] for e in _events(recorder.path)].count("pull") >= 3


def _names(path) -> list:
    return [e["name"] for e in _events(path)]


def test_writes_come_on_time_whatever_the_program_does(tmp_path, monkeypatch):
    """FLUSH_SECONDS after a span ended, it is in the file, though the program records
    nothing more (a rank stalled, then killed): the writer thread wrote it. It writes
    nothing while nothing is new, and ends with the recording."""
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 0.2)
    timeline.start(tmp_path)
    recorder = timeline._active
    try:
        with timeline.span("before the stall"):
            pass
        deadline = time.monotonic() + 10
        while "before the stall" not in _names(recorder.path):
            assert time.monotonic() < deadline, "no write in 10 s"
            time.sleep(0.05)
        assert recorder.spans == []
        size = os.path.getsize(recorder.path)
        time.sleep(0.5)
        assert os.path.getsize(recorder.path) == size
    finally:
        timeline.stop()
    recorder.writer.join(timeout=10)
    assert not recorder.writer.is_alive()


def test_a_process_killed_outright_keeps_what_it_recorded_until_flush_seconds_before(
        tmp_path):
    """SIGKILL runs no handler: what a process recorded more than FLUSH_SECONDS before it
    is in its file (valid JSON), written by the writer thread while the program slept."""
    program = ("import sys, time\n"
               "from gpukv import timeline\n"
               "timeline.FLUSH_SECONDS = 0.2\n"
               "timeline.start(sys.argv[1])\n"
               "with timeline.span('recorded'):\n"
               "    pass\n"
               "print('ready', flush=True)\n"
               "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", program, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        time.sleep(1.5)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    (path,) = tmp_path.glob("gpukv-timeline-rank0-pid*.json")
    assert _names(path) == ["recorded"]


#: a program that records a span, says "ready", then sleeps argv[2] seconds and says
#: "alive"; BEFORE runs before gpukv is imported, AFTER once the recording started (none
#: but SIGTERM's write: FLUSH_SECONDS made endless)
_TERMINATED = """\
import os, signal, sys, time
def mine(signum, frame):
    print('mine', flush=True)
    sys.exit(7)
{before}
from gpukv import timeline
timeline.FLUSH_SECONDS = float('inf')
timeline.start(sys.argv[1])
{after}
with timeline.span('recorded'):
    pass
print('ready', flush=True)
time.sleep(float(sys.argv[2]))
print('alive', flush=True)
"""


@pytest.mark.parametrize("before, after, status, said", [
    ("", "", -signal.SIGTERM, []),
    ("signal.signal(signal.SIGTERM, mine)", "", 7, ["mine"]),
    ("", "signal.signal(signal.SIGTERM, mine)", 7, ["mine"]),
    ("signal.signal(signal.SIGTERM, signal.SIG_IGN)", "", 0, ["alive"]),
], ids=["default", "handler before", "handler after", "ignored"])
def test_sigterm_writes_the_timeline_and_does_what_it_did(tmp_path, before, after, status,
                                                          said):
    """A SIGTERM writes what the process recorded, then does what it did without the
    timeline: ends the process as by SIGTERM, runs the handler the program set (before
    the recording began, after it, at exit: SIGTERM's write, or exit's), or nothing
    where the program ignores it."""
    program = _TERMINATED.format(before=before, after=after)
    child = subprocess.Popen([sys.executable, "-c", program, str(tmp_path), "2"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
    assert (child.returncode, out.split()) == (status, said)
    (path,) = tmp_path.glob("gpukv-timeline-rank0-pid*.json")
    assert _names(path) == ["recorded"]


def test_the_thread_and_sigterms_handler_are_there_while_recording_only(tmp_path):
    """Off, nothing runs: no writer thread, SIGTERM as the program has it; a recording sets
    both up, and its end takes both away."""
    def writers():
        return [t for t in threading.enumerate() if t.name == "gpukv timeline writer"]
    before = signal.getsignal(signal.SIGTERM)
    assert not timeline.enabled() and writers() == []
    timeline.start(tmp_path)
    try:
        assert len(writers()) == 1
        assert signal.getsignal(signal.SIGTERM) is timeline._write_on_sigterm
    finally:
        timeline.stop()
    for writer in writers():
        writer.join(timeout=10)
    assert writers() == [] and signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_during_a_write_comes_after_it(tmp_path, monkeypatch):
    """A SIGTERM handled while this thread writes the timeline (a flush() it interrupted,
    or the write of an earlier SIGTERM) waits for that write to end: the events it
    writes are not lost (the process ends right after, as by SIGTERM)."""
    program = ("import os, signal, sys\n"
               "from gpukv import timeline\n"
               "timeline.FLUSH_SECONDS = float('inf')\n"
               "timeline.start(sys.argv[1])\n"
               "with timeline.span('recorded'):\n"
               "    pass\n"
               "real = os.pwrite\n"
               "def slow(fd, data, at):\n"
               "    os.kill(os.getpid(), signal.SIGTERM)  # (handled on the next line)\n"
               "    return real(fd, data, at)\n"
               "os.pwrite = slow\n"
               "timeline.flush()\n"
               "print('not ended', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", program, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (-signal.SIGTERM, ""), done.stderr
    (path,) = tmp_path.glob("gpukv-timeline-rank0-pid*.json")
    assert _names(path) == ["recorded"]


def test_a_forked_child_records_nothing(tmp_path):
    """A child forked while recording (a data loader's worker) records nothing (its
    spans would only pile up: the file is its parent's); the parent goes on recording,
    its writer thread too."""
    program = ("import os, sys, time\n"
               "from gpukv import timeline\n"
               "timeline.FLUSH_SECONDS = 0.2\n"
               "timeline.start(sys.argv[1])\n"
               "pid = os.fork()\n"
               "if pid == 0:\n"
               "    with timeline.span('in the child'):\n"
               "        pass\n"
               "    os._exit(0 if not timeline.enabled() else 1)\n"
               "_, status = os.waitpid(pid, 0)\n"
               "with timeline.span('in the parent'):\n"
               "    pass\n"
               "time.sleep(1.5)\n"
               "print(status, flush=True)\n"
               "os._exit(0)  # (no write at exit: the writer thread's alone)\n")
    done = subprocess.run([sys.executable, "-c", program, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "0\n"), done.stderr
    (path,) = tmp_path.glob("gpukv-timeline-rank0-pid*.json")
    assert _names(path) == ["in the parent"]


def test_a_span_argument_json_cannot_hold_is_written_as_its_value_or_str(recording):
    """A diagnostic never fails on what it is shown: NumPy scalars keep their value,
    anything else JSON has no form for is its str."""
    with timeline.span("step", step=np.int64(7), ratio=np.float32(0.5), where=recording):
        pass
    (event,) = [e for e in _events(timeline.flush()) if e["name"] == "step"]
    assert event["args"] == {"step": 7, "ratio": 0.5, "where": str(recording)}


def test_a_folder_that_cannot_be_written_is_known_when_recording_starts(tmp_path,
                                                                        monkeypatch):
    """The file is made when recording starts: a folder that refuses it is start()'s
    ArgumentError naming it and the OS error, and GPUKV_TIMELINE's one RuntimeWarning at
    import, not a surprise at exit."""
    def refused(path, *args):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(timeline.os, "open", refused)
    with pytest.raises(gpukv.ArgumentError,
                       match=f"timeline folder '{tmp_path}'.*Permission denied"):
        timeline.start(tmp_path)
    assert not timeline.enabled()
    with pytest.warns(RuntimeWarning, match=r"cannot write in the folder .*Permission denied"):
        timeline._start_from_environment({"GPUKV_TIMELINE": str(tmp_path)})
    assert not timeline.enabled()


@pytest.mark.parametrize("value", ["", " ", "0", " 0 ", "off", "OFF", "none"])
def test_a_blank_or_zero_variable_records_nothing(tmp_path, monkeypatch, value):
    """GPUKV_TIMELINE blank, 0, off or none is off, as GPUKV_CALIBRATION's: no folder
    named ' ', '0' or 'off' is made in the working folder."""
    monkeypatch.chdir(tmp_path)
    timeline._start_from_environment({"GPUKV_TIMELINE": value})
    assert not timeline.enabled()
    assert not list(tmp_path.iterdir())


def test_recording_again_into_the_same_folder_writes_the_file_anew(tmp_path):
    """A process that stops and starts again into one folder writes the same file name:
    the file is begun anew, valid JSON with the new recording's spans alone (before, the
    longer first file's end stayed after the new one's)."""
    timeline.start(tmp_path)
    for _ in range(50):
        with timeline.span("first"):
            pass
    timeline.stop()
    timeline.start(tmp_path)
    try:
        with timeline.span("second"):
            pass
        path = timeline.flush()
    finally:
        timeline.stop()
    assert [e["name"] for e in _events(path)] == ["second"]


def test_a_start_that_fails_leaves_the_recording_running(tmp_path):
    """A path that is a file cannot be a folder: an ArgumentError, and the recording
    already running goes on into its own file."""
    (tmp_path / "first").mkdir()
    timeline.start(tmp_path / "first")
    try:
        (tmp_path / "a-file").write_text("")
        with pytest.raises(gpukv.ArgumentError, match="a-file"):
            timeline.start(tmp_path / "a-file")
        with timeline.span("after"):
            pass
        path = timeline.flush()
        assert os.path.dirname(path) == str(tmp_path / "first")
        assert [e["name"] for e in _events(path)] == ["after"]
    finally:
        timeline.stop()


def test_off_records_nothing_and_a_span_is_a_shared_null(tmp_path):
    assert not timeline.enabled()
    assert timeline.span("x") is timeline.span("y")
    assert timeline.stop() is None and timeline.flush() is None
    kv = gpukv.create("local")
    kv.init(1, np.zeros(3))
    kv.push(1, np.ones(3))
    assert os.listdir(tmp_path) == []


def test_the_environment_variable_records_a_process_and_its_trainer(tmp_path):
    """GPUKV_TIMELINE=DIR in a fresh process: at exit, its Chrome trace holds the
    Trainer's steps, each with the store's push inside."""
    pytest.importorskip("torch")
    program = (
        "import torch, gpukv.torch\n"
        "models = [torch.nn.Linear(4, 2) for _ in range(2)]\n"
        "t = gpukv.torch.Trainer(models, 'sgd', {'learning_rate': 0.1}, kvstore='local')\n"
        "for _ in range(3):\n"
        "    t.zero_grad()\n"
        "    for m in models:\n"
        "        m(torch.ones(3, 4)).sum().backward()\n"
        "    t.step()\n")
    env = dict(os.environ, GPUKV_TIMELINE=str(tmp_path))
    subprocess.run([sys.executable, "-c", program], check=True, env=env, timeout=120)
    (path,) = tmp_path.glob("gpukv-timeline-rank0-pid*.json")
    events = _events(path)
    steps = [e for e in events if e["name"] == "Trainer.step"]
    assert [e["args"]["step"] for e in steps] == [0, 1, 2]
    pushes = [e for e in events if e["name"] == "push"]
    assert all(any(_inside(p, s) for p in pushes) for s in steps)


def test_snapshot_writes_are_spans_of_their_own_thread(recording):
    kv = gpukv.create("local")
    kv.init("w", np.zeros(8, np.float32))
    kv.snapshot(recording / "snaps", step=1)
    kv.finish_snapshots()
    events = _events(timeline.stop())
    writes = [e for e in events if e["name"] == "snapshot write"]
    snapshot = next(e for e in events if e["name"] == "snapshot")
    assert writes and all(w["tid"] != snapshot["tid"] for w in writes)
    assert any(w["args"]["file"].startswith("shard") for w in writes), writes


def _thread_names(path) -> list:
    """(tid, name) of every thread the trace names, in order."""
    with open(path) as f:
        trace = json.load(f)
    return [(e["tid"], e["args"]["name"]) for e in trace["traceEvents"]
            if e["name"] == "thread_name"]


def test_a_stores_snapshot_writes_are_one_row_however_many(recording):
    """Snapshots taken one by one, the writer idle between them (as in a training loop),
    are written by one thread: one "gpukv-snapshots" row in the trace, not one each."""
    kv = gpukv.create("local")
    kv.init("w", np.zeros(8, np.float32))
    for step in range(1, 6):
        kv.snapshot(recording / "snaps", step=step)
        kv.finish_snapshots()
        time.sleep(0.01)  # (the steps between two snapshots)
    path = timeline.stop()
    rows = [tid for tid, name in _thread_names(path) if name == "gpukv-snapshots"]
    writes = [e for e in _events(path) if e["name"] == "snapshot write"]
    assert len(rows) == 1 and len(writes) == 10
    assert {w["tid"] for w in writes} == set(rows)


def test_threads_that_ended_are_forgotten_once_their_names_are_written(recording):
    """Threads that record spans and end (a long job starts many) are kept track of only
    until the file names them: the trace names each, the recorder holds none of them."""
    def one_span():
        with timeline.span("work"):
            pass
    ids = []
    for i in range(20):
        thread = threading.Thread(target=one_span, name=f"short-lived {i}")
        thread.start()
        thread.join()
        ids.append(thread.native_id)
        if i % 5 == 4:
            timeline.flush()
    recorder = timeline._active
    assert recorder is not None
    assert not set(ids) & set(recorder.threads)
    assert not {tid for tid, _ in recorder.named} & set(ids)
    named = dict(_thread_names(timeline.stop()))
    assert [named.get(tid) for tid in ids] == [f"short-lived {i}" for i in range(20)]


def test_spans_show_in_torch_profiler(recording):
    torch = pytest.importorskip("torch")
    kv = gpukv.create("local")
    kv.init("w", np.zeros(8, np.float32))
    with torch.profiler.profile() as prof:
        kv.push("w", np.ones(8, np.float32))
    names = {e.key for e in prof.key_averages()}
    assert {"gpukv.push", "gpukv.reduce"} <= names, names


def _python(program: str, folder, cwd) -> subprocess.CompletedProcess:
    """`python -c program` with GPUKV_TIMELINE=folder, in `cwd`."""
    env = dict(os.environ, GPUKV_TIMELINE=str(folder))
    return subprocess.run([sys.executable, "-c", program], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _runtime_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "RuntimeWarning" in line]


@pytest.mark.parametrize("folder", ["afile", "afile/sub"], ids=["a file", "under a file"])
def test_a_folder_that_cannot_be_made_warns_once_and_records_nothing(tmp_path, folder):
    """GPUKV_TIMELINE naming a file, or a folder that cannot be made: `import gpukv` and
    the store work, one RuntimeWarning names the variable, the path and the OS error, and
    nothing is recorded."""
    (tmp_path / "afile").write_text("not a folder")
    done = _python("import numpy as np, gpukv\n"
                   "kv = gpukv.create('local')\n"
                   "kv.init(0, np.zeros(3))\n"
                   "print(gpukv.timeline.enabled())\n", folder, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    (warning,) = _runtime_warnings(done.stderr)
    assert f"GPUKV_TIMELINE: cannot write in the folder {folder!r} ([Errno " in warning, warning
    assert os.listdir(tmp_path) == ["afile"]


def test_a_timeline_that_cannot_be_written_at_exit_warns(tmp_path):
    """A timeline folder gone by the exit: the process ends as it would have, with one
    RuntimeWarning naming the file it could not write."""
    done = _python("import shutil, gpukv\n"
                   "shutil.rmtree('tl')\n", "tl", tmp_path)
    assert done.returncode == 0, done.stderr
    (warning,) = _runtime_warnings(done.stderr)
    assert "GPUKV_TIMELINE: cannot write " in warning and "gpukv-timeline-rank" in warning


@pytest.mark.parametrize("argv", [["info"], ["cluster", "--help"], ["bench", "--help"]])
def test_a_command_that_calls_no_store_writes_no_timeline(argv, tmp_path):
    """`gpukv info` (or `export`, `cluster`, `gpucheck`, or any command asked for its
    help) calls no store in its own process: an empty trace named rank 0 would only
    mislead."""
    env = dict(os.environ, GPUKV_TIMELINE=str(tmp_path / "tl"))
    done = subprocess.run([sys.executable, "-m", "gpukv", *argv], env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not list((tmp_path / "tl").glob("*.json"))


@pytest.mark.mpi
def test_gpukv_run_writes_the_ranks_timelines_only(tmp_path):
    """Under `gpukv run -n 2`, the ranks write a timeline each; the launcher, which
    imports gpukv too, writes none of its own."""
    require_mpi()
    (tmp_path / "prog.py").write_text("import gpukv\n")
    env = dict(os.environ, GPUKV_TIMELINE=str(tmp_path / "tl"))
    launcher = subprocess.Popen([sys.executable, "-m", "gpukv", "run", "-n", "2",
                                 str(tmp_path / "prog.py")], env=env, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=dies_with_us())
    status, _, err, _ = _finish(launcher, 120)  # (which ends the job if it overruns)
    assert status == 0, err
    names = sorted(os.listdir(tmp_path / "tl"))
    assert [name.split("-pid")[0] for name in names] == [
        "gpukv-timeline-rank0", "gpukv-timeline-rank1"], names
    assert not any(f"-pid{launcher.pid}." in name for name in names), names


@pytest.mark.mpi
def test_a_job_that_aborts_leaves_each_ranks_timeline(tmp_path):
    """A rank's uncaught exception aborts the MPI job: that rank writes its events before
    the abort, and the rank the abort kills leaves the file it made at the start (each
    valid JSON): the run that failed is the one whose timeline is wanted."""
    require_mpi()
    (tmp_path / "prog.py").write_text(
        "import numpy as np, gpukv\n"
        "kv = gpukv.create('dist_sync')\n"
        "kv.init('w', np.zeros(4))\n"
        "for _ in range(3):\n"
        "    kv.push('w', np.ones(4))\n"
        "kv.barrier()\n"
        "if kv.rank == 1:\n"
        "    raise RuntimeError('rank 1 fails')\n"
        "kv.barrier()\n")
    env = dict(os.environ, GPUKV_TIMELINE=str(tmp_path / "tl"), GPUKV_DIST_TIMEOUT="30")
    launcher = subprocess.Popen([sys.executable, "-m", "gpukv", "run", "-n", "2",
                                 str(tmp_path / "prog.py")], env=env, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=dies_with_us())
    status, _, err, _ = _finish(launcher, 120)
    assert status != 0 and "rank 1 fails" in err, err
    (failed,) = (tmp_path / "tl").glob("gpukv-timeline-rank1-pid*.json")
    assert [e["name"] for e in _events(failed)].count("push") == 3
    (killed,) = (tmp_path / "tl").glob("gpukv-timeline-rank0-pid*.json")
    _events(killed)  # (valid JSON)


def test_a_forked_child_leaves_its_parents_file_alone(recording, monkeypatch):
    """A process forked while recording (a data loader's worker: another pid, the
    parent's recorder) does not write into the file its parent writes on. (The pid is
    patched rather than a process forked: a fork beside JAX's threads may deadlock.)"""
    kv = gpukv.create("local")
    kv.init(0, np.zeros(3))
    path = timeline.flush()
    before = open(path, "rb").read()
    monkeypatch.setattr(timeline.os, "getpid", lambda: os.getppid())
    with timeline.span("in the child"):
        pass
    assert timeline.flush() == path
    assert open(path, "rb").read() == before
    monkeypatch.undo()
    timeline.flush()
    assert "in the child" in [e["name"] for e in _events(path)]

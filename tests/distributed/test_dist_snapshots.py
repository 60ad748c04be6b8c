"""Snapshots of dist stores across MPI processes: a job resumes from another job's
snapshot on other numbers of processes and servers, bit for bit, with each worker's
user_state; a user_state one worker cannot save is an error on every worker; `keep` is
exact however late the files land; a spoiled snapshot is refused on every worker."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpukv.checkpoints import snapshots

from .. import gpu_env
from .mpirun import PROGRAMS, ok, run

pytestmark = pytest.mark.mpi


def _job(n: int, servers: int, *args: str) -> str:
    """stdout of `snapshots.py` on n processes with `servers` servers (n == 0: one
    process on a 'local' store, without MPI)."""
    env = gpu_env.subprocess_env(gpus=False)
    if n == 0:
        env["STORE"] = "local"
        result = subprocess.run([sys.executable, str(PROGRAMS / "snapshots.py"), *args],
                                capture_output=True, text=True, env=env, timeout=120)
        return ok(result)
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT="30")
    out = ok(run("snapshots.py", n, *args, env=env))
    for w in range(n - servers):
        assert f"PASS worker {w} of {n - servers}" in out, out
    return out


def _caught(out: str) -> list:
    """(worker, message) of every `CAUGHT ArgumentError` line (ranks print at once: lines
    may run into each other, so they are found by pattern, not by line)."""
    return re.findall(r"CAUGHT ArgumentError on worker (\d+): (.*?)(?=CAUGHT|PASS|DIGEST|$)",
                      out, re.M | re.S)


def _digests(out: str) -> set:
    return set(re.findall(r"DIGEST worker \d+ ([0-9a-f]{64})", out))


#: (processes, servers, steps up to): each job resumes from the one before
CHAINS = {
    "3x0-2x0-3x1": [(3, 0, 2), (2, 0, 4), (3, 1, 6)],
    "2x0-4x2": [(2, 0, 3), (4, 2, 6)],
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_jobs_resume_one_another_bit_for_bit(tmp_path, chain):
    """Each job of the chain resumes from the snapshot the one before took at its last
    step (on other numbers of processes and servers), every worker it had gets its own
    user_state back, and the last job's values equal one uninterrupted run's bits."""
    root = str(tmp_path / "snaps")
    before = None
    for n, servers, until in CHAINS[chain]:
        listing = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*")) \
            if before else []
        out = _job(n, servers, "train", root, str(until))
        workers = n - servers
        if before is None:
            assert "RESUMED" not in out, out
        else:
            for w in range(workers):
                assert f"RESUMED worker {w} step {before[0]} saved by {before[1]}" in out, \
                    (out, listing)
        assert len(_digests(out)) == 1, out
        before = (until, workers)
    reference = _job(0, 0, "train", str(tmp_path / "reference"), str(before[0]))
    assert _digests(out) == _digests(reference), (out, reference)


def test_a_user_state_one_worker_cannot_save_fails_everywhere(tmp_path):
    """A user_state that one worker cannot save raises ArgumentError on every worker (no
    hang), that worker's naming where; nothing is written, and the next snapshot is
    complete for every worker once finish_snapshots() returns there."""
    out = _job(3, 0, "bad_user_state", str(tmp_path / "snaps"))
    caught = _caught(out)
    assert sorted(int(w) for w, _ in caught) == [0, 1, 2], out
    messages = dict(caught)
    assert "user_state['bad']: a set cannot be saved" in messages["1"], out
    assert "another worker's user_state" in messages["0"], out


@pytest.mark.parametrize("overlap", ["", "overlap"])
def test_a_trainer_user_state_one_worker_cannot_save_fails_everywhere_at_once(tmp_path,
                                                                              overlap):
    """A Trainer whose one worker's user_state the due snapshot cannot save: step()
    raises ArgumentError on every worker at once (no worker waits out the timeout in a
    step the others never took), and the mended step goes ahead everywhere; with the
    reductions started by backward too."""
    pytest.importorskip("torch")
    out = _job(3, 0, "trainer_bad_user_state", str(tmp_path / "snaps"), overlap)
    caught = re.findall(r"CAUGHT ArgumentError on worker (\d) after ([\d.]+) s: "
                        r"(.*?)(?=CAUGHT|PASS|$)", out, re.M | re.S)
    assert sorted(int(w) for w, _, _ in caught) == [0, 1, 2], out
    assert all(float(took) < 5 for _, took, _ in caught), out
    messages = {w: m for w, _, m in caught}
    assert "user_state['bad']: a set cannot be saved" in messages["1"], out
    assert "another worker's cannot be saved" in messages["0"], out
    for w in range(3):
        assert f"PASS worker {w} of 3" in out, out


def test_a_trainer_updating_locally_resumes_bit_for_bit(tmp_path):
    """A Trainer with update_on_kvstore=False on a dist store snapshots (each worker a
    share of its replica's store): a job resumed from the step-3 snapshot ends as the
    uninterrupted job did, bit for bit, every worker with its own user_state; a job on
    fewer workers resumes from the last one."""
    pytest.importorskip("torch")
    root = tmp_path / "snaps"
    whole = _job(3, 0, "trainer_local_updates", str(root), "6")
    assert "RESUMED" not in whole and len(_digests(whole)) == 1, whole
    (third,) = [p for p in root.iterdir() if p.name.startswith("step-000000003-")]
    shards = sorted(p.name for p in third.iterdir())
    assert shards[:3] == [f"shard-0000{i}-of-00003.npz" for i in range(3)], shards
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(third, again / third.name)
    resumed = _job(3, 0, "trainer_local_updates", str(again), "6")
    for w in range(3):
        assert f"RESUMED worker {w} step 3 saved by 3 state {{'worker': {w}, 'step': 3}}" \
            in resumed, resumed
    assert _digests(resumed) == _digests(whole), (whole, resumed)
    # every worker resumed with worker 0's running statistics, which then went on as in
    # the uninterrupted job on worker 0 (the others' had their own there)
    # (digests are matched by their 16 hex digits: the ranks' lines reach us through
    # mpiexec, which has been seen to join one rank's line to the next rank's)
    assert len(set(re.findall(r"RESUMED worker \d .* buffers ([0-9a-f]{16})", resumed))) == 1, \
        resumed
    buffers = [dict(re.findall(r"BUFFERS worker (\d) ([0-9a-f]{16})", out))
               for out in (whole, resumed)]
    assert buffers[0]["0"] == buffers[1]["0"] and buffers[0]["1"] != buffers[1]["1"], buffers
    fewer = _job(2, 0, "trainer_local_updates", str(root), "8")
    for w in range(2):
        assert f"RESUMED worker {w} step 6 saved by 3 state {{'worker': {w}, 'step': 6}}" \
            in fewer, fewer
    assert len(_digests(fewer)) == 1, fewer


def _folders(out: str) -> list:
    (line,) = re.findall(r"FOLDERS ([^\s]*)", out)
    return line.split(",") if line else []


@pytest.mark.parametrize("n,servers,trainer",
                         [(3, 0, ""), (1, 0, ""), (0, 0, ""), (4, 1, ""), (3, 0, "trainer")],
                         ids=["3x0", "1x0", "local", "4x1", "3x0-trainer"])
def test_keep_is_exact_when_files_land_late(tmp_path, n, servers, trainer):
    """After snapshots of steps 1..5 with keep=2 (a store's `keep`, or a Trainer's
    checkpoint_keep) and finish_snapshots(), exactly the 2 newest snapshot folders are
    left, both complete, even when worker 0's own file of each snapshot lands first and
    the other files after it."""
    if trainer:
        pytest.importorskip("torch")
    root = tmp_path / "snaps"
    out = _job(n, servers, "keep", str(root), "2", "5", trainer)
    folders = _folders(out)
    assert [name.split("-")[1] for name in folders] == ["000000004", "000000005"], out
    assert [s.step for s in snapshots.complete_snapshots(root)] == [4, 5]


def test_snapshots_several_threads_take_at_once_each_have_a_step_of_their_own(tmp_path):
    """A dist store's snapshots taken by two threads of each worker at once, with no
    step, are numbered 1..6 on every worker alike: each call takes the step after the
    last snapshot's, whichever thread took that, and every snapshot is complete."""
    out = _job(2, 0, "threads", str(tmp_path / "snaps"))
    assert re.findall(r"STEPS ([\d,]*)", out) == ["1,2,3,4,5,6"], out


def test_a_shard_from_an_earlier_step_is_refused_on_every_worker(tmp_path):
    """A shard copied into the newest snapshot from an earlier step of the same run makes
    resume raise CheckpointError on every worker, naming the shard and both steps, and
    leaves every worker's values as they were."""
    root = tmp_path / "snaps"
    _job(3, 0, "train", str(root), "2")
    older, newest = sorted(p for p in root.iterdir())
    shard = snapshots.shard_file(1, 3)
    shutil.copyfile(older / shard, newest / shard)
    out = _job(3, 0, "refused", str(root))
    caught = re.findall(r"CAUGHT CheckpointError on worker (\d+): "
                        r"(.*?)(?=CAUGHT|UNCHANGED|PASS|$)", out, re.M | re.S)
    assert sorted(int(w) for w, _ in caught) == [0, 1, 2], out
    for _, message in caught:
        assert str(newest / shard) in message and "step 1" in message \
            and "step 2" in message, out
    for w in range(3):
        assert f"UNCHANGED worker {w}" in out, out


@pytest.mark.parametrize("n,servers", [(3, 0), (3, 1)], ids=["3x0", "3x1"])
def test_workers_loading_different_snapshots_are_refused_everywhere(tmp_path, n, servers):
    """Worker 0 loads the snapshot of step 1 and the others that of step 2 (each worker
    reads a snapshot's folder itself): a PeerMismatchError on every worker naming both
    folders, well within the timeout, before anything is read, where each worker would
    otherwise have resumed its shards from a snapshot of its own."""
    root = tmp_path / "snaps"
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS=str(servers), GPUKV_DIST_TIMEOUT="20")
    result = run("snapshots.py", n, "loads_differ", str(root), env=env, timeout=90)
    out = result.stdout + result.stderr
    caught = re.findall(r"CAUGHT PeerMismatchError on worker (\d+) after ([\d.]+) s: "
                        r"(.*?)(?=CAUGHT|PASS|$)", result.stdout, re.M | re.S)
    assert sorted(int(w) for w, _, _ in caught) == list(range(n - servers)), out
    first, second = (s.path for s in snapshots.complete_snapshots(root))
    assert "step-000000001-" in first and "step-000000002-" in second, (first, second)
    for _, took, message in caught:
        assert float(took) < 10, out
        assert message.startswith("load of ") and "processes disagree" in message and \
            f"calls load of {first!r}" in message and f"calls load of {second!r}" in message, out


@pytest.mark.parametrize("how,error,others", [
    ("step", "ArgumentError", "PeerMismatchError"),
    ("state", "ArgumentKindError", "ArgumentError")])
def test_a_snapshot_one_worker_alone_refuses_fails_every_worker_at_once(
        tmp_path, how, error, others):
    """Worker 1 alone refuses its snapshot's arguments (a step below its last, a
    user_state that is no dict): its own error, and on the others at once a
    PeerMismatchError naming the refusal (a step is checked before the call's
    agreement), or an ArgumentError saying another worker's user_state cannot be saved
    (agreed inside the call, after which the store goes on), rather than a wait for
    worker 1."""
    env = gpu_env.subprocess_env(gpus=False)
    env.update(GPUKV_NUM_SERVERS="0", GPUKV_DIST_TIMEOUT="20")
    result = run("snapshots.py", 3, "snapshot_refused_on_one", str(tmp_path / "snaps"), how,
                 env=env, timeout=90)
    out = result.stdout + result.stderr
    caught = re.findall(r"CAUGHT (\w+) on worker (\d+) after ([\d.]+) s", result.stdout)
    assert sorted((int(w), kind) for kind, w, _ in caught) == [
        (0, others), (1, error), (2, others)], out
    assert all(float(took) < 10 for _, _, took in caught), out
    assert all(f"PASS worker {w} of 3" in out for w in range(3)), out

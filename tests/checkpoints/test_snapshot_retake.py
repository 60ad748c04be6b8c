"""A snapshot taken again at the same step (a Trainer's `checkpoint_every` and its
`snapshot()` at one step) rewrites its folder; a process killed (SIGKILL) at any point of
that rewrite leaves the old snapshot, the new one, or a folder not taken for complete,
never one that mixes the two."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv.checkpoints import snapshots

from .. import gpu_env
from .retake_writer import SIZE, TAKES

WRITER = Path(__file__).resolve().parent / "retake_writer.py"

#: the file operations of the second take: its worker file removed, then the shard's and
#: the worker file's write and rename; one more: none is interrupted
OPERATIONS = 5


def _take(found: snapshots.Snapshot) -> str:
    """Which take `found` holds, checked to hold that take's values as well as its
    user_state."""
    take = found.user_state(0)["take"]
    kv = gpukv.create("local")
    kv.load(found)
    out = np.zeros(SIZE, np.float32)
    kv.pull(0, out=out)
    assert (out == TAKES[take]).all(), (found.path, take, out[:3])
    return take


@pytest.mark.parametrize("kill_at", range(1, OPERATIONS + 2))
def test_a_kill_while_a_step_is_taken_again_never_leaves_a_mixed_snapshot(tmp_path, kill_at):
    """Killed before the kill_at-th file operation of the second take of step 5: every
    complete snapshot holds the values and user_state of one take; the newest is the
    first take of step 5, the second, or (while the folder is rewritten) step 4; and
    kv.resume in another process loads the newest whole."""
    run = subprocess.run([sys.executable, str(WRITER), str(tmp_path), str(kill_at)],
                         capture_output=True, text=True, timeout=120,
                         env=gpu_env.subprocess_env(gpus=False))
    finished = run.returncode == 0
    assert finished or run.returncode == -signal.SIGKILL, run.stderr
    assert finished == (kill_at > OPERATIONS), (kill_at, run.stdout, run.stderr)
    takes = [_take(found) for found in snapshots.complete_snapshots(tmp_path)]
    assert takes[0] == "step 4"
    assert takes[1:] in ([], ["step 5, first"], ["step 5, second"])
    if finished:
        assert takes == ["step 4", "step 5, second"]
    kv = gpukv.create("local")
    kv.init(0, np.full(SIZE, 7, np.float32))
    found = kv.resume(tmp_path)
    out = np.zeros(SIZE, np.float32)
    kv.pull(0, out=out)
    assert (out == TAKES[takes[-1]]).all()
    assert found.user_state(0)["take"] == takes[-1]


def test_the_same_step_taken_again_holds_the_second_take(tmp_path):
    """Taken again at the same step, a snapshot's folder holds the second take whole:
    its values and its user_state."""
    kv = gpukv.create("local")
    kv.init(0, np.zeros(SIZE, np.float32))
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=1.0))
    first = kv.snapshot(tmp_path, 5, user_state={"take": "step 5, first"})
    kv.push(0, np.full(SIZE, -1, np.float32))
    second = kv.snapshot(tmp_path, 5, user_state={"take": "step 5, second"})
    kv.finish_snapshots()
    assert first == second
    (found,) = snapshots.complete_snapshots(tmp_path)
    assert _take(found) == "step 5, second"

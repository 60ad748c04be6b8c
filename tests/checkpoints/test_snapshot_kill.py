"""A process killed (SIGKILL) at any moment while it takes snapshots never leaves one
that is found as complete but does not load, or holds another step's values."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv.checkpoints import snapshots

from .. import gpu_env
from .snapshot_writer import SIZES, expected

WRITER = Path(__file__).resolve().parent / "snapshot_writer.py"


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.07, 0.12, 0.2, 0.3, 0.45, 0.7])
def test_kill_9_never_leaves_a_snapshot_that_passes_for_complete(tmp_path, delay):
    """SIGKILL `delay` s into the snapshot loop: every snapshot found complete (the
    newest among them) loads and holds exactly the values and user_state of its step,
    and every other folder is refused."""
    process = subprocess.Popen([sys.executable, str(WRITER), str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=gpu_env.subprocess_env(gpus=False))
    try:
        assert process.stdout.readline() == "looping\n", process.stderr.read()
        time.sleep(delay)
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate()
    assert process.returncode == -signal.SIGKILL
    complete = snapshots.complete_snapshots(tmp_path)
    latest = gpukv.latest_snapshot(tmp_path)
    assert latest == (complete[-1] if complete else None)
    for found in complete:
        kv = gpukv.create("local")
        kv.load(found)
        outs = [np.zeros(size, np.float32) for size in SIZES.values()]
        kv.pull(list(SIZES), out=outs)
        for key, out in zip(SIZES, outs):
            assert out.tobytes() == expected(key, found.step).tobytes(), (found, key)
        state = found.user_state(0)
        assert state["step"] == found.step
        assert state["check"].tobytes() == expected(2, found.step).tobytes()
    paths = {s.path for s in complete}
    for name in os.listdir(tmp_path):
        if os.path.join(tmp_path, name) not in paths:
            with pytest.raises(gpukv.CheckpointError):
                gpukv.create("local").load(tmp_path / name)

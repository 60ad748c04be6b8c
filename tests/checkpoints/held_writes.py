"""Snapshot files held back: what a test uses to push on while a snapshot is being
written, and so check that the snapshot holds what was staged when it was taken."""
from __future__ import annotations

import threading

from gpukv.checkpoints import snapshots


def hold_snapshot_writes(monkeypatch) -> threading.Event:
    """Make every snapshot file's write wait until the returned event is set."""
    release = threading.Event()
    write = snapshots.write_archive

    def held_write(*args, **kwargs):
        assert release.wait(30), "the test never let the write go"
        write(*args, **kwargs)
    monkeypatch.setattr(snapshots, "write_archive", held_write)
    return release

"""The prune a dist store's snapshots get at a normal exit, when no `finish_snapshots`
followed them: the `keep` newest stay, as `finish_snapshots` leaves them.

While a job runs, worker 0 prunes once its own files of a snapshot are written, counting
only complete snapshots; the newest may still lack another process's files then, so one
more may stay. At exit no process can say anything to another (the job's end is under
way), so the files tell: this process's writes end, and worker 0 waits, up to the
store's timeout, for the newest snapshot of each folder to be complete, then prunes.
What it needs is kept here, apart from the store: a store dropped before the program
ends leaves its snapshots' prune to the exit all the same.
"""
from __future__ import annotations

import atexit
import os
import time

from ..checkpoints import snapshots
from .mpi import job_exit


class ExitPrune:
    """The folders a store's snapshots went to since its last `finish_snapshots`."""

    def __init__(self, control, timeout: float):
        self._control = control  # the store's workers (its rank, and whether it failed)
        self._timeout = timeout
        self._pruning: dict = {}  # root -> keep
        self._newest: dict = {}  # root -> the folder of the last snapshot there
        self._registered = False

    def note(self, root: str, keep: int, folder: str) -> None:
        """A snapshot into `folder` under `root`, whose `keep` newest should stay."""
        self._pruning[root], self._newest[root] = keep, folder
        if not self._registered:
            self._registered = True
            atexit.register(self._at_exit)

    def take(self) -> dict:
        """{root: keep} of the snapshots since the last take (`finish_snapshots` prunes
        them itself), forgotten here."""
        pruning, self._pruning = self._pruning, {}
        return pruning

    def _at_exit(self) -> None:
        pruning = self.take()
        if not pruning or job_exit.forked() or self._control.failed():
            return
        snapshots.finish_writes()
        if self._control.rank != 0:
            return
        deadline = time.monotonic() + self._timeout
        for root, keep in pruning.items():
            newest = os.path.normpath(self._newest[root])
            while time.monotonic() < deadline and newest not in {
                    os.path.normpath(s.path) for s in snapshots.complete_snapshots(root)}:
                time.sleep(0.05)
            try:
                snapshots.prune(root, keep)  # (never one of the `keep` newest complete)
            except OSError:
                pass  # the folder went meanwhile: nothing to prune

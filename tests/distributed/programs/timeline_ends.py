"""Jobs of two workers whose end kills a rank, for what its timeline (GPUKV_TIMELINE) keeps:
`python -m mpi4py timeline_ends.py MODE`.

- stall: both make 5 pushpulls; then worker 1 sleeps a minute, and worker 0's sixth
  pushpull waits for it until GPUKV_DIST_TIMEOUT, raises PeerError, and the job is
  aborted (MPICH's mpiexec kills worker 1 with SIGKILL).
- sigterm FOLDER: the timeline is written on SIGTERM alone (FLUSH_SECONDS made endless):
  both make 3 pushpulls, then record a `tick` span every 20 ms, the first made, each says
  so in FOLDER/ticking-R (R its rank), until a SIGTERM ends them.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import gpukv
from gpukv import timeline


def main(mode: str, folder: str = "") -> None:
    if mode == "sigterm":
        timeline.FLUSH_SECONDS = float("inf")
    kv = gpukv.create("dist_sync")
    kv.init("w", np.zeros(64, np.float32))
    out = np.zeros(64, np.float32)
    for _ in range(5 if mode == "stall" else 3):
        kv.pushpull("w", np.ones(64, np.float32), out=out)
    if mode == "stall":
        if kv.rank == 1:
            time.sleep(60)
        kv.pushpull("w", np.ones(64, np.float32), out=out)  # waits for worker 1: PeerError
        return
    kv.barrier()
    with timeline.span("tick"):
        time.sleep(0.02)
    open(os.path.join(folder, f"ticking-{kv.rank}"), "w").close()
    while True:
        with timeline.span("tick"):
            time.sleep(0.02)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Programs the tests of ranks that ended launch: `mpiexec -n N python -m mpi4py
ended_ranks.py NAME [ARGS]`. GPUKV_NUM_SERVERS and GPUKV_DIST_TIMEOUT set the servers and
the timeout. A worker that gets a PeerError prints `CAUGHT PeerError on worker R after S
s: message`; one whose calls all went through prints `PASS worker R of W`."""
from __future__ import annotations

import sys
import time

import numpy as np

import gpukv


def _call(kv, call: str) -> None:
    if call == "push":
        kv.push(0, np.ones(4, np.float32))
        kv.pull(0, out=np.zeros(4, np.float32))
    else:
        kv.barrier()


def ends(how: str, victim: str, call: str) -> None:
    """Worker `victim` ends its program (`return`, or `exit`: sys.exit(0)) once the store
    is made, while the others make `call` (a push and a pull, or a barrier)."""
    kv = gpukv.create("dist_sync")
    kv.init(0, np.zeros(4, np.float32))
    kv.barrier()
    if kv.rank == int(victim):
        if how == "exit":
            sys.exit(0)
        return
    start = time.monotonic()
    try:
        _call(kv, call)
    except gpukv.PeerError as exc:
        print(f"CAUGHT {type(exc).__name__} on worker {kv.rank} after "
              f"{time.monotonic() - start:.2f} s: {exc}", flush=True)
        return
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def late_then_ends(seconds: str, calls: str, call: str = "barrier") -> None:
    """Worker 0 comes `seconds` late to the first of `calls` calls (barriers, or a push
    and a pull) and ends its program as soon as the last is done: it made every call, so
    every worker passes."""
    kv = gpukv.create("dist_sync")
    kv.init(0, np.zeros(4, np.float32))
    kv.barrier()
    if kv.rank == 0:
        time.sleep(float(seconds))
    for _ in range(int(calls)):
        _call(kv, call)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def creates_after_it_ended(victim: str) -> None:
    """Rank `victim` ends its program after the first store; the others make a second
    (num_servers=0), whose agreement on COMM_WORLD names it as ended."""
    kv = gpukv.create("dist_sync", num_servers=0)
    kv.barrier()
    if kv.rank == int(victim):
        return
    start = time.monotonic()
    try:
        gpukv.create("dist_sync", num_servers=0)
    except gpukv.PeerError as exc:
        print(f"CAUGHT {type(exc).__name__} on worker {kv.rank} after "
              f"{time.monotonic() - start:.2f} s: {exc}", flush=True)
        return
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])

"""Rounds that a `gpukv run --max-restarts` job starts again: `restarted.py FIRST LATER`.

Every worker pushes ones*(rank+1) into a small float32 key and pulls it back, FIRST rounds
on the first attempt (GPUKV_RUN_ATTEMPT 0: the test makes it fail meanwhile) and LATER
rounds on the next ones; after round i the value is 1 - lr*n(n+1)/2*(i+1), checked on every
pull. Each round prints `ROUND i attempt A worker R of N`, the end `PASS worker R of N in
attempt A`. A PeerError ends the process, as a user's would: the launcher restarts the job.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import gpukv


def main(first: int, later: int) -> None:
    attempt = int(os.environ["GPUKV_RUN_ATTEMPT"])
    kv = gpukv.create("dist_sync")
    lr, n, r = 0.01, kv.num_workers, kv.rank
    kv.init("w", np.ones(1024, np.float32))
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=lr))
    grad, out = np.full(1024, r + 1.0, np.float32), np.zeros(1024, np.float32)
    for i in range(first if attempt == 0 else later):
        print(f"ROUND {i} attempt {attempt} worker {r} of {n}", flush=True)
        kv.push("w", grad)
        kv.pull("w", out=out)
        expect = np.float32(1 - lr * n * (n + 1) / 2 * (i + 1))
        assert np.allclose(out, expect, atol=1e-4), (i, out[:3], expect)
    kv.barrier()
    print(f"PASS worker {r} of {n} in attempt {attempt}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

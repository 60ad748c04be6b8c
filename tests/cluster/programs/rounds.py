"""Training rounds for the fault tests:
`rounds.py ROUNDS ELEMENTS CHECKPOINT [COMPRESSION]`.

Every worker pushes ones*(rank+1) into one float32 key of ELEMENTS elements and pulls it
back, ROUNDS times, under SGD: after round i the value is 1 - lr*n(n+1)/2*(i+1), checked
on every pull. With a COMPRESSION the gradients cross compressed: 'sign' carries these
constant gradients and updates exactly, both ways; with 'powersgd' the key is a matrix of
ELEMENTS / 1024 rows (whose rank 4 carries these rank-1 sums whole).
Each worker prints `ROUND i` when a round starts and saves the store to CHECKPOINT after
round 1. A PeerError is printed as `CAUGHT PeerError on worker R after
S s: message` (S: seconds since the round began) and raised again, so the process ends
with it as a user's would.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import gpukv

COLUMNS = 1024  # of the matrix key PowerSGD compresses


def main(rounds: int, elements: int, checkpoint: str, compression: str = "none") -> None:
    kv = gpukv.create("dist_sync", bigarray_bound=1000)
    lr, n, r = 0.01, kv.num_workers, kv.rank
    shape = (elements // COLUMNS, COLUMNS) if compression == "powersgd" else (elements,)
    kv.init("w", np.ones(shape, np.float32))
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=lr))
    if compression != "none":
        kv.set_gradient_compression({"type": compression})
    grad, out = np.full(shape, r + 1.0, np.float32), np.zeros(shape, np.float32)
    for i in range(rounds):
        print(f"ROUND {i} worker {r}", flush=True)
        began = time.monotonic()
        try:
            kv.push("w", grad)
            kv.pull("w", out=out)
            if i == 1:
                kv.save(checkpoint)
        except gpukv.PeerError as exc:
            print(f"CAUGHT PeerError on worker {r} after {time.monotonic() - began:.1f} s: "
                  f"{exc}", flush=True)
            raise
        expect = np.float32(1 - lr * n * (n + 1) / 2 * (i + 1))
        assert np.allclose(out, expect, atol=1e-4), (i, out.reshape(-1)[:3], expect)
    kv.barrier()
    print(f"PASS worker {r} of {n}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5])

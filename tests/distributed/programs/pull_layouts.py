"""What workers pull of keys whose pulls travel compressed (`sign`, `ternary`), with or
without dedicated servers: `mpiexec -n N python -m mpi4py pull_layouts.py TYPE DTYPE OUT`
(GPUKV_NUM_SERVERS sets the servers). Each worker pushes 3 rounds of its own gradients of
two keys of DTYPE, one of them summing past float16's range, and worker 0 writes every
value it pulled to OUT (.npy, as float64) for the test to compare layouts."""
from __future__ import annotations

import sys

import numpy as np

import gpukv


def main(kind: str, dtype: str, out: str) -> None:
    dt = np.dtype(dtype)
    kv = gpukv.create("dist_sync")
    kv.set_gradient_compression({"type": kind})
    kv.init(["h", "big"], [np.zeros(300, dt), np.zeros(64, dt)])
    h, big = np.empty(300, dt), np.empty(64, dt)
    pulled = []
    for step in range(3):
        g = np.random.default_rng(10 * kv.rank + step).standard_normal(300).astype(dt)
        kv.push(["h", "big"], [g, np.full(64, 40000, dt)])
        kv.pull(["h", "big"], out=[h, big])
        pulled += [h.astype(np.float64), big.astype(np.float64)]
    if kv.rank == 0:
        np.save(out, np.concatenate(pulled))
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

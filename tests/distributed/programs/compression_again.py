"""Compression set again, the same, mid-run: `mpiexec -n P python -m mpi4py
compression_again.py` (GPUKV_NUM_SERVERS: 0 or 1). Every residual starts afresh, the
servers' pull residuals too, so that the pulls are alike in every layout. Worker 0
prints `PULL <step> <sha1>` after each of 6 rounds of 'sign' from 2 workers (the second
set before round 3), without an updater and with SGD."""
from __future__ import annotations

import hashlib

import numpy as np

import gpukv

kv = gpukv.create("dist_sync")
worker = kv.rank
for updates in (False, True):
    key = f"w{int(updates)}"
    kv.init(key, np.zeros(700, np.float32))
    if updates:
        kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.1))
    kv.set_gradient_compression({"type": "sign"})
    for step in range(6):
        if step == 3:
            kv.set_gradient_compression({"type": "sign"})
        rng = np.random.default_rng(10 * step + worker)
        kv.push(key, rng.standard_normal(700).astype(np.float32))
        out = np.empty(700, np.float32)
        kv.pull(key, out=out)
        if worker == 0:
            print(f"PULL {key} {step} {hashlib.sha1(out.tobytes()).hexdigest()}", flush=True)

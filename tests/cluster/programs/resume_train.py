"""Training that snapshots as it goes and resumes from its newest complete snapshot:
`resume_train.py CHECKPOINT_DIR STEPS EVERY OUT [SERVERS]`.

A Trainer over a dist_sync store (SERVERS dedicated servers, 0 by default) takes `STEPS`
SGD-with-momentum steps, a snapshot every `EVERY`, kept all (the tests restart by hand
from any of them). Worker w's batch at step s is drawn from a generator worker w keeps in
its `user_state`, seeded from (s, w) the first time, so a resumed run draws what the
uninterrupted one would. Each step prints "step S of W workers"; worker 0 writes the
final weights to OUT (.npz). GPUKV_TEST_STEP_SECONDS stretches every step (a test then has
time to strike mid-run).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
from torch import nn

import gpukv
import gpukv.torch as gt


def main(directory: str, steps: int, every: int, out: str, servers: int = 0) -> None:
    kv = gpukv.create("dist_sync", num_servers=servers)  # a server serves in here, exits
    rank, size = kv.rank, kv.num_workers
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    trainer = gt.Trainer([model], "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                         kvstore=kv, checkpoint_dir=directory, checkpoint_every=every,
                         checkpoint_keep=1000)
    pause = float(os.environ.get("GPUKV_TEST_STEP_SECONDS", "0"))
    batch = 16
    g = torch.Generator()
    if "rng" in trainer.user_state:
        g.set_state(trainer.user_state["rng"])
    else:
        g.manual_seed(1000 * trainer.steps + rank)
    for step in range(trainer.steps, steps):
        x = torch.randn(batch, 32, generator=g)
        y = torch.randint(0, 4, (batch,), generator=g)
        trainer.zero_grad()
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        trainer.user_state["rng"] = g.get_state()  # as it is for the next step
        trainer.step(batch * size)
        print(f"step {step + 1} of {size} workers", flush=True)
        time.sleep(pause)
    trainer.finish_snapshots()
    if rank == 0:
        np.savez(out, *[p.detach().numpy() for p in model.parameters()])
    print(f"PASS worker {rank} of {size}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
         *(int(a) for a in sys.argv[5:]))
    sys.stdout.flush()

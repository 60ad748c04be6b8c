"""50 Adam steps of the Trainer on a deterministic store, from any layout:
`[mpiexec -n P python -m mpi4py] adam_digest.py REPLICAS BUCKET_BYTES STORE [ON_STORE]`.

Every replica (global index: worker-major) trains on its own batches, the same in every
layout; worker 0 prints `DIGEST weights <sha1>` of its weights after the last step.
DIGEST_DEFAULT=1 makes the store in its default order instead; DIGEST_POWERSGD=1 has the
Trainer compress with PowerSGD (rank 2: every weight matrix).
"""
from __future__ import annotations

import hashlib
import os
import sys

import torch
from torch import nn

import gpukv
import gpukv.torch as gt

STEPS = 50
BATCH = 8


def main(replicas: int, bucket_bytes: int, store: str, on_store: str = "1") -> None:
    torch.set_num_threads(1)  # the same kernels' arithmetic in every layout
    # DIGEST_DEFAULT=1: the store's default order, to show that layouts differ there
    deterministic = os.environ.get("DIGEST_DEFAULT") != "1"
    kv = gpukv.create(store, deterministic=deterministic)  # a server process serves here
    rank, workers = getattr(kv, "rank", 0), getattr(kv, "num_workers", 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(),
                          nn.Linear(48, 10))
    modules = [model] + [_copy(model) for _ in range(replicas - 1)]
    compression = ({"type": "powersgd", "rank": 2}
                   if os.environ.get("DIGEST_POWERSGD") == "1" else None)
    trainer = gt.Trainer(modules, "adam", {"learning_rate": 0.01}, kvstore=kv,
                         update_on_kvstore=on_store == "1", bucket_bytes=bucket_bytes,
                         compression_params=compression)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total = BATCH * replicas * workers
    for step in range(STEPS):
        for r, module in enumerate(modules):
            g = torch.Generator().manual_seed(step * 1000 + rank * replicas + r)
            x = torch.randn(BATCH, 32, generator=g) * 3
            y = torch.randint(0, 10, (BATCH,), generator=g)
            loss_fn(module(x), y).backward()
        trainer.step(total)
        trainer.zero_grad()
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    if rank == 0:
        print(f"DIGEST weights {h.hexdigest()[:12]}", flush=True)  # one write: ranks share stdout
    print(f"PASS worker {rank} of {workers}", flush=True)


def _copy(model):
    import copy
    return copy.deepcopy(model)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])

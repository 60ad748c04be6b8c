"""A torchrun-style DDP script, moved to gpukv: one process per replica, started by
`gpukv run` (torchrun's counterpart), a `dist_sync` store, `gpukv.torch.Trainer` in
DDP's loss convention, a `DistributedSampler` from the Trainer's `num_replicas` and
`replica_index`, snapshots it resumes from, and a safetensors export at the end.

    .venv/bin/python -m gpukv run -n 2 examples/torch_dist_train.py --out run1
    .venv/bin/python -m gpukv run -n 2 examples/torch_dist_train.py --out run1   # resumes
    .venv/bin/python -m gpukv run -n 3 examples/torch_dist_train.py --out run1 --epochs 4
    .venv/bin/python -m gpukv export run1/checkpoints run1/model.safetensors

The third line resumes on 3 workers, the third one taking worker 0's `user_state` (the
epoch). Each line of DDP it replaces is named beside it. Exits with status 1 on any worker if the
loss does not fall or the workers' weights differ.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukv
import gpukv.torch


def make_data(n: int = 2048, seed: int = 0) -> TensorDataset:
    """Labels from a fixed random teacher network: the same data on every worker."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return TensorDataset(x, y)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="run", help="folder for the snapshots (default: run)")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)

    kv = gpukv.create("dist_sync")           # dist.init_process_group("gloo")
    torch.manual_seed(0)                     # the same start on every worker (as DDP's
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))  # broadcast)
    trainer = gpukv.torch.Trainer(           # DDP(model) + torch.optim.SGD
        model, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv,
        checkpoint_dir=Path(args.out) / "checkpoints", checkpoint_every=20)
    sampler = DistributedSampler(make_data(), num_replicas=trainer.num_replicas,
                                 rank=trainer.replica_index(0), seed=0)
    loader = DataLoader(make_data(), batch_size=32, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()          # a mean per replica: DDP's convention
    # a resumed run goes on from its epoch, on any number of workers: worker 0's, which
    # a worker the snapshot did not have takes too
    first = trainer.saved_user_state(0).get("epoch", 0) if trainer.resumed_from else 0
    losses = []
    with trainer:                            # at the end: a last snapshot, all written
        for epoch in range(first, args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                trainer.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                trainer.step()               # optimizer.step(): the mean over workers
                losses.append(loss.item())
            trainer.user_state["epoch"] = epoch + 1
            if kv.rank == 0:
                print(f"epoch {epoch}: loss {sum(losses[-10:]) / 10:.4f}", flush=True)
    return _check(kv, model, losses if first == 0 else [])


def _check(kv, model, losses) -> int:
    """1 unless every worker holds the same weights and, in a run that started afresh,
    the loss fell (its last ten steps' mean below its first ten's)."""
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).digest()
    mine = int.from_bytes(digest[:7], "little")
    agreed = kv.workers_max([mine, -mine], "the weights' digest")
    same = agreed[0] == -agreed[1]
    fell = not losses or sum(losses[-10:]) < sum(losses[:10])
    if kv.rank == 0:
        print(f"workers hold the same weights: {same}; loss fell: {fell}", flush=True)
    return 0 if same and fell else 1


if __name__ == "__main__":
    sys.exit(main())

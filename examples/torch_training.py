"""Data-parallel PyTorch training with `gpukv.torch.Trainer` (gluon's Trainer, for PyTorch).

The same job as examples/torch_training_by_hand.py, written with the Trainer: it keys every
parameter (small ones fused into one flat buffer per replica), starts every replica from
replica 0's weights, and `trainer.step(batch_size)` pushes the gradients, runs SGD on the
store and pulls the new weights into every replica in place.

    python examples/torch_training.py                 # every GPU, or 4 CPU replicas
    python examples/torch_training.py --replicas 2 --steps 200

Exits with status 1 if the loss does not fall or the replicas drift apart.
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

import gpukv
import gpukv.torch


def make_data(n: int, dim: int, classes: int, seed: int):
    """A synthetic classification task: labels from a fixed random teacher network."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, classes, generator=g)
    y = (torch.tanh(x) @ teacher).argmax(dim=1)
    return x, y


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas (default: every CUDA device, else 4 CPU replicas)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = args.replicas or gpus or 4
    if n < 1:
        p.error("--replicas must be >= 1")
    devices = [torch.device("cuda", i % gpus) if gpus else torch.device("cpu")
               for i in range(n)]
    print(f"torch {torch.__version__}, gpukv {gpukv.__version__}: {n} replica(s) on "
          f"{f'{gpus} CUDA device(s)' if gpus else 'the CPU'}")

    dim, hidden, classes = 32, 64, 4
    x, y = make_data(8192, dim, classes, args.seed)
    base = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, classes))
    models = [copy.deepcopy(base).to(d) for d in devices]
    trainer = gpukv.torch.Trainer(models, "sgd", {"learning_rate": args.lr},
                                  kvstore="device" if gpus else "local")

    loss_fn = nn.CrossEntropyLoss(reduction="sum")  # step() divides by the batch size
    shard = max(1, args.batch // n)
    losses = []
    g = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (shard * n,), generator=g)
        trainer.zero_grad()
        step_loss = 0.0
        for r, (model, dev) in enumerate(zip(models, devices)):
            part = idx[r * shard:(r + 1) * shard]
            loss = loss_fn(model(x[part].to(dev)), y[part].to(dev))
            loss.backward()
            step_loss += loss.item() / (shard * n)
        trainer.step(shard * n)
        losses.append(step_loss)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {step_loss:.4f}")

    with torch.no_grad():
        drift = max(float((a.detach().cpu() - b.detach().cpu()).abs().max())
                    for m in models[1:]
                    for a, b in zip(m.parameters(), models[0].parameters()))
    window = max(1, len(losses) // 10)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first/last {window} steps); "
          f"replica drift {drift:.2e}; {len(trainer.keys)} key(s) for "
          f"{sum(1 for _ in base.parameters())} parameters")
    if not last < 0.7 * first:
        print("FAILED: the loss did not fall", file=sys.stderr)
        return 1
    if drift > 1e-5:
        print("FAILED: the replicas hold different weights", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

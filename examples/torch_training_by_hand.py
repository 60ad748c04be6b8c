"""Data-parallel PyTorch training with gradients summed by gpukv, without copies.

Every replica (one per CUDA device, or several CPU replicas when there is no GPU) keeps
its own copy of a small MLP and computes gradients on its shard of each batch. The
gradients go to the store as the `p.grad` tensors themselves (PyTorch tensors are used
through `__cuda_array_interface__` on GPUs and `Tensor.numpy()` on the CPU, so nothing is
copied), the store sums them and applies SGD on the key's home device, and every replica
pulls the new weights straight into `p.data`, in place. examples/torch_training.py does the
same with `gpukv.torch.Trainer`, in a few lines (and faster: small parameters share keys).

    python examples/torch_training_by_hand.py          # every GPU, or 4 CPU replicas
    python examples/torch_training_by_hand.py --replicas 2 --steps 200

Exits with status 1 if the loss does not fall or the replicas drift apart.
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

import gpukv


def make_data(n: int, dim: int, classes: int, seed: int):
    """A synthetic classification task: labels from a fixed random teacher network."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, classes, generator=g)
    y = (torch.tanh(x) @ teacher).argmax(dim=1)
    return x, y


def make_model(dim: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, classes))


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
    if torch.cuda.is_available():
        n = args.replicas or torch.cuda.device_count()
        devices = [torch.device("cuda", i % torch.cuda.device_count()) for i in range(n)]
        kv = gpukv.create("device")  # reduce and update on the GPUs
        where = f"{n} replica(s) on {torch.cuda.device_count()} CUDA device(s)"
    else:
        n = args.replicas or 4
        devices = [torch.device("cpu")] * n
        kv = gpukv.create("local")  # reduce and update on the host
        where = f"no GPU: {n} CPU replicas"
    if n < 1:
        p.error("--replicas must be >= 1")
    print(f"torch {torch.__version__}, gpukv {gpukv.__version__}: {where}")

    dim, hidden, classes = 32, 64, 4
    x, y = make_data(8192, dim, classes, args.seed)
    base = make_model(dim, hidden, classes)
    models = [copy.deepcopy(base).to(d) for d in devices]
    params = [list(m.parameters()) for m in models]
    keys = list(range(len(params[0])))

    # The store owns the weights: initialised from replica 0, then SGD on every push.
    kv.init(keys, [q.data for q in params[0]])
    lr, replicas = args.lr, n

    def sgd(key, grad, weight):
        # `grad` is the sum over replicas of per-shard mean gradients.
        weight -= (lr / replicas) * grad

    kv.set_updater(sgd)
    # Every replica starts from the store's weights (pulled in place into p.data).
    kv.pull(keys, out=[[params[r][k].data for r in range(n)] for k in keys])

    loss_fn = nn.CrossEntropyLoss()
    grads = None
    shard = max(1, args.batch // n)
    losses = []
    g = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (shard * n,), generator=g)
        step_loss = 0.0
        for r, (model, dev) in enumerate(zip(models, devices)):
            xb = x[idx[r * shard:(r + 1) * shard]].to(dev, non_blocking=True)
            yb = y[idx[r * shard:(r + 1) * shard]].to(dev, non_blocking=True)
            model.zero_grad(set_to_none=False)  # keep the same grad tensors every step
            loss = loss_fn(model(xb), yb)
            loss.backward()
            step_loss += loss.item() / n
        if grads is None:  # the grad tensors exist now and keep their memory from here on
            grads = [[params[r][k].grad for r in range(n)] for k in keys]
            weights = [[params[r][k].data for r in range(n)] for k in keys]
        # On GPUs the store orders its work after CuPy's current stream, and that stream
        # after its work; by default it is the legacy default stream PyTorch uses too, so
        # no synchronisation is needed.
        kv.push(keys, grads)
        kv.pull(keys, out=weights)
        losses.append(step_loss)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {step_loss:.4f}")

    with torch.no_grad():
        drift = max(float((params[r][k].detach().cpu() - params[0][k].detach().cpu())
                          .abs().max())
                    for r in range(n) for k in keys)
        full = loss_fn(models[0](x.to(devices[0])), y.to(devices[0])).item()
    window = max(1, len(losses) // 10)
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first/last {window} steps); "
          f"full-data loss {full:.4f}; replica drift {drift:.2e}")
    if not last < 0.7 * first:
        print("FAILED: the loss did not fall", file=sys.stderr)
        return 1
    if drift > 1e-5:
        print("FAILED: the replicas hold different weights", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

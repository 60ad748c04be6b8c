"""Data-parallel training with `kv.set_optimizer`: SGD with momentum, then Adam.

A two-layer regression model is trained on every device (each GPU when CuPy sees some,
else 4 host "devices"): each device computes the gradient of its shard of the batch,
one list push sums them and runs the optimizer on each key's home device, and one list
pull gives every device the new weights. The loss printed falls step after step.

    python examples/train_set_optimizer.py [--steps 60]
"""
from __future__ import annotations

import argparse

import numpy as np

import gpukv


def devices():
    """(array module, list of device contexts): GPUs if CuPy sees any, else 4 host slots."""
    try:
        import cupy as cp
        n = cp.cuda.runtime.getDeviceCount()
    except Exception:
        n = 0
    if n:
        return cp, [cp.cuda.Device(i) for i in range(n)]
    import contextlib
    return np, [contextlib.nullcontext() for _ in range(4)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)

    xp, ctxs = devices()
    rng = np.random.default_rng(0)
    n, d, h = 512 * len(ctxs), 16, 32
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((d, 1)).astype(np.float32))
    shards = []
    for i, ctx in enumerate(ctxs):
        with ctx:
            part = slice(i * n // len(ctxs), (i + 1) * n // len(ctxs))
            shards.append((xp.asarray(x[part]), xp.asarray(y[part])))
    init = {"w1": (rng.standard_normal((d, h)) * 0.3).astype(np.float32),
            "b1": np.zeros(h, np.float32),
            "w2": (rng.standard_normal((h, 1)) * 0.3).astype(np.float32),
            "b2": np.zeros(1, np.float32)}
    keys = list(init)

    def replicas(values):
        out = []
        for ctx in ctxs:
            with ctx:
                out.append([xp.array(values[k], copy=True) for k in keys])
        return out

    def step(kv, params):
        grads, loss = [], 0.0
        for ctx, (xs, ys), (w1, b1, w2, b2) in zip(ctxs, shards, params):
            with ctx:
                a = xs @ w1 + b1
                z = xp.tanh(a)
                err = z @ w2 + b2 - ys
                loss += float((err * err).sum())
                g = 2 * err / n                      # d loss / d output (mean over all)
                dz = (g @ w2.T) * (1 - z * z)
                grads.append([xs.T @ dz, dz.sum(0), z.T @ g, g.sum(0)])
        kv.push(keys, [[grads[i][j] for i in range(len(ctxs))] for j in range(len(keys))])
        kv.pull(keys, out=[[params[i][j] for i in range(len(ctxs))] for j in range(len(keys))])
        return loss / n

    kind = "device" if xp is not np else "local"
    print(f"{len(ctxs)} {'GPU' if xp is not np else 'host'} device(s), store {kind!r}")
    for name, opt in [("SGD momentum", gpukv.optim.SGD(learning_rate=0.1, momentum=0.9)),
                      ("Adam", gpukv.optim.create("adam", learning_rate=0.01))]:
        kv = gpukv.create(kind)
        kv.init(keys, [init[k] for k in keys])
        kv.set_optimizer(opt)
        params = replicas(init)
        losses = [step(kv, params) for _ in range(args.steps)]
        for s in range(0, args.steps, max(1, args.steps // 6)):
            print(f"  {name:12s} step {s + 1:3d}  loss {losses[s]:.5f}")
        print(f"  {name:12s} step {args.steps:3d}  loss {losses[-1]:.5f}")
        assert losses[-1] < losses[0] / 2, "the loss should fall"


if __name__ == "__main__":
    main()

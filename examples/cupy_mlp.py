"""A data-parallel MLP in CuPy on every GPU, its gradients summed by gpukv.

Each logical GPU (every visible GPU, or `GPUKV_VIRTUAL_GPUS=N` virtual ones sharing
them) holds a replica of a two-layer MLP and computes gradients by hand on its shard of
each batch; `kv.push` sums them and runs SGD on each key's home GPU, and `kv.pull`
writes the new weights back into every replica's arrays. Without a GPU the same model
runs in NumPy on 4 host devices (separate arrays in main memory).

    python examples/cupy_mlp.py
    GPUKV_VIRTUAL_GPUS=8 python examples/cupy_mlp.py --steps 300

Exits with status 1 if the loss does not fall or the replicas drift apart.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import numpy as np

import gpukv


def devices():
    """(array module, [(label, context manager factory)], store name) for this machine."""
    from gpukv.device.cuda.device import gpu_count, gpu_devices
    if gpu_count() > 0:
        import cupy
        logical = gpu_devices()
        return (cupy, [(f"GPU {d.physical}" + (f" slot {d.slot}" if d.slot else ""),
                        lambda d=d: cupy.cuda.Device(d.physical)) for d in logical],
                "device")
    return np, [(f"host {i}", contextlib.nullcontext) for i in range(4)], "local"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=512, help="global batch size")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    xp, places, store = devices()
    n = len(places)
    if xp is np:
        print(f"no GPU: running the same model in NumPy on {n} host devices")
    else:
        print(f"CuPy {xp.__version__}: {n} logical GPU(s): "
              + ", ".join(label for label, _ in places))

    dim, hidden, classes = 32, 64, 4
    rng = np.random.default_rng(args.seed)
    x_all = rng.standard_normal((8192, dim)).astype(np.float32)
    teacher = rng.standard_normal((dim, classes)).astype(np.float32)
    y_all = (np.tanh(x_all) @ teacher).argmax(axis=1)
    init = {
        "w1": (rng.standard_normal((dim, hidden)) * np.sqrt(2 / dim)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, classes)) * np.sqrt(2 / hidden)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }
    names = list(init)

    kv = gpukv.create(store)
    kv.init(names, [init[k] for k in names])
    lr = args.lr

    def sgd(key, grad, weight):
        weight -= (lr / n) * grad  # grad: the sum over replicas of per-shard means

    kv.set_updater(sgd)

    # One replica per device: its weights, its gradient buffers, its data.
    replicas = []
    for _, where in places:
        with where():
            replicas.append({
                "w": {k: xp.empty(v.shape, v.dtype) for k, v in init.items()},
                "g": {k: xp.zeros(v.shape, v.dtype) for k, v in init.items()},
                "x": xp.asarray(x_all), "y": xp.asarray(y_all),
            })
    weights = [[r["w"][k] for r in replicas] for k in names]
    grads = [[r["g"][k] for r in replicas] for k in names]
    kv.pull(names, out=weights)

    shard = max(1, args.batch // n)
    order = np.random.default_rng(args.seed + 1)
    losses = []
    for step in range(args.steps):
        idx = order.integers(0, len(x_all), shard * n)
        step_loss = 0.0
        for i, ((_, where), r) in enumerate(zip(places, replicas)):
            with where():
                part = xp.asarray(idx[i * shard:(i + 1) * shard])
                step_loss += float(forward_backward(xp, r, part)) / n
        kv.push(names, grads)
        kv.pull(names, out=weights)
        losses.append(step_loss)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {step_loss:.4f}")

    drift = 0.0
    for k in names:
        ref = _host(replicas[0]["w"][k])
        for r in replicas[1:]:
            drift = max(drift, float(np.abs(_host(r["w"][k]) - ref).max()))
    window = max(1, len(losses) // 10)
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first/last {window} steps); "
          f"replica drift {drift:.2e}")
    if not last < 0.7 * first:
        print("FAILED: the loss did not fall", file=sys.stderr)
        return 1
    if drift > 1e-5:
        print("FAILED: the replicas hold different weights", file=sys.stderr)
        return 1
    return 0


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def forward_backward(xp, r, idx):
    """Cross-entropy loss of a batch; writes the mean gradients into r['g'] in place."""
    w, g = r["w"], r["g"]
    x, y = r["x"][idx], r["y"][idx]
    m = x.shape[0]
    h_pre = x @ w["w1"] + w["b1"]
    h = xp.maximum(h_pre, 0)
    logits = h @ w["w2"] + w["b2"]
    logits = logits - logits.max(axis=1, keepdims=True)
    e = xp.exp(logits)
    prob = e / e.sum(axis=1, keepdims=True)
    loss = -xp.log(prob[xp.arange(m), y] + 1e-12).mean()
    d_logits = prob
    d_logits[xp.arange(m), y] -= 1
    d_logits /= m
    g["w2"][...] = h.T @ d_logits
    g["b2"][...] = d_logits.sum(axis=0)
    d_h = (d_logits @ w["w2"].T) * (h_pre > 0)
    g["w1"][...] = x.T @ d_h
    g["b1"][...] = d_h.sum(axis=0)
    return loss


if __name__ == "__main__":
    sys.exit(main())

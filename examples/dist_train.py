"""mpiexec -n 4 python examples/dist_train.py
mpiexec -n 4 python examples/dist_train.py --num-servers 1

Data-parallel training across processes with a dist store. The first line runs 4 workers
that also serve a shard of the keys each; the second makes rank 0 a dedicated server and
ranks 1-3 workers (`--store dist_async --num-servers 1` applies each push as it arrives).
Needs mpi4py and an MPI: `pip install '.[mpi]'` (in a gpukv checkout) brings both,
mpiexec included.

Each worker holds its own shard of a synthetic data set and its own copy of a small NumPy
MLP's weights. A step: compute the gradient of the shard, push it (the store sums the
workers' gradients and runs SGD where each key is served), pull the new weights. Rank 0
prints the loss of its shard every few steps. At the end every worker compares its
weights with the others' (an mpi4py allgather of a digest) and checks that the loss fell;
the exit status is 1 on any worker if either fails.
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

import gpukv

FEATURES, HIDDEN, PER_WORKER = 8, 32, 512


def make_data(n: int, seed: int):
    """Points labelled by a fixed nonlinear rule (the same on every worker for `seed`)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = (x[:, 0] * x[:, 1] + 0.8 * x[:, 2] - 0.5 * x[:, 3] ** 2 + 0.5 > 0).astype(np.float32)
    return x, y


def init_params(seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    return {"w1": (rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32),
            "b1": np.zeros(HIDDEN, np.float32),
            "w2": (rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
            "b2": np.zeros(1, np.float32)}


def loss_and_grads(p: dict, x, y):
    """Binary cross-entropy of a tanh MLP on the shard (x, y) and its gradient (means)."""
    h = np.tanh(x @ p["w1"] + p["b1"])
    z = (h @ p["w2"] + p["b2"])[:, 0]
    loss = np.mean(np.maximum(z, 0) - y * z + np.log1p(np.exp(-np.abs(z))))
    dz = ((0.5 * (1 + np.tanh(0.5 * z)) - y) / len(x))[:, None]  # sigmoid(z) - y
    dh = (dz @ p["w2"].T) * (1 - h * h)
    return float(loss), {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ dz, "b2": dz.sum(0)}


def workers_comm(kv):
    """An MPI communicator of the workers only: the first kv.num_servers ranks serve, and
    their `gpukv.create` never returned."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if kv.num_servers == 0:
        return world
    workers = world.Get_group().Range_incl([(kv.num_servers, world.Get_size() - 1, 1)])
    return world.Create_group(workers)


def digest(params: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Data-parallel training across MPI processes.")
    p.add_argument("--store", choices=["dist_sync", "dist_async", "dist_device_sync"],
                   default="dist_sync")
    p.add_argument("--num-servers", type=int, default=None,
                   help="dedicated server processes (default: GPUKV_NUM_SERVERS, else 0: "
                        "every process is a worker and serves a shard)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    # A server's create serves until the workers are done, then ends its process.
    kv = gpukv.create(args.store, num_servers=args.num_servers)
    rank, n = kv.rank, kv.num_workers
    x, y = make_data(n * PER_WORKER, args.seed)
    shard = slice(rank * PER_WORKER, (rank + 1) * PER_WORKER)  # this worker's data
    x, y = x[shard], y[shard]

    params = init_params(args.seed)
    names = list(params)
    kv.init(names, [params[k] for k in names])  # rank 0's values win
    # Each worker pushes the mean gradient of its shard; the store sums them: / n.
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=args.lr, momentum=0.9,
                                        rescale_grad=1.0 / n))
    kv.pull(names, out=[params[k] for k in names])
    if rank == 0:
        print(f"gpukv {gpukv.__version__}: {args.store}, {n} worker(s), "
              f"{kv.num_servers} dedicated server(s), {PER_WORKER} samples per worker")

    first, _ = loss_and_grads(params, x, y)
    every = max(1, args.steps // 10)
    for step in range(1, args.steps + 1):
        loss, grads = loss_and_grads(params, x, y)
        kv.push(names, [grads[k] for k in names])
        kv.pull(names, out=[params[k] for k in names])
        if rank == 0 and (step == 1 or step % every == 0):
            print(f"step {step:4d}  loss {loss:.4f}  (worker 0's shard)", flush=True)

    kv.barrier()  # dist_async: every worker's last push is in before the last pull
    kv.pull(names, out=[params[k] for k in names])
    final, _ = loss_and_grads(params, x, y)
    results = workers_comm(kv).allgather((digest(params), first, final))
    same = len({d for d, _, _ in results}) == 1
    fell = all(np.isfinite(b) and b < a for _, a, b in results)
    if rank == 0:
        mean = [float(np.mean([r[i] for r in results])) for i in (1, 2)]
        print(f"loss over every shard: {mean[0]:.4f} -> {mean[1]:.4f}"
              f"{'' if fell else '  FAILED: the loss did not fall on every worker'}")
        print("every worker holds the same weights" if same
              else "FAILED: the workers hold different weights")
    return 0 if same and fell else 1


if __name__ == "__main__":
    sys.exit(main())

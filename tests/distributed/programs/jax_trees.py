"""gpukv.jax on a dist store: every worker holds 2 JAX host devices (XLA_FLAGS), pushes
a tree per device, then a tree sharded over its devices, and takes the mean over every
device of every worker; then, without servers, one worker's push_tree is refused where
the others' is not, and every worker says so at once. Each worker checks the results
against NumPy and prints `PASS worker R of N`."""
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gpukv
import gpukv.jax as gjax

LR = 0.5


def grads_of(worker: int, device: int, like: dict) -> dict:
    """A gradient per (worker, device), the same in every process for the check."""
    rng = np.random.default_rng(100 * worker + device)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in like.items()}


def main() -> None:
    kv = gpukv.create(sys.argv[1] if len(sys.argv) > 1 else "dist_sync")
    rank, workers = kv.rank, kv.num_workers
    devices = jax.devices()[:2]
    assert len(devices) == 2, devices
    params = {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32),
              "s": np.full(2, 0.5, np.float32)}
    all_grads = [[grads_of(w, d, params) for d in range(2)] for w in range(workers)]
    every = [g for per_worker in all_grads for g in per_worker]

    # mean_tree with no optimizer on the store: pmean over 2 x workers devices
    gjax.init_tree(kv, params, prefix="grads/")
    mine = [jax.device_put(g, d) for g, d in zip(all_grads[rank], devices)]
    for tree in gjax.mean_tree(kv, mine, prefix="grads/"):
        for k in params:
            want = sum(g[k] for g in every) / len(every)
            np.testing.assert_allclose(np.asarray(tree[k]), want, rtol=1e-6, atol=1e-6)

    # a tree sharded over this worker's devices: one value per shard, SGD on the store
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=LR))
    gjax.init_tree(kv, params, prefix="params/")
    mesh = Mesh(np.array(devices), ("i",))
    stacked = {k: np.concatenate([g[k][None] for g in all_grads[rank]]) for k in params}
    sharded = jax.device_put(stacked, NamedSharding(mesh, P("i")))
    gjax.push_tree(kv, [sharded], prefix="params/")
    pulled = gjax.pull_tree(kv, params, prefix="params/")
    for k in params:
        want = params[k] - LR * sum(g[k] for g in every)
        np.testing.assert_allclose(np.asarray(pulled[k]), want, rtol=1e-5, atol=1e-5)
    kv.barrier()
    if kv.num_servers == 0:  # (with servers a push is no collective: docs/limits.md)
        refused_alone(kv, params, rank, workers)
    print(f"PASS worker {rank} of {workers}", flush=True)


def refused_alone(kv, params, rank: int, workers: int) -> None:
    """The last worker's push_tree is refused (a leaf of another shape) where the others'
    is not: it raises its own ShapeError and every other worker a PeerMismatchError
    naming the refusal, at once, rather than summing that worker's next push with this
    one (the store is broken after it: the last thing done here)."""
    last = rank == workers - 1
    tree = {k: np.ones((5,) if last and k == "b" else v.shape, np.float32)
            for k, v in params.items()}
    try:
        gjax.push_tree(kv, [tree, tree], prefix="params/")
    except gpukv.ShapeError as exc:
        assert last and "'b'" in str(exc), exc
    except gpukv.PeerMismatchError as exc:
        assert not last and "gpukv.jax.push_tree refused (ShapeError)" in str(exc), exc
    else:
        raise AssertionError("the push was not refused")


if __name__ == "__main__":
    main()

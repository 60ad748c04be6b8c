"""The Trainer on a dist store with a parameter one worker's forward pass leaves out (DDP's
`find_unused_parameters`): `mpiexec -n N python -m mpi4py trainer_unused.py NAME [ARGS]`.

Each worker has two replicas of a model whose middle layer `b` the forward pass may skip.
A worker that trained prints `PASS worker R of W`; one that got an error prints `CAUGHT
<error type> on worker R after S s: message`. GPUKV_NUM_SERVERS and GPUKV_DIST_TIMEOUT
set the servers and the timeout.
"""
from __future__ import annotations

import copy
import hashlib
import sys
import threading
import time

import torch
from torch import nn

import gpukv
import gpukv.torch as gt

REPLICAS = 2
STEPS = 4
LR, MOMENTUM = 0.1, 0.9


class Skipping(nn.Module):
    """a, then b unless `use_b` is False, then c: b's gradients stay stale when skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.c(h)


def uses_b(step: int, worker: int, replica: int) -> bool:
    """Worker 1 skips b in every even step: with both replicas in step 0, with its second
    one only in step 2 (a bucket incomplete there, though b has gradients); odd steps use
    it everywhere."""
    if worker != 1 or step % 2:
        return True
    return step == 2 and replica == 0


def batches(step: int, workers: int) -> list:
    """(x, y) of every replica of every worker (worker-major), the same in every process."""
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(3, 4, generator=g), torch.randint(0, 3, (3,), generator=g))
            for _ in range(workers * REPLICAS)]


def backward(models: list, step: int, workers: int, worker: int) -> None:
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    shards = batches(step, workers)[worker * REPLICAS:(worker + 1) * REPLICAS]
    for r, (m, (x, y)) in enumerate(zip(models, shards)):
        loss_fn(m(x, uses_b(step, worker, r)), y).backward()


def train(kv, model: nn.Module, overlap: bool, on_store: bool, bucket_bytes: int) -> tuple:
    """This worker's replica 0 after STEPS steps with ignore_stale_grad, and the names of
    the threads that pushed to `kv`."""
    models = [copy.deepcopy(model) for _ in range(REPLICAS)]
    options = {} if bucket_bytes < 0 else {"bucket_bytes": bucket_bytes}
    trainer = gt.Trainer(models, "sgd", {"learning_rate": LR, "momentum": MOMENTUM},
                         kvstore=kv, update_on_kvstore=on_store, overlap=overlap, **options)
    assert trainer.overlap == overlap
    pushers: list = []
    push = kv.push
    kv.push = lambda *a, **k: pushers.append(threading.current_thread().name) or push(*a, **k)
    for step in range(STEPS):
        trainer.zero_grad()
        backward(models, step, kv.num_workers, kv.rank)
        trainer.step(3 * REPLICAS * kv.num_workers, ignore_stale_grad=True)
    return models[0], pushers


def reference(model: nn.Module, workers: int) -> nn.Module:
    """Plain torch: one model, the sum of every replica's gradients of every worker (b's
    left out where skipped), torch.optim.SGD (the same steps as gpukv's at a constant
    rate)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for step in range(STEPS):
        opt.zero_grad()
        for k, (x, y) in enumerate(batches(step, workers)):
            loss_fn(model(x, uses_b(step, k // REPLICAS, k % REPLICAS)), y).backward()
        for p in model.parameters():
            p.grad /= 3 * REPLICAS * workers
        opt.step()
    return model


def unused(on_store: str, bucket_bytes: str, overlap: str = "on") -> None:
    """With ignore_stale_grad, b skipped by worker 1 in some steps: every worker ends with
    plain torch's weights, and worker 0 prints `WEIGHTS <sha1>` of them (the test holds
    overlap 'on' to 'off'). bucket_bytes -1: the default buckets (one fused key)."""
    on = on_store == "1"
    kv = gpukv.create("dist_sync")
    torch.manual_seed(0)
    model = Skipping()
    mine, pushers = train(kv, model, overlap == "on", on, int(bucket_bytes))
    torch_model = reference(model, kv.num_workers)
    h = hashlib.sha1()
    for (name, a), b in zip(mine.named_parameters(), torch_model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, (a - b).abs().max())
        h.update(a.detach().numpy().tobytes())
    early = sum(name.startswith("gpukv-reduce") for name in pushers)
    # with update_on_kvstore the early reductions push to a store of this process
    assert (early > 0) == (overlap == "on" and not on), (early, pushers)
    if kv.rank == 0:
        print(f"WEIGHTS {h.hexdigest()[:12]}", flush=True)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def refused(on_store: str, bucket_bytes: str) -> None:
    """overlap=True without ignore_stale_grad, b skipped by worker 1: worker 1's step is
    its own ArgumentError naming b, every other worker's a PeerError, each within the
    timeout (none waits for worker 1 for good)."""
    size = int(bucket_bytes)
    kv = gpukv.create("dist_sync")
    torch.manual_seed(0)
    models = [Skipping() for _ in range(REPLICAS)]
    options = {} if size < 0 else {"bucket_bytes": size}
    trainer = gt.Trainer(models, "sgd", {"learning_rate": LR}, kvstore=kv,
                         update_on_kvstore=on_store == "1", overlap=True, **options)
    trainer.zero_grad()
    backward(models, 0, kv.num_workers, kv.rank)
    start = time.monotonic()
    try:
        trainer.step(3 * REPLICAS * kv.num_workers)
        raise AssertionError(f"worker {kv.rank} stepped")
    except (gpukv.ArgumentError, gpukv.PeerError) as exc:
        assert isinstance(exc, gpukv.PeerError) == (kv.rank != 1), exc
        print(f"CAUGHT {type(exc).__name__} on worker {kv.rank} after "
              f"{time.monotonic() - start:.2f} s: {exc}", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])

"""The Trainer across hosts against PyTorch DDP (gloo) in the same processes: one worker
per process, the same start and batches; after `steps` SGD-with-momentum steps every
worker's weights equal DDP's. Run under `mpiexec ... python -m mpi4py trainer_ddp.py`;
DDP meets at the first host of GPUKV_CLUSTER_HOSTS (127.0.0.1 without it)."""
from __future__ import annotations

import copy
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import gpukv
import gpukv.torch as gt


def _worker0_address(kv) -> str:
    """Worker 0's own address, which it sends to the other workers (the servers, the
    first ranks, have ended their program inside `create`)."""
    world, first = MPI.COMM_WORLD, kv.num_servers
    if kv.rank:
        return world.recv(source=first, tag=7)
    hosts = os.environ.get("GPUKV_CLUSTER_HOSTS", "127.0.0.1").split(",")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((hosts[0], 9))  # no packet: the route picks this host's own address
    address = probe.getsockname()[0]
    probe.close()
    for worker in range(first + 1, world.Get_size()):
        world.send(address, dest=worker, tag=7)
    return address


def main(steps: int = 4, on_store: str = "0") -> None:
    kv = gpukv.create("dist_sync")  # a server process serves in here, then exits
    rank, size = kv.rank, kv.num_workers
    # DDP's group: the workers, meeting at worker 0's address (sent to every worker)
    address = _worker0_address(kv)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:29533", rank=rank,
                            world_size=size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    trainer = gt.Trainer([ours], "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore=kv, update_on_kvstore=on_store == "1")
    ddp = nn.parallel.DistributedDataParallel(theirs)
    reference = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()  # a mean over the local batch, as DDP averages
    batch = 32
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(batch * size, 64, generator=g)
        y = torch.randint(0, 10, (batch * size,), generator=g)
        xs, ys = x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]
        trainer.zero_grad()
        (loss_fn(ours(xs), ys) * batch).backward()  # a sum: the Trainer divides by it
        trainer.step(batch * size)
        reference.zero_grad()
        loss_fn(ddp(xs), ys).backward()
        reference.step()
    worst = max(float((a - b).abs().max()) for a, b in zip(ours.parameters(),
                                                           theirs.parameters()))
    assert worst < 1e-6, f"rank {rank}: weights differ from DDP's by {worst}"
    # free DDP's reducer, then gloo's group, while Python runs: the group's threads drop
    # their last work, and a thread taking the GIL as Python ends aborts the process
    del ddp, reference
    gc.collect()
    dist.destroy_process_group()
    print(f"PASS worker {kv.rank} of {kv.num_workers} max difference {worst:.2e}",
          flush=True)


if __name__ == "__main__":
    main(*[int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])])

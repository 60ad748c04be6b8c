"""The store shared by the processes of an MPI job: `DistKVStore` (store.py) and the
one-process stores it is made of (parts.py), its MPI layer (`mpi/`: transport, agreement,
chunks, job exit) and the engines it drives between processes (`engines/`: the `Engine`
protocol, sharded rounds, NCCL rounds, servers and their client)."""
from .engines.protocol import Engine, Leaves, Partials, Shard
from .mpi.agree import Agreement
from .mpi.transport import Transport

__all__ = ["Agreement", "Engine", "Leaves", "Partials", "Shard", "Transport"]

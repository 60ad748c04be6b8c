"""Several processes on MPI: the transport (mpi4py, every wait bounded), the agreement that
precedes each collective call, key sharding, and the engines a dist store drives (the
`Engine` they implement, the `Shard` they call back)."""
from .agree import Agreement
from .engine import Engine, Leaves, Partials, Shard
from .transport import Transport

__all__ = ["Agreement", "Engine", "Leaves", "Partials", "Shard", "Transport"]

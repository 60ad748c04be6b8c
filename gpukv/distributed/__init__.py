"""Several processes on MPI: the transport (mpi4py, every wait bounded), the agreement that
precedes each collective call, key sharding, and the engines a dist store drives."""
from .agree import Agreement
from .transport import Transport

__all__ = ["Agreement", "Transport"]

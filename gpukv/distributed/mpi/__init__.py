"""The MPI layer of a dist store: the transport (mpi4py, every wait bounded), the
agreement that precedes each collective call, message chunks, and how a rank's job ends
when it fails (job_exit.py, which reports to `gpukv run`)."""

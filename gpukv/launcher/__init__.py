"""The launcher: `python -m gpukv run` starts an MPI job and sees it end.

- `launch`: the supervisor (mpiexec under watch, the attempt's failure lines, Ctrl-C);
- `restarts`: the attempts, restarted on the hosts that still answer;
- `hostfile`, `host_probe`: the hosts a job runs on, and which of them answer;
- `process_tree`: every process an attempt started, to end them all;
- `run_rank`: the entry each rank runs its program through;
- `run_report`: the one-line report a rank sends the launcher when it fails, the only
  module the ranks' side (`gpukv.distributed.mpi.job_exit`) shares with it.

It never imports the stores or their engines: a job's processes and the launcher meet only
through mpiexec, the environment and `run_report`'s messages.
"""

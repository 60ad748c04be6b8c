"""The launcher: `python -m gpukv run` starts an MPI job and sees it end.

- `launch`: the supervisor (mpiexec under watch, the end of a failed job, Ctrl-C, -n's
  default);
- `output`: the ranks' lines, each after `[R] `, with --log-dir in a file per rank and
  attempt; mpiexec's own words kept back unless --verbose;
- `failures`: the line per failed rank (rank, local rank, host, pid, what happened), from
  the ranks' reports and mpiexec's words;
- `restarts`: the attempts, restarted on the hosts that still answer;
- `hostfile`, `host_probe`: the hosts a job runs on, and which of them answer;
- `process_tree`: every process an attempt started, to end them all;
- `guard`: what ends an attempt's job on this host when the launcher is killed first;
- `run_rank`: the entry each rank runs its program through (torchrun's variables, its
  start and end told, tracebacks without the wrapper's frames);
- `run_report`: the one-line reports a rank sends the launcher (its start, its end, its
  failure), the only module the ranks' side (`gpukv.distributed.mpi.job_exit`) shares
  with it.

It never imports the stores or their engines: a job's processes and the launcher meet only
through mpiexec, the environment and `run_report`'s messages.
"""

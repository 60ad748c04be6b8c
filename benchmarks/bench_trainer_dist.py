"""Data-parallel PyTorch training over several processes of one machine: gpukv.torch.Trainer
on a dist_sync store against PyTorch DistributedDataParallel (gloo).

    python benchmarks/bench_trainer_dist.py                     # 2 processes, every model
    python benchmarks/bench_trainer_dist.py --devices 2,4 --iters 30 --out /tmp/trainer
    python benchmarks/bench_trainer_dist.py --cluster 2 --rate 1gbit --models resnet50-mlp
    python benchmarks/bench_trainer_dist.py --cluster 2 --rate 1gbit --models resnet50-mlp \
        --ways store-overlap,sign,powersgd,ddp-powersgd  # compressed, against PowerSGD

Each case is one MPI job of P processes (`mpiexec -n P ... --child`), one replica each, the
global batch (`--batch`) split over them. One iteration is zero_grad, forward, backward and
the step; the ways take turns, one iteration each per round after a barrier, and a round's
time is the slowest process's. With `--cluster N` the job runs across N hosts emulated on
this machine (gpukv.tools.cluster: network namespaces, links shaped to `--rate`, MPI and
gloo over TCP only), one process per host, started from host 0, whose address is gloo's
master; the record then has the link-bound floor: what each host must send in an
all-reduce of the gradients, 2(N-1)/N of them, over its link. The ways:
- compute: forward, backward and torch.optim.SGD on the process's shard, no communication:
  the floor of an iteration;
- ddp: DistributedDataParallel over gloo (buckets of 25 MB, the first 1 MB, whose
  allreduces overlap backward; `--bucket-mb` sets its buckets and the Trainer's alike)
  with torch.optim.SGD;
- trainer: `Trainer(update_on_kvstore=False, overlap=False)`: the store sums the gradients
  at the step (one allreduce per bucket), every process runs SGD;
- trainer overlap: the same with `overlap=True`: each bucket's allreduce starts from
  backward, on a background thread;
- trainer on store: `update_on_kvstore=True`: the step reduce-scatters, each process
  updates its shard, and the weights are all-gathered;
- trainer on store overlap: the same with `overlap=True`;
- trainer sign: trainer on store overlap with `compression_params={'type': 'sign'}`: one
  bit per value (and a float32 scale per 64) both ways, the gradients pushed and the
  weights' changes pulled, with error feedback;
- trainer ternary: the same with `{'type': 'ternary'}`: 0 or +-a block's scale per value
  (five values a byte, and a float32 scale per 128), both ways;
- trainer powersgd: trainer (one push of every key after backward) with
  `compression_params={'type': 'powersgd', 'rank': 4}`: every parameter of 2+ dimensions
  its own key, all their P and Q summed by two allreduces; each worker decodes the sums
  itself (nothing to pull);
- ddp powersgd: ddp with PyTorch's PowerSGD communication hook (`powerSGD_hook`, rank 4,
  error feedback and warm start; its first 2 iterations allreduce uncompressed, and
  --warmup is raised to 3 so that they and the first compressed one are not timed).
`--ways` picks some of them (compute and ddp always run: the others are measured against
them; by default the four uncompressed Trainer ways). 'iter/ddp' is a way's iteration
over ddp's; 'backward' is the time of `loss.backward()` (slowest process), where the
overlap's reductions run beside backward's hooks, and 'bwd/alone' that over the compute
way's (DDP's includes its wait for the last all-reduce).
'sync' is an iteration less the compute way's (the time communication adds); beside it,
'mpi allreduce' is the floor of that: one MPI Allreduce of all the gradients (float32, in
place) with mpi4py, timed in the same job. After the
timing every way's weights are compared with DDP's (same start, same batches; the Trainer
sums where DDP averages, so its learning rate is scaled to match) and a way that differs
by more than float32 rounding fails the case; the compressed ways (trainer sign, trainer
ternary, trainer powersgd, ddp powersgd) differ by design: their difference is shown, marked
lossy, and not checked (bench_accuracy.py measures what compression costs in accuracy). Results:
trainer_dist_<machine>.json in --out DIR (default benchmarks/results/; '-' writes
nothing); exit status 1 when a case failed.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import faulthandler
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402
from bench_dist import find_mpiexec, free_port  # noqa: E402

from gpukv.distributed.store import env_timeout  # noqa: E402
from gpukv.tools import cluster as emulated  # noqa: E402

MODELS = ("mlp", "wide-mlp", "resnet50-mlp", "1000-params")
#: run by default (resnet50-mlp is for --cluster: 100 MB of gradients)
DEFAULT_MODELS = ("mlp", "wide-mlp", "1000-params")
LR = 0.01
#: the Trainer's ways and their options
TRAINER_WAYS = {
    "trainer": {"update_on_kvstore": False, "overlap": False},
    "trainer overlap": {"update_on_kvstore": False, "overlap": True},
    "trainer on store": {"update_on_kvstore": True, "overlap": False},
    "trainer on store overlap": {"update_on_kvstore": True, "overlap": True},
    "trainer sign": {"update_on_kvstore": True, "overlap": True,
                     "compression_params": {"type": "sign"}},
    "trainer ternary": {"update_on_kvstore": True, "overlap": True,
                        "compression_params": {"type": "ternary"}},
    # the optimizer on the workers: every worker decodes the sum, the pull costs nothing;
    # every key in one push, so that one pair of allreduces carries all their P and Q
    "trainer powersgd": {"update_on_kvstore": False, "overlap": False,
                         "compression_params": {"type": "powersgd", "rank": 4}},
}
#: DDP with PyTorch's PowerSGD communication hook, and the hook's options
POWERSGD_WAY = "ddp powersgd"
POWERSGD = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2,
            "min_compression_rate": 2, "use_error_feedback": True, "warm_start": True}
#: the fewest --warmup rounds with the PowerSGD way: its uncompressed iterations and its
#: first compressed one (which makes the hook's state) stay out of the timing
POWERSGD_WARMUP = POWERSGD["start_powerSGD_iter"] + 1
#: the ways that compress the gradients: their weights are not DDP's (reported, not checked)
LOSSY = ("trainer sign", "trainer ternary", "trainer powersgd", POWERSGD_WAY)
WAYS = ("compute", "ddp", *TRAINER_WAYS, POWERSGD_WAY)
#: --ways names the ways after compute and ddp by these
WAY_NAMES = {"off": "trainer", "overlap": "trainer overlap", "store": "trainer on store",
             "store-overlap": "trainer on store overlap", "sign": "trainer sign",
             "ternary": "trainer ternary",
             "powersgd": "trainer powersgd", "ddp-powersgd": POWERSGD_WAY}
#: --ways by default: the ways that end with DDP's weights
DEFAULT_WAYS = ("off", "overlap", "store", "store-overlap")


def make_model(name: str):
    """The model and its input width (the MLP and the 1000-parameter stack are
    bench_trainer.py's; the wide MLP has 6M parameters, 24 MB of gradients; resnet50-mlp
    has ResNet-50's size, 25M parameters (100 MB of float32 gradients) in 50 tensors,
    25 layers of 1000 x 1000, light enough to compute on a small machine)."""
    from torch import nn
    if name == "resnet50-mlp":
        layers: list = []
        for _ in range(25):
            layers += [nn.Linear(1000, 1000), nn.ReLU()]
        return nn.Sequential(*layers[:-1]), 1000
    if name == "wide-mlp":
        return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                             nn.ReLU(), nn.Linear(2048, 512)), 512
    from bench_trainer import MODELS as SMALL
    make, dim = SMALL[name]
    return make(), dim


# ---------------------------------------------------------------------- one process
def in_order(hook):
    """A DDP communication hook that starts a bucket once the previous bucket's future is
    done. powerSGD_hook issues a bucket's later allreduces (P, then Q) from its future's
    callbacks: meanwhile the next bucket's first allreduce starts from backward, in an
    order the processes need not share, and gloo, which pairs the collectives by the
    order they start, then fails ("Received data size doesn't match expected size").
    Backward still overlaps the communication of one bucket."""
    pending: list = []

    def ordered(state, bucket):
        if pending:
            pending.pop().wait()
        future = hook(state, bucket)
        pending.append(future)
        return future
    return ordered


def end_gloo() -> None:
    """Free what still holds gloo's group, then the group, while Python runs: its threads
    drop their last work, and a thread that takes the GIL as Python ends aborts the
    process ("terminate called without an active exception")."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def said(line: str) -> None:
    """A milestone on stderr, which the driver shows when the job fails."""
    print(line, file=sys.stderr, flush=True)


def child(args) -> int:
    # A stalled peer fails the job with the words of gloo or gpukv (their own timeouts
    # end before the driver's limit); a job that hangs elsewhere in Python still says
    # where: every thread's stack, shortly before the driver ends it.
    faulthandler.dump_traceback_later(args.timeout * 0.9)
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    import gpukv
    import gpukv.torch as gt

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    said(f"rank {rank} of {size}: MPI started")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                            rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=args.timeout / 3))

    def slowest(call) -> float:
        """Seconds of `call()` on the slowest process, all starting together."""
        comm.Barrier()
        start = time.perf_counter()
        call()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    records = []
    for model_name in args.models:
        torch.manual_seed(0)
        base, dim = make_model(model_name)
        shard = args.batch // size
        g = torch.Generator().manual_seed(1)
        x = torch.randn(shard * size, dim, generator=g)
        classes = 10 if model_name == "mlp" else dim
        y = torch.randint(0, classes, (shard * size,), generator=g)
        xs, ys = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        batch = shard * size

        def torch_sgd(model, lr):
            return torch.optim.SGD(model.parameters(), lr=lr)

        models, steps = {}, {}
        compute_model = copy.deepcopy(base)
        compute_opt = torch_sgd(compute_model, LR / batch)
        models["compute"] = compute_model
        steps["compute"] = (compute_opt.zero_grad, compute_model, compute_opt.step)
        ddp_model = nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                        bucket_cap_mb=args.bucket_mb)
        ddp_opt = torch_sgd(ddp_model, LR * size / batch)  # DDP averages the gradients
        models["ddp"] = ddp_model.module
        steps["ddp"] = (ddp_opt.zero_grad, ddp_model, ddp_opt.step)
        ways = ["compute", "ddp", *args.ways]
        if POWERSGD_WAY in args.ways:
            hooked = nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                         bucket_cap_mb=args.bucket_mb)
            hooked.register_comm_hook(powerSGD.PowerSGDState(process_group=None, **POWERSGD),
                                      in_order(powerSGD.powerSGD_hook))
            hooked_opt = torch_sgd(hooked, LR * size / batch)  # the hook averages too
            models[POWERSGD_WAY] = hooked.module
            steps[POWERSGD_WAY] = (hooked_opt.zero_grad, hooked, hooked_opt.step)
        for way in (w for w in args.ways if w in TRAINER_WAYS):
            kw = TRAINER_WAYS[way]
            model = copy.deepcopy(base)
            trainer = gt.Trainer(model, "sgd", {"learning_rate": LR},
                                 kvstore=gpukv.create("dist_sync"),
                                 bucket_bytes=args.bucket_mb << 20, **kw)
            models[way] = model
            steps[way] = (trainer.zero_grad, model,
                          lambda trainer=trainer: trainer.step(batch))

        def iteration(way, backward_s: list):
            zero, model, step = steps[way]
            zero()
            loss = loss_fn(model(xs), ys)
            start = time.perf_counter()
            loss.backward()
            backward_s.append(time.perf_counter() - start)
            step()

        samples: dict = {way: [] for way in ways}
        backwards: dict = {way: [] for way in ways}
        for i in range(args.warmup + args.iters):
            for way in ways:
                backward_s: list = []
                seconds = slowest(lambda: iteration(way, backward_s))
                if i >= args.warmup:
                    samples[way].append(seconds)
                    backwards[way].append(comm.allreduce(backward_s[0], op=MPI.MAX))
        parameters = sum(p.numel() for p in base.parameters())
        flat = np.ones(parameters, np.float32)  # the raw transport's time for the gradients
        raw = [slowest(lambda: comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM))
               for _ in range(args.warmup + args.iters)][args.warmup:]
        reference = [p.detach() for p in models["ddp"].parameters()]
        record = {"model": model_name, "processes": size, "batch": batch,
                  "parameters": parameters, "mpi_allreduce_s": statistics.median(raw),
                  "ways": {}}
        compute = statistics.median(samples["compute"])
        ddp = statistics.median(samples["ddp"])
        for way in ways:
            median = statistics.median(samples[way])
            diff = max(float(((p.detach() - q).abs() / (q.abs() + 1e-3)).max())
                       for p, q in zip(models[way].parameters(), reference))
            record["ways"][way] = {"iteration_s": median, "sync_s": median - compute,
                                   "backward_s": statistics.median(backwards[way]),
                                   "backward_over_compute": statistics.median(backwards[way])
                                   / statistics.median(backwards["compute"]),
                                   "iteration_over_ddp": median / ddp,
                                   "min_s": min(samples[way]), "max_s": max(samples[way]),
                                   "relative_difference_from_ddp": diff,
                                   "lossy": way in LOSSY}
        records.append(record)
    if rank == 0:
        Path(args.result).write_text(json.dumps(records))
    ddp_model = hooked = None  # noqa: F841 (DDP's reducers hold the group)
    steps.clear()
    end_gloo()
    said(f"rank {rank}: done; Python and MPI end next")  # (beyond faulthandler's sight)
    return 0


# ------------------------------------------------------------------------- the driver
def run_case(processes: int, args) -> list[dict]:
    """One MPI job of `processes` processes, on this machine or (--cluster) one per
    emulated host."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise RuntimeError("no mpiexec found (pip install mpi4py mpich)")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"

        def command(master: str, hosts: list) -> list:
            spread = ["-hosts", ",".join(f"{h}:1" for h in hosts)] if hosts else []
            # NumPy's BLAS gets the threads torch gets: a thread per core in every
            # process oversubscribes the cores (PowerSGD's matrix products)
            settings = ["-genv", "OPENBLAS_NUM_THREADS", str(args.threads),
                        "-genv", "OMP_NUM_THREADS", str(args.threads)]
            if env_timeout() is None:  # (read as the stores read it) a stall: words
                settings += ["-genv", "GPUKV_DIST_TIMEOUT", str(args.timeout / 3)]
            return [mpiexec, *spread, *settings, "-n", str(processes), sys.executable,
                    str(Path(__file__).resolve()), "--child", "--result", str(result),
                    "--master", master, "--port", str(free_port()),
                    "--models", ",".join(args.models), "--batch", str(args.batch),
                    "--threads", str(args.threads), "--warmup", str(args.warmup),
                    "--timeout", str(args.timeout),
                    "--iters", str(args.iters), "--bucket-mb", str(args.bucket_mb),
                    "--ways", ",".join(n for n, w in WAY_NAMES.items() if w in args.ways)]
        run = {"capture_output": True, "text": True, "timeout": args.timeout,
               "cwd": HERE.parent}
        try:
            if args.cluster:
                with emulated.EmulatedCluster(processes, args.rate) as cluster:
                    job = cluster.run(0, command(cluster.addresses[0], cluster.addresses),
                                      **run)
            else:
                job = subprocess.run(command("127.0.0.1", []), **run)
        except subprocess.TimeoutExpired as exc:
            printed = exc.stderr or ""  # bytes: what came before the time limit
            if isinstance(printed, bytes):
                printed = printed.decode(errors="replace")
            raise RuntimeError(f"the job did not end within {args.timeout} s; what its "
                               f"processes said (their stacks at 90% of it):\n"
                               f"{printed[-6000:]}") from None
        if job.returncode != 0 or not result.exists():
            raise RuntimeError(f"exit {job.returncode}: {job.stdout[-1500:]}"
                               f"{job.stderr[-1500:]}")
        records = json.loads(result.read_text())
    for record in records:
        if args.cluster:
            record["rate"] = args.rate
            record["link_bound_s"] = (2 * (processes - 1) / processes * 4
                                      * record["parameters"] / (emulated.rate_bits(args.rate) / 8))
    return records


def build_parser() -> argparse.ArgumentParser:
    p = C.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--models", type=C.name_list(MODELS, "model"),
                   default=",".join(DEFAULT_MODELS), metavar="NAMES",
                   help=f"models among {', '.join(MODELS)}, comma-separated (default: "
                        f"{', '.join(DEFAULT_MODELS)})")
    p.add_argument("--ways", type=C.name_list(tuple(WAY_NAMES), "way"),
                   default=",".join(DEFAULT_WAYS), metavar="NAMES",
                   help=f"the ways besides compute and ddp among {', '.join(WAY_NAMES)} "
                        f"(trainer, trainer overlap, trainer on store, trainer on store "
                        f"overlap, trainer sign, trainer ternary, trainer powersgd, ddp "
                        f"powersgd), comma-separated (default: "
                        f"{','.join(DEFAULT_WAYS)}; ddp-powersgd raises --warmup to "
                        f"{POWERSGD_WARMUP} at least)")
    C.add_devices_option(p, "2", "processes, one replica each")
    p.add_argument("--cluster", type=C.positive_int, default=None, metavar="HOSTS",
                   help="run across HOSTS emulated hosts, one process each (needs root; "
                        "gpukv.tools.cluster); overrides --devices")
    p.add_argument("--rate", default="1gbit", metavar="RATE",
                   help="with --cluster: each host's link rate (default 1gbit)")
    p.add_argument("--batch", type=C.positive_int, default=256, metavar="N",
                   help="global batch size, split over the processes (default 256)")
    p.add_argument("--bucket-mb", type=C.positive_int, default=25, metavar="MB",
                   help="bucket capacity of the Trainer (bucket_bytes) and of DDP "
                        "(bucket_cap_mb) alike, in MiB; the first bucket stays 1 MiB "
                        "(default 25, DDP's)")
    p.add_argument("--threads", type=C.positive_int, default=1, metavar="N",
                   help="torch.set_num_threads in every process (default 1)")
    p.add_argument("--timeout", type=C.positive_int, default=900, metavar="SECONDS",
                   help="time limit of one MPI job (default 900); gloo's timeout and "
                        "GPUKV_DIST_TIMEOUT (unless set) are a third of it, so that a "
                        "stalled process is named")
    C.add_timing_options(p, 3, 20, unit="iteration",
                         note="every way takes one iteration per round, in turns")
    C.add_out_option(p, "trainer_dist_<machine>.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    return p


def table_rows(record: dict) -> list[list]:
    ddp = record["ways"]["ddp"]["iteration_s"]
    rows = []
    for way, r in record["ways"].items():
        rows.append([record["model"], record["processes"], way,
                     C.format_seconds(r["iteration_s"]),
                     C.format_seconds(r["sync_s"]) if way != "compute" else "-",
                     round(r["iteration_s"] / ddp, 2),
                     C.format_seconds(r["backward_s"]), round(r["backward_over_compute"], 2),
                     f"{r['relative_difference_from_ddp']:.1e}"
                     + (" (lossy)" if r.get("lossy") else "")])
    rows.append([record["model"], record["processes"], "mpi allreduce", "-",
                 C.format_seconds(record["mpi_allreduce_s"]), "-", "-", "-", "-"])
    if "link_bound_s" in record:
        rows.append([record["model"], record["processes"], f"link-bound ({record['rate']})",
                     "-", C.format_seconds(record["link_bound_s"]), "-", "-", "-", "-"])
    return rows


def main(argv=None) -> int:
    """Returns 1 when a case failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.ways = [WAY_NAMES[name] for name in args.ways]
    if args.child:
        return child(args)
    if args.cluster:
        try:
            emulated.rate_bits(args.rate)
        except ValueError as exc:
            parser.error(f"argument --rate: {exc}")
        if args.cluster < 2:
            parser.error(f"argument --cluster: {args.cluster}: expected 2 hosts or more")
        args.devices = [args.cluster]
    C.check_batch(parser, args.batch, max(args.devices))
    if POWERSGD_WAY in args.ways and args.warmup < POWERSGD_WARMUP:
        print(f"--warmup {args.warmup} raised to {POWERSGD_WARMUP}: the PowerSGD hook's "
              f"first iterations are not timed", file=sys.stderr)
        args.warmup = POWERSGD_WARMUP
    records, rows, failed = [], [], False
    for processes in args.devices:
        try:
            case = run_case(processes, args)
        except Exception as exc:  # one broken case must not end the run
            failed = True
            error = f"{type(exc).__name__}: {exc}"
            records.append({"processes": processes, "error": error[-600:]})
            print(f"FAILED on {processes} processes: {error}", file=sys.stderr)
            continue
        for record in case:
            off = [way for way, r in record["ways"].items()
                   if way not in ("compute", *LOSSY)
                   and r["relative_difference_from_ddp"] > 1e-3]
            if off:
                failed = True
                record["error"] = f"weights differ from DDP's: {', '.join(off)}"
                print(f"FAILED {record['model']}: {record['error']}", file=sys.stderr)
            records.append(record)
            rows += table_rows(record)
    C.print_table(["model", "processes", "way", "iteration", "sync", "iter/ddp", "backward",
                   "bwd/alone", "diff vs ddp"], rows)
    payload = {"processes": args.devices, "batch": args.batch, "threads": args.threads,
               "bucket_mb": args.bucket_mb,
               "warmup": args.warmup, "iters": args.iters,
               "cluster": args.cluster and {"hosts": args.cluster, "rate": args.rate},
               "results": records, "machine": C.machine_info(),
               "libraries": C.library_versions("numpy", "torch", "mpi4py")}
    C.save_results(payload, args.out, C.result_name("trainer_dist"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

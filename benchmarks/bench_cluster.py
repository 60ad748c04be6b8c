"""Push+pull across hosts emulated on this machine (gpukv.tools.cluster): gpukv's
`dist_sync` store in its layouts and with compression, against MXNet 1.9.1's dist_sync,
raw MPI Allreduce and PyTorch's all-reduce over gloo, on links shaped to a rate.

    python benchmarks/bench_cluster.py --mxnet-python /work/mxenv/bin/python
    python benchmarks/bench_cluster.py --hosts 2,4 --rates 1gbit --sizes 16MB --ways s0,spn,mpi
    python benchmarks/bench_cluster.py --quick          # 2 hosts, 10gbit, 4 MB, 1+5 rounds

Needs root and `ip`/`tc` (every host is a network namespace with its own address; its link
is shaped with `tc tbf` both ways, MPI runs over TCP with shared memory off). For every
number of hosts N and link rate, one cluster is made and every way runs in it as one job,
each process in its host's namespace, one per host unless the layout says otherwise:

- s0: gpukv, N workers that also serve a shard each (S = 0); 2bit, 1bit, sign, ternary,
  powersgd, fp16, bf16: the same with that gradient compression on the wire (sign-spn,
  ternary-spn, powersgd-spn: in the spn layout; powersgd's keys are matrices of 1024
  columns);
- spn: gpukv, one server and one worker per host (S = W = N; the first N ranks serve, and
  mpiexec places ranks round-robin over the hosts);
- ded: gpukv, host 0 runs the one server, the other N - 1 hosts a worker each;
- mx-spn, mx-ded: MXNet 1.9.1 dist_sync (ps-lite) in the same layouts, given
  --mxnet-python (the scheduler on host 0; MXNet has no S = 0 layout);
- mpi: `comm.Allreduce` (mpi4py) of the same bytes between N ranks;
- gloo: `torch.distributed.all_reduce` over gloo of the same bytes between N processes,
  all of an iteration's tensors started at once and then waited for, as DDP does (given
  PyTorch).

Sizes: float32 keys of the given bytes, and `resnet50`: ResNet-50's 25.6 M parameters
(102.2 MB; 161 tensors as torchvision builds it, the classifier's bias folded into its
weight: 160) grouped by gpukv.torch's Trainer into its buckets (DDP's rule: 25 MB, the first
1 MB, filled in backward's order), one key per bucket (needs PyTorch). An iteration pushes
then pulls every key of the size (one all-reduce per key for mpi and gloo); after
--warmup untimed iterations, --iters are timed one by one on worker 0, and the median,
min and max are reported with the link-bound limit 2(N-1)/N x bytes / rate: what every
host must send (and receive) in an all-reduce, for the fraction of it reached. Results
go to cluster_<machine>.json and .png in --out DIR (default benchmarks/results/); the exit
status is 1 when any job failed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402
import bench_dist as D  # noqa: E402

from gpukv.tools import cluster as emulated  # noqa: E402

RESNET50 = "resnet50"
DEFAULT_HOSTS, DEFAULT_RATES = "2,4", "1gbit,10gbit"
DEFAULT_SIZES = f"4MB,16MB,{RESNET50}"
QUICK = {"hosts": [2], "rates": ["10gbit"], "sizes": [4 << 20], "warmup": 1, "iters": 5}
GLOO_PORT = 29500


# --------------------------------------------------------------------------- ways
@dataclass(frozen=True)
class Way:
    name: str
    lib: str              # gpukv, mxnet, mpi or gloo
    placement: str        # s0, spn or ded (one process per host for mpi and gloo)
    compression: str | None = None
    text: str = ""

    def layout(self, hosts: int) -> D.Layout:
        """Workers and servers on `hosts` hosts."""
        if self.placement == "spn":
            return D.Layout(hosts, hosts)
        if self.placement == "ded":
            return D.Layout(hosts - 1, 1)
        return D.Layout(hosts, 0)


WAYS = {w.name: w for w in (
    Way("s0", "gpukv", "s0", text="gpukv S=0"),
    Way("spn", "gpukv", "spn", text="gpukv server per host"),
    Way("ded", "gpukv", "ded", text="gpukv server host"),
    Way("2bit", "gpukv", "s0", "2bit", "gpukv S=0 2bit"),
    Way("1bit", "gpukv", "s0", "1bit", "gpukv S=0 1bit"),
    Way("sign", "gpukv", "s0", "sign", "gpukv S=0 sign"),
    Way("sign-spn", "gpukv", "spn", "sign", "gpukv server per host sign"),
    Way("ternary", "gpukv", "s0", "ternary", "gpukv S=0 ternary"),
    Way("ternary-spn", "gpukv", "spn", "ternary", "gpukv server per host ternary"),
    Way("powersgd", "gpukv", "s0", "powersgd", "gpukv S=0 powersgd"),
    Way("powersgd-spn", "gpukv", "spn", "powersgd", "gpukv server per host powersgd"),
    Way("fp16", "gpukv", "s0", "fp16", "gpukv S=0 fp16"),
    Way("bf16", "gpukv", "s0", "bf16", "gpukv S=0 bf16"),
    Way("mx-spn", "mxnet", "spn", text="MXNet server per host"),
    Way("mx-ded", "mxnet", "ded", text="MXNet server host"),
    Way("mpi", "mpi", "s0", text="MPI Allreduce"),
    Way("gloo", "gloo", "s0", text="torch gloo all_reduce"),
)}


def has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


# ------------------------------------------------------------------------ ResNet-50
def resnet50_shapes() -> list[tuple[str, tuple]]:
    """(name, shape) of ResNet-50's trainable parameters in torchvision's order, the
    classifier's bias folded into its weight as one more input column: 160 tensors."""
    shapes = [("conv1.weight", (64, 3, 7, 7))]
    shapes += _batch_norm("bn1", 64)
    inplanes = 64
    for layer, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), 1):
        for block in range(blocks):
            at = f"layer{layer}.{block}"
            shapes += [(f"{at}.conv1.weight", (width, inplanes, 1, 1))]
            shapes += _batch_norm(f"{at}.bn1", width)
            shapes += [(f"{at}.conv2.weight", (width, width, 3, 3))]
            shapes += _batch_norm(f"{at}.bn2", width)
            shapes += [(f"{at}.conv3.weight", (4 * width, width, 1, 1))]
            shapes += _batch_norm(f"{at}.bn3", 4 * width)
            if block == 0:
                shapes += [(f"{at}.downsample.0.weight", (4 * width, inplanes, 1, 1))]
                shapes += _batch_norm(f"{at}.downsample.1", 4 * width)
            inplanes = 4 * width
    return shapes + [("fc.weight+bias", (1000, 2048 + 1))]


def _batch_norm(name: str, channels: int) -> list[tuple[str, tuple]]:
    return [(f"{name}.weight", (channels,)), (f"{name}.bias", (channels,))]


def resnet50_buckets() -> list[int]:
    """Bytes of the Trainer's buckets of ResNet-50's float32 parameters, in key order."""
    import torch

    from gpukv.torch.buckets import BUCKET_BYTES, make_buckets

    names, shapes = zip(*resnet50_shapes())
    params = [[torch.empty(shape, device="meta") for shape in shapes]]
    buckets = make_buckets(list(names), params, BUCKET_BYTES)
    return [sum(p.numel() * 4 for p in bucket.params[0]) for bucket in buckets]


# -------------------------------------------------------------------------- sizes
def parse_cluster_sizes(text: str) -> list:
    """'4MB,16MB,resnet50' -> [4194304, 16777216, 'resnet50']: bytes with units, or
    the name of the ResNet-50 case."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        out += [RESNET50] if part.lower() == RESNET50 else C.parse_sizes(part, 4)
    if not out:
        raise C.BadArgument(f"no size given, e.g. 16MB or {RESNET50}")
    return list(dict.fromkeys(out))


def size_name(size) -> str:
    return size if isinstance(size, str) else C.format_size(size)


def make_plan(sizes: list, warmup: int, iters: int,
              buckets: list[int] | None) -> tuple[list, list[str]]:
    """The plan every job runs ([[bytes or [bytes, ...], warmup, iters], ...]) and the
    name of each entry, in the same order."""
    plan, names = [], []
    for size in sizes:
        if size == RESNET50:
            if buckets is None:
                continue
            plan.append([buckets, warmup, iters])
        else:
            plan.append([size, warmup, iters])
        names.append(size_name(size))
    return plan, names


# ------------------------------------------------------------------------- children
def gloo_child(args) -> int:
    """One process of the gloo job (rank and peers in RANK, WORLD_SIZE, MASTER_ADDR)."""
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo")
        rank, workers = dist.get_rank(), dist.get_world_size()
        expected = D.expected_sum(workers)

        def make(sizes, keys):
            tensors = [torch.full((n // 4,), float(rank + 1)) for n in sizes]

            def step():
                for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
                    work.wait()
            return step, lambda: all(bool((t == expected).all()) for t in tensors)

        timings = D.time_plan(json.loads(args.plan), make, dist.barrier)
        dist.barrier()
        if rank == 0:
            meta = {"versions": C.library_versions("torch", "numpy"), "workers": workers,
                    "torch_threads": torch.get_num_threads()}
            Path(args.result).write_text(json.dumps({"timings": timings, "meta": meta}))
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
        return 1
    return 0


# --------------------------------------------------------------------------- jobs
def host_spec(cluster) -> str:
    """mpiexec's hosts, one slot each: ranks go round-robin over the hosts."""
    return ",".join(f"{address}:1" for address in cluster.addresses)


def run_way(way: Way, cluster, plan: list, args, tmp: Path) -> dict:
    """One job of `way` on `cluster`, as bench_dist's jobs: timings from worker 0's file."""
    hosts = cluster.hosts
    result = tmp / f"{way.name}_{hosts}.json"
    result.unlink(missing_ok=True)
    what = f"{way.name} on {hosts} hosts"
    if way.lib in ("gpukv", "mpi"):
        mpiexec = D.find_mpiexec()
        if mpiexec is None:
            return {"what": what, "ok": False, "error": "no mpiexec found", "timings": {}}
        layout = way.layout(hosts)
        options = ["--no-halves"]
        if way.compression:
            options += ["--compression", json.dumps({"type": way.compression})]
        argv = [mpiexec, "-hosts", host_spec(cluster), "-n", str(layout.processes),
                *D.child_command(way.lib, layout, plan, args, result, tuple(options))]
        specs = [(cluster.command(0, argv), cluster.env())]
    elif way.lib == "mxnet":
        specs = mxnet_specs(way, cluster, plan, args, result)
    else:
        specs = gloo_specs(cluster, plan, args, result)
    return D.finish_job(D.run_group(specs, args.timeout), result, what)


def mxnet_specs(way: Way, cluster, plan: list, args, result: Path) -> list:
    """The scheduler (host 0), servers and workers of an MXNet job, each in its host."""
    layout = way.layout(cluster.hosts)
    addresses = cluster.addresses
    base = dict(cluster.env(), DMLC_PS_ROOT_URI=addresses[0],
                DMLC_PS_ROOT_PORT=str(D.free_port()), DMLC_INTERFACE=emulated.IFACE,
                DMLC_NUM_SERVER=str(layout.servers), DMLC_NUM_WORKER=str(layout.workers))
    roles = [("scheduler", 0)]
    if way.placement == "ded":
        roles += [("server", 0)] + [("worker", h) for h in range(1, cluster.hosts)]
    else:
        roles += [(role, h) for role in ("server", "worker") for h in range(cluster.hosts)]
    cmd = D.mxnet_command(plan, args, result)
    return [(cluster.command(host, cmd),
             dict(base, DMLC_ROLE=role, DMLC_NODE_HOST=addresses[host]))
            for role, host in roles]


def gloo_specs(cluster, plan: list, args, result: Path) -> list:
    """One torch.distributed process per host, rank 0 on host 0 (the master)."""
    base = dict(cluster.env(), MASTER_ADDR=cluster.addresses[0], MASTER_PORT=str(GLOO_PORT),
                WORLD_SIZE=str(cluster.hosts), GLOO_SOCKET_IFNAME=emulated.IFACE)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "gloo",
           "--plan", json.dumps(plan), "--result", str(result)]
    return [(cluster.command(h, cmd), dict(base, RANK=str(h))) for h in range(cluster.hosts)]


# ------------------------------------------------------------------------- results
def limit_seconds(hosts: int, nbytes: int, rate: str) -> float:
    """What each host must send in an all-reduce of `nbytes`, over its link."""
    return 2 * (hosts - 1) / hosts * nbytes / (emulated.rate_bits(rate) / 8)


def build_cases(hosts: int, rate: str, plan: list, names: list, jobs: dict) -> list[dict]:
    cases = []
    for (nbytes, _, _), name in zip(plan, names):
        sizes = C.entry_sizes(nbytes)
        total = sum(sizes)
        limit = limit_seconds(hosts, total, rate)
        for way_name, job in jobs.items():
            way = WAYS[way_name]
            layout = way.layout(hosts)
            t = job["timings"].get(C.entry_label(nbytes)) if job["ok"] else None
            case = {"hosts": hosts, "rate": rate, "size": name, "bytes": total,
                    "keys": len(sizes), "way": way.name, "way_text": way.text,
                    "workers": layout.workers,
                    "servers": layout.servers if way.lib in ("gpukv", "mxnet") else 0,
                    "limit_s": limit, "ok": t is not None,
                    "error": None if t is not None else job.get("error") or "not measured"}
            if way.placement == "ded":
                # the server host's link carries every worker's push in and pull out
                case["layout_limit_s"] = layout.workers * total / (
                    emulated.rate_bits(rate) / 8)
            if t is not None:
                case.update(median_s=t["median_s"], min_s=t["min_s"], max_s=t["max_s"],
                            iters=t["iters"], fraction_of_limit=limit / t["median_s"])
            cases.append(case)
    return cases


def burst_notes(cases: list[dict]) -> list[str]:
    """Why a round that moves less than a link's token bucket can beat the limit: the
    bucket lets it through at the bridge's speed, not at the link's rate."""
    small = sorted({(c["rate"], c["size"]) for c in cases if c["ok"] and c["bytes"]
                    * 2 * (c["hosts"] - 1) / c["hosts"] <= emulated.burst_bytes(c["rate"])})
    return [f"{size} at {rate}: each host moves at most tbf's burst "
            f"({C.format_size(emulated.burst_bytes(rate))}), which crosses unshaped, so its "
            f"'of limit' can pass 100%; it times the software and the bridge, not the link"
            for rate, size in small]


def print_report(cases: list[dict], notes: list[str]) -> None:
    print("\npush+pull of every key per iteration, float32; median [min-max] over the timed "
          "iterations on worker 0; limit = 2(N-1)/N x bytes / link rate")
    rows = []
    for c in cases:
        rows.append([c["hosts"], c["rate"], c["size"], c["keys"], c["way_text"],
                     C.format_seconds(c["limit_s"]),
                     C.format_seconds(c["median_s"]) if c["ok"] else "failed",
                     f"{C.format_seconds(c['min_s'])}-{C.format_seconds(c['max_s'])}"
                     if c["ok"] else "-",
                     f"{c['fraction_of_limit']:.0%}" if c["ok"] else "-"])
    C.print_table(["hosts", "link", "size", "keys", "way", "limit", "median", "min-max",
                   "of limit"], rows)
    for note in notes:
        print(f"note: {note}")
    sys.stdout.flush()


def plot(cases: list[dict], path: Path) -> None:
    """One panel per (hosts, link, size): each way's median with its min-max, the limit."""
    plt = C.pyplot()
    panels = list(dict.fromkeys((c["hosts"], c["rate"], c["size"]) for c in cases))
    cols = len(dict.fromkeys(c["size"] for c in cases))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (hosts, rate, size) in zip(axes.flat, panels):
        mine = [c for c in cases if (c["hosts"], c["rate"], c["size"]) == (hosts, rate, size)]
        ok = [c for c in mine if c["ok"]]
        xs = range(len(ok))
        medians = [c["median_s"] * 1e3 for c in ok]
        spread = [[(c["median_s"] - c["min_s"]) * 1e3 for c in ok],
                  [(c["max_s"] - c["median_s"]) * 1e3 for c in ok]]
        colors = [{"gpukv": "C0", "mxnet": "C2", "mpi": "C1", "gloo": "C3"}[
            WAYS[c["way"]].lib] for c in ok]
        ax.bar(xs, medians, yerr=spread, color=colors, capsize=2)
        ax.axhline(mine[0]["limit_s"] * 1e3, color="k", ls="--", lw=1, label="link limit")
        ax.set_xticks(list(xs), [c["way"] for c in ok], rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("ms per iteration")
        ax.set_title(f"{hosts} hosts, {rate}, {size} ({mine[0]['keys']} keys)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    C.save_figure(fig, path)


# -------------------------------------------------------------------------- driver
def build_parser() -> argparse.ArgumentParser:
    p = C.ArgumentParser(prog=Path(__file__).name,
                         description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--hosts", type=C.host_counts, default=None, metavar="COUNTS",
                   help=f"comma-separated numbers of emulated hosts, each a cluster of its "
                        f"own (default {DEFAULT_HOSTS}; 2 with --quick)")
    p.add_argument("--rates", type=C.link_rates, default=None, metavar="RATES",
                   help=f"comma-separated link rates, e.g. 1gbit,10gbit (default "
                        f"{DEFAULT_RATES}; 10gbit with --quick)")
    p.add_argument("--sizes", type=parse_cluster_sizes, default=None, metavar="BYTES",
                   help=f"float32 bytes per iteration: bytes with K/M/G units (binary), "
                        f"each one key, or '{RESNET50}' for ResNet-50's gradients in the "
                        f"Trainer's buckets (default {DEFAULT_SIZES}; 4MB with --quick)")
    p.add_argument("--ways", type=C.name_list(list(WAYS), "way"), default=",".join(WAYS),
                   metavar="NAMES", help=f"what to run among {', '.join(WAYS)} (mx-* only "
                                         "with --mxnet-python, gloo only with PyTorch; "
                                         "default: all)")
    C.add_timing_options(p, 3, 7, unit="iteration", note="in every job")
    p.add_argument("--quick", action="store_true",
                   help="a short run: 1 warm-up and 5 timed iterations, and the axes not "
                        "given restricted to 2 hosts, 10gbit and 4MB")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="seconds per job (default 600)")
    p.add_argument("--mxnet-python", default=os.environ.get("MXNET_PYTHON"), metavar="PATH",
                   help="interpreter with mxnet 1.9.1 (default $MXNET_PYTHON; none: skip)")
    C.add_out_option(p, "cluster_<machine>.json and .png")
    # What bench_dist's child programs read from the driver's arguments.
    p.set_defaults(op="push+pull", optimizer="none")
    p.add_argument("--child", choices=["gloo"], help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def settle(args) -> list[str]:
    """Fill in the axes' defaults (--quick's where it is given); the notes on what is
    left out and why."""
    quick = QUICK if args.quick else {}
    args.hosts = args.hosts or quick.get("hosts") or C.parse_ints(DEFAULT_HOSTS)
    args.rates = args.rates or quick.get("rates") or C.link_rates(DEFAULT_RATES)
    args.sizes = args.sizes or quick.get("sizes") or parse_cluster_sizes(DEFAULT_SIZES)
    if quick:
        args.warmup, args.iters = min(args.warmup, quick["warmup"]), min(args.iters,
                                                                         quick["iters"])
    notes = []
    if not args.mxnet_python and any(w.startswith("mx-") for w in args.ways):
        args.ways = [w for w in args.ways if not w.startswith("mx-")]
        notes.append("MXNet not run: no --mxnet-python")
    if not has_torch():
        if "gloo" in args.ways:
            args.ways = [w for w in args.ways if w != "gloo"]
            notes.append("gloo not run: PyTorch is not installed")
        if RESNET50 in args.sizes:
            notes.append(f"{RESNET50} not run: the Trainer's buckets need PyTorch")
    return notes


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return gloo_child(args)
    notes = settle(args)
    why = emulated.unavailable()
    if why:
        print(f"bench_cluster: cannot emulate hosts here: {why}", file=sys.stderr)
        return 1
    buckets = resnet50_buckets() if RESNET50 in args.sizes and has_torch() else None
    plan, names = make_plan(args.sizes, args.warmup, args.iters, buckets)
    load_before = os.getloadavg()
    if load_before[0] > 0.5 * D.usable_cpus():
        notes.append(f"the machine was busy (load {load_before[0]:.1f} on "
                     f"{D.usable_cpus()} cores): timings are noisy")
    start = time.perf_counter()
    cases, every = [], []
    with tempfile.TemporaryDirectory(prefix="gpukv-bench-cluster-") as tmp:
        for hosts in args.hosts:
            for rate in args.rates:
                jobs = run_cluster(hosts, rate, plan, args, Path(tmp))
                every += [dict(job, hosts=hosts, rate=rate, way=name)
                          for name, job in jobs.items()]
                cases += build_cases(hosts, rate, plan, names, jobs)
    notes += burst_notes(cases)
    print_report(cases, notes)
    for job in every:
        if not job["ok"]:
            print(f"\nFAILED {job['what']} at {job['rate']}: {job['error']}", file=sys.stderr)
            for line in job.get("output_tail", "").strip().splitlines()[-8:]:
                print(f"    {line}", file=sys.stderr)
    if C.out_folder(args.out) is not None:
        payload = record(args, cases, every, notes, buckets, load_before,
                         time.perf_counter() - start)
        print()
        C.save_results(payload, args.out, C.result_name("cluster"),
                       plot=lambda png: plot(cases, png))
    return 0 if all(job["ok"] for job in every) else 1


def run_cluster(hosts: int, rate: str, plan: list, args, tmp: Path) -> dict:
    """Every way's job on one cluster of `hosts` hosts at `rate`: {way: job}."""
    jobs = {}
    with emulated.EmulatedCluster(hosts, rate) as cluster:
        for name in args.ways:
            job = run_way(WAYS[name], cluster, plan, args, tmp)
            jobs[name] = job
            state = "ok" if job["ok"] else f"FAILED ({job['error']})"
            print(f"{hosts} hosts {rate} {name}: {state}, {job.get('seconds', 0):.1f} s",
                  file=sys.stderr, flush=True)
    return jobs


def record(args, cases, every, notes, buckets, load_before, wall) -> dict:
    """The JSON: machine, versions, settings, cases, and every job (with what its worker 0
    said of itself, e.g. MXNet's DMLC_* settings)."""
    meta: dict = {}
    for job in every:
        if job.get("meta"):
            meta.setdefault(WAYS[job["way"]].lib, job["meta"])
    return {
        "benchmark": "cluster push+pull",
        "machine": C.machine_info(),
        "versions": C.library_versions("gpukv", "numpy", "mpi4py", "torch", "matplotlib"),
        "mpi_library": (meta.get("gpukv") or meta.get("mpi") or {}).get("mpi_library"),
        "mxnet": meta.get("mxnet"),
        "gloo": meta.get("gloo"),
        "settings": {"hosts": args.hosts, "rates": args.rates,
                     "sizes": [size_name(s) for s in args.sizes], "ways": args.ways,
                     "warmup": args.warmup, "iters": args.iters, "timeout_s": args.timeout,
                     "mpiexec": D.find_mpiexec(),
                     "resnet50": None if buckets is None else {
                         "parameters": len(resnet50_shapes()),
                         "bytes": sum(buckets), "bucket_bytes": buckets}},
        "emulation": "each host a network namespace on a bridge, its link shaped both ways "
                     "with tc tbf (bandwidth only: no added latency); MPI over TCP with "
                     "shared memory off (MPIR_CVAR_NOLOCAL=1); every host shares this "
                     "machine's kernel and cores",
        "usable_cpus": D.usable_cpus(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "notes": notes + [
            "fraction_of_limit = limit_s / median_s, limit_s = 2(N-1)/N x bytes / rate; "
            "for ded, layout_limit_s = workers x bytes / rate is what the server host's "
            "link must carry each way",
            "compressed ways are held to the float32 limit: above 100% is the compression"],
        "wall_s": round(wall, 1),
        "cases": cases,
        "jobs": every,
    }


if __name__ == "__main__":
    sys.exit(main())

"""What the deterministic reduction order costs: a sync round of one key in the store's
default order against `deterministic=True`, in one process, in several, and across hosts
emulated on this machine.

    python benchmarks/bench_deterministic.py                  # every scope, 16MiB and 100MB
    python benchmarks/bench_deterministic.py --scopes process,processes --sizes 16MiB
    python benchmarks/bench_deterministic.py --quick --scopes process --out -

A round is a push then a pull of one float32 key (or one pushpull, --op), the sum assigned
(or SGD where the key is served, --optimizer sgd). The sides, both in the same processes
where they can be, round by round in turn with who goes first alternating:
- default: the store made as `gpukv.create(name)` (GPUKV_DETERMINISTIC is unset);
- deterministic: `gpukv.create(name, deterministic=True)`; with --same-order the default
  order again (no option passed), which shows the noise floor of the ratio.

Scopes (--scopes):
- process: one process, a 'device' store and a 'local' store over --devices host devices
  (NumPy arrays); limit: the bytes a round must move, 2(n+1) x size (n sources read, the
  stored value written, read back, n outputs written), at the memory bandwidth of a NumPy
  copy measured in the same run;
- processes: `mpiexec -n P` on this machine, `dist_sync` over MPI's shared memory;
- hosts: one process per host on --hosts hosts emulated with network namespaces, links
  shaped with tc to each of --rates (needs root and ip/tc), MPI over TCP.
For the MPI scopes --servers picks num_servers: with 0 every process is a worker and both
sides share the job; with 1 the first process serves and the other P - 1 work, and the
two sides run as two jobs back to back (servers serve one store per job). Their limit is
a raw `Allreduce` of the same bytes between the same processes, timed in the (first) job
before the stores are made; the hosts scope also gives the link-bound limit
2(N-1)/N x bytes / rate.

For every case: the median, min, max and spread of --iters rounds after --warmup, per side;
the ratio deterministic / default of the medians and, round by round, of the pairs; the
limit and each side's fraction of it. A table is printed, and
deterministic_<machine>.json with a chart deterministic_<machine>.png go to --out DIR
(default benchmarks/results/; '-' writes nothing). The exit status is 1 when a case failed
(including a store that does not take `deterministic=` yet). On 2 cores the defaults take
about 5 minutes, most of it the emulated hosts at 1 Gb/s; --servers 0,1 about twice that.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402
import bench_dist as D  # noqa: E402

from gpukv.tools import cluster as emulated  # noqa: E402

SCOPES = ("process", "processes", "hosts")
STORES = ("device", "local")
DEFAULTS = {"sizes": "16MiB,100MB", "devices": "8", "processes": "2,4", "hosts": "2,4",
            "rates": "1gbit,10gbit", "servers": "0"}
QUICK = {"sizes": [64 << 10], "processes": [2], "hosts": [2], "rates": ["10gbit"],
         "warmup": 1, "iters": 3}
SIDES = ("default", "deterministic")
GOAL_RATIO = 1.10           # the deterministic order may cost at most 10% over the default
DEFAULT_WORTHY_RATIO = 1.03  # within 3% everywhere, it could be the default
ENV_SWITCH = "GPUKV_DETERMINISTIC"
CHILD = HERE / "_deterministic_mpi.py"


def side_options(same_order: bool) -> list[tuple[str, dict]]:
    """(name, options of gpukv.create) of each side: `deterministic=` only where asked."""
    return [("default", {}), ("deterministic", {} if same_order else {"deterministic": True})]


# ----------------------------------------------------------------------- one process
def one_process_case(store: str, devices: int, nbytes: int, args, sides,
                     copy_Bps: float) -> dict:
    """Both sides' stores over `devices` host devices, timed round by round in turn."""
    import numpy as np

    import gpukv

    case = {"scope": "process", "store": store, "devices": devices, "processes": 1,
            "workers": 1, "servers": 0, "bytes": C.elements(nbytes, 4) * 4}
    case["limit"] = {"kind": "memory bandwidth (NumPy copy)",
                     "seconds": 2 * (devices + 1) * case["bytes"] / copy_Bps}
    values = [np.full(C.elements(nbytes, 4), d + 1, np.float32) for d in range(devices)]
    outs = [np.empty_like(v) for v in values]
    expected = devices * (devices + 1) / 2 * (-1 if args.optimizer == "sgd" else 1)
    samples: dict = {name: [] for name, _ in sides}
    try:
        # The stores are made in both orders, and each pair times half of the rounds:
        # here a store made second ran its rounds 15-20% slower than the same store made
        # first (its memory, not its order of summing), which one order would count as
        # the cost of one side.
        for made in (sides, sides[::-1]):
            steps = {}
            for name, options in made:
                kv = gpukv.create(store, **options)
                kv.init(0, np.zeros_like(values[0]))
                if args.optimizer == "sgd":
                    kv.set_optimizer(gpukv.optim.SGD(learning_rate=1.0))
                steps[name] = _round(kv, values, outs, args.op)
                steps[name]()
                if not all(bool((o == expected).all()) for o in outs):
                    raise AssertionError(f"{name}: the first pull is not {expected}")
            half = args.iters // 2 if made is sides else args.iters - args.iters // 2
            for name, times in time_in_turn(steps, args.warmup, half).items():
                samples[name] += times
            del steps, kv
    except Exception as exc:
        traceback.print_exc()
        return {**case, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return finish_case(case, samples)


def _round(kv, values, outs, op: str):
    if op == "pushpull":
        return lambda: kv.pushpull(0, values, outs)

    def step():
        kv.push(0, values)
        kv.pull(0, out=outs)
    return step


def time_in_turn(steps: dict, warmup: int, iters: int) -> dict:
    """Seconds of every step's rounds, one round of each in turn, who goes first
    alternating: {name: [seconds, ...]}."""
    names = list(steps)
    samples: dict = {name: [] for name in names}
    for i in range(warmup + iters):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            steps[name]()
            if i >= warmup:
                samples[name].append(time.perf_counter() - t0)
    return samples


# ------------------------------------------------------------------------- MPI jobs
def mpi_cases(scope: str, processes: int, servers: int, plan: list, args, sides,
              tmp: Path, cluster=None) -> list[dict]:
    """The cases of one MPI layout (every size of the plan), on this machine or on
    `cluster`'s hosts, one process per host."""
    base = {"scope": scope, "store": "dist_sync", "devices": 1, "processes": processes,
            "workers": processes - servers, "servers": servers,
            "oversubscribed": D.oversubscribed(processes)}
    if cluster is not None:
        base.update(hosts=cluster.hosts, rate=cluster.rates[0])
    # S = 0: both sides in one job; S >= 1: one job per side, back to back
    groups = [sides] if servers == 0 else [[side] for side in sides]
    # the Allreduce limit is timed once, in the first job
    jobs = [run_job(group, processes, servers, plan, args, tmp, cluster, allreduce=i == 0)
            for i, group in enumerate(groups)]
    cases = []
    for nbytes, _, _ in plan:
        label = str(C.elements(nbytes, 4) * 4)
        case = dict(base, bytes=int(label))
        failed = next((j for j in jobs if not j["ok"]), None)
        if failed is not None:
            cases.append(dict(case, ok=False, error=failed["error"],
                              output_tail=failed.get("output_tail", "")))
            continue
        entries = [j["timings"][label] for j in jobs]
        samples = {n: s["samples_s"] for e in entries for n, s in e["sides"].items()}
        allreduce = entries[0]["allreduce"]
        case["limit"] = {"kind": "MPI Allreduce", "seconds": allreduce["median_s"],
                         "allreduce": allreduce}
        if cluster is not None:
            case["link_limit_s"] = (2 * (processes - 1) / processes * case["bytes"]
                                    / (emulated.rate_bits(cluster.rates[0]) / 8))
        case["jobs_s"] = [j["seconds"] for j in jobs]
        cases.append(finish_case(case, samples))
    return cases


def run_job(group, processes: int, servers: int, plan: list, args, tmp: Path,
            cluster, allreduce: bool = True) -> dict:
    """One mpiexec job of `group`'s sides; its timings as bench_dist's jobs give them."""
    mpiexec = D.find_mpiexec()
    names = "+".join(name for name, _ in group)
    where = f"on {cluster.hosts} hosts at {cluster.rates[0]}" if cluster else "here"
    what = f"{processes} processes S={servers} {names} {where}"
    if mpiexec is None:
        return {"what": what, "ok": False, "error": "no mpiexec found", "timings": {}}
    result = tmp / "job.json"
    result.unlink(missing_ok=True)
    child = [sys.executable, str(CHILD), "--plan", json.dumps(plan), "--servers",
             str(servers), "--sides", json.dumps(group), "--op", args.op,
             "--optimizer", args.optimizer, "--result", str(result)]
    if not allreduce:
        child.append("--no-allreduce")
    if cluster is None:
        specs = [([mpiexec, "-n", str(processes), *child], child_env(None))]
    else:
        hosts = ",".join(f"{address}:1" for address in cluster.addresses)
        argv = [mpiexec, "-hosts", hosts, "-n", str(processes), *child]
        specs = [(cluster.command(0, argv), child_env(cluster.env()))]
    job = D.finish_job(D.run_group(specs, args.timeout), result, what)
    state = "ok" if job["ok"] else f"FAILED ({job['error']})"
    print(f"  {what}: {state}, {job['seconds']:.1f} s", file=sys.stderr, flush=True)
    return job


def child_env(base: dict | None) -> dict:
    """The environment of a job: this checkout first on the path, and the default order
    left to the store (no GPUKV_DETERMINISTIC)."""
    env = dict(os.environ if base is None else base)
    env.pop(ENV_SWITCH, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent),
                                                      env.get("PYTHONPATH")]))
    return env


# --------------------------------------------------------------------------- results
def finish_case(case: dict, samples: dict) -> dict:
    """Each side's statistics, the ratio deterministic / default and the fractions of
    the limit, from the rounds' seconds of both sides."""
    default, det = samples["default"], samples["deterministic"]
    case["ok"], case["error"] = True, None
    for name in SIDES:
        stats = C.summarize(samples[name])
        stats["spread"] = (stats["max_s"] - stats["min_s"]) / stats["median_s"]
        stats["samples_s"] = samples[name]
        stats["of_limit"] = case["limit"]["seconds"] / stats["median_s"]
        case[name] = stats
    case["ratio"] = case["deterministic"]["median_s"] / case["default"]["median_s"]
    pairs = [d / b for b, d in zip(default, det)]
    case["ratio_paired"] = {"median": statistics.median(pairs), "min": min(pairs),
                            "max": max(pairs)}
    case["within_goal"] = case["ratio"] <= GOAL_RATIO
    return case


def case_name(c: dict) -> str:
    """'device x8', '4p S=0 over', '2 hosts 1gbit S=0' ('over': more processes than
    cores)."""
    if c["scope"] == "process":
        return f"{c['store']} x{c['devices']}"
    over = " over" if c.get("oversubscribed") else ""
    if c["scope"] == "processes":
        return f"{c['processes']}p S={c['servers']}{over}"
    return f"{c['hosts']} hosts {c['rate']} S={c['servers']}{over}"


def print_report(cases: list[dict], args) -> None:
    sides = "default order twice (--same-order)" if args.same_order else \
        "default order vs deterministic=True"
    print(f"\nsync round of one float32 key ({args.op}, optimizer {args.optimizer}), {sides}; "
          f"median [min-max] of {args.iters} rounds each, in turn; ratio = deterministic / "
          f"default (medians; paired: median of the rounds' ratios); limit: memory bandwidth "
          f"(process) or MPI Allreduce, of limit = limit / median, per side; link = "
          f"2(N-1)/N x bytes / rate ('over': more processes than cores)")
    rows = []
    for c in cases:
        size = C.format_size(c["bytes"])
        if not c["ok"]:
            rows.append([c["scope"], case_name(c), size, "failed"] + ["-"] * 8)
            continue
        d, x = c["default"], c["deterministic"]
        rows.append([c["scope"], case_name(c), size, C.format_seconds(d["median_s"]),
                     _range(d), C.format_seconds(x["median_s"]), _range(x),
                     f"{c['ratio']:.3f}", f"{c['ratio_paired']['median']:.3f}",
                     C.format_seconds(c["limit"]["seconds"]),
                     f"{d['of_limit']:.0%}/{x['of_limit']:.0%}",
                     C.format_seconds(c.get("link_limit_s"))])
    C.print_table(["scope", "case", "size", "default", "min-max", "determ.", "min-max",
                   "ratio", "paired", "limit", "of limit", "link"], rows)
    ok = [c for c in cases if c["ok"]]
    if ok:
        worst = max(ok, key=lambda c: c["ratio"])
        print(f"\nworst ratio {worst['ratio']:.3f} ({worst['scope']} {case_name(worst)} "
              f"{C.format_size(worst['bytes'])}); ratio <= {GOAL_RATIO:.2f} (the goal) in "
              f"{sum(c['within_goal'] for c in ok)} of {len(ok)} cases")
    for c in cases:
        if not c["ok"]:
            print(f"\nFAILED {c['scope']} {case_name(c)} {C.format_size(c['bytes'])}: "
                  f"{c['error']}", file=sys.stderr)
            for line in c.get("output_tail", "").strip().splitlines()[-8:]:
                print(f"    {line}", file=sys.stderr)
    sys.stdout.flush()


def _range(stats: dict) -> str:
    return f"{C.format_seconds(stats['min_s'])}-{C.format_seconds(stats['max_s'])}"


def summary(cases: list[dict]) -> dict:
    ok = [c for c in cases if c["ok"]]
    ratios = [c["ratio"] for c in ok]
    return {"cases": len(cases), "failed": len(cases) - len(ok),
            "worst_ratio": max(ratios) if ratios else None,
            "median_ratio": statistics.median(ratios) if ratios else None,
            "goal_ratio": GOAL_RATIO, "goal_met": bool(ok) and max(ratios) <= GOAL_RATIO,
            "within_3_percent": bool(ok) and max(ratios) <= DEFAULT_WORTHY_RATIO}


def plot(cases: list[dict], path: Path) -> None:
    """Top: each case's ratio with its paired rounds' range, the goal; bottom: both
    sides' medians with their min-max, and the limit."""
    plt = C.pyplot()
    ok = [c for c in cases if c["ok"]]
    labels = [f"{case_name(c)}\n{C.format_size(c['bytes'])}" for c in ok]
    xs = list(range(len(ok)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.7 * len(ok) + 2), 7.5),
                                      sharex=True)
    colors = [f"C{SCOPES.index(c['scope'])}" for c in ok]
    ratios = [c["ratio"] for c in ok]
    spread = [[c["ratio"] - c["ratio_paired"]["min"] for c in ok],
              [c["ratio_paired"]["max"] - c["ratio"] for c in ok]]
    top.bar(xs, [r - 1 for r in ratios], bottom=1, yerr=spread, color=colors, capsize=2)
    top.axhline(1.0, color="k", lw=0.8)
    top.axhline(GOAL_RATIO, color="r", ls="--", lw=1, label=f"goal {GOAL_RATIO:.2f}")
    top.set_ylabel("deterministic / default")
    for scope in dict.fromkeys(c["scope"] for c in ok):
        top.bar([0], [0], bottom=1, color=f"C{SCOPES.index(scope)}", label=scope)
    top.legend(fontsize=8)
    top.grid(True, axis="y", alpha=0.3)
    for name, offset, color in (("default", -0.2, "C7"), ("deterministic", 0.2, "C3")):
        med = [c[name]["median_s"] * 1e3 for c in ok]
        err = [[(c[name]["median_s"] - c[name]["min_s"]) * 1e3 for c in ok],
               [(c[name]["max_s"] - c[name]["median_s"]) * 1e3 for c in ok]]
        bottom.bar([x + offset for x in xs], med, width=0.4, yerr=err, color=color,
                   capsize=2, label=name)
    bottom.scatter(xs, [c["limit"]["seconds"] * 1e3 for c in ok], marker="_", s=300,
                   color="k", zorder=3, label="limit")
    bottom.set_yscale("log")
    bottom.set_ylabel("ms per round")
    bottom.legend(fontsize=8)
    bottom.grid(True, axis="y", which="both", alpha=0.3)
    bottom.set_xticks(xs, labels, rotation=60, ha="right", fontsize=7)
    C.save_figure(fig, path)


# ---------------------------------------------------------------------------- driver
def build_parser() -> argparse.ArgumentParser:
    p = C.ArgumentParser(prog=Path(__file__).name,
                         description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--scopes", type=C.name_list(SCOPES, "scope"), default=None,
                   metavar="NAMES", help=f"what to run among {', '.join(SCOPES)} "
                                         "(default: all)")
    C.add_sizes_option(p, None, "the key's size (float32, bytes / 4 elements)", minimum=4,
                       default_text=f"{DEFAULTS['sizes']}; 64K with --quick")
    C.add_devices_option(p, DEFAULTS["devices"], "host devices of the one-process stores")
    p.add_argument("--stores", type=C.name_list(STORES, "store"), default=",".join(STORES),
                   metavar="NAMES", help="one-process stores among device, local "
                                         "(default: both)")
    p.add_argument("--processes", type=C.host_counts, default=None, metavar="COUNTS",
                   help=f"MPI processes on this machine, each a case (default "
                        f"{DEFAULTS['processes']}; 2 with --quick)")
    p.add_argument("--hosts", type=C.host_counts, default=None, metavar="COUNTS",
                   help=f"emulated hosts, one process each (default {DEFAULTS['hosts']}; "
                        "2 with --quick)")
    p.add_argument("--rates", type=C.link_rates, default=None, metavar="RATES",
                   help=f"the emulated hosts' link rates (default {DEFAULTS['rates']}; "
                        "10gbit with --quick)")
    p.add_argument("--servers", type=_server_counts, default=DEFAULTS["servers"],
                   metavar="COUNTS", help="num_servers of the MPI cases, each a case: 0 "
                                          "and/or 1; 1 runs two jobs a case, one per side "
                                          f"(default {DEFAULTS['servers']})")
    p.add_argument("--op", default="push+pull", choices=["push+pull", "pushpull"],
                   help="one round: push then pull, or one pushpull call")
    p.add_argument("--optimizer", default="none", choices=["none", "sgd"],
                   help="none: a round assigns the sum; sgd: SGD where the key is served")
    C.add_timing_options(p, 1, 11, unit="round", note="per side and case")
    p.add_argument("--same-order", action="store_true",
                   help="time the default order on both sides (no deterministic= passed): "
                        "the ratio's noise floor, and a run on a gpukv without the option")
    p.add_argument("--quick", action="store_true",
                   help="a short run: 1 warm-up and 3 timed rounds, and the axes not given "
                        "restricted to 64K, 2 processes, 2 hosts and 10gbit")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="seconds per MPI job (default 300)")
    C.add_out_option(p, "deterministic_<machine>.json and .png")
    return p


def _server_counts(text: str) -> list[int]:
    counts = [p.strip() for p in text.split(",") if p.strip()]
    if not counts or any(c not in ("0", "1") for c in counts):
        raise C.BadArgument(f"{text!r}: expected 0, 1 or 0,1")
    return [int(c) for c in dict.fromkeys(counts)]


def settle(args) -> None:
    """Fill in the axes' defaults (--quick's where it is given)."""
    quick = QUICK if args.quick else {}
    args.scopes = args.scopes or list(SCOPES)
    args.sizes = list(dict.fromkeys(args.sizes or quick.get("sizes")
                                    or C.parse_sizes(DEFAULTS["sizes"])))
    args.processes = args.processes or quick.get("processes") or C.parse_ints(
        DEFAULTS["processes"])
    args.hosts = args.hosts or quick.get("hosts") or C.parse_ints(DEFAULTS["hosts"])
    args.rates = args.rates or quick.get("rates") or C.link_rates(DEFAULTS["rates"])
    if quick:
        args.warmup = min(args.warmup, quick["warmup"])
        args.iters = min(args.iters, quick["iters"])


def run_cases(args, notes: list[str]) -> tuple[list[dict], dict]:
    """Every case of every scope asked for, and the memory bandwidth measured."""
    sides = side_options(args.same_order)
    plan = [[n, args.warmup, args.iters] for n in args.sizes]
    cases: list[dict] = []
    copy = None
    if "process" in args.scopes:
        copy = C.copy_bandwidth(threads=D.usable_cpus())
        print(f"NumPy copy, {D.usable_cpus()} threads: {copy['median_Bps'] / 1e9:.2f} GB/s",
              file=sys.stderr, flush=True)
        for store in args.stores:
            for devices in args.devices:
                for nbytes in args.sizes:
                    case = one_process_case(store, devices, nbytes, args, sides,
                                            copy["median_Bps"])
                    print(f"  {case_name(case)} {C.format_size(nbytes)}: "
                          f"{'ok' if case['ok'] else 'FAILED'}", file=sys.stderr, flush=True)
                    cases.append(case)
    with tempfile.TemporaryDirectory(prefix="gpukv-bench-det-") as tmp:
        if "processes" in args.scopes:
            for processes in args.processes:
                for servers in args.servers:
                    cases += mpi_cases("processes", processes, servers, plan, args, sides,
                                       Path(tmp))
        why = emulated.unavailable() if "hosts" in args.scopes else None
        if why:
            notes.append(f"hosts not emulated: {why}")
            cases.append({"scope": "hosts", "store": "dist_sync", "hosts": 0, "rate": "-",
                          "servers": 0, "processes": 0, "bytes": 0, "ok": False,
                          "error": f"cannot emulate hosts: {why}"})
        elif "hosts" in args.scopes:
            for hosts in args.hosts:
                for rate in args.rates:
                    with emulated.EmulatedCluster(hosts, rate) as cluster:
                        for servers in args.servers:
                            cases += mpi_cases("hosts", hosts, servers, plan, args, sides,
                                               Path(tmp), cluster)
    return cases, copy


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    settle(args)
    notes = []
    if os.environ.pop(ENV_SWITCH, None) is not None:
        notes.append(f"{ENV_SWITCH} was set: unset here, the default side is the store's "
                     "default order")
    if args.same_order:
        notes.append("--same-order: both sides are the default order (deterministic= not "
                     "passed); the ratios are the noise floor")
    load_before = os.getloadavg()
    if load_before[0] > 0.5 * D.usable_cpus():
        notes.append(f"the machine was busy (load {load_before[0]:.1f} on "
                     f"{D.usable_cpus()} cores): timings are noisy")
    start = time.perf_counter()
    cases, copy = run_cases(args, notes)
    wall = time.perf_counter() - start
    print_report(cases, args)
    for note in notes:
        print(f"note: {note}")
    print(f"\ntook {wall:.0f} s")
    if C.out_folder(args.out) is not None:
        payload = {
            "benchmark": "deterministic reduction order cost",
            "machine": C.machine_info(),
            "versions": C.library_versions("gpukv", "numpy", "mpi4py", "matplotlib"),
            "settings": {"scopes": args.scopes, "sizes": args.sizes,
                         "devices": args.devices, "stores": args.stores,
                         "processes": args.processes, "hosts": args.hosts,
                         "rates": args.rates, "servers": args.servers, "op": args.op,
                         "optimizer": args.optimizer, "warmup": args.warmup,
                         "iters": args.iters, "same_order": args.same_order,
                         "sides": dict(side_options(args.same_order)),
                         "timeout_s": args.timeout, "mpiexec": D.find_mpiexec()},
            "memory_bandwidth": copy,
            "usable_cpus": D.usable_cpus(),
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "notes": notes + [
                "ratio = deterministic median / default median; ratio_paired: the "
                "per-round ratios of rounds run next to each other",
                "process limit: 2(n+1) x bytes at the NumPy copy bandwidth; MPI limit: "
                "Allreduce of the same bytes between the same processes, in the same job",
                "hosts: network namespaces on a bridge, links shaped with tc tbf, MPI over "
                "TCP; every host shares this machine's cores"],
            "summary": summary(cases),
            "wall_s": round(wall, 1),
            "cases": cases,
        }
        print()
        C.save_results(payload, args.out, C.result_name("deterministic"),
                       plot=lambda png: plot(cases, png))
    return 0 if cases and all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())

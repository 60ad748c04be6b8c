"""Several-process push+pull on one machine: gpukv's `dist_sync` store against raw MPI
Allreduce and MXNet 1.9.1's `dist_sync` (ps-lite).

    python benchmarks/bench_dist.py --mxnet-python /path/to/mxenv/bin/python
    python benchmarks/bench_dist.py --layouts 2w1s,2w0s --sizes 4KB,4MB --out /tmp/dist

A layout `WwSs` is W workers and S servers. For gpukv it is one MPI job of W+S ranks
(`mpiexec -n W+S python bench_dist.py --child gpukv ...`): with S >= 1 the first S ranks
serve inside `gpukv.create('dist_sync', num_servers=S)`, with S = 0 every rank is a
worker and serves a shard. Each worker pushes one float32 array per key and pulls the
result back; one iteration is push + pull (or `--op pushpull`), timed one by one after a
barrier, and throughput is the key's bytes divided by the median seconds of an iteration
(per worker). Every job runs `--rounds` times, who goes first alternating between rounds;
figures are medians over rounds, and ratios are taken round by round (the two sides ran
next to each other) before the median. The first pull of every key is checked.

Side by side, on the same sizes:
- Allreduce: `comm.Allreduce` of the same bytes per rank between W ranks (mpi4py, float32),
  the limit of the MPI engine gpukv runs on; its 4 KB latency is always measured.
- MXNet: with `--mxnet-python`, a scheduler, S servers and W workers of MXNet 1.9.1's
  dist_sync over ps-lite on 127.0.0.1 (benchmarks/_mxnet_dist.py). A layout with S = 0 is
  compared with MXNet's W workers and 1 server (MXNet needs a server).

Every job is a subprocess with a time limit; worker 0 writes its timings to a file the
driver reads. Sizes below 1 MB run more iterations (up to 5x `--iters`). When a job has
more busy processes than the machine has cores it is marked 'oversubscribed': MPI ranks
busy-poll while they wait, so those figures say more about the scheduler than the
transport. Results go to dist_<machine>.json (and a PNG when matplotlib is installed) in
--out DIR (default benchmarks/results/; '-' writes nothing); the exit status is 1 when
any case failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402

DEFAULT_SIZES = "4KB,64KB,1MB,4MB,16MB"
DEFAULT_LAYOUTS = "2w1s,2w2s,4w1s,2w0s,4w0s"
LATENCY_BYTES = 4096
LIBS = ("gpukv", "mpi", "mxnet")
# The goals the numbers are read against.
MXNET_SPEEDUP_GOAL = ("2w1s", 4 << 20, 2.0)     # layout, bytes, gpukv / MXNet throughput
ALLREDUCE_FRACTION_GOAL = (4 << 20, 0.80)        # S = 0, bytes and up, of Allreduce's
LOG_TAIL = 2000                                  # characters of a failed job's output kept


# ------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    workers: int
    servers: int

    @property
    def name(self) -> str:
        return f"{self.workers}w{self.servers}s"

    @property
    def processes(self) -> int:
        return self.workers + self.servers


def parse_layouts(text: str) -> list[Layout]:
    """'2w1s,4w0s' -> [Layout(2, 1), Layout(4, 0)]."""
    layouts = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)w(\d+)s", part)
        if match is None or int(match.group(1)) < 1:
            raise C.BadArgument(f"layout {part!r}: expected WwSs with W >= 1, e.g. 2w1s "
                                "(2 workers, 1 server) or 4w0s (no dedicated server)")
        layouts.append(Layout(int(match.group(1)), int(match.group(2))))
    if not layouts:
        raise C.BadArgument("no layout given, e.g. 2w1s,2w0s")
    return list(dict.fromkeys(layouts))


def mxnet_layout(layout: Layout) -> Layout:
    """MXNet's counterpart: the same workers, and at least one server."""
    return Layout(layout.workers, max(1, layout.servers))


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def oversubscribed(busy_processes: int) -> bool:
    return busy_processes > usable_cpus()


def make_plan(sizes: list[int], warmup: int, iters: int) -> list[list[int]]:
    """[[bytes, warmup, iters], ...]: fixed counts, the same on every rank (a sync store
    needs every worker in every round); sizes below 1 MB get up to 5x the iterations."""
    return [[n, warmup, iters * max(1, min(5, (1 << 20) // n))] for n in sizes]


# ------------------------------------------------------------------------- children
def child_main(args) -> int:
    """One rank of an MPI job (`--child gpukv|mpi`); worker 0 writes the timings.
    mpi4py is imported by gpukv itself first, so gpukv's own MPI settings apply."""
    layout = parse_layouts(args.layout)[0]
    try:
        if args.child == "gpukv":
            result = gpukv_child(layout, json.loads(args.plan), args.op, args.optimizer,
                                 json.loads(args.compression or "null"), not args.no_halves)
        else:
            result = allreduce_child(layout, json.loads(args.plan))
        if result is not None:
            with open(args.result, "w") as f:
                json.dump(result, f)
    except Exception:  # not SystemExit: a gpukv server ends its process that way
        # One rank failing leaves the others waiting in MPI: end the whole job now.
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    return 0


def expected_sum(workers: int, compression: dict | None = None) -> float:
    """The first pull when worker r pushes r + 1 everywhere: their sum, or the sum of what
    the compression makes of them (2bit sends +threshold, 1bit +1 for values above it)."""
    kind = (compression or {}).get("type", "none")
    if kind == "2bit":
        return workers * float(compression.get("threshold", 0.5))
    if kind == "1bit":
        return workers * (1.0 if 1 > float(compression.get("threshold", 0.5)) else -1.0)
    return workers * (workers + 1) / 2


def time_plan(plan, make, barrier) -> dict:
    """Times the step `make(sizes, keys)` returns for every entry of the plan (one key, or
    several pushed and pulled together); every key of the plan has its own number."""
    timings = {}
    first = 0
    for nbytes, warmup, iters in plan:
        sizes = C.entry_sizes(nbytes)
        step, check = make(sizes, list(range(first, first + len(sizes))))
        first += len(sizes)
        step()
        ok = check()
        barrier()
        samples = C.time_calls(step, warmup=warmup, iters=iters)
        timings[C.entry_label(nbytes)] = {**C.summarize(samples), "check": ok}
    return timings


def gpukv_child(layout: Layout, plan: list, op: str, optimizer: str,
                compression: dict | None = None, halves: bool = True) -> dict | None:
    import numpy as np

    import gpukv

    kv = gpukv.create("dist_sync", num_servers=layout.servers)  # servers never return
    if kv.num_workers != layout.workers:
        raise RuntimeError(f"{kv.num_workers} workers, expected {layout.workers}")
    if compression:
        kv.set_gradient_compression(compression)
    expected = expected_sum(layout.workers, compression)
    if optimizer == "sgd":  # the sharded update: w = 0 - 1 * sum after the first round
        kv.set_optimizer(gpukv.optim.SGD(learning_rate=1.0))
        expected = -expected

    low_rank = (compression or {}).get("type") == "powersgd"

    def make(sizes, keys):
        # PowerSGD compresses matrices: its keys are of 1024 columns where they divide
        values = [np.full((n // 4 // 1024, 1024) if low_rank and n % 4096 == 0 else n // 4,
                          kv.rank + 1, np.float32) for n in sizes]
        outs = [np.empty_like(v) for v in values]
        # one key goes in as itself, several as lists (one call for all of them)
        key, value, out = (keys[0], values[0], outs[0]) if len(keys) == 1 else (
            keys, values, outs)
        kv.init(key, [np.zeros_like(v) for v in values] if len(keys) > 1
                else np.zeros_like(value))
        if op == "pushpull":
            def step():
                kv.pushpull(key, value, out)
        else:
            def step():
                kv.push(key, value)
                kv.pull(key, out=out)
        if low_rank:  # a low-rank sum is the sum up to rounding
            return step, lambda: all(np.allclose(o, expected, rtol=1e-4) for o in outs)
        return step, lambda: all(bool((o == expected).all()) for o in outs)

    timings = time_plan(plan, make, kv.barrier)
    halves = time_halves(kv, plan) if op == "push+pull" and halves else {}
    kv.barrier()
    if kv.rank != 0:
        return None
    return {"timings": timings,
            "halves": halves,
            "meta": {"versions": C.library_versions("gpukv", "numpy", "mpi4py"),
                     "mpi_library": _mpi_library(), "workers": kv.num_workers, "op": op,
                     "optimizer": optimizer, "compression": compression}}


def time_halves(kv, plan: list) -> dict:
    """Median seconds of the push and of the pull of an iteration, apart: where the time
    of push+pull goes (the pull is a copy of the store's value into `out`)."""
    import numpy as np

    halves = {}
    for key, (nbytes, warmup, iters) in enumerate(plan):
        value = np.full(max(1, nbytes // 4), kv.rank + 1, np.float32)
        out = np.empty_like(value)
        push, pull = [], []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            kv.push(key, value)
            t1 = time.perf_counter()
            kv.pull(key, out=out)
            if i >= warmup:
                push.append(t1 - t0)
                pull.append(time.perf_counter() - t1)
        halves[str(value.nbytes)] = {"push_s": statistics.median(push),
                                     "pull_s": statistics.median(pull)}
    return halves


def allreduce_child(layout: Layout, plan: list) -> dict | None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size != layout.workers:
        raise RuntimeError(f"{comm.size} ranks, expected {layout.workers}")
    expected = expected_sum(layout.workers)

    def make(sizes, keys):
        sends = [np.full(n // 4, comm.rank + 1, np.float32) for n in sizes]
        recvs = [np.empty_like(s) for s in sends]

        def step():
            for send, recv in zip(sends, recvs):
                comm.Allreduce(send, recv)
        return step, lambda: all(bool((r == expected).all()) for r in recvs)

    timings = time_plan(plan, make, comm.Barrier)
    comm.Barrier()
    if comm.rank != 0:
        return None
    return {"timings": timings,
            "meta": {"versions": C.library_versions("numpy", "mpi4py"),
                     "mpi_library": _mpi_library(), "ranks": comm.size, "op": "Allreduce"}}


def _mpi_library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().strip().splitlines()[0]


# --------------------------------------------------------------------------- jobs
def find_mpiexec() -> str | None:
    """The mpiexec `gpukv run` calls: beside this interpreter, else on PATH."""
    from gpukv.launcher.launch import find_mpiexec as launcher
    return launcher()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(specs: list[tuple[list[str], dict | None]], timeout: float) -> dict:
    """Starts every (command, env) at once and waits for all of them. The first failure
    or the time limit ends the rest (each runs in its own session, so its children too)."""
    procs, logs = [], []
    start = time.perf_counter()
    try:
        for cmd, env in specs:
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, cwd=HERE.parent, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, text=True))
        deadline = time.monotonic() + timeout
        timed_out = False
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    output = []
    for log in logs:
        log.seek(0)
        output.append(log.read())
        log.close()
    return {"returncodes": [p.returncode for p in procs], "timed_out": timed_out,
            "seconds": time.perf_counter() - start, "output": output}


def finish_job(job: dict, result_path: Path, what: str) -> dict:
    """The job's timings and meta (from worker 0's file) and its error, if any."""
    result = {}
    if result_path.exists():
        with contextlib.suppress(ValueError):
            result = json.loads(result_path.read_text())
    error = None
    if job["timed_out"]:
        error = "timed out" + (" after writing its results" if result else "")
    elif any(job["returncodes"]):
        error = f"exit codes {job['returncodes']}"
    elif not result:
        error = "no results written"
    bad = [n for n, t in result.get("timings", {}).items() if not t.get("check", True)]
    if bad and error is None:
        error = "wrong result pulled at " + ", ".join(C.format_size(int(n)) for n in bad)
    out = {"what": what, "ok": error is None, "error": error,
           "seconds": round(job["seconds"], 2), "returncodes": job["returncodes"],
           "timings": result.get("timings", {}), "halves": result.get("halves", {}),
           "meta": result.get("meta")}
    if error is not None:
        out["output_tail"] = "\n".join(o.strip() for o in job["output"] if o.strip())[-LOG_TAIL:]
    return out


def run_mpi_job(lib: str, layout: Layout, plan: list, args, tmp: Path) -> dict:
    what = f"{lib} {layout.name}"
    mpiexec = find_mpiexec()
    if mpiexec is None:
        return {"what": what, "ok": False, "error": "no mpiexec found", "timings": {}}
    ranks = layout.processes if lib == "gpukv" else layout.workers
    result = tmp / f"{lib}_{layout.name}.json"
    cmd = [mpiexec, "-n", str(ranks), *child_command(lib, layout, plan, args, result)]
    out = finish_job(run_group([(cmd, None)], args.timeout), result, what)
    out["command"] = " ".join(cmd[:4] + [Path(cmd[4]).name] + cmd[5:])
    return out


def child_command(lib: str, layout: Layout, plan: list, args, result: Path,
                  options: tuple = ()) -> list[str]:
    """What every rank of an MPI job (`lib`: gpukv or mpi) runs: this script as a child,
    `options` (more of the hidden child options) added."""
    return [sys.executable, str(Path(__file__).resolve()), "--child", lib,
            "--layout", layout.name, "--plan", json.dumps(plan), "--op", args.op,
            "--optimizer", args.optimizer, "--result", str(result), *options]


def mxnet_command(plan: list, args, result: Path) -> list[str]:
    """What every role of an MXNet job runs (its role and peers come in DMLC_*)."""
    return [args.mxnet_python, str(HERE / "_mxnet_dist.py"), "--plan", json.dumps(plan),
            "--op", args.op, "--optimizer", args.optimizer, "--result", str(result)]


def run_mxnet_job(layout: Layout, plan: list, args, tmp: Path) -> dict:
    what = f"mxnet {layout.name}"
    result = tmp / f"mxnet_{layout.name}.json"
    base = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()),
                DMLC_NODE_HOST="127.0.0.1", DMLC_NUM_SERVER=str(layout.servers),
                DMLC_NUM_WORKER=str(layout.workers))
    cmd = mxnet_command(plan, args, result)
    roles = ["scheduler"] + ["server"] * layout.servers + ["worker"] * layout.workers
    specs = [(cmd, dict(base, DMLC_ROLE=role)) for role in roles]
    return finish_job(run_group(specs, args.timeout), result, what)


# ------------------------------------------------------------------------- results
def round_seconds(runs: list[dict] | None, nbytes: int) -> list[float | None]:
    """Median seconds of one iteration in every round (None where that round failed)."""
    out = []
    for job in runs or []:
        t = job["timings"].get(str(nbytes)) if job["ok"] else None
        out.append(None if t is None else t["median_s"])
    return out


def side(runs: list[dict] | None, nbytes: int, busy: int) -> dict | None:
    """One library's figures for one size: the median over rounds of each round's
    median seconds, GB/s, and the rounds' spread."""
    if runs is None:
        return None
    per_round = round_seconds(runs, nbytes)
    good = [t for t in per_round if t is not None]
    if not good:
        error = next((j["error"] for j in runs if j["error"]), None)
        return {"ok": False, "error": error or "size not measured",
                "oversubscribed": oversubscribed(busy)}
    median = statistics.median(good)
    stats = [j["timings"][str(nbytes)] for j in runs if j["ok"]]
    return {"ok": True, "median_s": median, "per_round_s": per_round,
            "min_s": min(t["min_s"] for t in stats),
            "iters_per_round": stats[0]["iters"], "failed_rounds": per_round.count(None),
            "GBps": nbytes / median / 1e9, "processes": busy,
            "oversubscribed": oversubscribed(busy)}


def build_cases(layouts, sizes, jobs) -> list[dict]:
    cases = []
    for layout in layouts:
        mx_layout = mxnet_layout(layout)
        for n in sizes:
            nbytes = max(1, n // 4) * 4
            runs = {"gpukv": jobs.get(("gpukv", layout.name)),
                    "allreduce": jobs.get(("mpi", layout.workers)),
                    "mxnet": jobs.get(("mxnet", mx_layout.name))}
            busy = {"gpukv": layout.processes, "allreduce": layout.workers,
                    "mxnet": mx_layout.processes}
            case = {"layout": layout.name, "workers": layout.workers,
                    "servers": layout.servers, "bytes": nbytes,
                    "oversubscribed": oversubscribed(layout.processes),
                    **{lib: side(r, nbytes, busy[lib]) for lib, r in runs.items()},
                    "mxnet_layout": mx_layout.name if runs["mxnet"] else None}
            for lib in ("allreduce", "mxnet"):
                case[f"gpukv_over_{lib}"] = _ratio(runs[lib], runs["gpukv"], nbytes)
            case["gpukv_halves"] = _halves(runs["gpukv"], nbytes)
            cases.append(case)
    return cases


def _halves(runs: list[dict] | None, nbytes: int) -> dict | None:
    """The median over rounds of gpukv's push and pull seconds, timed apart."""
    found = [j["halves"][str(nbytes)] for j in runs or []
             if j["ok"] and str(nbytes) in j.get("halves", {})]
    if not found:
        return None
    return {half: statistics.median(h[half] for h in found) for half in ("push_s", "pull_s")}


def _ratio(base: list[dict] | None, gpukv: list[dict] | None, nbytes: int) -> float | None:
    """gpukv's throughput over `base`'s (base seconds / gpukv seconds), taken round by
    round (the two ran next to each other) and the median over rounds."""
    pairs = zip(round_seconds(base, nbytes), round_seconds(gpukv, nbytes))
    ratios = [b / g for b, g in pairs if b is not None and g is not None]
    return statistics.median(ratios) if ratios else None


def build_goals(cases: list[dict]) -> list[dict]:
    goals = []
    layout, size, target = MXNET_SPEEDUP_GOAL
    for c in cases:
        if c["layout"] == layout and c["bytes"] == size:
            goals.append(_goal(f"{layout} {C.format_size(size)}: gpukv / MXNet throughput",
                               c["gpukv_over_mxnet"], f">= {target}x",
                               None if c["gpukv_over_mxnet"] is None
                               else c["gpukv_over_mxnet"] >= target))
    size, target = ALLREDUCE_FRACTION_GOAL
    for c in cases:
        if c["servers"] == 0 and c["bytes"] >= size:
            r = c["gpukv_over_allreduce"]
            goals.append(_goal(f"{c['layout']} {C.format_size(c['bytes'])}: gpukv / "
                               f"Allreduce throughput", r, f">= {target:.0%}",
                               None if r is None else r >= target))
    for c in cases:
        if c["bytes"] == LATENCY_BYTES and c["mxnet"] is not None:
            g, m = c["gpukv"], c["mxnet"]
            value = g["median_s"] if g and g["ok"] else None
            limit = m["median_s"] if m["ok"] else None
            goals.append(_goal(f"{c['layout']} 4K latency vs MXNet {c['mxnet_layout']}",
                               value, "<= " + C.format_seconds(limit),
                               None if value is None or limit is None else value <= limit,
                               seconds=True))
    return goals


def _goal(name, value, target, met, seconds=False) -> dict:
    return {"goal": name, "value": value, "target": target, "met": met,
            "value_text": "-" if value is None else
            (C.format_seconds(value) if seconds else f"{value:.2f}x")}


def print_report(cases, goals, jobs, args) -> None:
    rows = []
    for c in cases:
        procs = f"{c['workers'] + c['servers']}" + (" over" if c["oversubscribed"] else "")
        rows.append([c["layout"], C.format_size(c["bytes"]), procs,
                     *_side_cells(c["gpukv"]), *_side_cells(c["allreduce"]),
                     *_side_cells(c["mxnet"]), c["mxnet_layout"] or "-",
                     _x(c["gpukv_over_allreduce"]), _x(c["gpukv_over_mxnet"])])
    print(f"\npush+pull per worker ({args.op}), float32; median over {args.rounds} rounds of "
          f"the median iteration; Allreduce between the same workers; ratios = gpukv's "
          f"throughput over the other's; {usable_cpus()} cores ('over' = more processes "
          "than cores)")
    C.print_table(["layout", "size", "procs", "gpukv", "GB/s", "Allreduce", "GB/s", "MXNet",
                   "GB/s", "MXNet of", "/Allreduce", "/MXNet"], rows)
    latency = [(w, side(runs, LATENCY_BYTES, w)) for (lib, w), runs in jobs.items()
               if lib == "mpi"]
    latency = [(w, s) for w, s in sorted(latency) if s["ok"]]
    if latency:
        print("\nAllreduce 4K latency: " + ", ".join(
            f"{w} ranks {C.format_seconds(s['median_s'])}" for w, s in latency))
    halves = [c for c in cases if c.get("gpukv_halves")]
    if halves:
        print("\ngpukv's push and pull timed apart (the pull copies the store's value into "
              "`out`)")
        C.print_table(["layout", "size", "push", "pull", "Allreduce"],
                      [[c["layout"], C.format_size(c["bytes"]),
                        C.format_seconds(c["gpukv_halves"]["push_s"]),
                        C.format_seconds(c["gpukv_halves"]["pull_s"]),
                        _side_cells(c["allreduce"])[0]] for c in halves])
    if goals:
        print()
        C.print_table(["goal", "value", "target", "met"],
                      [[g["goal"], g["value_text"], g["target"],
                        {True: "ok", False: "MISS", None: "n/a"}[g["met"]]] for g in goals])
    sys.stdout.flush()
    failed = [j for runs in jobs.values() for j in runs if not j["ok"]]
    for j in failed:
        print(f"\nFAILED {j['what']}, round {j['round']}: {j['error']}", file=sys.stderr)
        tail = j.get("output_tail", "").strip().splitlines()[-8:]
        for line in tail:
            print(f"    {line}", file=sys.stderr)


def _side_cells(s: dict | None) -> list:
    if s is None:
        return ["-", None]
    if not s["ok"]:
        return ["failed", None]
    return [C.format_seconds(s["median_s"]), round(s["GBps"], 3)]


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def plot(cases: list[dict], path: Path) -> None:
    plt = C.pyplot()

    layouts = list(dict.fromkeys(c["layout"] for c in cases))
    fig, axes = plt.subplots(1, len(layouts), figsize=(4.5 * len(layouts), 4), squeeze=False)
    for ax, name in zip(axes[0], layouts):
        mine = [c for c in cases if c["layout"] == name]
        for lib, label, color in (("gpukv", "gpukv dist_sync", "C0"),
                                  ("allreduce", "MPI Allreduce", "C1"),
                                  ("mxnet", f"MXNet {mine[0]['mxnet_layout']}", "C2")):
            pts = [(c["bytes"], c[lib]["GBps"]) for c in mine if c[lib] and c[lib]["ok"]]
            if pts:
                ax.loglog(*zip(*pts), marker="o", ms=3, label=label, color=color)
        ax.set_title(name + (" (oversubscribed)" if mine[0]["oversubscribed"] else ""))
        ax.set_xlabel("bytes per worker")
        ax.set_ylabel("GB/s per worker")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    C.save_figure(fig, path)


# -------------------------------------------------------------------------- driver
def build_parser() -> argparse.ArgumentParser:
    p = C.ArgumentParser(prog=Path(__file__).name,
                         description=__doc__.split("\n\n")[0].replace("\n", " "))
    C.add_sizes_option(p, DEFAULT_SIZES, "the key's size on every worker (float32, "
                       "bytes / 4 elements)", minimum=4)
    p.add_argument("--layouts", type=parse_layouts, default=DEFAULT_LAYOUTS, metavar="WwSs",
                   help="comma-separated WwSs: W workers, S servers (0s: every worker "
                        "serves a shard); they take the place of --devices "
                        f"(default {DEFAULT_LAYOUTS})")
    p.add_argument("--libs", type=C.name_list(LIBS, "library"), default=",".join(LIBS),
                   metavar="NAMES",
                   help=f"what to run among {', '.join(LIBS)} (mxnet only with "
                        "--mxnet-python; default: all)")
    p.add_argument("--op", default="push+pull", choices=["push+pull", "pushpull"],
                   help="one iteration: push then pull, or one pushpull call")
    p.add_argument("--optimizer", default="none", choices=["none", "sgd"],
                   help="none: a round assigns the sum; sgd: SGD runs where the keys are "
                        "served (gpukv and MXNet)")
    C.add_timing_options(p, 3, 15, unit="iteration", note="in every round",
                         iters_note="sizes below 1 MB run up to 5x as many")
    p.add_argument("--rounds", type=C.positive_int, default=3, metavar="N",
                   help="times every job runs; figures are medians over rounds (default 3)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="seconds per job (default 120)")
    p.add_argument("--mxnet-python", default=os.environ.get("MXNET_PYTHON"), metavar="PATH",
                   help="interpreter with mxnet 1.9.1 (default $MXNET_PYTHON; none: skip)")
    C.add_out_option(p, "dist_<machine>.json and .png")
    # One rank of an MPI job this script started.
    p.add_argument("--child", choices=["gpukv", "mpi"], help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--compression", help=argparse.SUPPRESS)  # JSON, gpukv only
    p.add_argument("--no-halves", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    python = args.mxnet_python
    C.check_mxnet_python(parser, python)
    named = any(a.split("=")[0] == "--libs" for a in (sys.argv[1:] if argv is None else argv))
    if "mxnet" in args.libs and named and not python:  # (the default, all, skips it)
        parser.error("--libs mxnet needs an interpreter with mxnet 1.9.1: --mxnet-python "
                     "PATH or MXNET_PYTHON")
    return args


def run_all(args, layouts, sizes, tmp: Path) -> dict:
    """Every job, `--rounds` times: {(lib, layout or ranks): [job of each round]}.
    Layout by layout, each baseline runs next to its first gpukv layout; who goes first
    alternates between rounds, so a busy spell of the machine hits both sides."""
    libs = set(args.libs)
    if not args.mxnet_python:
        libs.discard("mxnet")
    plan = make_plan(sizes, args.warmup, args.iters)
    mpi_plan = make_plan(sorted(set(sizes) | {LATENCY_BYTES}), args.warmup, args.iters)
    jobs: dict = {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        done = set()
        for layout in layouts:
            mx = mxnet_layout(layout)
            todo = []
            if "mpi" in libs and ("mpi", layout.workers) not in done:
                todo.append((("mpi", layout.workers), partial(
                    run_mpi_job, "mpi", Layout(layout.workers, 0), mpi_plan, args, tmp)))
            if "mxnet" in libs and ("mxnet", mx.name) not in done:
                todo.append((("mxnet", mx.name), partial(run_mxnet_job, mx, plan, args, tmp)))
            if "gpukv" in libs:
                todo.append((("gpukv", layout.name), partial(
                    run_mpi_job, "gpukv", layout, plan, args, tmp)))
            for key, run in (todo if r % 2 == 0 else todo[::-1]):
                done.add(key)
                job = run()
                job["round"] = r + 1
                if key[0] == "mpi":
                    job["what"] = f"Allreduce {key[1]} ranks"
                jobs.setdefault(key, []).append(job)
                state = "ok" if job["ok"] else f"FAILED ({job['error']})"
                print(f"  {job['what']}: {state}, {job.get('seconds', 0):.1f} s",
                      file=sys.stderr, flush=True)
    return jobs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    layouts, sizes = args.layouts, list(dict.fromkeys(args.sizes))
    load_before = os.getloadavg()
    if load_before[0] > 0.5 * usable_cpus():
        print(f"note: the machine is busy (load {load_before[0]:.1f} on {usable_cpus()} "
              "cores); timings will be noisy", file=sys.stderr)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpukv-bench-dist-") as tmp:
        jobs = run_all(args, layouts, sizes, Path(tmp))
    cases = build_cases(layouts, sizes, jobs)
    goals = build_goals(cases)
    print_report(cases, goals, jobs, args)

    if C.out_folder(args.out) is not None:
        every = [j for runs in jobs.values() for j in runs]
        mxnet_meta = next((j["meta"] for j in every
                           if j["what"].startswith("mxnet") and j.get("meta")), None)
        payload = {
            "benchmark": "dist push+pull",
            "machine": C.machine_info(),
            "versions": C.library_versions("gpukv", "numpy", "mpi4py"),
            "mpi_library": next((j["meta"]["mpi_library"] for j in every
                                 if j.get("meta") and "mpi_library" in j["meta"]), None),
            "mxnet": mxnet_meta,
            "settings": {"sizes": sizes, "layouts": [x.name for x in layouts],
                         "libs": args.libs, "op": args.op, "optimizer": args.optimizer,
                         "rounds": args.rounds,
                         "warmup": args.warmup, "iters": args.iters,
                         "plan": make_plan(sizes, args.warmup, args.iters),
                         "timeout_s": args.timeout, "mpiexec": find_mpiexec(),
                         "mpi_env": {k: v for k, v in os.environ.items()
                                     if k.startswith(("MPIR_CVAR_", "MPICH_", "UCX_",
                                                      "FI_", "GPUKV_"))},
                         "transport": "one machine: MPI over shared memory, MXNet (ps-lite "
                                      "ZeroMQ) over TCP on 127.0.0.1"},
            "usable_cpus": usable_cpus(),
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "notes": ["oversubscribed: more busy processes than cores; MPI ranks "
                      "busy-poll while waiting, so such timings depend on the OS scheduler",
                      "ratios are gpukv's throughput over the other's (same bytes per "
                      "worker); S = 0 layouts are compared with MXNet's W workers, 1 server",
                      "MXNet 1.9.1's dist_sync server without an optimizer keeps adding to "
                      "the stored value; only its first pull is checked"],
            "wall_s": round(time.perf_counter() - start, 1),
            "cases": cases,
            "goals": goals,
            "jobs": {" ".join(map(str, k)): [{x: y for x, y in j.items() if x != "meta"}
                                             for j in runs]
                     for k, runs in jobs.items()},
        }
        print()
        C.save_results(payload, args.out, C.result_name("dist"),
                       plot=lambda png: plot(cases, png))
    return 0 if all(j["ok"] for runs in jobs.values() for j in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

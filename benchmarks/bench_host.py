"""Host push+pull speed: gpukv's `local` store against MXNet 1.9.1's, and against memory.

Every case pushes one float32 array per host "device" (4 by default) for each key and
pulls the result back into one out per device: with the default assign updater that is
a k-way sum written into the stored value, then a copy of it into k outs. The minimal
memory traffic of one push+pull is 2 * (k + 1) * nbytes (k reads + 1 write to reduce,
1 read + k writes to broadcast); dividing it by the time gives GB/s, and dividing that
by the bandwidth of a plain `np.copyto` measured in the same process (read + write bytes;
the best of a 1-thread and an n-thread copy, n = gpukv's host threads) gives the fraction
of the memory limit reached.

MXNet runs in its own interpreter (`--mxnet-python`, e.g. an env with mxnet==1.9.1 and
numpy==1.23.5) through benchmarks/_mxnet_host.py; its timed steps end in
`mx.nd.waitall()` so its asynchronous engine is fully counted. The two sides take turns
case by case (who goes first alternates) for `--rounds` rounds, and each figure is the
median over rounds, so a slow spell of a shared machine hits both. Cases whose arrays fit
in the last-level cache can exceed 100% of the copy bandwidth, which is measured on
arrays far larger than any cache.

    python benchmarks/bench_host.py --mxnet-python /path/to/mxenv/bin/python
    python benchmarks/bench_host.py --sizes 4KB,1MB --keys 100x16KB --devices 2,4 --out -

Sizes are bytes per key and device (float32: bytes / 4 elements); the table and the JSON
give both. A table is printed and JSON goes to --out DIR (default benchmarks/results/);
the exit status is 1 when a case failed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common
import numpy as np

HERE = Path(__file__).resolve().parent

# Speedup over MXNet each standard case should reach (the host-speed goals).
# Cases are named by bytes per key: 4K, 4M, 64M are 1K, 1M, 16M float32 elements.
GOALS = {"4K": 1.5, "4M": 1.5, "64M": 2.0, "1000x1K": 2.0}
# Fraction of the copy bandwidth the largest standard case should reach.
BANDWIDTH_GOALS = {"64M": 0.70}


def parse_key_cases(text: str) -> list[tuple[int, int]]:
    """'1000x1K,10x4M' -> [(1000, 1024), (10, 4194304)]: KEYSxBYTES, '' for none."""
    cases = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        keys, x, size = spec.lower().partition("x")
        try:
            if not x:
                raise ValueError("no x")
            nbytes = _common.parse_size(size)
            if nbytes < 4:
                raise ValueError("below one float32")
            cases.append((_common.parse_ints(keys)[0], nbytes))
        except ValueError:
            raise _common.BadArgument(f"{spec!r}: expected KEYSxBYTES, e.g. 1000x1KB "
                                      "or 10x4MB (bytes per key, at least 4)") from None
    return cases


def build_parser() -> argparse.ArgumentParser:
    p = _common.ArgumentParser(prog=Path(__file__).name,
                               description=__doc__.split("\n\n")[0])
    _common.add_sizes_option(p, "4K,4M,64M", "one-key cases: the key's size on every "
                             "device (float32, bytes / 4 elements)", minimum=4)
    p.add_argument("--keys", type=parse_key_cases, default="1000x1K", metavar="KEYSxBYTES",
                   help="many-key cases KEYSxBYTES (bytes per key and device), pushed and "
                        "pulled as one list call (comma-separated; '' for none; "
                        "default 1000x1K)")
    _common.add_devices_option(p, "4", "host devices (arrays) per key")
    _common.add_timing_options(p, 3, 10, unit="push+pull",
                               iters_note="at least: a sample is the mean of a batch "
                                          "lasting a few ms, and --min-time may add samples")
    p.add_argument("--min-time", type=float, default=0.4, metavar="SECONDS",
                   help="seconds of timing at least, per case and side (default 0.4)")
    p.add_argument("--rounds", type=_common.positive_int, default=5, metavar="N",
                   help="times MXNet and gpukv alternate; figures are medians over rounds "
                        "(default 5)")
    p.add_argument("--mxnet-python", default=os.environ.get("MXNET_PYTHON"), metavar="PATH",
                   help="interpreter with mxnet 1.9.1 (default $MXNET_PYTHON; none: skip)")
    _common.add_out_option(p, "host_<machine>.json")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    _common.check_mxnet_python(parser, args.mxnet_python)
    return args


def make_cases(args) -> list[dict]:
    """One case per (devices, size) and per (devices, many-key case). Names are the
    byte sizes ('4M', '1000x1K'), with the device count added when there are several."""
    specs = [(_common.format_size(n), 1, n) for n in args.sizes]
    specs += [(f"{keys}x{_common.format_size(n)}", keys, n) for keys, n in args.keys]
    cases = []
    for devices in args.devices:
        for base, keys, nbytes in specs:
            name = base if len(args.devices) == 1 else f"{base}/{devices}dev"
            elems = _common.elements(nbytes, 4)
            cases.append({"name": name, "base": base, "keys": keys, "elems": elems,
                          "bytes": elems * 4, "devices": devices})
    return cases


def traffic_bytes(case: dict) -> int:
    """Minimal bytes one push+pull moves: (k reads + 1 write) + (1 read + k writes)."""
    return 2 * (case["devices"] + 1) * case["keys"] * case["bytes"]


# ----------------------------------------------------------------------- gpukv side
def gpukv_step(case: dict):
    """The push+pull step of one case on a fresh gpukv store (checked once)."""
    import gpukv

    kv = gpukv.create("local")
    shape = (case["elems"],)
    keys = list(range(case["keys"]))
    for k in keys:
        kv.init(k, np.zeros(shape, np.float32))
    values = [[np.full(shape, i + 1, np.float32) for i in range(case["devices"])]
              for _ in keys]
    outs = [[np.empty(shape, np.float32) for _ in range(case["devices"])] for _ in keys]
    if case["keys"] == 1:
        key, vals, out = keys[0], values[0], outs[0]
    else:
        key, vals, out = keys, values, outs

    def step():
        kv.push(key, vals)
        kv.pull(key, out=out)

    step()
    expected = sum(range(1, case["devices"] + 1))
    for per_key in outs:
        for o in per_key:
            if not (o == expected).all():
                raise RuntimeError(f"gpukv {case['name']}: wrong result pulled")
    return step


def time_step(step, args) -> dict:
    """Median (and spread) of one push+pull, batched so each sample lasts a few ms."""
    batch = _common.batch_for(min(_common.time_calls(step, warmup=1, iters=3)))
    return _common.summarize(_common.time_calls(step, warmup=args.warmup, iters=args.iters,
                                                min_time=args.min_time, batch=batch))


def copy_limit(threads: int) -> dict:
    """Copy bandwidth with 1 thread and with `threads` threads; the limit is the faster."""
    runs = [_common.copy_bandwidth(threads=1)]
    if threads > 1:
        runs.append(_common.copy_bandwidth(threads=threads))
    best = max(runs, key=lambda r: r["median_Bps"])
    return {"limit_Bps": best["median_Bps"], "limit_threads": best["threads"], "runs": runs}


# ---------------------------------------------------------------------- MXNet side
class MXNetSide:
    """benchmarks/_mxnet_host.py running under the MXNet interpreter, timing on request."""

    def __init__(self, python: str):
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([python, str(HERE / "_mxnet_host.py")], cwd=HERE,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True)
        self.meta = self._read()

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._log.seek(0)
            raise SystemExit(f"MXNet side failed (exit {self._proc.returncode}):\n"
                             f"{self._log.read().strip()}")
        return json.loads(line)

    def time(self, case: dict, args) -> dict:
        request = {"case": case, "warmup": args.warmup, "iters": args.iters,
                   "min_time": args.min_time}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait()
        self._log.close()


# -------------------------------------------------------------------------- driver
def make_steps(cases: list[dict]) -> tuple[dict, dict]:
    """{name: gpukv step} of the cases whose store works, {name: error} of the others."""
    steps, errors = {}, {}
    for case in cases:
        try:
            steps[case["name"]] = gpukv_step(case)
        except Exception as exc:  # one broken case must not end the run
            errors[case["name"]] = f"{type(exc).__name__}: {exc}"[:300]
    return steps, errors


def run_rounds(cases: list[dict], steps: dict, mxnet, args, threads: int) -> list[dict]:
    """Every case `--rounds` times, gpukv and MXNet in turns (who goes first alternates)."""
    rounds = []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
        entry = {"mxnet": {}, "gpukv": {}, "copy": {}}
        for i, case in enumerate(c for c in cases if c["name"] in steps):
            name = case["name"]
            if mxnet is not None and (r + i) % 2 == 0:
                entry["mxnet"][name] = mxnet.time(case, args)
            entry["gpukv"][name] = time_step(steps[name], args)
            # The limit right after the timing it is compared with: same machine load.
            entry["copy"][name] = copy_limit(threads)
            if mxnet is not None and (r + i) % 2 == 1:
                entry["mxnet"][name] = mxnet.time(case, args)
        rounds.append(entry)
    return rounds


def case_summary(case: dict, rounds: list[dict], with_mxnet: bool) -> dict:
    """One case's medians over rounds, ratios and goals."""
    name = case["name"]
    moved = traffic_bytes(case)
    gk = [r["gpukv"][name]["median_s"] for r in rounds]
    mx = [r["mxnet"][name]["median_s"] for r in rounds] if with_mxnet else []
    fractions = [moved / g / r["copy"][name]["limit_Bps"] for g, r in zip(gk, rounds)]
    speedups = [m / g for m, g in zip(mx, gk)]
    s = {
        "keys": case["keys"], "floats_per_key": case["elems"], "bytes_per_key": case["bytes"],
        "devices": case["devices"], "bytes_moved": moved,
        "gpukv_s": statistics.median(gk),
        "mxnet_s": statistics.median(mx) if mx else None,
        "speedup": statistics.median(speedups) if speedups else None,
        "GBps": moved / statistics.median(gk) / 1e9,
        "fraction_of_copy": statistics.median(fractions),
        "per_round": {"gpukv_s": gk, "mxnet_s": mx, "speedup": speedups,
                      "fraction_of_copy": fractions},
    }
    goal = GOALS.get(case["base"]) if case["devices"] == 4 else None
    bw_goal = BANDWIDTH_GOALS.get(case["base"]) if case["devices"] == 4 else None
    if goal is not None and s["speedup"] is not None:
        s["speedup_goal"] = goal
    if bw_goal is not None:
        s["fraction_goal"] = bw_goal
    met = []
    if goal is not None and s["speedup"] is not None:
        met.append(s["speedup"] >= goal)
    if bw_goal is not None:
        met.append(s["fraction_of_copy"] >= bw_goal)
    s["goals_met"] = all(met) if met else None
    return s


def table_row(case: dict, s: dict) -> list:
    head = [case["name"], case["devices"], case["keys"], _common.format_size(case["bytes"]),
            case["elems"]]
    if "error" in s:
        return head + ["failed", "-", "-", "-", "-", "-"]
    return head + [
        _common.format_seconds(s["gpukv_s"]), _common.format_seconds(s["mxnet_s"]),
        f"{s['speedup']:.2f}x" if s["speedup"] else "-",
        f"{s['GBps']:.1f}", f"{100 * s['fraction_of_copy']:.0f}%", _goal_text(s)]


def main(argv=None) -> int:
    """Returns 1 when a case failed (its store computed a wrong sum or raised)."""
    args = parse_args(argv)
    import gpukv
    from gpukv.device import host_sum as host_comm

    cases = make_cases(args)
    mxnet = MXNetSide(args.mxnet_python) if args.mxnet_python else None
    steps, errors = make_steps(cases)
    try:
        rounds = run_rounds(cases, steps, mxnet, args, host_comm.THREADS)
    finally:
        if mxnet is not None:
            mxnet.close()
    mx_meta = mxnet.meta if mxnet is not None else None

    copies = [c["limit_Bps"] for r in rounds for c in r["copy"].values()]
    limit = statistics.median(copies) if copies else None
    summary = {c["name"]: ({"error": errors[c["name"]], "devices": c["devices"]}
                           if c["name"] in errors else case_summary(c, rounds, mxnet is not None))
               for c in cases}
    print(f"\nhost push+pull, float32; median of {args.rounds} rounds; copy limit "
          + (f"{limit / 1e9:.1f} GB/s" if limit else "-")
          + f" (read+write, best of 1 and {host_comm.THREADS} threads)")
    _common.print_table(["case", "devices", "keys", "bytes", "floats", "gpukv", "MXNet",
                         "speedup", "GB/s", "of copy", "goal"],
                        [table_row(c, summary[c["name"]]) for c in cases])
    for name, error in errors.items():
        print(f"FAILED {name}: {error}", file=sys.stderr)

    payload = {
        "benchmark": "host push+pull",
        "machine": _common.machine_info(),
        "numpy_simd": _common.numpy_build(),
        "versions": {"gpukv": gpukv.__version__,
                     **_common.library_versions("numpy")},
        "mxnet": mx_meta,
        "settings": {"devices": args.devices, "warmup": args.warmup, "iters": args.iters,
                     "min_time_s": args.min_time, "rounds": args.rounds,
                     "dtype": "float32",
                     "host_threads": host_comm.THREADS,
                     "block_bytes": host_comm.BLOCK_BYTES},
        "copy_limit": {"median_Bps": limit,
                       "how": "np.copyto of 256 MiB, read+write bytes, the faster of "
                              f"the 1-thread and {host_comm.THREADS}-thread medians, "
                              "measured right after each gpukv timing; fractions use "
                              "the one next to their timing",
                       "threads_that_won": sorted({c["limit_threads"] for r in rounds
                                                   for c in r["copy"].values()})},
        "results": summary,
        "raw_rounds": rounds,
    }
    _common.save_results(payload, args.out, _common.result_name("host"))
    return 1 if errors else 0


def _goal_text(s: dict) -> str:
    parts = []
    if s.get("speedup_goal") is not None:
        ok = s["speedup"] >= s["speedup_goal"]
        parts.append(f">={s['speedup_goal']}x {'ok' if ok else 'MISS'}")
    if s.get("fraction_goal") is not None:
        ok = s["fraction_of_copy"] >= s["fraction_goal"]
        parts.append(f">={100 * s['fraction_goal']:.0f}% {'ok' if ok else 'MISS'}")
    return ", ".join(parts) or "-"


if __name__ == "__main__":
    sys.exit(main())

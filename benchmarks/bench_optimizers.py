"""Optimizer step over many keys: one batched update (multi-tensor) vs a per-key loop.

    python benchmarks/bench_optimizers.py --sizes 4KB,256KB,4MB --keys 64 --iters 20
    python benchmarks/bench_optimizers.py --gpu --devices 1,2   # keys spread over 1, 2 GPUs

For each optimizer and key size it times the updater a list push runs (all keys in one
`update` call: on the host in-place NumPy over cache-sized pieces, small keys gathered
into shared pieces; on a GPU one kernel launch per (device, dtype) group) against the
same updater called once per key (what N single-key pushes cost). On the host it also
reports the fraction of the machine's copy bandwidth the batched step reaches, counting
the bytes the rule must read and write. GPU timings use CUDA events. Without --host or
--gpu it runs on GPUs when one is present, else on the host. Sizes are bytes per key of
float32 (bytes / 4 elements); the table and the JSON give both. A table is printed and
JSON goes to --out DIR (default benchmarks/results/); the exit status is 1 when a case
failed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402

from gpukv import optim  # noqa: E402
from gpukv.device import host_device  # noqa: E402

RULES = {
    "sgd_mom": lambda: optim.SGD(learning_rate=0.01, momentum=0.9, wd=1e-4),
    "adam": lambda: optim.Adam(learning_rate=1e-3, wd=1e-4),
    "lamb": lambda: optim.LAMB(learning_rate=1e-3, wd=1e-4),
}
STATES = {"sgd_mom": 1, "adam": 2, "lamb": 2}


def _setup(rule, n_keys, size, homes, gpu):
    updater = optim.OptimizerUpdater(RULES[rule]())
    keys = list(range(n_keys))
    if gpu:
        import cupy as cp
        stored, merged = [], []
        for k in keys:
            home = homes[k % len(homes)]
            with home.cuda_device:
                stored.append(cp.ones(size, cp.float32))
                merged.append(cp.full(size, 1e-3, cp.float32))
    else:
        stored = [np.ones(size, np.float32) for _ in keys]
        merged = [np.full(size, 1e-3, np.float32) for _ in keys]
    key_homes = [homes[k % len(homes)] for k in keys]
    updater.update(keys, merged, stored, key_homes)  # allocate the states
    return updater, keys, merged, stored, key_homes


def _time(fn, homes, gpu, warmup, iters):
    if not gpu:
        once = C.time_calls(fn, warmup=1, iters=1)[0]
        return C.time_calls(fn, warmup=warmup, iters=iters, batch=C.batch_for(once))
    import cupy as cp
    for _ in range(warmup):
        fn()
    samples = []
    dev = homes[0]
    for _ in range(iters):
        with dev.cuda_device:
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(dev.stream)
        fn()
        for h in homes[1:]:
            dev.wait_for(h)
        with dev.cuda_device:
            stop.record(dev.stream)
            stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return samples


def build_parser() -> argparse.ArgumentParser:
    p = C.ArgumentParser(prog=Path(__file__).name,
                         description=__doc__.split("\n")[0])
    C.add_sizes_option(p, "1K,16K,256K,4M", "the size of every key (float32, bytes / 4 "
                       "elements)", minimum=4)
    p.add_argument("--keys", type=C.positive_int, default=64, metavar="N",
                   help="keys per push, i.e. per update call (default 64)")
    C.add_devices_option(p, "1", "devices the keys are spread over (round-robin): GPUs "
                         "with --gpu, host devices otherwise")
    p.add_argument("--rules", type=C.name_list(RULES, "rule"), default=",".join(RULES),
                   metavar="NAMES",
                   help=f"optimizers among {', '.join(RULES)}, comma-separated "
                        "(default: all)")
    C.add_place_options(p, "GPUs when one is present, else the host")
    C.add_timing_options(p, 3, 10, unit="update",
                         note="an update is one batched call, or the per-key loop")
    C.add_out_option(p, "optimizers_<host|gpu>_<machine>.json")
    return p


def homes_for(n: int, gpu: bool) -> list | None:
    """The first `n` GPUs (None when fewer are visible), or `n` host devices."""
    if not gpu:
        return [host_device(i) for i in range(n)]
    from gpukv.device.cuda.device import gpu_devices
    homes = gpu_devices()[:n]
    return homes if len(homes) == n else None


def run_case(rule, size, n_keys, homes, gpu, args, bandwidth) -> dict:
    """One (rule, size, devices) case: batched vs per-key update times."""
    updater, keys, merged, stored, key_homes = _setup(rule, n_keys, size, homes, gpu)

    def batched():
        updater.update(keys, merged, stored, key_homes)

    def per_key():
        for i, k in enumerate(keys):
            updater.update([k], [merged[i]], [stored[i]], [key_homes[i]])

    tb = statistics.median(_time(batched, homes, gpu, args.warmup, args.iters))
    tp = statistics.median(_time(per_key, homes, gpu, args.warmup, args.iters))
    # bytes the rule must move: read w, g and states, write w and states
    moved = n_keys * size * 4 * (3 + 2 * STATES[rule])
    frac = (moved / tb) / bandwidth if bandwidth else None
    return {"rule": rule, "size": size, "bytes": size * 4, "keys": n_keys,
            "devices": len(homes), "batched_s": tb, "per_key_s": tp, "speedup": tp / tb,
            "bytes_moved": moved, "fraction_of_copy_bw": frac}


def table_row(rec: dict) -> list:
    head = [rec["rule"], C.format_size(rec["bytes"]), rec["size"], rec["keys"],
            rec["devices"]]
    if "error" in rec or "skipped" in rec:
        return head + ["failed" if "error" in rec else "skipped", "-", "-", "-"]
    frac = rec["fraction_of_copy_bw"]
    return head + [C.format_seconds(rec["batched_s"]), C.format_seconds(rec["per_key_s"]),
                   round(rec["speedup"], 2), round(frac, 3) if frac is not None else "-"]


def main(argv=None) -> int:
    """Returns 1 when a case failed, or --gpu found no GPU."""
    args = build_parser().parse_args(argv)
    gpu = not args.host and C.has_gpu()
    if args.gpu and not gpu:
        print(f"{Path(__file__).name}: --gpu: no GPU visible", file=sys.stderr)
        return 1
    bandwidth = None if gpu else C.copy_bandwidth(64 << 20)["median_Bps"]
    records = []
    for n in args.devices:
        homes = homes_for(n, gpu)
        for rule in args.rules:
            for nbytes in args.sizes:
                size = C.elements(nbytes, 4)
                base = {"rule": rule, "size": size, "bytes": size * 4, "keys": args.keys,
                        "devices": n}
                if homes is None:  # cannot run here: not a failure
                    records.append({**base, "skipped": f"fewer than {n} GPUs visible"})
                    continue
                try:
                    records.append(run_case(rule, size, args.keys, homes, gpu, args,
                                            bandwidth))
                except Exception as exc:  # one broken case must not end the run
                    records.append({**base, "error": f"{type(exc).__name__}: {exc}"[:300]})
    C.print_table(["rule", "bytes", "floats", "keys", "devices", "batched", "per-key",
                   "per-key/batched", "of copy BW"], [table_row(r) for r in records])
    for r in records:
        if "error" in r or "skipped" in r:
            state = "FAILED" if "error" in r else "skipped"
            print(f"{state} {r['rule']} {C.format_size(r['bytes'])} on {r['devices']}: "
                  f"{r.get('error') or r['skipped']}", file=sys.stderr)
    payload = {"benchmark": "optimizers", "device": "gpu" if gpu else "host",
               "devices": args.devices, "machine": C.machine_info(),
               "libraries": C.library_versions("numpy", "cupy"),
               "copy_bandwidth_Bps": bandwidth, "results": records}
    C.save_results(payload, args.out,
                   C.result_name("optimizers_gpu" if gpu else "optimizers_host"))
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())

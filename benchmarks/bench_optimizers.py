"""Optimizer step over many keys: one batched update (multi-tensor) vs a per-key loop.

    python benchmarks/bench_optimizers.py --sizes 1K,64K,1M --keys 64 --iters 20
    python benchmarks/bench_optimizers.py --gpu --devices 2     # on GPUs, when present

For each optimizer and key size it times the updater a list push runs (all keys in one
`update` call: on the host in-place NumPy over cache-sized pieces, small keys gathered
into shared pieces; on a GPU one kernel launch per (device, dtype) group) against the
same updater called once per key (what N single-key pushes cost). On the host it also
reports the fraction of the machine's copy bandwidth the batched step reaches, counting
the bytes the rule must read and write. GPU timings use CUDA events. A table is printed;
JSON goes to benchmarks/results/.
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


def main(argv=None):
    p = argparse.ArgumentParser(prog=Path(__file__).name,
                                description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=C.parse_sizes, default="256,4K,64K,1M",
                   help="elements per key")
    p.add_argument("--keys", type=int, default=64, help="keys per push")
    p.add_argument("--devices", type=int, default=1, help="GPU homes (with --gpu)")
    p.add_argument("--rules", type=C.name_list(RULES, "rule"), default=",".join(RULES),
                   help=f"optimizers among {', '.join(RULES)} (default: all)")
    p.add_argument("--gpu", action="store_true", help="keys on GPUs (needs CuPy and a GPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    args = p.parse_args(argv)
    if args.keys < 1 or args.devices < 1 or args.warmup < 0 or args.iters < 1:
        p.error("need --keys >= 1, --devices >= 1, --warmup >= 0 and --iters >= 1")

    if args.gpu:
        from gpukv.device.cuda.device import gpu_devices
        homes = gpu_devices()[:args.devices]
        if not homes:
            sys.exit("--gpu: no GPU visible")
    else:
        homes = [host_device(0)]
    bandwidth = None if args.gpu else C.copy_bandwidth(64 << 20)["median_Bps"]
    rows, records = [], []
    for rule in args.rules:
        for size in args.sizes:
            updater, keys, merged, stored, key_homes = _setup(rule, args.keys, size, homes,
                                                              args.gpu)

            def batched():
                updater.update(keys, merged, stored, key_homes)

            def per_key():
                for i, k in enumerate(keys):
                    updater.update([k], [merged[i]], [stored[i]], [key_homes[i]])

            tb = statistics.median(_time(batched, homes, args.gpu, args.warmup, args.iters))
            tp = statistics.median(_time(per_key, homes, args.gpu, args.warmup, args.iters))
            # bytes the rule must move: read w, g and states, write w and states
            moved = args.keys * size * 4 * (3 + 2 * STATES[rule])
            frac = (moved / tb) / bandwidth if bandwidth else None
            rows.append([rule, C.format_size(size), args.keys, C.format_seconds(tb),
                         C.format_seconds(tp), round(tp / tb, 2),
                         round(frac, 3) if frac is not None else "-"])
            records.append({"rule": rule, "size": size, "keys": args.keys,
                            "batched_s": tb, "per_key_s": tp, "speedup": tp / tb,
                            "bytes_moved": moved, "fraction_of_copy_bw": frac})
    C.print_table(["rule", "size", "keys", "batched", "per-key", "per-key/batched",
                   "of copy BW"], rows)
    payload = {"benchmark": "optimizers", "device": "gpu" if args.gpu else "host",
               "devices": len(homes), "machine": C.machine_info(),
               "libraries": C.library_versions("numpy", "cupy"),
               "copy_bandwidth_Bps": bandwidth, "results": records}
    path = C.write_json(payload, args.json, prefix="optimizers_gpu" if args.gpu else
                        "optimizers_host")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Gradient-compression throughput: encode and decode GB/s of float32 input, vs. a copy.

For each size and compressor (2bit, 1bit, fp16, bf16) it times `compress` (quantise with
error feedback, or cast) and `decompress` (into a float32 buffer), and reports GB/s of
float32 values handled (4 bytes per element), next to `np.copyto` of the same float32
array measured in the same run, the memory-bandwidth limit an encoder that reads its
input once is held to. On a machine with a GPU the same is done with CuPy arrays and
CUDA events (copy: `cupy.copyto`).

    python benchmarks/bench_compression.py --sizes 64K,1M,16M --warmup 2 --iters 10
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common  # noqa: E402

from gpukv.update.compression import Cast, OneBit, TwoBit  # noqa: E402

KINDS = {"2bit": lambda: TwoBit(0.5), "1bit": lambda: OneBit(0.0),
         "fp16": lambda: Cast("fp16"), "bf16": lambda: Cast("bf16")}


def host_case(n, kind, warmup, iters):
    rng = np.random.default_rng(0)
    g = rng.standard_normal(n).astype(np.float32)
    comp = KINDS[kind]()
    residual = np.zeros(n, np.float32)
    payload, ctx = comp.compress(g, residual)
    out = np.empty(n, np.float32)
    dst = np.empty_like(g)
    enc = _common.time_calls(lambda: comp.compress(g, residual), warmup=warmup, iters=iters,
                             batch=_common.batch_for(n * 1e-9))
    dec = _common.time_calls(lambda: comp.decompress(payload, ctx, out), warmup=warmup,
                             iters=iters, batch=_common.batch_for(n * 1e-9))
    cp = _common.time_calls(lambda: np.copyto(dst, g), warmup=warmup, iters=iters,
                            batch=_common.batch_for(n * 2e-10))
    return _record(n, kind, "host", enc, dec, cp, payload.nbytes)


def gpu_case(n, kind, warmup, iters):
    import cupy

    def timed(fn):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return samples

    g = cupy.random.standard_normal(n, dtype=cupy.float32)
    comp = KINDS[kind]()
    residual = cupy.zeros(n, cupy.float32)
    payload, ctx = comp.compress(g, residual)
    out = cupy.empty(n, cupy.float32)
    dst = cupy.empty_like(g)
    enc = timed(lambda: comp.compress(g, residual))
    dec = timed(lambda: comp.decompress(payload, ctx, out))
    cp = timed(lambda: cupy.copyto(dst, g))
    return _record(n, kind, "gpu", enc, dec, cp, int(payload.nbytes))


def _record(n, kind, where, enc, dec, cp, payload_bytes):
    enc_s, dec_s, cp_s = (_common.summarize(s)["median_s"] for s in (enc, dec, cp))
    gb = 4 * n / 1e9
    return {"where": where, "kind": kind, "size": n, "payload_bytes": payload_bytes,
            "ratio": 4 * n / payload_bytes,
            "encode_GBps": gb / enc_s, "decode_GBps": gb / dec_s, "copy_GBps": gb / cp_s,
            "encode_of_copy": cp_s / enc_s, "decode_of_copy": cp_s / dec_s,
            "encode": _common.summarize(enc), "decode": _common.summarize(dec),
            "copy": _common.summarize(cp)}


def _has_gpu() -> bool:
    try:
        from gpukv.device.cuda.device import gpu_count
        return gpu_count() > 0
    except Exception:
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(prog=Path(__file__).name,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_common.parse_sizes, default="64K,1M,16M",
                        help="float32 elements, e.g. 1M,16M")
    parser.add_argument("--kinds", type=_common.name_list(KINDS, "compressor"),
                        default=",".join(KINDS),
                        help=f"compressors among {', '.join(KINDS)} (default: all)")
    parser.add_argument("--devices", default="auto", choices=["auto", "host", "gpu"],
                        help="where to run: host, gpu, or both when a GPU is present")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", nargs="?", const="", default=None,
                        help="write JSON (default path: benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.iters < 1:
        parser.error("need --warmup >= 0 and --iters >= 1")
    sizes, kinds = args.sizes, args.kinds
    places = ["host"] if args.devices == "host" else (
        ["gpu"] if args.devices == "gpu" else ["host"] + (["gpu"] if _has_gpu() else []))
    rows, records = [], []
    for where in places:
        for n in sizes:
            for kind in kinds:
                case = host_case if where == "host" else gpu_case
                rec = case(n, kind, args.warmup, args.iters)
                records.append(rec)
                rows.append([where, _common.format_size(n), kind, f"{rec['ratio']:.0f}x",
                             round(rec["encode_GBps"], 2), round(rec["decode_GBps"], 2),
                             round(rec["copy_GBps"], 2), f"{rec['encode_of_copy']:.0%}",
                             f"{rec['decode_of_copy']:.0%}"])
    _common.print_table(["where", "floats", "kind", "shrink", "encode GB/s", "decode GB/s",
                         "copy GB/s", "enc/copy", "dec/copy"], rows)
    limit = _common.copy_bandwidth(64 << 20)
    print(f"host copy bandwidth (64 MiB, read+write counted): "
          f"{limit['median_Bps'] / 1e9:.2f} GB/s")
    if args.json is not None:
        payload = {"benchmark": "compression", "machine": _common.machine_info(),
                   "versions": {"python": sys.version.split()[0],
                                **_common.library_versions("numpy", "cupy-cuda12x")},
                   "host_copy_bandwidth": limit, "units": "GB/s of float32 values",
                   "results": records}
        path = _common.write_json(payload, args.json or None, prefix="compression")
        print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()

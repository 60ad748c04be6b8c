"""Gradient-compression throughput: encode and decode GB/s of float32 input, vs. a copy.

For each size and compressor (2bit, 1bit, sign, ternary, fp16, bf16) it times `compress`
(quantise with error feedback, or cast), `decompress` (into a float32 buffer) and
decompress-and-add (what a receiver summing several sources does per source), and reports
milliseconds and GB/s of float32 values handled (4 bytes per element), next to
`np.copyto` of the same float32 array measured in the same run, the memory-bandwidth
limit an encoder that reads its
input once is held to. On a machine with a GPU the same is done with CuPy arrays and
CUDA events (copy: `cupy.copyto`); `--host` or `--gpu` keeps to one of the two. With fp16
among the kinds, the host also times the sum of two float16 payloads into a float32 out
(`host_sum`, what a strategy does with fp16 terms), next to the same copy: both read and
write the bytes of the float32 values once.

    python benchmarks/bench_compression.py --sizes 256KB,4MB,64MB --warmup 2 --iters 10

Sizes are bytes of float32 input (bytes / 4 elements); the table and the JSON give both.
A table is printed and JSON goes to --out DIR (default benchmarks/results/); the exit
status is 1 when a case failed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common  # noqa: E402

from gpukv.device import host_jit  # noqa: E402
from gpukv.encoding.compressors import Cast, OneBit, Sign, Ternary, TwoBit  # noqa: E402

KINDS = {"2bit": lambda: TwoBit(0.5), "1bit": lambda: OneBit(0.0), "sign": Sign,
         "ternary": Ternary, "fp16": lambda: Cast("fp16"), "bf16": lambda: Cast("bf16")}
SUM_SOURCES = 2  # float16 payloads per timed host sum


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
    acc = _common.time_calls(lambda: comp.decompress(payload, ctx, out, accumulate=True),
                             warmup=warmup, iters=iters, batch=_common.batch_for(n * 1e-9))
    cp = _common.time_calls(lambda: np.copyto(dst, g), warmup=warmup, iters=iters,
                            batch=_common.batch_for(n * 2e-10))
    return _record(n, kind, "host", enc, dec, acc, cp, payload.nbytes)


def host_sum_case(n, warmup, iters):
    """host_sum of SUM_SOURCES float16 payloads of n values into a float32 out, and
    np.copyto of n float32 values."""
    from gpukv.device.host_sum import host_sum

    rng = np.random.default_rng(0)
    halves = [rng.standard_normal(n).astype(np.float16) for _ in range(SUM_SOURCES)]
    out = np.empty(n, np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    dst = np.empty_like(g)
    total = _common.time_calls(lambda: host_sum(out, halves), warmup=warmup, iters=iters,
                               batch=_common.batch_for(n * 1e-9))
    cp = _common.time_calls(lambda: np.copyto(dst, g), warmup=warmup, iters=iters,
                            batch=_common.batch_for(n * 2e-10))
    sum_s, cp_s = (_common.summarize(s)["median_s"] for s in (total, cp))
    return {"where": "host", "kind": "fp16-sum", "size": n, "bytes": 4 * n,
            "sources": SUM_SOURCES, "sum_ms": sum_s * 1e3, "copy_ms": cp_s * 1e3,
            "sum_GBps": 4 * n / 1e9 / sum_s, "copy_GBps": 4 * n / 1e9 / cp_s,
            "sum_of_copy": cp_s / sum_s, "sum": _common.summarize(total),
            "copy": _common.summarize(cp)}


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
    acc = timed(lambda: comp.decompress(payload, ctx, out, accumulate=True))
    cp = timed(lambda: cupy.copyto(dst, g))
    return _record(n, kind, "gpu", enc, dec, acc, cp, int(payload.nbytes))


def _record(n, kind, where, enc, dec, acc, cp, payload_bytes):
    enc_s, dec_s, acc_s, cp_s = (_common.summarize(s)["median_s"] for s in (enc, dec, acc, cp))
    gb = 4 * n / 1e9
    return {"where": where, "kind": kind, "size": n, "bytes": 4 * n,
            "payload_bytes": payload_bytes, "ratio": 4 * n / payload_bytes,
            "encode_ms": enc_s * 1e3, "decode_ms": dec_s * 1e3,
            "decode_add_ms": acc_s * 1e3, "copy_ms": cp_s * 1e3,
            "encode_GBps": gb / enc_s, "decode_GBps": gb / dec_s,
            "decode_add_GBps": gb / acc_s, "copy_GBps": gb / cp_s,
            "encode_of_copy": cp_s / enc_s, "decode_of_copy": cp_s / dec_s,
            "decode_add_of_copy": cp_s / acc_s,
            "encode": _common.summarize(enc), "decode": _common.summarize(dec),
            "decode_add": _common.summarize(acc), "copy": _common.summarize(cp)}


def build_parser() -> argparse.ArgumentParser:
    p = _common.ArgumentParser(prog=Path(__file__).name,
                               description=__doc__.splitlines()[0])
    _common.add_sizes_option(p, "256K,4M,16M,64M", "the float32 input of a case (bytes / 4 "
                             "elements)", minimum=4)
    p.add_argument("--kinds", type=_common.name_list(KINDS, "compressor"),
                   default=",".join(KINDS), metavar="NAMES",
                   help=f"compressors among {', '.join(KINDS)}, comma-separated "
                        "(default: all)")
    _common.add_place_options(p, "the host, and GPUs too when one is present")
    _common.add_timing_options(p, 2, 10, unit="call",
                               note="encode, decode and the copy are timed alike")
    _common.add_out_option(p, "compression_<machine>.json")
    return p


def places(args) -> list[str]:
    """Where to run: --host, --gpu, or the host and a GPU when there is one."""
    if args.host:
        return ["host"]
    if args.gpu:
        return ["gpu"]
    return ["host"] + (["gpu"] if _common.has_gpu() else [])


def run_case(where, n, kind, args) -> dict:
    """One case's record; a case that raises is recorded with its error."""
    case = host_case if where == "host" else gpu_case
    try:
        return case(n, kind, args.warmup, args.iters)
    except Exception as exc:  # one broken compressor must not end the run
        return {"where": where, "kind": kind, "size": n, "bytes": 4 * n,
                "error": f"{type(exc).__name__}: {exc}"[:300]}


def table_row(rec: dict) -> list:
    head = [rec["where"], _common.format_size(rec["bytes"]), rec["size"], rec["kind"]]
    if "error" in rec:
        return head + ["failed"] + ["-"] * 9
    return head + [f"{rec['ratio']:.0f}x"] + [
        f"{rec[k]:.3g}" for k in ("encode_ms", "decode_ms", "decode_add_ms", "copy_ms")] + [
        round(rec["encode_GBps"], 2), round(rec["decode_GBps"], 2)] + [
        f"{rec[k]:.0%}" for k in ("encode_of_copy", "decode_of_copy", "decode_add_of_copy")]


def sum_row(rec: dict) -> list:
    head = [_common.format_size(rec["bytes"]), rec["size"]]
    if "error" in rec:
        return head + ["failed"] + ["-"] * 3
    return head + [f"{rec['sum_ms']:.3g}", f"{rec['copy_ms']:.3g}", round(rec["sum_GBps"], 2),
                   f"{rec['sum_of_copy']:.0%}"]


def run_sum_case(n, args) -> dict:
    """The host fp16 sum's record; one that raises is recorded with its error."""
    try:
        return host_sum_case(n, args.warmup, args.iters)
    except Exception as exc:
        return {"where": "host", "kind": "fp16-sum", "size": n, "bytes": 4 * n,
                "error": f"{type(exc).__name__}: {exc}"[:300]}


def main(argv=None) -> int:
    """Returns 1 when a case failed, or --gpu found no GPU."""
    args = build_parser().parse_args(argv)
    if args.gpu and not _common.has_gpu():
        print(f"{Path(__file__).name}: --gpu: no GPU visible", file=sys.stderr)
        return 1
    wheres = places(args)
    records = [run_case(where, _common.elements(nbytes, 4), kind, args)
               for where in wheres for nbytes in args.sizes for kind in args.kinds]
    _common.print_table(["where", "bytes", "floats", "kind", "shrink", "encode ms",
                         "decode ms", "dec+add ms", "copy ms", "encode GB/s",
                         "decode GB/s", "enc/copy", "dec/copy", "add/copy"],
                        [table_row(r) for r in records])
    sums = ([run_sum_case(_common.elements(nbytes, 4), args) for nbytes in args.sizes]
            if "host" in wheres and "fp16" in args.kinds else [])
    if sums:
        print(f"\nhost sums of {SUM_SOURCES} float16 payloads into float32:")
        _common.print_table(["bytes", "floats", "sum ms", "copy ms", "sum GB/s", "sum/copy"],
                            [sum_row(r) for r in sums])
    failed = [r for r in records + sums if "error" in r]
    for r in failed:
        print(f"FAILED {r['where']} {r['kind']} {_common.format_size(r['bytes'])}: "
              f"{r['error']}", file=sys.stderr)
    limit = _common.copy_bandwidth(64 << 20)
    print(f"host copy bandwidth (64 MiB, read+write counted): "
          f"{limit['median_Bps'] / 1e9:.2f} GB/s")
    payload = {"benchmark": "compression", "machine": _common.machine_info(),
               "versions": {"python": sys.version.split()[0],
                            **_common.library_versions("numpy", "numba", "cupy-cuda12x")},
               # which host codecs ran: the compiled ones, or their NumPy twins
               "host_codecs": "numba" if host_jit.enabled() else "numpy",
               "host_copy_bandwidth": limit, "units": "GB/s of float32 values",
               "results": records, "sums": sums}
    _common.save_results(payload, args.out, _common.result_name("compression"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

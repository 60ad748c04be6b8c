"""`python -m gpukv bench --calibrate`: measure the cost model's constants on this machine.

The 'auto' and 'tree' strategies rank strategies with `comm.simulate`'s alpha-beta model.
This mode measures, in this process, the constants that model uses and writes them to a
versioned JSON calibration file (`comm.simulate.CALIBRATION_FORMAT`), which
`simulate.load_calibration` reads back. Always measured (host):

- ``host_sum_gbps``: bytes of input per second of gpukv's own `host_sum` (4 sources);
- ``host_sum_us``: its fixed cost (a call on tiny arrays).

With a GPU (unless ``--host``), also:

- ``launch_us``: host time to issue one tiny CuPy kernel or device copy (the mean of both);
- ``kernel_us``: device time of one tiny kernel queued behind other work;
- ``hbm_gbps``: read + written bytes per second of a CuPy add kernel (a + b -> c);
- ``host_gbps`` / ``host_copy_us``: one GPU <-> pinned host memory, both directions;
- ``host_total_gbps``: every GPU <-> pinned host memory at once (one GPU: = host_gbps);
- ``nccl_base_us``: one tiny NCCL all-reduce over every GPU, less the model's per-step
  latency, when NCCL loads;
- per link weight of the measured link matrix (`topology.link_matrix_from_ranks` of the
  ranks `device.cuda.probe.p2p_ranks` reports, the one 'auto' sees; 64 = virtual GPUs on
  one GPU, 0 = no peer access: staged via the host): one-way GB/s and latency of a copy
  over one pair of that weight.

The GPU measurements are the device layer's (`gpukv.device.cuda.measure.GpuProbe`):
medians of CUDA-event intervals, small latencies timed behind a large copy queued first,
so the events see device time, not the host's issue time. Host times are medians of
`time.perf_counter` intervals.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import benchutil

MIB = 1 << 20
HOST_SUM_SOURCES = 4
HOST_SUM_BYTES = 16 * MIB   # per source
TINY_BATCH = 100            # host calls per timed batch of tiny work


def _entry(value: float, unit: str, method: str, **extra) -> dict:
    out = {"value": float(value), "unit": unit, "method": method}
    out.update(extra)
    return out


def _median_host(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _positive(x: float, floor: float) -> float:
    return max(float(x), floor)


# ------------------------------------------------------------------------------ host
def measure_host(warmup: int = 3, iters: int = 10, nbytes: int = HOST_SUM_BYTES,
                 sources: int = HOST_SUM_SOURCES) -> dict:
    """{'host_sum_gbps': entry, 'host_sum_us': entry} measured with `device.host_sum.host_sum`."""
    from ..device.host_sum import host_sum
    elems = max(1, nbytes // 4)
    srcs = [np.full(elems, i + 1, np.float32) for i in range(sources)]
    out = np.empty(elems, np.float32)
    tiny = [np.full(16, i + 1, np.float32) for i in range(sources)]
    tiny_out = np.empty(16, np.float32)

    def batch():
        for _ in range(TINY_BATCH):
            host_sum(tiny_out, tiny)

    fixed = _median_host(batch, warmup, iters) / TINY_BATCH
    big = _median_host(lambda: host_sum(out, srcs), warmup, iters)
    input_bytes = sources * elems * 4
    gbps = input_bytes / _positive(big - fixed, 1e-9) / 1e9
    return {
        "host_sum_gbps": _entry(
            gbps, "GB/s", f"host_sum of {sources} float32 sources of "
            f"{benchutil.format_size(elems * 4)}: input bytes / "
            f"(median time - host_sum_us), {iters} runs"),
        "host_sum_us": _entry(
            _positive(fixed * 1e6, 0.01), "us",
            f"median over {iters} batches of {TINY_BATCH} host_sum calls of {sources} "
            "sources of 16 float32, per call"),
    }


# ------------------------------------------------------------------------------- GPU
def _link_matrix(count: int):
    """The link matrix of GPUs 0..count-1, read as the strategies read it."""
    from ..comm.plan import topology
    from ..device.cuda.probe import p2p_ranks
    ids = list(range(count))
    return topology.link_matrix_from_ranks(ids, p2p_ranks(ids))


# ------------------------------------------------------------------------------ run
def system_info(gpus=(), matrix=None) -> dict:
    """The machine a calibration was measured on (what `load_calibration` compares):
    this host, and the names of the GPUs measured with their link matrix."""
    from ..device.cuda.probe import cpu_model
    out: dict[str, Any] = {"hostname": platform.node(), "cpu_model": cpu_model(),
                           "logical_cpus": os.cpu_count(), "gpus": list(gpus)}
    if matrix is not None:
        out["link_matrix"] = np.asarray(matrix, dtype=float).tolist()
    out["name"] = (f"{len(out['gpus'])} x {out['gpus'][0]}" if out["gpus"]
                   else f"host {out['cpu_model'] or 'cpu'}")
    return out


def calibrate(*, host_only: bool = False, warmup: int = 3, iters: int = 10,
              nbytes: int | None = None, cupy=None, nccl=None, matrix=None) -> dict:
    """Measure and return the calibration record (not yet written).

    On GPUs (the device layer sees one, or `cupy` is a stand-in for CuPy) unless
    `host_only`; `nbytes` sizes the bandwidth measurements (default 16 MiB per host_sum
    source, 64 MiB on GPUs). `nccl` (CuPy's NCCL module) and `matrix` (the GPUs' link
    matrix) replace what would be loaded or probed.
    """
    from ..comm.plan import simulate, topology
    from ..device.cuda import measure
    t0 = time.perf_counter()
    constants = measure_host(warmup, iters, nbytes or HOST_SUM_BYTES)
    links: list = []
    skipped: dict = {}
    probe = None
    if not host_only:
        probe = measure.open_probe(
            cupy, matrix=_link_matrix if matrix is None else matrix,
            same_weight=topology.SAME_DEVICE_WEIGHT,
            nccl=nccl,
            nccl_step_us=simulate.COSTS.nccl_step_us, nbytes=nbytes or measure.GPU_BYTES,
            warmup=warmup, iters=iters)
    if probe is not None:
        gpu_constants, links, skipped = probe.run()
        constants.update(gpu_constants)
        machine = system_info(probe.gpu_names(), probe.matrix)
    else:
        skipped["gpu"] = ("host only (--host)" if host_only
                          else "no GPU: only the host constants were measured")
        machine = system_info()
    try:
        versions = benchutil.versions(probe.library_versions() if probe else None)
    except Exception as exc:  # versions are informative; never fail the calibration
        versions = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "format": simulate.CALIBRATION_FORMAT,
        "version": simulate.CALIBRATION_VERSION,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine,
        "versions": versions,
        "settings": {"warmup": warmup, "iters": iters, "timing": "medians",
                     "seconds": round(time.perf_counter() - t0, 3)},
        "constants": constants,
        "links": links,
        "skipped": skipped,
    }


def write(record: dict, path) -> Path:
    """Write `record` atomically to `path` (folders created); returns the path."""
    import json

    from ..checkpoints.checkpoint import atomic_write
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            f.write((json.dumps(record, indent=2) + "\n").encode())
    except Exception as exc:
        reason = exc.__cause__ or exc
        raise SystemExit(f"gpukv bench --calibrate: cannot write {path}: {reason}") from exc
    return path


def _check_writable(path: Path) -> None:
    """SystemExit unless `write` can make or replace the file `path`: it is no folder,
    nothing on the way to it is a file, and the nearest folder that exists is writable."""
    why = None
    if path.is_dir():
        why = "it is a folder; give a file's path"
    else:
        place = path.parent
        while not place.exists() and place != place.parent:
            place = place.parent
        if not place.is_dir():
            why = f"{str(place)!r} is a file, not a folder"
        elif not os.access(place, os.W_OK | os.X_OK):
            why = f"the folder {str(place)!r} is not writable"
    if why is not None:
        raise SystemExit(f"gpukv bench --calibrate: cannot write {path}: {why}")


def _defaults() -> dict:
    """name -> the model's default value, for the report."""
    from ..comm.plan import simulate
    m = simulate.generic_machine(np.zeros((1, 1)))
    out = {}
    for name, (_, where) in simulate.CALIBRATED.items():
        out[name] = getattr(simulate.COSTS if where == "costs" else m, name)
    return out


def report(record: dict, file=None) -> None:
    import sys
    file = file or sys.stdout
    from ..comm.plan import simulate
    defaults = _defaults()
    print(f"gpukv calibration on {record['machine']['name']} "
          f"({record['settings']['seconds']:.1f} s)", file=file)
    rows = [[name, e["value"], e["unit"], defaults.get(name), e["method"]]
            for name, e in record["constants"].items()]
    for link in record["links"]:
        cls = (simulate.generic_machine(np.zeros((2, 2))).staged if link["weight"] <= 0
               else simulate.generic_link(link["weight"]))
        for key, default in (("gbps", cls.gbps), ("latency_us", cls.latency_us)):
            e = link[key]
            rows.append([f"link {link['weight']:g} {key}", e["value"], e["unit"], default,
                         f"{link['kind']}: {e['method']}"])
    benchutil.print_table(["constant", "measured", "unit", "default", "how"], rows,
                          {0, 2, 4}, file=file)
    for name, why in record.get("skipped", {}).items():
        print(f"  not measured: {name}: {why}", file=file)


def main(args) -> int:
    """The --calibrate mode of `gpukv bench` for parsed `args`; returns 0."""
    from ..comm.plan import simulate
    path = args.calibration_file or simulate.calibration_path()
    if path is None:
        raise SystemExit("gpukv bench --calibrate: GPUKV_CALIBRATION is off; pass "
                         "--calibration-file PATH")
    _check_writable(Path(path).expanduser())  # before the measuring, not after it
    record = calibrate(host_only=args.host, warmup=max(1, args.warmup),
                       iters=max(5, args.iters), nbytes=args.copy_size)
    if not args.quiet:
        report(record)
    written = write(record, path)
    simulate.reset_calibration()  # this process reads the new file from now on
    print(f"wrote {written}")
    return 0

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
- per link weight of the measured link matrix (`topology.link_matrix_from_cuda`, the one
  'auto' sees; 64 = virtual GPUs on one GPU, 0 = no peer access: staged via the host):
  one-way GB/s and latency of a copy over one pair of that weight.

GPU times are medians of CUDA-event intervals; small latencies are timed behind a large
copy queued first, so the events see device time, not the host's issue time. Host times
are medians of `time.perf_counter` intervals.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from . import benchutil

MIB = 1 << 20
HOST_SUM_SOURCES = 4
HOST_SUM_BYTES = 16 * MIB   # per source
GPU_BYTES = 64 * MIB        # bandwidth measurements on GPUs
TINY_BATCH = 100            # host calls per timed batch of tiny work
DEVICE_BATCH = 8            # tiny kernels or copies per CUDA-event interval


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
    """{'host_sum_gbps': entry, 'host_sum_us': entry} measured with `comm.host.host_sum`."""
    from ..comm.host import host_sum
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
    return topology.link_matrix_from_cuda(list(range(count)))


class GpuProbe:
    """Measures the GPU constants with CuPy module `cp` (a stand-in in tests).

    `matrix`: the link matrix of the physical GPUs (default `_link_matrix`); `nccl`:
    CuPy's NCCL module, or None to load it (the measurement is skipped if it fails).
    """

    def __init__(self, cp, *, matrix=None, nccl=None, nbytes: int = GPU_BYTES,
                 warmup: int = 3, iters: int = 10):
        self.cp = cp
        self.count = int(cp.cuda.runtime.getDeviceCount())
        self.matrix = np.asarray(_link_matrix(self.count) if matrix is None else matrix,
                                 dtype=float)
        self.nccl = nccl
        self.nbytes = max(4, nbytes // 4 * 4)
        self.warmup, self.iters = warmup, max(1, iters)
        self.streams: dict = {}
        self._busy: dict = {}

    # ---------------------------------------------------------------- plumbing
    def device(self, d: int):
        return self.cp.cuda.Device(d)

    def stream(self, d: int):
        s = self.streams.get(d)
        if s is None:
            with self.device(d):
                s = self.streams[d] = self.cp.cuda.Stream(non_blocking=True)
        return s

    def array(self, d: int, nbytes: int, fill: float | None = None):
        with self.device(d):
            a = self.cp.empty(nbytes // 4, self.cp.float32)
            if fill is not None:
                a.fill(fill)
        return a

    def sync(self):
        for d in range(self.count):
            self.device(d).synchronize()

    def busy(self, d: int):
        """Queue a large copy on GPU d's stream, so what follows waits on the device."""
        pair = self._busy.get(d)
        if pair is None:
            n = 4 * self.nbytes
            pair = self._busy[d] = (self.array(d, n, 0.0), self.array(d, n))
        src, dst = pair
        with self.device(d):
            dst.data.copy_from_device_async(src.data, src.nbytes, self.stream(d))

    def timed(self, devices, step, *, preload: bool = False, per: int = 1) -> float:
        """Median seconds of `step()` / `per`, by CUDA events spanning the streams of
        `devices`; with `preload`, each interval starts behind a large queued copy."""
        from .bench import CudaClock
        clock = CudaClock(self.cp, [(d, self.stream(d)) for d in devices])

        def once(pairs=None):
            if preload:
                for d in devices:
                    self.busy(d)
            a = clock.start()
            step()
            b = clock.stop()
            if pairs is not None:
                pairs.append((a, b))

        for _ in range(self.warmup):
            once()
        self.sync()
        pairs: list = []
        for _ in range(self.iters):
            once(pairs)
        times = clock.elapsed(pairs)
        self.sync()
        return statistics.median(times) / per

    def _copy(self, dst, src, nbytes, d):
        with self.device(d):
            dst.data.copy_from_device_async(src.data, nbytes, self.stream(d))

    def copy_class(self, src_dev: int, dst_dev: int) -> tuple:
        """(GB/s one way, latency s) of copies GPU src_dev -> GPU dst_dev."""
        n = self.nbytes
        src, dst = self.array(src_dev, n, 1.0), self.array(dst_dev, n)
        tiny_src, tiny_dst = self.array(src_dev, 4, 1.0), self.array(dst_dev, 4)

        def tiny():
            for _ in range(DEVICE_BATCH):
                self._copy(tiny_dst, tiny_src, 4, dst_dev)

        latency = self.timed([dst_dev], tiny, preload=True, per=DEVICE_BATCH)
        big = self.timed([dst_dev], lambda: self._copy(dst, src, n, dst_dev))
        return n / _positive(big - latency, 1e-9) / 1e9, latency

    # ------------------------------------------------------------ measurements
    def launch_us(self) -> dict:
        cp = self.cp
        a, b, c = self.array(0, 4, 1.0), self.array(0, 4, 1.0), self.array(0, 4)
        s = self.stream(0)

        def kernels():
            with self.device(0), s:
                for _ in range(TINY_BATCH):
                    cp.add(a, b, out=c)

        def copies():
            for _ in range(TINY_BATCH):
                self._copy(c, a, 4, 0)

        per = []
        for fn in (kernels, copies):
            for _ in range(self.warmup):
                fn()
            times = []
            for _ in range(self.iters):
                self.sync()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            per.append(statistics.median(times) / TINY_BATCH)
        self.sync()
        return _entry(
            statistics.fmean(per) * 1e6, "us",
            f"host time to issue {TINY_BATCH} calls, per call, median of {self.iters}: "
            "mean of a 1-element cupy.add (out=) and a 4-byte device copy",
            kernel_us=per[0] * 1e6, copy_us=per[1] * 1e6)

    def kernel_us(self) -> dict:
        cp = self.cp
        a, b, c = self.array(0, 4, 1.0), self.array(0, 4, 1.0), self.array(0, 4)
        s = self.stream(0)

        def step():
            with self.device(0), s:
                for _ in range(DEVICE_BATCH):
                    cp.add(a, b, out=c)

        t = self.timed([0], step, preload=True, per=DEVICE_BATCH)
        return _entry(_positive(t * 1e6, 0.01), "us",
                      f"CUDA events around {DEVICE_BATCH} 1-element cupy.add kernels queued "
                      "behind a large copy, per kernel, median")

    def hbm_gbps(self, kernel_s: float = 0.0) -> dict:
        cp = self.cp
        n = self.nbytes
        a, b, c = self.array(0, n, 1.0), self.array(0, n, 2.0), self.array(0, n)
        s = self.stream(0)

        def step():
            with self.device(0), s:
                cp.add(a, b, out=c)

        t = self.timed([0], step)
        return _entry(3 * n / _positive(t - kernel_s, 1e-9) / 1e9, "GB/s",
                      f"cupy.add of two {benchutil.format_size(n)} float32 arrays on GPU 0: "
                      "bytes read + written / (median CUDA-event time - kernel_us)")

    def host_copies(self) -> dict:
        """host_gbps and host_copy_us: GPU 0 <-> pinned host memory, both directions."""
        cp = self.cp
        n = self.nbytes
        dev = self.array(0, n, 1.0)
        tiny = self.array(0, 4, 1.0)
        pinned = cp.cuda.alloc_pinned_memory(n)
        s = self.stream(0)

        def d2h(nbytes, src):
            with self.device(0):
                src.data.copy_to_host_async(pinned.ptr, nbytes, s)

        def h2d(nbytes, dst):
            with self.device(0):
                dst.data.copy_from_host_async(pinned.ptr, nbytes, s)

        out = {}
        lat, bw = [], []
        for name, fn in (("d2h", d2h), ("h2d", h2d)):
            def tiny_step(fn=fn):
                for _ in range(DEVICE_BATCH):
                    fn(4, tiny)
            latency = self.timed([0], tiny_step, preload=True, per=DEVICE_BATCH)
            big = self.timed([0], lambda fn=fn: fn(n, dev))
            lat.append(latency)
            bw.append(n / _positive(big - latency, 1e-9) / 1e9)
            out[name] = {"gbps": bw[-1], "latency_us": latency * 1e6}
        del pinned
        return {
            "host_gbps": _entry(
                2 / (1 / bw[0] + 1 / bw[1]), "GB/s",
                f"GPU 0 <-> pinned host copies of {benchutil.format_size(n)}: harmonic mean "
                "of both directions, bytes / (median CUDA-event time - latency)",
                d2h_gbps=bw[0], h2d_gbps=bw[1]),
            "host_copy_us": _entry(
                _positive(statistics.fmean(lat) * 1e6, 0.01), "us",
                f"4-byte GPU 0 <-> pinned host copies, {DEVICE_BATCH} queued behind a large "
                "copy per CUDA-event interval, per copy; mean of both directions",
                d2h_us=lat[0] * 1e6, h2d_us=lat[1] * 1e6),
        }

    def host_total_gbps(self, host_gbps: float | None, latency_s: float = 0.0) -> dict:
        if self.count < 2:
            if host_gbps is None:
                raise RuntimeError("host_gbps was not measured")
            return _entry(host_gbps, "GB/s",
                          "one GPU: every logical device shares its link, = host_gbps")
        cp = self.cp
        n = self.nbytes
        devices = list(range(self.count))
        arrays = [self.array(d, n, 1.0) for d in devices]
        pinned = [cp.cuda.alloc_pinned_memory(n) for _ in devices]

        def d2h():
            for d, a, p in zip(devices, arrays, pinned):
                with self.device(d):
                    a.data.copy_to_host_async(p.ptr, n, self.stream(d))

        def h2d():
            for d, a, p in zip(devices, arrays, pinned):
                with self.device(d):
                    a.data.copy_from_host_async(p.ptr, n, self.stream(d))

        rates = [self.count * n / _positive(self.timed(devices, fn) - latency_s, 1e-9) / 1e9
                 for fn in (d2h, h2d)]
        return _entry(2 / (1 / rates[0] + 1 / rates[1]), "GB/s",
                      f"all {self.count} GPUs <-> pinned host at once, "
                      f"{benchutil.format_size(n)} each: total bytes / (median CUDA-event "
                      "time spanning every GPU's stream - host_copy_us), harmonic mean of "
                      "both directions",
                      d2h_gbps=rates[0], h2d_gbps=rates[1])

    def links(self) -> list:
        """One entry per link weight present between distinct GPUs, plus weight 64
        (same GPU: virtual GPUs); each measured on the first pair of that weight."""
        from ..comm.plan import topology
        pairs = {float(topology.SAME_DEVICE_WEIGHT): (0, 0)}
        for i in range(self.count):
            for j in range(self.count):
                if i != j:
                    pairs.setdefault(float(self.matrix[i, j]), (i, j))
        out = []
        for w, (i, j) in sorted(pairs.items(), reverse=True):
            gbps, latency = self.copy_class(i, j)
            kind = ("same GPU" if i == j else
                    "no peer access: staged via host" if w <= 0 else "peer copy")
            out.append({
                "weight": w, "pair": [i, j], "kind": kind,
                "gbps": _entry(gbps, "GB/s",
                               f"GPU {i} -> GPU {j} copy of "
                               f"{benchutil.format_size(self.nbytes)}: bytes / (median "
                               "CUDA-event time - latency)"),
                "latency_us": _entry(_positive(latency * 1e6, 0.01), "us",
                                     f"4-byte GPU {i} -> GPU {j} copies, {DEVICE_BATCH} "
                                     "queued behind a large copy, per copy"),
            })
        return out

    def nccl_base_us(self) -> dict:
        nccl = self.nccl
        if nccl is None:
            from ..comm.nccl import nccl_module
            nccl = nccl_module()
        from ..comm.plan.simulate import COSTS
        devices = list(range(self.count))
        comms = nccl.NcclCommunicator.initAll(devices)
        bufs = [self.array(d, 16, 1.0) for d in devices]

        def step():
            nccl.groupStart()
            try:
                for d, comm, buf in zip(devices, comms, bufs):
                    with self.device(d):
                        comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size,
                                       nccl.NCCL_FLOAT32, nccl.NCCL_SUM, self.stream(d).ptr)
            finally:
                nccl.groupEnd()

        t = self.timed(devices, step)
        n = len(devices)
        steps_us = 2 * (n - 1) * COSTS.nccl_step_us
        return _entry(_positive(t * 1e6 - steps_us, 0.01), "us",
                      f"grouped NCCL all-reduce of 4 float32 over {n} GPU(s), issue "
                      "included: median CUDA-event time spanning every GPU's stream, less "
                      f"2(n-1) x nccl_step_us ({COSTS.nccl_step_us:g} us)", ranks=n)

    def run(self) -> tuple:
        """(constants, links, skipped): every measurement, each skipped with its reason
        if it fails."""
        constants: dict = {}
        skipped: dict = {}

        def attempt(name, fn):
            try:
                result = fn()
            except Exception as exc:
                skipped[name] = f"{type(exc).__name__}: {exc}"[:300]
                return None
            if name in ("host_copies",):
                constants.update(result)
            elif name != "links":
                constants[name] = result
            return result

        def value(name, scale=1.0, default=None):
            entry = constants.get(name)
            return entry["value"] * scale if entry else default

        attempt("launch_us", self.launch_us)
        attempt("kernel_us", self.kernel_us)
        attempt("hbm_gbps", lambda: self.hbm_gbps(value("kernel_us", 1e-6, 0.0)))
        attempt("host_copies", self.host_copies)
        attempt("host_total_gbps", lambda: self.host_total_gbps(
            value("host_gbps"), value("host_copy_us", 1e-6, 0.0)))
        links = attempt("links", self.links) or []
        attempt("nccl_base_us", self.nccl_base_us)
        self.streams.clear()
        self._busy.clear()
        return constants, links, skipped


# ------------------------------------------------------------------------------ run
def system_info(cp=None, count: int = 0, matrix=None) -> dict:
    """The machine a calibration was measured on (what `load_calibration` compares)."""
    out = {"hostname": platform.node(), "cpu_model": benchutil.cpu_model(),
           "logical_cpus": os.cpu_count(), "gpus": []}
    if cp is not None:
        for i in range(count):
            name = cp.cuda.runtime.getDeviceProperties(i)["name"]
            out["gpus"].append(name.decode() if isinstance(name, bytes) else str(name))
        out["link_matrix"] = np.asarray(matrix, dtype=float).tolist()
    out["name"] = (f"{count} x {out['gpus'][0]}" if out["gpus"]
                   else f"host {out['cpu_model'] or 'cpu'}")
    return out


def calibrate(*, host_only: bool = False, warmup: int = 3, iters: int = 10,
              nbytes: int | None = None, cupy=None, nccl=None, matrix=None) -> dict:
    """Measure and return the calibration record (not yet written).

    On GPUs (CuPy sees one, or `cupy` is a stand-in) unless `host_only`; `nbytes` sizes
    the bandwidth measurements (default 16 MiB per host_sum source, 64 MiB on GPUs).
    """
    from types import SimpleNamespace

    from . import bench
    from ..comm.plan import simulate
    cp = cupy
    if cp is None and not host_only:
        from ..device.cuda.device import cupy_module, gpu_count
        if gpu_count() > 0:
            cp = cupy_module()
    if host_only:
        cp = None
    t0 = time.perf_counter()
    constants = measure_host(warmup, iters, nbytes or HOST_SUM_BYTES)
    links: list = []
    skipped: dict = {}
    count = 0
    if cp is not None:
        probe = GpuProbe(cp, matrix=matrix, nccl=nccl, nbytes=nbytes or GPU_BYTES,
                         warmup=warmup, iters=iters)
        count, matrix = probe.count, probe.matrix
        gpu_constants, links, skipped = probe.run()
        constants.update(gpu_constants)
    else:
        skipped["gpu"] = ("host only (--host)" if host_only
                          else "no GPU: only the host constants were measured")
    env = SimpleNamespace(kind="gpu", cp=cp) if cp is not None else SimpleNamespace(kind="host")
    try:
        versions = bench.versions(env)
    except Exception as exc:  # versions are informative; never fail the calibration
        versions = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "format": simulate.CALIBRATION_FORMAT,
        "version": simulate.CALIBRATION_VERSION,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": system_info(cp, count, matrix),
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

    from ..api.checkpoint import atomic_write
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            f.write((json.dumps(record, indent=2) + "\n").encode())
    except Exception as exc:
        reason = exc.__cause__ or exc
        raise SystemExit(f"gpukv bench --calibrate: cannot write {path}: {reason}") from exc
    return path


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
               else simulate._generic_link(link["weight"]))
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
    record = calibrate(host_only=args.host, warmup=max(1, args.warmup),
                       iters=max(5, args.iters), nbytes=args.copy_size)
    if not args.quiet:
        report(record)
    written = write(record, path)
    simulate.reset_calibration()  # this process reads the new file from now on
    print(f"wrote {written}")
    return 0

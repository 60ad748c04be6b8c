"""Measurements of this machine's GPUs for the cost model's calibration.

`GpuProbe` times, with CUDA events, what the alpha-beta model of the reduction
strategies needs: issue and kernel latency, memory bandwidth, copies to and from pinned
host memory, copies over each class of peer link, and one NCCL all-reduce. Every result
is a plain dict (value, unit, how it was measured); the calibration tool of the layers
above writes them to its file.

GPU times are medians of CUDA-event intervals; small latencies are timed behind a large
copy queued first, so the events see device time, not the host's issue time.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from . import device as _device
from .timing import CudaClock

__all__ = ["GpuProbe", "open_probe", "entry", "format_size", "GPU_BYTES", "TINY_BATCH",
           "DEVICE_BATCH"]

MIB = 1 << 20
GPU_BYTES = 64 * MIB        # bandwidth measurements on GPUs
TINY_BATCH = 100            # host calls per timed batch of tiny work
DEVICE_BATCH = 8            # tiny kernels or copies per CUDA-event interval


def entry(value: float, unit: str, method: str, **extra) -> dict:
    """One measured constant: its value, unit and how it was measured."""
    out = {"value": float(value), "unit": unit, "method": method}
    out.update(extra)
    return out


def format_size(n: int) -> str:
    """1048576 -> '1M', 1000 -> '1000' (binary units, round numbers only)."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _positive(x: float, floor: float) -> float:
    return max(float(x), floor)


def open_probe(cp=None, **options) -> GpuProbe | None:
    """A GpuProbe over the GPUs of `cp` (default: the CuPy gpukv uses), or None when no
    GPU is visible. `options` go to GpuProbe."""
    if cp is None:
        if _device.gpu_count() == 0:
            return None
        cp = _device.cupy_module()
    return GpuProbe(cp, **options)


class GpuProbe:
    """Measures the GPU constants with CuPy module `cp` (a stand-in in tests).

    `matrix`: the link matrix of the physical GPUs, or a callable `count -> matrix`;
    `same_weight`: the weight that matrix gives two logical devices on one GPU (its
    copies are measured as one more link class); `nccl`: CuPy's NCCL module (default:
    loaded when measured; the measurement is skipped if that fails); `nccl_step_us`: the
    model's per-step NCCL latency, taken off the all-reduce time.
    """

    def __init__(self, cp, *, matrix, same_weight: float, nccl=None,
                 nccl_step_us: float, nbytes: int = GPU_BYTES, warmup: int = 3,
                 iters: int = 10):
        self.cp = cp
        self.count = int(cp.cuda.runtime.getDeviceCount())
        if callable(matrix):
            matrix = matrix(self.count)
        self.matrix = np.asarray(matrix, dtype=float)
        self.same_weight = float(same_weight)
        self.nccl = nccl
        self.nccl_step_us = float(nccl_step_us)
        self.nbytes = max(4, nbytes // 4 * 4)
        self.warmup, self.iters = warmup, max(1, iters)
        self.streams: dict = {}
        self._busy: dict = {}

    def library_versions(self) -> dict:
        """CuPy, CUDA and NCCL versions of the library measured with (`probe.gpu_versions`)."""
        from .probe import gpu_versions
        return gpu_versions(self.cp)

    def gpu_names(self) -> list:
        """The name of every GPU measured."""
        names = [self.cp.cuda.runtime.getDeviceProperties(i)["name"]
                 for i in range(self.count)]
        return [n.decode() if isinstance(n, bytes) else str(n) for n in names]

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
                a.fill(fill)  # on the default stream: done before the probe's streams read
                self.device(d).synchronize()
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
        clock = CudaClock([(d, self.stream(d)) for d in devices], self.cp)

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
        return entry(
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
        return entry(_positive(t * 1e6, 0.01), "us",
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
        return entry(3 * n / _positive(t - kernel_s, 1e-9) / 1e9, "GB/s",
                     f"cupy.add of two {format_size(n)} float32 arrays on GPU 0: "
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
        return {
            "host_gbps": entry(
                2 / (1 / bw[0] + 1 / bw[1]), "GB/s",
                f"GPU 0 <-> pinned host copies of {format_size(n)}: harmonic mean "
                "of both directions, bytes / (median CUDA-event time - latency)",
                d2h_gbps=bw[0], h2d_gbps=bw[1]),
            "host_copy_us": entry(
                _positive(statistics.fmean(lat) * 1e6, 0.01), "us",
                f"4-byte GPU 0 <-> pinned host copies, {DEVICE_BATCH} queued behind a large "
                "copy per CUDA-event interval, per copy; mean of both directions",
                d2h_us=lat[0] * 1e6, h2d_us=lat[1] * 1e6),
        }

    def host_total_gbps(self, host_gbps: float | None, latency_s: float = 0.0) -> dict:
        if self.count < 2:
            if host_gbps is None:
                raise RuntimeError("host_gbps was not measured")
            return entry(host_gbps, "GB/s",
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
        return entry(2 / (1 / rates[0] + 1 / rates[1]), "GB/s",
                     f"all {self.count} GPUs <-> pinned host at once, "
                     f"{format_size(n)} each: total bytes / (median CUDA-event "
                     "time spanning every GPU's stream - host_copy_us), harmonic mean of "
                     "both directions",
                     d2h_gbps=rates[0], h2d_gbps=rates[1])

    def links(self) -> list:
        """One entry per link weight present between distinct GPUs, plus `same_weight`
        (same GPU: virtual GPUs); each measured on the first pair of that weight."""
        pairs = {self.same_weight: (0, 0)}
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
                "gbps": entry(gbps, "GB/s",
                              f"GPU {i} -> GPU {j} copy of "
                              f"{format_size(self.nbytes)}: bytes / (median "
                              "CUDA-event time - latency)"),
                "latency_us": entry(_positive(latency * 1e6, 0.01), "us",
                                    f"4-byte GPU {i} -> GPU {j} copies, {DEVICE_BATCH} "
                                    "queued behind a large copy, per copy"),
            })
        return out

    def nccl_base_us(self) -> dict:
        nccl = self.nccl
        if nccl is None:
            from . import nccl as _nccl
            nccl = _nccl.nccl_module()
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
        steps_us = 2 * (n - 1) * self.nccl_step_us
        return entry(_positive(t * 1e6 - steps_us, 0.01), "us",
                     f"grouped NCCL all-reduce of 4 float32 over {n} GPU(s), issue "
                     "included: median CUDA-event time spanning every GPU's stream, less "
                     f"2(n-1) x nccl_step_us ({self.nccl_step_us:g} us)", ranks=n)

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

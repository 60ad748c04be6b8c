"""Helpers shared by the benchmark scripts: timing, sizes, machine facts, tables, JSON.

Only the standard library and NumPy are used, so the module also runs under other
interpreters (the MXNet reference environment imports it to time the baseline).
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import re
import socket
import statistics
import threading
import time
from importlib import metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _load_benchutil():
    """gpukv/tools/benchutil.py, loaded by its path: this module also runs under interpreters
    where gpukv is not installed (the MXNet one)."""
    path = Path(__file__).resolve().parent.parent / "gpukv" / "tools" / "benchutil.py"
    spec = importlib.util.spec_from_file_location("_gpukv_benchutil", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_util = _load_benchutil()
format_size = _util.format_size
format_seconds = _util.format_seconds
pyplot = _util.pyplot
save_figure = _util.save_figure


# ------------------------------------------------------------------------- arguments
# One parser for every script (and `gpukv bench`): sizes in bytes '300', '4K', '16MiB',
# 'A..B' (x4 steps); the errors are ValueErrors that argparse shows as usage errors
# (exit 2). The options every script shares are built by the add_* helpers.
BadArgument = _util.BadArgument
ArgumentParser = _util.ArgumentParser  # "--sizes -4K" is a value, never an option
parse_size = _util.parse_size
parse_sizes = _util.parse_sizes
parse_ints = _util.parse_ints
positive_int = _util.positive_int
nonnegative_int = _util.nonnegative_int
nonnegative_float = _util.nonnegative_float
name_list = _util.name_list
add_sizes_option = _util.add_sizes_option
add_devices_option = _util.add_devices_option
add_timing_options = _util.add_timing_options
add_place_options = _util.add_place_options
elements = _util.elements
RESULTS_TEXT = "benchmarks/results/"


def host_counts(text: str) -> list[int]:
    """Comma-separated numbers of emulated hosts (or processes), each 2 or more."""
    counts = parse_ints(text)
    if any(n < 2 for n in counts):
        raise BadArgument(f"{text!r}: every count must be 2 or more")
    return counts


def link_rates(text: str) -> list[str]:
    """Comma-separated link rates of emulated hosts ('1gbit,10gbit'), checked by
    gpukv.tools.cluster, without repeats."""
    from gpukv.tools.cluster import rate_bits

    rates = [r.strip().lower() for r in text.split(",") if r.strip()]
    if not rates:
        raise BadArgument("no link rate given, e.g. 1gbit")
    for rate in rates:
        try:
            rate_bits(rate)
        except ValueError as exc:
            raise BadArgument(str(exc)) from None
    return list(dict.fromkeys(rates))


def check_batch(parser, batch: int, replicas: int) -> None:
    """A usage error (exit 2) when a batch of `batch` samples leaves one of `replicas`
    replicas without a sample: it would have no gradient."""
    if batch < replicas:
        parser.error(f"--batch {batch}: each of the {replicas} replicas needs a sample at "
                     f"least")


def check_mxnet_python(parser, python: str | None) -> None:
    """A usage error (exit 2) when --mxnet-python (or MXNET_PYTHON) names no interpreter."""
    if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        parser.error(f"--mxnet-python {python}: no such interpreter (it, or MXNET_PYTHON, "
                     f"names a Python with mxnet 1.9.1)")


def add_out_option(p, files: str = "the JSON") -> None:
    """--out DIR, default benchmarks/results/ ('-' writes nothing)."""
    _util.add_out_option(p, RESULTS_TEXT, files)


def out_folder(value: str | None) -> Path | None:
    """The folder --out names (benchmarks/results/ without it); None for '-'."""
    return _util.out_folder(value, RESULTS_DIR)


# -------------------------------------------------------------------------- timing
def summarize(samples: list[float]) -> dict:
    """Median, min, mean and spread of per-iteration times (seconds)."""
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "mean_s": statistics.fmean(samples),
        "stdev_s": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "iters": len(samples),
    }


def time_calls(fn, *, warmup: int, iters: int, min_time: float = 0.0,
               batch: int = 1) -> list[float]:
    """Per-call seconds of `fn()`: `warmup` untimed calls, then at least `iters` timed.

    With `batch` > 1 each sample is the mean of `batch` back-to-back calls, which keeps
    timer overhead out of microsecond-scale calls. Sampling goes on until `min_time`
    seconds have been spent timing, so fast cases collect more samples.
    """
    for _ in range(warmup):
        fn()
    samples = []
    clock = time.perf_counter
    spent = 0.0
    while len(samples) < iters or spent < min_time:
        t0 = clock()
        for _ in range(batch):
            fn()
        dt = clock() - t0
        spent += dt
        samples.append(dt / batch)
        if len(samples) >= 100 * max(iters, 1):
            break
    return samples


# A plan entry of the several-process benchmarks is [bytes, warmup, iters]: `bytes` is one
# key's size, or a list of key sizes pushed and pulled together in one iteration.
def entry_sizes(nbytes) -> list[int]:
    """The key sizes of a plan entry's `bytes` (rounded down to whole float32 items)."""
    sizes = nbytes if isinstance(nbytes, list) else [nbytes]
    return [max(1, int(n) // 4) * 4 for n in sizes]


def entry_label(nbytes) -> str:
    """The name a plan entry's timings go under: '4194304' for one key, '160x102224128'
    for 160 keys of 102224128 bytes in all."""
    sizes = entry_sizes(nbytes)
    total = str(sum(sizes))
    return total if not isinstance(nbytes, list) else f"{len(sizes)}x{total}"


def batch_for(seconds_per_call: float, target: float = 2e-3) -> int:
    """How many calls to put in one sample so that a sample lasts about `target` seconds."""
    if seconds_per_call <= 0:
        return 1
    return max(1, min(1000, int(target / seconds_per_call)))


# ------------------------------------------------------------------- memory limit
def copy_bandwidth(nbytes: int = 256 << 20, *, threads: int = 1, warmup: int = 2,
                   iters: int = 7) -> dict:
    """Bytes per second of `np.copyto` between two `nbytes` arrays (read + write counted).

    With `threads` > 1 the copy is split in contiguous chunks over that many threads
    (NumPy releases the GIL while copying). Reports the median and best of `iters`.
    """
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    if threads <= 1:
        def run():
            np.copyto(dst, src)
    else:
        bounds = [len(src) * i // threads for i in range(threads + 1)]
        pairs = [(dst[a:b], src[a:b]) for a, b in zip(bounds, bounds[1:])]
        run = _threaded(lambda d, s: np.copyto(d, s), pairs)
    samples = time_calls(run, warmup=warmup, iters=iters)
    moved = 2 * src.nbytes
    return {
        "threads": threads,
        "bytes": src.nbytes,
        "median_Bps": moved / statistics.median(samples),
        "best_Bps": moved / min(samples),
    }


def _threaded(work, chunks):
    """A callable running `work(*chunk)` for every chunk, each on its own thread."""
    def run():
        threads = [threading.Thread(target=work, args=c) for c in chunks[1:]]
        for t in threads:
            t.start()
        work(*chunks[0])
        for t in threads:
            t.join()
    return run


# ------------------------------------------------------------------- machine facts
def has_gpu() -> bool:
    """Whether gpukv sees a GPU (False where CuPy, a driver or gpukv itself is missing)."""
    try:
        from gpukv.device.cuda.device import gpu_count
        return gpu_count() > 0
    except Exception:
        return False


def cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux), else platform's guess."""
    return _util.cpu_model()


def machine_info() -> dict:
    """Hostname, CPU, core count, memory and OS of this machine."""
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
                    break
    except OSError:
        pass
    caches = _caches()
    if caches:
        info["caches"] = caches
    return info


def _caches() -> dict:
    """Cache sizes of CPU 0 as the kernel reports them, e.g. {'L1d': '48K', 'L2': '1024K'}."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    out = {}
    for index in sorted(root.glob("index*")) if root.exists() else []:
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        out[name] = size
    return out


def library_versions(*names: str) -> dict:
    """Installed versions of gpukv and of the named distributions (None when one is
    missing)."""
    versions = {"python": platform.python_version()}
    for name in ("gpukv", *names):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def numpy_build() -> dict:
    """Which SIMD extensions this NumPy build dispatches to (empty when unknown)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            return {}
    wanted = ("AVX2", "AVX512F", "AVX512_SKX", "AVX512_SPR", "FMA3")
    return {k: bool(features.get(k)) for k in wanted if k in features}


# --------------------------------------------------------------------------- output
# Hostnames that say nothing about the machine (VMs, containers, fresh installs).
_GENERIC_HOSTS = frozenset(["", "localhost", "vm", "host", "ubuntu", "debian", "runner"])


def result_name(prefix: str) -> str:
    """`<prefix>_<host>`: the hostname, or the CPU model when the hostname is generic
    (a VM's 'vm', a container id), e.g. 'host_amd-epyc'."""
    host = socket.gethostname()
    if host.lower() in _GENERIC_HOSTS or re.fullmatch(r"[0-9a-f]{12,}", host):
        host = cpu_model()
    return f"{prefix}_{_util.slug(host)}"


def write_json(payload: dict, path: str | os.PathLike | None = None, *,
               prefix: str = "bench") -> Path:
    """Write `payload` (plus a UTC timestamp and the command line) as pretty JSON.

    Default path: benchmarks/results/<prefix>_<host>.json. Returns the path written.
    """
    target = Path(path) if path else RESULTS_DIR / f"{result_name(prefix)}.json"
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return _util.write_record(target, payload, created)


def save_results(payload: dict, out: str | None, name: str, plot=None) -> Path | None:
    """Write `payload` as <name>.json into the folder --out names, and with `plot` (a
    callable taking the PNG's path) the chart next to it; print what was written.
    Returns the JSON's path, None when --out is '-'."""
    folder = out_folder(out)
    if folder is None:
        return None
    path = write_json(payload, folder / f"{name}.json")
    print(f"wrote {path}")
    if plot is not None:
        png = path.with_suffix(".png")
        try:
            plot(png)
        except ImportError:
            print("no PNG: matplotlib is not installed")
        else:
            print(f"wrote {png}")
    return path


def print_table(headers: list[str], rows: list[list], *, file=None) -> None:
    """A plain aligned text table; numbers right-aligned, everything else left-aligned."""
    left = {i for i in range(len(headers))
            if not (rows and all(_is_number(row[i]) for row in rows))}
    _util.print_table(headers, rows, left, file=file)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) or v is None

"""The strategy benchmark behind `python -m gpukv bench` and benchmarks/bench_strategies.py.

What one "step" is everywhere: every one of `n` devices holds a value per key; the values
are summed and the sum written back to every device (push, then pull into the same
arrays), i.e. an allreduce of `size` bytes per device and key.

Cases:
- sweep: sizes x device counts x strategies, one key per step;
- small: many small keys (default 1000 x 4 KB x 4 devices) in one list push+pull;
- goal: the large-key case (default 256 MB float32 per device on 4 and 8 devices).

Every case is timed against baselines measured in the same process: a per-key loop of
array-library ops (CuPy on GPUs, NumPy on the host: sum the sources key by key, copy the
sum back), and PyTorch (`torch.stack(...).sum(0)` per key, and `torch._foreach_add_`
over the lists of all keys) when torch is installed. The tensors PyTorch works on share
memory with the benchmark's arrays (DLPack / `torch.from_numpy`), so nothing is duplicated.

Definitions (reported in the JSON too):
- time: median over `--iters` timed steps (GPU: CUDA events spanning every stream used;
  host: `time.perf_counter`).
- algbw = keys * size / time; busbw = algbw * 2(n-1)/n (nccl-tests, allreduce).
- minimal bytes = keys * size * 2(n+1): a push must read n sources and write the stored
  value, a pull must read it and write n outputs.
- copy fraction = (minimal bytes / time) / copy bandwidth, where the copy bandwidth is
  measured in the same run (GPU: device-to-device memcpy on GPU 0; host: np.copyto), with
  bytes read + written counted, so 1.0 means "as fast as a plain memory copy".

Output: a table per case; with `--out DIR` also strategies_<device>.json and a chart,
strategies_<device>.png, in DIR (without `--out`, nothing is written: the results are only
printed; benchmarks/bench_strategies.py writes into benchmarks/results/ by default).
The exit status is 1 when a case failed or computed a wrong sum, 2 for bad options.

`--calibrate` runs none of this: it measures the constants of the 'auto' strategy's cost
model on this machine and writes them to a calibration file (see `gpukv.tools.calibrate`).

On a machine without a GPU (or with --host) the same steps run on host devices (NumPy
arrays standing for n devices), through `gpukv.create('local')` and through
`gpukv.create('device', strategy=name)`, which runs a named strategy's algorithm over host
devices (the JSON's `effective` says 'host-sum' where a store summed on the host instead).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from . import benchutil

DTYPE = np.float32
GPU_SIZES = "4K,64K,1M,16M,256M,1G"
HOST_SIZES = "4K,64K,1M,16M"
DEFAULT_DEVICES = "2,4,8"
BASELINES = ("loop", "torch_stack", "torch_foreach")
SMALL_GOAL_VS_LOOP = 10.0   # the list push+pull must be >= 10x the per-key CuPy loop
LARGE_GOAL_FRACTION = 0.85  # push+pull must reach 85% of the measured D2D copy bandwidth

log = logging.getLogger("gpukv.bench")

# ----------------------------------------------------------------------------- helpers
_SUFFIX = benchutil.SUFFIX
format_size = benchutil.format_size
format_seconds = benchutil.format_seconds
slug = benchutil.slug


parse_size = benchutil.parse_size
parse_ints = benchutil.parse_ints


#: a key's bytes: at least one value
parse_key_size = benchutil.size_at_least(
    np.dtype(DTYPE).itemsize, f"one {np.dtype(DTYPE).name} ({np.dtype(DTYPE).itemsize} bytes)",
    item=np.dtype(DTYPE).itemsize)
#: the bytes of the copy-bandwidth measurement: less would time the call, not the copy
parse_copy_size = benchutil.size_at_least(
    4096, "4K, which times the copy's call rather than its bandwidth")


def parse_sizes(text: str) -> list[int]:
    """'4K,1M' -> [4096, 1048576]; 'A..B' -> A, 4A, 16A, ... up to B (both included);
    whole float32 values, at least one each."""
    return benchutil.parse_sizes(text, minimum=np.dtype(DTYPE).itemsize)


CASES = ("sweep", "small", "goal")


def strategy_names() -> list[str]:
    """What --strategies and --goal-strategy accept: 'local' and the registry's names."""
    from ..comm.registry import STRATEGIES
    return ["local"] + list(STRATEGIES)


parse_strategies = benchutil.name_list(strategy_names, "strategy")
parse_baselines = benchutil.name_list(BASELINES, "baseline", allow_empty=True)
parse_cases = benchutil.name_list(CASES, "case")


def parse_strategy(text: str) -> str:
    """One name of `strategy_names()`, lower-cased."""
    names = parse_strategies(text)
    if len(names) != 1:
        raise benchutil.BadArgument(f"{text!r}: expected one strategy")
    return names[0]


def print_table(headers, rows, file=None) -> None:
    left = {i for i in range(len(headers))
            if any(isinstance(row[i], str) and not row[i].endswith(("s", "x", "%"))
                   for row in rows)}
    benchutil.print_table(headers, rows, left, file=file)


def cpu_model() -> str:
    return benchutil.cpu_model(default="cpu")


def _wants_progress(args) -> bool:
    """--progress draws the bar; otherwise only a terminal gets one (a log file or a pipe
    would fill with carriage-return redraws)."""
    if args.progress:
        return True
    return not (args.no_progress or args.quiet) and sys.stderr.isatty()


def _progress(total: int, enabled: bool):
    """A tqdm bar on stderr (a do-nothing stand-in without tqdm or when disabled)."""
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True,
                        leave=False)
        except ImportError:
            pass

    class _Null:
        def update(self, n=1):
            pass

        def set_postfix_str(self, s):
            pass

        def close(self):
            pass

        def write(self, s):
            print(s, file=sys.stderr)
    return _Null()


NO_TORCH = "skipped: PyTorch (torch) is not installed or does not import"


def _torch():
    """torch, or None when it is not installed (or fails to import)."""
    try:
        import torch
    except Exception:
        return None
    return torch


# ------------------------------------------------------------------------------ clocks
class HostClock:
    """Wall-clock time of host work."""

    def start(self):
        return time.perf_counter()

    def stop(self):
        return time.perf_counter()

    def elapsed(self, pairs) -> list[float]:
        return [b - a for a, b in pairs]


def measure(step, clock, warmup: int, iters: int, sync) -> dict:
    """Median/min seconds of `step()` after `warmup` untimed calls."""
    for _ in range(warmup):
        step()
    sync()
    pairs = []
    for _ in range(iters):
        a = clock.start()
        step()
        pairs.append((a, clock.stop()))
    times = clock.elapsed(pairs)
    sync()
    return {"time_s": statistics.median(times), "time_min_s": min(times), "iters": len(times)}


# ------------------------------------------------------------------------ environments
class HostEnv:
    """n host "devices": separate NumPy arrays in main memory."""

    kind = "host"

    def __init__(self):
        self.xp = np
        self.name = f"host {cpu_model()}"

    def activate(self, device: int):
        return contextlib.nullcontext()

    def array(self, device: int, elems: int):
        return np.zeros(elems, DTYPE)

    def clock(self, n: int):
        return HostClock()

    def sync(self):
        pass

    def free(self):
        gc.collect()

    def fits(self, nbytes: int) -> bool:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return True
        return nbytes < 0.7 * avail

    def to_home(self, array, home_device: int):
        return array

    def copy_into(self, dst, src):
        np.copyto(dst, src)

    def torch_tensor(self, torch, array):
        return torch.from_numpy(array)

    def torch_clock(self, torch, n: int):
        return HostClock()

    def torch_sync(self, torch):
        pass

    def copy_bandwidth(self, nbytes: int, warmup: int, iters: int) -> dict:
        src = np.ones(nbytes // 4, DTYPE)
        dst = np.empty_like(src)
        result = measure(lambda: np.copyto(dst, src), HostClock(), warmup, iters, self.sync)
        return {"method": "np.copyto, one thread, read + write bytes counted",
                "bytes": int(src.nbytes),
                "GBps": 2 * src.nbytes / result["time_s"] / 1e9,
                "best_GBps": 2 * src.nbytes / result["time_min_s"] / 1e9}

    def gpu_versions(self) -> None:
        return None

    def info(self) -> dict:
        return {"kind": "host", "name": self.name, "cpu_model": cpu_model(),
                "logical_cpus": os.cpu_count()}


class CudaEnv:
    """n logical GPUs: device i lives on GPU i % count (virtual GPUs share a GPU).

    Everything GPU-side goes through gpukv's device layer: arrays are made, copied and
    waited for by its CUDA devices, GPU facts come from `device.cuda.probe` and times
    from CUDA events (`device.cuda.timing`).
    """

    kind = "gpu"

    def __init__(self):
        from ..device.cuda import probe
        self.gpus = probe.gpu_properties()
        self.count = len(self.gpus)
        self.name = self.gpus[0]["name"]
        self.xp = self.device(0).xp  # the GPUs' array module, for the checks

    def physical(self, device: int) -> int:
        return device % self.count

    def device(self, device: int):
        """gpukv's device for (the physical GPU of) logical device `device`."""
        from ..device.cuda.device import cuda_device
        return cuda_device(self.physical(device))

    def activate(self, device: int):
        """A context making (the GPU of) logical device `device` current."""
        return self.device(device).activate()

    def array(self, device: int, elems: int):
        return self.device(device).zeros(elems, DTYPE)

    def _logical(self, n: int):
        from ..device.cuda.device import cuda_device
        return [cuda_device(i % self.count, i // self.count) for i in range(n)]

    def clock(self, n: int):
        """A clock spanning the streams of n logical devices and each GPU's current stream."""
        from ..device.cuda.timing import clock_for_devices
        return clock_for_devices(self._logical(n))

    def sync(self):
        from ..device.cuda.probe import synchronize
        synchronize(range(self.count))

    def free(self):
        from ..device.cuda.probe import release_cached_memory
        gc.collect()
        self.sync()
        release_cached_memory()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit on every GPU (spread evenly)."""
        from ..device.cuda.probe import free_memory
        per_gpu = nbytes / max(1, self.count)
        return all(per_gpu <= 0.85 * free_memory(p) for p in range(self.count))

    def to_home(self, array, home_device: int):
        """`array` on GPU `home_device` (a peer copy when it lives elsewhere)."""
        return self.device(home_device).to_local(array)

    def copy_into(self, dst, src):
        """dst[...] = src, by the GPU of `src`: its stream wrote `src`, so no event is
        needed before the copy reads it."""
        from ..device import device_of
        device_of(src).copy(dst, src)

    def torch_tensor(self, torch, array):
        return torch.from_dlpack(array)

    def torch_clock(self, torch, n: int):
        from ..device.cuda.timing import clock_for_stream_handles
        return clock_for_stream_handles([(p, torch.cuda.current_stream(p).cuda_stream)
                                         for p in range(min(n, self.count))])

    def torch_sync(self, torch):
        for p in range(self.count):
            torch.cuda.synchronize(p)

    def _copy_time(self, device: int, dst, src, warmup: int, iters: int) -> dict:
        """`measure` of copies src -> dst queued on GPU `device`, by CUDA events."""
        from ..device.cuda.timing import clock_for_devices
        dev = self.device(device)
        return measure(lambda: dev.copy(dst, src), clock_for_devices([dev]), warmup, iters,
                       self.sync)

    def copy_bandwidth(self, nbytes: int, warmup: int, iters: int) -> dict:
        """Device-to-device memcpy bandwidth on GPU 0 (and GPU 0 -> 1 when there are two)."""
        out = {"method": "cudaMemcpyAsync device-to-device on GPU 0, read + write bytes counted",
               "bytes": int(nbytes)}
        src = self.array(0, nbytes // 4)
        dst = self.array(0, nbytes // 4)
        result = self._copy_time(0, dst, src, warmup, iters)
        out["GBps"] = 2 * src.nbytes / result["time_s"] / 1e9
        out["best_GBps"] = 2 * src.nbytes / result["time_min_s"] / 1e9
        if self.count >= 2:
            from ..device.cuda.probe import peer_access
            peer = self.array(1, nbytes // 4)
            try:
                can = peer_access([1, 0])[0][1]
            except Exception:
                can = None
            result = self._copy_time(1, peer, src, warmup, iters)
            out["peer_0_to_1_GBps"] = src.nbytes / result["time_s"] / 1e9
            out["peer_0_to_1_note"] = "one-way bytes per second of a GPU 0 -> GPU 1 memcpy"
            out["peer_access_1_0"] = can
            del peer
        del src, dst
        self.free()
        return out

    def gpu_versions(self) -> dict:
        from ..device.cuda.probe import gpu_versions
        return gpu_versions()

    def info(self) -> dict:
        keys = ("id", "name", "memory_GiB", "compute_capability")
        return {"kind": "gpu", "name": self.name,
                "gpus": [{k: g[k] for k in keys} for g in self.gpus],
                "virtual_gpus": os.environ.get("GPUKV_VIRTUAL_GPUS") or None,
                "cpu_model": cpu_model()}


# --------------------------------------------------------------------------- workloads
class Workload:
    """`keys` keys of `elems` float32 elements on each of `n` devices: data[d][k]."""

    def __init__(self, env, n: int, keys: int, elems: int):
        self.env, self.n, self.keys, self.elems = env, n, keys, elems
        self.data = [[env.array(d, elems) for _ in range(keys)] for d in range(n)]
        self.values = [[self.data[d][k] for d in range(n)] for k in range(keys)]

    @property
    def key_bytes(self) -> int:
        return self.elems * np.dtype(DTYPE).itemsize

    def fill(self, per_device):
        for d in range(self.n):
            with self.env.activate(d):
                for a in self.data[d]:
                    a.fill(per_device(d))

    def check(self) -> bool:
        """After a fill(d + 1) and one step: does every array hold n(n+1)/2?"""
        expected = self.n * (self.n + 1) / 2
        xp = self.env.xp
        for d in range(self.n):
            with self.env.activate(d):
                for a in self.data[d]:
                    if not bool(xp.all(a == expected)):
                        return False
        return True


def _new_store(name: str, w: Workload):
    """A store ('local', or 'device' with strategy `name`) holding every key of `w`."""
    import gpukv
    kv = gpukv.create("local") if name == "local" else gpukv.create("device", strategy=name)
    keys = list(range(w.keys))
    kv.init(keys, [w.data[0][k] for k in keys])
    return kv, keys


def _store_step(name: str, w: Workload):
    """push+pull of every key through a gpukv store ('local', or 'device' with `name`)."""
    kv, keys = _new_store(name, w)
    values = w.values
    if w.keys == 1:
        key, value = 0, values[0]

        def step():
            kv.push(key, value)
            kv.pull(key, out=value)
    else:
        def step():
            kv.push(keys, values)
            kv.pull(keys, out=values)
    return step, kv.strategy, kv


def _store_per_key_step(name: str, w: Workload):
    """The same store driven with one push and one pull call per key."""
    kv, keys = _new_store(name, w)
    values = w.values

    def step():
        for k in keys:
            kv.push(k, values[k])
            kv.pull(k, out=values[k])
    return step, kv.strategy, kv


def _loop_step(w: Workload):
    """The per-key baseline: for each key sum the sources with array ops, copy the sum back."""
    env = w.env
    homes = [env.physical(k % w.n) if env.kind == "gpu" else 0 for k in range(w.keys)]
    values = w.values

    if env.kind == "gpu":
        def step():
            for k, srcs in enumerate(values):
                home = homes[k]
                with env.activate(home):
                    acc = env.to_home(srcs[0], home).copy()
                    for s in srcs[1:]:
                        acc += env.to_home(s, home)
                for o in srcs:
                    env.copy_into(o, acc)
    else:
        def step():
            for srcs in values:
                acc = srcs[0].copy()
                for s in srcs[1:]:
                    acc += s
                for o in srcs:
                    np.copyto(o, acc)
    return step


def _torch_steps(torch, w: Workload):
    """{'torch_stack': step, 'torch_foreach': step} over tensors sharing w's memory."""
    env = w.env
    tensors = [[env.torch_tensor(torch, a) for a in per_dev] for per_dev in w.data]
    per_key = [[tensors[d][k] for d in range(w.n)] for k in range(w.keys)]
    home_dev = tensors[0][0].device
    cross = any(t.device != home_dev for per in tensors for t in per)
    acc = [torch.empty_like(t) for t in tensors[0]]
    foreach_copy = getattr(torch, "_foreach_copy_", None)

    def copy_all(dst, src):
        if foreach_copy is not None:
            foreach_copy(dst, src)
        else:
            for a, b in zip(dst, src):
                a.copy_(b, non_blocking=True)

    def stack_step():
        for srcs in per_key:
            home = srcs[0].device
            if cross:
                srcs_home = [s.to(home, non_blocking=True) for s in srcs]
            else:
                srcs_home = srcs
            total = torch.stack(srcs_home).sum(0)
            for o in srcs:
                o.copy_(total, non_blocking=True)

    def foreach_step():
        copy_all(acc, tensors[0])
        for d in range(1, w.n):
            src = tensors[d]
            if cross:
                src = [t.to(home_dev, non_blocking=True) for t in src]
            torch._foreach_add_(acc, src)
        for d in range(w.n):
            copy_all(tensors[d], acc)

    return {"torch_stack": stack_step, "torch_foreach": foreach_step}


# --------------------------------------------------------------------------- one point
def _row(case, label, path, w, effective, timing, copy_gbps, check=None, error=None):
    n, keys, size = w.n, w.keys, w.key_bytes
    row = {"case": case, "name": label, "path": path, "effective": effective,
           "devices": n, "keys": keys, "size_bytes": size,
           "min_bytes": 2 * (n + 1) * keys * size, "check": check, "error": error}
    if timing is not None:
        t = timing["time_s"]
        algbw = keys * size / t / 1e9
        row.update(timing)
        row["algbw_GBps"] = algbw
        row["busbw_GBps"] = algbw * 2 * (n - 1) / n
        row["eff_GBps"] = row["min_bytes"] / t / 1e9
        row["copy_fraction"] = row["eff_GBps"] / copy_gbps if copy_gbps else None
    return row


def bench_point(env, case, n, keys, size, strategies, baselines, args, bar, copy_gbps,
                per_key_store=False) -> list[dict]:
    """Rows for every strategy and baseline on one (n devices, keys, size) workload."""
    elems = max(1, size // np.dtype(DTYPE).itemsize)
    rows: list[dict] = []
    total = n * keys * elems * 4
    torch = _torch() if any(b.startswith("torch") for b in baselines) else None
    labels = list(strategies) + (["store_per_key"] if per_key_store else []) + list(baselines)
    if not env.fits(total * 2 + 2 * keys * elems * 4):
        sized = _Sized(env, n, keys, elems)
        for label in labels:
            rows.append(_row(case, label, "skipped", sized, None, None, copy_gbps,
                             error=f"skipped: {format_size(total)} does not fit in memory"))
            bar.update()
        return rows
    w = Workload(env, n, keys, elems)
    clock = env.clock(n)
    for label in list(strategies) + (["store_per_key"] if per_key_store else []):
        bar.set_postfix_str(f"{case} n={n} {format_size(size)} {label}")
        obj = None
        try:
            if label == "store_per_key":
                name = strategies[0] if strategies else "auto"
                if env.kind == "host":
                    name = "local"
                step, effective, obj = _store_per_key_step(name, w)
                path = "store"
            else:
                step, effective, obj = _store_step(label, w)
                path = "store"
                # A store given a strategy sends host arrays through it, but for 'auto' and
                # 'cpu': those take the plain host sum
                if (env.kind == "host" and label not in ("local", "cpu")
                        and obj.strategy in ("auto", "cpu")):
                    effective = "host-sum"
            w.fill(lambda d: d + 1)
            step()
            env.sync()
            ok = w.check()
            w.fill(lambda d: 0)
            timing = measure(step, clock, args.warmup, args.iters, env.sync)
            rows.append(_row(case, label, path, w, effective, timing, copy_gbps,
                             check="ok" if ok else "WRONG"))
        except Exception as exc:  # one failing strategy must not end the run
            log.debug("strategy %s failed", label, exc_info=True)
            rows.append(_row(case, label, "error", w, None, None, copy_gbps,
                             error=f"{type(exc).__name__}: {exc}"[:300]))
        del obj
        bar.update()
    for label in baselines:
        bar.set_postfix_str(f"{case} n={n} {format_size(size)} {label}")
        skip = _baseline_skip(env, label, torch, n, elems)
        if skip is not None:  # cannot run here: not a failure
            rows.append(_row(case, label, "skipped", w, None, None, copy_gbps, error=skip))
            bar.update()
            continue
        try:
            if label == "loop":
                step = _loop_step(w)
                timing = measure(step, clock, args.warmup, args.iters, env.sync)
            else:
                step = _torch_steps(torch, w)[label]
                timing = measure(step, env.torch_clock(torch, n), args.warmup, args.iters,
                                 lambda: env.torch_sync(torch))
            rows.append(_row(case, label, "baseline", w, label, timing, copy_gbps))
        except Exception as exc:
            rows.append(_row(case, label, "error", w, None, None, copy_gbps,
                             error=f"{type(exc).__name__}: {exc}"[:300]))
        bar.update()
    # ratios: baseline time / this time (> 1: faster than the baseline)
    base = {r["name"]: r.get("time_s") for r in rows if r["path"] == "baseline"}
    for r in rows:
        if r.get("time_s") and r["path"] != "baseline":
            r["speedup"] = {b: (t / r["time_s"] if t else None) for b, t in base.items()}
    step = obj = None  # drop every reference to the arrays before freeing memory
    del w, clock, step, obj
    env.free()
    return rows


def _baseline_skip(env, label, torch, n, elems) -> str | None:
    """Why baseline `label` cannot run here (its library is missing, it would not fit),
    or None."""
    if label.startswith("torch") and torch is None:
        return NO_TORCH
    if env.kind == "gpu" and label == "torch_stack" and not env.fits((n + 2) * elems * 4):
        return "skipped: torch.stack would not fit in GPU memory"
    return None


class _Sized:
    """Shape facts of a workload that was never allocated."""

    def __init__(self, env, n, keys, elems):
        self.env, self.n, self.keys, self.elems = env, n, keys, elems
        self.key_bytes = elems * np.dtype(DTYPE).itemsize


# ---------------------------------------------------------------------------- output
def _speed(r, name):
    return _x((r.get("speedup") or {}).get(name))


def table_rows(rows):
    out = []
    for r in rows:
        eff = r.get("effective")
        label = r["name"] if not eff or eff == r["name"] else f"{r['name']}->{eff}"
        if r.get("check") == "WRONG":
            label += " WRONG"
        if r.get("time_s") is None:
            out.append([format_size(r["size_bytes"]), r["devices"], r["keys"], label,
                        "skipped" if r["path"] == "skipped" else "failed",
                        None, None, None, "-", "-", "-", "-"])
            continue
        frac = r.get("copy_fraction")
        out.append([format_size(r["size_bytes"]), r["devices"], r["keys"], label,
                    format_seconds(r["time_s"]), r["algbw_GBps"], r["busbw_GBps"],
                    r["eff_GBps"], f"{100 * frac:.1f}%" if frac is not None else "-",
                    _speed(r, "loop"), _speed(r, "torch_stack"), _speed(r, "torch_foreach")])
    return out


HEADERS = ["size", "devs", "keys", "strategy", "time", "algbw GB/s", "busbw GB/s",
           "min-bytes GB/s", "of copy", "vs loop", "vs torch.stack", "vs torch foreach"]


def plot(result: dict, path: Path) -> Path | None:
    """busbw-style chart: minimal-bytes bandwidth against size, one panel per device count."""
    try:
        plt = benchutil.pyplot()
    except ImportError:
        return None
    rows = [r for r in result["results"] if r["case"] == "sweep" and r.get("time_s")]
    counts = sorted({r["devices"] for r in rows})
    if not counts:
        return None
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 4.2), squeeze=False)
    copy = result["copy_bandwidth"].get("best_GBps") or result["copy_bandwidth"]["GBps"]
    for ax, n in zip(axes[0], counts):
        names = []
        for r in rows:
            if r["devices"] == n and r["name"] not in names:
                names.append(r["name"])
        for name in names:
            pts = sorted((r["size_bytes"], r["eff_GBps"]) for r in rows
                         if r["devices"] == n and r["name"] == name)
            style = "--" if name in BASELINES else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                    label=name)
        ax.axhline(copy, color="k", lw=0.8, ls=":", label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["size_bytes"] for r in rows})
        ax.set_xticks(ticks, [format_size(t) for t in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("bytes per device")
        ax.set_ylabel("minimal bytes moved / time (GB/s)")
        ax.set_title(f"{n} devices")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"gpukv push+pull: {result['device']['name']}", fontsize=10)
    return benchutil.save_figure(fig, path)


def write_json(result: dict, path: Path) -> Path:
    created = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    return benchutil.write_record(path, result, created)


# ------------------------------------------------------------------------------ main
def build_parser(prog: str = "gpukv bench",
                 out_default: str | None = None) -> argparse.ArgumentParser:
    """The options of `gpukv bench`; `out_default` names the folder written without --out
    (None: none)."""
    p = benchutil.ArgumentParser(
        prog=prog,
        description="Time push+pull (an allreduce through the store) for every strategy, "
                    "against a per-key array loop and PyTorch, on GPUs or host devices.")
    benchutil.add_sizes_option(p, None, "size of a key on every device",
                               minimum=np.dtype(DTYPE).itemsize,
                               default_text=f"GPU {GPU_SIZES}, host {HOST_SIZES}")
    benchutil.add_devices_option(p, DEFAULT_DEVICES,
                                 "devices of the sweep; more than the GPUs present "
                                 "become virtual GPUs (GPUKV_VIRTUAL_GPUS)")
    p.add_argument("--strategies", type=parse_strategies, default=None, metavar="NAMES",
                   help="comma-separated strategies among local and the registry's "
                        "(default: all of the registry; host runs add 'local')")
    p.add_argument("--baselines", type=parse_baselines, default=",".join(BASELINES),
                   metavar="NAMES",
                   help=f"comma-separated baselines among {', '.join(BASELINES)} ('' for none)")
    p.add_argument("--cases", type=parse_cases, default=",".join(CASES), metavar="NAMES",
                   help="which cases to run: sweep, small (many small keys), goal (large key)")
    benchutil.add_timing_options(p, 3, 10, unit="step",
                                 note="one step is a push+pull of every key")
    p.add_argument("--small-keys", type=benchutil.positive_int, default=1000, metavar="N",
                   help="keys of the small case (default 1000)")
    p.add_argument("--small-size", type=parse_key_size, default=parse_size("4K"), metavar="BYTES",
                   help="bytes per key of the small case (default 4K)")
    p.add_argument("--small-devices", type=benchutil.positive_int, default=4, metavar="N",
                   help="devices of the small case (default 4)")
    p.add_argument("--goal-size", type=parse_key_size, default=None, metavar="BYTES",
                   help="bytes per device of the large-key case (default GPU 256M, host 16M)")
    p.add_argument("--goal-devices", type=parse_ints, default=parse_ints("4,8"),
                   metavar="COUNTS",
                   help="device counts of the large-key case (default 4,8)")
    p.add_argument("--goal-strategy", type=parse_strategy, default="auto", metavar="NAME",
                   help="strategy of the small and large-key cases (default auto; host: local)")
    p.add_argument("--copy-size", type=parse_copy_size, default=None, metavar="BYTES",
                   help="bytes of the copy-bandwidth measurement (default GPU 256M, host 64M)")
    p.add_argument("--torch-threads", type=benchutil.positive_int, default=None, metavar="N",
                   help="torch.set_num_threads for the CPU baselines (default: 1 on host "
                        "runs, as the NumPy code is single-threaded; unchanged on GPUs)")
    benchutil.add_place_options(p, "GPUs when one is present, else the host")
    benchutil.add_out_option(p, out_default,
                             "strategies_<device>.json and its chart, "
                             "strategies_<device>.png")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", action="store_true",
                          help="draw the progress bar even when stderr is not a terminal")
    progress.add_argument("--no-progress", action="store_true",
                          help="no progress bar (default when stderr is not a terminal)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the file names")
    p.add_argument("--calibrate", action="store_true",
                   help="instead of the benchmark, measure the cost model's constants on "
                        "this machine (host summation; on GPUs also launch and kernel "
                        "latency, memory, peer-link and host-copy bandwidths, NCCL) and "
                        "write them to the calibration file the 'auto' and 'tree' "
                        "strategies read; --host: host constants only, --copy-size: "
                        "bytes of the bandwidth measurements")
    p.add_argument("--calibration-file", default=None, metavar="PATH",
                   help="where --calibrate writes (default $GPUKV_CALIBRATION, else "
                        "$XDG_CACHE_HOME/gpukv/calibration.json or "
                        "~/.cache/gpukv/calibration.json)")
    return p


def _gpu_count() -> int:
    from ..device.cuda.device import gpu_count
    return gpu_count()


def _choose_env(args):
    if getattr(args, "gpu", False) or (not args.host and _gpu_count() > 0):
        return CudaEnv()
    return HostEnv()


def _names(value) -> list[str]:
    """A parsed name list as is; a comma-separated string (a hand-made Namespace) split."""
    if isinstance(value, str):
        return [s.strip().lower() for s in value.split(",") if s.strip()]
    return list(value)


def run(args) -> dict:
    """Run the benchmark for parsed `args`; returns the result record."""
    env = _choose_env(args)
    on_gpu = env.kind == "gpu"
    sizes = args.sizes or parse_sizes(GPU_SIZES if on_gpu else HOST_SIZES)
    if args.strategies:
        strategies = _names(args.strategies)
    else:
        from ..comm.registry import STRATEGIES
        strategies = list(STRATEGIES) if on_gpu else ["local"] + list(STRATEGIES)
    baselines = _names(args.baselines)
    cases = _names(args.cases)
    goal_size = args.goal_size or parse_size("256M" if on_gpu else "16M")
    goal_strategy = args.goal_strategy.lower()
    if not on_gpu and goal_strategy == "auto":
        goal_strategy = "local"  # host arrays: the 'local' store
    if on_gpu:
        wanted = max(list(args.devices) * ("sweep" in cases)
                     + list(args.goal_devices) * ("goal" in cases)
                     + [args.small_devices] * ("small" in cases) + [1])
        if wanted > env.count and not os.environ.get("GPUKV_VIRTUAL_GPUS"):
            # home devices of the store are spread over this many logical GPUs
            os.environ["GPUKV_VIRTUAL_GPUS"] = str(wanted)
    threads = None
    if any(b.startswith("torch") for b in baselines):
        torch = _torch()  # imported once, before timing
        threads = args.torch_threads
        if threads is None and not on_gpu:
            threads = 1  # like the NumPy loop and the host store: one thread
        if torch is not None and threads:
            torch.set_num_threads(threads)
    copy_size = args.copy_size or parse_size("256M" if on_gpu else "64M")
    copy = env.copy_bandwidth(copy_size, max(2, args.warmup), max(5, args.iters))
    # The limit is the best copy seen: the median suffers from other load on a shared host.
    copy_gbps = copy["best_GBps"]
    copy["reference"] = "best_GBps"

    n_sweep = len(sizes) * len(args.devices) * (len(strategies) + len(baselines))
    total = (n_sweep * ("sweep" in cases)
             + (2 + len(baselines)) * ("small" in cases)
             + len(args.goal_devices) * (1 + len(baselines)) * ("goal" in cases))
    bar = _progress(total, _wants_progress(args))
    rows: list[dict] = []
    try:
        if "sweep" in cases:
            for n in args.devices:
                for size in sizes:
                    rows += bench_point(env, "sweep", n, 1, size, strategies, baselines,
                                        args, bar, copy_gbps)
        if "small" in cases:
            rows += bench_point(env, "small", args.small_devices, args.small_keys,
                                args.small_size, [goal_strategy], baselines, args, bar,
                                copy_gbps, per_key_store=True)
        if "goal" in cases:
            for n in args.goal_devices:
                rows += bench_point(env, "goal", n, 1, goal_size, [goal_strategy], baselines,
                                    args, bar, copy_gbps)
    finally:
        bar.close()
    # Measured again at the end: the best of both is the limit (a busy moment at the start
    # on a shared host would otherwise understate it); fractions are recomputed against it.
    again = env.copy_bandwidth(copy_size, max(2, args.warmup), max(5, args.iters))
    copy["runs_best_GBps"] = [copy["best_GBps"], again["best_GBps"]]
    copy["best_GBps"] = max(copy["best_GBps"], again["best_GBps"])
    copy["GBps"] = max(copy["GBps"], again["GBps"])
    for r in rows:
        if r.get("eff_GBps") is not None:
            r["copy_fraction"] = r["eff_GBps"] / copy["best_GBps"]

    result = {
        "benchmark": "strategies",
        "device": env.info(),
        "versions": benchutil.versions(env.gpu_versions()),
        "copy_bandwidth": copy,
        "settings": {"sizes": sizes, "devices": args.devices, "strategies": strategies,
                     "baselines": baselines, "cases": cases, "warmup": args.warmup,
                     "iters": args.iters, "dtype": np.dtype(DTYPE).name,
                     "torch_threads": threads,
                     "small": {"keys": args.small_keys, "size_bytes": args.small_size,
                               "devices": args.small_devices, "strategy": goal_strategy},
                     "goal": {"size_bytes": goal_size, "devices": args.goal_devices,
                              "strategy": goal_strategy}},
        "definitions": {
            "time_s": "median of the timed steps; one step = push of every key from every "
                      "device, then pull into the same arrays",
            "algbw_GBps": "keys * size_bytes / time_s",
            "busbw_GBps": "algbw * 2(n-1)/n (nccl-tests allreduce)",
            "min_bytes": "keys * size_bytes * 2(n+1): n sources read + stored value written "
                         "(push), stored value read + n outputs written (pull)",
            "eff_GBps": "min_bytes / time_s",
            "copy_fraction": "eff_GBps / copy_bandwidth.best_GBps (read + write bytes of a "
                             "copy; the best timed copy, measured before and after the cases)",
            "speedup": "baseline time_s / this time_s (> 1: faster than the baseline)",
            "loop": f"per-key {'CuPy' if on_gpu else 'NumPy'} loop: sum the sources key by "
                    "key with array ops, then copy the sum back to every device",
            "torch_stack": "per key: torch.stack(sources).sum(0), copied back to every device",
            "torch_foreach": "all keys at once: _foreach_copy_/_foreach_add_ over the key "
                             "lists of every device, then copied back",
            "path": "store: through gpukv.create('device', strategy=name) (or 'local') "
                    "push/pull; baseline: no gpukv",
            "effective": "the store's strategy; 'host-sum': host arrays summed on the host "
                         "instead of through the strategy",
        },
        "results": rows,
        "goals": goals(rows, on_gpu),
    }
    return result


def goals(rows, on_gpu: bool) -> dict:
    """The two targets: many small keys vs the loop and torch; large key vs the copy limit."""
    out: dict = {"applies": "GPU" if on_gpu else "GPU; this host run is informational"}
    small = [r for r in rows if r["case"] == "small"]
    store = next((r for r in small if r["path"] == "store"
                  and r["name"] != "store_per_key" and r.get("time_s")), None)
    if store is not None:
        sp = store.get("speedup") or {}
        vs_torch = [v for k, v in sp.items() if k.startswith("torch") and v]
        torch_fe = sp.get("torch_foreach")
        out["small_keys"] = {
            "time_s": store["time_s"], "vs_loop": sp.get("loop"), "vs_torch_foreach": torch_fe,
            "vs_fastest_torch": min(vs_torch) if vs_torch else None,
            "target": f">= {SMALL_GOAL_VS_LOOP:g}x the per-key loop and faster than PyTorch",
            "met": bool(sp.get("loop") and sp["loop"] >= SMALL_GOAL_VS_LOOP
                        and all(v > 1 for v in vs_torch)),
        }
    large = [r for r in rows if r["case"] == "goal" and r["path"] != "baseline"
             and r.get("time_s")]
    if large:
        out["large_key"] = {
            "by_devices": {str(r["devices"]): r["copy_fraction"] for r in large},
            "target": f">= {LARGE_GOAL_FRACTION:.0%} of the measured copy bandwidth",
            "met": all((r["copy_fraction"] or 0) >= LARGE_GOAL_FRACTION for r in large),
        }
    return out


def report(result: dict, file=None) -> None:
    file = file or sys.stdout
    dev = result["device"]
    copy = result["copy_bandwidth"]
    print(f"gpukv bench on {dev['name']}"
          + (f" ({len(dev.get('gpus', []))} GPU(s))" if dev["kind"] == "gpu"
             else " (no GPU: host devices, NumPy)"), file=file)
    print(f"copy bandwidth: best {copy['best_GBps']:.1f} GB/s, median {copy['GBps']:.1f} GB/s"
          f" ({copy['method']}, "
          f"{format_size(copy['bytes'])})"
          + (f"; GPU 0->1 peer copy {copy['peer_0_to_1_GBps']:.1f} GB/s one-way"
             if "peer_0_to_1_GBps" in copy else ""), file=file)
    titles = {"sweep": "one key: sizes x devices x strategies",
              "small": "many small keys in one list push+pull",
              "goal": "large key"}
    for case in ("sweep", "small", "goal"):
        rows = [r for r in result["results"] if r["case"] == case]
        if not rows:
            continue
        print(f"\n== {case}: {titles[case]}", file=file)
        ran = {r["name"] for r in rows if r["path"] == "baseline" and r.get("time_s")}
        keep = [i for i in range(len(HEADERS))
                if i < len(HEADERS) - len(BASELINES) or BASELINES[i - len(HEADERS)] in ran]
        print_table([HEADERS[i] for i in keep],
                    [[row[i] for i in keep] for row in table_rows(rows)], file=file)
        notes: dict = {}
        for r in rows:
            if r.get("error"):
                notes.setdefault(r["name"], r["error"])
        for name, error in notes.items():
            print(f"  {name}: {error}", file=file)
    g = result["goals"]
    if "small_keys" not in g and "large_key" not in g:
        return
    print(f"\ngoals ({g['applies']}):", file=file)
    if "small_keys" in g:
        s = g["small_keys"]
        print(f"  many small keys: {_x(s['vs_loop'])} the per-key loop, "
              f"{_x(s['vs_torch_foreach'])} torch foreach -> target {s['target']}: "
              f"{'met' if s['met'] else 'NOT met'}", file=file)
    if "large_key" in g:
        s = g["large_key"]
        fr = ", ".join(f"{n} devices {100 * (v or 0):.1f}%" for n, v in s["by_devices"].items())
        print(f"  large key: {fr} of copy bandwidth -> target {s['target']}: "
              f"{'met' if s['met'] else 'NOT met'}", file=file)
    bad = [r for r in result["results"] if r.get("check") == "WRONG"]
    if bad:
        print(f"\nWRONG RESULTS: {', '.join(sorted({r['name'] for r in bad}))}", file=file)
    failed = failed_rows(result)
    if failed:
        print(f"\nFAILED: {', '.join(sorted({r['name'] for r in failed}))}", file=file)


def failed_rows(result: dict) -> list[dict]:
    """Rows of cases that raised (not those skipped because they cannot run here)."""
    return [r for r in result["results"] if r["path"] == "error"]


def _x(v):
    return f"{v:.2f}x" if v else "-"


def main(argv=None, prog: str = "gpukv bench", out_default: str | os.PathLike | None = None
         ) -> int:
    """`gpukv bench [options]`: returns the exit status (1 when a strategy computed wrong
    sums or a case failed, or --gpu found no GPU; 2 for bad options). `prog` names the
    command in its usage; `out_default` is the folder written without --out (None: the
    results are only printed)."""
    shown = None if out_default is None else _shown(Path(out_default))
    parser = build_parser(prog, shown)
    args = parser.parse_args(argv)
    if args.gpu and _gpu_count() == 0:
        print(f"{prog}: --gpu: no GPU visible", file=sys.stderr)
        return 1
    if args.calibrate:
        from . import calibrate
        return calibrate.main(args)
    logging.getLogger("gpukv").setLevel(logging.ERROR)  # "host arrays only" notes etc.
    result = run(args)
    if not args.quiet:
        report(result)
    folder = benchutil.out_folder(args.out, out_default)
    if folder is not None:
        save(result, folder, args.quiet)
    elif args.out is None and not args.quiet:
        print("\nresults not saved: --out DIR writes the JSON and the chart into DIR")
    wrong = any(r.get("check") == "WRONG" for r in result["results"])
    return 1 if wrong or failed_rows(result) else 0


def _shown(folder: Path) -> str:
    """A folder as help shows it: its last two parts, e.g. 'benchmarks/results/'."""
    return "/".join(folder.parts[-2:]) + "/"


def save(result: dict, folder: Path, quiet: bool = False) -> None:
    """Write the JSON and the chart into `folder`."""
    tag = result["device"]["name"]
    tag = f"host_{slug(cpu_model())}" if result["device"]["kind"] == "host" else slug(tag)
    json_path = write_json(result, folder / f"strategies_{tag}.json")
    print(f"wrote {json_path}")
    written = plot(result, json_path.with_suffix(".png"))
    if written is not None:
        print(f"wrote {written}")
    elif not quiet:
        print("no chart: matplotlib is not installed, or no sweep case was timed")


if __name__ == "__main__":
    sys.exit(main(prog="python -m gpukv.tools.bench"))

"""What snapshots cost a training step: gpukv.torch.Trainer without snapshots, with
checkpoint_every=10 and with checkpoint_every=1, timed in turns in one run.

    python benchmarks/bench_snapshot.py                 # 25.6M parameters, batch 256
    python benchmarks/bench_snapshot.py --every 10,1 --iters 12 --threads 1
    python benchmarks/bench_snapshot.py --quick --out -  # a small model, seconds

The model has ResNet-50's parameter count (25,599,574 against its 25,557,032): 25 layers
Linear(1000, 1000) + ReLU and a Linear(1000, 574) head, trained with SGD with momentum
0.9 (its state is as big as the weights: a snapshot holds 2 x 102 MB) on one CPU replica
and a `--store` store, update_on_kvstore=True. An MLP does less arithmetic per parameter
than ResNet-50's convolutions, so its step is short for its state: the overhead measured
here is an upper bound of what a convolutional model of that size pays at that step time.

One way per Trainer (each on its own copy of the model and its own folder under `--dir`):
'none' (no checkpoint_dir) and 'every K' for each K of `--every`. A round gives every way
one block of `--block` steps in turn (zero_grad, forward, backward, step), then waits
for the way's snapshots to be written (`finish_snapshots`, inside the block's time); the
blocks start halfway between two snapshots of every K that divides the block, so the
one snapshot of a block of 10 with K=10 is written in the background while its own block
goes on, never during another way's. A way's iteration time is its block's seconds per
step; its median over the rounds (and the spread) is reported, and the overhead is
against 'none' in the same run.

Beside it, per snapshot: 'staging', the wall time of the `KVStore.snapshot` call the
step makes (the copy into host buffers; with K=1 also the wait for the previous write to
free its buffers), and 'write', the background thread's wall and CPU seconds in
`write_archive` (timed by wrapping `gpukv.checkpoints.snapshots.write_archive`). The physical
limits, measured in every round after the blocks: 'memcpy', one np.copyto of the
snapshot's bytes between two host buffers, and 'disk', `write_archive` of the same bytes
(two float32 arrays, fsynced) into `--dir`, whose file system is recorded. The process's
CPU seconds per block are kept too: on a machine with few cores the writer's crc32 and
write compete with torch's threads.

A table is printed; JSON (and a PNG with matplotlib) goes to
snapshot_<N>threads_<machine>.json (N: torch's threads) in
--out DIR (default benchmarks/results/; '-' writes nothing). The exit status is 1 when a
way failed.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpukv  # noqa: E402
import gpukv.torch as gt  # noqa: E402
from gpukv.checkpoints import checkpoint as _checkpoint  # noqa: E402
from gpukv.checkpoints import snapshots as _snapshots  # noqa: E402

LR = 0.01
MOMENTUM = 0.9
#: (layers of width x width, width, head outputs): 25,599,574 parameters by default
FULL = (25, 1000, 574)
QUICK = {"shape": (3, 256, 10), "batch": 32, "block": 4, "warmup": 1, "iters": 2}


def make_model(layers: int, width: int, head: int):
    """`layers` x (Linear(width, width), ReLU), then Linear(width, head)."""
    parts: list = []
    for _ in range(layers):
        parts += [nn.Linear(width, width), nn.ReLU()]
    parts.append(nn.Linear(width, head))
    return nn.Sequential(*parts)


def file_system(path: str) -> dict:
    """The mount `path` lies on (/proc/mounts' longest prefix): its point, device and
    type; 'unknown' where /proc/mounts is missing."""
    real = os.path.realpath(path)
    best = {"mount": "?", "device": "?", "type": "unknown"}
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return best
    length = -1
    for device, point, kind in mounts:
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > length:
            best, length = {"mount": point, "device": device, "type": kind}, len(point)
    return best


# ------------------------------------------------------------- timing the writer
class WriterClock:
    """Wall and CPU seconds the snapshot writer spends in `write_archive`, summed until
    `take()`; installed by wrapping the name gpukv.checkpoints.snapshots calls."""

    def __init__(self):
        self._lock = threading.Lock()
        self._wall = self._cpu = 0.0
        self._original = _snapshots.write_archive

    def __enter__(self):
        def timed(path, header, arrays):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                self._original(path, header, arrays)
            finally:
                with self._lock:
                    self._wall += time.perf_counter() - start
                    self._cpu += time.thread_time() - cpu
        _snapshots.write_archive = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc) -> None:
        _snapshots.write_archive = self._original  # type: ignore[assignment]

    def take(self) -> tuple[float, float]:
        """(wall, cpu) seconds since the last call."""
        with self._lock:
            out, self._wall, self._cpu = (self._wall, self._cpu), 0.0, 0.0
        return out


# ----------------------------------------------------------------------- the ways
class Way:
    """One Trainer on its own copy of the model; with `every`, its snapshots go to its
    own folder and every `KVStore.snapshot` call is timed."""

    def __init__(self, name: str, every: int | None, base, batch, store: str, folder: str):
        self.name, self.every = name, every
        self.model = copy.deepcopy(base)
        self.kv = gpukv.create(store)
        self.staging: list = []
        self.last = 0.0  # the last block's seconds per step
        if every is not None:
            self._time_snapshots()
        options = {} if every is None else {"checkpoint_dir": os.path.join(folder, name),
                                            "checkpoint_every": every}
        self.trainer = gt.Trainer(self.model, "sgd",
                                  {"learning_rate": LR, "momentum": MOMENTUM},
                                  kvstore=self.kv, **options)
        self.x, self.y = batch
        self.loss = nn.CrossEntropyLoss()
        self.samples: dict = {"iteration_s": [], "cpu_per_step_s": [], "staging_s": [],
                              "write_s": [], "write_cpu_s": []}

    def _time_snapshots(self) -> None:
        call = self.kv.snapshot

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.staging.append(time.perf_counter() - start)
        self.kv.snapshot = timed  # type: ignore[method-assign]

    def step(self) -> None:
        self.trainer.zero_grad()
        self.loss(self.model(self.x), self.y).backward()
        self.trainer.step(len(self.x))

    def block(self, steps: int, clock: WriterClock, keep: bool) -> None:
        """`steps` steps and the wait for their snapshots; recorded when `keep`."""
        clock.take()
        self.staging.clear()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        self.trainer.finish_snapshots()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        write, write_cpu = clock.take()
        self.last = wall / steps
        if not keep:
            return
        s = self.samples
        s["iteration_s"].append(wall / steps)
        s["cpu_per_step_s"].append(cpu / steps)
        if self.staging:
            s["staging_s"].append(statistics.median(self.staging))
            s["write_s"].append(write / len(self.staging))
            s["write_cpu_s"].append(write_cpu / len(self.staging))


def limits(nbytes: int, folder: str, buffers: tuple) -> dict:
    """One memcpy and one fsynced `write_archive` of `nbytes` (two float32 arrays)."""
    src, dst = buffers
    start = time.perf_counter()
    np.copyto(dst, src)
    copy_s = time.perf_counter() - start
    half = src.size // 2
    path = os.path.join(folder, "limit.npz")
    start, cpu = time.perf_counter(), time.process_time()
    _checkpoint.write_archive(path, {}, {"a": src[:half], "b": src[half:]})
    write_s, write_cpu = time.perf_counter() - start, time.process_time() - cpu
    os.unlink(path)
    return {"memcpy_s": copy_s, "disk_write_s": write_s, "disk_write_cpu_s": write_cpu}


def spread(samples: list) -> dict | None:
    if not samples:
        return None
    # (inclusive: the quartiles of the samples themselves, never outside their range)
    q = (statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1
         else [samples[0]] * 3)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "q1": q[0], "q3": q[2], "n": len(samples)}


def measure(args, folder: str) -> dict:
    torch.manual_seed(0)
    base = make_model(*args.shape)
    parameters = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(args.batch, args.shape[1], generator=g),
             torch.randint(0, args.shape[2], (args.batch,), generator=g))
    ways = [Way("none", None, base, batch, args.store, folder)]
    ways += [Way(f"every {k}", k, base, batch, args.store, folder) for k in args.every]
    state_bytes = 2 * 4 * parameters  # the weights and the momentum, float32
    src = np.ones(state_bytes // 4, np.float32)
    buffers = (src, np.ones_like(src))  # both touched: page faults are not a copy's cost
    for way in ways:  # blocks start halfway between two snapshots
        for _ in range(args.block // 2):
            way.step()
    rounds: list = []
    with WriterClock() as clock:
        for r in range(args.warmup + args.iters):
            keep = r >= args.warmup
            for way in ways:
                way.block(args.block, clock, keep)
            if keep:
                rounds.append(limits(state_bytes, folder, buffers))
            if args.progress:
                last = "  ".join(f"{w.name} {C.format_seconds(w.last)}" for w in ways)
                print(f"round {r + 1}/{args.warmup + args.iters}: {last}", file=sys.stderr,
                      flush=True)
    none = statistics.median(ways[0].samples["iteration_s"])
    results = {}
    for way in ways:
        s = way.samples
        median = statistics.median(s["iteration_s"])
        results[way.name] = {
            "every": way.every, "iteration_s": spread(s["iteration_s"]),
            "overhead": median / none - 1,
            "overhead_per_round": [a / b - 1 for a, b in
                                   zip(s["iteration_s"], ways[0].samples["iteration_s"])],
            "cpu_per_step_s": spread(s["cpu_per_step_s"]),
            "staging_s": spread(s["staging_s"]), "write_s": spread(s["write_s"]),
            "write_cpu_s": spread(s["write_cpu_s"])}
    return {"parameters": parameters, "state_bytes": state_bytes, "ways": results,
            "limits": {k: spread([r[k] for r in rounds]) for k in rounds[0]}}


# ----------------------------------------------------------------------- output
def table_rows(record: dict) -> list[list]:
    rows = []
    for name, w in record["ways"].items():
        it = w["iteration_s"]
        cells = [name, C.format_seconds(it["median"]),
                 f"{C.format_seconds(it['min'])}..{C.format_seconds(it['max'])}",
                 "-" if w["every"] is None else f"{100 * w['overhead']:+.1f}%",
                 C.format_seconds(w["cpu_per_step_s"]["median"])]
        for part in ("staging_s", "write_s", "write_cpu_s"):
            cells.append("-" if w[part] is None else C.format_seconds(w[part]["median"]))
        rows.append(cells)
    lim = record["limits"]
    size = record["state_bytes"]
    rows.append([f"memcpy {size / 1e6:.0f} MB", "-", "-", "-", "-",
                 C.format_seconds(lim["memcpy_s"]["median"]), "-", "-"])
    rows.append([f"disk write {size / 1e6:.0f} MB", "-", "-", "-", "-", "-",
                 C.format_seconds(lim["disk_write_s"]["median"]),
                 C.format_seconds(lim["disk_write_cpu_s"]["median"])])
    return rows


def plot(record: dict, path: Path) -> None:
    plt = C.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(record["ways"])
    its = [record["ways"][n]["iteration_s"] for n in names]
    medians = [1e3 * s["median"] for s in its]
    errors = [[m - 1e3 * s["min"] for m, s in zip(medians, its)],
              [1e3 * s["max"] - m for m, s in zip(medians, its)]]
    bars = left.bar(names, medians, yerr=errors, capsize=4, color="tab:blue")
    for bar, name in zip(bars, names):
        w = record["ways"][name]
        if w["every"] is not None:
            left.annotate(f"{100 * w['overhead']:+.1f}%", (bar.get_x() + bar.get_width() / 2,
                          bar.get_height()), ha="center", va="bottom")
    left.set_ylabel("ms per iteration (median, min..max)")
    left.set_title(f"Trainer, {record['parameters'] / 1e6:.1f}M parameters, "
                   f"batch {record['batch']}")
    lim = record["limits"]
    parts = {"memcpy": lim["memcpy_s"]["median"]}
    for name in names:
        w = record["ways"][name]
        if w["staging_s"] is not None:
            parts[f"staging ({name})"] = w["staging_s"]["median"]
    parts["disk write"] = lim["disk_write_s"]["median"]
    for name in names:
        w = record["ways"][name]
        if w["write_s"] is not None:
            parts[f"write ({name})"] = w["write_s"]["median"]
    right.barh(list(parts), [1e3 * v for v in parts.values()], color="tab:orange")
    right.invert_yaxis()
    right.set_xlabel("ms per snapshot")
    right.set_title(f"{record['state_bytes'] / 1e6:.0f} MB of state; "
                    f"{record['file_system']['type']} disk")
    C.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = C.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--every", type=C.parse_ints, default="10,1", metavar="STEPS",
                   help="checkpoint_every of the ways with snapshots, comma-separated "
                        "(default 10,1)")
    p.add_argument("--batch", type=C.positive_int, default=None, metavar="N",
                   help="batch size of every step (default 256; 32 with --quick)")
    p.add_argument("--block", type=C.positive_int, default=None, metavar="STEPS",
                   help="steps of one way per round (default 10; 4 with --quick)")
    p.add_argument("--store", choices=("local", "device"), default="local",
                   help="the Trainer's store (default local)")
    p.add_argument("--threads", type=C.positive_int, default=None, metavar="N",
                   help="torch.set_num_threads (default: torch's own, "
                        f"{torch.get_num_threads()} here)")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="where the snapshots are written, in a temporary folder made there "
                        "(default: the system's temporary folder)")
    p.add_argument("--quick", action="store_true",
                   help="a 3-layer MLP of width 256, batch 32, blocks of 4 steps, 1+2 "
                        "rounds: for tests, seconds")
    p.add_argument("--warmup", type=C.nonnegative_int, default=None, metavar="N",
                   help="untimed rounds first (default 2; 1 with --quick); a round is one "
                        "block of every way, in turns")
    p.add_argument("--iters", type=C.positive_int, default=None, metavar="N",
                   help="timed rounds, reported as their median (default 15; 2 with "
                        "--quick)")
    p.add_argument("--progress", action="store_true",
                   help="print every round's iteration times to stderr")
    C.add_out_option(p, "snapshot_<N>threads_<machine>.json and its PNG")
    return p


def main(argv=None) -> int:
    """Returns 1 when the run failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.every):
        parser.error(f"argument --every: {args.every}: expected counts >= 1")
    quick = QUICK if args.quick else {}
    args.shape = quick.get("shape", FULL)
    args.batch = args.batch or quick.get("batch", 256)
    args.block = args.block or quick.get("block", 10)
    args.warmup = quick.get("warmup", 2) if args.warmup is None else args.warmup
    args.iters = args.iters or quick.get("iters", 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpukv-bench-snap-", dir=args.dir) as folder:
        where = file_system(folder)
        try:
            record = measure(args, folder)
        except Exception as exc:  # reported as a failed run, not a traceback
            record = {"error": f"{type(exc).__name__}: {exc}"[-600:]}
            print(f"FAILED: {record['error']}", file=sys.stderr)
    record.update({"batch": args.batch, "block": args.block, "store": args.store,
                   "model": {"layers": args.shape[0], "width": args.shape[1],
                             "head": args.shape[2]},
                   "threads": torch.get_num_threads(), "file_system": where,
                   "seconds": time.perf_counter() - started})
    if "error" not in record:
        C.print_table(["way", "iteration", "min..max", "overhead", "cpu/step",
                       "staging", "write", "write cpu"], table_rows(record))
        print(f"{record['parameters']} parameters, batch {args.batch}, "
              f"{record['threads']} torch threads, snapshots on {where['type']} "
              f"({where['device']} at {where['mount']}); {record['seconds']:.0f} s")
    payload = {"benchmark": "snapshot", "results": record, "machine": C.machine_info(),
               "libraries": C.library_versions("numpy", "torch")}
    name = C.result_name(f"snapshot_{record['threads']}threads")
    C.save_results(payload, args.out, name,
                   plot=None if "error" in record else (lambda png: plot(record, png)))
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())

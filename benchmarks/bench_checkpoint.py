"""Whole-store checkpoints with many small keys: KVStore.save and KVStore.load.

    python benchmarks/bench_checkpoint.py --keys 100000
    python benchmarks/bench_checkpoint.py --keys 10000,100000 --shape 4 --optimizer adam

For each key count it fills a 'local' store with that many keys of `--shape` float32
elements, sets the optimizer (its state is created by one push of every key) and times
`save`, `load` into a fresh store with the same optimizer (every key created) and `load`
back into the store that saved (every key overwritten). The baseline, measured in the same
run, is writing and reading the same bytes as one flat .npy file: the ratio says what the
per-key bookkeeping costs on top of moving the data. Each loaded store is checked against
the saved one (values and a following push); a mismatch or a failure exits non-zero.
A table is printed; JSON goes to --out DIR (default benchmarks/results/). `--keys` and
`--shape` are counts, not byte sizes: this benchmark has no --sizes or --devices.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402

import gpukv  # noqa: E402
from gpukv import optim  # noqa: E402

OPTIMIZERS = {
    "none": lambda: None,
    "sgd_mom": lambda: optim.SGD(learning_rate=0.01, momentum=0.9),
    "adam": lambda: optim.Adam(learning_rate=1e-3),
}


def _store(n_keys: int, shape: tuple, make_opt):
    kv = gpukv.create("local")
    keys = list(range(n_keys))
    kv.init(keys, [np.full(shape, k % 97, np.float32) for k in keys])
    opt = make_opt()
    if opt is not None:
        kv.set_optimizer(opt)
        kv.push(keys, [np.full(shape, 0.5, np.float32)] * n_keys)
    return kv, keys


def _values(kv, keys, shape):
    outs = [np.empty(shape, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    return np.stack(outs) if outs else np.empty((0,) + shape, np.float32)


def _timed(fn, cpu: list | None = None) -> float:
    """Wall seconds of `fn()`; its process CPU seconds are appended to `cpu` (on a shared
    machine they say more than the wall clock)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - start_cpu)
    return time.perf_counter() - start


def _same_after_push(a, b, keys, shape) -> bool:
    """Whether stores `a` and `b` hold the same values, also after one more push."""
    if not np.array_equal(_values(a, keys, shape), _values(b, keys, shape)):
        return False
    grads = [np.full(shape, 0.25, np.float32)] * len(keys)
    a.push(keys, grads)
    b.push(keys, grads)
    return np.array_equal(_values(a, keys, shape), _values(b, keys, shape))


def _baseline(nbytes: int, folder: Path) -> tuple[float, float]:
    """Seconds to write and to read `nbytes` as one flat .npy file."""
    flat = np.ones(max(nbytes // 4, 1), np.float32)
    path = folder / "flat.npy"
    write = _timed(lambda: np.save(path, flat))
    read = _timed(lambda: np.load(path))
    return write, read


ROUND_TIMES = ("save", "fresh", "same", "save_cpu", "load_cpu")


def _round(kv, keys, shape, path, make_opt, times: dict) -> bool:
    """One save, load into a fresh store and load back, their seconds appended to the
    lists in `times`. Returns whether the loaded store matches the saved one."""
    times["save"].append(_timed(lambda: kv.save(path), times["save_cpu"]))
    fresh = gpukv.create("local")
    opt = make_opt()
    if opt is not None:
        fresh.set_optimizer(opt)
    times["fresh"].append(_timed(lambda: fresh.load(path), times["load_cpu"]))
    times["same"].append(_timed(lambda: kv.load(path)))
    return _same_after_push(kv, fresh, keys, shape)  # pulls every key


def run_case(n_keys, shape, rule, warmup, iters, folder: Path) -> dict:
    make_opt = OPTIMIZERS[rule]
    kv, keys = _store(n_keys, shape, make_opt)
    path = folder / f"ck_{n_keys}.npz"
    ok = True
    scratch = {k: [] for k in ROUND_TIMES}  # the warm-up rounds' times are dropped
    for _ in range(warmup):
        ok = _round(kv, keys, shape, path, make_opt, scratch) and ok
    t = {k: [] for k in ROUND_TIMES}
    for _ in range(iters):
        ok = _round(kv, keys, shape, path, make_opt, t) and ok
    saves, fresh_loads, same_loads = t["save"], t["fresh"], t["same"]
    save_cpu, load_cpu = t["save_cpu"], t["load_cpu"]
    size = path.stat().st_size
    base_write, base_read = _baseline(size, folder)
    save_s, fresh_s, same_s = (statistics.median(s) for s in (saves, fresh_loads, same_loads))
    return {"keys": n_keys, "shape": list(shape), "optimizer": rule, "file_bytes": size,
            "save_s": save_s, "load_new_keys_s": fresh_s, "load_existing_keys_s": same_s,
            "save_cpu_s": statistics.median(save_cpu),
            "load_new_keys_cpu_s": statistics.median(load_cpu),
            "baseline_write_s": base_write, "baseline_read_s": base_read,
            "save_per_key_us": save_s / max(n_keys, 1) * 1e6,
            "load_per_key_us": fresh_s / max(n_keys, 1) * 1e6, "ok": ok}


def parse_shape(text: str) -> tuple:
    """'4' -> (4,), '2x3' -> (2, 3)."""
    parts = text.strip().lower().split("x")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise C.BadArgument(f"shape {text!r}: expected positive integers joined by x, "
                            "e.g. 4 or 2x3")
    return tuple(int(p) for p in parts)


def build_parser() -> argparse.ArgumentParser:
    p = C.ArgumentParser(prog=Path(__file__).name,
                         description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=C.parse_ints, default="100000", metavar="COUNTS",
                   help="key counts, one case each, e.g. 10000,100000 (default 100000)")
    p.add_argument("--shape", type=parse_shape, default="4",
                   help="shape of every key in float32 elements, e.g. 4 or 2x3 (default 4)")
    p.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS),
                   help="the store's optimizer, whose state is saved too (default adam)")
    C.add_timing_options(p, 0, 1, unit="round",
                         note="a round is a save, a load into a fresh store and a load "
                              "back; 100k keys take seconds")
    C.add_out_option(p, "checkpoint_<machine>.json")
    return p


def table_row(rec: dict) -> list:
    head = [rec["keys"], rec["optimizer"]]
    if "error" in rec:
        return head + ["-", "failed", "-", "-", "-", "-", "FAILED"]
    return head + [C.format_size(rec["file_bytes"]), C.format_seconds(rec["save_s"]),
                   C.format_seconds(rec["load_new_keys_s"]),
                   C.format_seconds(rec["load_existing_keys_s"]),
                   round(rec["save_s"] / rec["baseline_write_s"], 1),
                   round(rec["load_new_keys_s"] / rec["baseline_read_s"], 1),
                   "ok" if rec["ok"] else "MISMATCH"]


def main(argv=None) -> int:
    """Returns 1 when a case failed or a loaded store did not match the saved one."""
    args = build_parser().parse_args(argv)
    records = []
    with tempfile.TemporaryDirectory(prefix="gpukv-bench-ck-") as tmp:
        for n_keys in args.keys:
            try:
                rec = run_case(n_keys, args.shape, args.optimizer, args.warmup, args.iters,
                               Path(tmp))
            except Exception as exc:  # one broken case must not end the run
                rec = {"keys": n_keys, "shape": list(args.shape),
                       "optimizer": args.optimizer, "ok": False,
                       "error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"FAILED {n_keys} keys: {rec['error']}", file=sys.stderr)
            records.append(rec)
    C.print_table(["keys", "optimizer", "file", "save", "load (new)", "load (existing)",
                   "save/flat write", "load/flat read", "check"],
                  [table_row(r) for r in records])
    payload = {"benchmark": "checkpoint", "machine": C.machine_info(),
               "libraries": C.library_versions("numpy"), "results": records}
    C.save_results(payload, args.out, C.result_name("checkpoint"))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

"""gpucheck's bandwidth section: each kernel family against the device-to-device copy.

Every kernel gpukv runs streams memory, so its speed is the least bytes it must move (read
+ written, for float32 data of the given size) over its time, compared with a plain
device-to-device memcpy of the same size measured in the same run (read + written bytes
counted too), as nccl-tests compares bus bandwidth with the hardware's. Times are CUDA
events around back-to-back calls on the device's stream, the call as the store makes it
(its host work included, which shows at small sizes); the median of a few batches.
Goals (on a real GPU, at the largest size): sums at >= 80% of the copy, optimizers at
>= 70%.
"""
from __future__ import annotations

import numpy as np

from .budget import Deadline
from .section import Section
from .timing import seconds_per_call

MIB = 1 << 20
SIZES = (1 * MIB, 16 * MIB, 256 * MIB)
QUICK_SIZES = (256 << 10,)
SUM_GOAL, OPTIMIZER_GOAL = 0.80, 0.70


def size_text(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= MIB else f"{nbytes >> 10} KiB"


def iterations(nbytes: int, quick: bool) -> int:
    if quick:
        return 2
    return 50 if nbytes <= MIB else (20 if nbytes <= 16 * MIB else 8)


class Family:
    """One kernel family at one size: `call()` runs it once; `moved` bytes per call."""

    def __init__(self, family: str, label: str, moved: float, call):
        self.family, self.label, self.moved, self.call = family, label, moved, call


def families(device, n: int) -> list:
    """Every family on float32 data of n elements on `device` (arrays made here)."""
    from ...device.base import Term
    from ...device.codecs import (
        cast_bf16,
        cast_fp16,
        dequantize_1bit,
        dequantize_2bit,
        dequantize_sign,
        dequantize_ternary,
        quantize_1bit,
        quantize_2bit,
        quantize_sign,
        quantize_ternary,
        sign_nbytes,
        ternary_nbytes,
        uncast_bf16,
        uncast_fp16,
    )
    f32 = np.float32
    xp = device.xp

    def arr(fill=1.0, dtype=f32):
        with device.activate():
            a = xp.empty(n, dtype)
            a.fill(fill)
        return a

    e = 4 * n  # bytes of one float32 array
    src, dst = arr(), arr()
    terms = [arr(float(i + 1)) for i in range(4)]
    out = arr(0.0)
    half = arr(0.0, np.float16)
    residual = arr(0.0)
    p2 = arr(0, np.uint8)[: -(-n // 4)]
    p1 = arr(0, np.uint8)[: -(-n // 8)]
    ps = arr(0, np.uint8)[:sign_nbytes(n)]
    sign_bytes = sign_nbytes(n) / n  # payload bytes per value
    pt = arr(0, np.uint8)[:ternary_nbytes(n)]
    ternary_bytes = ternary_nbytes(n) / n
    with device.activate():
        h16 = cast_fp16(src, 1.0)
        b16 = cast_bf16(src, 1.0)
    out_list = [
        Family("copy", "device-to-device memcpy", 2 * e, lambda: device.copy(dst, src)),
        Family("sum", "sum of 2 terms", 3 * e,
               lambda: device.sum_into([(out, [Term(terms[0], True), Term(terms[1], True)])])),
        Family("sum", "sum of 4 terms", 5 * e,
               lambda: device.sum_into([(out, [Term(t, True) for t in terms])])),
        Family("tree sum", "canonical tree sum of 4 leaves", 5 * e,
               lambda: device.tree_sum_into([(out, terms)])),
        Family("copy", "cast float32 -> float16", 1.5 * e,
               lambda: device.copy_many([(half, src)])),
        Family("compression", "2bit encode", 3.0625 * e,
               lambda: quantize_2bit(src, residual, 0.5, out=p2)),
        Family("compression", "2bit decode", 1.0625 * e,
               lambda: dequantize_2bit(p2, n, 0.5, out)),
        Family("compression", "1bit encode", 3.03125 * e,
               lambda: quantize_1bit(src, residual, 0.0, out=p1)),
        Family("compression", "1bit decode", 1.03125 * e,
               lambda: dequantize_1bit(p1, n, out)),
        Family("compression", "sign encode", (3 + sign_bytes / 4) * e,
               lambda: quantize_sign(src, residual, out=ps)),
        Family("compression", "sign decode", (1 + sign_bytes / 4) * e,
               lambda: dequantize_sign(ps, n, out)),
        Family("compression", "ternary encode", (3 + ternary_bytes / 4) * e,
               lambda: quantize_ternary(src, residual, out=pt)),
        Family("compression", "ternary decode", (1 + ternary_bytes / 4) * e,
               lambda: dequantize_ternary(pt, n, out)),
        Family("compression", "fp16 encode", 1.5 * e, lambda: cast_fp16(src, 1.0)),
        Family("compression", "fp16 decode", 1.5 * e, lambda: uncast_fp16(h16, 1.0, out)),
        Family("compression", "bf16 encode", 1.5 * e, lambda: cast_bf16(src, 1.0)),
        Family("compression", "bf16 decode", 1.5 * e, lambda: uncast_bf16(b16, 1.0, out)),
    ]
    return out_list + _optimizer_families(device, n, arr)


def _optimizer_families(device, n: int, arr) -> list:
    from ...optim import registered
    from ...optim._updater import OptimizerUpdater
    found = []
    for cls in registered():
        opt = cls()
        states = len(opt.state_names())
        if getattr(opt, "per_key_norms", False):
            # two passes: w, g and the states in, states and the step out; then w and
            # the step in, w out
            moved = 4 * n * ((2 + states) + (states + 1) + 2 + 1)
        else:  # w, g and each state in; w and each state out
            moved = 4 * n * ((2 + states) + (1 + states))
        updater, weight, grad = OptimizerUpdater(opt), arr(1.0), arr(1e-3)

        def call(updater=updater, weight=weight, grad=grad):
            updater.update([0], [grad], [weight], [device])
        found.append(Family("optimizer", f"{opt.name} step", moved, call))
    return found


def run(deadline: Deadline, *, quick: bool, emulated: bool) -> Section:
    from ...device.cuda.device import cuda_device
    from ...device.cuda.probe import release_cached_memory
    section = Section("bandwidth")
    device = cuda_device(0)
    sizes = QUICK_SIZES if quick else SIZES
    rows: list = []
    copy_gbps: dict = {}
    for nbytes in sizes:
        if deadline.passed():
            section.cut = f"the budget ran out before {size_text(nbytes)}"
            break
        _keep(section, sizes, rows, copy_gbps)
        section.progress(running=f"making the {size_text(nbytes)} arrays")
        try:
            measured = families(device, nbytes // 4)
        except Exception as exc:  # e.g. out of memory: the sizes done so far stand
            section.fail(f"making the {size_text(nbytes)} arrays: {type(exc).__name__}: {exc}")
            break
        for fam in measured:
            # the rows so far, kept before each measure: one that hangs is named
            _keep(section, sizes, rows, copy_gbps)
            section.progress(running=f"{fam.label} at {size_text(nbytes)}")
            if deadline.passed():
                section.cut = f"the budget ran out during {size_text(nbytes)}"
                break
            row = {"family": fam.family, "kernel": fam.label, "bytes": nbytes}
            try:
                seconds = seconds_per_call(device, fam.call, iterations(nbytes, quick))
            except Exception as exc:
                section.fail(f"{fam.label} at {size_text(nbytes)}: {type(exc).__name__}: {exc}")
                row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                continue
            row.update(seconds=seconds, minimal_bytes=fam.moved,
                       GBps=fam.moved / seconds / 1e9)
            if fam.label == "device-to-device memcpy":
                copy_gbps[nbytes] = row["GBps"]
            row["copy_fraction"] = row["GBps"] / copy_gbps[nbytes] if nbytes in copy_gbps \
                else None
            rows.append(row)
        release_cached_memory()
    _keep(section, sizes, rows, copy_gbps)
    _goals(section, rows, max(sizes), judged=not emulated and not quick)
    largest = max(copy_gbps, default=None)  # the largest size measured
    kernels = [r for r in rows if r["bytes"] == largest and r.get("copy_fraction")
               and r["kernel"] != "device-to-device memcpy"]
    if largest is not None and kernels:
        worst = min(kernels, key=lambda r: r["copy_fraction"])
        best = max(kernels, key=lambda r: r["copy_fraction"])
        section.line = (f"copy {copy_gbps[largest]:.0f} GB/s at {size_text(largest)}; "
                        f"{len(kernels)} kernels at {worst['copy_fraction']:.0%} "
                        f"({worst['kernel']}) to {best['copy_fraction']:.0%} of it")
    return section


def _keep(section: Section, sizes, rows: list, copy_gbps: dict) -> None:
    """The section's data with the rows measured so far."""
    section.data.update(sizes=list(sizes), copy_GBps={str(k): v for k, v in copy_gbps.items()},
                        rows=rows, method="CUDA events around back-to-back calls on the "
                        "device's stream, median of 3 batches; bytes: the least each call "
                        "must read and write (a codec that runs several CuPy kernels "
                        "moves more)")
    section.line = f"{len(rows)} kernels measured"


def _goals(section: Section, rows: list, size: int, judged: bool) -> None:
    at = [r for r in rows if r["bytes"] == size and r.get("copy_fraction") is not None]
    for family, goal in (("sum", SUM_GOAL), ("tree sum", SUM_GOAL),
                         ("optimizer", OPTIMIZER_GOAL)):
        mine = [r for r in at if r["family"] == family]
        if not mine:
            continue
        worst = min(mine, key=lambda r: r["copy_fraction"])
        section.goal(f"{family} kernels at {size_text(size)}, slowest ({worst['kernel']}), "
                     "fraction of the copy", worst["copy_fraction"], goal, judged=judged)

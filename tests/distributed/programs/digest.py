"""The same gradients through any layout: `mpiexec -n P python -m mpi4py digest.py N`.

Eight gradients per key (magnitudes over six decades) are the leaves 0..7 of a
deterministic store's sum; each of the store's workers pushes N of them (worker w: leaves
w*N .. w*N + N - 1; N = 8 on one process), on the host or, with STORE=dist_device_sync,
on its GPUs. Worker 0 prints `DIGEST <what> <sha1>` for the summed values (no updater),
then for the values after three rounds of SGD with momentum. Run without MPI (plain
`python digest.py 8 local|device`) it uses a one-process store instead.

With DIGEST_WIDE=1 every value is pushed as float32, into float16 keys too.

With DIGEST_COMPRESS=1 the pushes are compressed (a one-process store: 'device'), in
phases of three rounds each (see `PHASES`): fp16 with a pre_divide, 2-bit, sign, ternary,
then PowerSGD (rank 4: 'big' is its one matrix), without an updater; then, with SGD,
2-bit again, fp16, sign, ternary and PowerSGD. Worker 0 prints `DIGEST <phase> <sha1>`
after each phase.
"""
from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

import gpukv

LEAVES = 8
#: name -> (dtype, shape): a key split over processes or servers (with the bound below),
#: small keys packed together, a 16-bit key summed in float32, and a float64 matrix (its
#: values read as float32 by every compressor, PowerSGD's matrices too)
KEYS = {"big": ("float32", (512, 512)), "small": ("float32", (1000,)),
        "tiny": ("float32", (3, 7)), "half": ("float16", (4096,)),
        "double": ("float64", (64, 48))}
BOUND = 100_000
#: (name, compression, whether SGD runs): three rounds each, in order; the compression is
#: set only when it changes (setting it starts fresh residuals)
FP16 = {"type": "fp16", "pre_divide": 3.0}
TWO_BIT = {"type": "2bit", "threshold": 0.5}
SIGN = {"type": "sign"}
TERNARY = {"type": "ternary"}
POWERSGD = {"type": "powersgd", "rank": 4}
PHASES = [("fp16_sum", FP16, False), ("twobit_sum", TWO_BIT, False),
          ("sign_sum", SIGN, False), ("ternary_sum", TERNARY, False),
          ("powersgd_sum", POWERSGD, False),
          ("twobit_sgd", TWO_BIT, True), ("fp16_sgd", FP16, True), ("sign_sgd", SIGN, True),
          ("ternary_sgd", TERNARY, True), ("powersgd_sgd", POWERSGD, True)]


def leaves(name: str, rounds: int = 1) -> list:
    """The 8 gradients of key `name` in round `rounds` - 1: normal values scaled by
    10**u, u uniform in [-3, 3]."""
    dtype, shape = KEYS[name]
    rng = np.random.default_rng([sorted(KEYS).index(name), rounds])
    out = []
    for _ in range(LEAVES):
        scale = 10.0 ** rng.uniform(-3, 3, size=shape)
        value = rng.standard_normal(shape) * scale
        if dtype == "float16":
            value = value / 1e3  # inside float16's range, sums included
        # DIGEST_WIDE=1: every value pushed as float32, which a push converts to the
        # key's dtype (float16 for 'half') before anything is summed
        wide = os.environ.get("DIGEST_WIDE") == "1"
        out.append(value.astype(np.float32 if wide else dtype))
    return out


def digest(arrays: list) -> str:
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:12]


def say(line: str) -> None:
    """Print `line` in one write: the lines of several ranks share one pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    per_worker = int(sys.argv[1])
    store = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("STORE", "dist_sync")
    # DIGEST_BOUND: another bigarray_bound ('small' split too, in pieces under 256 values)
    bound = int(os.environ.get("DIGEST_BOUND", BOUND))
    options = {"bigarray_bound": bound} if store.startswith("dist") else {}
    if len(sys.argv) > 3:
        options["strategy"] = sys.argv[3]
    # DIGEST_DEFAULT=1: the store's default order, to show that layouts differ there
    deterministic = os.environ.get("DIGEST_DEFAULT") != "1"
    kv = gpukv.create(store, deterministic=deterministic, **options)
    rank = getattr(kv, "rank", 0)
    names = sorted(KEYS)
    place = _placer(store)
    mine = slice(rank * per_worker, (rank + 1) * per_worker)
    kv.init(names, [np.zeros(KEYS[n][1], KEYS[n][0]) for n in names])
    if os.environ.get("DIGEST_COMPRESS") == "1":
        compressed(kv, names, place, mine)
        say(f"PASS worker {rank} of {kv.num_workers}")
        return
    kv.push(names, [[place(j, v) for j, v in enumerate(leaves(n)[mine])] for n in names])
    outs = [np.empty(KEYS[n][1], KEYS[n][0]) for n in names]
    kv.pull(names, out=outs)
    if rank == 0:
        say(f"DIGEST sum {digest(outs)}")
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.1, momentum=0.9))
    for r in range(2, 5):
        kv.push(names, [[place(j, v) for j, v in enumerate(leaves(n, r)[mine])]
                        for n in names])
    kv.pull(names, out=outs)
    if rank == 0:
        say(f"DIGEST sgd {digest(outs)}")
    say(f"PASS worker {rank} of {kv.num_workers}")


def compressed(kv, names: list, place, mine: slice) -> None:
    """The phases of `PHASES`, each three rounds of this worker's leaves, compressed."""
    rank = getattr(kv, "rank", 0)
    outs = [np.empty(KEYS[n][1], KEYS[n][0]) for n in names]
    current, optimized = None, False
    for phase, (what, compression, sgd) in enumerate(PHASES):
        if compression is not current:
            kv.set_gradient_compression(compression)
            current = compression
        if sgd and not optimized:
            kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.1, momentum=0.9))
            optimized = True
        for r in range(10 * phase, 10 * phase + 3):
            kv.push(names, [[place(j, v) for j, v in enumerate(leaves(n, r)[mine])]
                            for n in names])
        kv.pull(names, out=outs)
        if rank == 0:
            say(f"DIGEST {what} {digest(outs)}")


def _placer(store: str):
    """Value j of this process: a NumPy array, or on GPU j (mod the GPUs) of a device
    store when CuPy sees GPUs."""
    if store not in ("dist_device_sync", "device"):
        return lambda j, v: v
    try:
        import cupy
        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy or no GPU: host values
        return lambda j, v: v

    def place(j, v):
        with cupy.cuda.Device(j % gpus):
            return cupy.asarray(v)
    return place


if __name__ == "__main__":
    main()

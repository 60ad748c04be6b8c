"""Programs the tests of compression state in dist snapshots launch: `mpiexec -n N python
-m mpi4py compressed_snapshots.py NAME ROOT [ARGS]` (num_servers=0; GPUKV_DETERMINISTIC
picks the engine's sums). Each prints one `PASS worker R of W` line, and every INFO line
of logger 'gpukv' that says compression state was not restored as `LOG worker R: ...`."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

import numpy as np

import gpukv
from gpukv.checkpoints import snapshots

#: key -> (dtype, shape): with bigarray_bound=200, 'm' (a matrix PowerSGD compresses) and
#: 'v' are split over the processes; 'h' (float16) is whole
KEYS = {"m": ("float32", (24, 40)), "v": ("float32", (301,)), "h": ("float16", (33,))}
STEPS = 5
COMPRESSIONS = [{"type": "sign"}, {"type": "ternary"}, {"type": "2bit", "threshold": 0.5},
                {"type": "1bit", "threshold": 0.0}, {"type": "powersgd", "rank": 2}]


class _Said(logging.Handler):
    def __init__(self, rank: int):
        super().__init__(logging.INFO)
        self.rank = rank

    def emit(self, record) -> None:
        message = record.getMessage()
        if "not restored" in message:
            print(f"LOG worker {self.rank}: {message}", flush=True)


def _descend(key, merged, stored):
    stored -= (merged * 0.05).astype(stored.dtype)


def _store(compression, updater: str):
    """A dist store of KEYS made the usual way: init, the updater, the compression."""
    kv = gpukv.create("dist_sync", bigarray_bound=200)
    for key, (dtype, shape) in KEYS.items():
        kv.init(key, (np.arange(np.prod(shape)).reshape(shape) % 7).astype(dtype))
    if updater == "updater":
        kv.set_updater(_descend)
    elif updater == "optimizer":
        kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.05, momentum=0.9))
    kv.set_gradient_compression(compression)
    return kv


def _steps(kv, start: int, stop: int) -> str:
    """Push each worker's gradients of the steps [start, stop), pull after each: the
    digest of every value pulled."""
    digest = hashlib.sha256()
    for step in range(start, stop):
        rng = np.random.default_rng([kv.rank, step])
        kv.push(list(KEYS), [(rng.standard_normal(shape) * 3).astype(dtype)
                             for dtype, shape in KEYS.values()])
        outs = [np.zeros(shape, dtype) for dtype, shape in KEYS.values()]
        kv.pull(list(KEYS), out=outs)
        for out in outs:
            digest.update(out.tobytes())
    return digest.hexdigest()


def _stored(kv, root: str) -> str:
    """The digest of the values proper (what the owners update), through a snapshot."""
    kv.snapshot(root, STEPS)
    kv.finish_snapshots()
    saved = snapshots.read_store(gpukv.latest_snapshot(root))
    return hashlib.sha256(b"".join(v.tobytes() for v in saved.values)).hexdigest()


def same_bits(root: str, k: str) -> None:
    """For every compressor, with no updater, an updater and an optimizer: a store that
    resumes from the snapshot another took at step k pulls and stores the bits of the
    store that never stopped; one that sets the compression again after its resume
    (every residual afresh) pulls other bits."""
    k_ = int(k)
    rank = None
    for c, compression in enumerate(COMPRESSIONS):
        for updater in ("assign", "updater", "optimizer"):
            case = os.path.join(root, f"{c}-{updater}")
            kv = _store(compression, updater)
            rank = kv.rank
            _steps(kv, 0, k_)
            kv.snapshot(os.path.join(case, "at-k"), k_)
            want = _steps(kv, k_, STEPS)  # while the snapshot is written
            want_stored = _stored(kv, os.path.join(case, "end-a"))
            again = _store(compression, updater)
            assert again.resume(os.path.join(case, "at-k")).step == k_
            got = _steps(again, k_, STEPS)
            assert got == want, (compression, updater, "pulls differ")
            assert _stored(again, os.path.join(case, "end-b")) == want_stored, \
                (compression, updater, "stored values differ")
            fresh = _store(compression, updater)
            fresh.resume(os.path.join(case, "at-k"))
            fresh.set_gradient_compression(compression)
            assert _steps(fresh, k_, STEPS) != want, (compression, updater,
                                                      "the residuals made no difference")
    print(f"PASS worker {rank} of {kv.num_workers}", flush=True)


def save(root: str, compression: str) -> None:
    """Take a snapshot at step 2 with `compression` (JSON) and an updater."""
    kv = _store(json.loads(compression), "updater")
    _steps(kv, 0, 2)
    kv.snapshot(root, 2)
    kv.finish_snapshots()
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def resume(root: str, compression: str) -> None:
    """Resume from the snapshot under `root` with `compression` (JSON): what follows
    equals a store that set its compression afresh after the resume."""
    kv = _store(json.loads(compression), "updater")
    logging.getLogger("gpukv").addHandler(_Said(kv.rank))
    kv.resume(root)
    got = _steps(kv, 2, STEPS)
    logging.getLogger("gpukv").handlers.clear()
    fresh = _store(json.loads(compression), "updater")
    fresh.resume(root)
    fresh.set_gradient_compression(json.loads(compression))
    assert _steps(fresh, 2, STEPS) == got
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def resume_once(root: str, compression: str) -> None:
    """Resume from the snapshot under `root` with `compression` (JSON) and push on."""
    kv = _store(json.loads(compression), "updater")
    logging.getLogger("gpukv").addHandler(_Said(kv.rank))
    kv.resume(root)
    _steps(kv, 2, STEPS)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def one_store(root: str, compression: str, updater: str, how: str) -> None:
    """One store per job (dedicated servers serve one): `how` is 'through' (steps 0..2,
    a snapshot at 2 under ROOT/at-2, steps 2..STEPS), 'resumed' (a resume from it,
    then steps 2..STEPS) or 'fresh' (the resume, then the compression set again);
    prints the digest of the pulls after step 2 and of the values stored at the end."""
    kv = _store(json.loads(compression), updater)
    logging.getLogger("gpukv").addHandler(_Said(kv.rank))
    at = os.path.join(root, "at-2")
    if how == "through":
        _steps(kv, 0, 2)
        kv.snapshot(at, 2)
    else:
        assert kv.resume(at).step == 2
        if how == "fresh":
            kv.set_gradient_compression(json.loads(compression))
    pulls = _steps(kv, 2, STEPS)
    stored = _stored(kv, os.path.join(root, f"end-{how}"))
    print(f"DIGEST worker {kv.rank} {pulls} {stored}", flush=True)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


if __name__ == "__main__":
    logging.getLogger("gpukv").setLevel(logging.INFO)
    {"same_bits": same_bits, "save": save, "resume": resume,
     "resume_once": resume_once, "one_store": one_store}[sys.argv[1]](*sys.argv[2:])

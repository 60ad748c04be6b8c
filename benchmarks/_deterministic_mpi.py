"""One rank of a bench_deterministic.py MPI job: raw Allreduce, then a `dist_sync` store per
side (the default order, the deterministic one) timed round by round in turn.

    mpiexec -n N python _deterministic_mpi.py --plan '[[bytes, warmup, iters], ...]'
        --servers S --sides '[["default", {}], ["deterministic", {"deterministic": true}]]'
        --op push+pull --optimizer none --result FILE

With S = 0 every rank is a worker, and both sides' stores live in the same processes: round
i runs one round of each, who goes first alternating, so a busy spell of the machine hits
both. With S >= 1 the servers serve one store per job, so a job has one side (the driver
runs the sides back to back). Before any store is made every rank times `Allreduce` of the
same bytes (unless --no-allreduce): the limit of the MPI engine under the store, on the
same processes and hosts.
The first worker writes the timings to FILE; every round's first pull is checked.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402


def expected_pull(workers: int, optimizer: str) -> float:
    """What worker r pushing r + 1 pulls after the first round: the sum, or with SGD at
    learning rate 1 from a zero weight, minus the sum."""
    total = workers * (workers + 1) / 2
    return -total if optimizer == "sgd" else total


def time_allreduce(comm, plan: list) -> dict:
    """Seconds of `Allreduce` of every plan entry's bytes between the ranks of `comm`."""
    import numpy as np

    out = {}
    expected = comm.size * (comm.size + 1) / 2
    for nbytes, warmup, iters in plan:
        send = np.full(C.elements(nbytes, 4), comm.rank + 1, np.float32)
        recv = np.empty_like(send)
        comm.Allreduce(send, recv)
        ok = bool((recv == expected).all())
        comm.Barrier()
        samples = C.time_calls(lambda: comm.Allreduce(send, recv), warmup=warmup,
                               iters=iters)
        out[str(send.nbytes)] = {**C.summarize(samples), "samples_s": samples, "check": ok}
    return out


def make_round(kv, key: int, nbytes: int, op: str):
    """One sync round of `key` on `kv` (push + pull, or one pushpull) and its output."""
    import numpy as np

    value = np.full(C.elements(nbytes, 4), kv.rank + 1, np.float32)
    out = np.empty_like(value)
    kv.init(key, np.zeros_like(value))
    if op == "pushpull":
        def step():
            kv.pushpull(key, value, out)
    else:
        def step():
            kv.push(key, value)
            kv.pull(key, out=out)
    return step, out


def time_sides(stores: dict, plan: list, op: str, expected: float, barrier) -> dict:
    """Per plan entry, every side's rounds, interleaved: {bytes: {side: summary}}."""
    timings = {}
    names = list(stores)
    for key, (nbytes, warmup, iters) in enumerate(plan):
        # Each side's arrays are made twice, in both orders, and each set times half of
        # the rounds: memory made second can run slower than memory made first (on one
        # process, 15-20% for the same store), which one order would count as a cost.
        sets, ok = [], True
        for made in (names, names[::-1]):
            steps = {}
            for name in made:
                step, out = make_round(stores[name], 2 * key + len(sets), nbytes, op)
                step()
                ok = ok and bool((out == expected).all())
                steps[name] = step
            sets.append(steps)
        barrier()
        samples: dict = {name: [] for name in names}
        for i in range(warmup + iters):
            order = names if i % 2 == 0 else names[::-1]
            steps = sets[(i // 2) % 2]
            for name in order:
                t0 = time.perf_counter()
                steps[name]()
                if i >= warmup:
                    samples[name].append(time.perf_counter() - t0)
        label = str(C.elements(nbytes, 4) * 4)
        timings[label] = {"check": ok, "sides": {
            name: {**C.summarize(s), "samples_s": s} for name, s in samples.items()}}
    return timings


def run(args) -> dict | None:
    import gpukv  # first: gpukv's own MPI settings apply before mpi4py starts MPI
    from gpukv.distributed.mpi.transport import mpi

    MPI = mpi()
    world = MPI.COMM_WORLD
    servers, plan = args.servers, json.loads(args.plan)
    sides = json.loads(args.sides)
    if servers and len(sides) != 1:
        raise ValueError("with servers a job times one side: they serve one store")
    allreduce = time_allreduce(world, plan) if args.allreduce else {}
    world.Barrier()
    stores = {}
    for name, options in sides:  # servers never return from create
        stores[name] = gpukv.create("dist_sync", num_servers=servers, **options)
        if args.optimizer == "sgd":
            stores[name].set_optimizer(gpukv.optim.SGD(learning_rate=1.0))
    first = next(iter(stores.values()))
    expected = expected_pull(first.num_workers, args.optimizer)
    timings = time_sides(stores, plan, args.op, expected, first.barrier)
    first.barrier()
    if first.rank != 0:
        return None
    for label, entry in timings.items():
        if label in allreduce:
            entry["allreduce"] = allreduce[label]
            entry["check"] = entry["check"] and allreduce[label].pop("check")
    return {"timings": timings,
            "meta": {"versions": C.library_versions("gpukv", "numpy", "mpi4py"),
                     "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
                     "workers": first.num_workers, "servers": servers,
                     "sides": dict(sides)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--servers", type=int, default=0)
    p.add_argument("--sides", required=True)
    p.add_argument("--op", default="push+pull", choices=["push+pull", "pushpull"])
    p.add_argument("--optimizer", default="none", choices=["none", "sgd"])
    p.add_argument("--result", required=True)
    p.add_argument("--no-allreduce", dest="allreduce", action="store_false",
                   help="leave the Allreduce out (another job of the case times it)")
    args = p.parse_args(argv)
    try:
        result = run(args)
        if result is not None:
            Path(args.result).write_text(json.dumps(result))
    except Exception:  # not SystemExit: a gpukv server ends its process that way
        # One rank failing leaves the others waiting in MPI: end the whole job now.
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

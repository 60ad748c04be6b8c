"""The MXNet 1.9.1 side of bench_dist.py: one role of a `dist_sync` (ps-lite) job.

Run under the MXNet interpreter (mxnet 1.9.1 with numpy 1.23), one process per role,
each with DMLC_ROLE=scheduler|server|worker, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT,
DMLC_NUM_SERVER and DMLC_NUM_WORKER set; bench_dist.py starts them all:

    DMLC_ROLE=worker ... mxenv/bin/python benchmarks/_mxnet_dist.py \
        --plan '[[4096, 3, 100]]' --op push+pull --result /tmp/mx.json

For the scheduler and the servers `import mxnet` is the whole job: MXNet serves and
exits inside the import. Each worker inits the keys of every entry of the plan
([[bytes, warmup, iters], ...], `bytes` one key's size or a list of sizes pushed and pulled
together), checks the first pull, waits at a barrier, then times every push+pull (or
pushpull) one by one, each ending in `wait_to_read()` on the outs so the asynchronous
engine's work is counted. Worker 0 writes the timings as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import _common  # benchmarks/ is on sys.path: it is this script's directory

ENV_VARS = ("DMLC_NUM_SERVER", "DMLC_NUM_WORKER", "DMLC_PS_ROOT_URI", "DMLC_NODE_HOST",
            "MXNET_KVSTORE_BIGARRAY_BOUND", "MXNET_CPU_WORKER_NTHREADS", "MXNET_ENGINE_TYPE",
            "OMP_NUM_THREADS")


def make_step(kv, keys: list, values: list, outs: list, op: str):
    """One iteration over the keys (one key as itself, several as lists in one call)."""
    key, value, out = (keys[0], values[0], outs[0]) if len(keys) == 1 else (keys, values, outs)
    if op == "pushpull":
        def step():
            kv.pushpull(key, value, out=out)
            for o in outs:
                o.wait_to_read()
    else:
        def step():
            kv.push(key, value)
            kv.pull(key, out=out)
            for o in outs:
                o.wait_to_read()
    return step


def run_worker(mx, plan: list, op: str, optimizer: str, result: str) -> None:
    import numpy as np

    kv = mx.kv.create("dist_sync")
    barrier = getattr(kv, "barrier", None) or kv._barrier
    workers = kv.num_workers
    expected = workers * (workers + 1) / 2
    if optimizer == "sgd":  # run by the servers: w = 0 - 1 * sum after the first round
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0, rescale_grad=1.0))
        expected = -expected
    timings = {}
    first_key = 0
    for nbytes, warmup, iters in plan:
        sizes = [n // 4 for n in _common.entry_sizes(nbytes)]
        keys = list(range(first_key, first_key + len(sizes)))
        first_key += len(sizes)
        kv.init(keys, [mx.nd.zeros((n,)) for n in sizes])
        values = [mx.nd.array(np.full(n, kv.rank + 1, np.float32)) for n in sizes]
        outs = [mx.nd.empty((n,)) for n in sizes]
        step = make_step(kv, keys, values, outs, op)
        step()
        # Only the first round is checked: without an optimizer MXNet 1.9.1's server
        # keeps adding to the stored value, so later pulls grow (and reach inf); with SGD
        # the value moves on every round.
        firsts = [o.asnumpy() for o in outs]
        ok = all(bool((f == expected).all()) for f in firsts)
        barrier()
        samples = _common.time_calls(step, warmup=warmup, iters=iters)
        timings[_common.entry_label(nbytes)] = {
            **_common.summarize(samples), "check": ok, "first_pull": float(firsts[0][0]),
            "expected": expected}
    barrier()
    if kv.rank == 0:
        meta = {"versions": _common.library_versions("mxnet", "numpy"),
                "env": {k: os.environ.get(k) for k in ENV_VARS},
                "workers": workers, "op": op, "optimizer": optimizer}
        with open(result, "w") as f:
            json.dump({"timings": timings, "meta": meta}, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, help="JSON [[bytes, warmup, iters], ...]")
    p.add_argument("--op", default="push+pull", choices=["push+pull", "pushpull"])
    p.add_argument("--optimizer", default="none", choices=["none", "sgd"])
    p.add_argument("--result", required=True, help="JSON file worker 0 writes")
    args = p.parse_args()
    import mxnet as mx  # the scheduler and servers run their whole job in here, then exit

    if os.environ.get("DMLC_ROLE") == "worker":
        run_worker(mx, json.loads(args.plan), args.op, args.optimizer, args.result)


if __name__ == "__main__":
    sys.exit(main())

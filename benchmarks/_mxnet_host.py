"""The MXNet 1.9.1 side of bench_host.py: times `mx.kv.create('local')`, answers in JSON.

Run under the MXNet interpreter (mxnet 1.9.1 with numpy 1.23), not under gpukv's:

    mxenv/bin/python benchmarks/_mxnet_host.py

It prints one JSON line (versions, engine settings), then serves requests, one JSON line
each on stdin: {"case": {"name", "keys", "elems", "devices"}, "warmup", "iters",
"min_time"}, elems being float32 elements per key; it answers each with one JSON line of
timings (see _common.summarize). A case's store and arrays are built on its first request
and reused, so bench_host.py can alternate the two libraries case by case. Every timed
step is push + pull followed by `mx.nd.waitall()`, so all the work MXNet's asynchronous
engine queued is counted.
"""
from __future__ import annotations

import json
import os
import sys

import _common  # benchmarks/ is on sys.path: it is this script's directory

ENGINE_VARS = ("MXNET_ENGINE_TYPE", "MXNET_CPU_WORKER_NTHREADS", "MXNET_KVSTORE_REDUCTION_NTHREADS",
               "MXNET_KVSTORE_BIGARRAY_BOUND", "OMP_NUM_THREADS")


def make_step(mx, case: dict):
    """The push+pull step of one case and the arrays it uses (kept alive by the closure)."""
    kv = mx.kv.create("local")
    ctxs = [mx.cpu(i) for i in range(case["devices"])]
    shape = (case["elems"],)
    keys = list(range(case["keys"]))
    for k in keys:
        kv.init(k, mx.nd.zeros(shape, ctx=mx.cpu(0)))
    values = [[mx.nd.ones(shape, ctx=c) * (i + 1) for i, c in enumerate(ctxs)] for _ in keys]
    outs = [[mx.nd.empty(shape, ctx=c) for c in ctxs] for _ in keys]
    mx.nd.waitall()
    if case["keys"] == 1:
        key, vals, out = keys[0], values[0], outs[0]
    else:
        key, vals, out = keys, values, outs

    def step():
        kv.push(key, vals)
        kv.pull(key, out=out)
        mx.nd.waitall()

    step()
    expected = sum(range(1, case["devices"] + 1))
    got = out[0] if case["keys"] == 1 else out[-1][0]
    if float(got[0].asscalar()) != expected:  # the baseline must do the real work
        raise RuntimeError(f"MXNet {case['name']}: pulled {got[0].asscalar()}, "
                           f"expected {expected}")
    return step


def main() -> None:
    import mxnet as mx

    print(json.dumps({
        "versions": _common.library_versions("mxnet", "numpy"),
        "engine_env": {k: os.environ.get(k) for k in ENGINE_VARS},
    }), flush=True)
    steps = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        case = request["case"]
        step = steps.get(case["name"])
        if step is None:
            step = steps[case["name"]] = make_step(mx, case)
        batch = _common.batch_for(min(_common.time_calls(step, warmup=1, iters=3)))
        samples = _common.time_calls(step, warmup=request["warmup"], iters=request["iters"],
                                     min_time=request["min_time"], batch=batch)
        print(json.dumps(_common.summarize(samples)), flush=True)


if __name__ == "__main__":
    main()

"""gpukv.jax against JAX's own collectives, on JAX's host devices (or GPUs where JAX has them).

    python benchmarks/bench_jax.py                  # 4 devices, 200 leaves, digits MLP
    python benchmarks/bench_jax.py --devices 2 --leaves 50 --steps 20 --out -

Two cases, each timed in one run (the ways taking turns, call by call) against a jitted
`shard_map` with `psum` or `pmean`:
- leaves: a tree of `--leaves` small float32 leaves (64 to 4096 values) on every device:
  `pushpull_tree` with one key per leaf (`bucket_bytes=0`), with the default buckets, and
  `mean_tree`, against a jitted `psum` of the same tree; and a memory copy of all the
  devices' bytes, the floor of any sum on the host;
- mlp: a training step of the digits MLP 64-512-512-10 (batch 64 per device, Adam): grads
  on each device, `mean_tree` and optax's Adam on each device, against one jitted step of
  `shard_map` with `pmean` and the same optax Adam (and whether their weights stay the same
  bits), and with gpukv's Adam on the store (MXNet's formula) for reference.
Without a GPU the devices are host devices (XLA_FLAGS=--xla_force_host_platform_device_count,
set here). The JSON goes to --out DIR (default benchmarks/results/, jax_<machine>.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=C.positive_int, default=4,
                   help="JAX devices the values are on (host devices without a GPU; "
                        "default 4)")
    p.add_argument("--leaves", type=C.positive_int, default=200,
                   help="small float32 leaves in the 'leaves' case's tree (default 200)")
    p.add_argument("--steps", type=C.positive_int, default=50, help="timed calls per way")
    C.add_out_option(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                                   f"platform_device_count={args.devices}").strip()
    import jax
    import numpy as np

    devices = jax.devices()[:args.devices]
    if len(devices) < args.devices:
        print(f"JAX has {len(devices)} device(s), not {args.devices}", file=sys.stderr)
        return 2
    rows, record = [], {"devices": [str(d) for d in devices], "steps": args.steps,
                        "machine": C.machine_info(), "versions": C.library_versions(
                            "jax", "jaxlib", "numpy")}
    record["leaves"] = leaves_case(jax, np, devices, args, rows)
    record["mlp"] = mlp_case(jax, np, devices, args, rows)
    C.print_table(["case", "way", "median ms", "x JAX"], rows)
    C.save_results(record, args.out, C.result_name("jax"))
    return 0


def leaves_case(jax, np, devices, args, rows) -> dict:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import gpukv
    import gpukv.jax as gjax
    rng = np.random.default_rng(0)
    sizes = rng.integers(64, 4097, args.leaves)
    trees = [{f"leaf{i:03d}": jax.device_put(rng.standard_normal(n).astype(np.float32), d)
              for i, n in enumerate(sizes)} for d in devices]
    mesh = Mesh(np.array(devices), ("i",))
    stacked = jax.device_put(jax.tree_util.tree_map(lambda *x: np.stack(x), *trees),
                             NamedSharding(mesh, P("i")))
    psum = jax.jit(jax.shard_map(lambda t: jax.tree_util.tree_map(
        lambda x: jax.lax.psum(x, "i"), t), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    ways = {"jax psum": lambda: jax.block_until_ready(psum(stacked))}
    for name, bucket_bytes in (("gpukv, a key per leaf", 0),
                               ("gpukv, buckets", gjax.BUCKET_BYTES)):
        kv = gpukv.create("device")
        gjax.init_tree(kv, trees[0], bucket_bytes=bucket_bytes)
        ways[name] = lambda kv=kv: jax.block_until_ready(gjax.pushpull_tree(kv, trees))
    kv = gpukv.create("device")
    gjax.init_tree(kv, trees[0])
    ways["gpukv mean_tree"] = lambda: jax.block_until_ready(gjax.mean_tree(kv, trees))
    nbytes = int(sizes.sum()) * 4 * len(devices)
    source, target = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    ways["copy of every device's bytes"] = lambda: np.copyto(target, source)
    return _timed("leaves", ways, args.steps, rows, {"leaves": args.leaves, "bytes": nbytes})


def mlp_case(jax, np, devices, args, rows) -> dict:
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from sklearn.datasets import load_digits

    import gpukv
    import gpukv.jax as gjax
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    n = len(devices)
    xs = x[:64 * n].reshape(n, 64, 64)
    ys = np.eye(10, dtype=np.float32)[y[:64 * n]].reshape(n, 64, 10)
    rng = np.random.default_rng(0)
    dims = [(64, 512), (512, 512), (512, 10)]
    params = {f"w{i}": jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32)
              for i, s in enumerate(dims)}
    params.update({f"b{i}": jnp.zeros(s[1]) for i, s in enumerate(dims)})
    opt = optax.adam(1e-3)

    def loss(p, xb, yb):
        h = jax.nn.relu(xb @ p["w0"] + p["b0"])
        h = jax.nn.relu(h @ p["w1"] + p["b1"])
        return jnp.mean(jnp.sum((h @ p["w2"] + p["b2"] - yb) ** 2, -1))
    mesh = Mesh(np.array(devices), ("i",))

    @jax.jit
    def jax_step(p, s, xb, yb):
        g = jax.shard_map(lambda p, xb, yb: jax.tree_util.tree_map(
            lambda v: jax.lax.pmean(v, "i"), jax.grad(loss)(p, xb[0], yb[0])), mesh=mesh,
            in_specs=(P(), P("i"), P("i")), out_specs=P(), check_vma=False)(p, xb, yb)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s
    on_mesh = [jax.device_put(a, NamedSharding(mesh, P("i"))) for a in (xs, ys)]
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    theirs = {"p": replicated, "s": opt.init(replicated)}

    def jax_way():
        theirs["p"], theirs["s"] = jax.block_until_ready(
            jax_step(theirs["p"], theirs["s"], *on_mesh))
    grad = jax.jit(jax.grad(loss))

    @jax.jit
    def update(p, s, g):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s
    shards = [(jax.device_put(xs[r], d), jax.device_put(ys[r], d))
              for r, d in enumerate(devices)]
    sums = gpukv.create("device")
    gjax.init_tree(sums, params)
    mine = {"p": [jax.device_put(params, d) for d in devices]}
    mine["s"] = [opt.init(p) for p in mine["p"]]

    def gpukv_optax_way():
        grads = [grad(p, *shard) for p, shard in zip(mine["p"], shards)]
        stepped = [update(p, s, g) for p, s, g in
                   zip(mine["p"], mine["s"], gjax.mean_tree(sums, grads))]
        mine["p"] = jax.block_until_ready([p for p, _ in stepped])
        mine["s"] = [s for _, s in stepped]
    kv = gpukv.create("device")
    gjax.init_tree(kv, params)
    kv.set_optimizer(gpukv.optim.create("adam", learning_rate=1e-3, rescale_grad=1 / n))
    on_store = {"p": [jax.device_put(params, d) for d in devices]}

    def gpukv_store_way():
        grads = [grad(p, *shard) for p, shard in zip(on_store["p"], shards)]
        gjax.push_tree(kv, grads)
        on_store["p"] = jax.block_until_ready(gjax.pull_tree(kv, params, devices=devices))
    ways = {"jax shard_map pmean + optax adam": jax_way,
            "gpukv mean_tree + optax adam": gpukv_optax_way,
            "gpukv adam on the store": gpukv_store_way}
    record = _timed("mlp", ways, args.steps, rows, {"batch_per_device": 64})
    # The same 10 steps from the start: gpukv + optax against pmean's gradients and the
    # same jitted update (the same bits expected), and against the step jitted whole
    # (where XLA fuses the update with the gradients, which may round otherwise).
    pmean = jax.jit(jax.shard_map(lambda p, xb, yb: jax.tree_util.tree_map(
        lambda v: jax.lax.pmean(v, "i"), jax.grad(loss)(p, xb[0], yb[0])), mesh=mesh,
        in_specs=(P(), P("i"), P("i")), out_specs=P(), check_vma=False))
    mine["p"] = [jax.device_put(params, d) for d in devices]
    mine["s"] = [opt.init(p) for p in mine["p"]]
    theirs["p"], theirs["s"] = replicated, opt.init(replicated)
    split = {"p": replicated, "s": opt.init(replicated)}
    for _ in range(10):
        gpukv_optax_way()
        jax_way()
        split["p"], split["s"] = update(split["p"], split["s"], pmean(split["p"], *on_mesh))
    record["optax_10_steps_largest_difference"] = {
        "against pmean then the same update": _apart(jax, np, mine["p"], split["p"]),
        "against the step jitted whole": _apart(jax, np, mine["p"], theirs["p"])}
    print("mlp, weights after 10 steps, largest difference of gpukv + optax:",
          record["optax_10_steps_largest_difference"])
    return record


def _apart(jax, np, replicas: list, reference) -> float:
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for tree in replicas
               for a, b in zip(jax.tree_util.tree_leaves(tree),
                               jax.tree_util.tree_leaves(reference)))


def _timed(case: str, ways: dict, steps: int, rows: list, extra: dict) -> dict:
    """Median ms per call of every way, the ways taking turns call by call (so that a
    change in the machine's load falls on all of them alike)."""
    for fn in ways.values():
        for _ in range(3):
            fn()
    samples: dict = {name: [] for name in ways}
    for _ in range(steps):
        for name, fn in ways.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    times = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    base = next(iter(times.values()))
    for name, ms in times.items():
        rows.append([case, name, round(ms, 3), round(ms / base, 2)])
    return {**extra, "median_ms": times}


if __name__ == "__main__":
    sys.exit(main())

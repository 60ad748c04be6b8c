"""Engines across processes fed node partials of the canonical tree (`engine.Partials`):
`mpiexec -n N python -m mpi4py canonical.py SERVERS SCENARIO`.

The values are 8 float32 leaves of 256 Ki elements (a fixed seed, magnitudes over six
decades), each worker holding 8 / workers of them in rank order; keys are slices of them
(split, summed alone, packed, float16), and keys of 3 values per worker from 3 * workers
more leaves (several node partials per worker). Scenarios:

- `canonical`: deterministic engines, without an updater, with one that assigns the sum,
  and with SGD (learning rate 1: the new value is minus the sum); every key's value on
  every worker is the pure NumPy tree sum of its leaves (`gpukv.canonical.tree.leaves_sum`),
  rounded once into the key's dtype. Prints `PASS worker R of W`.
- `default`: the engines as they are by default, each worker pushing the sum of its own
  leaves; prints `DIGESTS worker R of W: key=ok|differs ...` against that tree sum.
- `counts`: worker 1 pushes one value less of a key than the others; prints `CAUGHT
  <error> on worker R: <message>`.
"""
from __future__ import annotations

import hashlib
import sys

import numpy as np

import gpukv
from gpukv.canonical.tree import leaves_sum, rank_nodes
from gpukv.distributed import Partials, Transport
from gpukv.distributed.engines import exchange
from gpukv.distributed.engines.client import ServerClient
from gpukv.distributed.engines.server import serve
from gpukv.distributed.engines.sharded import ShardedRounds
from gpukv.distributed.parts import Shard

LEAVES, ELEMENTS, BOUND, TIMEOUT = 8, 256 * 1024, 100_000, 30.0
#: key -> (elements, dtype, values each worker pushes: "even" 8 / workers, or 3)
KEYS = {
    "big": (ELEMENTS, np.float32, "even"),       # split
    "alone": (30_000, np.float32, "even"),       # one allreduce of its own by default
    "s1": (1000, np.float32, "even"),            # small keys, packed
    "s2": (3001, np.float32, "even"),
    "h_big": (200_001, np.float16, "even"),      # 16-bit keys, summed in float32
    "h_small": (777, np.float16, "even"),
    "odd_big": (120_001, np.float32, 3),         # several node partials per worker
    "odd_small": (500, np.float16, 3),
}


def leaves(n: int, seed: int) -> list:
    """`n` float32 leaves of ELEMENTS elements, magnitudes from 1e-3 to 1e3."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(ELEMENTS) * 10.0 ** rng.uniform(-3, 3, ELEMENTS))
            .astype(np.float32) for _ in range(n)]


def count_of(spec, workers: int) -> int:
    return LEAVES // workers if spec[2] == "even" else spec[2]


def values_of(key: str, workers: int, data: dict) -> list:
    """Every leaf of `key` (the first `count * workers` of its set, sliced to the key)."""
    n, _, per = KEYS[key]
    count = count_of(KEYS[key], workers)
    offset = sum(map(ord, key)) % (ELEMENTS - n + 1)  # each key a different slice
    pool = data[per]
    return [leaf[offset:offset + n] for leaf in pool[:count * workers]]


def partials(key: str, rank: int, workers: int, data: dict, count: int | None = None):
    """This worker's Partials of `key`: the tree sum of each of its nodes."""
    values = values_of(key, workers, data)
    count = count or count_of(KEYS[key], workers)
    rows = [leaves_sum(values[lo:hi], np.add) for lo, hi in rank_nodes(rank, count, workers)]
    return Partials(np.ascontiguousarray(np.stack(rows)), count)


def expected(key: str, workers: int, data: dict, negate: bool) -> np.ndarray:
    total = leaves_sum(values_of(key, workers, data), np.add)
    return (-total if negate else total).astype(KEYS[key][1])


def own_sum(key: str, rank: int, workers: int, data: dict) -> np.ndarray:
    """What a default engine gets: the sum of this worker's own leaves, in its dtype."""
    count = count_of(KEYS[key], workers)
    values = values_of(key, workers, data)[rank * count:(rank + 1) * count]
    return leaves_sum(values, np.add).astype(KEYS[key][1])


def digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:12]


def assign(key, merged, stored):
    stored[...] = merged


def engine_for(world, servers: int, deterministic: bool):
    """A fresh engine on a communicator of its own (None on a server, after serving)."""
    comm = world.Dup()
    t = Transport(comm, TIMEOUT, comm.Get_size())
    if t.rank < servers:
        serve(t, servers, Shard(), asynchronous=False)
        return None
    if servers:
        return ServerClient(t, servers, BOUND, deterministic=deterministic)
    return ShardedRounds(t, Shard(), BOUND, deterministic=deterministic)


def run_round(engine, mode: str, grads: dict) -> dict:
    """One push of every key (after `mode`'s updater), then the values on this worker."""
    keys = list(KEYS)
    replicas = [np.zeros(KEYS[k][0], KEYS[k][1]) for k in keys]
    engine.init(keys, replicas)
    if mode == "assign":
        engine.set_updater(assign)
    elif mode == "sgd":
        engine.set_optimizer(gpukv.optim.create("sgd", learning_rate=1.0))
    engine.push(keys, [grads[k] for k in keys], replicas)
    engine.pull(keys, replicas)
    engine.control.barrier()
    return dict(zip(keys, replicas))


def finish(engine) -> None:
    if isinstance(engine, ServerClient):
        engine.stop()


def canonical(world, servers: int) -> None:
    workers = world.Get_size() - servers
    data = {"even": leaves(LEAVES, 7)}
    data[3] = leaves(3 * workers, 8)
    for mode in ("sum", "assign", "sgd"):
        engine = engine_for(world, servers, deterministic=True)
        if engine is None:
            continue
        rank = engine.control.rank
        grads = {k: partials(k, rank, workers, data) for k in KEYS}
        got = run_round(engine, mode, grads)
        for key, value in got.items():
            want = expected(key, workers, data, negate=mode == "sgd")
            assert digest(value) == digest(want), (mode, key, digest(value), digest(want))
        finish(engine)
        if mode == "sgd":
            print(f"PASS worker {rank} of {workers}", flush=True)


def default(world, servers: int) -> None:
    workers = world.Get_size() - servers
    data = {"even": leaves(LEAVES, 7)}
    data[3] = leaves(3 * workers, 8)
    engine = engine_for(world, servers, deterministic=False)
    if engine is None:
        return
    rank = engine.control.rank
    got = run_round(engine, "sum", {k: own_sum(k, rank, workers, data) for k in KEYS})
    same = {k: digest(v) == digest(expected(k, workers, data, False)) for k, v in got.items()}
    told = " ".join(f"{k}={'ok' if ok else 'differs'}" for k, ok in same.items())
    finish(engine)
    print(f"DIGESTS worker {rank} of {workers}: {told}", flush=True)


def counts(world, servers: int) -> None:
    workers = world.Get_size() - servers
    data = {"even": leaves(LEAVES, 7), 3: leaves(3 * workers, 8)}
    engine = engine_for(world, servers, deterministic=True)
    if engine is None:
        return
    rank = engine.control.rank
    key = "odd_small"
    replica = np.zeros(KEYS[key][0], KEYS[key][1])
    engine.init([key], [replica])
    try:
        engine.push([key], [partials(key, rank, workers, data, 2 if rank == 1 else 3)],
                    [replica])
        engine.pull([key], [replica])
    except gpukv.PeerError as exc:
        print(f"CAUGHT {type(exc).__name__} on worker {rank}: {exc}", flush=True)
        return  # the engine is broken: the job aborts at exit
    raise AssertionError("a push of another count went through")


def main(servers: str, scenario: str) -> None:
    from mpi4py import MPI
    exchange.CHUNK_BYTES = 64 << 10  # several chunks per piece
    {"canonical": canonical, "default": default, "counts": counts}[scenario](
        MPI.COMM_WORLD, int(servers))


if __name__ == "__main__":
    main(*sys.argv[1:])

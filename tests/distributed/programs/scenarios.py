"""Programs the MPI tests launch: `mpiexec -n N python -m mpi4py scenarios.py NAME [ARGS]`.

Each scenario runs on every rank, checks what it must with asserts (an AssertionError
aborts the job under `python -m mpi4py`, so the test sees a non-zero exit and the
traceback), and prints one `PASS worker R ...` line per worker on success. Failure
scenarios print `CAUGHT <error type>: <message>` on every rank that got the error.
Options: the environment variables GPUKV_NUM_SERVERS and GPUKV_DIST_TIMEOUT, and
STORE (default dist_sync).
"""
from __future__ import annotations

import copy
import os
import signal
import sys
import threading
import time

import numpy as np

import gpukv

STORE = os.environ.get("STORE", "dist_sync")


def create(**options):
    return gpukv.create(STORE, **options)


def passed(kv, *details) -> None:
    print(f"PASS worker {kv.rank} of {kv.num_workers}", *details,
          "(NCCL)" if getattr(kv, "nccl", False) else "", flush=True)


def caught(kv_rank, exc) -> None:
    print(f"CAUGHT {type(exc).__name__} on worker {kv_rank}: {exc}", flush=True)


def pull_again(kv, key, out) -> None:
    """After a failure: pull `key` once more and print the PeerError it raises (AGAIN
    ..., with how long it took)."""
    start = time.monotonic()
    try:
        kv.pull(key, out=out)
    except gpukv.PeerError as exc:
        print(f"AGAIN {type(exc).__name__} on worker {kv.rank} after "
              f"{time.monotonic() - start:.1f} s", flush=True)


# ------------------------------------------------------------------- MXNet's tests
def sync_sgd(dtype: str = "float32", rounds: str = "3") -> None:
    """MXNet's dist_sync test: keys initialised to ones, each worker pushes ones*(rank+1)
    every round; with SGD(lr) the value after round i is 1 - lr*n(n+1)/2*(i+1). A small
    int key, a small str-free key list and a big key split over every server."""
    kv = create(bigarray_bound=1000)
    lr, n, r = 0.05, kv.num_workers, kv.rank
    # 5, 7 and 9 have >= bigarray_bound elements: split over every server (9 in pieces
    # of unequal length with 2, 3 or 4 servers)
    shapes = {3: (2, 3), 5: (30, 40), 7: (1200,), 9: (1001,)}
    dt = np.dtype(dtype)
    kv.init(list(shapes), [np.ones(s, dt) for s in shapes.values()])
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=lr))
    for i in range(int(rounds)):
        grads = [np.ones(s, dt) * (r + 1) for s in shapes.values()]
        kept = [g.copy() for g in grads]
        kv.push(list(shapes), grads)
        for g, k in zip(grads, kept):  # the pushed arrays are never overwritten
            assert np.array_equal(g, k), "push changed the caller's gradient"
        outs = [np.zeros(s, dt) for s in shapes.values()]
        kv.pull(list(shapes), out=outs)
        expect = 1 - lr * n * (n + 1) / 2 * (i + 1)
        tol = 1e-2 if dt == np.float16 else 1e-5
        for key, out in zip(shapes, outs):
            assert np.allclose(out, expect, atol=tol), (key, i, out.reshape(-1)[:4], expect)
    kv.barrier()
    passed(kv, f"value {float(outs[0].reshape(-1)[0]):.4f}")


def sync_assign() -> None:
    """Without an updater a round assigns the sum of every worker's push (MXNet)."""
    kv = create(bigarray_bound=1000)
    n, r = kv.num_workers, kv.rank
    kv.init(["w", "big"], [np.zeros((4, 5), np.float32), np.zeros(2000, np.float64)])
    for i in range(2):
        kv.push("w", [np.full((4, 5), r + 1.0, np.float32)] * 2)  # two devices
        kv.push("big", np.full(2000, (r + 1.0) * (i + 1)))
        out = np.zeros((4, 5), np.float32)
        big = np.zeros(2000)
        kv.pull(["w", "big"], out=[out, big])
        assert np.all(out == n * (n + 1)), out
        assert np.all(big == n * (n + 1) / 2 * (i + 1)), big[:3]
    passed(kv)


def async_sgd(rounds: str = "4") -> None:
    """dist_async: every push is applied as it comes; after every worker pushed `rounds`
    times (and a barrier), the SGD value is 1 - lr * rounds * n(n+1)/2, whatever the
    order the server saw them in."""
    kv = create(bigarray_bound=1000)
    lr, n, r = 0.01, kv.num_workers, kv.rank
    kv.init(["a", "b"], [np.ones(6, np.float32), np.ones(1500, np.float32)])
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=lr))
    for _ in range(int(rounds)):
        kv.push(["a", "b"], [np.full(6, r + 1.0, np.float32), np.full(1500, r + 1.0,
                                                                      np.float32)])
    kv.barrier()
    outs = [np.zeros(6, np.float32), np.zeros(1500, np.float32)]
    kv.pull(["a", "b"], out=outs)
    expect = 1 - lr * int(rounds) * n * (n + 1) / 2
    for out in outs:
        assert np.allclose(out, expect, atol=1e-5), (out[:3], expect)
    passed(kv)


def async_needs_optimizer() -> None:
    """dist_async applies each push with the store's optimizer: a push before
    set_optimizer is an ArgumentError naming the key (nothing is sent); after it, the
    pushes are applied."""
    kv = create()
    r, n = kv.rank, kv.num_workers
    kv.init("w", np.zeros(8, np.float32))
    try:
        kv.push("w", np.full(8, r + 1.0, np.float32))
    except gpukv.ArgumentError as exc:
        caught(r, exc)
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=1.0))
    kv.push("w", np.full(8, r + 1.0, np.float32))
    kv.barrier()
    out = np.zeros(8, np.float32)
    kv.pull("w", out=out)
    assert np.all(out == -n * (n + 1) / 2), out
    passed(kv)


# ------------------------------------------------------------------ the other calls
def calls() -> None:
    """pushpull (into the value and into outs), broadcast, string keys made in another
    order on each worker, row_sparse_pull, keys(), len, in, rank and num_workers."""
    kv = create(bigarray_bound=1000)
    n, r = kv.num_workers, kv.rank
    names = ["emb", "w", "b"] if r % 2 else ["b", "w", "emb"]
    shapes = {"emb": (50, 30), "w": (3, 4), "b": (4,)}
    for name in names:
        kv.init(name, np.full(shapes[name], float(r + 10), np.float32))  # rank 0's wins
    assert sorted(kv.keys()) == ["b", "emb", "w"] and len(kv) == 3 and "w" in kv
    out = np.zeros((3, 4), np.float32)
    kv.pull("w", out=out)
    assert np.all(out == 10), out
    value = np.full((3, 4), r + 1.0, np.float32)
    kv.pushpull("w", value)  # no updater: the sum over workers, written back into value
    assert np.all(value == n * (n + 1) / 2), value
    outs = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    kv.pushpull("b", np.ones(4, np.float32), out=outs)
    assert all(np.all(o == n) for o in outs), outs
    bc = np.zeros(5, np.float64)
    kv.broadcast("c", np.full(5, float(r + 7)), out=bc)
    assert np.all(bc == 7), bc  # rank 0's value
    grad = np.zeros((50, 30), np.float32)
    grad[r] = 1.0
    kv.push("emb", grad)
    rows = gpukv.RowSparse(np.array([0, 1]), np.zeros((2, 30), np.float32), shape=(50, 30))
    kv.row_sparse_pull("emb", out=rows, row_ids=np.array([1, 0]))
    dense = np.zeros((50, 30), np.float32)
    kv.pull("emb", out=dense)
    assert np.all(dense[:n] == 1) and np.all(dense[n:] == 0), dense[:, 0]
    assert np.array_equal(rows.data, dense[:2]), rows.data[:, 0]
    passed(kv)


def device_sync() -> None:
    """dist_device_sync with CuPy arrays on several GPUs of each process: summed on the
    GPUs, then across processes; pulls land on every GPU."""
    import cupy
    kv = create(bigarray_bound=1000)
    lr, n, r = 0.1, kv.num_workers, kv.rank
    gpus = cupy.cuda.runtime.getDeviceCount()

    def on(i, array):
        with cupy.cuda.Device(i % gpus):
            return cupy.asarray(array)
    kv.init(["w", "h"], [on(0, np.ones((40, 30), np.float32)), on(1, np.ones(6, np.float16))])
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=lr))
    for i in range(2):
        kv.push(["w", "h"], [[on(d, np.full((40, 30), (r + 1) / 2, np.float32)) for d in (0, 1)],
                             [on(d, np.full(6, (r + 1) / 2, np.float16)) for d in (2, 3)]])
        outs = [[on(d, np.zeros((40, 30), np.float32)) for d in range(gpus)],
                [on(d, np.zeros(6, np.float16)) for d in range(gpus)]]
        kv.pull(["w", "h"], out=outs)
        expect = 1 - lr * n * (n + 1) / 2 * (i + 1)
        for o in outs[0] + outs[1]:
            assert isinstance(o, cupy.ndarray)
            assert np.allclose(cupy.asnumpy(o), expect, atol=1e-2), (cupy.asnumpy(o), expect)
    passed(kv, f"on {gpus} GPUs")


def host_arrays_said_once() -> None:
    """dist_device_sync given host arrays only: its INFO notice that keys are reduced on
    the host comes once per worker, naming the store the user made (the one-process
    stores it keeps its values and sums in say nothing of their own)."""
    import logging
    logging.basicConfig(level=logging.INFO, format="NOTICE %(message)s", stream=sys.stdout)
    kv = create()
    kv.init(["w", "v"], [np.zeros(4, np.float32), np.zeros(3, np.float32)])
    for _ in range(2):
        kv.pushpull(["w", "v"], [np.ones(4, np.float32), np.ones(3, np.float32)],
                    out=[np.zeros(4, np.float32), np.zeros(3, np.float32)])
    passed(kv)


def _descend(key, merged, stored):
    """An updater for keys of any dtype (servers run it: defined at module level)."""
    stored -= (np.float32(0.1) * merged).astype(stored.dtype)


def compression(kind: str = "2bit") -> None:
    """Compression on the wire gives what a one-process 'device' store with the same
    compression gives for the same sources (each worker one source, with its residual),
    without an updater, with one, then with SGD with momentum (with sign, a value that
    settles to what workers hold); a pull after a pull gives the same bits (with sign,
    the first of a round moved the worker's copy on by the round's payload). Odd workers
    list the keys of a push in reverse; with servers, in the last round, even workers
    push the matrices in one call and the others one call each."""
    kv = create(bigarray_bound=1000)
    n, r = kv.num_workers, kv.rank
    params = {"type": kind, "threshold": 0.5} if kind in ("2bit", "1bit") else {"type": kind}
    kv.set_gradient_compression(params)
    reference = gpukv.create("device")
    reference.set_gradient_compression(params)
    # 'b' and 'm' split; 'i' int: not compressed; 'm' and 'n' matrices PowerSGD compresses
    shapes = {"a": (3, 4), "b": (1500,), "i": (5,), "m": (64, 48), "n": (48, 40)}
    dtypes = {"a": np.float32, "b": np.float32, "i": np.int32, "m": np.float32,
              "n": np.float32}
    # PowerSGD's sums are allreduces here, in source order there: rounding apart
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if kind == "powersgd" else {"atol": 1e-5}
    for key, shape in shapes.items():
        kv.init(key, np.zeros(shape, dtypes[key]))
        reference.init(key, np.zeros(shape, dtypes[key]))
    rng = np.random.default_rng(0)  # the same draws on every worker
    for round_ in range(8):
        if round_ == 3:  # then with an updater on the store
            for store in (kv, reference):
                store.set_updater(_descend)
        if round_ == 6:  # then with an optimizer that settles compressed pulls
            for store in (kv, reference):
                store.set_optimizer(gpukv.optim.SGD(learning_rate=0.1, momentum=0.9))
        grads = {k: [(rng.standard_normal(s) * 2).astype(dtypes[k]) for _ in range(n)]
                 for k, s in shapes.items()}
        live = [k for k in shapes if round_ < 6 or k != "i"]  # (SGD takes no ints)
        order = live if r % 2 == 0 else list(reversed(live))
        calls = [order]
        if round_ == 5 and kv.num_servers and r % 2 == 0:  # (pushes are not collective)
            matrices = [k for k in order if k in ("m", "n")]  # (PowerSGD's are)
            calls = [matrices] + [[k] for k in order if k not in matrices]
        for keys in calls:
            kv.push(keys, [grads[k][r] for k in keys])
        reference.push(live, [grads[k] for k in live])
        for key, shape in shapes.items():
            got, want = np.zeros(shape, dtypes[key]), np.zeros(shape, dtypes[key])
            kv.pull(key, out=got)  # after a pull each round: sign's one payload
            reference.pull(key, out=want)
            assert np.allclose(got, want, **tolerance), (key, got.reshape(-1)[:4],
                                                         want.reshape(-1)[:4])
            again = np.zeros(shape, dtypes[key])
            kv.pull(key, out=again)  # nothing pushed since: the served value whole
            assert again.tobytes() == got.tobytes(), key
    assert kv.gradient_compression == reference.gradient_compression
    passed(kv)


# ------------------------------------------------------------------------ checkpoints
def save(path: str, optimizer: str = "adam") -> None:
    """Train two rounds, save the store and the optimizer state (every worker calls;
    worker 0 writes), train one more round and print the value it gave."""
    kv = create(bigarray_bound=1000)
    r = kv.rank
    _keys(kv)
    kv.set_optimizer(gpukv.optim.create(optimizer, learning_rate=0.1))
    for i in range(2):
        kv.push(["a", "b"], _grads(r, i))
    kv.save(path + ".store")
    kv.save_optimizer_states(path + ".states", dump_optimizer=True)
    kv.push(["a", "b"], _grads(r, 2))
    print(f"VALUE worker {r} {_checksum(kv)!r}", flush=True)
    passed(kv)


def load(path: str, optimizer: str = "adam") -> None:
    """Load what `save` wrote (maybe saved with other process and server counts), redo
    its last round, and print the value: the same as `save` printed."""
    kv = create(bigarray_bound=1000)
    r = kv.rank
    _keys(kv, fill=5.0)  # other values: the file's must replace them
    kv.set_optimizer(gpukv.optim.create(optimizer, learning_rate=0.1))
    kv.load(path + ".store")
    kv.load_optimizer_states(path + ".states")
    kv.push(["a", "b"], _grads(r, 2, workers=int(os.environ.get("SAVED_WORKERS", "0"))))
    print(f"VALUE worker {r} {_checksum(kv)!r}", flush=True)
    passed(kv)


def load_bad(path: str) -> None:
    """A file whose key has another shape: CheckpointError on every worker, and the
    store is unchanged (and still usable)."""
    kv = create(bigarray_bound=1000)
    kv.init("a", np.ones((7, 7), np.float32))
    try:
        kv.load(path + ".store")
    except gpukv.CheckpointError as exc:
        caught(kv.rank, exc)
    out = np.zeros((7, 7), np.float32)
    kv.push("a", np.ones((7, 7), np.float32))
    kv.pull("a", out=out)
    assert np.all(out == kv.num_workers), out
    passed(kv)


def load_states_of_another_optimizer(path: str) -> None:
    """An optimizer-state file of Adam loaded into SGD: a CheckpointError naming the file
    on every worker, and the store still usable."""
    kv = create()
    kv.init("a", np.ones(8, np.float32))
    kv.set_optimizer(gpukv.optim.Adam(learning_rate=0.1))
    kv.push("a", np.ones(8, np.float32))
    kv.save_optimizer_states(path + ".adam")
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.1))
    try:
        kv.load_optimizer_states(path + ".adam")
    except gpukv.CheckpointError as exc:
        caught(kv.rank, exc)
    kv.push("a", np.ones(8, np.float32))
    passed(kv)


def _keys(kv, fill: float = 1.0) -> None:
    kv.init(["a", "b"], [np.full((2, 3), fill, np.float32), np.full((1100,), fill, np.float32)])


def _grads(rank: int, step: int, workers: int = 0) -> list:
    """Worker `rank`'s gradients at `step`; with `workers`, the sum a worker pushes alone
    to stand for that many workers (a store saved by several, loaded by one)."""
    ranks = range(workers) if workers else [rank]
    a = sum(np.arange(6, dtype=np.float32).reshape(2, 3) * (w + 1 + step) for w in ranks)
    b = sum(np.linspace(-1, 1, 1100, dtype=np.float32) * (w + 2 + step) for w in ranks)
    return [a, b]


def _checksum(kv) -> list:
    a, b = np.zeros((2, 3), np.float32), np.zeros(1100, np.float32)
    kv.pull(["a", "b"], out=[a, b])
    return [round(float(x), 5) for x in (a.sum(), b.sum(), b[7])]


# ----------------------------------------------------------------------------- failures
def stall(victim: str = "1", made_before: str = "", rounds_first: str = "0") -> None:
    """Worker `victim` stops answering (sleeps past the timeout): every other worker gets
    a PeerError naming it, in bounded time. With `made_before`, every worker first makes
    a key of that name (agreed on at the next collective call, a push). With
    `rounds_first`, every worker first pushes and pulls that many times (past three, the
    others wait in a round whose sum carries its agreement)."""
    kv = create()
    kv.init("w", np.ones(4, np.float32))
    for _ in range(int(rounds_first)):
        kv.push("w", np.ones(4, np.float32))
        kv.pull("w", out=np.zeros(4, np.float32))
    if made_before:
        kv.init(made_before, np.ones(3, np.float32))
    if kv.rank == int(victim):
        time.sleep(float(os.environ["GPUKV_DIST_TIMEOUT"]) * 4)
    try:
        for _ in range(3):
            kv.push("w", np.ones(4, np.float32))
            kv.pull("w", out=np.zeros(4, np.float32))
    except gpukv.PeerError as exc:
        caught(kv.rank, exc)
        return
    passed(kv)


def stall_at_create(victim: str = "1") -> None:
    """Process `victim` is slow to find its GPU at create (it sleeps past the timeout):
    every other process gets a PeerError from create naming it, in bounded time."""
    from gpukv.distributed import store
    rank = int(os.environ.get("PMI_RANK", "0"))
    if rank == int(victim):
        found = store._nccl_gpu

        def slow(*args):
            time.sleep(float(os.environ["GPUKV_DIST_TIMEOUT"]) * 4)
            return found(*args)
        store._nccl_gpu = slow
    try:
        create()
    except gpukv.PeerError as exc:
        caught(rank, exc)


def _worker_grad(worker: int, size: int, dtype) -> np.ndarray:
    """Worker `worker`'s gradient: values of many magnitudes, whose float sum depends on
    the order it is taken in."""
    rng = np.random.default_rng(worker)
    scale = 10.0 ** rng.integers(-3, 4, size)
    return (rng.standard_normal(size) * scale).astype(dtype)


def chunked_sums(rounds: str = "2") -> None:
    """Keys that cross in many chunks, of sizes no chunk divides, split over the servers or
    whole, float32 and float16: after each round every worker pulls the bits of the sum
    taken in worker order, though the pushes arrive in reverse worker order."""
    from gpukv.distributed.mpi.chunks import CHUNK_BYTES
    kv = create(bigarray_bound=1000)
    n, r = kv.num_workers, kv.rank
    step = CHUNK_BYTES // 4
    keys = {"split": (3 * step + 7, "float32"), "whole": (2 * step - 1, "float32"),
            "one": (1, "float32"), "half": (5 * step + 3, "float16")}
    kv.init(list(keys), [np.zeros(size, dt) for size, dt in keys.values()])
    for i in range(int(rounds)):
        time.sleep(0.05 * (n - 1 - r))  # the last worker's push comes first
        kv.push(list(keys), [_worker_grad(r + i, size, dt) for size, dt in keys.values()])
        outs = [np.empty(size, dt) for size, dt in keys.values()]
        kv.pull(list(keys), out=outs)
        for (key, (size, dt)), out in zip(keys.items(), outs):
            acc = np.zeros(size, np.float32)
            for w in range(n):  # in worker order, wide for float16 as the store sums
                acc += _worker_grad(w + i, size, dt).astype(np.float32)
            want = acc.astype(dt)
            assert out.tobytes() == want.tobytes(), (key, i, np.abs(out - want).max())
    passed(kv)


def stop_mid_push(victim: str = "1") -> None:
    """Worker `victim` is stopped (SIGSTOP) while its push of a key of many chunks is on
    the wire, and resumed after four timeouts: every other worker gets a PeerError
    naming it within the timeout's bound."""
    kv = create(bigarray_bound=1000)
    size = 16 << 20  # 64 MiB of float32: many chunks to every server
    kv.init("w", np.zeros(size, np.float32))
    grad = np.ones(size, np.float32)
    if kv.rank == int(victim):
        timeout = float(os.environ["GPUKV_DIST_TIMEOUT"])
        import subprocess
        subprocess.Popen(["sh", "-c", f"sleep {timeout * 4}; kill -CONT {os.getpid()}"])
        threading.Timer(0.003, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    start = time.monotonic()
    try:
        for _ in range(3):
            kv.push("w", grad)
            kv.pull("w", out=np.empty(size, np.float32))
    except gpukv.PeerError as exc:
        caught(kv.rank, exc)
        print(f"WAITED {time.monotonic() - start:.1f} on worker {kv.rank}", flush=True)
        return
    passed(kv)


def kill(victim: str = "1", at: str = "1") -> None:
    """Worker `victim` dies (SIGKILL) in the middle of training, at step `at`."""
    kv = create()
    kv.init("w", np.ones(4, np.float32))
    for step in range(int(at) + 2):
        if step == int(at) and kv.rank == int(victim):
            os.kill(os.getpid(), signal.SIGKILL)
        kv.push("w", np.ones(4, np.float32))
        kv.pull("w", out=np.zeros(4, np.float32))
    passed(kv)


def fused_rounds() -> None:
    """Small sums whose agreement travels inside them (`gpukv.distributed.mpi.fused`):
    loops of pushpulls of one key, of another, of two keys packed together, and the two
    in turn, with a barrier and a key made by every worker between them. Every sum is
    right, and most of the loops' rounds were one allreduce each (counted). Then worker 0
    makes a key alone before a round the others foretold: a PeerMismatchError naming
    both calls on every worker."""
    from gpukv.distributed.mpi import agree
    fused_sums = [0]
    fused = agree.Agreement._fused

    def counted(self, *args):
        taken = fused(self, *args)
        fused_sums[0] += taken is not None
        return taken
    agree.Agreement._fused = counted
    kv = create()
    sizes = {"a": 5, "b": 300, "c": 3, "d": 7, "e": 2}
    kv.init(["a", "b", "c", "d"], [np.zeros(sizes[k], np.float32) for k in "abcd"])
    workers = kv.num_workers
    total = workers * (workers + 1) // 2  # of every worker's rank + 1
    step = 0

    def round_of(keys: str) -> None:
        nonlocal step
        step += 1
        grads = [np.full(sizes[k], (kv.rank + 1) * step, np.float32) for k in keys]
        outs = [np.zeros(sizes[k], np.float32) for k in keys]
        kv.pushpull(list(keys), grads, out=outs)
        for key, out in zip(keys, outs):
            assert np.all(out == total * step), (key, step, out)

    for keys in ["a"] * 6 + ["b"] * 6 + ["cd"] * 6 + ["a", "cd"] * 4:
        round_of(keys)
    kv.barrier()
    kv.init("e", np.zeros(2, np.float32))
    for keys in ["a", "e", "a", "a", "e", "a", "a", "a"]:
        round_of(keys)
    # the forecast's rule: the last three rounds of each loop of six, and the last four
    # of the eight in turn
    assert fused_sums[0] == 13, fused_sums
    for _ in range(4):
        round_of("a")
    try:
        if kv.rank == 0:
            kv.init("z", np.zeros(3, np.float32))
        round_of("a")
    except gpukv.PeerMismatchError as exc:
        caught(kv.rank, exc)
        return
    passed(kv)


def shape_mismatch() -> None:
    """Workers that init one key with different shapes: every worker gets a
    PeerMismatchError naming the key (at its next call that talks to the others, here
    a barrier)."""
    kv = create()
    try:
        kv.init("w", np.ones(4 + kv.rank, np.float32))
        kv.barrier()
    except gpukv.PeerMismatchError as exc:
        caught(kv.rank, exc)
        return
    passed(kv)


def key_mismatch() -> None:
    """Workers that push different keys in one round (num_servers=0), of other sizes: a
    PeerMismatchError naming both calls on every worker, instead of mixed data (the
    round's allreduce starts beside its agreement, and is never waited on when the
    agreement fails), and the next call a PeerError at once. Rounds that agreed on both
    keys come first (the agreements keep the checksums of the calls they met)."""
    kv = create()
    kv.init(["a", "b"], [np.ones(4, np.float32), np.ones(7, np.float32)])
    for _ in range(3):
        kv.push("a", np.ones(4, np.float32))
        kv.push("b", np.ones(7, np.float32))
    try:
        kv.push("a" if kv.rank == 0 else "b", np.ones(4 if kv.rank == 0 else 7, np.float32))
    except gpukv.PeerMismatchError as exc:
        caught(kv.rank, exc)
        pull_again(kv, "a", np.zeros(4, np.float32))
        return
    passed(kv)


def optimizer_mismatch() -> None:
    """Workers that set optimizers with other options: PeerMismatchError everywhere."""
    kv = create()
    kv.init("w", np.ones(4, np.float32))
    try:
        kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.1 * (kv.rank + 1)))
    except gpukv.PeerMismatchError as exc:
        caught(kv.rank, exc)
        return
    passed(kv)


def shared_optimizer() -> None:
    """An optimizer object runs on one store of a process: a 'local' store (and with
    num_servers=0 a second dist store, refused alike by every worker) given the dist
    store's is an ArgumentError and keeps no optimizer; a copy runs there, counting
    apart. Then worker 1 alone gives the dist store an optimizer another store runs:
    its ArgumentError and, at once, a PeerMismatchError on the others (REFUSED ...
    after S prints how long each took); the optimizer stays the store's."""
    from gpukv.optim import claims
    kv = create()
    r = kv.rank
    kv.init("w", np.ones(4, np.float32))
    opt = gpukv.optim.create("adam", learning_rate=0.1)
    kv.set_optimizer(opt)
    kv.set_optimizer(opt)  # (the same store again)
    others = [gpukv.create("local")] + ([create()] if kv.num_servers == 0 else [])
    for other in others:
        other.init("w", np.ones(4, np.float32))
        try:
            other.set_optimizer(opt)
            raise AssertionError(f"{other.type}: an optimizer another store runs was taken")
        except gpukv.ArgumentError as exc:
            assert "runs this optimizer object already" in str(exc), exc
        assert not other.has_updater, other.type
        other.set_optimizer(copy.deepcopy(opt))
    for store in [kv, *others]:
        store.push("w", np.ones(4, np.float32))
    local_one = others[0].optimizer
    assert dict(opt.update_counts) == {"w": 1}, dict(opt.update_counts)
    assert dict(local_one.update_counts) == {"w": 1}, dict(local_one.update_counts)
    fresh = gpukv.optim.create("adam", learning_rate=0.1)
    start = time.monotonic()
    try:
        kv.set_optimizer(local_one if r == 1 else fresh)
        raise AssertionError("an optimizer worker 1 alone refused went through")
    except (gpukv.PeerMismatchError, gpukv.ArgumentError) as exc:
        assert isinstance(exc, gpukv.PeerMismatchError) == (r != 1), exc
        print(f"REFUSED on worker {r} after {time.monotonic() - start:.2f} s", flush=True)
        caught(r, exc)
    assert claims.holder(opt) is kv and claims.holder(fresh) is None
    assert claims.holder(local_one) is others[0]
    passed(kv)


def options_differ_at_push() -> None:
    """Workers whose optimizer's rescale_grad differs at a push (a batch size given on one
    worker only): PeerMismatchError everywhere, saying each worker's options."""
    kv = create()
    kv.init("w", np.ones(4, np.float32))
    sgd = gpukv.optim.create("sgd", learning_rate=0.1)
    kv.set_optimizer(sgd)
    sgd.rescale_grad = 0.125 if kv.rank == 0 else 1.0
    try:
        kv.push("w", np.ones(4, np.float32))
    except gpukv.PeerMismatchError as exc:
        caught(kv.rank, exc)
        return
    passed(kv)


def compression_mismatch() -> None:
    """Workers that set other compressions: PeerMismatchError everywhere, at the call."""
    kv = create()
    kv.init("w", np.ones(4, np.float32))
    try:
        kv.set_gradient_compression({"type": "sign" if kv.rank == 0 else "ternary"})
    except gpukv.PeerMismatchError as exc:
        caught(kv.rank, exc)
        return
    passed(kv)


def changing_options() -> None:
    """Options changed on the optimizer while training count, as in one process: a new
    learning rate, rescale_grad and a per-key multiplier (changed on every worker)."""
    kv = create()
    n, r = kv.num_workers, kv.rank
    s = n * (n + 1) / 2  # the sum of the workers' pushes
    kv.init(["a", "b"], [np.ones(3), np.ones(3)])
    sgd = gpukv.optim.create("sgd", learning_rate=0.1)
    kv.set_optimizer(sgd)
    expect = {"a": 1.0, "b": 1.0}
    for lr, rescale, mult_b in [(0.1, 1.0, 1.0), (0.01, 1.0, 1.0), (0.01, 0.5, 1.0),
                                (0.01, 0.5, 3.0)]:
        sgd.set_learning_rate(lr)
        sgd.rescale_grad = rescale
        sgd.set_lr_mult({"b": mult_b})
        kv.push(["a", "b"], [np.full(3, r + 1.0), np.full(3, r + 1.0)])
        expect["a"] -= lr * rescale * s
        expect["b"] -= lr * mult_b * rescale * s
        for key in "ab":
            out = np.zeros(3)
            kv.pull(key, out=out)
            assert np.allclose(out, expect[key]), (key, lr, rescale, out, expect[key])
    sgd.momentum = 0.9  # the shards' states were made without: refused on every worker
    try:
        kv.push(["a", "b"], [np.full(3, r + 1.0), np.full(3, r + 1.0)])
        raise AssertionError("momentum turned on after the first push was taken")
    except gpukv.ArgumentError as exc:
        assert "key 'a': optimizer 'sgd' now keeps the states ['mom']" in str(exc), exc
    sgd.momentum = 0.0
    kv.push(["a", "b"], [np.full(3, r + 1.0), np.full(3, r + 1.0)])
    out = np.zeros(3)
    kv.pull("a", out=out)
    assert np.allclose(out, expect["a"] - 0.01 * 0.5 * s), out
    passed(kv)


def unequal_pushes(path: str, kinds: str = "int") -> None:
    """Keys pushed unequally under a learning-rate schedule take the rates one process
    gives them, whichever process or server serves each (`kinds`: the key kinds tried,
    each on a store of its own)."""
    for kind in kinds.split(","):
        kv = _unequal_pushes(f"{path}.{kind}", kind)
    passed(kv)


def _unequal_pushes(path: str, kind: str):
    """One key pushed at every step, one at two steps only, beside a 'local' store given
    the same sums: the same bits and update counts after every step; a save mid-way
    loaded back (here, and by a 'local' store) redoes the last steps to the same bits;
    and update_counts='restart' starts every count over, as one process's load does."""
    kv = create()
    r = kv.rank
    # served by different processes (crc32), made in this order: one process counts 'w'
    # before 'b', and 0 before 4
    every, lagging = (0, 4) if kind == "int" else ("w", "b")
    keys = [every, lagging]
    rng = np.random.default_rng(0)
    start = [rng.standard_normal(5).astype(np.float32) for _ in keys]
    grads = [[rng.standard_normal(5).astype(np.float32) for _ in keys] for _ in range(6)]

    def sgd(schedule=None):  # the rate halves at every update
        return gpukv.optim.SGD(momentum=0.5, lr_scheduler=schedule or gpukv.optim.FactorScheduler(
            step=1, factor=0.5, base_lr=0.1))

    def step(store, i, alone=False):
        pushed = keys if i in (0, 4) else [every]
        # rank 0 pushes the gradients, the others zeros: every layout's sums are exact
        store.push(pushed, [grads[i][keys.index(k)] * (1.0 if alone or r == 0 else 0.0)
                            for k in pushed])

    def same(store, reference, optimizer, reference_optimizer, what):
        got, want = ([np.zeros(5, np.float32) for _ in keys] for _ in range(2))
        store.pull(keys, out=got)
        reference.pull(keys, out=want)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), (kind, what, got, want)
        if optimizer is not None:
            assert (dict(optimizer.update_counts), optimizer.num_update) == (
                dict(reference_optimizer.update_counts), reference_optimizer.num_update), (
                kind, what, dict(optimizer.update_counts), optimizer.num_update)
        return want

    one = gpukv.create("local")
    one.init(keys, [s.copy() for s in start])
    one_sgd = sgd()
    one.set_optimizer(one_sgd)
    kv.init(keys, [s.copy() for s in start])
    mine = sgd()
    kv.set_optimizer(mine)
    for i in range(6):
        step(kv, i)
        step(one, i, alone=True)
        same(kv, one, mine, one_sgd, f"step {i}")
        if i == 2:
            kv.save(path + ".store")
            kv.save_optimizer_states(path + ".states", dump_optimizer=True)
    kv.load(path + ".store")
    kv.load_optimizer_states(path + ".states")
    for i in range(3, 6):
        step(kv, i)
    same(kv, one, mine, one_sgd, "resumed")
    if r == 0:  # the files a dist store wrote resume one process alike
        again = gpukv.create("local")
        again.set_optimizer(sgd())
        again.load(path + ".store")
        again.load_optimizer_states(path + ".states")
        for i in range(3, 6):
            step(again, i, alone=True)
        same(again, one, None, None, "resumed in one process")
    # fine-tuning from the saved states under a schedule of one's own, from its start
    cosine = gpukv.optim.CosineScheduler(max_update=4, base_lr=0.2)
    mine, one_sgd = sgd(cosine), sgd(copy.deepcopy(cosine))
    kv.set_optimizer(mine)
    one.set_optimizer(one_sgd)
    kv.load_optimizer_states(path + ".states", update_counts="restart")
    one.load_optimizer_states(path + ".states", update_counts="restart")
    assert mine.num_update == 0 and not any(mine.update_counts.values()), kind
    for i in (4, 5):
        step(kv, i)
        step(one, i, alone=True)
        same(kv, one, mine, one_sgd, f"restarted, step {i}")
    assert dict(mine.update_counts) == {every: 2, lagging: 1}, dict(mine.update_counts)
    try:  # refused alike by every worker, changing nothing
        kv.load_optimizer_states(path + ".states", update_counts="reset")
        raise AssertionError("update_counts='reset' was taken")
    except gpukv.ArgumentError as exc:
        assert "update_counts='reset'" in str(exc), exc
    step(kv, 4)
    step(one, 4, alone=True)
    same(kv, one, mine, one_sgd, "after a refused load")
    return kv


def refusals() -> None:
    """A push (or a broadcast) every worker refuses alike (a wrong shape) changes nothing
    and the store goes on; with num_servers=0, one refused by worker 1 alone is its own
    ShapeError there and a PeerMismatchError naming the refusal on every other worker,
    never a later push summed with the others' refused one."""
    kv = create()
    r = kv.rank
    kv.init(1, np.zeros(3, np.float32))
    try:
        kv.pushpull(1, np.ones(4, np.float32))
        raise AssertionError("a wrong shape on every worker was taken")
    except gpukv.ShapeError as exc:
        assert "key 1" in str(exc), exc
    try:  # refused alike, each worker's error in words of its own (its shape)
        kv.push(1, np.ones(4 + r, np.float32))
        raise AssertionError("a wrong shape on every worker was taken")
    except gpukv.ShapeError as exc:
        assert f"got ({4 + r},)" in str(exc), exc
    kv.push(1, np.full(3, r + 1.0, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull(1, out=out)
    assert np.all(out == kv.num_workers * (kv.num_workers + 1) / 2), out
    try:  # an out of another shape: checked before the key is made
        kv.broadcast(6, np.ones(3, np.float32), out=np.zeros(4, np.float32))
        raise AssertionError("a broadcast into a wrong out was taken")
    except gpukv.ShapeError:
        assert 6 not in kv
    kv.broadcast(6, np.full(3, 7.0, np.float32), out=out)
    assert np.all(out == 7.0), out
    if kv.num_servers:  # (pushes to servers are no collective: docs/limits.md)
        passed(kv)
        return
    try:
        kv.push(1, np.ones(4 if r == 1 else 3, np.float32))
        raise AssertionError("a push refused by worker 1 alone went through")
    except (gpukv.PeerMismatchError, gpukv.ShapeError) as exc:  # (worker 1: its own)
        assert isinstance(exc, gpukv.ShapeError) == (r == 1), exc
        caught(r, exc)
    passed(kv)


def refused_on_one(call: str) -> None:
    """Calls every worker refuses alike change nothing and the store goes on: an init of
    a key made already, a broadcast into a read-only out, pulls into an out of another
    shape (with a key made just before, whose agreement they make, and without); a pull
    worker 1 alone refuses is its own error there and the others' pulls go on. Then
    worker 1 alone refuses `call` (init, broadcast, or a pull right after an init) where
    the others make it: init and broadcast are its own error there and a
    PeerMismatchError naming the refusal on the others (at their next collective call
    for an init: a push here), well within the timeout; the pull is its own error, and
    the store goes on (its next keys agreed on as the others', not with key 7's, whose
    agreement the refused pull made). REFUSED ... after S prints how long each took."""
    kv = create()
    r, n = kv.rank, kv.num_workers
    total = n * (n + 1) / 2
    read_only = np.zeros(3, np.float32)
    read_only.flags.writeable = False
    kv.init(1, np.full(3, 5.0 + r, np.float32))
    for alike, error in [(lambda: kv.pull(1, out=np.zeros(4, np.float32)), gpukv.ShapeError),
                         (lambda: kv.init(1, np.zeros(3, np.float32)), gpukv.DuplicateKeyError),
                         (lambda: kv.broadcast(2, np.ones(3, np.float32), out=read_only),
                          gpukv.ReadOnlyError),
                         (lambda: kv.pull(1, out=np.zeros(4, np.float32)), gpukv.ShapeError)]:
        try:
            alike()
            raise AssertionError("a call refused on every worker went through")
        except error:
            pass
    assert 2 not in kv and kv.keys() == [1], kv.keys()
    out = np.zeros(3, np.float32)
    kv.pull(1, out=out)
    assert np.all(out == 5.0), out  # rank 0's init value
    try:
        kv.pull(1, out=np.zeros(4 if r == 1 else 3, np.float32))
        assert r != 1, "a pull into a wrong out went through"
    except gpukv.ShapeError:
        assert r == 1
    kv.push(1, np.full(3, r + 1.0, np.float32))
    kv.pull(1, out=out)
    assert np.all(out == total), out
    start = time.monotonic()
    try:
        if call == "init":
            try:
                kv.init(5, [np.ones(3, np.float32), np.ones(4 if r == 1 else 3, np.float32)])
                assert r != 1, "an init refused by worker 1 alone went through"
            except gpukv.ShapeError as exc:
                assert r == 1, exc
                caught(r, exc)
            kv.push(1, np.ones(3, np.float32))  # (where the others hear of the init)
        elif call == "broadcast":
            kv.broadcast(6, np.full(3, 7.0, np.float32),
                         out=read_only if r == 1 else np.zeros(3, np.float32))
        else:
            kv.init(7, np.full(2, 3.0 + r, np.float32))
            seven = np.zeros(5 if r == 1 else 2, np.float32)
            kv.pull(7, out=seven)
            assert np.all(seven == 3.0), seven
        assert r != 1 and call == "pull", f"{call} refused by worker 1 alone went through"
    except (gpukv.PeerMismatchError, gpukv.ShapeError, gpukv.ReadOnlyError) as exc:
        # (the init: worker 1's push too is a PeerMismatchError, the store failed)
        assert isinstance(exc, gpukv.PeerMismatchError) == (r != 1 or call == "init"), exc
        print(f"REFUSED on worker {r} after {time.monotonic() - start:.2f} s", flush=True)
        caught(r, exc)
    if call == "pull":  # the store goes on: worker 1 made the pull's agreement on key 7,
        # so key 8 is agreed on alone at the next collective call, as on the others
        kv.init(8, np.zeros(2, np.float32))
        kv.push([7, 8], [np.full(2, r + 1.0, np.float32)] * 2)
        both = [np.zeros(2, np.float32), np.zeros(2, np.float32)]
        kv.pull([7, 8], out=both)
        assert all(np.all(b == total) for b in both), both
    passed(kv)


def checkpoint_paths_differ(call: str, path: str) -> None:
    """Every worker saves and loads with the same paths; then worker 0 makes checkpoint
    call `call` with its path and the others with paths of their own (for a load, ones
    that name no file): a PeerMismatchError naming the call and the paths on every
    worker, well within the timeout, before anything is written or read (REFUSED ...
    after S prints how long each took)."""
    kv = create(bigarray_bound=1000)
    r = kv.rank
    _keys(kv)
    kv.set_optimizer(gpukv.optim.create("adam", learning_rate=0.1))
    kv.push(["a", "b"], _grads(r, 0))
    kv.save(path + ".store")
    kv.save_optimizer_states(path + ".states")
    kv.load(path + ".store")
    kv.load_optimizer_states(path + ".states")
    ending = ".states" if "optimizer" in call else ".store"
    mine = path + ending if r == 0 else f"{path}.worker{r}{ending}"
    if call.startswith("save"):
        mine = f"{path}.{call}.worker{r}{ending}"
    start = time.monotonic()
    try:
        getattr(kv, call)(mine)
        raise AssertionError(f"{call} of another path on each worker went through")
    except gpukv.PeerMismatchError as exc:
        print(f"REFUSED on worker {r} after {time.monotonic() - start:.2f} s", flush=True)
        caught(r, exc)
    assert not os.path.exists(mine) or not call.startswith("save"), mine
    passed(kv)


def settings_refusals() -> None:
    """A settings call every worker refuses alike (bad compression options, a non-optimizer)
    raises its own error everywhere, changes nothing and the store goes on; options worker
    1 alone refuses are its ArgumentError and, at once, a PeerMismatchError naming the
    refusal on every other worker (REFUSED ... after S prints how long each took)."""
    kv = create()
    r = kv.rank
    kv.init("w", np.ones(4, np.float32))
    kv.set_gradient_compression({"type": "sign"})
    for call, error in [(lambda: kv.set_gradient_compression({"type": "sign", "x": 1}),
                         gpukv.ArgumentError),
                        (lambda: kv.set_optimizer("sgd"), gpukv.ArgumentKindError),
                        (lambda: kv.set_updater(3), gpukv.ArgumentKindError)]:
        try:
            call()
            raise AssertionError("a call refused on every worker went through")
        except error:
            pass
    assert kv.gradient_compression == {"type": "sign"}, kv.gradient_compression
    kv.set_gradient_compression(None)
    kv.push("w", np.full(4, r + 1.0, np.float32))
    out = np.zeros(4, np.float32)
    kv.pull("w", out=out)
    assert np.all(out == kv.num_workers * (kv.num_workers + 1) / 2), out
    start = time.monotonic()
    try:
        kv.set_gradient_compression({"type": "sign", "x": 1} if r == 1 else {"type": "sign"})
        raise AssertionError("options worker 1 alone refused went through")
    except (gpukv.PeerMismatchError, gpukv.ArgumentError) as exc:
        assert isinstance(exc, gpukv.PeerMismatchError) == (r != 1), exc
        print(f"REFUSED on worker {r} after {time.monotonic() - start:.2f} s", flush=True)
        caught(r, exc)
    assert kv.gradient_compression is None, kv.gradient_compression
    passed(kv)


def lamb_split(path: str = "") -> None:
    """LAMB needs whole keys: a key that would be split over servers (or processes) is
    refused at every call that makes one once LAMB is set (init, broadcast, and, given a
    `path` every process sees, a load of a file holding it), and at set_optimizer when it
    exists, on every worker, naming the key; each refusal makes nothing, and the store
    goes on with LAMB, then SGD."""
    kv = create(bigarray_bound=100)
    kv.init("s", np.ones(10, np.float32))
    kv.set_optimizer(gpukv.optim.create("lamb", learning_rate=0.1))
    calls = [lambda: kv.init("w", np.ones(1000, np.float32)),
             lambda: kv.broadcast("w", np.ones(1000, np.float32),
                                  out=np.zeros(1000, np.float32))]
    if path:
        if kv.rank == 0:  # a file holding a key that would be split
            other = gpukv.create("local")
            other.init("w", np.ones(1000, np.float32))
            other.save(path)
        kv.barrier()
        calls.append(lambda: kv.load(path))
    for call in calls:
        try:
            call()
            raise AssertionError("LAMB took a key split over the servers or processes")
        except gpukv.ArgumentError as exc:
            print(f"MADE {type(exc).__name__} on worker {kv.rank}: {exc}", flush=True)
    assert kv.keys() == ["s"], kv.keys()  # (nothing was made)
    kv.push("s", np.ones(10, np.float32))  # the store goes on: LAMB on the whole key
    out = np.zeros(10, np.float32)
    kv.pull("s", out=out)
    assert np.all(out < 1), out
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.5))
    kv.init("w", np.ones(1000, np.float32))  # SGD takes it split
    try:
        kv.set_optimizer(gpukv.optim.create("lamb"))
    except gpukv.ArgumentError as exc:
        caught(kv.rank, exc)
    kv.push("w", np.ones(1000, np.float32))
    out = np.zeros(1000, np.float32)
    kv.pull("w", out=out)
    assert np.allclose(out, 1 - 0.5 * kv.num_workers), out[:3]
    passed(kv)


def dumped_options(path: str) -> None:
    """Optimizer state saved with dump_optimizer, loaded: every worker's optimizer takes
    the file's options as the servers' (or each process's) do, reports them, and a rate
    set anew after the load is the one the next push runs at; the values are one
    process's, bit for bit."""
    kv, reference = create(), gpukv.create("local")
    workers = kv.num_workers
    for store in (kv, reference):
        store.init(0, np.ones(4, np.float32))
        store.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.05, momentum=0.9))
    kv.push(0, np.ones(4, np.float32))
    reference.push(0, [np.ones(4, np.float32)] * workers)
    kv.save_optimizer_states(path, dump_optimizer=True)
    reference.save_optimizer_states(f"{path}.{kv.rank}", dump_optimizer=True)
    for store, where in ((kv, path), (reference, f"{path}.{kv.rank}")):
        optimizer = gpukv.optim.create("sgd", learning_rate=0.1, momentum=0.9)
        store.set_optimizer(optimizer)
        store.load_optimizer_states(where)
        assert optimizer.learning_rate == 0.05, optimizer.learning_rate
        optimizer.set_learning_rate(0.1)  # set anew: the next push runs at it
    kv.push(0, np.ones(4, np.float32))
    reference.push(0, [np.ones(4, np.float32)] * workers)
    got, expected = np.zeros(4, np.float32), np.zeros(4, np.float32)
    kv.pull(0, out=got)
    reference.pull(0, out=expected)
    assert got.tobytes() == expected.tobytes(), (got, expected)
    passed(kv)


def updater_function() -> None:
    """set_updater with a function defined at module level runs where the keys are
    served (pickled to dedicated servers), once per round with the workers' sum; one
    made after create, which servers cannot load, is an ArgumentError on every worker
    there, and the store goes on."""
    kv = create()
    kv.init(9, np.zeros(3))

    def late_updater(key, merged, stored):  # made after create: no server has it
        stored += merged
    late_updater.__qualname__ = "late_updater"  # at module level, as a script's
    globals()["late_updater"] = late_updater
    try:
        kv.set_updater(late_updater)
        assert not kv.num_servers, "servers loaded a function made after create"
    except gpukv.ArgumentError as exc:
        assert kv.num_servers and "before gpukv.create" in str(exc), exc
        caught(kv.rank, exc)
    kv.set_updater(double_and_add)
    kv.push(9, np.ones(3))
    out = np.zeros(3)
    kv.pull(9, out=out)
    assert np.all(out == 2 * kv.num_workers), out
    passed(kv)


def trainer(optimizer: str = "sgd", update_on_kvstore: str = "1", overlap: str = "auto",
            passes: str = "1") -> None:
    """gpukv.torch.Trainer on a dist store, two replicas per worker: the same weights as
    one process training every worker's replicas on a 'local' store (rescale_grad set by
    step(batch_size) reaches the shards), and every worker ends with them.

    overlap: 'auto', 'on' or 'off' (on: small buckets, so that several reductions start
    from backward); passes: backward passes per step, the earlier ones outside
    no_sync ('2') or inside ('2nosync'); '1halve0': after backward, worker 0 alone halves
    its gradients through `.data` (stale on one process only); '1mean': DDP's convention,
    mean losses and step() without a batch size (averaged over every worker's replicas);
    '1calls': between backward and step, the program's own calls on the dist store (a
    barrier, workers_max, an init and a pushpull of a metric), which come after the
    reductions backward started on every worker."""
    import contextlib
    import copy

    import torch
    from torch import nn

    import gpukv.torch as gt
    buckets = {"auto": {}, "on": {"overlap": True, "bucket_bytes": 300},
               "off": {"overlap": False}}[overlap]
    # the fused key is split (with small buckets, the first layer's weight too)
    kv = create(bigarray_bound=60 if buckets.get("overlap") else 100)
    n, r = kv.num_workers, kv.rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    params = ({"learning_rate": 0.1} if optimizer == "adam"
              else {"learning_rate": 0.5, "momentum": 0.9})
    on_store = update_on_kvstore == "1"
    mine = [copy.deepcopy(model) for _ in range(2)]
    everyone = [copy.deepcopy(model) for _ in range(2 * n)]
    dist = gt.Trainer(mine, optimizer, dict(params), kvstore=kv, update_on_kvstore=on_store,
                      **buckets)
    assert dist.overlap == (overlap == "on")  # CPU replicas: off unless asked for
    local = gt.Trainer(everyone, optimizer, dict(params), kvstore="local",
                       update_on_kvstore=on_store, overlap=False)
    pushers = []  # the thread of every push to the dist store
    push = kv.push
    kv.push = lambda *a, **k: pushers.append(threading.current_thread().name) or push(*a, **k)
    g = torch.Generator().manual_seed(1)
    mean = "mean" in passes
    loss_fn = nn.CrossEntropyLoss(reduction="mean" if mean else "sum")
    if mean:
        assert dist.num_replicas == local.num_replicas == 2 * n, dist.num_replicas
        assert [dist.replica_index(i) for i in range(2)] == [2 * r, 2 * r + 1]
    for step in range(4):
        x, y = torch.randn(8 * n, 6, generator=g), torch.randint(0, 3, (8 * n,), generator=g)
        for trainer, models, first in ((dist, mine, 2 * r), (local, everyone, 0)):
            trainer.zero_grad()
            shards = list(zip(x.chunk(2 * n), y.chunk(2 * n)))[first:first + len(models)]
            for k in range(int(passes[0])):
                last = k == int(passes[0]) - 1
                with trainer.no_sync() if "nosync" in passes and not last \
                        else contextlib.nullcontext():
                    for m, (xs, ys) in zip(models, shards):
                        loss_fn(m(xs), ys).backward()
            if "calls" in passes and trainer is dist:
                try:  # (a registration the store cannot hold weakly)
                    kv.settle_before_calls(lambda: None, dist._early.reducing)
                    raise AssertionError("settle_before_calls took a lambda")
                except gpukv.ArgumentKindError as exc:
                    assert "wait must be a bound method" in str(exc), exc
                kv.barrier()
                kv.workers_max([step], "step")
                if step == 0:
                    kv.init("metric", np.zeros(1, np.float32))
                metric = np.ones(1, np.float32)
                kv.pushpull("metric", metric)
                assert on_store or metric[0] == n, metric  # (the store's SGD steps it)
            if "halve0" in passes and first == 0:  # worker 0's replicas
                for m in models[:2]:
                    for p in m.parameters():
                        p.grad.data.mul_(0.5)
            if mean:
                trainer.step()
            else:
                trainer.step(8 * n * (step + 1))  # another batch size every step
    for a, b in zip(mine[0].parameters(), everyone[0].parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    early = sum(name.startswith("gpukv-reduce") for name in pushers)
    # with update_on_kvstore the early reductions go to a store of this process
    assert (early > 0) == (dist.overlap and not on_store), (early, pushers)
    passed(kv)


def trainer_sparse_table() -> None:
    """gpukv.torch.Trainer with an nn.Embedding(sparse=True) on a dist store: a warning
    naming the table says it goes dense, and every worker ends with the weights of one
    process training every worker's replicas densely (lazy_update=False)."""
    import copy
    import warnings

    import torch
    from torch import nn

    import gpukv.torch as gt
    from gpukv.torch.rows import SparseGradientsMadeDense
    kv = create()
    n, r = kv.num_workers, kv.rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Flatten(), nn.Linear(6, 1))
    mine = [copy.deepcopy(model) for _ in range(2)]
    everyone = [copy.deepcopy(model) for _ in range(2 * n)]
    params = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dist = gt.Trainer(mine, "sgd", dict(params), kvstore=kv)
    assert [w.category for w in said] == [SparseGradientsMadeDense], said
    assert "'0.weight'" in str(said[0].message) and "dist store" in str(said[0].message)
    local = gt.Trainer(everyone, "sgd", dict(params, lazy_update=False), kvstore="local")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 10, (2 * n, 2), generator=g)
        for trainer, models, first in ((dist, mine, 2 * r), (local, everyone, 0)):
            trainer.zero_grad()
            for m, row in zip(models, ids[first:first + len(models)]):
                m(row[None]).sum().backward()
            trainer.step(1)
    for a, b in zip(mine[0].parameters(), everyone[0].parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    passed(kv)


def trainer_scaled(update_on_kvstore: str = "1", overlap: str = "off") -> None:
    """gpukv.torch.Trainer under torch.amp.GradScaler on a dist store, two replicas per
    worker, mean losses: an inf in worker 1's gradients at step 1 skips that step on every
    worker, and the weights are those of one process over every replica without a scale
    that skips it too. With update_on_kvstore=False, scaler.step before allreduce_grads
    is refused, changing nothing, and the scale comes off the sums (every worker's scaler
    backs off); on the store, each worker's scaler sees its own gradients."""
    import copy

    import torch
    from torch import nn

    import gpukv.torch as gt
    kv = create(bigarray_bound=60)
    n, r = kv.num_workers, kv.rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    on_store = update_on_kvstore == "1"
    options = {"overlap": True, "bucket_bytes": 300} if overlap == "on" else {}
    mine = [copy.deepcopy(model) for _ in range(2)]
    everyone = [copy.deepcopy(model) for _ in range(2 * n)]
    sgd = {"learning_rate": 0.5, "momentum": 0.9}
    dist = gt.Trainer(mine, "sgd", dict(sgd), kvstore=kv, update_on_kvstore=on_store,
                      **options)
    local = gt.Trainer(everyone, "sgd", dict(sgd), kvstore="local",
                       update_on_kvstore=on_store, overlap=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(1)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(4):
        x, y = torch.randn(8 * n, 6, generator=g), torch.randint(0, 3, (8 * n,), generator=g)
        shards = list(zip(x.chunk(2 * n), y.chunk(2 * n)))
        for trainer, models, first in ((dist, mine, 2 * r), (local, everyone, 0)):
            trainer.zero_grad()
            for m, (xs, ys) in zip(models, shards[first:first + len(models)]):
                loss = loss_fn(m(xs), ys)
                (scaler.scale(loss) if trainer is dist else loss).backward()
        if step == 1 and r == 1:
            with torch.no_grad():
                mine[1][0].weight.grad[0, 0] = float("inf")
        if not on_store:
            if step == 0:
                before = [p.detach().clone() for p in mine[0].parameters()]
                try:
                    scaler.step(dist)
                except gpukv.ArgumentError as exc:
                    assert "allreduce_grads" in str(exc), exc
                else:
                    raise AssertionError("scaler.step before allreduce_grads was taken")
                assert all(torch.equal(a, b) for a, b in zip(before, mine[0].parameters()))
            dist.allreduce_grads()
        scaler.step(dist)
        scaler.update()
        if step != 1:
            local.step()
    for a, b in zip(mine[0].parameters(), everyone[0].parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    assert dist.steps == local.steps == 3, (dist.steps, local.steps)
    sys.stdout.write(f"SCALE worker {r} {scaler.get_scale():g}\n")  # (one write: whole)
    sys.stdout.flush()
    passed(kv)


def trainer_frozen(seeds: str) -> None:
    """Each worker makes its two replicas with `seeds` ('same': one seed everywhere;
    else its own), a frozen float32 layer and a frozen bfloat16 one ahead of a trainable
    head, and two buffers: after Trainer() every replica of every worker holds worker 0's
    replica 0's frozen parameters and buffers (prints FROZEN with their digest and with
    worker 0's own)."""
    import hashlib
    import logging

    import torch

    import gpukv.torch as gt

    class Seen(logging.Handler):
        said: list = []

        def emit(self, record):
            self.said.append(record.getMessage())
    logging.getLogger("gpukv").addHandler(Seen())

    def model(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4),
                                torch.nn.Linear(4, 2))
        m[1].to(torch.bfloat16).requires_grad_(False)
        m[0].requires_grad_(False)
        m.register_buffer("u", torch.randn(3))  # (spectral_norm's vector, say)
        m[2].register_buffer("count", torch.tensor(seed))
        return m

    def digest(m) -> str:
        frozen = [p for p in m.parameters() if not p.requires_grad] + list(m.buffers())
        return hashlib.sha256(b"".join(p.detach().reshape(-1).view(torch.uint8).numpy()
                                       .tobytes() for p in frozen)).hexdigest()[:16]
    kv = create()
    seed = 0 if seeds == "same" else 10 * kv.rank
    replicas = [model(seed), model(seed + 1)]
    gt.Trainer(replicas, "sgd", {"learning_rate": 0.1}, kvstore=kv)
    worker0 = digest(model(0))
    print(f"FROZEN worker {kv.rank} {digest(replicas[0])} {digest(replicas[1])} worker0 "
          f"{worker0} warned {sum('differed between workers' in m for m in Seen.said)}",
          flush=True)
    passed(kv)


def load_16_bit(path: str) -> None:
    """A float16 key stepped once by SGD on the store (which keeps a float32 master copy),
    then loaded from `path` (100 everywhere, no optimizer state): the next step starts
    from the loaded value on every worker."""
    kv = create(bigarray_bound=8)  # the key split over the shards
    kv.init("w", np.ones(32, np.float16))
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.5))
    kv.push("w", np.ones(32, np.float16))
    kv.load(path)
    kv.push("w", np.ones(32, np.float16))
    out = np.zeros(32, np.float16)
    kv.pull("w", out=out)
    want = 100 - 0.5 * kv.num_workers
    assert (out == want).all(), (out, want)
    passed(kv)


def trainer_uneven() -> None:
    """Worker r has r + 1 replicas: num_replicas (and so step() without a batch size) is
    refused on every worker, naming the counts; step(batch_size) trains."""
    import torch
    from torch import nn

    import gpukv.torch as gt
    kv = create()
    r = kv.rank
    models = [nn.Linear(3, 2) for _ in range(r + 1)]
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore=kv)
    try:
        print(trainer.num_replicas)
    except gpukv.ArgumentError as exc:
        assert "between 1 and 2 replicas" in str(exc), exc
    else:
        raise AssertionError("num_replicas was given")
    for model in models:
        model(torch.ones(4, 3)).sum().backward()
    trainer.step(4 * 3)
    assert trainer.steps == 1
    passed(kv)


def trainer_stale(update_on_kvstore: str = "1", overlap: str = "off") -> None:
    """gpukv.torch.Trainer on a dist store with ignore_stale_grad, one key per parameter,
    and one parameter without a gradient on worker 1 only: every worker still pushes the
    same keys, and the weights are those of one process over every replica."""
    import copy

    import torch
    from torch import nn

    import gpukv.torch as gt
    kv = create()
    n, r = kv.num_workers, kv.rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    options = dict(update_on_kvstore=update_on_kvstore == "1", bucket_bytes=0,
                   overlap=overlap == "on")
    mine = [copy.deepcopy(model) for _ in range(2)]
    everyone = [copy.deepcopy(model) for _ in range(2 * n)]
    dist = gt.Trainer(mine, "sgd", {"learning_rate": 0.5}, kvstore=kv, **options)
    local = gt.Trainer(everyone, "sgd", {"learning_rate": 0.5}, kvstore="local", **options)
    g = torch.Generator().manual_seed(1)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for _ in range(3):
        x, y = torch.randn(8 * n, 6, generator=g), torch.randint(0, 3, (8 * n,), generator=g)
        for trainer, models, first in ((dist, mine, 2 * r), (local, everyone, 0)):
            trainer.zero_grad()
            shards = list(zip(x.chunk(2 * n), y.chunk(2 * n)))[first:first + len(models)]
            for k, (m, (xs, ys)) in enumerate(zip(models, shards), start=first):
                loss_fn(m(xs), ys).backward()
                if k // 2 == 1:  # worker 1's replicas
                    m[2].bias.grad = None
            trainer.step(8 * n, ignore_stale_grad=True)
    for a, b in zip(mine[0].parameters(), everyone[0].parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    passed(kv)


def device_init(nccl: str) -> None:
    """dist_device_sync: a pull right after init gives rank 0's value on every GPU (on
    the host path the GPU copies follow the host ones), with NCCL or without."""
    import cupy
    kv = create(nccl=nccl == "1")
    r = kv.rank
    with cupy.cuda.Device(0):
        kv.init("w", cupy.full(5, 10.0 * (r + 1), cupy.float32))
    outs, gpus = [], cupy.cuda.runtime.getDeviceCount()
    for d in range(2):
        with cupy.cuda.Device(d % gpus):
            outs.append(cupy.zeros(5, cupy.float32))
    kv.pull("w", out=outs)
    for o in outs:
        assert np.all(cupy.asnumpy(o) == 10), cupy.asnumpy(o)
    passed(kv)


def settings_differ(setting: str = "bigarray_bound") -> None:
    """Processes that make a store with other settings (bigarray_bound 8 and 1000, or
    timeout; or GPUKV_DIST_CHUNK_BYTES 8 on rank 0 and unset on the others) get a
    PeerMismatchError from create, naming what differs."""
    first = int(os.environ.get("PMI_RANK", "0")) == 0
    try:
        if setting == "GPUKV_DIST_CHUNK_BYTES":
            os.environ.pop(setting, None)
            if first:
                os.environ[setting] = "8"
            create()
        else:
            create(**{setting: 8 if first else 1000})
    except gpukv.PeerMismatchError as exc:
        caught(os.environ.get("PMI_RANK"), exc)


def setting_refused_on_one(victim: str = "1", name: str = "GPUKV_BIGARRAY_BOUND",
                           value: str = "-1") -> None:
    """One process whose own environment holds a malformed setting (`name`=`value`)
    refuses it at create (ArgumentError), and the others hear of it at once
    (PeerMismatchError naming it), not after their timeout; each prints how long its
    create took."""
    rank = int(os.environ.get("PMI_RANK", "0"))
    if rank == int(victim):
        os.environ[name] = value
    start = time.monotonic()
    try:
        create()
    except gpukv.GpukvError as exc:
        print(f"TOOK {time.monotonic() - start:.1f} s on rank {rank}", flush=True)
        caught(rank, exc)


def option_wins_over_a_malformed_setting(victim: str = "1") -> None:
    """deterministic=True given, and a malformed GPUKV_DETERMINISTIC in one process's
    environment: the option wins there too (nothing of the store reads the variable),
    and a round sums as usual."""
    if os.environ.get("PMI_RANK") == victim:
        os.environ["GPUKV_DETERMINISTIC"] = "x"
    kv = create(deterministic=True)
    kv.init("w", np.zeros(4, np.float32))
    kv.push("w", np.full(4, kv.rank + 1, np.float32))
    out = np.zeros(4, np.float32)
    kv.pull("w", out=out)
    assert out.tolist() == [sum(range(1, kv.num_workers + 1))] * 4, out
    passed(kv, kv.deterministic)


def absent(victim: str = "1") -> None:
    """A process that never makes the store: the others' create raises PeerError
    naming it, in bounded time. (Every process starts MPI: MPI_Init itself waits for
    all of them, whatever gpukv does.)"""
    from mpi4py import MPI  # noqa: F401  (starts MPI on every rank)
    if os.environ.get("PMI_RANK") == victim:
        time.sleep(float(os.environ["GPUKV_DIST_TIMEOUT"]) * 4)
        return
    try:
        create()
    except gpukv.PeerError as exc:
        caught(os.environ.get("PMI_RANK"), exc)


def second_served_store() -> None:
    """One store with dedicated servers per job: a second is an ArgumentError."""
    kv = create()
    try:
        create()
    except gpukv.ArgumentError as exc:
        caught(kv.rank, exc)
    passed(kv)


def updater_on_one() -> None:
    """With num_servers=0 every process sets the updater: one alone is refused."""
    kv = create()
    kv.init(1, np.zeros(4))
    try:
        if kv.rank == 0:
            kv.set_updater(double_and_add)
        kv.push(1, np.ones(4))
    except gpukv.PeerMismatchError as exc:
        caught(kv.rank, exc)


def options_differ() -> None:
    """Optimizer options changed on one process only (a learning rate, a batch size
    through the Trainer's rescale_grad) are refused at the next push, not applied to
    some shards."""
    kv = create()
    kv.init(1, np.zeros(4))
    sgd = gpukv.optim.create("sgd", learning_rate=0.1)
    kv.set_optimizer(sgd)
    if kv.rank == 1:
        sgd.rescale_grad = 0.5
    try:
        kv.push(1, np.ones(4))
    except gpukv.PeerMismatchError as exc:
        caught(kv.rank, exc)


def _collective_call(kv, call: str, path: str) -> None:
    """`call`, one of the calls every worker makes together, on `kv`."""
    if call == "push":
        kv.push(["a", "b"], _grads(kv.rank, 1))
    elif call == "barrier":
        kv.barrier()
    elif call in ("save", "load"):
        getattr(kv, call)(path + ".store")
    else:
        getattr(kv, call)(path + ".states")


def mismatched_calls(first: str, other: str, path: str) -> None:
    """Worker 0 makes call `first` while the others make `other` (after a save and a
    save_optimizer_states that all make): every worker gets a PeerMismatchError naming
    both calls (with dedicated servers a push is no collective call: the barrier after
    it meets worker 0's call), and its next call a PeerError at once."""
    kv = create(bigarray_bound=1000)
    _keys(kv)
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=0.1))
    kv.push(["a", "b"], _grads(kv.rank, 0))
    kv.save(path + ".store")
    kv.save_optimizer_states(path + ".states")
    try:
        _collective_call(kv, first if kv.rank == 0 else other, path)
        kv.barrier()
    except gpukv.PeerError as exc:
        caught(kv.rank, exc)
    pull_again(kv, "a", np.zeros((2, 3), np.float32))


def uncaught_error(victim: str = "1") -> None:
    """Worker `victim` pushes a wrong shape and does not catch the ShapeError, while the
    others go on to their next calls: the uncaught error ends the whole job at once
    (also under a bare `mpiexec python prog.py`)."""
    kv = create()
    kv.init("w", np.ones(4, np.float32))
    kv.push("w", np.ones(4, np.float32))
    kv.pull("w", out=np.zeros(4, np.float32))
    kv.init("v", np.ones(3, np.float32))  # agreed on at the next collective call
    if kv.rank == int(victim):
        kv.push("w", np.ones(5, np.float32))
    print(f"GOING ON worker {kv.rank}", flush=True)
    try:
        kv.push("w", np.ones(4, np.float32))
        kv.pull("w", out=np.zeros(4, np.float32))
        kv.barrier()
    except gpukv.PeerError as exc:
        caught(kv.rank, exc)
        raise
    passed(kv)


def server_dies(point: str, code: str = "1") -> None:
    """The dedicated server (rank 0) exits with status `code` at `point`: in its first or
    third update ("push1", "push3"), or a moment after its first ("later"). Every worker
    gets a PeerError (never MPI's own exception), then a PeerError at once from its next
    call, and the job ends."""
    kv = create()
    kv.init("w", np.ones(1000, np.float32))
    kv.set_updater(dying_updater)
    try:
        for _ in range(50):
            kv.push("w", np.ones(1000, np.float32))
            kv.pull("w", out=np.zeros(1000, np.float32))
            time.sleep(0.02)
    except gpukv.PeerError as exc:
        caught(kv.rank, exc)
    pull_again(kv, "w", np.zeros(1000, np.float32))


_updates = [0]


def dying_updater(key, merged, stored):
    """The updater of `server_dies`: ends the server process at the point its arguments
    name."""
    point, code = sys.argv[2], int(sys.argv[3])
    _updates[0] += 1
    if point == f"push{_updates[0]}":
        os._exit(code)
    if point == "later" and _updates[0] == 1:
        threading.Timer(0.2, os._exit, (code,)).start()
    stored += merged


def mpi_error(kind: str) -> None:
    """An MPI call that fails under a transport (as one does when a peer died): rank 0
    receives into a buffer too small for what rank 1 sends ("truncated"), or sends to a
    rank that is not there ("no_such_rank"). Rank 0 gets a PeerError, not MPI's own
    exception, and its transport is failed from then on; at exit it aborts the job."""
    from mpi4py import MPI

    from gpukv.distributed import Transport
    t = Transport(MPI.COMM_WORLD.Dup(), float(os.environ["GPUKV_DIST_TIMEOUT"]))
    if t.rank == 1:
        if kind == "truncated":
            t.wait_all([t.send_array(np.ones(64, np.float32), 0, 77)], "sending")
        return
    try:
        if kind == "truncated":
            t.wait_all([t.recv_array(np.zeros(4, np.float32), 1, 77)], "receiving")
        else:
            t.wait_all([t.send_object("hello", t.size + 5, 77)], "sending")
    except gpukv.PeerError as exc:
        caught(t.rank, exc)
    try:
        t.check()
    except gpukv.PeerError as exc:
        print(f"AGAIN {type(exc).__name__} on worker {t.rank}", flush=True)


def save_right_after_init(path: str) -> None:
    """save as the first call after init (the keys still queued with num_servers=0)."""
    kv = create()
    kv.init("w", np.full(3, 1.0 + kv.rank))
    kv.save(path)
    local = gpukv.create("local")
    local.load(path)
    out = np.zeros(3)
    local.pull("w", out=out)
    assert np.all(out == 1.0), out
    passed(kv)


def load_wrong_optimizer(path: str) -> None:
    """A checkpoint whose optimizer state does not fit (Adam's into SGD with momentum)
    fails on every worker and changes nothing: the file's other keys are not made."""
    kv = create(bigarray_bound=1000)
    kv.init("a", np.ones((2, 3), np.float32))
    kv.set_optimizer(gpukv.optim.create("sgd", momentum=0.9))
    try:
        kv.load(path + ".store")
    except gpukv.CheckpointError as exc:
        caught(kv.rank, exc)
    assert "b" not in kv and kv.keys() == ["a"], kv.keys()
    passed(kv)


def bfloat16() -> None:
    """bfloat16 keys (ml_dtypes): summed in float32 on every path."""
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    kv = create(bigarray_bound=1000)
    n, r = kv.num_workers, kv.rank
    kv.init(["s", "big"], [np.zeros(4, bf16), np.zeros(1500, bf16)])
    kv.push(["s", "big"], [np.full(4, r + 1, bf16), np.full(1500, r + 1, bf16)])
    outs = [np.zeros(4, bf16), np.zeros(1500, bf16)]
    kv.pull(["s", "big"], out=outs)
    for o in outs:
        assert np.all(o.astype(np.float32) == n * (n + 1) / 2), o[:4]
    passed(kv)


def narrow_local_sums(dtype: str = "float16") -> None:
    """Worker 0 pushes three values of a 16-bit float key whose sum there (120000) is past
    float16's range, the others -60000 / (n - 1) each: the sum over every process fits,
    and comes out as one process gives it (the sums of a process's values are made in
    float32, as one process makes them), for a small key and a split one."""
    dt = _dtype(dtype)
    kv = create(bigarray_bound=1000)
    n, r = kv.num_workers, kv.rank
    shapes = {"s": (2,), "big": (1500,)}
    kv.init(list(shapes), [np.zeros(shape, dt) for shape in shapes.values()])
    if r == 0:
        mine = [[np.full(shape, v, dt) for v in (60000, 60000, 0)] for shape in shapes.values()]
    else:
        mine = [np.full(shape, -60000 / (n - 1), dt) for shape in shapes.values()]
    kv.push(list(shapes), mine)
    outs = [np.zeros(shape, dt) for shape in shapes.values()]
    kv.pull(list(shapes), out=outs)
    for o in outs:
        assert np.all(o.astype(np.float32) == 60000), o[:4]
    passed(kv)


def refused_by_the_optimizer() -> None:
    """A push the optimizer refuses (an int key) is a DTypeError on every worker before
    anything is sent; the store goes on."""
    kv = create()
    kv.init(["i", "f"], [np.zeros(3, np.int32), np.zeros(3, np.float32)])
    kv.set_optimizer(gpukv.optim.create("sgd", learning_rate=1.0))
    try:
        kv.push("i", np.ones(3, np.int32))
    except gpukv.DTypeError as exc:
        caught(kv.rank, exc)
    kv.push("f", np.ones(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull("f", out=out)
    assert np.all(out == -kv.num_workers), out
    passed(kv)


def empty_calls() -> None:
    """Calls with empty key lists do nothing, as in one process."""
    kv = create()
    kv.init([], [])
    kv.push([], [])
    kv.pull([], out=[])
    kv.pushpull([], [], out=[])
    kv.init(1, np.ones(2))
    out = np.zeros(2)
    kv.pull(1, out=out)
    assert np.all(out == 1), out
    passed(kv)


def torch_outs() -> None:
    """Tensors written as PyTorch writes them: a leaf that requires grad is refused outside
    torch.no_grad() (by pull, pushpull and broadcast, before any message), a write moves
    the version counter; the store stays in step on every worker."""
    import torch
    kv = create()
    kv.init("w", np.full(4, 5, np.float32))
    leaf = torch.zeros(4, requires_grad=True)
    for call in (lambda: kv.pull("w", out=leaf), lambda: kv.pushpull("w", leaf),
                 lambda: kv.broadcast("b", np.ones(4, np.float32), out=leaf)):
        try:
            call()
            raise AssertionError("a write into a leaf that requires grad was accepted")
        except gpukv.ReadOnlyError as exc:
            assert "key " in str(exc) and "torch.no_grad" in str(exc), exc
    assert not leaf.detach().any() and "b" not in kv
    with torch.no_grad():
        kv.pull("w", out=leaf)
    assert leaf._version == 1 and torch.equal(leaf.detach(), torch.full((4,), 5.0)), leaf
    saved = torch.ones(4)
    loss = (leaf * saved).sum()
    kv.pushpull("w", saved)  # no updater: the sum over workers, written back
    assert torch.equal(saved, torch.full((4,), float(kv.num_workers))), saved
    try:
        loss.backward()
        raise AssertionError("backward through a tensor written since it was saved passed")
    except RuntimeError as exc:
        assert "modified by an inplace operation" in str(exc), exc
    passed(kv)


# ------------------------------------------------------------- split keys in chunks
def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _contribution(rank: int, size: int, dt: np.dtype) -> np.ndarray:
    """Rank `rank`'s gradient: values whose float sum depends on the order of adding."""
    rng = np.random.default_rng(1000 + rank)
    if dt.kind in "iu":
        return rng.integers(-50 if dt.kind == "i" else 0, 50, size).astype(dt)
    return (rng.standard_normal(size) * 10.0 ** rng.integers(-4, 5, size)).astype(dt)


def split_sums(dtype: str, sizes: str, updater: str = "0", chunk_bytes: str = "0") -> None:
    """Split keys of `sizes` elements (any size: bigarray_bound=1) pushed once, without or
    with an updater that stores the sum: every worker's copy is the sum of the workers'
    gradients added in rank order, bit for bit, in the dtype sums are made in; with
    `chunk_bytes`, the messages of a piece are that short."""
    from gpukv.device.host_sum import accumulate_dtype
    if int(chunk_bytes):
        from gpukv.distributed.engines import exchange
        exchange.CHUNK_BYTES = int(chunk_bytes)
    kv = create(bigarray_bound=1)
    n, r, dt = kv.num_workers, kv.rank, _dtype(dtype)
    lengths = [int(s) for s in sizes.split(",")]
    keys = [f"k{i}" for i in range(len(lengths))]
    kv.init(keys, [np.zeros(m, dt) for m in lengths])
    if updater == "1":
        kv.set_updater(store_the_sum)
    kv.push(keys, [_contribution(r, m, dt) for m in lengths])
    outs = [np.zeros(m, dt) for m in lengths]
    kv.pull(keys, out=outs)
    wire = accumulate_dtype(dt)
    for key, m, out in zip(keys, lengths, outs):
        expect = _contribution(0, m, dt).astype(wire)
        for source in range(1, n):
            expect = expect + _contribution(source, m, dt).astype(wire)
        expect = expect.astype(dt)
        assert out.tobytes() == expect.tobytes(), (
            key, m, np.flatnonzero(out.view(np.uint8) != expect.view(np.uint8))[:5])
    passed(kv)


def store_the_sum(key, merged, stored):
    stored[...] = merged


def stall_in_exchange(victim: str = "1") -> None:
    """Worker `victim` stops in the middle of an exchange of a split key (after its first
    messages; between 2 workers, before MPI's allreduce that sums it): every other worker
    gets a PeerError naming it within the timeout."""
    from gpukv.distributed.engines import exchange
    exchange.CHUNK_BYTES = 4096
    kv = create(bigarray_bound=1)
    kv.init("w", np.zeros(100_000, np.float32))
    stall_for = float(os.environ["GPUKV_DIST_TIMEOUT"]) * 4
    if kv.rank == int(victim) and kv.num_workers == 2:  # MPI's allreduce sums the key
        allreduce = exchange.allreduce

        def stall_first(t, keys, what):
            time.sleep(stall_for)
            allreduce(t, keys, what)
        exchange.allreduce = stall_first
    elif kv.rank == int(victim):
        progress = exchange._Exchange._progress

        def stall(self):
            progress(self)
            time.sleep(stall_for)
        exchange._Exchange._progress = stall  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        kv.push("w", np.ones(100_000, np.float32))
    except gpukv.PeerError as exc:
        print(f"CAUGHT PeerError on worker {kv.rank}: {exc} "
              f"(after {time.monotonic() - start:.1f} s)", flush=True)
        return
    passed(kv)


def python_runs_while_waiting() -> None:
    """Worker 0 pushes and pulls while worker 1 sleeps a second before its push (with
    servers, the pull is what waits): meanwhile another thread of worker 0 runs Python.
    Prints RATE: its loop's speed during the wait over its speed alone (a wait that held
    the GIL would leave it near 0, one that polled in Python near 0.5). Each speed is the
    best of four windows, so that a moment of another process's work on a shared core
    does not count as the wait's."""
    kv = create()
    kv.init("w", np.zeros(1000, np.float32))
    kv.barrier()

    def spin(seconds: float) -> float:
        rates = []
        for _ in range(4):
            count, end = 0, time.perf_counter() + seconds / 4
            while time.perf_counter() < end:
                count += sum(range(100))
            rates.append(count / (seconds / 4))
        return max(rates)

    def push_pull() -> None:
        kv.push("w", np.ones(1000, np.float32))
        kv.pull("w", out=np.zeros(1000, np.float32))

    if kv.rank == 0:
        alone = spin(0.4)
        pushing = threading.Thread(target=push_pull)
        pushing.start()
        time.sleep(0.05)  # (the push is waiting for worker 1 by now)
        during = spin(0.4)
        waited = pushing.is_alive()
        pushing.join()
        print(f"RATE {during / alone:.2f} waited {waited}", flush=True)
    else:
        time.sleep(1.0)
        push_pull()
    passed(kv)


def end_after_an_exchange(megabytes: str = "4") -> None:
    """Two workers push and pull a split key through the exchange's own messages (not
    MPI's allreduce) and end right after: the last receiver may still owe the sender
    MPICH's word that a message was read, and the job must end without a PeerError."""
    from gpukv.distributed.engines import exchange
    exchange.MPI_FOR_TWO = False
    kv = create(bigarray_bound=1)
    grad = np.ones(int(megabytes) << 18, np.float32)
    kv.init("w", np.zeros_like(grad))
    out = np.empty_like(grad)
    for _ in range(3):
        kv.push("w", grad)
        kv.pull("w", out=out)
    assert (out == kv.num_workers).all()
    passed(kv)


def end_late(late: str = "2") -> None:
    """Every worker pushes and pulls, then worker `late` works on for three timeouts before
    it ends. The others wait for its word at exit no longer than the timeout; it, last to
    its exit, finds their words there and ends at once. Each prints how long it waited
    (`EXIT WAIT worker R: S s`)."""
    import atexit

    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    began: list = []
    # registered before the store's wait, so called after it (and the other way below)
    atexit.register(lambda: print(f"EXIT WAIT worker {rank}: "
                                  f"{time.monotonic() - began[0]:.2f} s", flush=True))
    kv = create()
    kv.init("w", np.zeros(10, np.float32))
    kv.push("w", np.ones(10, np.float32))
    kv.pull("w", out=np.zeros(10, np.float32))
    atexit.register(lambda: began.append(time.monotonic()))
    if kv.rank == int(late):
        time.sleep(3 * float(os.environ["GPUKV_DIST_TIMEOUT"]))
    passed(kv)


def double_and_add(key, merged, stored):
    stored += 2 * merged


def init_missing() -> None:
    """Worker 1 never inits key 3, which worker 0 does; both then push key 1. With servers
    the PeerError names the init worker 1 did not make, not the push waiting behind it."""
    kv = create()
    kv.init(1, np.zeros(3, np.float32))
    if kv.rank != 1:
        kv.init(3, np.zeros(4, np.float32))
    try:
        kv.push(1, np.ones(3, np.float32))
        kv.pull(1, out=np.zeros(3, np.float32))
        raise AssertionError("a key one worker never made went unnoticed")
    except gpukv.PeerError as exc:
        caught(kv.rank, exc)


def refuse_key_2(key, merged, stored):
    if key == 2:
        raise ValueError("updater refuses key 2")
    stored += merged


def updater_raises() -> None:
    """With num_servers=0, an updater that raises on a key's owner: the owner raises the
    updater's error, and every other process a PeerError saying so, at once (not after
    their timeout)."""
    kv = create()
    kv.set_updater(refuse_key_2)
    kv.init([1, 2, 3], [np.zeros(2, np.float32)] * 3)
    start = time.monotonic()
    try:
        kv.push([1, 2, 3], [np.ones(2, np.float32)] * 3)
        kv.pull([1, 2, 3], out=[np.zeros(2, np.float32) for _ in range(3)])
        raise AssertionError("the updater's error reached no process")
    except (ValueError, gpukv.PeerError) as exc:
        assert "updater refuses key 2" in str(exc), exc
        print(f"RAISED {type(exc).__name__} on worker {kv.rank} after "
              f"{time.monotonic() - start:.1f} s", flush=True)


def updater_calls_the_store() -> None:
    """With num_servers=0, an updater that pushes another key from inside a push: the
    owner of the key raises an ArgumentError saying why, the others a PeerError carrying
    it (the two calls' messages would cross)."""
    kv = create()

    def push_inside(key, merged, stored):
        kv.push(2, np.ones(2, np.float32))

    kv.init([1, 2], [np.zeros(2, np.float32)] * 2)
    kv.set_updater(push_inside)
    try:
        kv.push(1, np.ones(2, np.float32))
        raise AssertionError("the push inside the updater went through")
    except (gpukv.ArgumentError, gpukv.PeerError) as exc:
        assert "a dist store's updater called the store" in str(exc), exc
        print(f"RAISED {type(exc).__name__} on worker {kv.rank}", flush=True)


def a_forked_child_ends() -> None:
    """Worker 0 forks a child (as a data loader's worker is) while a snapshot is being
    written; the child runs the exit handlers a normal end runs (then os._exit, as such
    workers end): they return at once, leaving the parent's store and the job alone, and
    the workers go on pushing. Prints the child's seconds and the sums."""
    import atexit
    import tempfile

    from gpukv.checkpoints import snapshots

    kv = create()
    kv.init(3, np.zeros(4, np.float32))
    write = snapshots.write_archive

    def slow_write(*args, **kwargs):
        time.sleep(1.0)  # (the fork lands while the write is in flight)
        return write(*args, **kwargs)

    snapshots.write_archive = slow_write
    kv.snapshot(tempfile.mkdtemp())
    if kv.rank == 0:
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            atexit._run_exitfuncs()  # what sys.exit would run, MPI_Finalize aside
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"CHILD ended {os.waitstatus_to_exitcode(status)} after "
              f"{time.monotonic() - start:.1f} s", flush=True)
    kv.finish_snapshots()
    for _ in range(3):
        kv.push(3, np.ones(4, np.float32))
    out = np.zeros(4, np.float32)
    kv.pull(3, out=out)
    print(f"SUM worker {kv.rank} {out[0]:g}", flush=True)
    passed(kv)


def ends_early(victim: str = "1") -> None:
    """Rank `victim` reaches the end of the program once the store is made, while the
    others push on: they raise PeerError saying that it ended, not that it is late."""
    kv = create()
    kv.init(1, np.zeros(2, np.float32))
    if kv.rank == int(victim):
        return
    try:
        kv.push(1, np.ones(2, np.float32))
    except gpukv.PeerError as exc:
        caught(kv.rank, exc)


def snapshots_left_at_exit(folder: str) -> None:
    """Three snapshots with keep=2, and the program ends without finish_snapshots: the
    exit leaves the two newest (the test counts them). Every process but worker 0 (whose
    world rank is the number of servers) writes slowly, so that the prune worker 0 makes
    once its own files are written finds the newest snapshot incomplete."""
    from gpukv.checkpoints import snapshots

    write = snapshots.write_archive

    def slow_write(*args, **kwargs):
        time.sleep(0.5)
        return write(*args, **kwargs)

    if os.environ["PMI_RANK"] != os.environ["GPUKV_NUM_SERVERS"]:
        snapshots.write_archive = slow_write
    kv = create()
    kv.init(1, np.zeros(4, np.float32))
    for step in (1, 2, 3):
        kv.push(1, np.full(4, step, np.float32))
        kv.snapshot(folder, step=step, keep=2)
    passed(kv)


def trainer_models_differ(how: str) -> None:
    """Workers whose models differ ('width': worker 1's hidden layer is wider; 'depth':
    worker 1's has one more layer): making the Trainer is a PeerMismatchError on every
    worker naming the first parameter that differs, or the counts, before any key."""
    import torch

    from gpukv.torch import Trainer
    kv = create()
    wide = 32 if how == "width" and kv.rank == 1 else 16
    layers = [torch.nn.Linear(8, wide), torch.nn.ReLU(), torch.nn.Linear(wide, 3)]
    if how == "depth" and kv.rank == 1:
        layers.append(torch.nn.Linear(3, 3))
    try:
        Trainer(torch.nn.Sequential(*layers), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    except gpukv.PeerMismatchError as exc:
        assert kv.keys() == [], kv.keys()
        caught(kv.rank, exc)


def trainer_arguments_refused(what: str) -> None:
    """Worker 1 alone makes its Trainer with arguments it refuses ('compression': an
    unknown compression option; 'buckets': bucket_bytes=-1): worker 1 raises its own
    ArgumentError, every other worker at once a PeerMismatchError naming the refusal
    (REFUSED ... after S), not a PeerError once worker 1 has gone; no key is made."""
    import torch

    from gpukv.torch import Trainer
    kv = create()
    options: dict = {"compression_params": {"type": "sign"}}
    if kv.rank == 1:
        options = ({"compression_params": {"type": "sign", "bogus": 1}}
                   if what == "compression" else {"bucket_bytes": -1})
    start = time.monotonic()
    try:
        Trainer(torch.nn.Linear(4, 2), "sgd", {"learning_rate": 0.1}, kvstore=kv, **options)
        raise AssertionError("a Trainer worker 1 refused was made")
    except (gpukv.PeerMismatchError, gpukv.ArgumentError) as exc:
        assert isinstance(exc, gpukv.PeerMismatchError) == (kv.rank != 1), exc
        assert kv.keys() == [], kv.keys()
        print(f"REFUSED on worker {kv.rank} after {time.monotonic() - start:.2f} s",
              flush=True)
        caught(kv.rank, exc)


def trainer_step_refused() -> None:
    """Worker 1 alone steps with a batch size it refuses (0): its own ArgumentError, and
    every other worker, in its step's push, a PeerMismatchError carrying worker 1's words
    at once (REFUSED ... after S), not a PeerError once worker 1 has gone."""
    import torch

    from gpukv.torch import Trainer
    kv = create()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trainer = Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore=kv)
    model(torch.ones(3, 4)).sum().backward()
    start = time.monotonic()
    try:
        trainer.step(0 if kv.rank == 1 else 3)
        raise AssertionError("a step worker 1 refused was taken")
    except (gpukv.PeerMismatchError, gpukv.ArgumentError) as exc:
        assert isinstance(exc, gpukv.PeerMismatchError) == (kv.rank != 1), exc
        print(f"REFUSED on worker {kv.rank} after {time.monotonic() - start:.2f} s",
              flush=True)
        caught(kv.rank, exc)


def trainer_raises_in_with(folder: str) -> None:
    """A Trainer with snapshots, used as `with trainer:`: worker 1 raises a ValueError in
    its third step. Leaving the block does not turn it into another error (the block's
    end asks nothing of the others, who are in that step's push): worker 1 catches its
    ValueError, the others a PeerError once it has gone."""
    import torch

    from gpukv.torch import Trainer
    kv = create()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trainer = Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore=kv,
                      checkpoint_dir=folder, checkpoint_every=1)
    try:
        with trainer:
            for step in range(5):
                if kv.rank == 1 and step == 2:
                    raise ValueError(f"bad batch {step}")
                trainer.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                trainer.step()
    except (ValueError, gpukv.PeerError) as exc:
        caught(kv.rank, exc)


def stores_made_and_dropped(count: str = "2100") -> None:
    """A store made, used and dropped `count` times beside one kept the whole time (a
    store per trial of a search): each dropped store gives its communicator back, so
    more stores than MPI has communicators (2048 in MPICH) come and go; the first store
    works after them."""
    import gc
    kept = create()
    kept.init(1, np.zeros(2, np.float32))
    for i in range(int(count)):
        kv = create()
        kv.init(1, np.zeros(2, np.float32))
        kv.push(1, np.full(2, i, np.float32))
        del kv
        if i % 100 == 99:
            gc.collect()  # (a store's parts refer to each other: the collector frees them)
    kept.push(1, np.ones(2, np.float32))
    out = np.zeros(2, np.float32)
    kept.pull(1, out=out)
    print(f"KEPT worker {kept.rank} {out[0]:g}", flush=True)
    passed(kept)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])

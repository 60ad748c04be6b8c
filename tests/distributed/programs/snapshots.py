"""Programs the dist snapshot tests launch: `mpiexec -n N python -m mpi4py snapshots.py
NAME [ARGS]` (or plain `python` with STORE=local). GPUKV_NUM_SERVERS sets the servers;
STORE the store (default dist_sync). Each prints one `PASS worker R of W` line."""
from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

import gpukv
from gpukv.checkpoints import snapshots

STORE = os.environ.get("STORE", "dist_sync")
#: key -> (dtype, shape); with bigarray_bound=100 the bigger keys are split over shards
KEYS = {"a": ("float32", (2, 3)), "b": ("float32", (1100,)), "c": ("float16", (301,))}
#: the logical workers whose gradients make every step's sum, whatever the real count
LOGICAL = 6


def _gradient(worker: int, step: int, key: str) -> np.ndarray:
    """Logical worker `worker`'s gradient: multiples of 1/4 below 8, so that any grouping
    of the sum is exact and the sum's bits do not depend on who pushes what."""
    dtype, shape = KEYS[key]
    size = int(np.prod(shape))
    rng = np.random.default_rng([worker, step, size])
    return (rng.integers(-32, 32, size) / 4).astype(dtype).reshape(shape)


def _create():
    """The store; a dist one splits the bigger keys over its shards."""
    return gpukv.create(STORE, **({} if STORE == "local" else {"bigarray_bound": 100}))


def _push(kv, step: int) -> None:
    """Worker r pushes the sum of the logical workers r, r + n, r + 2n, ..."""
    mine = range(kv.rank, LOGICAL, kv.num_workers)
    kv.push(list(KEYS), [sum(_gradient(w, step, k) for w in mine) for k in KEYS])


def _digest(kv) -> str:
    outs = [np.zeros(shape, dtype) for dtype, shape in KEYS.values()]
    kv.pull(list(KEYS), out=outs)
    return hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()


def _user_state(rank: int, step: int) -> dict:
    return {"rank": rank, "step": step, "seen": np.arange(3) + 100 * rank + step,
            "order": (rank, [step, "x"])}


def train(root: str, until: str) -> None:
    """Resume from the newest snapshot under `root` (if any; each worker checks the
    user_state it saved), push the steps up to `until`, snapshotting after each with a
    user_state of its own, and print the values' digest."""
    kv = _create()
    dtype = {k: np.dtype(d) for k, (d, _) in KEYS.items()}
    kv.init(list(KEYS), [np.ones(s, dtype[k]) for k, (_, s) in KEYS.items()])
    kv.set_optimizer(gpukv.optim.Adam(learning_rate=0.01, multi_precision=True))
    found = kv.resume(root)
    start = 0
    if found is not None:
        start = found.step
        if kv.rank < found.workers:
            state = found.user_state(kv.rank)
            expect = _user_state(kv.rank, start)
            assert state["seen"].tobytes() == expect["seen"].tobytes(), state
            del state["seen"], expect["seen"]
            assert state == expect, (state, expect)
        print(f"RESUMED worker {kv.rank} step {start} saved by {found.workers}", flush=True)
    for step in range(start, int(until)):
        _push(kv, step)
        kv.snapshot(root, step + 1, user_state=_user_state(kv.rank, step + 1))
    kv.finish_snapshots()
    print(f"DIGEST worker {kv.rank} {_digest(kv)}", flush=True)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def bad_user_state(root: str) -> None:
    """Worker 1's user_state holds a set: ArgumentError on every worker (worker 1's names
    where), nothing is written, and the next snapshot works."""
    kv = _create()
    kv.init("a", np.ones(200, np.float32))
    state = {"bad": {1, 2}} if kv.rank == 1 else {"fine": 1}
    try:
        kv.snapshot(root, 1, user_state=state)
    except gpukv.ArgumentError as exc:
        print(f"CAUGHT ArgumentError on worker {kv.rank}: {exc}", flush=True)
    else:
        raise AssertionError("the snapshot was taken")
    kv.finish_snapshots()
    assert gpukv.latest_snapshot(root) is None
    kv.snapshot(root, 2, user_state={"fine": kv.rank})
    kv.finish_snapshots()
    found = gpukv.latest_snapshot(root)
    assert (found.step, found.workers) == (2, kv.num_workers), found
    assert found.user_state(kv.rank) == {"fine": kv.rank}
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def trainer_bad_user_state(root: str, overlap: str = "") -> None:
    """A Trainer whose worker 1 has a user_state the snapshot due after the step cannot
    save: ArgumentError from step() on every worker at once (worker 1's names where), no
    step taken anywhere; with user_state mended, the step and its snapshot go ahead. With
    `overlap`, each replica updates itself and backward starts the buckets' reductions on
    the store (collectives the check must come after on every worker)."""
    import torch

    import gpukv.torch as gt
    kv = _create()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    options = dict(update_on_kvstore=False, overlap=True, bucket_bytes=64) if overlap else {}
    trainer = gt.Trainer([model], "sgd", {"learning_rate": 0.1}, kvstore=kv,
                         checkpoint_dir=root, checkpoint_every=1, **options)
    assert trainer.overlap == bool(overlap)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 3)).sum().backward()
    trainer.user_state = {"bad": {1, 2}} if kv.rank == 1 else {"fine": 1}
    start = time.monotonic()
    try:
        trainer.step(2)
    except gpukv.ArgumentError as exc:
        print(f"CAUGHT ArgumentError on worker {kv.rank} after "
              f"{time.monotonic() - start:.1f} s: {exc}", flush=True)
    else:
        raise AssertionError("the step was taken")
    assert trainer.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    trainer.user_state = {"fine": kv.rank}
    trainer.step(2)
    trainer.finish_snapshots()
    found = gpukv.latest_snapshot(root)
    assert found is not None and found.step == 1, found
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def trainer_local_updates(root: str, until: str) -> None:
    """A Trainer on a dist store with update_on_kvstore=False (each worker updates its
    replica) takes `until` steps from where its snapshots left off, one every 3 steps;
    worker w's batch of step s is drawn from a generator seeded (s, w). Prints the
    resume and a digest of the weights."""
    import torch

    import gpukv.torch as gt
    kv = _create()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.Tanh(), torch.nn.Linear(7, 2))
    trainer = gt.Trainer([model], "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore=kv, update_on_kvstore=False, checkpoint_dir=root,
                         checkpoint_every=3, checkpoint_keep=10)
    if trainer.resumed_from is not None:
        print(f"RESUMED worker {kv.rank} step {trainer.steps} saved by "
              f"{trainer.resumed_from.workers} state {trainer.user_state} buffers "
              f"{_buffers_digest(model)}", flush=True)
    for step in range(trainer.steps, int(until)):
        g = torch.Generator().manual_seed(1000 * step + kv.rank)
        trainer.zero_grad()
        model(torch.randn(4, 5, generator=g)).square().sum().backward()
        trainer.user_state = {"worker": kv.rank, "step": step + 1}
        trainer.step(4 * kv.num_workers)
    trainer.finish_snapshots()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print(f"DIGEST worker {kv.rank} {digest}", flush=True)
    print(f"BUFFERS worker {kv.rank} {_buffers_digest(model)}", flush=True)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def _buffers_digest(model) -> str:
    """A digest of the model's buffers (BatchNorm's running statistics: each worker's own,
    from its own batches)."""
    return hashlib.sha256(b"".join(b.numpy().tobytes()
                                   for b in model.buffers())).hexdigest()[:16]


def _late_writes() -> None:
    """Every shard file, and every worker file but worker 0's, lands 0.2 s late (as on a
    slow shared file system): worker 0's own file is then the first of each snapshot."""
    from gpukv.checkpoints import snapshots
    write = snapshots.write_archive

    def late(path, header, arrays):
        if header.get("kind") == snapshots.SHARD_KIND or header.get("rank", 0) != 0:
            time.sleep(0.2)
        write(path, header, arrays)
    snapshots.write_archive = late


def keep(root: str, keep: str, steps: str, trainer: str = "") -> None:
    """Snapshots of steps 1..`steps` with keep=`keep` (through a Trainer's
    checkpoint_keep with `trainer`), files landing late; then finish_snapshots() and
    worker 0 prints the folders left (`FOLDERS name,name,...`)."""
    _late_writes()
    kv = _create()
    if trainer:
        import torch

        import gpukv.torch as gt
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        coach = gt.Trainer([model], "sgd", {"learning_rate": 0.1}, kvstore=kv,
                           checkpoint_dir=root, checkpoint_every=1,
                           checkpoint_keep=int(keep))
        for step in range(int(steps)):
            g = torch.Generator().manual_seed(1000 * step + kv.rank)
            coach.zero_grad()
            model(torch.randn(4, 5, generator=g)).square().sum().backward()
            coach.step(4 * kv.num_workers)
        coach.finish_snapshots()
    else:
        dtype = {k: np.dtype(d) for k, (d, _) in KEYS.items()}
        kv.init(list(KEYS), [np.ones(s, dtype[k]) for k, (_, s) in KEYS.items()])
        for step in range(int(steps)):
            _push(kv, step)
            kv.snapshot(root, step + 1, user_state={"step": step + 1}, keep=int(keep))
        kv.finish_snapshots()
    if kv.rank == 0:
        print(f"FOLDERS {','.join(sorted(os.listdir(root)))}", flush=True)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def refused(root: str) -> None:
    """Resume from `root`, whose newest snapshot the test spoiled: CheckpointError on
    every worker (`CAUGHT CheckpointError on worker R: ...`), and every value as it was
    (`UNCHANGED worker R`)."""
    kv = _create()
    dtype = {k: np.dtype(d) for k, (d, _) in KEYS.items()}
    kv.init(list(KEYS), [np.full(s, 3, dtype[k]) for k, (_, s) in KEYS.items()])
    kv.set_optimizer(gpukv.optim.Adam(learning_rate=0.01, multi_precision=True))
    before = _digest(kv)
    try:
        kv.resume(root)
    except gpukv.CheckpointError as exc:
        print(f"CAUGHT CheckpointError on worker {kv.rank}: {exc}", flush=True)
    else:
        raise AssertionError("the spoiled snapshot was loaded")
    if _digest(kv) == before:
        print(f"UNCHANGED worker {kv.rank}", flush=True)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def loads_differ(root: str) -> None:
    """Snapshots of steps 1 and 2, then worker 0 loads step 1's and the others step 2's:
    a PeerMismatchError on every worker naming both folders, well within the timeout,
    before anything is read (`CAUGHT PeerMismatchError on worker R after S s: ...`)."""
    kv = _create()
    dtype = {k: np.dtype(d) for k, (d, _) in KEYS.items()}
    kv.init(list(KEYS), [np.ones(s, dtype[k]) for k, (_, s) in KEYS.items()])
    kv.set_optimizer(gpukv.optim.Adam(learning_rate=0.01, multi_precision=True))
    for step in (1, 2):
        _push(kv, step)
        kv.snapshot(root, step)
    kv.finish_snapshots()
    first, second = snapshots.complete_snapshots(root)
    assert (first.step, second.step) == (1, 2), (first, second)
    kv.load(second)  # the same snapshot everywhere: loaded
    start = time.monotonic()
    try:
        kv.load(first if kv.rank == 0 else second)
    except gpukv.PeerMismatchError as exc:
        print(f"CAUGHT PeerMismatchError on worker {kv.rank} after "
              f"{time.monotonic() - start:.2f} s: {exc}", flush=True)
    else:
        raise AssertionError("workers loaded snapshots of different steps")
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def snapshot_refused_on_one(root: str, how: str) -> None:
    """Worker 1 alone makes a snapshot call it refuses ('step': a step below its last;
    'state': a user_state that is no dict): its own error there, a PeerMismatchError
    naming the refusal on the others at once (`CAUGHT ... after S s`); a user_state is
    agreed on inside the call, where the others' error says another worker's cannot be
    saved, and the store goes on: the next snapshot, made alike, is taken."""
    kv = _create()
    kv.init("w", np.ones(4, np.float32))
    kv.snapshot(root, 2)
    kv.finish_snapshots()
    args: dict = {"step": 3}
    if kv.rank == 1:
        args = {"step": 1} if how == "step" else {"step": 3, "user_state": [1]}
    start = time.monotonic()
    try:
        kv.snapshot(root, **args)
        raise AssertionError("a snapshot worker 1 refused was taken")
    except (gpukv.PeerMismatchError, gpukv.ArgumentError, gpukv.ArgumentKindError) as exc:
        print(f"CAUGHT {type(exc).__name__} on worker {kv.rank} after "
              f"{time.monotonic() - start:.2f} s: {exc}", flush=True)
    if how == "state":  # (agreed inside the call: the store goes on)
        kv.snapshot(root, 4)
        kv.finish_snapshots()
        assert snapshots.latest_snapshot(root).step == 4
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


def threads(root: str) -> None:
    """Two threads of each worker snapshot three times each at once, with no step: each
    call takes the step after the store's last snapshot, whichever thread took it, on
    every worker alike (`STEPS s1,s2,...` of the complete snapshots, once written)."""
    import threading
    kv = _create()
    kv.init("w", np.ones(4, np.float32))

    def snapshots_of_one_thread():
        for _ in range(3):
            kv.snapshot(root, keep=None)
    workers = [threading.Thread(target=snapshots_of_one_thread) for _ in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    kv.finish_snapshots()
    if kv.rank == 0:
        steps = [s.step for s in snapshots.complete_snapshots(root)]
        print(f"STEPS {','.join(map(str, steps))}", flush=True)
    print(f"PASS worker {kv.rank} of {kv.num_workers}", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])

"""`gpukv demo`: MXNet's KVStore tutorial, checked step by step, then a short training.

1. The tutorial (push, pull, lists of devices, an updater, lists of keys) on NumPy arrays
   with a 'local' store, exactly as written; again with CuPy arrays spread over the GPUs
   and a 'device' store when there are GPUs. Every value pulled is printed and compared
   with the expected one; what the tutorial's updater prints is shown under its step.
2. Data-parallel training of a small MLP (binary classification of synthetic data): one
   data shard per device, each device computes its gradient, the gradients are pushed to
   the store, an SGD optimizer updates the weights there, every device pulls them back.
   With PyTorch installed, torch replicas (one per device) are trained by
   `gpukv.torch.Trainer`: on the CPU for host devices, on CUDA when the demo's devices are
   GPUs that PyTorch sees. Otherwise the weights are arrays pushed to the store directly:
   on every GPU (CuPy) when there are some, else on host "devices" (NumPy).
3. With `--dist`, inside an MPI job (`mpiexec -n 3 python -m gpukv demo --dist`): the
   same training across processes on a `dist_sync` store, each process one worker (one
   CPU replica, or NumPy arrays without PyTorch) with its own data shard; the workers
   serve the keys, or with `--num-servers S` the first S processes do. Only worker 0
   prints; the tutorial is not run. Without mpiexec it trains one worker.

Exit status: 0 when every tutorial value matches and the trained weights have a lower
loss than the initial ones (on every device, or every worker, alike), 1 otherwise. Only
NumPy is needed (PyTorch is used when it imports; --dist needs mpi4py); tqdm or rich draw
a progress bar when installed and stderr is a terminal.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import math
import sys
import time

import numpy as np

import gpukv

from .benchutil import ArgumentParser, nonnegative_float, nonnegative_int, positive_int

# ------------------------------------------------------------------------------ devices


class _Place:
    """Where the demo's arrays live: host "devices" (NumPy) or GPUs (CuPy)."""

    def __init__(self, n: int, gpus: list):
        self.n = n
        self.gpus = gpus
        self.xp = gpus[0].xp if gpus else np  # the devices' array module

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpus)

    def describe(self) -> str:
        if not self.gpus:
            return f"{self.n} host device(s) (NumPy)"
        ids = sorted({g.physical for g in self.gpus[:self.n]})
        return f"{self.n} device(s) on GPU(s) {ids} (CuPy)"

    def context(self, i: int):
        """A context that makes device i current (a no-op on the host)."""
        if not self.gpus:
            return contextlib.nullcontext()
        return self.gpus[i % len(self.gpus)].activate()

    def put(self, i: int, array: np.ndarray):
        """A copy of the host array `array` on device i."""
        if not self.gpus:
            return np.array(array)
        with self.context(i):
            return self.xp.asarray(array)

    def full(self, i: int, shape, value, dtype=np.float64):
        return self.put(i, np.full(shape, value, dtype))


def _to_host(array) -> np.ndarray:
    from ..device.cuda.device import to_numpy
    return to_numpy(array)


def _pick_devices(args) -> _Place:
    gpus = []
    if not args.cpu:
        from ..device.cuda.device import gpu_count, gpu_devices
        if gpu_count():
            gpus = gpu_devices()
    n = args.devices if args.devices is not None else (len(gpus) if gpus else 4)
    return _Place(n, gpus)


# ----------------------------------------------------------------------------- tutorial


class _Checker:
    """Prints each step with the value obtained and counts the ones that differ.

    What the tutorial's updater prints goes to `printed` and is shown indented under the
    row of the step that ran it, so that it does not break up the table.
    """

    CODE_WIDTH = 60  # the longest step's code fits: every "->" lines up

    def __init__(self, out):
        self.out = out
        self.printed = io.StringIO()
        self.mismatches = 0
        self.steps = 0

    def _row(self, code: str, shown: str, ok: bool, verdict: str) -> None:
        self.steps += 1
        print(f"  {code:<{self.CODE_WIDTH}} -> {shown}   {verdict}", file=self.out)
        for line in self.printed.getvalue().splitlines():
            print(f"      printed: {line}", file=self.out)
        self.printed.seek(0)
        self.printed.truncate()
        if not ok:
            self.mismatches += 1

    @staticmethod
    def _summary(value: np.ndarray) -> str:
        flat = value.reshape(-1)
        if flat.size and np.all(flat == flat[0]):
            return f"all {flat[0]:g}"
        return np.array2string(value, precision=4, separator=", ").replace("\n", "")

    def check(self, code: str, got, expected: float) -> None:
        values = [_to_host(g) for g in (got if isinstance(got, list) else [got])]
        ok = all(v.shape == (2, 3) and np.all(v == expected) for v in values)
        shown = self._summary(values[0]) if len(values) == 1 else \
            f"[{len(values)} arrays] " + ", ".join(self._summary(v) for v in values)
        verdict = "ok" if ok else f"MISMATCH: expected all {expected:g}"
        self._row(code, shown, ok, verdict)

    def expect_calls(self, code: str, got: list, expected: list) -> None:
        ok = got == expected
        verdict = "ok" if ok else f"MISMATCH: expected {expected}"
        self._row(code, f"updater called for {got}", ok, verdict)


def run_tutorial(place: _Place, out=None) -> bool:
    """MXNet's KVStore tutorial on `place`; True when every value is the expected one."""
    out = sys.stdout if out is None else out
    store = "device" if place.on_gpu else "local"
    ndev = 4  # "one value per device", spread round-robin over the GPUs
    if place.on_gpu:
        ids = sorted({g.physical for g in place.gpus})
        where = f"CuPy arrays spread over GPU(s) {ids}"
    else:
        where = "NumPy arrays"
    print(f"tutorial: gpukv.create({store!r}) with {where}", file=out)
    check = _Checker(out)
    shape = (2, 3)
    kv = gpukv.create(store)
    kv.init(3, place.full(0, shape, 2.0))
    a = place.full(0, shape, 0.0)
    kv.pull(3, out=a)
    check.check("kv.init(3, ones*2); kv.pull(3, out=a)", a, 2)
    kv.push(3, place.full(0, shape, 8.0))
    kv.pull(3, out=a)
    check.check("kv.push(3, ones*8); kv.pull(3, out=a)", a, 8)
    b = [place.full(i, shape, 1.0) for i in range(ndev)]
    kv.push(3, b)
    kv.pull(3, out=a)
    check.check(f"kv.push(3, [ones]*{ndev}); kv.pull(3, out=a)", a, ndev)
    calls = []

    def update(key, input, stored):
        print(f"update on key: {key}", file=check.printed)
        calls.append(key)
        stored += input * 2

    kv.set_updater(update)
    kv.pull(3, out=a)
    check.check("kv.set_updater(update); kv.pull(3, out=a)", a, ndev)
    kv.push(3, place.full(0, shape, 1.0))
    kv.pull(3, out=a)
    check.check("kv.push(3, ones); kv.pull(3, out=a)", a, ndev + 2)
    check.expect_calls("(updater calls of that push)", calls, [3])
    b = [place.full(i, shape, 1.0) for i in range(ndev)]
    kv.pull(3, out=b)
    check.check(f"kv.pull(3, out=[ones]*{ndev})", b, ndev + 2)
    keys = [5, 7, 9]
    kv.init(keys, [place.full(0, shape, 1.0)] * len(keys))
    del calls[:]
    kv.push(keys, [place.full(0, shape, 1.0)] * len(keys))
    check.expect_calls("kv.init(keys, ones); kv.push(keys, ones)", calls, keys)
    b = [place.full(0, shape, 0.0) for _ in keys]
    kv.pull(keys, out=b)
    check.check("kv.pull(keys, out=b); b[1]", b[1], 3)
    b = [[place.full(i, shape, 1.0) for i in range(ndev)] for _ in keys]
    kv.push(keys, b)
    kv.pull(keys, out=b)
    check.check(f"kv.push(keys, [[ones]*{ndev}]*3); kv.pull(keys, out=b); b[1][1]",
                b[1][1], 3 + 2 * ndev)
    if check.mismatches:
        print(f"tutorial: {check.mismatches} of {check.steps} steps MISMATCH", file=out)
        return False
    print(f"tutorial: all {check.steps} steps match", file=out)
    return True


# ----------------------------------------------------------------------------- training


def _make_data(n_samples: int, n_features: int, seed: int):
    """Points in a box labelled by a fixed nonlinear rule (a small MLP can learn it)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_samples, n_features))
    score = x[:, 0] * x[:, 1] + 0.8 * x[:, 2] - 0.5 * x[:, 3] ** 2 + 0.5
    y = (score > 0).astype(np.float64)
    return x, y


def _init_params(n_features: int, hidden: int, seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    return {
        "w1": rng.standard_normal((n_features, hidden)) / math.sqrt(n_features),
        "b1": np.zeros(hidden),
        "w2": rng.standard_normal((hidden, 1)) / math.sqrt(hidden),
        "b2": np.zeros(1),
    }


def _loss_and_grads(xp, p: dict, x, y):
    """Binary cross-entropy of a tanh MLP on (x, y), and its gradient (means over the shard)."""
    h = xp.tanh(x @ p["w1"] + p["b1"])
    z = (h @ p["w2"] + p["b2"])[:, 0]
    loss = xp.mean(xp.maximum(z, 0) - y * z + xp.log1p(xp.exp(-xp.abs(z))))
    sigmoid = 0.5 * (1.0 + xp.tanh(0.5 * z))  # = 1 / (1 + exp(-z)), without overflow
    dz = (sigmoid - y)[:, None] / x.shape[0]
    dh = (dz @ p["w2"].T) * (1 - h * h)
    grads = {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ dz, "b2": dz.sum(0)}
    correct = xp.sum((z > 0) == (y > 0.5))
    return loss, correct, grads


def _set_sgd(kv, lr: float, momentum: float, rescale: float) -> str:
    """Give `kv` gpukv.optim.SGD with these options; returns how to print it."""
    from ..optim import SGD
    kv.set_optimizer(SGD(learning_rate=lr, momentum=momentum, rescale_grad=rescale))
    return f"gpukv.optim.SGD(learning_rate={lr}, momentum={momentum}, rescale_grad={rescale:g})"


class _Progress:
    """A progress bar (tqdm or rich) when asked for or on a terminal, else nothing.

    Lines always go to `out` (through the bar's writer when there is one), so the loss
    log reads the same with or without a bar.
    """

    def __init__(self, total: int, kind: str, out):
        self.out = out
        self._bar = None
        self._rich = None
        if kind == "auto":
            kind = "tqdm" if sys.stderr.isatty() else "plain"
            fallbacks: tuple[str, ...] = ("tqdm", "rich")
        else:
            fallbacks = (kind,)
        if kind == "plain":
            return
        for name in fallbacks:
            try:
                if name == "tqdm":
                    from tqdm import tqdm
                    self._bar = tqdm(total=total, desc="training", unit="step",
                                     file=sys.stderr, leave=False)
                else:
                    from rich.progress import Progress
                    self._rich = Progress(transient=True)
                    self._rich.start()
                    self._task = self._rich.add_task("training", total=total)
                return
            except ImportError:
                continue
        print(f"gpukv demo: {kind} is not installed; printing plain progress",
              file=sys.stderr)

    def line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.out)
        elif self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.out, flush=True)

    def advance(self, loss: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self._bar.update(1)
        elif self._rich is not None:
            self._rich.update(self._task, advance=1, description=f"training loss {loss:.4f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._rich is not None:
            self._rich.stop()


FEATURES, HIDDEN, PER_DEVICE = 8, 32, 512  # the MLP and the samples of each data shard


def _problem(n: int, seed: int) -> tuple:
    """(initial weights, one (x, y) shard per device or worker), in float32."""
    x, y = (a.astype(np.float32) for a in _make_data(n * PER_DEVICE, FEATURES, seed))
    params = {k: v.astype(np.float32) for k, v in _init_params(FEATURES, HIDDEN, seed).items()}
    data = [(x[i * PER_DEVICE:(i + 1) * PER_DEVICE], y[i * PER_DEVICE:(i + 1) * PER_DEVICE])
            for i in range(n)]
    return params, data


def _describe_training(n: int, per: str, where: str) -> str:
    return (f"training: a {FEATURES}-{HIDDEN}-1 MLP on {n * PER_DEVICE} samples, "
            f"{PER_DEVICE} per {per}, on {where}")


def run_training(place: _Place, steps: int, lr: float, progress: str = "auto",
                 out=None, seed: int = 0) -> bool:
    """Data-parallel training on `place`; True when the loss of the trained weights is
    below the loss of the initial ones (and every device pulled the same weights).

    With PyTorch it trains torch replicas through `gpukv.torch.Trainer`; without it (or
    on GPUs PyTorch cannot reach) it trains arrays pushed to the store directly.
    """
    out = sys.stdout if out is None else out
    params, data = _problem(place.n, seed)
    devices = _torch_devices(place)
    engine = _ArrayTraining(place, params, data, lr) if devices is None else \
        _TrainerTraining(devices, params, data, lr, "device" if place.on_gpu else "local")
    print(_describe_training(place.n, "device", engine.where(place)), file=out)
    return _train_and_judge(engine, steps, progress, out, place.n * PER_DEVICE,
                            "the devices pulled different weights")


def _train_and_judge(engine, steps: int, progress: str, out, samples: int,
                     different: str) -> bool:
    """Train, then print and return the verdict: the loss fell, the weights agree."""
    print(engine.header(), file=out)
    first, elapsed = _train(engine, steps, progress, out, samples)
    consistent = engine.same_weights()
    # Step lines show the loss before each update: judge the weights the training ended with.
    final, accuracy = engine.final_loss()
    print(f"{'final':<14}loss {final:.4f}  accuracy {accuracy:.1%}", file=out)
    fell = math.isfinite(final) and final < first
    if fell:
        print(f"training: loss fell from {first:.4f} to {final:.4f} in {steps} steps "
              f"({elapsed:.2f} s)   ok", file=out)
    else:
        print(f"training: loss went from {first:.4f} to {final:.4f} in {steps} steps   "
              "FAILED: the loss did not fall", file=out)
    if not consistent:
        print(f"training: FAILED: {different}", file=out)
    return fell and consistent


def _train(engine, steps: int, progress: str, out, samples: int) -> tuple:
    """Run `steps` steps of `engine`, logging the loss; (first loss, seconds taken)."""
    every = max(1, steps // 10)
    bar = _Progress(steps, progress, out)
    first = None
    started = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            loss, correct = engine.step()  # the loss before this step's update
            if first is None:
                first = loss
            if not math.isfinite(loss):
                bar.line(f"step {step:4d}/{steps}  loss {loss}  (not finite)")
                break
            bar.advance(loss)
            if step == 1 or step % every == 0 or step == steps:
                bar.line(f"step {step:4d}/{steps}  loss {loss:.4f}  "
                         f"accuracy {correct / samples:.1%}")
    finally:
        bar.close()
    return first, time.perf_counter() - started


class _ArrayTraining:
    """Training written against the store: each device computes its gradient (NumPy or
    CuPy), pushes it, SGD runs on the store, every device pulls the new weights."""

    def __init__(self, place: _Place, params: dict, data: list, lr: float):
        self.place = place
        self.names = list(params)
        self.store = "device" if place.on_gpu else "local"
        self.kv = gpukv.create(self.store)
        self.kv.init(self.names, [place.put(0, params[k]) for k in self.names])
        self.opt = _set_sgd(self.kv, lr, 0.9, 1.0 / place.n)
        # Each device: its shard of the data and its own copy of the weights.
        self.shards = [(place.put(i, x), place.put(i, y)) for i, (x, y) in enumerate(data)]
        self.local = [{k: place.put(i, params[k]) for k in self.names} for i in range(place.n)]

    def where(self, place: _Place) -> str:
        return place.describe()

    def header(self) -> str:
        return (f"training: gpukv.create({self.store!r}), {len(self.names)} keys "
                f"{self.names}, {self.opt}")

    def step(self) -> tuple:
        losses, corrects, grads = [], [], []
        for i in range(self.place.n):
            with self.place.context(i):
                loss, correct, g = _loss_and_grads(self.place.xp, self.local[i], *self.shards[i])
            losses.append(loss)
            corrects.append(correct)
            grads.append(g)
        names = self.names
        self.kv.push(names, [[g[k] for g in grads] for k in names])  # summed, then SGD
        self.kv.pull(names, out=[[p[k] for p in self.local] for k in names])
        return sum(float(v) for v in losses) / self.place.n, sum(int(c) for c in corrects)

    def final_loss(self) -> tuple:
        """(loss, accuracy) of the weights each device pulled last, over all the shards."""
        losses, correct, samples = [], 0, 0
        for i, (x, y) in enumerate(self.shards):
            with self.place.context(i):
                loss, right, _ = _loss_and_grads(self.place.xp, self.local[i], x, y)
            losses.append(float(loss))
            correct += int(right)
            samples += int(x.shape[0])
        return sum(losses) / len(losses), correct / samples

    def same_weights(self) -> bool:
        first = {k: _to_host(v) for k, v in self.local[0].items()}
        return all(np.array_equal(first[k], _to_host(v))
                   for p in self.local[1:] for k, v in p.items())


def _torch_devices(place: _Place):
    """The torch device of each replica, or None when the array path must train: PyTorch
    is not installed, or the demo's devices are GPUs that PyTorch does not see."""
    try:
        import torch

        import gpukv.torch  # noqa: F401  (fails when PyTorch is missing or broken)
    except ImportError:
        return None
    if not place.on_gpu:
        return [torch.device("cpu")] * place.n
    ids = [place.gpus[i % len(place.gpus)].physical for i in range(place.n)]
    if not torch.cuda.is_available() or max(ids) >= torch.cuda.device_count():
        return None
    return [torch.device("cuda", i) for i in ids]


class _TrainerTraining:
    """The same MLP as torch replicas (one per device) trained by gpukv.torch.Trainer:
    backward on each shard, then `trainer.step(batch)` pushes, runs SGD and pulls."""

    def __init__(self, devices: list, params: dict, data: list, lr: float, store,
                 batch: int | None = None):
        import torch

        import gpukv.torch
        self.torch = torch
        self.devices = devices
        self.models = [_torch_mlp(params, d) for d in devices]
        self.shards = [(torch.from_numpy(x).to(d), torch.from_numpy(y).to(d))
                       for d, (x, y) in zip(devices, data)]
        # The batch step() divides by: every sample of the step (those of every worker).
        self.samples = batch or sum(len(x) for x, _ in data)
        kv = store if isinstance(store, gpukv.KVStore) else gpukv.create(store)
        self.store = kv.type
        self.lr = lr
        from ..optim import SGD
        self.trainer = gpukv.torch.Trainer(self.models, SGD(learning_rate=lr, momentum=0.9),
                                           kvstore=kv)

    def where(self, place: _Place) -> str:
        kind = "CUDA" if self.devices[0].type == "cuda" else "CPU"
        return f"{len(self.devices)} {kind} replica(s) (PyTorch {self.torch.__version__})"

    def header(self) -> str:
        return (f"training with gpukv.torch.Trainer on {len(self.models)} replicas: "
                f"gpukv.create({self.store!r}), keys {self.trainer.keys}, "
                f"gpukv.optim.SGD(learning_rate={self.lr}, momentum=0.9), "
                f"step(batch_size={self.samples})")

    def _loss(self, model, x, y):
        """Summed binary cross-entropy over the shard and the right answers (tensors)."""
        z = model(x)[:, 0]
        loss = self.torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="sum")
        return loss, ((z > 0) == (y > 0.5)).sum()

    def step(self) -> tuple:
        self.trainer.zero_grad()
        losses, correct = [], 0
        for model, (x, y) in zip(self.models, self.shards):
            loss, right = self._loss(model, x, y)
            loss.backward()  # a sum: step() divides by the whole batch
            losses.append(loss.item() / len(x))
            correct += int(right)
        self.trainer.step(self.samples)
        return sum(losses) / len(losses), correct

    def final_loss(self) -> tuple:
        losses, correct = [], 0
        with self.torch.no_grad():
            for model, (x, y) in zip(self.models, self.shards):
                loss, right = self._loss(model, x, y)
                losses.append(loss.item() / len(x))
                correct += int(right)
        return sum(losses) / len(losses), correct / self.samples

    def same_weights(self) -> bool:
        first = [p.detach().cpu() for p in self.models[0].parameters()]
        return all(self.torch.equal(a, b.detach().cpu())
                   for m in self.models[1:] for a, b in zip(first, m.parameters()))

    def weights(self) -> list:
        """The first replica's weights, as NumPy arrays."""
        return [p.detach().cpu().numpy() for p in self.models[0].parameters()]


def _torch_mlp(params: dict, device):
    """A torch module computing the demo's MLP from `params` (w1, b1, w2, b2), on device."""
    import torch

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, value in params.items():
                self.register_parameter(name, torch.nn.Parameter(
                    torch.from_numpy(np.array(value)).to(device)))

        def forward(self, x):
            return torch.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2

    return MLP()


# ------------------------------------------------------------------ across processes


class _DistTraining:
    """One worker of an MPI job: an engine of the one-process demo (gpukv.torch.Trainer
    with PyTorch, else arrays pushed to the store) on this worker's data shard and a
    dist_sync store; losses and right answers are summed over the workers, and the check
    that they hold the same weights compares digests, with mpi4py."""

    def __init__(self, kv, comm, params: dict, shard: tuple, lr: float):
        self.kv = kv
        self.comm = comm
        devices = _torch_devices(_Place(1, []))
        self.inner = (_ArrayWorker(kv, params, shard, lr) if devices is None else
                      _TrainerTraining(devices, params, [shard], lr, kv,
                                       batch=len(shard[0]) * kv.num_workers))

    def where(self, place=None) -> str:
        servers = self.kv.num_servers
        serving = f"{servers} dedicated server(s)" if servers else "each serving a shard"
        kind = "NumPy" if isinstance(self.inner, _ArrayWorker) else "PyTorch"
        return f"{self.kv.num_workers} worker process(es), {serving} ({kind})"

    def header(self) -> str:
        return self.inner.header()

    def _summed(self, loss, correct) -> tuple:
        """(mean loss over the workers, right answers over every shard)."""
        total = self.comm.allreduce(np.array([float(loss), float(correct)]))
        return float(total[0]) / self.kv.num_workers, int(total[1])

    def step(self) -> tuple:
        return self._summed(*self.inner.step())

    def final_loss(self) -> tuple:
        loss, accuracy = self.inner.final_loss()  # its right answers / every worker's samples
        loss, _ = self._summed(loss, 0)
        return loss, float(self.comm.allreduce(accuracy))

    def same_weights(self) -> bool:
        digest = hashlib.sha256()
        for w in self.inner.weights():
            digest.update(np.ascontiguousarray(w).tobytes())
        return len(set(self.comm.allgather(digest.hexdigest()))) == 1


class _ArrayWorker:
    """The array training of one worker on a dist store: its gradient is pushed, SGD
    runs where the keys are served, the new weights are pulled."""

    def __init__(self, kv, params: dict, shard: tuple, lr: float):
        self.kv = kv
        self.names = list(params)
        self.local = {k: np.array(v) for k, v in params.items()}
        self.shard = shard
        kv.init(self.names, [self.local[k] for k in self.names])  # rank 0's values win
        self.opt = _set_sgd(kv, lr, 0.9, 1.0 / kv.num_workers)
        kv.pull(self.names, out=[self.local[k] for k in self.names])

    def header(self) -> str:
        return (f"training: gpukv.create({self.kv.type!r}, num_servers="
                f"{self.kv.num_servers}), {len(self.names)} keys {self.names}, {self.opt}")

    def step(self) -> tuple:
        loss, correct, grads = _loss_and_grads(np, self.local, *self.shard)
        self.kv.push(self.names, [grads[k] for k in self.names])  # summed, then SGD
        self.kv.pull(self.names, out=[self.local[k] for k in self.names])
        return loss, correct

    def final_loss(self) -> tuple:
        loss, correct, _ = _loss_and_grads(np, self.local, *self.shard)
        return float(loss), int(correct) / (len(self.shard[0]) * self.kv.num_workers)

    def weights(self) -> list:
        return [self.local[k] for k in self.names]


def _workers_comm(kv):
    """An MPI communicator of the workers: the first kv.num_servers ranks are servers,
    whose `gpukv.create` never returned."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if kv.num_servers == 0:
        return world
    workers = world.Get_group().Range_incl([(kv.num_servers, world.Get_size() - 1, 1)])
    return world.Create_group(workers)


def _world_rank() -> int:
    try:
        from mpi4py import MPI
    except ImportError:
        return 0
    return MPI.COMM_WORLD.Get_rank()


def run_dist(args) -> int:
    """`gpukv demo --dist`: this process's part of the training across an MPI job; the
    exit status, the same on every worker (servers end inside gpukv.create)."""
    try:
        kv = gpukv.create("dist_sync", num_servers=args.num_servers)
    except gpukv.BackendError as exc:  # no mpi4py
        print(f"gpukv demo --dist: {exc}", file=sys.stderr)
        return 1
    except gpukv.ArgumentError as exc:  # e.g. more servers than processes
        if _world_rank() == 0:
            print(f"gpukv demo --dist: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout if kv.rank == 0 else io.StringIO()  # only worker 0 speaks
    progress = args.progress if kv.rank == 0 else "plain"
    params, data = _problem(kv.num_workers, args.seed)
    engine = _DistTraining(kv, _workers_comm(kv), params, data[kv.rank], args.lr)
    processes = kv.num_workers + kv.num_servers
    print(f"gpukv {gpukv.__version__} demo across {processes} MPI process(es)", file=out)
    print(_describe_training(kv.num_workers, "worker", engine.where()), file=out)
    ok = _train_and_judge(engine, args.steps, progress, out, kv.num_workers * PER_DEVICE,
                          "the workers hold different weights")
    print("demo: OK" if ok else "demo: FAILED", file=out)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="gpukv demo",
        description="Run the gpukv tutorial and a short data-parallel training, checking "
                    "every result (exit status 1 on any mismatch, or if the training does not end "
                    "with a lower loss than it started with).")
    parser.add_argument("--devices", type=positive_int, default=None, metavar="N",
                        help="devices to train on (default: every GPU, or 4 host devices)")
    parser.add_argument("--steps", type=positive_int, default=60,
                        help="training steps (default: 60)")
    parser.add_argument("--lr", type=nonnegative_float, default=0.5,
                        help="learning rate, a finite number >= 0 (default: 0.5)")
    parser.add_argument("--cpu", action="store_true", help="use host devices even with GPUs")
    parser.add_argument("--progress", choices=["auto", "tqdm", "rich", "plain"], default="auto",
                        help="progress display (default: a bar on a terminal when tqdm or "
                             "rich is installed)")
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="seed of the synthetic data (an int >= 0)")
    parser.add_argument("--skip-tutorial", action="store_true", help="only train")
    parser.add_argument("--dist", action="store_true",
                        help="train across the processes of an MPI job on a dist_sync store "
                             "(mpiexec -n 3 python -m gpukv demo --dist): one worker per "
                             "process, worker 0 prints; no tutorial")
    parser.add_argument("--num-servers", type=nonnegative_int, default=None, metavar="S",
                        help="with --dist: the first S processes are dedicated servers "
                             "(default: GPUKV_NUM_SERVERS, else 0: every process serves a "
                             "shard of the keys)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when everything checked out, 1 otherwise."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.dist:
        if args.devices is not None:
            parser.error("--devices: with --dist each process is one worker; choose the "
                         "workers with mpiexec -n")
        return run_dist(args)
    if args.num_servers is not None:
        parser.error("--num-servers needs --dist")
    try:
        return run_local(args)
    except gpukv.ArgumentError as exc:  # a malformed setting (GPUKV_DETERMINISTIC=maybe)
        print(f"gpukv demo: {exc}", file=sys.stderr)
        return 2


def run_local(args) -> int:
    """`gpukv demo`: the tutorial and the training on this process's devices; the exit
    status."""
    place = _pick_devices(args)
    print(f"gpukv {gpukv.__version__} demo on {place.describe()}")
    ok = True
    if not args.skip_tutorial:
        ok = run_tutorial(_Place(4, []))
        if place.on_gpu:
            ok = run_tutorial(place) and ok
    ok = run_training(place, args.steps, args.lr, args.progress, seed=args.seed) and ok
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1

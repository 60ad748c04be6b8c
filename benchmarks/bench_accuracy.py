"""Gradient compression's cost in accuracy: every compressor against plain PyTorch, on real data.

    python benchmarks/bench_accuracy.py                      # both models, every way, 3 seeds
    python benchmarks/bench_accuracy.py --models mlp --epochs 5 --seeds 1 --out /tmp/acc
    python benchmarks/bench_accuracy.py --ways torch,uncompressed,2bit,sign
    python benchmarks/bench_accuracy.py --quick --out /tmp/acc   # seconds: the tests' run
    python benchmarks/bench_accuracy.py --optimizer adam          # Adam, lr 0.001 (nag, rmsprop)
    python benchmarks/bench_accuracy.py --amp --ways torch,uncompressed,sign  # float16

The data are scikit-learn's bundled digits (1797 8x8 images, 10 classes, no download):
a stratified 80/20 split (seed 0), pixels scaled to [0, 1]. Two models: an MLP
64-512-512-10 (301,066 parameters) and a small CNN on the 1x8x8 images (conv 1->32 and
32->64, 3x3 pad 1, max-pool 2, 1024->116->10: 138,886 parameters). Every way trains with
the same optimizer (SGD with momentum 0.9, lr 0.05; or `--optimizer`: nag, the same with
Nesterov's momentum; adam, betas 0.9 and 0.999, lr 0.001; rmsprop, centered, decay and
momentum 0.9, lr 0.001), learning rate, batches and initial weights (per seed):
- torch: plain PyTorch, one model on the whole batch, torch.optim's, mean cross-entropy;
- uncompressed: `gpukv.torch.Trainer` over 4 CPU replicas (`--replicas`) on a 'device'
  store, each replica a quarter of the batch with a per-sample-sum loss and
  `step(batch_size)` rescaling by 1/batch: the same arithmetic as torch;
- one way per compressor type the registry offers (`type_names()`), at its default
  options (a type registered later is picked up with no change here), and MXNet's 2bit
  and 1bit at threshold 0.5 ('2bit-t0.5', '1bit-t0.5') should their default threshold
  differ from it (today it does not: no such way is made).
Measured per way, model and seed: the test accuracy after every epoch, the seconds of
every epoch's training (wall), and the bytes a replica sends per step each way: push,
every key's compressed payload (float32 without compression); pull, the float32 weights
(the payload for a compressor whose class says `compresses_pulls = True`; PowerSGD's P
and Q for its push, each parameter of two or more dimensions its own key). The table gives the
mean over seeds (+- their standard deviation), the change in percentage points against
torch, the bytes against float32's, and the seconds per epoch (median over epochs and
seeds) against the uncompressed Trainer's in the same run; the ways of a seed are trained
in turns. JSON with every curve, and a PNG of the curves (one panel per model, one line
per way, the mean over seeds), go to --out DIR (default benchmarks/results/,
accuracy_<machine>.json; with another optimizer, accuracy_adam_<machine>.json and so on;
a --quick run, accuracy_quick_<machine>.json, never a published full run's name);
the exit status is 1 when a way failed.

`--amp`: every way computes under `torch.autocast` with float16 and scales its loss with a
`torch.amp.GradScaler` of its own (torch: `scaler.step(optimizer)`; the Trainer's ways:
`scaler.step(trainer, batch)`), and the files are named accuracy_amp_<machine>.json.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpukv.torch  # noqa: E402
from gpukv.encoding.compressors import make_compressor, type_names  # noqa: E402


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 4 * 4, 116), nn.ReLU(), nn.Linear(116, 10))


MODELS = {"mlp": _mlp, "cnn": _cnn}
MOMENTUM = 0.9
BETAS = (0.9, 0.999)
DECAY = 0.9  # RMSProp's decay of its mean squares (and mean)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One optimizer on both sides: its default learning rate, its options (as the JSON
    record says them), PyTorch's for (params, lr) and gpukv's (name, options) for lr."""
    lr: float
    options: dict
    torch: Callable
    gpukv: Callable


OPTIMIZERS = {
    "sgd": Rule(0.05, {"momentum": MOMENTUM},
                lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=MOMENTUM),
                lambda lr: ("sgd", {"learning_rate": lr, "momentum": MOMENTUM})),
    "nag": Rule(0.05, {"momentum": MOMENTUM, "nesterov": True},
                lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=MOMENTUM,
                                                   nesterov=True),
                lambda lr: ("nag", {"learning_rate": lr, "momentum": MOMENTUM})),
    "adam": Rule(0.001, {"betas": BETAS},
                 lambda params, lr: torch.optim.Adam(params, lr=lr, betas=BETAS),
                 lambda lr: ("adam", {"learning_rate": lr, "beta1": BETAS[0],
                                      "beta2": BETAS[1]})),
    "rmsprop": Rule(0.001, {"alpha": DECAY, "momentum": MOMENTUM, "centered": True},
                    lambda params, lr: torch.optim.RMSprop(params, lr=lr, alpha=DECAY,
                                                           momentum=MOMENTUM, centered=True),
                    lambda lr: ("rmsprop", {"learning_rate": lr, "gamma1": DECAY,
                                            "gamma2": MOMENTUM, "centered": True})),
}
SPLIT_SEED = 0
TEST_FRACTION = 0.2
EARLY_EPOCH = 5  # the accuracy reported besides the final one
MXNET_THRESHOLD = 0.5  # MXNet's usual threshold for 2bit and 1bit
BASELINE = "torch"
UNCOMPRESSED = "uncompressed"
# --quick: seconds, for the test suite
QUICK = {"seeds": 1, "epochs": 2, "train": 480, "ways": [BASELINE, UNCOMPRESSED, "fp16", "2bit"]}


# ------------------------------------------------------------------------------ ways
def compression_ways() -> dict:
    """Way name -> compression_params: every registered type at its defaults, then 2bit
    and 1bit at MXNet's threshold where their default differs."""
    ways = {name: {"type": name} for name in type_names() if name != "none"}
    for name in ("2bit", "1bit"):
        if name not in ways:
            continue
        try:
            default = make_compressor({"type": name}).params().get("threshold")
        except Exception:  # a broken type fails as a way of its own, below
            continue
        if default is not None and float(default) != MXNET_THRESHOLD:
            ways[f"{name}-t{MXNET_THRESHOLD:g}"] = {"type": name, "threshold": MXNET_THRESHOLD}
    return ways


def all_ways() -> dict:
    """Every way, in table order: name -> compression_params (None: no store, or none)."""
    return {BASELINE: None, UNCOMPRESSED: None, **compression_ways()}


class Precision:
    """float32, or with `amp` float16 autocast and a GradScaler (one per way)."""

    def __init__(self, amp: bool):
        self.amp = amp
        self.scaler = torch.amp.GradScaler("cpu") if amp else None

    def loss(self, loss_fn, model, x, y):
        if not self.amp:
            return loss_fn(model(x), y)
        with torch.autocast("cpu", dtype=torch.float16):
            return loss_fn(model(x), y)

    def backward(self, loss) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer, *args) -> None:
        if self.scaler is None:
            optimizer.step(*args)
            return
        self.scaler.step(optimizer, *args)
        self.scaler.update()


class TorchWay:
    """Plain PyTorch: one model on the whole batch, torch.optim's optimizer, mean loss."""

    def __init__(self, base: nn.Module, lr: float, replicas: int, optimizer: str = "sgd",
                 amp: bool = False):
        self.model = copy.deepcopy(base)
        self.opt = OPTIMIZERS[optimizer].torch(self.model.parameters(), lr)
        self.loss = nn.CrossEntropyLoss()
        self.precision = Precision(amp)

    def step(self, x, y) -> None:
        self.opt.zero_grad()
        self.precision.backward(self.precision.loss(self.loss, self.model, x, y))
        self.precision.step(self.opt)

    def wire(self):
        return None


class TrainerWay:
    """gpukv.torch.Trainer over CPU replicas (deep copies of the model), each a slice of
    the batch with a per-sample-sum loss; `step(batch)` rescales by 1/batch."""

    def __init__(self, base: nn.Module, lr: float, replicas: int, compression=None,
                 optimizer: str = "sgd", amp: bool = False):
        self.replicas = [copy.deepcopy(base) for _ in range(replicas)]
        self.model = self.replicas[0]  # every replica holds the store's weights
        self.compression = compression
        name, params = OPTIMIZERS[optimizer].gpukv(lr)
        self.trainer = gpukv.torch.Trainer(self.replicas, name, params, kvstore="device",
                                           compression_params=compression)
        self.loss = nn.CrossEntropyLoss(reduction="sum")
        self.precision = Precision(amp)

    def step(self, x, y) -> None:
        n = len(self.replicas)
        self.trainer.zero_grad()
        for model, xs, ys in zip(self.replicas, x.tensor_split(n), y.tensor_split(n)):
            self.precision.backward(self.precision.loss(self.loss, model, xs, ys))
        self.precision.step(self.trainer, len(x))

    def key_sizes(self) -> dict:
        """Store key -> its shape (a parameter's own, or the flat size of a bucket)."""
        shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        return {key: shapes[names[0]] if len(names) == 1 else
                (sum(int(np.prod(shapes[n])) for n in names),)
                for key, names in self.trainer.buckets.items()}

    def wire(self) -> dict:
        return wire_bytes(self.key_sizes(), self.compression)


def wire_bytes(key_shapes: dict, compression) -> dict:
    """Bytes one replica sends per step, summed over the keys (`key_shapes`: key ->
    shape): push (the payloads of compressing a float32 zero array of each key's size, a
    residual given where the compressor uses one; PowerSGD's P and Q) and pull (float32,
    as the optimizer runs on the store, or the payloads for a compressor that
    `compresses_pulls`), with float32's bytes for reference."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in key_shapes.values()]
    f32 = sum(4 * n for n in sizes)
    comp = make_compressor(compression) if compression is not None else None
    if comp is None:
        push = f32
    elif comp.low_rank:
        push = sum(comp.nbytes(shape) for shape in key_shapes.values())
    else:
        push = 0
        for n in sizes:
            residual = np.zeros(n, np.float32) if comp.uses_residual else None
            payload, _ = comp.compress(np.zeros(n, np.float32), residual)
            push += int(payload.nbytes)
    both = comp is not None and comp.compresses_pulls
    pull = push if both else f32
    return {"keys": len(key_shapes), "float32_bytes": f32, "push_bytes": push,
            "pull_bytes": pull, "push_over_float32": push / f32, "pull_over_float32": pull / f32,
            "both_ways": both}


def make_way(name: str, compression, base, lr, replicas, optimizer: str = "sgd",
             amp: bool = False):
    if name == BASELINE:
        return TorchWay(base, lr, replicas, optimizer, amp)
    return TrainerWay(base, lr, replicas, compression, optimizer, amp)


# ------------------------------------------------------------------------------ data
def load_data(train_limit: int | None = None) -> dict:
    """The digits: a stratified split (seed 0), pixels in [0, 1], as torch tensors
    (images 1x8x8); `train_limit` keeps a stratified subset of the training part."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED)
    if train_limit is not None and train_limit < len(y_train):
        x_train, _, y_train, _ = train_test_split(
            x_train, y_train, train_size=train_limit, stratify=y_train,
            random_state=SPLIT_SEED)
    return {"x_train": torch.from_numpy(x_train), "y_train": torch.from_numpy(y_train),
            "x_test": torch.from_numpy(x_test), "y_test": torch.from_numpy(y_test)}


def batches(data, batch: int, seed: int, epoch: int):
    """The batches of one epoch: the same shuffle for every way (per seed and epoch)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(data["y_train"]), generator=g)
    for i in range(0, len(order), batch):
        idx = order[i:i + batch]
        yield data["x_train"][idx], data["y_train"][idx]


def accuracy(model: nn.Module, data) -> float:
    with torch.no_grad():
        guess = model(data["x_test"]).argmax(1)
    return float((guess == data["y_test"]).float().mean())


# ------------------------------------------------------------------------------- run
def train_seed(model_name, seed, ways, data, args, records) -> None:
    """Train every way (not failed yet) of one model from one seed's weights, in turns
    epoch by epoch; append each one's curve and epoch times to its record."""
    torch.manual_seed(seed)
    base = MODELS[model_name]()
    live = {}
    for name, compression in ways.items():
        rec = records[name]
        if "error" in rec:
            continue
        try:
            live[name] = make_way(name, compression, base, args.lr, args.replicas,
                                  args.optimizer, args.amp)
            if "wire" not in rec:
                rec["wire"] = live[name].wire()
        except Exception as exc:
            _fail(rec, exc, model_name, seed)
        rec["curves"].append([])
        rec["epoch_s"].append([])
    for epoch in range(args.epochs):
        for name, way in list(live.items()):
            rec = records[name]
            try:
                start = time.perf_counter()
                for x, y in batches(data, args.batch, seed, epoch):
                    way.step(x, y)
                rec["epoch_s"][-1].append(time.perf_counter() - start)
                acc = accuracy(way.model, data)
                if not np.isfinite(acc):
                    raise FloatingPointError("accuracy is not a number")
                rec["curves"][-1].append(acc)
            except Exception as exc:
                _fail(rec, exc, model_name, seed)
                del live[name]
    for name in live:
        curve = records[name]["curves"][-1]
        print(f"  {model_name} seed {seed} {name}: {100 * curve[-1]:.2f}%", file=sys.stderr,
              flush=True)


def _fail(rec, exc, model_name, seed) -> None:
    error = f"{type(exc).__name__}: {exc}"[:300]
    rec["error"] = error
    print(f"FAILED {model_name} {rec['way']} (seed {seed}): {error}", file=sys.stderr,
          flush=True)


def run_model(model_name, ways, data, args) -> list[dict]:
    """Every way's record on one model: curves, epoch times, bytes, and their summary."""
    n_params = sum(p.numel() for p in MODELS[model_name]().parameters())
    records = {name: {"model": model_name, "parameters": n_params, "way": name,
                      "compression": comp, "curves": [], "epoch_s": []}
               for name, comp in ways.items()}
    for name, comp in ways.items():
        if comp is not None:
            try:
                records[name]["compression"] = make_compressor(comp).params()
            except Exception as exc:
                _fail(records[name], exc, model_name, "-")
    for seed in args.seeds:
        train_seed(model_name, seed, ways, data, args, records)
    for rec in records.values():
        summarize(rec, args.epochs)
    base, trainer = records.get(BASELINE), records.get(UNCOMPRESSED)
    for rec in records.values():
        if "error" in rec:
            continue
        for what in ("final", "early"):
            ref = base.get(what) if base and "error" not in base else None
            rec[f"{what}_delta_pp"] = (100 * (rec[what] - ref)) if ref is not None else None
        ref_s = trainer.get("epoch_median_s") if trainer and "error" not in trainer else None
        rec["epoch_over_uncompressed"] = rec["epoch_median_s"] / ref_s if ref_s else None
    return list(records.values())


def summarize(rec: dict, epochs: int) -> None:
    """Mean and spread over seeds of the final and early accuracy, the mean curve, and
    the median seconds per epoch."""
    if "error" in rec:
        return
    finals = [c[-1] for c in rec["curves"]]
    early = min(EARLY_EPOCH, epochs) - 1
    earlies = [c[early] for c in rec["curves"]]
    rec["final"], rec["final_std"] = statistics.fmean(finals), _std(finals)
    rec["final_per_seed"] = finals
    rec["early_epoch"] = early + 1
    rec["early"], rec["early_std"] = statistics.fmean(earlies), _std(earlies)
    rec["mean_curve"] = [statistics.fmean(c[e] for c in rec["curves"]) for e in range(epochs)]
    rec["epoch_median_s"] = statistics.median(s for row in rec["epoch_s"] for s in row)


def _std(values) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


# --------------------------------------------------------------------------- output
def table_row(rec: dict) -> list:
    head = [rec["model"], rec["way"]]
    if "error" in rec:
        return head + ["failed"] + [None] * 10
    wire = rec.get("wire")
    return head + [
        f"{100 * rec['final']:.2f} +- {100 * rec['final_std']:.2f}",
        _pp(rec["final_delta_pp"]), round(100 * rec["early"], 2), _pp(rec["early_delta_pp"]),
        wire and wire["push_bytes"], wire and round(wire["push_over_float32"], 4),
        wire and wire["pull_bytes"], wire and round(wire["pull_over_float32"], 4),
        C.format_seconds(rec["epoch_median_s"]),
        None if rec["epoch_over_uncompressed"] is None
        else round(rec["epoch_over_uncompressed"], 2)]


def _pp(value):
    return None if value is None else round(value, 2)


def plot(records: list[dict], models: list[str], path: Path, optimizer: str = "sgd") -> None:
    """One panel per model: the mean test accuracy over seeds after every epoch, a line
    per way."""
    plt = C.pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model_name in zip(axes[0], models):
        for rec in records:
            if rec["model"] != model_name or "mean_curve" not in rec:
                continue
            curve = [100 * a for a in rec["mean_curve"]]
            style = ({"color": "black", "linestyle": "--", "zorder": 3} if rec["way"] == BASELINE
                     else {})  # the baseline on top of the ways that match it
            ax.plot(range(1, len(curve) + 1), curve, marker=".", label=rec["way"], **style)
        params = next((r["parameters"] for r in records if r["model"] == model_name), 0)
        ax.set_title(f"{model_name} ({params:,} parameters)")
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("test accuracy (%), mean over seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"digits: test accuracy of every gradient compressor ({optimizer})")
    C.save_figure(fig, path)


def _learning_rate(text: str) -> float:
    """A finite learning rate above 0 (argparse names the option in the error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise C.BadArgument(f"expected a finite number above 0, got {text.strip()!r}")
    return value


def build_parser():
    ways = all_ways()
    p = C.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--models", type=C.name_list(MODELS, "model"), default=",".join(MODELS),
                   metavar="NAMES",
                   help=f"models among {', '.join(MODELS)}, comma-separated (default: all)")
    p.add_argument("--ways", type=C.name_list(ways, "way"), default=None, metavar="NAMES",
                   help=f"ways among {', '.join(ways)}, comma-separated (default: all; "
                        f"{BASELINE} and {UNCOMPRESSED}, the baselines, are always run)")
    p.add_argument("--epochs", type=C.positive_int, default=None, metavar="N",
                   help="epochs per way and seed (default 20; 2 with --quick)")
    p.add_argument("--seeds", type=C.positive_int, default=None, metavar="N",
                   help="seeds 0..N-1, each its own initial weights and shuffles "
                        "(default 3; 1 with --quick)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd",
                   help="every way's optimizer: sgd (momentum 0.9, the default), nag (the "
                        "same, Nesterov's), adam (betas 0.9 and 0.999) or rmsprop "
                        "(centered, decay 0.9, momentum 0.9)")
    p.add_argument("--lr", type=_learning_rate, default=None, metavar="LR",
                   help="learning rate of every way (default 0.05 with sgd and nag, 0.001 "
                        "with adam and rmsprop)")
    p.add_argument("--batch", type=C.positive_int, default=64, metavar="N",
                   help="global batch size, split over the replicas (default 64)")
    p.add_argument("--replicas", type=C.positive_int, default=4, metavar="N",
                   help="CPU replicas of the Trainer's ways (default 4)")
    p.add_argument("--amp", action="store_true",
                   help="float16 autocast and a torch.amp.GradScaler in every way")
    p.add_argument("--threads", type=C.positive_int, default=1, metavar="N",
                   help="torch.set_num_threads (default 1)")
    p.add_argument("--quick", action="store_true",
                   help=f"a run of seconds: {QUICK['seeds']} seed, {QUICK['epochs']} epochs, "
                        f"{QUICK['train']} training images, ways {','.join(QUICK['ways'])} "
                        f"(options given still apply)")
    C.add_out_option(p, "accuracy_<machine>.json and .png")
    return p


def settings(args) -> None:
    """Fill in what --quick or the defaults decide."""
    quick = args.quick
    if args.lr is None:
        args.lr = OPTIMIZERS[args.optimizer].lr
    args.epochs = args.epochs or (QUICK["epochs"] if quick else 20)
    args.seeds = list(range(args.seeds or (QUICK["seeds"] if quick else 3)))
    args.train_limit = QUICK["train"] if quick else None
    names = args.ways or (QUICK["ways"] if quick else list(all_ways()))
    wanted = [BASELINE, UNCOMPRESSED] + [n for n in names if n not in (BASELINE, UNCOMPRESSED)]
    ways = all_ways()
    args.way_params = {n: ways[n] for n in wanted if n in ways}


def main(argv=None) -> int:
    """Returns 1 when a way failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    C.check_batch(parser, args.batch, args.replicas)
    settings(args)
    torch.set_num_threads(args.threads)
    data = load_data(args.train_limit)
    records: list[dict] = []
    for model_name in args.models:
        records += run_model(model_name, args.way_params, data, args)
    early = min(EARLY_EPOCH, args.epochs)
    C.print_table(["model", "way", "final acc %", "d pp", f"acc@{early} %", f"d@{early} pp",
                   "push B/step", "push/f32", "pull B/step", "pull/f32", "s/epoch",
                   "s/uncompr"], [table_row(r) for r in records])
    print(f"(accuracy: mean +- stdev over seeds {args.seeds}, after {args.epochs} epochs; "
          f"acc@{early}: after epoch {early}; d: percentage points against {BASELINE}; "
          f"bytes: one replica's per step, summed over the Trainer's keys; s/epoch: median "
          f"wall seconds of an epoch's training, s/uncompr: against {UNCOMPRESSED})")
    payload = {
        "settings": {
            "data": {"name": "sklearn digits", "train": len(data["y_train"]),
                     "test": len(data["y_test"]), "test_fraction": TEST_FRACTION,
                     "split_seed": SPLIT_SEED, "stratified": True, "scale": "pixels / 16"},
            "models": {m: sum(p.numel() for p in MODELS[m]().parameters())
                       for m in args.models},
            "optimizer": {"name": args.optimizer, "learning_rate": args.lr,
                          **OPTIMIZERS[args.optimizer].options},
            "epochs": args.epochs, "seeds": args.seeds, "batch": args.batch,
            "replicas": args.replicas, "kvstore": "device", "threads": args.threads,
            "quick": args.quick, "early_epoch": early, "amp": args.amp,
            "ways": args.way_params},
        "results": records, "machine": C.machine_info(),
        "libraries": C.library_versions("gpukv", "numpy", "torch", "scikit-learn")}
    prefix = "accuracy" if args.optimizer == "sgd" else f"accuracy_{args.optimizer}"
    if args.amp:
        prefix += "_amp"
    if args.quick:  # (never under the name of a published full run)
        prefix += "_quick"
    C.save_results(payload, args.out, C.result_name(prefix),
                   plot=lambda png: plot(records, args.models, png, args.optimizer
                                         + (", float16 autocast" if args.amp else "")))
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())

"""PyTorch data-parallel step: gpukv.torch.Trainer vs per-parameter keys vs plain PyTorch.

    python benchmarks/bench_trainer.py                      # 4 CPU replicas, both models
    python benchmarks/bench_trainer.py --devices 2,4 --iters 50 --out /tmp/trainer

Two models: an MLP (a few large parameters) and a stack of 500 Linear(8, 8) layers (1000
small parameters). For each, on N CPU replicas sharing a 'local' store, three ways to
train with plain SGD:
- trainer: `gpukv.torch.Trainer.step` (small parameters fused into a few keys, weights
  and gradients views of one flat buffer per replica); 'overlap' starts each bucket's
  reduction from backward (`overlap=True`), 'local-update' is update_on_kvstore=False
  (the store sums, every replica runs SGD);
- per-key: the hand-written loop of examples/torch_training_by_hand.py (one int key per
  parameter, `kv.push(keys, grads)` then `kv.pull(keys, out=weights)`), with the
  example's Python updater ('per-key fn') and with gpukv.optim.SGD ('per-key sgd');
- torch: one process, one model on the whole batch, torch.optim.SGD.
'sync' times the part after backward (the step, or push+pull, or optimizer.step);
'iteration' adds zero_grad, forward and backward on every replica. The ways are timed in
turns (medians of `--iters` rounds); ratios are against the trainer in the same run.
`--devices` are replica counts (CPU replicas, one case each); the models are fixed, so
there is no --sizes. A table is printed and JSON goes to --out DIR (default
benchmarks/results/); the exit status is 1 when a case failed.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpukv  # noqa: E402
import gpukv.torch  # noqa: E402

MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512),
                                  nn.ReLU(), nn.Linear(512, 10)), 256),
    "1000-params": (lambda: nn.Sequential(*[nn.Linear(8, 8) for _ in range(500)]), 8),
}
LR = 0.01


class Case:
    """Replicas of one model, a batch split over them, and a loss (per-sample sum)."""

    def __init__(self, model_name, replicas, batch, seed=0):
        torch.manual_seed(seed)
        make, dim = MODELS[model_name]
        self.base = make()
        self.x = torch.randn(batch, dim)
        self.y = torch.randint(0, dim if model_name != "mlp" else 10, (batch,))
        self.batch = batch
        self.replicas = replicas
        self.loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def models(self):
        return [copy.deepcopy(self.base) for _ in range(self.replicas)]

    def backward(self, models):
        for m, xs, ys in zip(models, self.x.chunk(len(models)), self.y.chunk(len(models))):
            self.loss_fn(m(xs), ys).backward()


def trainer_way(case, overlap=False, update_on_kvstore=True):
    models = case.models()
    trainer = gpukv.torch.Trainer(models, "sgd", {"learning_rate": LR}, kvstore="local",
                                  overlap=overlap, update_on_kvstore=update_on_kvstore)
    sync = lambda: trainer.step(case.batch)  # noqa: E731
    return models, trainer.zero_grad, sync, len(trainer.keys)


def per_key_way(case, updater):
    models = case.models()
    params = [list(m.parameters()) for m in models]
    keys = list(range(len(params[0])))
    kv = gpukv.create("local")
    kv.init(keys, [p.data for p in params[0]])
    if updater == "fn":
        def sgd(key, grad, weight):  # as examples/torch_training_by_hand.py
            weight -= (LR / case.batch) * grad
        kv.set_updater(sgd)
    else:
        kv.set_optimizer(gpukv.optim.SGD(learning_rate=LR, rescale_grad=1.0 / case.batch))
    kv.pull(keys, out=[[row[k].data for row in params] for k in keys])
    case.backward(models)  # the grad tensors exist from here on
    grads = [[row[k].grad for row in params] for k in keys]
    weights = [[row[k].data for row in params] for k in keys]

    def zero():
        for m in models:
            m.zero_grad(set_to_none=False)

    def sync():
        kv.push(keys, grads)
        kv.pull(keys, out=weights)
    return models, zero, sync, len(keys)


def torch_way(case):
    model = copy.deepcopy(case.base)
    opt = torch.optim.SGD(model.parameters(), lr=LR / case.batch)
    return [model], lambda: opt.zero_grad(set_to_none=False), opt.step, 0


WAYS = {
    "trainer": trainer_way,
    "trainer overlap": lambda c: trainer_way(c, overlap=True),
    "trainer local-update": lambda c: trainer_way(c, update_on_kvstore=False),
    "trainer local-update overlap": lambda c: trainer_way(c, True, False),
    "per-key sgd": lambda c: per_key_way(c, "sgd"),
    "per-key fn": lambda c: per_key_way(c, "fn"),
    "torch": torch_way,
}


def measure(case, warmup, iters):
    """Median sync and iteration seconds of every way, timed in turns (one sample of each
    way per round) so that a busy machine slows them all alike."""
    setups = {}
    for way, make in WAYS.items():
        models, zero, sync, keys = make(case)
        zero()
        case.backward(models)

        def iteration(models=models, zero=zero, sync=sync):
            zero()
            case.backward(models)
            sync()

        def timed_sync(models=models, zero=zero, sync=sync):
            """The sync's seconds, after a backward of its own (a step needs fresh
            gradients: the Trainer refuses stale ones)."""
            zero()
            case.backward(models)
            start = time.perf_counter()
            sync()
            return time.perf_counter() - start
        setups[way] = (timed_sync, iteration, keys)
    for _ in range(warmup):
        for _, iteration, _ in setups.values():
            iteration()
    samples = {way: ([], []) for way in WAYS}
    for _ in range(iters):
        for way, (timed_sync, iteration, _) in setups.items():
            samples[way][0].append(timed_sync())
            samples[way][1].extend(C.time_calls(iteration, warmup=0, iters=1))
    return {way: {"sync_s": C.summarize(samples[way][0])["median_s"],
                  "iteration_s": C.summarize(samples[way][1])["median_s"],
                  "keys": setups[way][2]} for way in WAYS}


def build_parser() -> argparse.ArgumentParser:
    p = C.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--models", type=C.name_list(MODELS, "model"), default=",".join(MODELS),
                   metavar="NAMES",
                   help=f"models among {', '.join(MODELS)}, comma-separated (default: all)")
    C.add_devices_option(p, "4", "CPU replicas sharing a 'local' store")
    p.add_argument("--batch", type=C.positive_int, default=256, metavar="N",
                   help="global batch size, split over the replicas (default 256)")
    p.add_argument("--threads", type=C.positive_int, default=1, metavar="N",
                   help="torch.set_num_threads (default 1)")
    C.add_timing_options(p, 3, 20, unit="step",
                         note="every way takes one step per round, in turns")
    C.add_out_option(p, "trainer_<machine>.json")
    return p


def run_model(model_name, replicas, args) -> list[dict]:
    """The records of every way on one model and replica count."""
    case = Case(model_name, replicas, args.batch)
    n_params = sum(1 for _ in case.base.parameters())
    results = measure(case, args.warmup, args.iters)
    base = results["trainer"]
    return [{"model": model_name, "parameters": n_params, "replicas": replicas, "way": way,
             **r, "sync_over_trainer": r["sync_s"] / base["sync_s"],
             "iteration_over_trainer": r["iteration_s"] / base["iteration_s"]}
            for way, r in results.items()]


def table_row(rec: dict) -> list:
    head = [rec["model"], rec["replicas"], rec["way"]]
    if "error" in rec:
        return head + [None, "failed", "-", "-", "-"]
    return head + [rec["keys"] if rec["way"] != "torch" else None,
                   C.format_seconds(rec["sync_s"]), round(rec["sync_over_trainer"], 2),
                   C.format_seconds(rec["iteration_s"]),
                   round(rec["iteration_over_trainer"], 2)]


def main(argv=None) -> int:
    """Returns 1 when a case failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    C.check_batch(parser, args.batch, max(args.devices))
    torch.set_num_threads(args.threads)
    records = []
    for replicas in args.devices:
        for model_name in args.models:
            try:
                records += run_model(model_name, replicas, args)
            except Exception as exc:  # one broken case must not end the run
                error = f"{type(exc).__name__}: {exc}"[:300]
                records.append({"model": model_name, "replicas": replicas, "way": "-",
                                "error": error})
                print(f"FAILED {model_name} on {replicas} replicas: {error}",
                      file=sys.stderr)
    C.print_table(["model", "replicas", "way", "keys", "sync", "sync/trainer", "iteration",
                   "iter/trainer"], [table_row(r) for r in records])
    payload = {"replicas": args.devices, "batch": args.batch, "threads": args.threads,
               "results": records, "machine": C.machine_info(),
               "libraries": C.library_versions("numpy", "torch")}
    C.save_results(payload, args.out, C.result_name("trainer"))
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())

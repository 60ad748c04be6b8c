"""A Trainer step with a large embedding table: the rows a batch touched (sparse=True)
against every row (sparse=False), and PyTorch's own optimizer on the sparse model.

    python benchmarks/bench_embedding.py                    # 2 CPU replicas, 200k rows
    python benchmarks/bench_embedding.py --vocab 1000000 --optimizers adam

The model: nn.EmbeddingBag(vocab, 64, mode='mean'), then nn.Linear(64, 10); a batch of
256 bags of 16 token ids, split over the replicas (at most 4,096 rows touched). Ways,
each on a 'local' store, timed in turns (medians of `--iters` steps):
- rows: gpukv.torch.Trainer on the sparse=True model: each step pushes the rows the
  batch touched, and the store's optimizer updates those rows (lazy_update);
- dense: the Trainer on the sparse=False model: every row, every step;
- torch: one model on the whole batch, torch.optim.SGD (sparse gradients), or for adam
  torch.optim.SparseAdam on the table and Adam on the linear layer.
'step' times the part after backward; 'iteration' adds zero_grad, forward and backward.
A table is printed and JSON goes to --out DIR (default benchmarks/results/).
"""
from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpukv.torch  # noqa: E402

DIM, CLASSES, BAG = 64, 10, 16
OPTIMIZERS = {"sgd": {"learning_rate": 0.1}, "adam": {"learning_rate": 0.01}}


class Model(nn.Module):
    def __init__(self, vocab: int, sparse: bool):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, DIM, mode="mean", sparse=sparse)
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, ids):
        return self.out(self.emb(ids))


class Case:
    """One batch of bags over the replicas, and the models of every way."""

    def __init__(self, vocab: int, replicas: int, batch: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (batch, BAG), generator=g)
        self.y = torch.randint(0, CLASSES, (batch,), generator=g)
        torch.manual_seed(seed)
        self.base = Model(vocab, sparse=True)
        self.vocab, self.replicas, self.batch = vocab, replicas, batch
        self.loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def models(self, sparse: bool, n: int):
        model = Model(self.vocab, sparse)
        model.load_state_dict(self.base.state_dict())
        return [copy.deepcopy(model) for _ in range(n)]

    def backward(self, models):
        n = len(models)
        for m, ids, y in zip(models, self.ids.chunk(n), self.y.chunk(n)):
            self.loss_fn(m(ids), y).backward()


def trainer_way(case, optimizer, sparse):
    models = case.models(sparse, case.replicas)
    trainer = gpukv.torch.Trainer(models, optimizer, dict(OPTIMIZERS[optimizer]),
                                  kvstore="local")
    return models, trainer.zero_grad, lambda: trainer.step(case.batch)


def torch_way(case, optimizer):
    model = case.models(True, 1)[0]
    lr = OPTIMIZERS[optimizer]["learning_rate"] / case.batch
    if optimizer == "sgd":
        opts = [torch.optim.SGD(model.parameters(), lr=lr)]
    else:
        opts = [torch.optim.SparseAdam(model.emb.parameters(), lr=lr),
                torch.optim.Adam(model.out.parameters(), lr=lr)]

    def zero():
        for opt in opts:
            opt.zero_grad(set_to_none=True)

    def step():
        for opt in opts:
            opt.step()
    return [model], zero, step


WAYS = {"rows": lambda c, o: trainer_way(c, o, True),
        "dense": lambda c, o: trainer_way(c, o, False),
        "torch": torch_way}


def measure(case, optimizer, warmup, iters) -> dict:
    """Median step and iteration seconds of every way, timed in turns."""
    setups = {way: make(case, optimizer) for way, make in WAYS.items()}
    samples: dict = {way: ([], []) for way in WAYS}
    for i in range(warmup + iters):
        for way, (models, zero, step) in setups.items():
            start = time.perf_counter()
            zero()
            case.backward(models)
            middle = time.perf_counter()
            step()
            end = time.perf_counter()
            if i >= warmup:
                samples[way][0].append(end - middle)
                samples[way][1].append(end - start)
    return {way: {"step_s": C.summarize(s)["median_s"],
                  "iteration_s": C.summarize(it)["median_s"]}
            for way, (s, it) in samples.items()}


def build_parser():
    p = C.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=C.positive_int, default=200_000, metavar="N",
                   help="rows of the table (default 200000)")
    p.add_argument("--optimizers", type=C.name_list(OPTIMIZERS, "optimizer"),
                   default=",".join(OPTIMIZERS), metavar="NAMES",
                   help=f"among {', '.join(OPTIMIZERS)} (default: both)")
    C.add_devices_option(p, "2", "CPU replicas sharing a 'local' store")
    p.add_argument("--batch", type=C.positive_int, default=256, metavar="N",
                   help="bags per step, split over the replicas (default 256)")
    C.add_timing_options(p, 2, 10, unit="step", note="every way takes one per round")
    C.add_out_option(p, "embedding_<machine>.json")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    C.check_batch(parser, args.batch, max(args.devices))
    torch.set_num_threads(1)
    records = []
    for replicas in args.devices:
        case = Case(args.vocab, replicas, args.batch)
        for optimizer in args.optimizers:
            found = measure(case, optimizer, args.warmup, args.iters)
            base = found["rows"]
            for way, r in found.items():
                records.append({"vocab": args.vocab, "replicas": replicas,
                                "optimizer": optimizer, "way": way, **r,
                                "step_over_rows": r["step_s"] / base["step_s"],
                                "iteration_over_rows": r["iteration_s"] / base["iteration_s"]})
    C.print_table(["replicas", "optimizer", "way", "step", "step/rows", "iteration",
                   "iter/rows"],
                  [[r["replicas"], r["optimizer"], r["way"], C.format_seconds(r["step_s"]),
                    round(r["step_over_rows"], 2), C.format_seconds(r["iteration_s"]),
                    round(r["iteration_over_rows"], 2)] for r in records])
    payload = {"vocab": args.vocab, "dim": DIM, "bag": BAG, "batch": args.batch,
               "results": records, "machine": C.machine_info(),
               "libraries": C.library_versions("numpy", "torch")}
    C.save_results(payload, args.out, C.result_name("embedding"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What GPUKV_TIMELINE costs a training step, and a picture of one.

    python benchmarks/bench_timeline.py                      # 4 CPU replicas, 300 rounds
    python benchmarks/bench_timeline.py --replicas 2 --rounds 100 --out /tmp/tl

The Trainer (`gpukv.torch.Trainer`, SGD with momentum, mean losses) steps an MLP
256-512-512-10 on 4 CPU replicas of a 'device' store, buckets of 64 KiB (each big weight a
key of its own), with the timeline off and on in turns (`timeline.start` /
`stop`, a fresh folder each round), each round one timed step after an untimed one. The
table gives the median step time each way and their ratio; a second run of the same
rounds with the timeline off twice measures the noise of the ratio. The JSON, and a PNG
of the spans of the last recorded steps (a row per nesting depth, as Perfetto draws them),
go to --out DIR (default benchmarks/results/, timeline_<machine>.json).
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpukv.torch  # noqa: E402
from gpukv import timeline  # noqa: E402


def make_trainer(replicas: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    models = [copy.deepcopy(model) for _ in range(replicas)]
    trainer = gpukv.torch.Trainer(models, "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                  kvstore="device", bucket_bytes=64 << 10)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> float:
        trainer.zero_grad()
        for m, xs, ys in zip(models, x.chunk(replicas), y.chunk(replicas)):
            loss_fn(m(xs), ys).backward()
        start = time.perf_counter()
        trainer.step()
        return time.perf_counter() - start
    return trainer, step


def rounds(step, count: int, record: bool, folder: Path) -> tuple[list, list]:
    """(off times, on times) of `count` rounds; `record` False keeps both ways off."""
    off, on = [], []
    for i in range(count):
        step()
        off.append(step())
        if record:
            timeline.start(folder / f"round{i % 3}")
        step()
        on.append(step())
        if record:
            timeline.stop()
    return off, on


def plot(trace_path: Path, png: Path) -> None:
    """The spans of the trace's last two Trainer steps, a row per nesting depth."""
    plt = C.pyplot()
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in events if e["name"] == "Trainer.step"][-2:]
    lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    shown = sorted((e for e in events if lo <= e["ts"] <= hi), key=lambda e: e["ts"])
    depth: list = []  # the open spans' ends
    fig, ax = plt.subplots(figsize=(12, 3.5))
    colours = {}
    for e in shown:
        while depth and depth[-1] <= e["ts"]:
            depth.pop()
        row = len(depth)
        depth.append(e["ts"] + e["dur"])
        colour = colours.setdefault(e["name"], f"C{len(colours) % 10}")
        ax.broken_barh([((e["ts"] - lo) / 1000, e["dur"] / 1000)], (-row - 0.9, 0.8),
                       color=colour, label=e["name"])
    handles = {h.get_label(): h for h in ax.collections}
    ax.legend(handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(1, 1),
              fontsize=7)
    ax.set_yticks([])
    ax.set_xlabel("ms")
    ax.set_title("GPUKV_TIMELINE: two Trainer steps (a row per nesting depth)")
    fig.tight_layout()
    C.save_figure(fig, png)


def main(argv=None) -> int:
    p = C.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=C.positive_int, default=4,
                   help="CPU replicas of the Trainer (default 4)")
    p.add_argument("--rounds", type=C.positive_int, default=300,
                   help="rounds of four Trainer steps, each timing one step with the "
                        "timeline off and one with it on (default 300)")
    C.add_out_option(p, "the JSON and the PNG")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    trainer, step = make_trainer(args.replicas)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for _ in range(20):
            step()
        noise_a, noise_b = rounds(step, args.rounds, False, folder)
        off, on = rounds(step, args.rounds, True, folder)
        trace = sorted((folder / "round0").glob("gpukv-timeline-*.json"))[0]
        spans = sum(e["ph"] == "X" for e in json.loads(trace.read_text())["traceEvents"])
        medians = {k: statistics.median(v) for k, v in
                   (("off", off), ("on", on), ("off again", noise_b), ("off first", noise_a))}
        ratio = medians["on"] / medians["off"]
        noise = medians["off again"] / medians["off first"]
        # each ratio is to the row above it, the first of its run
        C.print_table(["way", "median step", "vs the row above"],
                      [["timeline off", C.format_seconds(medians["off"]), "-"],
                       ["timeline on", C.format_seconds(medians["on"]), round(ratio, 4)],
                       ["noise run: off", C.format_seconds(medians["off first"]), "-"],
                       ["noise run: off again", C.format_seconds(medians["off again"]),
                        round(noise, 4)]])
        print(f"(spans per step recorded: {spans / 2:.0f}; {args.replicas} replicas, "
              f"{len(trainer.keys)} keys, {args.rounds} rounds)")
        payload = {"machine": C.machine_info(),
                   "libraries": C.library_versions("numpy", "torch"),
                   "replicas": args.replicas,
                   "rounds": args.rounds, "keys": len(trainer.keys),
                   "median_step_s": medians, "on_over_off": ratio, "noise_ratio": noise,
                   "spans_per_step": spans / 2}
        C.save_results(payload, args.out, C.result_name("timeline"),
                       lambda png: plot(trace, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/bench_accuracy.py: a quick run's record, curves and chart."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .. import gpu_env
from .test_bench_cli import BENCHMARKS, ROOT, _load

pytest.importorskip("torch")
pytest.importorskip("sklearn")

QUICK_WAYS = ["torch", "uncompressed", "fp16", "2bit"]
MODELS = ["mlp", "cnn"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """(the process, the JSON record, the folder) of one `--quick` run."""
    out = tmp_path_factory.mktemp("accuracy")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_accuracy.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=gpu_env.subprocess_env(gpus=False))
    paths = list(out.glob("accuracy_quick_*.json"))
    record = json.loads(paths[0].read_text()) if len(paths) == 1 else None
    return proc, record, out


def _results(record) -> dict:
    return {(r["model"], r["way"]): r for r in record["results"]}


def test_quick_run_succeeds_and_writes_one_record(quick_run):
    """--quick exits 0, prints the table and writes one accuracy_quick_<machine>.json
    (not the name of a published full run)."""
    proc, record, _ = quick_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record is not None, proc.stdout
    assert "final acc %" in proc.stdout
    assert record["settings"]["quick"] and record["settings"]["epochs"] == 2


def test_quick_run_has_every_way_of_every_model(quick_run):
    """The record holds the quick ways on both models, none failed, a curve per seed
    with one accuracy in [0, 1] per epoch."""
    _, record, _ = quick_run
    results = _results(record)
    assert set(results) == {(m, w) for m in MODELS for w in QUICK_WAYS}
    epochs = record["settings"]["epochs"]
    for rec in results.values():
        assert "error" not in rec, rec
        assert len(rec["curves"]) == len(record["settings"]["seeds"])
        for curve in rec["curves"]:
            assert len(curve) == epochs and all(0 <= a <= 1 for a in curve)
        assert 0 <= rec["final"] <= 1 and 0 <= rec["early"] <= 1
        assert all(s > 0 for row in rec["epoch_s"] for s in row)


@pytest.mark.parametrize("model", MODELS)
def test_uncompressed_trainer_matches_plain_torch(quick_run, model):
    """The uncompressed Trainer (per-replica sums, rescaled by 1/batch) is the same
    arithmetic as plain PyTorch's mean loss: the same final accuracy within 1 pp."""
    _, record, _ = quick_run
    results = _results(record)
    torch_acc = results[(model, "torch")]["final"]
    assert results[(model, "uncompressed")]["final"] == pytest.approx(torch_acc, abs=0.01)


@pytest.mark.parametrize("model", MODELS)
def test_bytes_on_the_wire(quick_run, model):
    """Push and pull bytes are positive; fp16 pushes half of float32's bytes, 2bit a
    sixteenth or so; the pull stays float32."""
    _, record, _ = quick_run
    results = _results(record)
    plain = results[(model, "uncompressed")]["wire"]
    assert plain["push_bytes"] == plain["pull_bytes"] == plain["float32_bytes"] > 0
    fp16 = results[(model, "fp16")]["wire"]
    assert 2 * fp16["push_bytes"] == plain["push_bytes"]
    assert fp16["pull_bytes"] == plain["pull_bytes"]
    two_bit = results[(model, "2bit")]["wire"]
    assert 0 < two_bit["push_bytes"] < plain["push_bytes"] / 15
    assert results[(model, "torch")]["wire"] is None


def test_quick_run_draws_the_curves(quick_run):
    """A PNG of the curves is written next to the JSON."""
    _, _, out = quick_run
    (png,) = out.glob("accuracy_*.png")
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_a_both_ways_compressor_compresses_the_pull_too(monkeypatch):
    """A compressor class with `compresses_pulls = True` counts its payload for the pull
    as well; without it the pull is float32's bytes."""
    from gpukv.encoding.compressors import Cast

    wire_bytes = _load("bench_accuracy.py").wire_bytes
    shapes = {"a": (1000,), "b": (24,)}
    assert wire_bytes(shapes, {"type": "fp16"})["pull_bytes"] == 4 * 1024
    monkeypatch.setattr(Cast, "compresses_pulls", True)
    wire = wire_bytes(shapes, {"type": "fp16"})
    assert wire["push_bytes"] == wire["pull_bytes"] == 2 * 1024 and wire["both_ways"]


def test_powersgd_pushes_p_and_q_of_its_matrices():
    """PowerSGD's push is R * (rows + cols) float32 values per matrix, a vector whole."""
    wire_bytes = _load("bench_accuracy.py").wire_bytes
    wire = wire_bytes({"w": (512, 64), "b": (512,)}, {"type": "powersgd"})
    assert wire["push_bytes"] == 4 * 4 * (512 + 64) + 4 * 512
    assert wire["pull_bytes"] == 4 * (512 * 64 + 512)


@pytest.mark.parametrize("optimizer", ["sgd", "nag", "adam", "rmsprop"])
def test_every_way_trains_with_the_optimizer_asked_for(optimizer):
    """`--optimizer` sets both sides alike: plain PyTorch's torch.optim and the Trainer's
    store optimizer, with the same learning rate and momentum, betas or decay."""
    import torch

    from gpukv.optim import NAG, SGD, Adam, RMSProp

    bench = _load("bench_accuracy.py")
    lr = bench.OPTIMIZERS[optimizer].lr
    base = bench.MODELS["mlp"]()
    plain = bench.make_way("torch", None, base, lr, 2, optimizer).opt
    store = bench.make_way("uncompressed", None, base, lr, 2, optimizer).trainer.optimizer
    group = plain.param_groups[0]
    assert group["lr"] == store.learning_rate == lr
    if optimizer in ("sgd", "nag"):
        assert type(plain) is torch.optim.SGD
        assert type(store) is (SGD if optimizer == "sgd" else NAG)
        assert group["momentum"] == store.momentum == bench.MOMENTUM
        assert group["nesterov"] == (optimizer == "nag")
    elif optimizer == "adam":
        assert type(plain) is torch.optim.Adam and type(store) is Adam
        assert group["betas"] == (store.beta1, store.beta2) == bench.BETAS
    else:
        assert type(plain) is torch.optim.RMSprop and type(store) is RMSProp
        assert group["centered"] and store.centered
        assert group["alpha"] == store.gamma1 == bench.DECAY
        assert group["momentum"] == store.gamma2 == bench.MOMENTUM


def test_amp_runs_every_way_under_float16_autocast_and_a_scaler(monkeypatch):
    """`--amp`: plain PyTorch and the Trainer both compute in float16 under autocast and
    step through a GradScaler of their own (which then holds a scale)."""
    import torch

    bench = _load("bench_accuracy.py")
    base = bench.MODELS["mlp"]()
    x, y = torch.rand(8, 64), torch.arange(8) % 10
    seen = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda *a, **k: seen.append(linear(*a, **k).dtype) or linear(*a, **k))
    for name in ("torch", "uncompressed"):
        way = bench.make_way(name, None, base, 0.05, 2, "sgd", amp=True)
        before = [p.detach().clone() for p in way.model.parameters()]
        way.step(x, y)
        assert way.precision.scaler.get_scale() > 0
        assert not all(torch.equal(a, b) for a, b in zip(before, way.model.parameters()))
    assert seen and set(seen) == {torch.float16}, seen

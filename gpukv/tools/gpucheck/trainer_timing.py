"""gpucheck's trainer section: `gpukv.torch.Trainer` with the model on the GPU against
plain PyTorch's optimizer step on the same model.

Both start from the same weights and see the same batches: an MLP trained with plain SGD
(no momentum, so both rules are the same arithmetic: w - lr * (g / batch)), a per-sample
sum loss, PyTorch's gradients scaled by 1/batch before `torch.optim.SGD.step()`, the
Trainer's by `step(batch)`. Reported: the per-step time of the whole iteration (zero_grad,
forward, backward, update) and of the update alone (CUDA events on PyTorch's stream; host
time without CUDA), medians over the steps (one replica with the optimizer on the store:
the Trainer's overlap is off, and its update is all of its step after backward); and
whether the weights agree after the first update, from the same weights and gradients
(bit for bit, else within two float32 rounding steps of the larger of the weight and the
step: PyTorch's CUDA kernels may fuse the multiply-add that gpukv's kernels round
twice); after the last step their difference is reported, not judged, as such rounding
differences grow through training as any perturbation of the weights does. Then
loss scaling: a few steps of `scaler.step(trainer)` under a `torch.amp.GradScaler`, one
with an inf in a gradient, must give the weights of the unscaled steps without that one,
bit for bit (the scale is a power of two), and halve the scale once. And a profile of
the update's host time (`host_profile`): where it goes.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

from . import host_profile
from .budget import Deadline
from .section import Section

LR = 0.05


@dataclass(frozen=True)
class Spec:
    dims: tuple       # the MLP's layer widths
    batch: int
    steps: int        # timed
    warmup: int


FULL = Spec((1024, 4096, 4096, 10), batch=256, steps=20, warmup=3)
QUICK = Spec((64, 256, 256, 10), batch=64, steps=3, warmup=1)
ULPS = 2  # float32 rounding steps allowed between one update and PyTorch's


def _model(torch, dims):
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class _Timer:
    """Per-step seconds: CUDA events on PyTorch's current stream, else host time."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda

    def __call__(self, fn) -> float:
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            stop = self.torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


def run(deadline: Deadline, *, quick: bool, emulated: bool) -> Section:
    section = Section("trainer")
    try:
        import torch

        import gpukv.torch as gtorch
    except ImportError as exc:
        section.skipped = f"PyTorch is not installed ({exc})"
        section.line = "skipped: " + section.skipped
        return section
    section.progress(running="PyTorch's start and the models")
    cuda = bool(torch.cuda.is_available()) and not emulated
    device = torch.device("cuda:0" if cuda else "cpu")
    spec = QUICK if quick else FULL
    torch.manual_seed(0)
    base = _model(torch, spec.dims)
    plain, replica = copy.deepcopy(base).to(device), copy.deepcopy(base).to(device)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    batch = spec.batch
    batches = [(torch.randn(batch, spec.dims[0], device=device),
                torch.randint(0, spec.dims[-1], (batch,), device=device))
               for _ in range(spec.warmup + spec.steps)]
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    trainer = gtorch.Trainer([replica], "sgd", {"learning_rate": LR}, kvstore="device")
    timer = _Timer(torch, cuda)

    def plain_update():
        for p in plain.parameters():
            p.grad.mul_(1.0 / batch)
        optimizer.step()

    ways = {"torch": (plain, optimizer.zero_grad, plain_update),
            "gpukv": (replica, trainer.zero_grad, lambda: trainer.step(batch))}
    times: dict = {(w, part): [] for w in ways for part in ("iteration", "update")}
    for i, (x, y) in enumerate(batches):
        section.data.update(_medians(times))  # the steps so far, kept before each step
        section.line = f"{i} of {len(batches)} steps run"
        section.progress(running=f"step {i + 1} of {len(batches)}")
        if deadline.passed():
            section.cut = f"the budget ran out after {i} of {len(batches)} steps"
            break
        if i == 1:  # both have made one update, from the same weights and gradients
            _compare_first_update(section, torch, plain, replica, LR)
        for name, (model, zero, update) in ways.items():  # in turns, the same batch
            def forward_backward(model=model, zero=zero, x=x, y=y):
                zero()
                loss_fn(model(x), y).backward()
            if i < spec.warmup:
                forward_backward()
                update()
                continue
            first = timer(forward_backward)
            second = timer(update)
            times[(name, "iteration")].append(first + second)
            times[(name, "update")].append(second)
    if cuda:
        torch.cuda.synchronize()
    medians = _medians(times)
    section.data.update(device=str(device), overlap=trainer.overlap,
                        model=f"MLP {'-'.join(map(str, spec.dims))}",
                        parameters=sum(p.numel() for p in base.parameters()), batch=batch,
                        steps=len(times[("gpukv", "update")]), optimizer=f"SGD lr={LR}",
                        **medians)
    if not cuda:
        section.data["note"] = ("the model is on the CPU: " + (
            "the CUDA emulation has no PyTorch device" if emulated
            else "PyTorch has no CUDA here"))
    _compare(section, torch, plain, replica)
    section.progress(running="the updates' host profiles")
    if not deadline.passed():  # where the update's host time goes (steps not compared)
        x, y = batches[-1]
        for name, (model, zero, update) in ways.items():
            def backward(model=model, zero=zero):
                zero()
                loss_fn(model(x), y).backward()
            section.data[f"{name}_update_host_profile"] = host_profile.profile(
                update, 2 if quick else 10, before=backward)
        if cuda:
            torch.cuda.synchronize()
    section.progress(running="loss scaling")
    _check_loss_scaling(section, torch, gtorch, device)
    if "gpukv_iteration_ms" in medians and "torch_iteration_ms" in medians:
        ratio = medians["gpukv_iteration_ms"] / medians["torch_iteration_ms"]
        section.data["iteration_ratio"] = ratio
        section.data["update_ratio"] = medians["gpukv_update_ms"] / medians["torch_update_ms"]
        section.line = (f"{section.data['model']} on {device}: step "
                        f"{medians['gpukv_iteration_ms']:.2f} ms against "
                        f"{medians['torch_iteration_ms']:.2f} ms in PyTorch ({ratio:.2f}x"
                        + (", overlap on" if trainer.overlap else "") + "), update "
                        f"{medians['gpukv_update_ms']:.2f} against "
                        f"{medians['torch_update_ms']:.2f} ms; weights "
                        f"{section.data['weights']}")
        if "gpukv_update_host_profile" in section.data:
            section.line += "; the update's host time: " + "; ".join(
                f"{name} " + host_profile.summary(section.data[f"{name}_update_host_profile"])
                for name in ways)
    return section


def _medians(times: dict) -> dict:
    """Milliseconds per step, medians of the steps timed so far, per way and part."""
    return {f"{w}_{part}_ms": statistics.median(v) * 1e3 for (w, part), v in times.items() if v}


def _compare_first_update(section: Section, torch, plain, replica, lr: float) -> None:
    """The weights after the first update of each, from the same weights and gradients:
    bit for bit, or within ULPS float32 rounding steps of the larger of PyTorch's weight
    and its step (lr times the scaled gradient, still in `.grad`)."""
    worst, bitwise = 0.0, True
    for (name, a), b in zip(plain.named_parameters(), replica.parameters()):
        a, b = a.detach().float(), b.detach().float()
        bitwise = bitwise and torch.equal(a, b)
        scale = torch.maximum(a.abs(), (lr * plain.get_parameter(name).grad).abs().float())
        ulp = torch.nextafter(scale, torch.full_like(scale, float("inf"))) - scale
        steps = float(((a - b).abs() / ulp).max())
        worst = max(worst, steps)
        if steps > ULPS:
            section.fail(f"weight {name} after one update differs from PyTorch's by "
                         f"{steps:.3g} float32 rounding steps (at most {ULPS} expected)")
    section.data.update(first_update_bitwise_equal=bitwise,
                        first_update_max_rounding_steps=worst)


def _compare(section: Section, torch, plain, replica) -> None:
    """How far apart the weights are after the last step (reported, not judged)."""
    worst, bitwise = 0.0, True
    for a, b in zip(plain.parameters(), replica.parameters()):
        a, b = a.detach(), b.detach()
        bitwise = bitwise and torch.equal(a, b)
        worst = max(worst, float((a - b).abs().max()))
    first = section.data.get("first_update_max_rounding_steps")
    section.data.update(weights_bitwise_equal=bitwise, weights_max_abs_difference=worst,
                        weights=("bit for bit equal" if bitwise else
                                 f"within {first:.2g} rounding steps after one update, "
                                 f"{worst:.2g} apart at the end") if first is not None
                        else f"{worst:.2g} apart at the end")


def _check_loss_scaling(section: Section, torch, gtorch, device) -> None:
    """`scaler.step(trainer)` against unscaled steps that leave the bad one out."""
    def train(scaled: bool):
        torch.manual_seed(1)
        model = _model(torch, (16, 32, 4)).to(device)
        trainer = gtorch.Trainer([model], "sgd", {"learning_rate": LR, "momentum": 0.9},
                                 kvstore="device")
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10) if scaled else None
        g = torch.Generator().manual_seed(2)
        for step in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            trainer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            (loss if scaler is None else scaler.scale(loss)).backward()
            if step == 1:
                with torch.no_grad():
                    model[0].weight.grad[0, 0] = float("inf")
            if scaler is not None:
                scaler.step(trainer)
                scaler.update()
            elif step != 1:
                trainer.step()
        return [p.detach().cpu() for p in model.parameters()], scaler
    try:
        want, _ = train(False)
        got, scaler = train(True)
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure
        section.fail(f"loss scaling: {type(exc).__name__}: {exc}")
        return
    same = all(torch.equal(a, b) for a, b in zip(want, got))
    section.data.update(loss_scaling_bitwise=same, loss_scaling_scale=scaler.get_scale())
    if not same:
        section.fail("loss scaling: scaler.step(trainer) gave other weights than the "
                     "unscaled steps without the one with an inf")
    elif scaler.get_scale() != 2.0 ** 9:
        section.fail(f"loss scaling: the scale is {scaler.get_scale():g} after one step "
                     f"with an inf, not 512")

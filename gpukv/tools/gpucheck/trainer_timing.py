"""gpucheck's trainer section: `gpukv.torch.Trainer` with the model on the GPU against
plain PyTorch's optimizer step on the same model.

Both start from the same weights and see the same batches: an MLP trained with plain SGD
(no momentum, so both rules are the same arithmetic: w - lr * (g / batch)), a per-sample
sum loss, PyTorch's gradients scaled by 1/batch before `torch.optim.SGD.step()`, the
Trainer's by `step(batch)`. Reported: the per-step time of the whole iteration (zero_grad,
forward, backward, update) and of the update alone (CUDA events on PyTorch's stream; host
time without CUDA), medians over the steps (one replica with the optimizer on the store:
the Trainer's overlap is off, and its update is all of its step after backward); and
whether the weights agree after the last step (bit for bit, and within float32 rounding:
PyTorch's CUDA kernels may fuse the multiply-add that gpukv's kernels round twice). Then
loss scaling: a few steps of `scaler.step(trainer)` under a `torch.amp.GradScaler`, one
with an inf in a gradient, must give the weights of the unscaled steps without that one,
bit for bit (the scale is a power of two), and halve the scale once.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

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
RTOL, ATOL = 1e-5, 1e-7


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
        if deadline.passed():
            section.cut = f"the budget ran out after {i} of {len(batches)} steps"
            break
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
    medians = {f"{w}_{part}_ms": statistics.median(v) * 1e3
               for (w, part), v in times.items() if v}
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
    return section


def _compare(section: Section, torch, plain, replica) -> None:
    worst, bitwise, close = 0.0, True, True
    for (name, a), b in zip(plain.named_parameters(), replica.parameters()):
        a, b = a.detach(), b.detach()
        if not torch.equal(a, b):
            bitwise = False
        if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            close = False
            section.fail(f"weight {name} differs from PyTorch's beyond rtol {RTOL}: max "
                         f"|difference| {float((a - b).abs().max()):.3g}")
        worst = max(worst, float((a - b).abs().max()))
    section.data.update(weights_bitwise_equal=bitwise, weights_close=close,
                        weights_max_abs_difference=worst,
                        weights="bit for bit equal" if bitwise else (
                            f"equal within rtol {RTOL} (max |difference| {worst:.2g})"
                            if close else "different"))


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

"""Loss scaling by `torch.amp.GradScaler`: `scaler.step(trainer)`, as with a torch optimizer.

The Trainer takes the protocol torch's fused optimizers take (`_step_supports_amp_scaling`):
GradScaler looks for an infinity or NaN in this process's gradients (the Trainer's
`param_groups`), then calls `Trainer.step` with `grad_scale` (the scale the gradients
still carry, or None after `scaler.unscale_(trainer)`) and `found_inf` set on the Trainer.

Gradients reach a store that runs the optimizer without their scale, and a step with an
infinity or NaN on any worker is skipped by every worker: the weights, the optimizer's
state and the compressors' residuals never see one, and each worker's scale is its own
business. With `update_on_kvstore=False` the scale comes off the sums, as with DDP: on a
store of several workers the sums must be made first (`allreduce_grads()`), so that every
worker's GradScaler sees the same gradients and keeps the same scale.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._errors import ArgumentError
from ..store.base import KVStore


class Scaled(NamedTuple):
    """What GradScaler set on the Trainer for one step."""
    #: the factor that takes the scale off the gradients (float32's 1/scale, as
    #: GradScaler's own), or None when `scaler.unscale_(trainer)` took it off already
    inverse: float | None
    #: whether GradScaler found an infinity or NaN in this process's gradients
    found_inf: bool


def set_on(trainer) -> Scaled | None:
    """What `GradScaler.step` set on `trainer` for this step, or None outside it."""
    found = vars(trainer).get("found_inf")
    if found is None:
        return None
    scale = vars(trainer).get("grad_scale")
    inverse = None
    if scale is not None:
        inverse = float(torch.as_tensor(scale).double().reciprocal().float())
    return Scaled(inverse, bool(found.item()))


def forget(trainer) -> None:
    """Drop what GradScaler set on `trainer`: it does so itself only after a step that
    returns, and a later step without it must not take it for a scaled one."""
    for name in ("grad_scale", "found_inf"):
        vars(trainer).pop(name, None)


def unscale(grads: list[torch.Tensor], inverse: float | None) -> None:
    """Take the scale off `grads`, in place."""
    if inverse is None:
        return
    with torch.no_grad():
        for grad in grads:
            grad.mul_(inverse)


def found_anywhere(store: KVStore, found: bool) -> bool:
    """Whether any worker found an infinity or NaN (every worker asks at each scaled step)."""
    if store.num_workers == 1:
        return found
    return bool(store.workers_max([int(found)], "Trainer.step under GradScaler: whether a "
                                                "worker's gradients hold an inf or NaN")[0])


def check_replica_scaling(store: KVStore, summed: bool, float16_sums: bool) -> None:
    """ArgumentError where `update_on_kvstore=False` cannot take a scaled step: compressed
    pushes (their residuals would keep scaled values, and an inf or NaN for good), or sums
    not made before GradScaler looked (`summed`: `allreduce_grads()` made them) where they
    may hold what it did not see: on a store of several workers, or where the step would
    sum several replicas' float16 gradients in float16 (`float16_sums`), which overflows
    with the scale on where each replica's gradient does not."""
    if store.gradient_compression is not None:
        raise ArgumentError(
            "GradScaler with update_on_kvstore=False and gradient compression: the "
            "compressors would take the scaled gradients, and keep an inf or NaN in their "
            "residuals; make the Trainer with update_on_kvstore=True, where gradients "
            "reach the store unscaled")
    if store.num_workers > 1 and not summed:
        raise ArgumentError(
            "GradScaler with update_on_kvstore=False on a store of several workers: the "
            "scale comes off the summed gradients, as with DDP, so that every worker keeps "
            "the same scale; call trainer.allreduce_grads() before scaler.step(trainer) "
            "(and scaler.unscale_(trainer) between them to clip)")
    if float16_sums and not summed:
        raise ArgumentError(
            "GradScaler with update_on_kvstore=False and float16 parameters on several "
            "replicas: the sums of the scaled gradients are made in float16, and may "
            "overflow where no replica's gradient did, after GradScaler looked; call "
            "trainer.allreduce_grads() before scaler.step(trainer), so that it looks at "
            "the sums (or keep float32 parameters under autocast, or update_on_kvstore=True, "
            "which sums in float32)")

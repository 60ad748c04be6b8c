"""What a Trainer's snapshots keep of a model beside the store: its buffers (BatchNorm's
running statistics and every other tensor its `state_dict` holds that is not a
parameter) and the parameters frozen when the Trainer was made, which the store does not
hold.

The store sums gradients, not buffers: they start as replica 0's (`frozen.start_alike`),
then each replica keeps its own, as in gluon. A snapshot
keeps those of worker 0's replica 0 (as DDP's `broadcast_buffers` spreads rank 0's), and
a resume gives them to every replica of every worker, so a model resumed, or exported for
inference, has running statistics, not a fresh BatchNorm's. Frozen parameters go the same
way, so that a resumed or exported model is whole (a fine-tuned head and the frozen body
it was trained on), as DDP's `model.state_dict()` is. The names a parameter is tied under
beside its first (an embedding shared with the output layer) are kept too, so that an
export holds every name `state_dict` has."""
from __future__ import annotations

import torch

from .._errors import CheckpointError


def module_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `module.state_dict()` holds (persistent ones), by its names."""
    names = {name for name, _ in module.named_buffers(remove_duplicate=False)}
    return {name: tensor for name, tensor in module.state_dict(keep_vars=True).items()
            if name in names}


def tied_parameters(module: torch.nn.Module) -> dict[str, str]:
    """{name: the name it is tied to} of each parameter `module.state_dict()` holds under
    several names (an embedding tied to the output layer): the Trainer, as
    `named_parameters()`, keeps the first name only; the others are these."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(param), name)
        if kept != name:
            tied[name] = kept
    return tied


def frozen_parameters(frozen: list) -> dict[str, torch.Tensor]:
    """{name: tensor} of replica 0's frozen parameters (`frozen`: (name, replica, tensor)
    of every replica's, `buckets.frozen`)."""
    return {name: tensor.detach() for name, replica, tensor in frozen if replica == 0}


def saved_shapes(saved, path, what: str = "buffers") -> dict[str, tuple]:
    """{name: shape} of the tensors a snapshot at `path` holds (`saved`: a dict of
    tensors, the Trainer's `what`); CheckpointError when it is anything else."""
    if not isinstance(saved, dict) or not all(isinstance(t, torch.Tensor)
                                              for t in saved.values()):
        raise CheckpointError(f"{path}: the Trainer's {what} are damaged")
    return {name: tuple(t.shape) for name, t in saved.items()}


def restore(saved: dict[str, torch.Tensor], modules: list[torch.nn.Module]) -> None:
    """Every module's buffers from `saved` (checked to fit them first)."""
    with torch.no_grad():
        for module in modules:
            for name, tensor in module_buffers(module).items():
                tensor.copy_(saved[name])


def restore_frozen(saved: dict[str, torch.Tensor], frozen: list) -> None:
    """Every replica's frozen parameters (`frozen`, as `frozen_parameters` takes it) from
    `saved` (checked to fit them first)."""
    with torch.no_grad():
        for name, _, tensor in frozen:
            tensor.copy_(saved[name])

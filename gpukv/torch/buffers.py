"""A module's buffers in a Trainer's snapshots: BatchNorm's running statistics and every
other tensor its `state_dict` holds that is not a parameter.

The store sums gradients, not buffers: each replica keeps its own, as in gluon. A snapshot
keeps those of worker 0's replica 0 (as DDP's `broadcast_buffers` spreads rank 0's), and
a resume gives them to every replica of every worker, so a model resumed, or exported for
inference, has running statistics, not a fresh BatchNorm's."""
from __future__ import annotations

import torch

from .._errors import CheckpointError


def module_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `module.state_dict()` holds (persistent ones), by its names."""
    names = {name for name, _ in module.named_buffers(remove_duplicate=False)}
    return {name: tensor for name, tensor in module.state_dict(keep_vars=True).items()
            if name in names}


def saved_shapes(saved, path) -> dict[str, tuple]:
    """{name: shape} of the buffers a snapshot at `path` holds (`saved`: a dict of
    tensors); CheckpointError when it is anything else."""
    if not isinstance(saved, dict) or not all(isinstance(t, torch.Tensor)
                                              for t in saved.values()):
        raise CheckpointError(f"{path}: the Trainer's buffers are damaged")
    return {name: tuple(t.shape) for name, t in saved.items()}


def restore(saved: dict[str, torch.Tensor], modules: list[torch.nn.Module]) -> None:
    """Every module's buffers from `saved` (checked to fit them first)."""
    with torch.no_grad():
        for module in modules:
            for name, tensor in module_buffers(module).items():
                tensor.copy_(saved[name])

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


def check_saved(saved, mine: dict[str, torch.Tensor], path) -> None:
    """CheckpointError unless the buffers `saved` in the snapshot at `path` (None: it has
    none) are this model's, by name and shape, as PyTorch's `load_state_dict` names them."""
    if saved is None:
        return
    if not isinstance(saved, dict) or not all(isinstance(t, torch.Tensor)
                                              for t in saved.values()):
        raise CheckpointError(f"{path}: the Trainer's buffers are damaged")
    problems = [f"size mismatch for {name}: {list(saved[name].shape)} in the snapshot, "
                f"{list(t.shape)} in the model"
                for name, t in mine.items() if name in saved and saved[name].shape != t.shape]
    problems += [f"buffer missing in the snapshot: {name}" for name in mine
                 if name not in saved]
    problems += [f"buffer not in the model: {name}" for name in saved if name not in mine]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{path}: another model's snapshot: "
                              f"{'; '.join(problems[:3])}{more}")


def restore(saved: dict[str, torch.Tensor], modules: list[torch.nn.Module]) -> None:
    """Every module's buffers from `saved` (checked by `check_saved`)."""
    with torch.no_grad():
        for module in modules:
            for name, tensor in module_buffers(module).items():
                tensor.copy_(saved[name])

"""`Trainer`: data-parallel PyTorch training on a gpukv store, as gluon's Trainer did on MXNet.

    import gpukv.torch
    trainer = gpukv.torch.Trainer(replicas, 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    for x, y in batches:
        trainer.zero_grad()
        for model, xs, ys in zip(replicas, x.chunk(n), y.chunk(n)):
            loss_fn(model(xs), ys).backward()      # a per-sample sum, as in gluon
        trainer.step(batch_size=len(x))            # push, update on the store, pull

One `torch.nn.Module` per device (same architecture), or a single module. Every trainable
parameter takes part; parameters with `requires_grad=False` when the Trainer is made are
left out (one unfrozen later is refused at the step: make a new Trainer). Parameters are
grouped in buckets (consecutive parameters of one dtype, up to `bucket_bytes`; filled in
backward's order, the first one up to 1 MiB; DDP's first bucket also takes the parameter
that passes 1 MiB), one store key per bucket: a key holding one parameter is named after
it, a fused one ``'<first>..<last>'``. In every
replica the weights and the gradients of a bucket are views of one flat buffer each (as
PyTorch DDP's ``gradient_as_bucket_view``), so a step pushes and pulls a handful of keys,
and the store reads and writes the replicas' memory without copies. Keep those tensors:
`module.to(...)`, assigning `p.data`, or creating a new optimizer state in PyTorch is not
seen by the trainer. `zero_grad()` zeroes the buffers in place; `model.zero_grad()` (which
sets `.grad` to None) works too, at the cost of one copy per parameter into its view at the
next step. Buffers (BatchNorm's running statistics) are not synchronised: each replica
keeps its own, as in gluon; a snapshot keeps replica 0's of worker 0, and a resume gives
them to every replica.

Only this module imports PyTorch (`import gpukv` never does).
"""
from __future__ import annotations

from .._errors import BackendError

try:
    import torch  # noqa: F401 - fail here, with the install hint, when PyTorch is missing
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise BackendError("gpukv.torch needs PyTorch: pip install torch (and for exports "
                       "safetensors and ml_dtypes: pip install 'gpukv[torch]')") from exc

# gpukv.torch.export.export_safetensors, as the docs spell it (safetensors, optional, is
# imported by an export only)
from . import export  # noqa: F401
from .buckets import BUCKET_BYTES
from .export import export_safetensors
from .rows import SparseGradientsMadeDense
from .trainer import Trainer
from .writes import WeightWritesLost

__all__ = ["BUCKET_BYTES", "SparseGradientsMadeDense", "Trainer", "WeightWritesLost",
           "export_safetensors"]

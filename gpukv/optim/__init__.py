"""Optimizers for `KVStore.set_optimizer`, with MXNet 1.9.1's arguments and arithmetic.

    import gpukv
    kv = gpukv.create('device')
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4))
    # or: kv.set_optimizer(gpukv.optim.create('adam', learning_rate=1e-3))

State (momentum, moments, float32 master copies of float16/bfloat16 weights) lives with
each key on its home device; a push of many keys updates them all in one multi-tensor
kernel launch per (GPU, dtype) group, or with vectorised NumPy on the host.
"""
from . import lr_scheduler
from ._base import Optimizer, create, register, registered
from ._rules import LAMB, NAG, SGD, AdaGrad, Adam, AdamW, RMSProp
from ._updater import OptimizerUpdater
from .lr_scheduler import (
                           CosineScheduler,
                           FactorScheduler,
                           LRScheduler,
                           MultiFactorScheduler,
                           PolyScheduler,
)

__all__ = ["Optimizer", "create", "register", "registered", "SGD", "NAG", "Adam", "AdamW",
           "AdaGrad", "RMSProp", "LAMB", "OptimizerUpdater", "lr_scheduler", "LRScheduler",
           "FactorScheduler", "MultiFactorScheduler", "PolyScheduler", "CosineScheduler"]

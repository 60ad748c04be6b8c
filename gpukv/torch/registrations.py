"""A count of the parameters and submodules registered on any `torch.nn.Module` of the
process since gpukv.torch was imported (PyTorch's global registration hooks): while it
stands still, no model can have gained or swapped a parameter, so a Trainer's step need
not walk its replicas' parameters to find out."""
from __future__ import annotations

from torch.nn.modules import module as _module

_count = [0]


def _registered(*_args) -> None:
    """Either hook (module, name, what): count it; returning None keeps what came."""
    _count[0] += 1


_module.register_module_parameter_registration_hook(_registered)
_module.register_module_module_registration_hook(_registered)


def registrations() -> int:
    """How many parameters and submodules have been registered so far."""
    return _count[0]

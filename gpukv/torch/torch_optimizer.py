"""`TorchOptimizer`: a Trainer as a `torch.optim.Optimizer`, for `torch.optim.lr_scheduler`.

torch's schedulers take only a `torch.optim.Optimizer`, and write into its
`param_groups[i]`: 'lr', and for the momentum cycles of OneCycleLR and CyclicLR
'momentum' (SGD's) or 'betas' (Adam's). This view has one group, every replica's
trainable parameters, holding those of the Trainer's optimizer that it has: 'lr' always,
'momentum' where it is on (it cannot be turned on or off once the states exist), 'betas'
for Adam-like rules' (beta1, beta2). What a scheduler writes there is taken by the
Trainer's next step (`Trainer._take_scheduled`), on every worker that runs the same
schedule. `step()` and `zero_grad()` are the Trainer's, so torch code that holds an
optimizer (a GradScaler included) can hold this one.
"""
from __future__ import annotations

import torch

from .._errors import ArgumentError, ArgumentKindError
from ..optim import Optimizer
from ..optim._base import check_number
from . import scaling

#: the view's name of every option it shows
_LR, _MOMENTUM, _BETAS = "lr", "momentum", "betas"


def group_options(optimizer: Optimizer) -> dict:
    """The group's options as `optimizer` has them now."""
    group: dict = {_LR: optimizer.lr}
    options = vars(optimizer)  # (the rules' own options: not every rule has them)
    if options.get("momentum", 0) > 0:
        group[_MOMENTUM] = options["momentum"]
    if "beta1" in options and "beta2" in options:
        group[_BETAS] = (options["beta1"], options["beta2"])
    return group


def optimizer_values(optimizer: Optimizer, names) -> dict:
    """{option: `optimizer`'s value} of `names` ('learning_rate', 'momentum', 'beta1',
    'beta2': the keys of `TorchOptimizer.scheduled`)."""
    return {name: optimizer.lr if name == "learning_rate" else vars(optimizer)[name]
            for name in names}


class TorchOptimizer(torch.optim.Optimizer):
    """The Trainer as a torch optimizer: one parameter group whose 'lr' (and 'momentum'
    or 'betas', where the optimizer has them) set the Trainer's next step
    (`trainer.torch_optimizer`).

    `step()` is `trainer.step()` (mean losses, DDP's convention); `trainer.step(batch_size)`
    may be called instead, and a scheduler counts it as an optimizer step all the same.
    Per-parameter rates are the Trainer optimizer's `set_lr_mult`, not further groups.
    """

    #: GradScaler hands `grad_scale` and `found_inf` to step(), which gives them to the
    #: Trainer (gpukv.torch.scaling): a step skipped for an inf is skipped on every worker
    _step_supports_amp_scaling = True

    def __init__(self, trainer, params: list, optimizer: Optimizer):
        self._trainer = trainer
        self._started = False
        super().__init__(params, group_options(optimizer))
        self._started = True

    def step(self, closure=None):
        """The Trainer's step (`trainer.step()`); a closure is refused (the Trainer takes
        no loss function)."""
        if closure is not None:
            raise ArgumentError("TorchOptimizer.step(closure): the Trainer takes no "
                                "closure; run forward and backward, then step()")
        scaled = {name: value for name, value in vars(self).items()
                  if name in ("grad_scale", "found_inf")}
        if not scaled:
            self._trainer.step()
            return
        vars(self._trainer).update(scaled)  # (GradScaler drops them from the view itself)
        try:
            self._trainer.step()
        finally:
            scaling.forget(self._trainer)

    def stepped(self) -> None:
        """The Trainer took a step, through this view or not: torch's schedulers look
        for this mark to tell that a step came before theirs (else they warn)."""
        self._opt_called = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The Trainer's `zero_grad` (torch.optim's default: `.grad` set to None)."""
        self._trainer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if self._started:
            raise ArgumentError("TorchOptimizer.add_param_group: the Trainer's parameters "
                                "are those it was made with; set per-parameter rates with "
                                "trainer.optimizer.set_lr_mult")
        super().add_param_group(param_group)

    def show(self, name: str, value: float) -> None:
        """Put `value` of option `name` (a key of `scheduled`) into the group."""
        group = self.param_groups[0]
        if name == "learning_rate":
            group[_LR] = value
        elif name == "momentum":
            group[_MOMENTUM] = value
        else:
            beta1, beta2 = group[_BETAS]
            group[_BETAS] = (value, beta2) if name == "beta1" else (beta1, value)

    def scheduled(self) -> dict:
        """{optimizer option: value} as the group holds them now ('learning_rate',
        'momentum', 'beta1', 'beta2'); ArgumentError for one out of the optimizer's
        range, before anything changes."""
        group = self.param_groups[0]
        out = {"learning_rate": _number("lr", group[_LR], low=0)}
        if _MOMENTUM in group:
            out["momentum"] = _number("momentum", group[_MOMENTUM], low=0, low_open=True,
                                      high=1, high_open=True)
        if _BETAS in group:
            betas = group[_BETAS]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ArgumentError(f"trainer.torch_optimizer.param_groups[0]['betas'] = "
                                    f"{betas!r}: expected (beta1, beta2)")
            for name, beta in zip(("beta1", "beta2"), betas):
                out[name] = _number(name, beta, low=0, high=1, high_open=True)
        return out


def _number(name: str, value, **limits) -> float:
    """A group's value as a float checked as the optimizer checks it (a scheduler may
    write a one-element tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        return check_number(name, value, **limits)
    except (ArgumentError, ArgumentKindError) as exc:
        raise type(exc)(f"trainer.torch_optimizer.param_groups[0]: {exc} (momentum "
                        f"cannot reach 0: it decides the optimizer's states)"
                        if name == "momentum" else
                        f"trainer.torch_optimizer.param_groups[0]: {exc}") from exc

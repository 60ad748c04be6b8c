"""Learning-rate schedules: `scheduler(num_update) -> lr`, as MXNet's `mx.lr_scheduler`.

`num_update` is the largest number of updates applied to any key so far. The schedules
keep MXNet's formulas and its (stateful) bookkeeping, so a run gives the same learning
rates step for step. `state()` / `from_state()` turn a schedule into plain JSON and back,
which is how `save_optimizer_states(..., dump_optimizer=True)` stores it.
"""
from __future__ import annotations

import math
import numbers

from .._errors import ArgumentError, ArgumentKindError

__all__ = ["LRScheduler", "FactorScheduler", "MultiFactorScheduler", "PolyScheduler",
           "CosineScheduler", "from_state"]


def _number(name, value, *, low=None, low_open=False, high=None, high_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentKindError(f"{name}: expected a number, got {type(value).__name__}")
    value = float(value)
    bad = not math.isfinite(value)
    if low is not None:
        bad |= value <= low if low_open else value < low
    if high is not None:
        bad |= value >= high if high_open else value > high
    if bad:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low}, "
        hi = "" if high is None else f"{high}" + (")" if high_open else "]")
        raise ArgumentError(f"{name}={value!r} is out of range {lo or '(-inf, '}{hi or 'inf)'}")
    return value


def _int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentKindError(f"{name}: expected an int, got {type(value).__name__}")
    if value < low:
        raise ArgumentError(f"{name}={value!r} must be >= {low}")
    return int(value)


class LRScheduler:
    """Base class: warm-up handling and the `__call__(num_update) -> lr` protocol.

    base_lr: the rate after warm-up (an optimizer given a `learning_rate` sets it, except
    for Poly and Cosine, and the warm-up still rises to the base_lr given here, as in
    MXNet);
    warmup_steps: how many updates the warm-up lasts (0: none); warmup_begin_lr: the rate
    it starts from; warmup_mode: 'linear' (rising to base_lr) or 'constant'. Each schedule
    below takes these options beside its own.
    """

    #: whether an optimizer's `learning_rate` becomes the rate after warm-up (MXNet's Poly
    #: and Cosine schedules decay from the base_lr they were made with instead)
    takes_optimizer_rate = True

    def __init__(self, base_lr=0.01, warmup_steps=0, warmup_begin_lr=0, warmup_mode="linear"):
        self.base_lr = _number("base_lr", base_lr, low=0)
        self.warmup_steps = _int("warmup_steps", warmup_steps, 0)
        self.warmup_final_lr = self.base_lr
        self.warmup_begin_lr = _number("warmup_begin_lr", warmup_begin_lr, low=0)
        if self.warmup_begin_lr > self.warmup_final_lr:
            raise ArgumentError(f"warmup_begin_lr={warmup_begin_lr!r} is above "
                                f"base_lr={base_lr!r}")
        if warmup_mode not in ("linear", "constant"):
            raise ArgumentError(f"warmup_mode={warmup_mode!r}: expected 'linear' or 'constant'")
        self.warmup_mode = warmup_mode

    def get_warmup_lr(self, num_update):
        """The rate during warm-up, at update `num_update`."""
        if self.warmup_mode == "linear":
            increase = ((self.warmup_final_lr - self.warmup_begin_lr)
                        * float(num_update) / float(self.warmup_steps))
            return self.warmup_begin_lr + increase
        return self.warmup_begin_lr

    def __call__(self, num_update):
        raise NotImplementedError("a schedule overrides __call__")

    # -- plain-JSON round trip
    def state(self) -> dict:
        """Everything this schedule holds, as plain JSON values."""
        return {"class": type(self).__name__, "attrs": dict(vars(self))}

    def __repr__(self):
        return f"{type(self).__name__}(base_lr={self.base_lr!r})"


class FactorScheduler(LRScheduler):
    """`base_lr * factor ** k`, never below `stop_factor_lr`, k the number of positive
    multiples of `step` below num_update, as MXNet counts (with step=10, updates 1-10
    take base_lr, 11-20 one factor)."""

    def __init__(self, step, factor=1, stop_factor_lr=1e-8, base_lr=0.01,
                 warmup_steps=0, warmup_begin_lr=0, warmup_mode="linear"):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.step = _int("step", step, 1)
        self.factor = _number("factor", factor, low=0, high=1)
        self.stop_factor_lr = _number("stop_factor_lr", stop_factor_lr, low=0)
        self.count = 0

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while num_update > self.count + self.step:
            self.count += self.step
            self.base_lr *= self.factor
            if self.base_lr < self.stop_factor_lr:
                self.base_lr = self.stop_factor_lr
        return self.base_lr


class MultiFactorScheduler(LRScheduler):
    """Multiply the rate by `factor` each time num_update passes one of `step`."""

    def __init__(self, step, factor=1, base_lr=0.01, warmup_steps=0, warmup_begin_lr=0,
                 warmup_mode="linear"):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if not isinstance(step, (list, tuple)) or not step:
            raise ArgumentKindError(f"step: expected a non-empty list of ints, got {step!r}")
        steps = [_int("step", s, 1) for s in step]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ArgumentError(f"step={step!r}: must be increasing")
        self.step = steps
        self.cur_step_ind = 0
        self.factor = _number("factor", factor, low=0, high=1)
        self.count = 0

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while self.cur_step_ind <= len(self.step) - 1:
            if num_update > self.step[self.cur_step_ind]:
                self.count = self.step[self.cur_step_ind]
                self.cur_step_ind += 1
                self.base_lr *= self.factor
            else:
                return self.base_lr
        return self.base_lr


class _DecayScheduler(LRScheduler):
    """After warm-up, `final_lr + (base_lr - final_lr) * decay(steps)` up to `max_update`.

    `decay(steps)` (steps: updates since warm-up) goes from 1 to 0; subclasses give it.
    The base_lr it was made with is the one it decays from (`base_lr_orig`), whatever an
    optimizer's `learning_rate` sets, as MXNet's: the optimizer logs a warning then.
    """

    takes_optimizer_rate = False

    def __init__(self, max_update, base_lr=0.01, final_lr=0,
                 warmup_steps=0, warmup_begin_lr=0, warmup_mode="linear"):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.max_update = _int("max_update", max_update, 1)
        self.base_lr_orig = self.base_lr
        self.final_lr = _number("final_lr", final_lr, low=0)
        if self.warmup_steps >= self.max_update:  # (nothing left to decay over)
            raise ArgumentError(f"warmup_steps={warmup_steps!r} must be below "
                                f"max_update={max_update!r}")
        self.max_steps = self.max_update - self.warmup_steps

    def _decay(self, steps):
        raise NotImplementedError

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        # Past max_update, the rate at max_update: what MXNet's keeps once it gave it, and
        # what a schedule first asked there (a resumed job's own) must give too.
        steps = min(num_update, self.max_update) - self.warmup_steps
        self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * self._decay(steps)
        return self.base_lr


class PolyScheduler(_DecayScheduler):
    """`final_lr + (base_lr - final_lr) * (1 - s / (max_update - warmup_steps)) ** pwr`,
    s = num_update - warmup_steps (the updates since warm-up); past max_update, the rate
    at max_update (final_lr, for pwr > 0), as MXNet's gives once it gave that one."""

    def __init__(self, max_update, base_lr=0.01, pwr=2, final_lr=0,
                 warmup_steps=0, warmup_begin_lr=0, warmup_mode="linear"):
        super().__init__(max_update, base_lr, final_lr, warmup_steps, warmup_begin_lr,
                         warmup_mode)
        self.power = _number("pwr", pwr, low=0)

    def _decay(self, steps):
        return pow(1 - float(steps) / float(self.max_steps), self.power)


class CosineScheduler(_DecayScheduler):
    """`final_lr + (base_lr - final_lr) * (1 + cos(pi * s / (max_update - warmup_steps)))
    / 2`, s = num_update - warmup_steps (the updates since warm-up); past max_update, the
    rate at max_update (final_lr), as MXNet's gives once it gave that one."""

    def _decay(self, steps):
        return (1 + math.cos(math.pi * steps / self.max_steps)) / 2


_CLASSES = {c.__name__: c for c in
            (FactorScheduler, MultiFactorScheduler, PolyScheduler, CosineScheduler)}


def restorable(schedule) -> bool:
    """Whether `from_state` restores `schedule` (one of the classes defined here, not a
    subclass of one, whose state it would not know)."""
    return _CLASSES.get(type(schedule).__name__) is type(schedule)


def from_state(state: dict) -> LRScheduler:
    """The schedule that `LRScheduler.state()` returned `state` for (only the classes
    defined here)."""
    cls = _CLASSES.get(state.get("class", "")) if isinstance(state, dict) else None
    attrs = state.get("attrs") if cls is not None else None
    if cls is None or not isinstance(attrs, dict):
        raise ArgumentError(f"not a known learning-rate schedule: {state!r}")
    obj = cls.__new__(cls)
    obj.__dict__.update(attrs)
    return obj

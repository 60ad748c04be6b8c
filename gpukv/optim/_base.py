"""The optimizer base class: hyper-parameters, their checks, schedules, per-key counts.

An optimizer here is a description of one update rule. `OptimizerUpdater` (in
`_updater.py`) owns the per-key state and runs the rule over many keys at once: with
NumPy on the host (`host_chunk`, in-place ufuncs over cache-sized pieces) and with one
multi-tensor CUDA kernel per group of keys on a GPU (`cuda_body`, see
`gpukv/device/cuda/optim_kernels.py`). The two are written operation for operation alike, in MXNet
1.9.1's order, so they round alike (bit for bit, except that float32 subnormals flush to
zero on GPUs: CuPy compiles every kernel with -ftz=true).

Scalars follow MXNet: every hyper-parameter reaches the kernel as a float32 (MXNet's
operator parameters are C floats); per-key values (learning rate with its multiplier,
bias corrections) are computed in Python floats and rounded to float32 once.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
import numbers
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from .._errors import ArgumentError, ArgumentKindError, KeyKindError

log = logging.getLogger("gpukv")
_REGISTRY: dict = {}
#: a learning-rate schedule: any callable `schedule(num_update) -> lr`, such as those of
#: `gpukv.optim.lr_scheduler` (whose `base_lr` the optimizer sets, and whose state it saves)
Schedule = Any


def register(cls):
    """Make `cls` available to `create(name)` under its lower-cased class name."""
    _REGISTRY[cls.__name__.lower()] = cls
    for alias in getattr(cls, "aliases", ()):
        _REGISTRY[alias] = cls
    return cls


def registered() -> list:
    """The optimizer classes `create` knows, each once (aliases aside), by class name."""
    return sorted(set(_REGISTRY.values()), key=lambda cls: cls.__name__)


def create(name, **options: Any) -> Optimizer:
    """The optimizer called `name` ('sgd', 'nag', 'adam', 'adamw', 'adagrad', 'rmsprop',
    'lamb') made with `options`, its keyword parameters (see its class); an option it
    does not have is an ArgumentKindError naming the ones it has. An Optimizer given as
    `name` is returned as it is (options beside it are an ArgumentKindError):

        gpukv.optim.create('sgd', learning_rate=0.1, momentum=0.9, wd=1e-4)
    """
    if isinstance(name, Optimizer):
        if options:
            raise ArgumentKindError(
                f"optimizer {name.name!r}: options {', '.join(sorted(options))} given with "
                f"an optimizer already made; set them on it, or give its name "
                f"(create({name.name!r}, ...))")
        return name
    if not isinstance(name, str):
        raise ArgumentKindError(f"optimizer name: expected a str, got {type(name).__name__}")
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise ArgumentError(f"optimizer {name!r}: unknown; known are "
                            f"{', '.join(sorted(_REGISTRY))}")
    return cls(**options)


#: the options every optimizer takes (each subclass lists them as keyword parameters)
BASE_OPTIONS = ("learning_rate", "wd", "rescale_grad", "clip_gradient", "lr_scheduler",
                "begin_num_update", "multi_precision", "param_idx2name")


def base_options(given: dict) -> dict:
    """The base options among a subclass constructor's `locals()`, for the base class."""
    return {name: given[name] for name in BASE_OPTIONS}


def _mult_key(table: str, key):
    """A multiplier's `key` as the store names keys: a str, or an int (NumPy's as int);
    anything else a KeyKindError naming it (it could neither match a key nor be saved)."""
    if isinstance(key, str):
        return key
    if isinstance(key, numbers.Integral) and not isinstance(key, (bool, np.bool_)):
        return int(key)
    raise KeyKindError(f"{table}: key {key!r}: expected a key (an int or a str) or a "
                       f"parameter name, got {type(key).__name__}")


def f32(x) -> float:
    """`x` rounded to float32, as a Python float (how MXNet passes operator parameters)."""
    return float(np.float32(x))


def check_number(name, value, *, low=None, low_open=False, high=None, high_open=False,
                 none_ok=False):
    """`value` as a float, or ArgumentKindError / ArgumentError naming the option."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentKindError(f"optimizer option {name}: expected a number, "
                                f"got {type(value).__name__}")
    value = float(value)
    bad = not math.isfinite(value)
    if not bad and low is not None:
        bad = value <= low if low_open else value < low
    if not bad and high is not None:
        bad = value >= high if high_open else value > high
    if bad:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        extra = " or None" if none_ok else ""
        raise ArgumentError(f"optimizer option {name}={value!r} is out of range: "
                            f"expected a value in {lo}, {hi}{extra}")
    return value


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentKindError(f"optimizer option {name}: expected a bool, "
                                f"got {type(value).__name__}")
    return bool(value)


def _number(name: str, **limits):
    return lambda value: check_number(name, value, **limits)


def _flag(name: str):
    return lambda value: check_bool(name, value)


_FRACTION = {"low": 0, "high": 1, "high_open": True}  # [0, 1)
_POSITIVE = {"low": 0, "low_open": True}  # (0, inf)
#: {attribute: its check}: every option of gpukv's rules, checked whenever it is set, in
#: the constructor or later (`opt.clip_gradient = -1` would reverse the gradient); one
#: name has the same range in every rule that has it
OPTION_CHECKS = {
    "lr": _number("learning_rate", low=0, none_ok=True),  # (None: the schedule's)
    "wd": _number("wd", low=0),
    "rescale_grad": _number("rescale_grad", **_POSITIVE),
    "clip_gradient": _number("clip_gradient", **_POSITIVE, none_ok=True),
    "multi_precision": _flag("multi_precision"),
    "momentum": _number("momentum", **_FRACTION),
    "beta1": _number("beta1", **_FRACTION),
    "beta2": _number("beta2", **_FRACTION),
    "gamma1": _number("gamma1", **_FRACTION),
    "gamma2": _number("gamma2", **_FRACTION),
    "epsilon": _number("epsilon", **_POSITIVE),
    "eps": _number("eps", **_POSITIVE),
    "clip_weights": _number("clip_weights", **_POSITIVE, none_ok=True),
    "lower_bound": _number("lower_bound", **_POSITIVE, none_ok=True),
    "upper_bound": _number("upper_bound", **_POSITIVE, none_ok=True),
    "lazy_update": _flag("lazy_update"),
    "correct_bias": _flag("correct_bias"),
    "centered": _flag("centered"),
    "bias_correction": _flag("bias_correction"),
}


def _keyword_options(cls) -> list[str]:
    """The options `cls(...)` takes by keyword: its `__init__`'s named parameters, and
    where that takes **kwargs too (to hand on to its base, as MXNet's optimizers do),
    those of the next `__init__` up its bases, in turn."""
    names: list = []
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.name != "self" and p.name not in names
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _checked(option_names) -> frozenset:
    """The attributes of `option_names` that OPTION_CHECKS checks (learning_rate is `lr`)."""
    return frozenset({"lr" if name == "learning_rate" else name for name in option_names}
                     & OPTION_CHECKS.keys())


def _checked_names(param_idx2name) -> dict:
    """`param_idx2name` as a dict of key -> parameter name (str); else
    ArgumentKindError."""
    if param_idx2name is None:
        return {}
    if not isinstance(param_idx2name, dict):
        raise ArgumentKindError(f"optimizer option param_idx2name: expected a dict of key "
                                f"-> parameter name, got {type(param_idx2name).__name__}")
    for key, name in param_idx2name.items():
        if not isinstance(name, str):
            raise ArgumentKindError(f"optimizer option param_idx2name[{key!r}]: expected a "
                                    f"parameter name (str), got {type(name).__name__}")
    return dict(param_idx2name)


def _warn_if_ignored(schedule, learning_rate: float) -> None:
    """Log that `learning_rate` will not be the rate: MXNet's Poly and Cosine schedules
    decay from the base_lr they were made with, whatever an optimizer sets."""
    if getattr(schedule, "takes_optimizer_rate", True):
        return
    made_with = schedule.base_lr_orig
    if made_with != learning_rate:
        log.warning("gpukv: learning_rate=%r has no effect beside %s: it decays from the "
                    "base_lr it was made with (%r), as MXNet's does; give the schedule "
                    "base_lr=%r instead", learning_rate, type(schedule).__name__,
                    made_with, learning_rate)


#: PyTorch's names of options that gpukv, as MXNet, names otherwise
_TORCH_NAMES = {"lr": ("learning_rate",), "weight_decay": ("wd",), "eps": ("epsilon",),
                "betas": ("beta1", "beta2")}


def _with_our_name(accepted):
    """`name` with gpukv's name for it, where it is PyTorch's for an option `accepted`
    holds: 'lr (gpukv names it learning_rate)'."""
    def named(name: str) -> str:
        ours = _TORCH_NAMES.get(name, ())
        if ours and all(o in accepted for o in ours):
            return f"{name} (gpukv names it {' and '.join(ours)})"
        return name
    return named


class Optimizer:
    """Base of every optimizer (MXNet's `mx.optimizer.Optimizer` arguments).

    learning_rate: the rate (None: the schedule's, else the optimizer's default: 0.01;
    0.001 for Adam, AdamW, RMSProp and LAMB); given beside an `lr_scheduler`, the schedule's
    `base_lr` (see `lr_scheduler.LRScheduler`). wd: L2 weight decay.
    rescale_grad: multiplies the gradient first (often 1/batch_size). clip_gradient: clip
    the (rescaled) gradient to [-c, c] (None: no clipping). lr_scheduler: an object with
    `__call__(num_update) -> lr`. begin_num_update: the update count keys start from.
    multi_precision: float16/bfloat16 weights always get a float32 master copy here; as in
    MXNet, it also makes SGD update every row of a float16 weight for a row-sparse
    gradient (MXNet's multi-precision SGD has no row-sparse form). param_idx2name: {key:
    parameter name}, so that multipliers set by name (`set_lr_mult`, `set_wd_mult`)
    apply to the key.

    Each optimizer below takes these options beside its own.
    """

    #: extra hyper-parameters of a subclass, in the order the CUDA kernel receives them
    hyper_names: ClassVar[tuple[str, ...]] = ()
    #: the rule's name in files and messages
    name = "optimizer"
    #: the rate of an optimizer made with neither a learning_rate nor an lr_scheduler
    default_learning_rate: ClassVar[float] = 0.01

    def __new__(cls, *args, **options):
        # An option the class does not have: a gpukv error naming those it has (Python's
        # own would be a bare TypeError from __init__).
        accepted = _keyword_options(cls)
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ArgumentKindError(f"{cls.__name__}: unknown option(s) "
                                    f"{', '.join(map(_with_our_name(accepted), unknown))}; "
                                    f"its options are {', '.join(accepted)}")
        return super().__new__(cls)

    def __init__(self, *, learning_rate: float | None = None, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None,
                 lr_scheduler: Schedule | None = None, begin_num_update: int = 0,
                 multi_precision: bool = False, param_idx2name: dict | None = None) -> None:
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise ArgumentKindError(f"optimizer option lr_scheduler: expected a callable "
                                    f"schedule, got {type(lr_scheduler).__name__}")
        self.lr_scheduler: Any = lr_scheduler
        learning_rate = check_number("learning_rate", learning_rate, low=0, none_ok=True)
        if lr_scheduler is None and learning_rate is None:
            learning_rate = self.default_learning_rate
        if lr_scheduler is not None and learning_rate is not None:
            # as MXNet: the rate after warm-up; the warm-up still rises to the base_lr
            # the schedule was made with (its warmup_final_lr)
            _warn_if_ignored(lr_scheduler, learning_rate)
            lr_scheduler.base_lr = learning_rate
        self.lr = learning_rate
        self.wd = wd
        self.rescale_grad = rescale_grad
        self.clip_gradient = clip_gradient
        if isinstance(begin_num_update, bool) or not isinstance(begin_num_update,
                                                                numbers.Integral):
            raise ArgumentKindError("optimizer option begin_num_update: expected an int, got "
                                    f"{type(begin_num_update).__name__}")
        if begin_num_update < 0:
            raise ArgumentError(f"optimizer option begin_num_update={begin_num_update!r} "
                                f"must be >= 0")
        self.begin_num_update: int = int(begin_num_update)
        self.num_update: int = self.begin_num_update
        self.multi_precision: bool = multi_precision
        self.idx2name: dict = _checked_names(param_idx2name)
        self.lr_mult: dict = {}
        self.wd_mult: dict = {}
        self.set_wd_mult({})
        self._index_update_count: dict = {}
        #: {key: num_update} of a push counted as a whole (`counting_round`), else None
        self._round_num_updates: dict | None = None

    def check_rule(self) -> None:
        """ArgumentKindError unless this optimizer's class defines an update rule
        (`host_chunk`): MXNet's `create_state` and `update` are not gpukv's interface,
        and a class with those alone would fail at its first push."""
        if type(self).host_chunk is Optimizer.host_chunk and not getattr(
                self, "per_key_norms", False):  # (LAMB's rule is in two parts, per key)
            mxnet = [m for m in ("create_state", "update") if hasattr(self, m)]
            said = (f" (it has MXNet's {' and '.join(mxnet)}, which gpukv does not call)"
                    if mxnet else "")
            raise ArgumentKindError(
                f"{type(self).__name__}: no update rule{said}: a gpukv optimizer defines "
                f"host_chunk (its rule on NumPy arrays; cuda_body for keys on GPUs), "
                f"state_names and option_names; see 'Writing an optimizer' in "
                f"docs/optimizers.md")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith("gpukv."):  # (a user's rule keeps its base's checks)
            cls.checked_options = _checked(cls.option_names)

    def __setattr__(self, name: str, value) -> None:
        if name in type(self).checked_options:
            value = OPTION_CHECKS[name](value)
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------- MXNet's interface
    @property
    def learning_rate(self) -> float:
        """The set rate, or the schedule's at `num_update` (as MXNet's: the rate of the
        latest update; a key's next update asks it at its own count + 1, or num_update if
        that is higher: `next_scalars`)."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler(self.num_update)
        return self.lr

    def set_learning_rate(self, lr) -> None:
        """Set the rate to `lr` (only without a schedule, as in MXNet)."""
        if self.lr_scheduler is not None:
            raise ArgumentError("set_learning_rate: this optimizer follows an lr_scheduler")
        self.lr = check_number("learning_rate", lr, low=0)

    def set_lr_mult(self, args_lr_mult: dict) -> None:
        """Per-key learning-rate multipliers: `args_lr_mult` is {key or parameter name:
        multiplier}, and replaces those set before."""
        self.lr_mult = self._mults("lr_mult", args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        """Per-key weight-decay multipliers: `args_wd_mult` is {key or parameter name:
        multiplier}, and replaces those set before. As in MXNet, every name of
        `param_idx2name` that ends neither in `_weight` nor in `_gamma` (a bias, a
        BatchNorm's beta) gets 0 unless `args_wd_mult` says otherwise."""
        mults = self._mults("wd_mult", args_wd_mult)
        self.wd_mult = {name: 0.0 for name in self.idx2name.values()
                        if not name.endswith(("_weight", "_gamma"))}
        self.wd_mult.update(mults)

    @staticmethod
    def _mults(name, mults) -> dict:
        if not isinstance(mults, dict):
            raise ArgumentKindError(f"{name}: expected a dict of key -> number, "
                                    f"got {type(mults).__name__}")
        return {_mult_key(name, k): check_number(f"{name}[{k!r}]", v, low=0)
                for k, v in mults.items()}

    def _mult(self, table, key) -> float:
        if key in table:
            return table[key]
        name = self.idx2name.get(key)
        return table.get(name, 1.0) if name is not None else 1.0

    # ---------------------------------------------------------------- the rule
    @property
    def settles_compressed_pulls(self) -> bool:
        """Whether, where pulls travel compressed (`gpukv.encoding.pulls`), the store's
        value becomes what workers hold after each step, rather than staying apart from
        it by what the codec has not sent yet. True for a heavy-ball momentum on the
        step (SGD's `momentum`, centered RMSProp's `gamma2`), which carries on what a
        step's code dropped; Nesterov's momentum, the Adam-like rules and rules without
        momentum train closer to uncompressed with the value kept apart (measured on
        the accuracy benchmark: docs/optimizers.md)."""
        return False

    def state_names(self) -> tuple:
        """Names of the per-key state arrays (each shaped and typed like the weight)."""
        return ()

    def next_scalars(self, key) -> tuple:
        """Count one more update of `key` and return its per-key kernel scalars.

        The first two are always (lr, wd) as float32 values; subclasses append theirs.
        Follows MXNet: the count of `key` goes up first, `num_update` becomes the largest
        count, and the schedule is asked for that (inside `counting_round`, for the
        num_update the push has reached at this key, counting its keys served elsewhere).
        """
        count = self._index_update_count.get(key, self.begin_num_update) + 1
        given = self._round_num_updates
        if given is None or key not in given:
            num_update = max(self.num_update, count)
        else:  # the push's num_update at this key, counted over all its keys
            num_update = max(given[key], count)
        lr = self.lr_scheduler(num_update) if self.lr_scheduler is not None else self.lr
        self._index_update_count[key] = count  # (counted once the schedule answered)
        if num_update > self.num_update:  # (a set costs a call of __setattr__ a key)
            self.num_update = num_update
        lr *= self._mult(self.lr_mult, key)
        wd = self.wd * self._mult(self.wd_mult, key)
        return self._scalars(lr, wd, count)

    @contextlib.contextmanager
    def counted(self, keys) -> Iterator[list]:
        """`next_scalars` of each of `keys` in turn, for a step run inside the block: when
        one of them (a schedule of one's own) or the step raises, no key's count has
        moved, and num_update is as it was."""
        before = [(key, self._index_update_count.get(key)) for key in keys]
        num_update = self.num_update
        try:
            yield [self.next_scalars(key) for key in keys]
        except BaseException:
            for key, count in reversed(before):
                if count is None:
                    self._index_update_count.pop(key, None)
                else:
                    self._index_update_count[key] = count
            self.num_update = num_update
            raise

    def round_num_updates(self, keys) -> dict:
        """{key: the num_update its update takes} in a push of `keys` (each once, in the
        order one process updates them: int keys ascending, str keys in the order they
        were made), as `next_scalars` would count them in turn; changes nothing."""
        counts, begin = self._index_update_count, self.begin_num_update
        num_update = self.num_update
        out = {}
        for key in keys:
            num_update = max(num_update, counts.get(key, begin) + 1)
            out[key] = num_update
        return out

    @contextlib.contextmanager
    def counting_round(self, keys, num_updates: dict | None = None) -> Iterator[dict]:
        """Count a push of `keys` (in the order of `round_num_updates`) as one process
        does, where the block updates only some of them (those a process or a server of
        a dist store serves): each update inside takes the num_update one process's
        would (`num_updates`: {key: it}, counted where every key of the push is known;
        default `round_num_updates(keys)`), and every key the block did not update is
        counted once it ends, as one process would have counted it. Yields the
        num_updates. A block that raises counts no key it did not update."""
        keys = list(dict.fromkeys(keys))
        given = self.round_num_updates(keys) if num_updates is None else dict(num_updates)
        counts, begin = self._index_update_count, self.begin_num_update
        before = {key: counts.get(key) for key in keys}
        outer = self._round_num_updates
        self._round_num_updates = given
        try:
            yield given
        finally:
            self._round_num_updates = outer
        for key, count in before.items():  # (not reached when the block raised)
            if counts.get(key) == count:
                counts[key] = (begin if count is None else count) + 1
        last = max(given.values(), default=self.num_update)
        if last > self.num_update:
            self.num_update = last

    def _scalars(self, lr, wd, t) -> tuple:
        return (f32(lr), f32(wd))

    def hyper(self) -> dict:
        """The float32 hyper-parameters the kernels use: rescale, clip and `hyper_names`."""
        out = {"rescale": f32(self.rescale_grad),
               "clip": f32(self.clip_gradient) if self.clip_gradient is not None else 0.0}
        for name in self.hyper_names:
            value = getattr(self, name)
            out[name] = f32(value) if value is not None else 0.0
        return out

    def defines(self) -> dict:
        """Compile-time switches of the CUDA kernel (and branches of the host step)."""
        return {"HAS_CLIP": int(self.clip_gradient is not None)}

    #: scratch arrays (shaped like `w`, of its dtype) `host_chunk` needs
    host_scratch = 0

    def host_chunk(self, w, g, states, sc, hp, tmp) -> None:
        """Update `w` (and `states`) in place from `g`, using only in-place ufuncs.

        All arguments are equally shaped arrays of the compute type (any slice of a key,
        or of several keys sharing the scalars `sc`, which `next_scalars` returned: lr and
        wd first); `hp` holds the float32 hyper-parameters of `hyper()`; `tmp` holds
        `host_scratch` scratch arrays of that shape. The updater calls it on cache-sized
        pieces.
        """
        raise NotImplementedError

    def host_step(self, w, g, states, sc, hp) -> None:
        """Update `w` (and `states`) in place from the gradient `g`; NumPy, one key
        (`sc` and `hp` as for `host_chunk`)."""
        tmp = [np.empty_like(w) for _ in range(self.host_scratch)]
        self.host_chunk(w, g, states, sc, hp, tmp)

    cuda_body = ""

    # --------------------------------------------------- row-sparse gradients
    def lazy_rows(self) -> bool:
        """Whether a row-sparse gradient updates only its rows (weights and states).

        False: the standard update of every row, absent rows with a zero gradient.
        """
        return False

    def lazy_rows_for(self, dtype) -> bool:
        """Whether a row-sparse gradient of a weight of `dtype` (a NumPy dtype, or its
        name) updates only its rows: `lazy_rows()`, but for a rule whose update of such
        a weight, in MXNet, has no row-sparse form and makes the gradient dense (SGD's
        of float16 weights with multi_precision)."""
        return self.lazy_rows()

    def sparse_chunk(self, w, g, states, sc, hp, tmp) -> None:
        """`host_chunk` as MXNet's kernel for row-sparse gradients rounds: run on the
        gradient's rows (lazy) or on every row with the gradient made dense (standard).
        Rules without a sparse kernel in MXNet use their dense rule. `w`, `g`, `states`,
        `sc`, `hp` and `tmp` are `host_chunk`'s."""
        self.host_chunk(w, g, states, sc, hp, tmp)

    @property
    def sparse_cuda_body(self) -> str:
        """`cuda_body` for row-sparse gradients (see `sparse_chunk`)."""
        return self.cuda_body

    # ----------------------------------------------------------- saving and loading
    #: the constructor arguments `options()` saves (each subclass adds its own)
    option_names: ClassVar[tuple[str, ...]] = (
        "learning_rate", "wd", "rescale_grad", "clip_gradient", "begin_num_update",
        "multi_precision")
    #: the attributes `__setattr__` checks (`OPTION_CHECKS`): a gpukv rule's own options;
    #: a rule defined outside gpukv checks those of the gpukv rule it derives from, and
    #: attributes of its own, whatever their names, are its own business
    checked_options: ClassVar[frozenset] = _checked(option_names)

    def options(self) -> dict:
        """The constructor arguments that rebuild this optimizer (plain JSON values)."""
        out = {}
        for name in self.option_names:
            out[name] = self.lr if name == "learning_rate" else getattr(self, name)
        return out

    @property
    def update_counts(self) -> Mapping:
        """{key: how many updates it has had, `begin_num_update` included}, read-only."""
        return MappingProxyType(self._index_update_count)

    def restore_update_counts(self, counts: dict, num_update: int) -> None:
        """Take over saved update counts ({key: count}) and `num_update`."""
        self._index_update_count.clear()  # in place: `update_counts` views stay current
        self._index_update_count.update(counts)
        self.num_update = num_update

    def settings(self) -> tuple:
        """What may change while training (the options, such as the learning rate and
        rescale_grad, and the per-key multipliers), as a comparable, picklable value:
        a dist store sends it to its servers when it changes."""
        return (tuple(sorted(self.options().items())), tuple(self.lr_mult.items()),
                tuple(self.wd_mult.items()))

    def apply_settings(self, settings: tuple) -> None:
        """Take over what `settings()` of an optimizer of the same kind returned."""
        options, lr_mult, wd_mult = settings
        for name, value in options:
            if name != "begin_num_update":  # the update counts have started
                setattr(self, "lr" if name == "learning_rate" else name, value)
        self.lr_mult = dict(lr_mult)
        self.wd_mult = dict(wd_mult)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({args})"

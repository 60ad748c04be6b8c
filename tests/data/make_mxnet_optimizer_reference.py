"""Write mxnet_optimizer_reference.json: MXNet 1.9.1's optimizers, step by step.

Run with the MXNet reference interpreter (mxnet==1.9.1, numpy==1.23.5), from any folder
but the mxnet package's own:

    python tests/data/make_mxnet_optimizer_reference.py

Each case creates an `mx.kv` 'local' store, sets an optimizer with `kv.set_optimizer`,
and pushes fixed-seed gradients for two keys for a few steps; the JSON holds the initial
weights, the gradients, the weights after every step and the final optimizer states.
AdamW has no optimizer class in MXNet 1.9.1: the case drives the contrib `adamw_update` /
`mp_adamw_update` operators the way MXNet's later AdamW optimizer does (lr=1, eta=the
bias-corrected learning rate). Floats are written with repr, so float32 values survive.
"""
import math
import os

import mxnet as mx
import numpy as np
from _mxnet_common import values, write_cases  # this script's folder

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mxnet_optimizer_reference.json")
KEYS = [3, 7]
SHAPES = [(3, 4), (5,)]
STEPS = 4


@mx.optimizer.register
class AdamWRef(mx.optimizer.Optimizer):
    """MXNet's AdamW rule on 1.9.1's contrib operators."""

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-6,
                 correct_bias=True, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.correct_bias = correct_bias

    def create_state(self, index, weight):
        return (mx.nd.zeros(weight.shape, weight.context, dtype=weight.dtype),
                mx.nd.zeros(weight.shape, weight.context, dtype=weight.dtype))

    def create_state_multi_precision(self, index, weight):
        if self.multi_precision and weight.dtype == np.float16:
            master = weight.astype(np.float32)
            return (self.create_state(index, master), master)
        return self.create_state(index, weight)

    def _step(self, index, weight, grad, state, mp):
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        t = self._index_update_count[index]
        if self.correct_bias:
            lr *= math.sqrt(1. - self.beta2 ** t) / (1. - self.beta1 ** t)
        kw = dict(lr=1.0, wd=wd, eta=lr, beta1=self.beta1, beta2=self.beta2,
                  epsilon=self.epsilon)
        if self.clip_gradient:
            kw["clip_gradient"] = self.clip_gradient
        rescale = mx.nd.full((1,), self.rescale_grad, ctx=weight.context)
        if mp:
            (mean, var), master = state
            mx.nd.contrib.mp_adamw_update(weight, grad, mean, var, master, rescale,
                                          out=weight, **kw)
        else:
            mean, var = state
            mx.nd.contrib.adamw_update(weight, grad, mean, var, rescale, out=weight, **kw)

    def update(self, index, weight, grad, state):
        self._step(index, weight, grad, state, False)

    def update_multi_precision(self, index, weight, grad, state):
        self._step(index, weight, grad, state,
                   self.multi_precision and weight.dtype == np.float16)


def case(name, opt, dtype="float32", sched=None, lr_mult=None, **kwargs):
    return {"name": name, "optimizer": opt, "kwargs": kwargs, "dtype": dtype,
            "lr_scheduler": sched, "lr_mult": lr_mult}


CASES = [
    case("sgd_plain", "sgd", learning_rate=0.1),
    case("sgd_mom_wd", "sgd", learning_rate=0.1, momentum=0.9, wd=1e-3),
    case("sgd_mom_clip_rescale", "sgd", learning_rate=0.05, momentum=0.9, wd=1e-2,
         rescale_grad=0.5, clip_gradient=0.3),
    case("sgd_clip_nomom", "sgd", learning_rate=0.1, wd=1e-2, clip_gradient=0.5),
    case("sgd_lazy_false", "sgd", learning_rate=0.1, momentum=0.5, lazy_update=False),
    case("sgd_factor_schedule", "sgd", sched={"class": "FactorScheduler", "step": 2,
                                              "factor": 0.5, "base_lr": 0.2},
         learning_rate=0.2, momentum=0.9),
    case("sgd_lr_mult", "sgd", lr_mult={"lr": {7: 0.5}, "wd": {3: 0.0}},
         learning_rate=0.1, momentum=0.9, wd=0.01),
    case("nag_mom_wd", "nag", learning_rate=0.1, momentum=0.9, wd=1e-3),
    case("nag_clip_rescale", "nag", learning_rate=0.1, momentum=0.9, rescale_grad=2.0,
         clip_gradient=0.2),
    case("nag_nomom", "nag", learning_rate=0.1, wd=1e-2),
    case("adam_default", "adam"),
    case("adam_all", "adam", learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-6,
         wd=1e-2, rescale_grad=0.5, clip_gradient=0.5),
    case("adam_lazy_false", "adam", learning_rate=0.01, lazy_update=False),
    case("adam_cosine", "adam", sched={"class": "CosineScheduler", "max_update": 6,
                                       "base_lr": 0.01, "final_lr": 0.001},
         learning_rate=0.01),
    case("adamw_default", "adamwref", learning_rate=0.01),
    case("adamw_all", "adamwref", learning_rate=0.01, wd=0.05, rescale_grad=0.5,
         clip_gradient=0.5, beta1=0.8, beta2=0.99, epsilon=1e-7),
    case("adamw_nobias", "adamwref", learning_rate=0.01, wd=0.01, correct_bias=False),
    case("adagrad_default", "adagrad", learning_rate=0.1),
    case("adagrad_all", "adagrad", learning_rate=0.1, wd=1e-2, clip_gradient=0.5,
         rescale_grad=0.5, eps=1e-6),
    case("rmsprop_default", "rmsprop", learning_rate=0.01),
    case("rmsprop_wd_clipw", "rmsprop", learning_rate=0.01, wd=1e-2, clip_weights=0.9,
         clip_gradient=1.0),
    case("rmsprop_centered", "rmsprop", learning_rate=0.01, centered=True),
    case("rmsprop_centered_all", "rmsprop", learning_rate=0.01, centered=True, gamma1=0.95,
         gamma2=0.8, wd=1e-2, clip_gradient=0.5, clip_weights=1.5, rescale_grad=0.5),
    case("lamb_default", "lamb", learning_rate=0.01),
    case("lamb_all", "lamb", learning_rate=0.01, wd=1e-2, clip_gradient=0.5,
         rescale_grad=0.5, lower_bound=0.1, upper_bound=2.0),
    case("lamb_nobias", "lamb", learning_rate=0.01, bias_correction=False, wd=1e-2),
    case("sgd_mom_fp16_mp", "sgd", dtype="float16", learning_rate=0.1, momentum=0.9,
         wd=1e-3, multi_precision=True),
    case("sgd_fp16_mp", "sgd", dtype="float16", learning_rate=0.1, clip_gradient=0.5,
         multi_precision=True),
    case("nag_fp16_mp", "nag", dtype="float16", learning_rate=0.1, momentum=0.9,
         wd=1e-3, multi_precision=True),
    case("adam_fp16_mp", "adam", dtype="float16", learning_rate=0.01, wd=1e-3,
         multi_precision=True),
    case("adamw_fp16_mp", "adamwref", dtype="float16", learning_rate=0.01, wd=1e-2,
         multi_precision=True),
    case("adagrad_fp16_mp", "adagrad", dtype="float16", learning_rate=0.1,
         multi_precision=True),
    case("rmsprop_fp16_mp", "rmsprop", dtype="float16", learning_rate=0.01, centered=True,
         multi_precision=True),
    case("lamb_fp16_mp", "lamb", dtype="float16", learning_rate=0.01, wd=1e-2,
         multi_precision=True),
]

STATE_NAMES = {  # MXNet's state layout -> gpukv's state names
    "sgd": ("mom",), "nag": ("mom",), "adam": ("mean", "var"), "adamwref": ("mean", "var"),
    "adagrad": ("history",), "lamb": ("mean", "var"),
}


def flat_states(opt_name, kwargs, state, mp):
    """MXNet's state object as {gpukv state name: array}."""
    out = {}
    if mp:
        if opt_name in ("sgd", "nag", "adamwref"):
            main, master = state
        else:
            master, main = state
        out["master"] = master
    else:
        main = state
    if opt_name == "rmsprop":
        names = ("n", "g", "delta") if kwargs.get("centered") else ("n",)
    else:
        names = STATE_NAMES[opt_name]
    if main is None:
        return out
    if isinstance(main, mx.nd.NDArray):
        main = (main,)
    for n, arr in zip(names, main):
        out[n] = arr
    return out


def run(c, seed):
    rng = np.random.RandomState(seed)
    dtype = np.dtype(c["dtype"])
    w0 = [rng.standard_normal(s).astype(np.float32).astype(dtype) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(np.float32).astype(dtype) for s in SHAPES]
             for _ in range(STEPS)]
    kwargs = dict(c["kwargs"])
    if c["lr_scheduler"]:
        spec = dict(c["lr_scheduler"])
        cls = getattr(mx.lr_scheduler, spec.pop("class"))
        kwargs["lr_scheduler"] = cls(**spec)
    opt = mx.optimizer.create(c["optimizer"], **kwargs)
    if c["lr_mult"]:
        opt.set_lr_mult(c["lr_mult"]["lr"])
        opt.set_wd_mult(c["lr_mult"]["wd"])
    kv = mx.kv.create("local")
    kv.init(KEYS, [mx.nd.array(w, dtype=dtype) for w in w0])
    kv.set_optimizer(opt)
    after = []
    for step in range(STEPS):
        kv.push(KEYS, [mx.nd.array(g, dtype=dtype) for g in grads[step]])
        outs = [mx.nd.zeros(s, dtype=dtype) for s in SHAPES]
        kv.pull(KEYS, out=outs)
        after.append([values(o.asnumpy()) for o in outs])
    mp = dtype == np.float16 and kwargs.get("multi_precision", False)
    states = {}
    for key in KEYS:
        flat = flat_states(c["optimizer"], c["kwargs"], kv._updater.states[key], mp)
        states[str(key)] = {n: values(a.asnumpy()) for n, a in flat.items()}
    return {"name": c["name"], "optimizer": "adamw" if c["optimizer"] == "adamwref"
            else c["optimizer"], "kwargs": c["kwargs"], "dtype": c["dtype"],
            "lr_scheduler": c["lr_scheduler"], "lr_mult": c["lr_mult"] and {
                "lr": {str(k): v for k, v in c["lr_mult"]["lr"].items()},
                "wd": {str(k): v for k, v in c["lr_mult"]["wd"].items()}},
            "keys": KEYS, "shapes": [list(s) for s in SHAPES],
            "init": [values(w) for w in w0],
            "grads": [[values(g) for g in gs] for gs in grads],
            "after": after, "states": states}


def main():
    write_cases(OUT, [run(c, 1000 + i) for i, c in enumerate(CASES)], STEPS)


if __name__ == "__main__":
    main()

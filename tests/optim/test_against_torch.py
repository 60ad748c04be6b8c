"""The store's optimizers (MXNet's formulas) against torch.optim's, fed the same 100
gradients: which take the same steps and which part, as docs/trainer.md's table says."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import optim

torch = pytest.importorskip("torch")

LR = 0.01
#: name -> (gpukv's optimizer, torch.optim's for a parameter list), the same options
PAIRS = {
    "sgd": (lambda: optim.SGD(learning_rate=LR, momentum=0.9, wd=1e-3),
            lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=1e-3)),
    "nag": (lambda: optim.NAG(learning_rate=LR, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, nesterov=True)),
    "adam": (lambda: optim.Adam(learning_rate=LR),
             lambda ps: torch.optim.Adam(ps, lr=LR)),
    "adamw": (lambda: optim.AdamW(learning_rate=LR, wd=0.01, epsilon=1e-8),
              lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01)),
    "rmsprop": (lambda: optim.RMSProp(learning_rate=LR, gamma1=0.9),
                lambda ps: torch.optim.RMSprop(ps, lr=LR, alpha=0.9)),
    "adagrad": (lambda: optim.AdaGrad(learning_rate=LR, eps=1e-10),
                lambda ps: torch.optim.Adagrad(ps, lr=LR, eps=1e-10)),
}


def apart(name: str, scale: float) -> float:
    """How far the weights end apart, over how far torch's moved: 100 steps of unit
    normal gradients times `scale` on 1000 weights."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(1000).astype(np.float32)
    grads = [(rng.standard_normal(1000) * scale).astype(np.float32) for _ in range(100)]
    make_gpukv, make_torch = PAIRS[name]
    kv = gpukv.create("local")
    kv.init("w", w0.copy())
    kv.set_optimizer(make_gpukv())
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = make_torch([p])
    for g in grads:
        kv.push("w", g)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    out = np.empty_like(w0)
    kv.pull("w", out=out)
    theirs = p.detach().numpy()
    return float(np.abs(out - theirs).max() / np.abs(theirs - w0).max())


@pytest.mark.parametrize("name", ["sgd", "nag", "adam", "adagrad"])
def test_these_take_torchs_steps_on_gradients_of_one(name):
    """SGD (momentum, L2 weight decay), NAG, Adam and AdaGrad (torch's epsilon) take
    torch's steps up to rounding on unit gradients."""
    assert apart(name, 1.0) < 1e-4


@pytest.mark.parametrize("name", ["adam", "rmsprop", "adagrad"])
def test_epsilon_sits_elsewhere_so_small_gradients_part(name):
    """Adam adds epsilon before the bias correction, RMSProp and AdaGrad inside the square
    root: on gradients of 1e-6 the steps part by a few percent or more."""
    assert apart(name, 1e-6) > 0.05


@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_these_part_on_gradients_of_one(name):
    """AdamW scales its decay by the bias-corrected step, and RMSProp's epsilon inside
    the square root shows on the smaller values: they part even on unit gradients."""
    assert apart(name, 1.0) > 0.01

"""The update rules, each in MXNet 1.9.1's order of operations.

For every rule, `host_chunk` (NumPy; LAMB: `host_direction_chunk`, then `host_step`) and
`cuda_body` (CUDA C, compiled with --fmad=false so nothing is fused) perform the same float
operations in the same order, so they give the same bits, except that float32 subnormals
flush to zero on GPUs (CuPy compiles with -ftz=true; see `gpukv/device/cuda/optim_kernels.py`). In
`cuda_body`, `w` and `g` are the weight (or its float32 master copy) and the gradient in
the compute type `ct`, `S0..S2` the state arrays, `lr, wd, x0, x1` the per-key scalars and
the hyper parameters have their own names. `clipv(x, c)` is mshadow's clip.
"""
from __future__ import annotations

import math

import numpy as np

from .._errors import ArgumentError
from ._base import Optimizer, Schedule, base_options, f32, register


def _clip(x, c):
    np.clip(x, -c, c, out=x)
    return x


def _rescaled(g, hp, clip: bool, out, w=None, wd=None, tmp=None):
    """out = clip(rescale_grad * g), or clip(rescale_grad * g + w * wd) given `w` (`tmp`:
    scratch for the decay term); no clip unless `clip`."""
    np.multiply(g, hp["rescale"], out=out)
    if w is not None:
        np.multiply(w, wd, out=tmp)
        np.add(out, tmp, out=out)
    if clip:
        _clip(out, hp["clip"])
    return out


def _lr_step(g, lr, hp, clip: bool, out):
    """out = lr * clip(rescale_grad * g); unclipped, MXNet rounds it as (lr * rescale) * g."""
    if clip:
        _rescaled(g, hp, True, out)
        np.multiply(out, lr, out=out)
    else:
        np.multiply(g, lr * hp["rescale"], out=out)
    return out


def _decay_step(w, g, lr, wd, hp, clip: bool, t):
    """MXNet's `sgd_update`: w = (1 - lr * wd) * w - lr * clip(rescale_grad * g)."""
    _lr_step(g, lr, hp, clip, t)
    np.multiply(w, w.dtype.type(1) - lr * wd, out=w)
    np.subtract(w, t, out=w)


def _set_moment_options(opt, beta1, beta2, epsilon) -> None:
    """Set the options of Adam-like rules (checked as set): beta1, beta2 in [0, 1),
    epsilon > 0."""
    opt.beta1 = beta1
    opt.beta2 = beta2
    opt.epsilon = epsilon


def _moments(mean, var, r, s, hp, square_first: bool):
    """Adam's moments: mean = beta1 * mean + (1 - beta1) * r and var = beta2 * var +
    (1 - beta2) * r * r, rounded as ((1 - beta2) * r) * r, or with `square_first` as
    (r * r) * (1 - beta2). `s`: scratch."""
    one = r.dtype.type(1)
    np.multiply(mean, hp["beta1"], out=mean)
    np.multiply(r, one - hp["beta1"], out=s)
    np.add(mean, s, out=mean)
    if square_first:
        np.multiply(r, r, out=s)
        np.multiply(s, one - hp["beta2"], out=s)
    else:
        np.multiply(r, one - hp["beta2"], out=s)
        np.multiply(s, r, out=s)
    np.multiply(var, hp["beta2"], out=var)
    np.add(var, s, out=var)


@register
class SGD(Optimizer):
    """SGD with momentum and weight decay (MXNet's `multi_sgd_mom_update` kernel).

        mom = momentum * mom - lr * wd * w - lr * clip(rescale_grad * grad)
        w = w + mom

    Row-sparse gradients (MXNet's sparse `sgd_update` / `sgd_mom_update`): with
    `lazy_update` only the gradient's rows of the weight and the momentum change; without
    it every row gets the standard update (absent rows with a zero gradient; without
    momentum MXNet first scales every row by 1 - lr * wd, then applies the rows).
    """

    hyper_names = ("momentum",)
    name = "sgd"

    def __init__(self, momentum: float = 0.0, lazy_update: bool = True, *,
                 learning_rate: float | None = None, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None,
                 lr_scheduler: Schedule | None = None, begin_num_update: int = 0,
                 multi_precision: bool = False, param_idx2name: dict | None = None) -> None:
        super().__init__(**base_options(locals()))
        self.momentum = momentum
        self.lazy_update = lazy_update

    option_names = Optimizer.option_names + ("momentum", "lazy_update")

    def state_names(self):
        return ("mom",) if self.momentum > 0 else ()

    @property
    def settles_compressed_pulls(self) -> bool:
        return self.momentum > 0

    def defines(self):
        return {**super().defines(), "HAS_MOM": int(self.momentum > 0)}

    host_scratch = 2

    def host_chunk(self, w, g, states, sc, hp, tmp):
        lr, wd = sc[0], sc[1]
        t, u = tmp[0], tmp[1]
        _lr_step(g, lr, hp, self.clip_gradient is not None, t)
        np.multiply(w, lr * wd, out=u)
        if self.momentum > 0:
            mom = states[0]
            np.multiply(mom, hp["momentum"], out=mom)
            np.subtract(mom, u, out=mom)
            np.subtract(mom, t, out=mom)
            np.add(w, mom, out=w)
        else:
            np.negative(u, out=u)
            np.subtract(u, t, out=u)
            np.add(w, u, out=w)

    # Row-sparse gradients (MXNet's sparse `sgd_update` / `sgd_mom_update`): with momentum
    # the rows follow the dense rule; without, `sgd_update`'s own order of operations.
    # MXNet's standard (non-lazy) sparse `sgd_update` scales every row by 1 - lr * wd,
    # then subtracts the rows' step: on a zero-filled dense gradient that is this rule.
    def lazy_rows(self) -> bool:
        return self.lazy_update

    # MXNet's SGD of a float16 weight with multi_precision is `mp_sgd_update` /
    # `mp_sgd_mom_update`, which have no row-sparse kernel: MXNet makes the gradient
    # dense, so momentum and weight decay reach every row. (Without multi_precision
    # MXNet runs the lazy kernels on the float16 weight itself; bfloat16 is never its
    # multi-precision case.)
    def lazy_rows_for(self, dtype) -> bool:
        if not (self.lazy_update and self.multi_precision):
            return self.lazy_update
        return (dtype if isinstance(dtype, str) else np.dtype(dtype).name) != "float16"

    def sparse_chunk(self, w, g, states, sc, hp, tmp):
        if self.momentum > 0:
            return self.host_chunk(w, g, states, sc, hp, tmp)
        _decay_step(w, g, sc[0], sc[1], hp, self.clip_gradient is not None, tmp[0])

    @property
    def sparse_cuda_body(self):
        if self.momentum > 0:
            return self.cuda_body
        return r"""
    ct t;
#if HAS_CLIP
    t = g * rescale; t = clipv(t, clip); t = lr * t;
#else
    t = (lr * rescale) * g;
#endif
    w = ((ct)1 - lr * wd) * w; w = w - t;
"""

    cuda_body = r"""
    ct t;
#if HAS_CLIP
    t = g * rescale; t = clipv(t, clip); t = lr * t;
#else
    t = (lr * rescale) * g;
#endif
    ct u = (lr * wd) * w;
#if HAS_MOM
    ct m = momentum * S0[i]; m = m - u; m = m - t; S0[i] = m; w = w + m;
#else
    ct m = -u; m = m - t; w = w + m;
#endif
"""


@register
class NAG(Optimizer):
    """Nesterov accelerated SGD (MXNet's `nag_mom_update`; `sgd_update` without momentum).

        mom = momentum * mom
        w = w - mom + (momentum + 1) * (mom - lr * (clip(rescale_grad * grad) + wd * w))
        mom = mom - lr * (clip(rescale_grad * grad) + wd * w)     (w: the new weight)

    The last line reads the weight already updated, as MXNet's in-place kernel does.
    """

    hyper_names = ("momentum",)
    name = "nag"
    aliases = ("nesterov",)

    def __init__(self, momentum: float = 0.0, *,
                 learning_rate: float | None = None, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None,
                 lr_scheduler: Schedule | None = None, begin_num_update: int = 0,
                 multi_precision: bool = False, param_idx2name: dict | None = None) -> None:
        super().__init__(**base_options(locals()))
        self.momentum = momentum

    option_names = Optimizer.option_names + ("momentum",)

    def state_names(self):
        return ("mom",) if self.momentum > 0 else ()

    def defines(self):
        return {**super().defines(), "HAS_MOM": int(self.momentum > 0)}

    host_scratch = 3

    def host_chunk(self, w, g, states, sc, hp, tmp):
        lr, wd = sc[0], sc[1]
        t, d, e = tmp[0], tmp[1], tmp[2]
        if self.momentum > 0:
            _rescaled(g, hp, self.clip_gradient is not None, t)
            mom = states[0]
            np.multiply(w, wd, out=d)
            np.add(d, t, out=d)
            np.multiply(d, lr, out=d)                 # d = lr * (clip(rg) + wd * w)
            np.multiply(mom, hp["momentum"], out=mom)
            np.subtract(w, mom, out=e)                # e = w - mom
            np.subtract(mom, d, out=d)                # d = mom - d
            np.multiply(d, hp["momentum"] + w.dtype.type(1), out=d)
            np.add(e, d, out=w)
            # MXNet writes the new weight in place first, so the momentum's decay term
            # sees the updated weight.
            np.multiply(w, wd, out=d)
            np.add(t, d, out=t)
            np.multiply(t, lr, out=t)
            np.subtract(mom, t, out=mom)
        else:                                         # (1 - lr*wd) * w - lr * rg
            _decay_step(w, g, lr, wd, hp, self.clip_gradient is not None, t)

    cuda_body = r"""
    ct t = g * rescale;
#if HAS_CLIP
    t = clipv(t, clip);
#endif
#if HAS_MOM
    ct d = t + wd * w; d = lr * d;
    ct m = momentum * S0[i];
    ct out = w - m; ct diff = m - d; diff = (momentum + (ct)1) * diff; out = out + diff;
    w = out;
    t = t + wd * w; t = lr * t;
    S0[i] = m - t;
#else
#if HAS_CLIP
    t = lr * t;
#else
    t = (lr * rescale) * g;
#endif
    w = ((ct)1 - lr * wd) * w; w = w - t;
#endif
"""


@register
class Adam(Optimizer):
    """Adam (MXNet's `adam_update`; the bias correction goes into the learning rate).

        g = clip(rescale_grad * grad + wd * w)
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        w = w - lr * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + epsilon)

    Row-sparse gradients: with `lazy_update` only the gradient's rows of w, m and v
    change (MXNet's lazy `adam_update`); without it, every row (absent rows: zero grad).
    """

    hyper_names = ("beta1", "beta2", "epsilon")
    name = "adam"
    default_learning_rate = 0.001

    def __init__(self, learning_rate: float | None = None, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-8, lazy_update: bool = True, *,
                 wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: Schedule | None = None,
                 begin_num_update: int = 0, multi_precision: bool = False,
                 param_idx2name: dict | None = None) -> None:
        super().__init__(**base_options(locals()))
        _set_moment_options(self, beta1, beta2, epsilon)
        self.lazy_update = lazy_update

    option_names = Optimizer.option_names + ("beta1", "beta2", "epsilon", "lazy_update")

    def state_names(self):
        return ("mean", "var")

    def _scalars(self, lr, wd, t):
        coef1 = 1.0 - self.beta1 ** t
        coef2 = 1.0 - self.beta2 ** t
        return (f32(lr * math.sqrt(coef2) / coef1), f32(wd))

    host_scratch = 2

    def host_chunk(self, w, g, states, sc, hp, tmp, square_first=False):
        """`Optimizer.host_chunk`; `square_first` rounds the second moment as
        (g * g) * (1 - beta2), as MXNet's row-sparse kernel does."""
        lr, wd = sc[0], sc[1]
        mean, var = states
        r, s = tmp[0], tmp[1]
        _rescaled(g, hp, self.clip_gradient is not None, r, w, wd, s)
        _moments(mean, var, r, s, hp, square_first)
        np.sqrt(var, out=r)
        np.add(r, hp["epsilon"], out=r)
        np.multiply(mean, lr, out=s)
        np.divide(s, r, out=s)
        np.subtract(w, s, out=w)

    def lazy_rows(self) -> bool:
        return self.lazy_update

    # MXNet's sparse `adam_update` computes (1 - beta2) * square(g) where the dense and
    # the lazy unclipped kernels compute ((1 - beta2) * g) * g: its standard update and
    # its clipped lazy update round v that way.
    def _sparse_square(self) -> bool:
        return not (self.lazy_update and self.clip_gradient is None)

    def sparse_chunk(self, w, g, states, sc, hp, tmp):
        self.host_chunk(w, g, states, sc, hp, tmp, square_first=self._sparse_square())

    _body = r"""
    ct r = g * rescale; r = r + w * wd;
#if HAS_CLIP
    r = clipv(r, clip);
#endif
    ct m = beta1 * S0[i]; m = m + ((ct)1 - beta1) * r; S0[i] = m;
    ct sq = SQUARE;
    ct v = beta2 * S1[i]; v = v + sq; S1[i] = v;
    ct den = sqrt(v) + epsilon;
    w = w - (lr * m) / den;
"""

    @property
    def sparse_cuda_body(self):
        if not self._sparse_square():
            return self.cuda_body
        return self._body.replace("SQUARE", "r * r; sq = ((ct)1 - beta2) * sq")

    cuda_body = _body.replace("SQUARE", "((ct)1 - beta2) * r; sq = sq * r")


@register
class AdamW(Optimizer):
    """Adam with decoupled weight decay (MXNet's contrib `adamw_update`, lr=1, eta=lr).

        g = clip(rescale_grad * grad)
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        eta = lr * sqrt(1 - beta2**t) / (1 - beta1**t)     (lr alone if not correct_bias)
        w = w - eta * (m / (sqrt(v) + epsilon) + wd * w)
    """

    hyper_names = ("beta1", "beta2", "epsilon")
    name = "adamw"
    default_learning_rate = 0.001

    def __init__(self, learning_rate: float | None = None, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-6, correct_bias: bool = True, *,
                 wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: Schedule | None = None,
                 begin_num_update: int = 0, multi_precision: bool = False,
                 param_idx2name: dict | None = None) -> None:
        super().__init__(**base_options(locals()))
        _set_moment_options(self, beta1, beta2, epsilon)
        self.correct_bias = correct_bias

    option_names = Optimizer.option_names + ("beta1", "beta2", "epsilon", "correct_bias")

    def state_names(self):
        return ("mean", "var")

    def _scalars(self, lr, wd, t):
        if self.correct_bias:
            lr = lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        return (f32(lr), f32(wd))

    host_scratch = 2

    def host_chunk(self, w, g, states, sc, hp, tmp):
        eta, wd = sc[0], sc[1]
        mean, var = states
        r, s = tmp[0], tmp[1]
        _rescaled(g, hp, self.clip_gradient is not None, r)
        _moments(mean, var, r, s, hp, square_first=True)
        np.sqrt(var, out=r)
        np.add(r, hp["epsilon"], out=r)
        np.divide(mean, r, out=r)
        np.multiply(w, wd, out=s)
        np.add(r, s, out=r)
        np.multiply(r, eta, out=r)
        np.subtract(w, r, out=w)

    cuda_body = r"""
    ct r = g * rescale;
#if HAS_CLIP
    r = clipv(r, clip);
#endif
    ct m = beta1 * S0[i]; m = m + ((ct)1 - beta1) * r; S0[i] = m;
    ct v = beta2 * S1[i]; v = v + ((ct)1 - beta2) * (r * r); S1[i] = v;
    ct d = m / (sqrt(v) + epsilon); d = d + wd * w;
    w = w - lr * d;
"""


@register
class AdaGrad(Optimizer):
    """AdaGrad (MXNet's dense AdaGrad.update).

        g = clip(grad * rescale_grad);  history += g * g
        w += (g / sqrt(history + eps) + w * wd) * -lr

    A row-sparse gradient always updates only its rows (MXNet's sparse `adagrad_update`).
    """

    hyper_names = ("eps",)
    name = "adagrad"

    def __init__(self, eps: float = 1e-7, *,
                 learning_rate: float | None = None, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None,
                 lr_scheduler: Schedule | None = None, begin_num_update: int = 0,
                 multi_precision: bool = False, param_idx2name: dict | None = None) -> None:
        super().__init__(**base_options(locals()))
        self.eps = eps

    option_names = Optimizer.option_names + ("eps",)

    def state_names(self):
        return ("history",)

    host_scratch = 2

    def host_chunk(self, w, g, states, sc, hp, tmp):
        lr, wd = sc[0], sc[1]
        (hist,) = states
        r, s = tmp[0], tmp[1]
        _rescaled(g, hp, self.clip_gradient is not None, r)
        np.multiply(r, r, out=s)
        np.add(hist, s, out=hist)
        np.add(hist, hp["eps"], out=s)
        np.sqrt(s, out=s)
        np.divide(r, s, out=r)
        np.multiply(w, wd, out=s)
        np.add(r, s, out=r)
        np.multiply(r, -lr, out=r)
        np.add(w, r, out=w)

    # MXNet's sparse `adagrad_update` always updates only the gradient's rows; its
    # w - lr * (g / sqrt(h + eps)) rounds as the dense w + (g / sqrt(h + eps) + 0) * -lr.
    # (MXNet refuses weight decay there; here the rows also get the dense rule's wd term.)
    def lazy_rows(self) -> bool:
        return True

    cuda_body = r"""
    ct r = g * rescale;
#if HAS_CLIP
    r = clipv(r, clip);
#endif
    ct h = S0[i] + r * r; S0[i] = h;
    ct d = r / sqrt(h + eps); d = d + w * wd; d = d * (-lr);
    w = w + d;
"""


@register
class RMSProp(Optimizer):
    """RMSProp: Tieleman & Hinton (`rmsprop_update`), or Graves' centered version
    (`rmspropalex_update`) with `centered=True`; `clip_weights` clips the new weight.

    gamma1: the decay of the mean square of the gradients (and, centered, of its mean);
    gamma2: the momentum of the centered version; epsilon: added to the mean square
    before its square root.
    """

    hyper_names = ("gamma1", "gamma2", "epsilon", "clip_weights")
    name = "rmsprop"
    default_learning_rate = 0.001

    def __init__(self, learning_rate: float | None = None, gamma1: float = 0.9,
                 gamma2: float = 0.9, epsilon: float = 1e-8, centered: bool = False,
                 clip_weights: float | None = None, *,
                 wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: Schedule | None = None,
                 begin_num_update: int = 0, multi_precision: bool = False,
                 param_idx2name: dict | None = None) -> None:
        super().__init__(**base_options(locals()))
        self.gamma1 = gamma1
        self.gamma2 = gamma2
        self.epsilon = epsilon
        self.centered = centered
        self.clip_weights = clip_weights

    option_names = Optimizer.option_names + ("gamma1", "gamma2", "epsilon", "centered",
                                             "clip_weights")

    def state_names(self):
        return ("n", "g", "delta") if self.centered else ("n",)

    @property
    def settles_compressed_pulls(self) -> bool:
        return self.centered and self.gamma2 > 0

    def defines(self):
        return {**super().defines(), "CENTERED": int(self.centered),
                "HAS_CLIP_W": int(self.clip_weights is not None)}

    host_scratch = 3

    def host_chunk(self, w, g, states, sc, hp, tmp):
        lr, wd = sc[0], sc[1]
        one = w.dtype.type(1)
        r, s, d = tmp[0], tmp[1], tmp[2]
        _rescaled(g, hp, self.clip_gradient is not None, r, w, wd, s)
        g1 = hp["gamma1"]
        if not self.centered:
            (n,) = states
            np.multiply(r, r, out=s)
            np.multiply(s, one - g1, out=s)
            np.multiply(n, g1, out=n)
            np.add(n, s, out=n)
            np.add(n, hp["epsilon"], out=s)
            np.sqrt(s, out=s)
            np.divide(r, s, out=s)
            np.multiply(s, lr, out=s)
            np.subtract(w, s, out=w)
        else:
            n, gs, delta = states
            np.multiply(r, one - g1, out=s)
            np.multiply(s, r, out=s)
            np.multiply(n, g1, out=n)
            np.add(n, s, out=n)
            np.multiply(gs, g1, out=gs)
            np.multiply(r, one - g1, out=s)
            np.add(gs, s, out=gs)
            np.multiply(gs, gs, out=s)
            np.subtract(n, s, out=s)
            np.add(s, hp["epsilon"], out=s)
            np.sqrt(s, out=s)
            np.multiply(r, lr, out=d)
            np.divide(d, s, out=d)
            np.multiply(delta, hp["gamma2"], out=delta)
            np.subtract(delta, d, out=delta)
            np.add(w, delta, out=w)
        if self.clip_weights is not None:
            _clip(w, hp["clip_weights"])

    cuda_body = r"""
    ct r = rescale * g; r = r + wd * w;
#if HAS_CLIP
    r = clipv(r, clip);
#endif
#if CENTERED
    ct n = (((ct)1 - gamma1) * r) * r; n = n + gamma1 * S0[i]; S0[i] = n;
    ct gs = ((ct)1 - gamma1) * r; gs = gs + gamma1 * S1[i]; S1[i] = gs;
    ct dl = gamma2 * S2[i]; dl = dl - (lr * r) / sqrt((n - gs * gs) + epsilon); S2[i] = dl;
    w = w + dl;
#else
    ct n = ((ct)1 - gamma1) * (r * r); n = n + gamma1 * S0[i]; S0[i] = n;
    w = w - lr * (r / sqrt(n + epsilon));
#endif
#if HAS_CLIP_W
    w = clipv(w, clip_weights);
#endif
"""


@register
class LAMB(Optimizer):
    """LAMB (MXNet's `multi_lamb_update`): Adam's direction plus wd * w, scaled per key by
    the trust ratio ||w|| / ||direction|| (||w|| bounded by lower_bound / upper_bound).

    beta1, beta2, epsilon: Adam's; bias_correction: divide the moments by
    1 - beta1**t and 1 - beta2**t.

    With multi_precision, ||w|| is the norm of the stored float16 (or bfloat16) weight,
    not of its float32 master copy: MXNet 1.9.1's optimizer steps float16 keys through
    `multi_mp_lamb_update`, which sums the squares of the weights it is given.
    """

    hyper_names = ("beta1", "beta2", "epsilon", "lower_bound", "upper_bound")
    name = "lamb"
    default_learning_rate = 0.001
    #: the step needs whole-key norms: the updater runs it key by key
    per_key_norms = True

    def __init__(self, learning_rate: float | None = None, beta1: float = 0.9,
                 beta2: float = 0.999, epsilon: float = 1e-6, lower_bound: float | None = None,
                 upper_bound: float | None = None, bias_correction: bool = True, *,
                 wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: Schedule | None = None,
                 begin_num_update: int = 0, multi_precision: bool = False,
                 param_idx2name: dict | None = None) -> None:
        super().__init__(**base_options(locals()))
        _set_moment_options(self, beta1, beta2, epsilon)
        self.lower_bound = lower_bound
        self.upper_bound = upper_bound
        if (self.lower_bound is not None and self.upper_bound is not None
                and self.lower_bound > self.upper_bound):
            raise ArgumentError(f"optimizer option lower_bound={lower_bound!r} is above "
                                f"upper_bound={upper_bound!r}")
        self.bias_correction = bias_correction

    option_names = Optimizer.option_names + ("beta1", "beta2", "epsilon", "lower_bound",
                                             "upper_bound", "bias_correction")

    def state_names(self):
        return ("mean", "var")

    def defines(self):
        return {**super().defines(), "BIAS": int(self.bias_correction),
                "HAS_LB": int(self.lower_bound is not None),
                "HAS_UB": int(self.upper_bound is not None)}

    def _scalars(self, lr, wd, t):
        one = np.float32(1)
        bc1 = one - np.power(np.float32(self.beta1), np.float32(t))
        bc2 = one - np.power(np.float32(self.beta2), np.float32(t))
        return (f32(lr), f32(wd), float(bc1), float(bc2))

    host_scratch = 2

    def host_direction_chunk(self, w, g, states, sc, hp, d, tmp) -> None:
        """Phase one on a piece: update the moments, write the direction into `d`
        (`w`, `g`, `states`, `sc`, `hp` and `tmp` as for `Optimizer.host_chunk`)."""
        wd, bc1, bc2 = sc[1], sc[2], sc[3]
        mean, var = states
        r, s = tmp[0], tmp[1]
        _rescaled(g, hp, self.clip_gradient is not None, r)
        _moments(mean, var, r, s, hp, square_first=False)
        if self.bias_correction:
            np.divide(mean, bc1, out=d)
            np.divide(var, bc2, out=s)
        else:
            np.copyto(d, mean)
            np.copyto(s, var)
        np.sqrt(s, out=s)
        np.add(s, hp["epsilon"], out=s)
        np.divide(d, s, out=d)
        np.multiply(w, wd, out=s)
        np.add(d, s, out=d)

    def host_direction(self, w, g, states, sc, hp):
        """Phase one on a whole key: update the moments, return the direction (a new
        array); `w`, `g`, `states`, `sc` and `hp` as for `Optimizer.host_chunk`."""
        d = np.empty_like(w)
        self.host_direction_chunk(w, g, states, sc, hp, d, [np.empty_like(w), np.empty_like(w)])
        return d

    def trust_lr(self, lr, sumsq_w, sumsq_d, hp, ct):
        """lr * ||w|| / ||d|| in MXNet's float arithmetic (lr alone if either norm is 0),
        from the sums of squares `sumsq_w` and `sumsq_d`, the bounds in `hp`, as a `ct`
        (the compute type) scalar."""
        r1 = np.sqrt(np.float32(sumsq_w))
        r2 = np.sqrt(np.float32(sumsq_d))
        if self.lower_bound is not None:
            r1 = max(r1, np.float32(hp["lower_bound"]))
        if self.upper_bound is not None:
            r1 = min(r1, np.float32(hp["upper_bound"]))
        r = ct(1) if (r1 == 0 or r2 == 0) else ct(np.float32(r1 / r2))
        return lr * r

    def host_step(self, w, g, states, sc, hp, stored=None):
        """`Optimizer.host_step`, with ||w|| taken of `stored` when given (the key's
        stored value, of which `w` may be the float32 master copy), as MXNet does."""
        d = self.host_direction(w, g, states, sc, hp)
        ref = w if stored is None else stored
        sumsq_w = float(np.sum(np.square(ref, dtype=np.float64)))
        sumsq_d = float(np.sum(np.square(d, dtype=np.float64)))
        lr = self.trust_lr(sc[0], sumsq_w, sumsq_d, hp, w.dtype.type)
        d *= lr
        w -= d

    # The GPU runs LAMB in two kernels (see _optim_kernels): this body is phase one.
    cuda_body = r"""
    ct r = g * rescale;
#if HAS_CLIP
    r = clipv(r, clip);
#endif
    ct m = beta1 * S0[i]; m = m + ((ct)1 - beta1) * r; S0[i] = m;
    ct sq = ((ct)1 - beta2) * r; sq = sq * r;
    ct v = beta2 * S1[i]; v = v + sq; S1[i] = v;
#if BIAS
    m = m / x0; v = v / x1;
#endif
    ct d = m / (sqrt(v) + epsilon); d = d + wd * w;
"""

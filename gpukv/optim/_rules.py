"""The update rules, each in MXNet 1.9.1's order of operations.

For every rule, `host_step` (NumPy) and `cuda_body` (CUDA C, compiled with --fmad=false so
nothing is fused) perform the same float operations in the same order. In `cuda_body`,
`w` and `g` are the weight (or its float32 master copy) and the gradient in the compute
type `ct`, `S0..S2` the state arrays, `lr, wd, x0, x1` the per-key scalars and the hyper
parameters have their own names. `clipv(x, c)` is mshadow's clip.
"""
from __future__ import annotations

import math

import numpy as np

from .._errors import ArgumentError
from ._base import Optimizer, check_bool, check_number, f32, register


def _clip(x, c):
    np.clip(x, -c, c, out=x)
    return x


@register
class SGD(Optimizer):
    """SGD with momentum and weight decay (MXNet's `multi_sgd_mom_update` kernel).

        mom = momentum * mom - lr * wd * w - lr * clip(rescale_grad * grad)
        w = w + mom

    `lazy_update` is accepted as in MXNet; it only changes row-sparse gradients, and the
    gradients an updater sees here are dense, so both settings give the standard update.
    """

    hyper_names = ("momentum",)
    name = "sgd"

    def __init__(self, momentum=0.0, lazy_update=True, **kwargs):
        super().__init__(**kwargs)
        self.momentum = check_number("momentum", momentum, low=0, high=1, high_open=True)
        self.lazy_update = check_bool("lazy_update", lazy_update)

    _options = Optimizer._options + ("momentum", "lazy_update")

    def state_names(self):
        return ("mom",) if self.momentum > 0 else ()

    def defines(self):
        return {**super().defines(), "HAS_MOM": int(self.momentum > 0)}

    def host_step(self, w, g, states, sc, hp):
        lr, wd = sc[0], sc[1]
        if self.clip_gradient is not None:
            t = _clip(np.multiply(g, hp["rescale"]), hp["clip"])
            t *= lr
        else:
            t = np.multiply(g, lr * hp["rescale"])
        u = np.multiply(w, lr * wd)
        if self.momentum > 0:
            mom = states[0]
            m = np.multiply(mom, hp["momentum"])
            m -= u
            m -= t
            mom[...] = m
            w += m
        else:
            np.negative(u, out=u)
            u -= t
            w += u

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

    def __init__(self, momentum=0.0, **kwargs):
        super().__init__(**kwargs)
        self.momentum = check_number("momentum", momentum, low=0, high=1, high_open=True)

    _options = Optimizer._options + ("momentum",)

    def state_names(self):
        return ("mom",) if self.momentum > 0 else ()

    def defines(self):
        return {**super().defines(), "HAS_MOM": int(self.momentum > 0)}

    def host_step(self, w, g, states, sc, hp):
        lr, wd = sc[0], sc[1]
        t = np.multiply(g, hp["rescale"])
        if self.clip_gradient is not None:
            _clip(t, hp["clip"])
        if self.momentum > 0:
            mom = states[0]
            d = np.multiply(w, wd)
            d += t
            d *= lr                                   # d = lr * (clip(rg) + wd * w)
            mom *= hp["momentum"]
            out = np.subtract(w, mom)
            diff = np.subtract(mom, d)
            diff *= hp["momentum"] + w.dtype.type(1)
            out += diff
            w[...] = out
            # MXNet writes the new weight in place first, so the momentum's decay term
            # sees the updated weight.
            t += np.multiply(w, wd)
            t *= lr
            mom -= t
        else:                                         # (1 - lr*wd) * w - lr * rg
            if self.clip_gradient is not None:
                t *= lr
            else:
                t = np.multiply(g, lr * hp["rescale"])
            w *= w.dtype.type(1) - lr * wd
            w -= t

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
    """

    hyper_names = ("beta1", "beta2", "epsilon")
    name = "adam"

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 lazy_update=True, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = check_number("beta1", beta1, low=0, high=1, high_open=True)
        self.beta2 = check_number("beta2", beta2, low=0, high=1, high_open=True)
        self.epsilon = check_number("epsilon", epsilon, low=0, low_open=True)
        self.lazy_update = check_bool("lazy_update", lazy_update)

    _options = Optimizer._options + ("beta1", "beta2", "epsilon", "lazy_update")

    def state_names(self):
        return ("mean", "var")

    def _scalars(self, lr, wd, t):
        coef1 = 1.0 - self.beta1 ** t
        coef2 = 1.0 - self.beta2 ** t
        return (f32(lr * math.sqrt(coef2) / coef1), f32(wd))

    def host_step(self, w, g, states, sc, hp):
        lr, wd = sc[0], sc[1]
        one = w.dtype.type(1)
        mean, var = states
        r = np.multiply(g, hp["rescale"])
        r += np.multiply(w, wd)
        if self.clip_gradient is not None:
            _clip(r, hp["clip"])
        mean *= hp["beta1"]
        mean += np.multiply(r, one - hp["beta1"])
        sq = np.multiply(r, one - hp["beta2"])
        sq *= r
        var *= hp["beta2"]
        var += sq
        den = np.sqrt(var)
        den += hp["epsilon"]
        num = np.multiply(mean, lr)
        num /= den
        w -= num

    cuda_body = r"""
    ct r = g * rescale; r = r + w * wd;
#if HAS_CLIP
    r = clipv(r, clip);
#endif
    ct m = beta1 * S0[i]; m = m + ((ct)1 - beta1) * r; S0[i] = m;
    ct sq = ((ct)1 - beta2) * r; sq = sq * r;
    ct v = beta2 * S1[i]; v = v + sq; S1[i] = v;
    ct den = sqrt(v) + epsilon;
    w = w - (lr * m) / den;
"""


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

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-6,
                 correct_bias=True, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = check_number("beta1", beta1, low=0, high=1, high_open=True)
        self.beta2 = check_number("beta2", beta2, low=0, high=1, high_open=True)
        self.epsilon = check_number("epsilon", epsilon, low=0, low_open=True)
        self.correct_bias = check_bool("correct_bias", correct_bias)

    _options = Optimizer._options + ("beta1", "beta2", "epsilon", "correct_bias")

    def state_names(self):
        return ("mean", "var")

    def _scalars(self, lr, wd, t):
        if self.correct_bias:
            lr = lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        return (f32(lr), f32(wd))

    def host_step(self, w, g, states, sc, hp):
        eta, wd = sc[0], sc[1]
        one = w.dtype.type(1)
        mean, var = states
        r = np.multiply(g, hp["rescale"])
        if self.clip_gradient is not None:
            _clip(r, hp["clip"])
        mean *= hp["beta1"]
        mean += np.multiply(r, one - hp["beta1"])
        sq = np.multiply(r, r)
        sq *= one - hp["beta2"]
        var *= hp["beta2"]
        var += sq
        den = np.sqrt(var)
        den += hp["epsilon"]
        d = np.divide(mean, den)
        d += np.multiply(w, wd)
        d *= eta
        w -= d

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
    """

    hyper_names = ("eps",)
    name = "adagrad"

    def __init__(self, eps=1e-7, **kwargs):
        super().__init__(**kwargs)
        self.eps = check_number("eps", eps, low=0, low_open=True)

    _options = Optimizer._options + ("eps",)

    @property
    def float_stable_eps(self):
        return self.eps

    def state_names(self):
        return ("history",)

    def host_step(self, w, g, states, sc, hp):
        lr, wd = sc[0], sc[1]
        (hist,) = states
        r = np.multiply(g, hp["rescale"])
        if self.clip_gradient is not None:
            _clip(r, hp["clip"])
        hist += np.multiply(r, r)
        den = np.add(hist, hp["eps"])
        np.sqrt(den, out=den)
        d = np.divide(r, den)
        d += np.multiply(w, wd)
        d *= -lr
        w += d

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
    (`rmspropalex_update`) with `centered=True`; `clip_weights` clips the new weight."""

    hyper_names = ("gamma1", "gamma2", "epsilon", "clip_weights")
    name = "rmsprop"

    def __init__(self, learning_rate=0.001, gamma1=0.9, gamma2=0.9, epsilon=1e-8,
                 centered=False, clip_weights=None, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.gamma1 = check_number("gamma1", gamma1, low=0, high=1, high_open=True)
        self.gamma2 = check_number("gamma2", gamma2, low=0, high=1, high_open=True)
        self.epsilon = check_number("epsilon", epsilon, low=0, low_open=True)
        self.centered = check_bool("centered", centered)
        self.clip_weights = check_number("clip_weights", clip_weights, low=0, low_open=True,
                                         none_ok=True)

    _options = Optimizer._options + ("gamma1", "gamma2", "epsilon", "centered", "clip_weights")

    def state_names(self):
        return ("n", "g", "delta") if self.centered else ("n",)

    def defines(self):
        return {**super().defines(), "CENTERED": int(self.centered),
                "HAS_CLIP_W": int(self.clip_weights is not None)}

    def host_step(self, w, g, states, sc, hp):
        lr, wd = sc[0], sc[1]
        one = w.dtype.type(1)
        r = np.multiply(g, hp["rescale"])
        r += np.multiply(w, wd)
        if self.clip_gradient is not None:
            _clip(r, hp["clip"])
        g1 = hp["gamma1"]
        if not self.centered:
            (n,) = states
            sq = np.multiply(r, r)
            sq *= one - g1
            n *= g1
            n += sq
            den = np.add(n, hp["epsilon"])
            np.sqrt(den, out=den)
            d = np.divide(r, den)
            d *= lr
            w -= d
        else:
            n, gs, delta = states
            sq = np.multiply(r, one - g1)
            sq *= r
            n *= g1
            n += sq
            gs *= g1
            gs += np.multiply(r, one - g1)
            den = np.multiply(gs, gs)
            np.subtract(n, den, out=den)
            den += hp["epsilon"]
            np.sqrt(den, out=den)
            d = np.multiply(r, lr)
            d /= den
            delta *= hp["gamma2"]
            delta -= d
            w += delta
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
    the trust ratio ||w|| / ||direction|| (||w|| bounded by lower_bound / upper_bound)."""

    hyper_names = ("beta1", "beta2", "epsilon", "lower_bound", "upper_bound")
    name = "lamb"

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-6,
                 lower_bound=None, upper_bound=None, bias_correction=True, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = check_number("beta1", beta1, low=0, high=1, high_open=True)
        self.beta2 = check_number("beta2", beta2, low=0, high=1, high_open=True)
        self.epsilon = check_number("epsilon", epsilon, low=0, low_open=True)
        self.lower_bound = check_number("lower_bound", lower_bound, low=0, low_open=True,
                                        none_ok=True)
        self.upper_bound = check_number("upper_bound", upper_bound, low=0, low_open=True,
                                        none_ok=True)
        if (self.lower_bound is not None and self.upper_bound is not None
                and self.lower_bound > self.upper_bound):
            raise ArgumentError(f"optimizer option lower_bound={lower_bound!r} is above "
                                f"upper_bound={upper_bound!r}")
        self.bias_correction = check_bool("bias_correction", bias_correction)

    _options = Optimizer._options + ("beta1", "beta2", "epsilon", "lower_bound",
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

    def host_direction(self, w, g, states, sc, hp):
        """Phase one: update the moments, return the direction (a new array)."""
        wd, bc1, bc2 = sc[1], sc[2], sc[3]
        one = w.dtype.type(1)
        mean, var = states
        r = np.multiply(g, hp["rescale"])
        if self.clip_gradient is not None:
            _clip(r, hp["clip"])
        mean *= hp["beta1"]
        mean += np.multiply(r, one - hp["beta1"])
        sq = np.multiply(r, one - hp["beta2"])
        sq *= r
        var *= hp["beta2"]
        var += sq
        if self.bias_correction:
            m = np.divide(mean, bc1)
            v = np.divide(var, bc2)
        else:
            m, v = mean, var.copy()
        np.sqrt(v, out=v)
        v += hp["epsilon"]
        d = np.divide(m, v)
        d += np.multiply(w, wd)
        return d

    def trust_lr(self, lr, sumsq_w, sumsq_d, hp, ct):
        """lr * ||w|| / ||d|| in MXNet's float arithmetic (lr alone if either norm is 0)."""
        r1 = np.sqrt(np.float32(sumsq_w))
        r2 = np.sqrt(np.float32(sumsq_d))
        if self.lower_bound is not None:
            r1 = max(r1, np.float32(hp["lower_bound"]))
        if self.upper_bound is not None:
            r1 = min(r1, np.float32(hp["upper_bound"]))
        r = ct(1) if (r1 == 0 or r2 == 0) else ct(np.float32(r1 / r2))
        return lr * r

    def host_step(self, w, g, states, sc, hp, stored=None):
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

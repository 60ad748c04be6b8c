"""gpukv's LAMB kernels (two phases, the first with a shared-memory reduction) run on the
CPU emulation and agree with the optimizer's NumPy twin."""
from __future__ import annotations

import numpy as np
import pytest

from gpukv import optim
from gpukv.device.cuda import optim_kernels as _optim_kernels
from gpukv.optim._updater import compute_dtype

from ..bfloat16 import BF16, needs_bfloat16
from .support import device, kernels

SIZES = (20000, 300, 8192, 1)  # five chunks of 8192: a key over several blocks, a tail


def _launch_lamb(opt, wdtype, weights, grads, scalars):
    """Phases 1 and 2 over every key at once, as `_optim_kernels.step` launches them.
    Returns (stored, master, states, direction, sums) as host arrays per key."""
    ct = compute_dtype(wdtype)
    narrow = np.dtype(wdtype).itemsize == 2
    stored = [device(w.astype(wdtype)) for w in weights]
    master = [device(s.host.astype(np.float32)) if narrow else None for s in stored]
    states = [[device(np.zeros(w.size, ct)) for _ in opt.state_names()] for w in weights]
    items = [(s, device(g.astype(ct)), m, st, sc)
             for s, g, m, st, sc in zip(stored, grads, master, states, scalars)]
    ptrs, sizes, chunk_start, toff, chunk_tensor, scal = _optim_kernels.plan(items)
    hp = _optim_kernels.hyper_vector(opt, opt.hyper())
    sums = device(np.zeros(2 * len(items)))
    tmp = device(np.zeros(int(sizes.sum()), ct))
    args = (device(ptrs), device(sizes), device(chunk_start), device(toff),
            device(chunk_tensor), device(scal), device(hp), sums, tmp)
    grid, block = (len(chunk_tensor),), (_optim_kernels.BLOCK,)
    for phase in (1, 2):
        source = _optim_kernels.kernel_source(opt, wdtype, phase)
        kernels.RawKernel(source, "gpukv_optim_step", options=("--fmad=false",))(
            grid, block, args)
    directions = [tmp.host[o:o + s] for o, s in zip(toff, sizes)]
    return ([s.host for s in stored], [m.host if m else None for m in master],
            [[a.host for a in st] for st in states], directions, sums.host.reshape(-1, 2))


@pytest.mark.parametrize("wdtype", [
    np.float32, np.float64, np.float16,
    pytest.param(BF16, id="bfloat16", marks=needs_bfloat16)], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("options", [
    {}, {"lower_bound": 0.5, "upper_bound": 20.0, "clip_gradient": 0.3,
         "bias_correction": False, "wd": 0.01, "rescale_grad": 0.5}], ids=["default", "bounded"])
def test_lamb_phases_match_the_host_twin(wdtype, options):
    """Moments, direction and the updated weights equal the NumPy twin's bits; the
    per-key norms (summed in a tree on the device, pairwise by NumPy) agree to 1e-12, and
    the step taken with the device's norms is the twin's step to the bit."""
    opt = optim.LAMB(learning_rate=0.01, **options)
    rng = np.random.default_rng(3)
    weights = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    grads = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    scalars = [opt.next_scalars(k) for k in range(len(SIZES))]
    stored, master, states, directions, sums = _launch_lamb(opt, wdtype, weights, grads,
                                                            scalars)
    ct = compute_dtype(wdtype).type
    hp = {k: ct(v) for k, v in opt.hyper().items()}
    for k, (w0, g) in enumerate(zip(weights, grads)):
        sc = tuple(ct(v) for v in scalars[k])
        w_stored = w0.astype(wdtype)
        w = w_stored.astype(ct)  # the rule updates the master copy (or the weight)
        host_states = [np.zeros(w.size, ct) for _ in opt.state_names()]
        d = opt.host_direction(w, g.astype(ct), host_states, sc, hp)
        np.testing.assert_array_equal(directions[k], d, err_msg=f"direction of key {k}")
        for got, want in zip(states[k], host_states):
            np.testing.assert_array_equal(got, want, err_msg=f"state of key {k}")
        norms = (np.sum(np.square(w_stored, dtype=np.float64)),
                 np.sum(np.square(d, dtype=np.float64)))
        np.testing.assert_allclose(sums[k], norms, rtol=1e-12, err_msg=f"norms of key {k}")
        lr = opt.trust_lr(sc[0], sums[k][0], sums[k][1], hp, ct)
        w -= d * lr
        if master[k] is None:
            np.testing.assert_array_equal(stored[k], w, err_msg=f"weight of key {k}")
        else:
            np.testing.assert_array_equal(master[k], w, err_msg=f"master copy of key {k}")
            np.testing.assert_array_equal(stored[k].view(np.uint16),
                                          w.astype(wdtype).view(np.uint16),
                                          err_msg=f"weight of key {k}")

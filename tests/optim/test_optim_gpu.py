"""Optimizers on GPU keys: the multi-tensor kernels give the host twin's weights, master
copies and states bit for bit (LAMB's weights within float32's last bits), for every rule,
option set and weight dtype, several keys per launch, with a learning-rate schedule."""
from __future__ import annotations

import numpy as np
import pytest

import gpukv
from gpukv import optim
from gpukv.device.cuda import optim_kernels as _optim_kernels
from gpukv.optim import lr_scheduler as sched

from ..bfloat16 import BF16, needs_bfloat16

pytestmark = pytest.mark.gpu

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16]
#: DTYPES as cases: bfloat16's skips without ml_dtypes
DTYPE_PARAMS = DTYPES[:3] + [pytest.param(BF16, id="bfloat16", marks=needs_bfloat16)]

# Sizes around the kernels' CHUNK (8192 elements per block): a key over three blocks, one
# of exactly one block, a 2-D key over two, and keys far smaller than a block.
SHAPES = {0: (20000,), 1: (_optim_kernels.CHUNK,), 2: (130, 70), 3: (7,), 4: (1,)}
KEYS = sorted(SHAPES)
# The keys each push updates: the second leaves some out, so the keys of one launch
# are at different update counts (Adam's bias correction, the schedule's step).
PUSHES = [KEYS, [0, 2, 4], KEYS]

SCHEDULES = {
    "factor": lambda: sched.FactorScheduler(step=1, factor=0.7),
    "multifactor": lambda: sched.MultiFactorScheduler(step=[1, 2], factor=0.5),
    "poly": lambda: sched.PolyScheduler(max_update=6, pwr=2, final_lr=1e-4,
                                        warmup_steps=1, warmup_begin_lr=1e-3),
    "cosine": lambda: sched.CosineScheduler(max_update=5, final_lr=1e-4, warmup_steps=2,
                                            warmup_begin_lr=1e-3, warmup_mode="constant"),
}

# name: (schedule, optimizer given that schedule)
OPTIMIZERS = {
    "sgd": ("factor", lambda s: optim.SGD(learning_rate=0.1, wd=1e-3, lr_scheduler=s)),
    "sgd_mom_wd_clip": ("poly", lambda s: optim.SGD(
        learning_rate=0.1, momentum=0.9, wd=1e-3, clip_gradient=0.8, rescale_grad=0.5,
        lr_scheduler=s)),
    "sgd_lazy_off": ("cosine", lambda s: optim.SGD(
        learning_rate=0.05, momentum=0.5, lazy_update=False, clip_gradient=2.0,
        lr_scheduler=s)),
    "nag": ("multifactor", lambda s: optim.create("nesterov", learning_rate=0.05, wd=1e-3,
                                                  lr_scheduler=s)),
    "nag_mom_wd_clip": ("factor", lambda s: optim.NAG(
        learning_rate=0.05, momentum=0.9, wd=1e-3, clip_gradient=1.0, lr_scheduler=s)),
    "adam": ("poly", lambda s: optim.Adam(learning_rate=0.01, wd=1e-3, lr_scheduler=s)),
    "adam_clip": ("cosine", lambda s: optim.Adam(
        learning_rate=0.01, wd=1e-3, clip_gradient=0.5, rescale_grad=2.0, lr_scheduler=s)),
    "adamw": ("multifactor", lambda s: optim.AdamW(learning_rate=0.01, wd=1e-2,
                                                   lr_scheduler=s)),
    "adamw_raw_clip": ("factor", lambda s: optim.AdamW(
        learning_rate=0.01, wd=1e-2, correct_bias=False, clip_gradient=0.5, lr_scheduler=s)),
    "adagrad": ("poly", lambda s: optim.AdaGrad(
        learning_rate=0.1, wd=1e-3, clip_gradient=1.0, lr_scheduler=s)),
    "rmsprop": ("cosine", lambda s: optim.RMSProp(learning_rate=0.01, wd=1e-3,
                                                  lr_scheduler=s)),
    "rmsprop_centered_clip": ("multifactor", lambda s: optim.RMSProp(
        learning_rate=0.01, centered=True, clip_weights=1.5, clip_gradient=1.0,
        gamma2=0.8, lr_scheduler=s)),
    "lamb": ("factor", lambda s: optim.LAMB(learning_rate=0.01, wd=1e-2, lr_scheduler=s)),
    "lamb_bounds": ("poly", lambda s: optim.LAMB(
        learning_rate=0.01, wd=1e-2, lower_bound=0.5, upper_bound=20.0,
        bias_correction=False, clip_gradient=0.3, rescale_grad=0.5, lr_scheduler=s)),
    # keys 3 and 4 (7 elements and 1) have weight norms below 5: their ratio uses the bound
    "lamb_lower_bound": ("factor", lambda s: optim.LAMB(
        learning_rate=0.01, wd=1e-2, lower_bound=5.0, lr_scheduler=s)),
}


def _make(name):
    schedule, make = OPTIMIZERS[name]
    opt = make(SCHEDULES[schedule]())
    opt.set_lr_mult({3: 0.5})
    opt.set_wd_mult({1: 2.0})
    return opt


def _values(seed, dtype):
    """Weights and per-push gradients of every key, in `dtype`, without float32
    subnormals (a GPU flushes them to zero)."""
    rng = np.random.default_rng(seed)
    weights = {k: rng.standard_normal(s).astype(np.float32).astype(dtype)
               for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(SHAPES[k]).astype(np.float32).astype(dtype) for k in keys}
             for keys in PUSHES]
    return weights, grads


def _bits(a) -> np.ndarray:
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


def assert_same_bits(got, want, what):
    """`got` and `want` hold the same dtype, shape and bytes; else say where they differ."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    differ = np.flatnonzero(_bits(got) != _bits(want))
    assert differ.size == 0, (f"{what}: {differ.size} of {got.size} elements differ, first "
                              f"at {differ[0]}: {got.reshape(-1)[differ[0]]!r} != "
                              f"{want.reshape(-1)[differ[0]]!r}")


def assert_no_subnormals(a, what):
    """A float32 result the comparison relies on holds no subnormal (a GPU would flush it)."""
    if a.dtype == np.float32:
        tiny = np.finfo(np.float32).tiny
        assert not ((a != 0) & (np.abs(a) < tiny)).any(), f"{what}: float32 subnormal"


@pytest.fixture
def launches(monkeypatch):
    """The key sizes of every multi-tensor optimizer step run on a GPU, one list each."""
    seen = []
    step = _optim_kernels.step

    def spy(optimizer, home, items, hp, body=None):
        seen.append([it[0].size for it in items])
        return step(optimizer, home, items, hp, body=body)

    monkeypatch.setattr(_optim_kernels, "step", spy)
    return seen


def _stores(name, dtype, weights, cp, keys=KEYS):
    """A 'local' store and a 'device' store (values made on GPU 0) of `weights`, each
    with optimizer `name`."""
    host = gpukv.create("local")
    host.init(keys, [weights[k] for k in keys])
    host.set_optimizer(_make(name))
    gpu = gpukv.create("device")
    with cp.cuda.Device(0):
        gpu.init(keys, [cp.asarray(weights[k]) for k in keys])
    gpu.set_optimizer(_make(name))
    return host, gpu


def _compare(host, gpu, name, dtype, step, keys=KEYS):
    lamb = name.startswith("lamb")
    for k in keys:
        what = f"{name} {dtype} push {step} key {k}"
        want_w = host._entries[k].value
        got_w = gpu._entries[k].value.get()
        assert_no_subnormals(want_w, f"{what} weight")
        hs, gs = host._updater.states[k], gpu._updater.states[k]
        for i, (g, h) in enumerate(zip(gs.arrays, hs.arrays)):
            assert_no_subnormals(h, f"{what} state {i}")
            assert_same_bits(g.get(), h, f"{what} state {i}")
        assert (gs.master is None) == (hs.master is None) == (dtype.itemsize != 2), what
        if not lamb:
            assert_same_bits(got_w, want_w, f"{what} weight")
            if hs.master is not None:
                assert_same_bits(gs.master.get(), hs.master, f"{what} master")
            continue
        # LAMB's trust ratio comes from norms summed in another order on the GPU: the
        # float32 ratio may differ in its last bit, and so each step by ~1e-7 of itself
        # (the steps here stay below 0.1); the moments do not depend on it.
        exact = want_w if hs.master is None else hs.master
        got = got_w if gs.master is None else gs.master.get()
        np.testing.assert_allclose(got.astype(np.float64), exact.astype(np.float64),
                                   rtol=4e-7, atol=3e-8, err_msg=what)
        if gs.master is not None:  # the stored weight is its master copy, rounded
            assert_same_bits(got_w, got.astype(dtype), f"{what} weight from master")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_gpu_steps_equal_the_host_twin(name, dtype, launches, monkeypatch):
    """Three pushes of five keys (one over three kernel blocks, one a single element)
    on one GPU: each push is one multi-tensor step (LAMB: its two launches) over all its
    keys, and after each the weights, master copies and states equal the 'local'
    store's bit for bit."""
    import cupy as cp
    monkeypatch.setenv("GPUKV_VIRTUAL_GPUS", "1")  # every key on GPU 0: one launch
    weights, grads = _values(17, dtype)
    host, gpu = _stores(name, dtype, weights, cp)
    for step, keys in enumerate(PUSHES):
        host.push(keys, [grads[step][k] for k in keys])
        with cp.cuda.Device(0):
            gpu.push(keys, [cp.asarray(grads[step][k]) for k in keys])
        assert launches[-1] == [int(np.prod(SHAPES[k])) for k in keys]
        _compare(host, gpu, name, dtype, step)
    assert len(launches) == len(PUSHES)
    assert gpu._optimizer.num_update == host._optimizer.num_update == len(PUSHES)


@needs_bfloat16  # one of the four dtypes
@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("name", ["sgd_mom_wd_clip", "adam_clip", "lamb_bounds"])
def test_gpu_keys_of_every_dtype_over_four_gpus(name, launches):
    """Keys of four dtypes homed on four GPUs, pushed from every GPU in one call: one
    launch per (home, dtype) group, with the host's bits (LAMB's weights: up to their
    last bits)."""
    import cupy as cp

    from gpukv.device.cuda.device import gpu_devices
    devs = gpu_devices()[:4]
    rng = np.random.default_rng(4)
    shapes = {k: (9000 + 10 * k,) if k % 3 == 0 else (5 + k, 3) for k in range(8)}
    dtypes = {k: DTYPES[k % 4] for k in shapes}
    keys = sorted(shapes)
    w0 = {k: rng.standard_normal(shapes[k]).astype(np.float32).astype(dtypes[k]) for k in keys}
    host, gpu = _stores(name, None, w0, cp, keys)
    homes = {gpu._entries[k].home for k in keys}
    assert len(homes) == min(len(keys), len(gpu_devices()))  # largest keys spread first
    groups = {(gpu._entries[k].home, dtypes[k]) for k in keys}
    for step in range(3):
        # Each gradient is the sum of two equal halves on two GPUs (exact in any order).
        halves = {k: rng.standard_normal(shapes[k]).astype(np.float32).astype(dtypes[k])
                  for k in keys}
        host.push(keys, [[halves[k], halves[k]] for k in keys])
        sources = []
        for k in keys:
            pair = []
            for d in (devs[k % 4], devs[(k + 1) % 4]):
                with d.cuda_device:
                    pair.append(cp.asarray(halves[k]))
            sources.append(pair)
        gpu.push(keys, sources)
    assert len(launches) == 3 * len(groups)
    for dtype in DTYPES:
        _compare(host, gpu, name, dtype, 3, [k for k in keys if dtypes[k] == dtype])


def test_every_registered_optimizer_is_covered():
    """The GPU matrix above runs every optimizer class gpukv.optim registers."""
    from gpukv.optim._base import _REGISTRY
    covered = {type(_make(name)) for name in OPTIMIZERS}
    assert covered == set(_REGISTRY.values())

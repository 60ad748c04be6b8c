"""gpukv.optim and KVStore.set_optimizer: MXNet 1.9.1's numbers, state, checkpoints, errors."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv import optim
from gpukv._errors import ArgumentError, ArgumentKindError, CheckpointError, DTypeError, GpukvError

from ..bfloat16 import needs_bfloat16

DATA = Path(__file__).parents[1] / "data" / "mxnet_optimizer_reference.json"
REFERENCE = json.loads(DATA.read_text())
CASES = {c["name"]: c for c in REFERENCE["cases"]}
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------- helpers
def _array(values, shape, dtype):
    return np.array([float(v) for v in values], np.float64).astype(dtype).reshape(shape)


def _optimizer(case):
    kwargs = dict(case["kwargs"])
    if case["lr_scheduler"]:
        spec = dict(case["lr_scheduler"])
        kwargs["lr_scheduler"] = getattr(optim, spec.pop("class"))(**spec)
    opt = optim.create(case["optimizer"], **kwargs)
    if case["lr_mult"]:
        opt.set_lr_mult({int(k): v for k, v in case["lr_mult"]["lr"].items()})
        opt.set_wd_mult({int(k): v for k, v in case["lr_mult"]["wd"].items()})
    return opt


def _split(grad, devices):
    """`devices` arrays whose sum is exactly `grad` in any order of summation."""
    if devices == 1:
        return grad
    half = (grad.astype(np.float32) * np.float32(0.5)).astype(grad.dtype)
    if not np.array_equal((half.astype(np.float32) * 2).astype(grad.dtype), grad):
        return [grad] + [np.zeros_like(grad) for _ in range(devices - 1)]  # subnormals
    return [half, half.copy()] + [np.zeros_like(grad) for _ in range(devices - 2)]


def _assert_no_subnormals(*arrays):
    """GPU-vs-host checks use float32 inputs without subnormals: CuPy compiles kernels
    with -ftz=true, so the GPU flushes them to zero where NumPy keeps them."""
    def flat(x):
        if isinstance(x, (list, tuple)):
            return [v for item in x for v in flat(item)]
        return list(np.asarray(x, np.float64).reshape(-1)) if hasattr(x, "shape") else [x]

    a = np.array([float(v) for v in flat(list(arrays))], np.float64).astype(np.float32)
    tiny = np.finfo(np.float32).tiny
    assert not ((a != 0) & (np.abs(a) < tiny)).any(), "float32 subnormal in the input"


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=1e-6, atol=1e-7, err_msg=what)


def _store(kind, case, opt=None):
    dtype = np.dtype(case["dtype"])
    shapes = [tuple(s) for s in case["shapes"]]
    kv = gpukv.create(kind)
    kv.init(case["keys"], [_array(v, s, dtype) for v, s in zip(case["init"], shapes)])
    kv.set_optimizer(opt if opt is not None else _optimizer(case))
    return kv, dtype, shapes


def _push_step(kv, case, step, dtype, shapes, devices=1):
    grads = [_array(v, s, dtype) for v, s in zip(case["grads"][step], shapes)]
    kv.push(case["keys"], [_split(g, devices) for g in grads])


def _pull(kv, case, dtype, shapes):
    outs = [np.zeros(s, dtype) for s in shapes]
    kv.pull(case["keys"], out=outs)
    return outs


# ------------------------------------------------------------- MXNet reference table
@pytest.mark.parametrize("store,devices", [("local", 1), ("device", 4)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_mxnet(name, store, devices):
    """Every step of every reference case gives MXNet 1.9.1's weights and final states."""
    case = CASES[name]
    kv, dtype, shapes = _store(store, case)
    for step in range(REFERENCE["steps"]):
        _push_step(kv, case, step, dtype, shapes, devices)
        for key, got, want, shape in zip(case["keys"], _pull(kv, case, dtype, shapes),
                                         case["after"][step], shapes):
            _close(got, _array(want, shape, dtype), f"{name} step {step + 1} key {key}")
    updater = kv._updater
    for key, shape in zip(case["keys"], shapes):
        state = updater.states[key]
        have = dict(zip(kv._optimizer.state_names(), state.arrays))
        if state.master is not None:
            have["master"] = state.master
        assert set(have) == set(case["states"][str(key)]), name
        for sname, values in case["states"][str(key)].items():
            want = _array(values, shape, np.float64)
            if case["optimizer"] == "lamb":  # the norms' order of summation shows here
                np.testing.assert_allclose(have[sname], want, rtol=1e-5, atol=1e-7)
            else:
                _close(have[sname], want, f"{name} {key} {sname}")


def test_reference_is_mostly_bit_exact():
    """Apart from LAMB's norms (summed in another order), the host path is bit-exact."""
    for name, case in CASES.items():
        if case["optimizer"] == "lamb" and case["dtype"] == "float32":
            continue
        kv, dtype, shapes = _store("local", case)
        for step in range(REFERENCE["steps"]):
            _push_step(kv, case, step, dtype, shapes)
            for got, want, shape in zip(_pull(kv, case, dtype, shapes),
                                        case["after"][step], shapes):
                assert np.array_equal(got, _array(want, shape, dtype)), (name, step)


def test_single_key_pushes_equal_one_list_push():
    """Updating keys one push at a time gives the same numbers as one list push."""
    case = CASES["adam_all"]
    kv1, dtype, shapes = _store("local", case)
    kv2, _, _ = _store("local", case)
    for step in range(REFERENCE["steps"]):
        _push_step(kv1, case, step, dtype, shapes)
        for key, v, s in zip(case["keys"], case["grads"][step], shapes):
            kv2.push(key, _array(v, s, dtype))
    for a, b in zip(_pull(kv1, case, dtype, shapes), _pull(kv2, case, dtype, shapes)):
        assert np.array_equal(a, b)


def test_update_count_is_per_key():
    """A key first pushed later starts its own count (Adam's bias correction uses t=1)."""
    w = np.linspace(-1, 1, 6, dtype=np.float32)
    g = np.linspace(0.5, -0.5, 6, dtype=np.float32)
    kv = gpukv.create("local")
    kv.init([1, 2], [w, w])
    kv.set_optimizer(optim.Adam(learning_rate=0.1))
    kv.push(1, g)
    kv.push(1, g)
    kv.push([1, 2], [g, g])
    fresh = gpukv.create("local")
    fresh.init(2, w)
    fresh.set_optimizer(optim.Adam(learning_rate=0.1))
    fresh.push(2, g)
    a, b = np.zeros(6, np.float32), np.zeros(6, np.float32)
    kv.pull(2, out=a)
    fresh.pull(2, out=b)
    assert np.array_equal(a, b)
    assert kv._optimizer._index_update_count == {1: 3, 2: 1}


def _scheduled_sgd():
    """SGD whose rate halves at every update (so a key's rate tells its num_update)."""
    schedule = optim.FactorScheduler(step=1, factor=0.5, base_lr=0.1)
    return optim.SGD(momentum=0.5, lr_scheduler=schedule)


def _store_of(keys, opt):
    kv = gpukv.create("local")
    kv.init(list(keys), [np.full(3, 1.0 + k, np.float32) for k in keys])
    kv.set_optimizer(opt)
    return kv


def _value(kv, key):
    out = np.zeros(3, np.float32)
    kv.pull(key, out=out)
    return out


#: int keys pushed unequally: key 0 at most steps, 4 at some, 9 once
UNEQUAL = [[0, 4], [0], [0], [0, 4], [4], [0, 4, 9]]


@pytest.mark.parametrize("told", [False, True], ids=["every-shard-counts", "told"])
def test_shards_counting_every_key_of_a_push_take_one_processs_rates(told):
    """Keys pushed unequally under a schedule, each updated by a store of its own (a dist
    store's shards): when each shard's optimizer counts every key of a push in one
    process's order (`counting_round`), or is told the num_update a worker's copy counted
    (a server), every key takes the rate one process gives it, bit for bit, and the
    counts are one process's."""
    one_opt = _scheduled_sgd()
    one = _store_of([0, 4, 9], one_opt)
    owners = {0: "a", 4: "b", 9: "b"}
    shards = {name: (_store_of([k for k, o in owners.items() if o == name], opt), opt)
              for name, opt in (("a", _scheduled_sgd()), ("b", _scheduled_sgd()))}
    worker = _scheduled_sgd()
    for i, keys in enumerate(UNEQUAL):
        grad = np.full(3, i + 1.0, np.float32)
        one.push(keys, [grad] * len(keys))
        with worker.counting_round(keys) as num_updates:
            pass  # (a worker's copy updates nothing: it counts)
        for name, (kv, opt) in shards.items():
            mine = [k for k in keys if owners[k] == name]
            if told:  # a server updates each key as its round completes
                for key in mine:
                    with opt.counting_round([key], {key: num_updates[key]}):
                        kv.push(key, grad)
                continue
            with opt.counting_round(keys):
                if mine:
                    kv.push(mine, [grad] * len(mine))
    for key, name in owners.items():
        assert np.array_equal(_value(shards[name][0], key), _value(one, key)), key
    assert dict(worker.update_counts) == dict(one_opt.update_counts) == {0: 5, 4: 4, 9: 1}
    for name, (kv, opt) in shards.items():
        assert opt.num_update == one_opt.num_update == 5
        if not told:
            assert dict(opt.update_counts) == dict(one_opt.update_counts)
    apart = _store_of([4], _scheduled_sgd())  # a shard counting its own keys alone
    for i, keys in enumerate(UNEQUAL):
        if 4 in keys:
            apart.push(4, np.full(3, i + 1.0, np.float32))
    assert not np.array_equal(_value(apart, 4), _value(one, 4))


def test_a_round_that_raises_counts_no_key_it_did_not_update():
    """A push whose round raises leaves the counts of the keys it did not update, and
    num_update, as they were."""
    opt = optim.SGD(learning_rate=0.1)
    kv = gpukv.create("local")
    kv.init([1, 2], [np.ones(2, np.float32)] * 2)
    kv.set_optimizer(opt)
    kv.push([1, 2], [np.ones(2, np.float32)] * 2)
    with pytest.raises(RuntimeError):
        with opt.counting_round([1, 2]):
            raise RuntimeError("the round failed")
    assert (dict(opt.update_counts), opt.num_update) == ({1: 1, 2: 1}, 1)
    with opt.counting_round([1, 2]) as num_updates:
        kv.push(2, np.ones(2, np.float32))
    assert num_updates == {1: 2, 2: 2}
    assert (dict(opt.update_counts), opt.num_update) == ({1: 2, 2: 2}, 2)


# ------------------------------------------------------------------ multi-precision
@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=needs_bfloat16)])
def test_narrow_weights_keep_a_float32_master(dtype):
    """16-bit weights are updated through a float32 master; the stored value is its cast."""
    dt = np.dtype(getattr(__import__("ml_dtypes"), dtype)) if dtype == "bfloat16" else \
        np.dtype(dtype)
    w = np.ones(8, dt)
    kv = gpukv.create("local")
    kv.init("w", w)
    kv.set_optimizer(optim.SGD(learning_rate=1e-4, multi_precision=True))
    for _ in range(100):  # each step alone is below half an ulp of 1.0 in 16 bits
        kv.push("w", np.ones(8, dt))
    master = kv._updater.states["w"].master
    assert master.dtype == np.float32
    assert np.allclose(master, 1 - 100 * 1e-4, rtol=1e-5)
    out = np.zeros(8, dt)
    kv.pull("w", out=out)
    assert np.array_equal(out, master.astype(dt))
    assert float(out[0]) < 1.0


def _written_master_case(xp, dt):
    """An adopted 16-bit value 8 steps of SGD in, then 3 elements written in place (one
    with the value it holds): the master takes the 2 changed, keeps the rest."""
    value = xp.asarray(np.linspace(1, 2, 8).astype(np.float32).astype(dt))
    kv = gpukv.create("local" if xp is np else "device")
    kv.adopt(["w"], [value])
    kv.set_optimizer(optim.SGD(learning_rate=1e-4))
    for _ in range(8):  # each step below half an ulp: only the master moves
        kv.push("w", xp.asarray(np.ones(8, dt)))
    before = xp.asnumpy(kv._updater.states["w"].master) if xp is not np else \
        kv._updater.states["w"].master.copy()
    value[0] = xp.asarray(np.array(5, dt))
    value[3] = value[3]  # written, the same bits
    value[7] = xp.asarray(np.array(np.nan, dt))
    kv.values_written(["w"])
    master = kv._updater.states["w"].master
    after = xp.asnumpy(master) if xp is not np else master
    assert after[0] == 5 and np.isnan(after[7])
    np.testing.assert_array_equal(after[1:7], before[1:7])
    assert not np.array_equal(before[1:7], np.linspace(1, 2, 8).astype(np.float32)[1:7])


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=needs_bfloat16)])
def test_values_written_in_place_reach_the_master_element_by_element(dtype):
    dt = np.dtype(getattr(__import__("ml_dtypes"), dtype)) if dtype == "bfloat16" else \
        np.dtype(dtype)
    _written_master_case(np, dt)


@pytest.mark.gpu
def test_gpu_values_written_in_place_reach_the_master_element_by_element():
    import cupy as cp
    with cp.cuda.Device(0):
        _written_master_case(cp, np.dtype("float16"))


def test_float64_weights_compute_in_float64():
    """float64 keys keep float64 states and no master copy."""
    kv = gpukv.create("local")
    kv.init(0, np.ones(4))
    kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
    kv.push(0, np.full(4, 0.5))
    state = kv._updater.states[0]
    assert state.master is None and state.arrays[0].dtype == np.float64
    out = np.zeros(4)
    kv.pull(0, out=out)
    assert np.allclose(out, 1 - np.float64(np.float32(0.1)) * 0.5)


def test_integer_key_is_refused():
    """An optimizer cannot update an integer key: DTypeError naming it."""
    kv = gpukv.create("local")
    kv.init("steps", np.zeros(3, np.int32))
    kv.set_optimizer(optim.SGD())
    with pytest.raises(DTypeError, match="steps"):
        kv.push("steps", np.ones(3, np.int32))


# ------------------------------------------------------------------ argument checks
@pytest.mark.parametrize("make,option", [
    (lambda: optim.SGD(learning_rate=-0.1), "learning_rate"),
    (lambda: optim.SGD(momentum=-0.5), "momentum"),
    (lambda: optim.SGD(momentum=1.0), "momentum"),
    (lambda: optim.SGD(wd=-1.0), "wd"),
    (lambda: optim.SGD(rescale_grad=0.0), "rescale_grad"),
    (lambda: optim.SGD(clip_gradient=-1.0), "clip_gradient"),
    (lambda: optim.NAG(momentum=-0.1), "momentum"),
    (lambda: optim.Adam(beta1=1.0), "beta1"),
    (lambda: optim.Adam(beta1=-0.1), "beta1"),
    (lambda: optim.Adam(beta2=1.5), "beta2"),
    (lambda: optim.Adam(epsilon=0.0), "epsilon"),
    (lambda: optim.AdamW(epsilon=-1e-8), "epsilon"),
    (lambda: optim.AdaGrad(eps=0.0), "eps"),
    (lambda: optim.RMSProp(gamma1=1.0), "gamma1"),
    (lambda: optim.RMSProp(clip_weights=0.0), "clip_weights"),
    (lambda: optim.LAMB(lower_bound=2.0, upper_bound=1.0), "lower_bound"),
    (lambda: optim.SGD(learning_rate=float("nan")), "learning_rate"),
    (lambda: optim.create("adam", beta1=2), "beta1"),
])
def test_options_out_of_range(make, option):
    """Options out of range raise ArgumentError (a ValueError) naming the option."""
    with pytest.raises(ArgumentError, match=option) as info:
        make()
    assert isinstance(info.value, ValueError) and isinstance(info.value, GpukvError)


@pytest.mark.parametrize("rule,attribute,value,error", [
    ("sgd", "clip_gradient", -1.0, ArgumentError),  # would reverse the gradient
    ("sgd", "wd", -3.0, ArgumentError),
    ("sgd", "rescale_grad", -1.0, ArgumentError),
    ("sgd", "rescale_grad", "abc", ArgumentKindError),
    ("sgd", "momentum", 1.0, ArgumentError),
    ("sgd", "lazy_update", "yes", ArgumentKindError),
    ("adam", "beta2", 1.0, ArgumentError),
    ("adam", "epsilon", 0.0, ArgumentError),
    ("rmsprop", "clip_weights", -1.0, ArgumentError),
    ("sgd", "lr", float("inf"), ArgumentError),
])
def test_an_option_set_as_an_attribute_is_checked_as_the_constructor_checks_it(
        rule, attribute, value, error):
    """`opt.clip_gradient = -1` after set_optimizer is refused, naming the option, and
    the store's next push updates as before."""
    kv = gpukv.create("local")
    kv.init(0, np.ones(3, np.float32))
    opt = optim.create(rule, learning_rate=0.1, momentum=0.5) if rule == "sgd" else \
        optim.create(rule, learning_rate=0.1)
    kv.set_optimizer(opt)
    before = getattr(opt, attribute)
    with pytest.raises(error, match=attribute if attribute != "lr" else "learning_rate"):
        setattr(opt, attribute, value)
    assert getattr(opt, attribute) == before
    kv.push(0, np.full(3, 5.0, np.float32))
    out = np.empty(3, np.float32)
    kv.pull(0, out=out)
    assert (out < 1).all()  # a step down the gradient


def test_a_users_rule_keeps_its_own_attributes_whatever_their_names():
    """The attribute checks are gpukv's rules' own: a rule defined outside gpukv may give
    `momentum`, `eps` or `beta1` meanings of its own (None for off, 0, 1), and keeps the
    checks of the gpukv rule it derives from (the base's, or SGD's)."""
    class Mine(optim.Optimizer):
        def __init__(self, momentum=None, eps=0.0, beta1=1.0, learning_rate=0.1):
            super().__init__(learning_rate=learning_rate)
            self.momentum, self.eps, self.beta1 = momentum, eps, beta1

    mine = Mine()
    assert (mine.momentum, mine.eps, mine.beta1) == (None, 0.0, 1.0)
    with pytest.raises(ArgumentError, match="clip_gradient"):
        mine.clip_gradient = -1.0

    class MySGD(optim.SGD):
        pass
    with pytest.raises(ArgumentError, match="momentum"):
        MySGD(momentum=1.5)


@pytest.mark.parametrize("make", [
    lambda: optim.SGD(learning_rate="0.1"),
    lambda: optim.SGD(lazy_update="yes"),
    lambda: optim.SGD(bogus=1),
    lambda: optim.create(3),
])
def test_options_of_the_wrong_kind(make):
    """Options of the wrong type raise ArgumentKindError (a TypeError)."""
    with pytest.raises(ArgumentKindError):
        make()


def test_unknown_optimizer_name():
    """An unknown optimizer name is an ArgumentError naming it."""
    with pytest.raises(ArgumentError, match="nadamx"):
        optim.create("nadamx")


@pytest.mark.parametrize("bad", ["sgd", optim.SGD, lambda k, g, w: None, None, 3])
def test_set_optimizer_needs_an_optimizer(bad):
    """set_optimizer with anything but an Optimizer instance raises ArgumentKindError."""
    kv = gpukv.create("local")
    with pytest.raises(ArgumentKindError):
        kv.set_optimizer(bad)


def test_create_names():
    """create() knows every rule by name, case-insensitively, with MXNet's defaults."""
    for name, cls in [("SGD", optim.SGD), ("nag", optim.NAG), ("Adam", optim.Adam),
                      ("adamw", optim.AdamW), ("adagrad", optim.AdaGrad),
                      ("rmsprop", optim.RMSProp), ("lamb", optim.LAMB)]:
        assert type(optim.create(name)) is cls
    assert optim.create("sgd").lr == 0.01 and optim.create("adam").lr == 0.001


def test_schedulers_follow_mxnet():
    """The schedules give MXNet's rates (values computed with mx.lr_scheduler)."""
    f = optim.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    assert [f(n) for n in range(1, 8)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
    m = optim.MultiFactorScheduler(step=[2, 5], factor=0.1, base_lr=1.0)
    assert [m(n) for n in (1, 2, 3, 5, 6)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])
    c = optim.CosineScheduler(max_update=4, base_lr=1.0, final_lr=0.0)
    assert [c(n) for n in (0, 2, 4, 9)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    p = optim.PolyScheduler(max_update=4, base_lr=1.0, pwr=2)
    assert p(2) == pytest.approx(0.25)
    w = optim.FactorScheduler(step=10, base_lr=1.0, warmup_steps=4, warmup_begin_lr=0.2)
    assert w(2) == pytest.approx(0.6)


def _rates(opt, updates: int) -> list:
    """The learning rate of each of `updates` updates of one key (SGD: lr as it is)."""
    return [float(opt.next_scalars(0)[0]) for _ in range(updates)]


def test_an_optimizers_rate_replaces_the_schedules_after_warm_up_only():
    """As MXNet's Optimizer: a learning_rate given beside a schedule becomes its base_lr,
    the rate after warm-up; the warm-up still rises to the base_lr the schedule was made
    with (MXNet 1.9.1: 0.025, 0.05, 0.075, 0.1, then the cosine from 0.1)."""
    cosine = optim.CosineScheduler(max_update=8, base_lr=0.1, final_lr=0.0, warmup_steps=4)
    rates = _rates(optim.SGD(learning_rate=0.3, lr_scheduler=cosine), 6)
    assert rates == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.0853553, 0.05], rel=1e-6)
    factor = optim.FactorScheduler(step=100, base_lr=0.01, warmup_steps=4)
    rates = _rates(optim.SGD(learning_rate=0.001, lr_scheduler=factor), 5)
    assert rates == pytest.approx([0.0025, 0.005, 0.0075, 0.001, 0.001], rel=1e-6)


@pytest.mark.parametrize("name", ["adam", "adamw", "rmsprop", "lamb", "sgd", "adagrad"])
def test_a_schedule_sets_the_rate_unless_a_learning_rate_is_given(name):
    """An optimizer's own default rate (0.001 for the Adam family, RMSProp and LAMB) is
    for an optimizer without a schedule: beside one, the schedule's base_lr is the rate,
    as the docs say (MXNet's Adam put its default over the schedule's, with a printed
    warning); a learning_rate given is the rate."""
    default = 0.001 if name in ("adam", "adamw", "rmsprop", "lamb") else 0.01
    assert optim.create(name).learning_rate == default
    factor = optim.FactorScheduler(step=5, base_lr=0.5)
    assert optim.create(name, lr_scheduler=factor).learning_rate == 0.5
    factor = optim.FactorScheduler(step=5, base_lr=0.5)
    assert optim.create(name, learning_rate=0.2, lr_scheduler=factor).learning_rate == 0.2


@pytest.mark.parametrize("schedule", [optim.PolyScheduler, optim.CosineScheduler])
def test_a_learning_rate_a_decaying_schedule_ignores_is_a_warning(schedule, caplog):
    """Poly and Cosine decay from the base_lr they were made with, whatever an optimizer
    sets (MXNet's rates, kept): a learning_rate that differs from it is a warning naming
    both; one equal to it, or none, says nothing."""
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        optim.SGD(learning_rate=0.1, lr_scheduler=schedule(max_update=10, base_lr=0.1))
        optim.SGD(lr_scheduler=schedule(max_update=10, base_lr=0.1))
        assert not caplog.records
        opt = optim.SGD(learning_rate=0.3, lr_scheduler=schedule(max_update=10, base_lr=0.1))
    (record,) = caplog.records
    assert (f"learning_rate=0.3 has no effect beside {schedule.__name__}: it decays from "
            f"the base_lr it was made with (0.1)") in record.getMessage()
    assert _rates(opt, 1) == pytest.approx([schedule(max_update=10, base_lr=0.1)(1)])


@pytest.mark.parametrize("schedule", [optim.PolyScheduler, optim.CosineScheduler])
def test_a_warm_up_as_long_as_the_schedule_is_refused(schedule):
    """Nothing would be left to decay over (a division by zero at the first update)."""
    with pytest.raises(gpukv.ArgumentError, match="warmup_steps=3 must be below max_update=3"):
        schedule(max_update=3, base_lr=0.1, warmup_steps=3)


def test_a_schedule_that_raises_counts_no_update_of_the_push():
    """A schedule's error reaches the push; no key of it is counted as updated (their
    counts and num_update stay as they were), so later updates keep MXNet's counts."""
    calls = []

    def schedule(num_update):
        calls.append(num_update)
        if len(calls) == 4:  # the second key of the second push
            raise RuntimeError("schedule failed")
        return 0.1

    kv = gpukv.create("local")
    kv.init([1, 2], [np.ones(2, np.float32), np.ones(2, np.float32)])
    opt = optim.SGD(lr_scheduler=schedule)
    kv.set_optimizer(opt)
    grads = [np.ones(2, np.float32), np.ones(2, np.float32)]
    kv.push([1, 2], grads)
    with pytest.raises(RuntimeError, match="schedule failed"):
        kv.push([1, 2], grads)
    assert opt._index_update_count == {1: 1, 2: 1} and opt.num_update == 1
    kv.push([1, 2], grads)
    assert opt._index_update_count == {1: 2, 2: 2} and opt.num_update == 2


@pytest.mark.parametrize("store", ["local", "device"])
@pytest.mark.parametrize("name,option,value", [("sgd", "momentum", 0.9),
                                               ("nag", "momentum", 0.5),
                                               ("rmsprop", "centered", True)])
def test_an_option_that_changes_the_states_after_a_push_is_refused(store, name, option,
                                                                   value):
    """The keys' states were made for the options of the first push: turning momentum
    on (or RMSProp's centered) afterwards is an ArgumentError naming the key, and the
    values, states and counts stay; set back, the next push steps as if it never was."""
    kv = gpukv.create(store)
    kv.init([0, 1], [np.ones(3, np.float32), np.ones(5000, np.float32)])
    opt = optim.create(name, learning_rate=0.1)
    kv.set_optimizer(opt)
    grads = [np.full(3, 0.5, np.float32), np.full(5000, 0.5, np.float32)]
    kv.push([0, 1], grads)
    before = [np.zeros(3, np.float32), np.zeros(5000, np.float32)]
    kv.pull([0, 1], out=before)
    old = getattr(opt, option)
    setattr(opt, option, value)
    with pytest.raises(ArgumentError, match=rf"key 0: optimizer '{name}' now keeps the states"):
        kv.push([0, 1], grads)
    after = [np.zeros(3, np.float32), np.zeros(5000, np.float32)]
    kv.pull([0, 1], out=after)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert dict(opt.update_counts) == {0: 1, 1: 1} and opt.num_update == 1
    setattr(opt, option, old)
    kv.push([0, 1], grads)
    twin = gpukv.create(store)
    twin.init([0, 1], [np.ones(3, np.float32), np.ones(5000, np.float32)])
    twin.set_optimizer(optim.create(name, learning_rate=0.1))
    twin.push([0, 1], grads)
    twin.push([0, 1], grads)
    want = [np.zeros(3, np.float32), np.zeros(5000, np.float32)]
    twin.pull([0, 1], out=want)
    kv.pull([0, 1], out=after)
    assert all(np.array_equal(a, b) for a, b in zip(after, want))


def test_an_option_that_changes_the_states_before_the_first_push_counts():
    """Before any push no state exists yet: momentum turned on then is simply used."""
    kv = gpukv.create("local")
    kv.init(0, np.ones(3, np.float32))
    opt = optim.SGD(learning_rate=0.1)
    kv.set_optimizer(opt)
    opt.momentum = 0.9
    for _ in range(2):
        kv.push(0, np.ones(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull(0, out=out)
    np.testing.assert_allclose(out, 1 - 0.1 - (0.9 * 0.1 + 0.1), rtol=1e-6)


def test_a_step_that_fails_counts_no_update(monkeypatch):
    """An error inside the step itself (here the host step raising) leaves every key's
    count and num_update as they were, as a schedule's error does."""
    kv = gpukv.create("local")
    kv.init([1, 2], [np.ones(2, np.float32), np.ones(2, np.float32)])
    opt = optim.Adam()
    kv.set_optimizer(opt)
    grads = [np.ones(2, np.float32), np.ones(2, np.float32)]
    kv.push([1, 2], grads)

    def fail(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(kv._updater, "_host", fail)
    with pytest.raises(MemoryError):
        kv.push([1, 2], grads)
    assert dict(opt.update_counts) == {1: 1, 2: 1} and opt.num_update == 1


def test_param_idx2name_gives_biases_no_weight_decay_as_mxnet():
    """MXNet: with param_idx2name, a parameter whose name ends neither in _weight nor in
    _gamma gets a weight-decay multiplier of 0, unless set_wd_mult says otherwise."""
    names = {0: "fc_bias", 1: "fc_weight", 2: "bn_gamma", 3: "bn_beta"}
    opt = optim.SGD(learning_rate=0.1, wd=0.1, param_idx2name=names)
    assert opt.wd_mult == {"fc_bias": 0.0, "bn_beta": 0.0}
    assert [float(opt.next_scalars(k)[1]) for k in range(4)] == \
        pytest.approx([0.0, 0.1, 0.1, 0.0])
    opt.set_wd_mult({"fc_bias": 0.5})
    assert opt.wd_mult == {"fc_bias": 0.5, "bn_beta": 0.0}
    kv = gpukv.create("local")
    kv.init(0, np.ones(3, np.float32))
    kv.set_optimizer(optim.SGD(learning_rate=0.1, wd=0.1, param_idx2name=names))
    kv.push(0, np.zeros(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull(0, out=out)
    assert np.all(out == 1.0)


@pytest.mark.parametrize("bad", [[1], "ab", 5, {0: 7}])
def test_a_bad_param_idx2name_is_an_argument_kind_error(bad):
    with pytest.raises(ArgumentKindError, match="param_idx2name"):
        optim.SGD(param_idx2name=bad)


class _Halving(optim.lr_scheduler.LRScheduler):
    """A schedule of one's own: halves every update."""

    def __call__(self, num_update):
        return self.base_lr / 2 ** num_update


def test_a_schedule_of_ones_own_is_not_saved_and_the_file_loads(tmp_path, caplog):
    """Only gpukv's own schedules are saved: a subclass of LRScheduler is left out with a
    warning, as a function is, and the optimizer the file is loaded into keeps its own."""
    kv = gpukv.create("local")
    kv.init(0, np.ones(2, np.float32))
    kv.set_optimizer(optim.SGD(lr_scheduler=_Halving(base_lr=1.0)))
    kv.push(0, np.ones(2, np.float32))
    with caplog.at_level("WARNING", logger="gpukv"):
        kv.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    assert "cannot be saved" in caplog.text
    other = gpukv.create("local")
    other.init(0, np.ones(2, np.float32))
    mine = _Halving(base_lr=1.0)
    opt = optim.SGD(lr_scheduler=mine)
    other.set_optimizer(opt)
    other.load_optimizer_states(tmp_path / "s")
    assert opt.lr_scheduler is mine and opt.num_update == 1


# ----------------------------------------------------------------- save and load
ROUND_TRIP = ["sgd_mom_clip_rescale", "nag_fp16_mp", "adam_cosine", "adamw_all",
              "adagrad_all", "rmsprop_centered_all", "lamb_all", "sgd_mom_fp16_mp",
              "sgd_plain"]


@pytest.mark.parametrize("dump", [False, True])
@pytest.mark.parametrize("name", ROUND_TRIP)
def test_save_load_round_trip(name, dump, tmp_path):
    """Resuming from saved states gives bit-identical weights to an uninterrupted run."""
    case = CASES[name]
    path = tmp_path / "opt.states"
    kv, dtype, shapes = _store("local", case)
    for step in range(2):
        _push_step(kv, case, step, dtype, shapes)
    kv.save_optimizer_states(path, dump_optimizer=dump)
    middle = _pull(kv, case, dtype, shapes)
    for step in range(2, 4):
        _push_step(kv, case, step, dtype, shapes)
    want = _pull(kv, case, dtype, shapes)

    resumed = gpukv.create("device")
    resumed.init(case["keys"], middle)
    resumed.set_optimizer(_optimizer(case))
    resumed.load_optimizer_states(path)
    for step in range(2, 4):
        _push_step(resumed, case, step, dtype, shapes, devices=4)
    for a, b in zip(_pull(resumed, case, dtype, shapes), want):
        assert np.array_equal(a, b), name


def test_dump_optimizer_restores_options(tmp_path):
    """dump_optimizer=True stores the options, multipliers and schedule; load applies them."""
    kv = gpukv.create("local")
    kv.init(5, np.ones(3, np.float32))
    opt = optim.SGD(learning_rate=0.3, momentum=0.7, wd=0.01,
                    lr_scheduler=optim.FactorScheduler(step=1, factor=0.5))
    opt.set_lr_mult({5: 0.5})
    kv.set_optimizer(opt)
    kv.push(5, np.ones(3, np.float32))
    kv.push(5, np.ones(3, np.float32))
    kv.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    other = gpukv.create("local")
    other.init(5, np.ones(3, np.float32))
    fresh = optim.SGD(momentum=0.7)
    other.set_optimizer(fresh)
    other.load_optimizer_states(tmp_path / "s")
    assert (fresh.lr, fresh.wd, fresh.lr_mult) == (0.3, 0.01, {5: 0.5})
    assert isinstance(fresh.lr_scheduler, optim.FactorScheduler)
    assert fresh.lr_scheduler.base_lr == opt.lr_scheduler.base_lr
    assert fresh.num_update == 2 and fresh._index_update_count == {5: 2}


def _saved(tmp_path, opt, name="s", dtype=np.float32):
    kv = gpukv.create("local")
    kv.init([1, 2], [np.ones((2, 3), dtype), np.ones(4, dtype)])
    kv.set_optimizer(opt)
    kv.push([1, 2], [np.ones((2, 3), dtype), np.ones(4, dtype)])
    kv.save_optimizer_states(tmp_path / name)
    return kv, tmp_path / name


def _fresh(opt, shapes=((2, 3), (4,)), keys=(1, 2), dtype=np.float32):
    kv = gpukv.create("local")
    kv.init(list(keys), [np.ones(s, dtype) for s in shapes])
    kv.set_optimizer(opt)
    return kv


def _fortran_ordered(path, out):
    """A copy of the archive `path` at `out` whose state arrays are stored in Fortran order
    (same values and checksums: any writer of .npz files may do this)."""
    import io
    import zipfile
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.startswith("state/"):
                array = np.asfortranarray(np.lib.format.read_array(io.BytesIO(data)))
                buf = io.BytesIO()
                np.lib.format.write_array(buf, array, allow_pickle=False)
                data = buf.getvalue()
            dst.writestr(info, data)
    return out


@pytest.mark.parametrize("home", ["host", "gpu"])
def test_load_of_fortran_ordered_states_gives_c_order(tmp_path, home):
    """States read from a file with Fortran-ordered members are C-contiguous (the GPU
    multi-tensor kernels index flat pointers) and resume exactly as from a C-ordered file."""
    from gpukv.checkpoints.checkpoint import read_archive

    from ..fake_gpu import FakeGpu
    kv, path = _saved(tmp_path, optim.Adam(), dtype=np.float16)
    header, arrays = read_archive(_fortran_ordered(path, tmp_path / "f"))
    assert any(a.ndim == 2 and not a.flags.c_contiguous for a in arrays.values())
    kinds = {"host": lambda: gpukv.device.host_device(0),
             "gpu": lambda: FakeGpu(0, [], {})}
    resumed = _fresh(optim.Adam(), dtype=np.float16)
    for k, e in resumed._entries.items():
        e.value[...] = kv._entries[k].value
    entries = {k: (e.value, kinds[home]()) for k, e in resumed._entries.items()}
    resumed._updater.import_state(header, arrays, entries)
    states = resumed._updater.states
    for state in states.values():
        for a in state.arrays + (state.master,):
            assert a.flags.c_contiguous, a.shape
    want = kv._updater.states
    for k in want:
        for a, b in zip(states[k].arrays + (states[k].master,),
                        want[k].arrays + (want[k].master,)):
            assert np.array_equal(a, b)
    if home == "host":  # and the store goes on as the one that saved
        for store in (kv, resumed):
            store.push([1, 2], [np.ones((2, 3), np.float16), np.ones(4, np.float16)])
        for k in (1, 2):
            assert np.array_equal(kv._entries[k].value, resumed._entries[k].value)


def test_load_rejects_another_optimizer(tmp_path):
    """States saved by another optimizer are a CheckpointError naming the saved one."""
    _, path = _saved(tmp_path, optim.Adam())
    with pytest.raises(CheckpointError, match="adam"):
        _fresh(optim.SGD(momentum=0.9)).load_optimizer_states(path)


def test_load_rejects_other_options(tmp_path):
    """SGD with momentum keeps a state SGD without momentum does not: CheckpointError."""
    _, path = _saved(tmp_path, optim.SGD(momentum=0.9))
    with pytest.raises(CheckpointError, match="mom"):
        _fresh(optim.SGD()).load_optimizer_states(path)


@pytest.mark.parametrize("shapes,keys", [(((3, 2), (4,)), (1, 2)), (((2, 3),), (1,)),
                                         (((2, 3), (4,)), ("1", "2"))])
def test_load_rejects_keys_that_do_not_match(tmp_path, shapes, keys):
    """A key missing from the store, or of another shape, is a CheckpointError."""
    _, path = _saved(tmp_path, optim.Adam())
    kv = _fresh(optim.Adam(), shapes=shapes, keys=keys)
    with pytest.raises(CheckpointError):
        kv.load_optimizer_states(path)


def test_load_rejects_a_float16_file_for_float32_keys(tmp_path):
    """States of float16 keys (with master copies) do not load into float32 keys."""
    _, path = _saved(tmp_path, optim.Adam(), dtype=np.float16)
    with pytest.raises(CheckpointError, match="master"):
        _fresh(optim.Adam()).load_optimizer_states(path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage", "missing"])
def test_load_rejects_damaged_files(tmp_path, damage):
    """Truncated, corrupted, empty, foreign or missing files raise CheckpointError."""
    kv, path = _saved(tmp_path, optim.Adam())
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        start = raw.rindex(b"\x93NUMPY")
        pos = start + 10 + int.from_bytes(raw[start + 8:start + 10], "little") + 2
        path.write_bytes(raw[:pos] + bytes([raw[pos] ^ 0xFF]) + raw[pos + 1:])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint at all" * 10)
    else:
        path.unlink()
    before = {k: tuple(a.copy() for a in s.arrays) for k, s in kv._updater.states.items()}
    with pytest.raises(CheckpointError):
        kv.load_optimizer_states(path)
    for k, arrays in before.items():  # a failed load changes nothing
        assert all(np.array_equal(a, b) for a, b in zip(arrays, kv._updater.states[k].arrays))


def test_save_and_load_need_an_optimizer(tmp_path):
    """Saving or loading optimizer states without set_optimizer is an ArgumentError."""
    kv = gpukv.create("local")
    kv.init(1, np.ones(2, np.float32))
    with pytest.raises(ArgumentError, match="set_optimizer"):
        kv.save_optimizer_states(tmp_path / "x")
    kv.set_updater(lambda k, g, w: None)
    with pytest.raises(ArgumentError, match="set_optimizer"):
        kv.load_optimizer_states(tmp_path / "x")


def test_file_has_no_pickle(tmp_path):
    """The file loads with allow_pickle=False and carries a versioned JSON header."""
    _, path = _saved(tmp_path, optim.Adam())
    with np.load(path, allow_pickle=False) as npz:
        names = set(npz.files)
        assert all(npz[n].dtype != object for n in names)
    from gpukv.checkpoints.checkpoint import read_archive
    header, arrays = read_archive(path)
    assert header["kind"] == "gpukv.optimizer-states" and header["version"] == 1
    assert header["optimizer"] == "adam"
    assert {k["key"] for k in header["keys"]} == {1, 2}
    assert set(arrays) == {"state/0/mean", "state/0/var", "state/1/mean", "state/1/var"}


_WRITER = textwrap.dedent("""
    import sys, numpy as np, gpukv
    kv = gpukv.create('local')
    kv.init(0, np.zeros(1 << 21, np.float32))
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.5, momentum=0.5))
    n = 0
    while True:
        kv.push(0, np.ones(1 << 21, np.float32))
        n += 1
        kv.save_optimizer_states(sys.argv[1])
        print(n, flush=True)
""")


def test_killed_writer_leaves_previous_file_whole(tmp_path):
    """SIGKILL in the middle of saving leaves a whole, loadable file from a finished save."""
    path = tmp_path / "opt.states"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # a few saves complete, then kill during the next one
            line = proc.stdout.readline()
            assert line.strip(), proc.stderr.read()
        time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    kv = gpukv.create("local")
    kv.init(0, np.zeros(1 << 21, np.float32))
    kv.set_optimizer(optim.SGD(learning_rate=0.5, momentum=0.5))
    kv.load_optimizer_states(path)
    count = kv._optimizer._index_update_count[0]
    assert count >= 3
    mom = np.float32(0)
    for _ in range(count):  # the momentum after `count` pushes of ones
        mom = np.float32(0.5) * mom - np.float32(0.5) * np.float32(1)
    assert np.all(kv._updater.states[0].arrays[0] == mom)


# --------------------------------------------------------- row-sparse gradients
LAZY = json.loads((Path(__file__).parents[1] / "data" / "mxnet_lazy_reference.json").read_text())
LAZY_CASES = {c["name"]: c for c in LAZY["cases"]}


def _rsp_parts(case, step, i, shape, devices):
    """The gradient of key `i` at `step` as `devices` RowSparse values (rows dealt out)."""
    rows = np.array(case["rows"][step][i], np.int64)
    data = _array(case["grads"][step][i], (len(rows),) + shape[1:], np.float32)
    return [gpukv.RowSparse(rows[j::devices], data[j::devices], shape) for j in range(devices)]


def _snapshot(kv, keys):
    values = [np.zeros(kv._entries[k].value.shape, np.float32) for k in keys]
    kv.pull(keys, out=values)
    states = {k: [a.copy() for a in kv._updater.states[k].arrays]
              for k in keys if k in kv._updater.states}
    return values, states


@pytest.mark.parametrize("name", sorted(LAZY_CASES))
def test_row_sparse_matches_mxnet(name):
    """Row-sparse pushes from 4 devices give MXNet 1.9.1's sparse-kernel numbers bit for
    bit; with a lazy rule, rows absent from a step's gradient keep their weight and state
    bits exactly."""
    case = LAZY_CASES[name]
    shapes = [tuple(s) for s in case["shapes"]]
    keys = case["keys"]
    opt = optim.create(case["optimizer"], **case["kwargs"])
    kv = gpukv.create("device")
    kv.init(keys, [_array(v, s, np.float32) for v, s in zip(case["init"], shapes)])
    kv.set_optimizer(opt)
    lazy = opt.lazy_rows()
    assert lazy == (case["optimizer"] in ("sgd", "adam", "adagrad")
                    and case["kwargs"].get("lazy_update", True))
    for step in range(LAZY["steps"]):
        before, states = _snapshot(kv, keys)
        kv.push(keys, [_rsp_parts(case, step, i, s, 4) for i, s in enumerate(shapes)])
        after, new_states = _snapshot(kv, keys)
        for i, (key, shape) in enumerate(zip(keys, shapes)):
            want = _array(case["after"][step][i], shape, np.float32)
            assert np.array_equal(after[i], want), (name, step, key)
            if lazy and key in states:
                absent = np.setdiff1d(np.arange(shape[0]), case["rows"][step][i])
                assert np.array_equal(after[i][absent], before[i][absent])
                for old, new in zip(states[key], new_states[key]):
                    assert np.array_equal(old[absent], new[absent])
    for key, shape in zip(keys, shapes):
        have = dict(zip(opt.state_names(), kv._updater.states[key].arrays))
        assert set(have) == set(case["states"][str(key)])
        for sname, values in case["states"][str(key)].items():
            assert np.array_equal(have[sname], _array(values, shape, np.float32)), sname


@pytest.mark.parametrize("make", [
    lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-2),
    lambda: optim.Adam(learning_rate=0.01, wd=1e-2),
    lambda: optim.AdaGrad(learning_rate=0.1),
], ids=["sgd_mom", "adam", "adagrad"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_lazy_rows_follow_the_dense_rule_on_their_rows(make, dtype):
    """With a fixed row set R, a lazy update of a big key leaves every other row (weight,
    states, master) bit-identical, and rows R equal a dense update of just those rows."""
    rng = np.random.default_rng(7)
    shape = (600, 70)  # over several host pieces
    rows = np.sort(rng.choice(shape[0], 37, replace=False))
    w0 = rng.standard_normal(shape).astype(dtype)
    kv = gpukv.create("device")
    kv.init("e", w0)
    kv.set_optimizer(make())
    ref = gpukv.create("local")
    ref.init("e", w0[rows])
    ref.set_optimizer(make())
    for _ in range(3):
        g = rng.standard_normal((rows.size, shape[1])).astype(dtype).astype(np.float32)
        kv.push("e", [gpukv.RowSparse(rows[:20], g[:20], shape),
                      gpukv.RowSparse(rows[20:], g[20:], shape)])
        ref.push("e", g.astype(dtype))
    got = np.zeros(shape, dtype)
    kv.pull("e", out=got)
    want = np.zeros((rows.size, shape[1]), dtype)
    ref.pull("e", out=want)
    absent = np.setdiff1d(np.arange(shape[0]), rows)
    assert np.array_equal(got[absent], w0[absent])
    assert np.array_equal(got[rows], want)
    st, rst = kv._updater.states["e"], ref._updater.states["e"]
    for a, b in zip(st.arrays + ((st.master,) if st.master is not None else ()),
                    rst.arrays + ((rst.master,) if rst.master is not None else ())):
        assert not a[absent].any() if a is not st.master else np.array_equal(
            a[absent], w0[absent].astype(np.float32))
        assert np.array_equal(a[rows], b)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_multi_precision_sgd_of_a_float16_weight_updates_every_row_as_mxnet(momentum):
    """MXNet's SGD of a float16 weight with multi_precision (mp_sgd_update,
    mp_sgd_mom_update) has no row-sparse kernel: a row-sparse push updates every row,
    the absent ones with a zero gradient (their momentum and weight decay go on), bit
    for bit as lazy_update=False does; MXNet 1.9.1 gives [0.682 0.782 0.971 0.971]."""
    def run(**options):
        kv = gpukv.create("local")
        kv.init("emb", np.ones((4, 2), np.float16))
        kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=momentum, wd=0.1,
                                   multi_precision=True, **options))
        for rows in ([0, 1], [0]):
            kv.push("emb", gpukv.RowSparse(np.array(rows), np.ones((len(rows), 2), np.float16),
                                           (4, 2)))
        out = np.zeros((4, 2), np.float16)
        kv.pull("emb", out=out)
        return out
    got = run()
    assert np.array_equal(got, run(lazy_update=False))
    assert (got[2:] != 1).all(), got
    if momentum:
        assert np.array_equal(got[:, 0], np.array([0.682, 0.782, 0.971, 0.971], np.float16))


@pytest.mark.gpu
def test_gpu_multi_precision_sgd_of_a_float16_weight_updates_every_row():
    """On a GPU too, SGD with multi_precision updates every row of a float16 weight for a
    row-sparse gradient: MXNet's numbers, the bits of lazy_update=False."""
    import cupy as cp
    outs = []
    for lazy in (True, False):
        kv = gpukv.create("device")
        with cp.cuda.Device(0):
            kv.init("emb", cp.ones((4, 2), np.float16))
            kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9, wd=0.1,
                                       multi_precision=True, lazy_update=lazy))
            for rows in ([0, 1], [0]):
                kv.push("emb", gpukv.RowSparse(cp.asarray(rows), cp.ones((len(rows), 2),
                                                                         np.float16), (4, 2)))
            out = cp.zeros((4, 2), np.float16)
            kv.pull("emb", out=out)
            outs.append(cp.asnumpy(out))
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(outs[0][:, 0], np.array([0.682, 0.782, 0.971, 0.971], np.float16))


@pytest.mark.parametrize("dtype,make", [
    ("float16", lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=0.1)),
    ("float32", lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=0.1,
                                  multi_precision=True)),
    pytest.param("bfloat16", lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=0.1,
                                               multi_precision=True), marks=needs_bfloat16),
    ("float16", lambda: optim.Adam(learning_rate=0.1, wd=0.1, multi_precision=True)),
], ids=["sgd-float16", "sgd-multi-precision-float32", "sgd-multi-precision-bfloat16",
        "adam-multi-precision-float16"])
def test_row_sparse_updates_mxnet_runs_lazily_stay_lazy(dtype, make):
    """Where MXNet runs a lazy row-sparse kernel (SGD on a float16 weight itself without
    multi_precision, and on any other dtype; Adam's multi-precision update, on the
    float32 master copy), the rows absent from the gradient keep their bits."""
    from ..bfloat16 import dtype_named
    dt = dtype_named(dtype)
    kv = gpukv.create("local")
    kv.init("emb", np.ones((4, 2), dt))
    kv.set_optimizer(make())
    for rows in ([0, 1], [0]):
        kv.push("emb", gpukv.RowSparse(np.array(rows), np.ones((len(rows), 2), dt), (4, 2)))
    out = np.zeros((4, 2), dt)
    kv.pull("emb", out=out)
    assert (out[2:] == 1).all() and (out[:2] != 1).all(), out


def test_standard_sparse_update_equals_a_dense_push():
    """lazy_update=False: a row-sparse push of SGD with momentum updates every row, as
    the dense push of the same gradient does."""
    rng = np.random.default_rng(3)
    shape = (50, 4)
    w0 = rng.standard_normal(shape).astype(np.float32)
    stores = []
    for _ in range(2):
        kv = gpukv.create("local")
        kv.init(1, w0)
        kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9, wd=0.01,
                                   lazy_update=False))
        stores.append(kv)
    for _ in range(3):
        rows = np.sort(rng.choice(shape[0], 5, replace=False))
        g = rng.standard_normal((5, 4)).astype(np.float32)
        sparse = gpukv.RowSparse(rows, g, shape)
        stores[0].push(1, sparse)
        stores[1].push(1, sparse.todense())
    a, b = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    stores[0].pull(1, out=a)
    stores[1].pull(1, out=b)
    assert np.array_equal(a, b) and not np.array_equal(a, w0)


def test_row_sparse_push_without_rows_counts_an_update():
    """A lazy push with no rows changes nothing but still counts (Adam's t goes up)."""
    kv = gpukv.create("local")
    kv.init(0, np.ones((3, 2), np.float32))
    kv.set_optimizer(optim.Adam())
    kv.push(0, gpukv.RowSparse.zeros((3, 2)))
    out = np.zeros((3, 2), np.float32)
    kv.pull(0, out=out)
    assert np.array_equal(out, np.ones((3, 2), np.float32))
    assert kv._optimizer._index_update_count == {0: 1}


# ------------------------------------------------------------ host step pieces
@pytest.mark.parametrize("name", ["sgd_mom_clip_rescale", "sgd_clip_nomom", "nag_mom_wd",
                                  "adam_all", "adamw_all", "adagrad_all",
                                  "rmsprop_centered_all", "lamb_all", "nag_fp16_mp",
                                  "adam_fp16_mp", "lamb_fp16_mp", "sgd_lr_mult"])
def test_pieces_and_gathered_keys_equal_one_whole_step(name, monkeypatch):
    """Splitting keys into pieces, and gathering small keys into one, changes no bit:
    the store gives what the rule's whole-array step gives key by key."""
    from gpukv.optim import _updater
    monkeypatch.setattr(_updater, "CHUNK", 64)
    monkeypatch.setattr(_updater, "SMALL", 24)
    case = CASES[name]
    dtype = np.dtype(case["dtype"])
    rng = np.random.default_rng(11)
    shapes = [(3,), (5, 4), (7,), (1,), (130,), (64,), (9, 9), (2,)]
    keys = list(range(len(shapes)))
    init = [rng.standard_normal(s).astype(dtype) for s in shapes]
    kv = gpukv.create("local")
    kv.init(keys, init)
    opt = _optimizer(case)
    opt.set_lr_mult({5: 0.5, 1: 0.25})
    kv.set_optimizer(opt)
    ref = _optimizer(case)
    ref.set_lr_mult({5: 0.5, 1: 0.25})
    w = [a.copy() for a in init]
    master = [a.astype(np.float32) if dtype == np.float16 else None for a in init]
    ct = np.float32 if dtype != np.float64 else np.float64
    states = [tuple(np.zeros(s, ct) for _ in ref.state_names()) for s in shapes]
    hp = {k: ct(v) for k, v in ref.hyper().items()}
    for step in range(3):
        push = keys if step != 1 else keys[1::2]
        grads = {k: rng.standard_normal(shapes[k]).astype(dtype) for k in push}
        kv.push(push, [grads[k] for k in push])
        for k in push:
            sc = tuple(ct(v) for v in ref.next_scalars(k))
            target = w[k] if master[k] is None else master[k]
            g = grads[k].astype(target.dtype)
            if ref.name == "lamb":
                ref.host_step(target, g, states[k], sc, hp, stored=w[k])
            else:
                ref.host_step(target, g, states[k], sc, hp)
            if master[k] is not None:
                w[k][...] = master[k].astype(dtype)
    outs = [np.zeros(s, dtype) for s in shapes]
    kv.pull(keys, out=outs)
    for k in keys:
        assert np.array_equal(outs[k], w[k]), (name, k)
        for a, b in zip(kv._updater.states[k].arrays, states[k]):
            assert np.array_equal(a, b), (name, k)


def test_states_of_keys_made_together_share_one_buffer():
    """Keys first updated in one push keep their states side by side in one buffer."""
    kv = gpukv.create("local")
    kv.init([1, 2, 3], [np.ones(4, np.float32), np.ones((2, 3), np.float32),
                        np.ones(5, np.float32)])
    kv.set_optimizer(optim.Adam())
    kv.push([1, 2, 3], [np.ones(4, np.float32), np.ones((2, 3), np.float32),
                        np.ones(5, np.float32)])
    st = [kv._updater.states[k] for k in (1, 2, 3)]
    assert st[0].arena is st[1].arena is st[2].arena
    assert [s.offset for s in st] == [0, 4, 10]
    assert st[1].arrays[1].shape == (2, 3) and np.shares_memory(st[1].arrays[1],
                                                                st[0].arena[1])


# ----------------------------------------------------------- the GPU kernel tables
class _Fake:
    def __init__(self, size, ptr):
        self.size = size
        self.data = type("P", (), {"ptr": ptr})()


def test_multi_tensor_plan_covers_every_element_once():
    """The chunk table of a launch covers each element of each key exactly once."""
    from gpukv.device.cuda import optim_kernels as K
    sizes = [1, K.CHUNK - 1, K.CHUNK, K.CHUNK + 1, 3 * K.CHUNK + 7, 5]
    items = [(_Fake(n, 1000 * j + 1), _Fake(n, 1000 * j + 2), None,
              (_Fake(n, 1000 * j + 3),), (0.1, 0.2)) for j, n in enumerate(sizes)]
    ptrs, got_sizes, start, toff, tensor, scal = K.plan(items)
    assert ptrs[2, 0] == 2001 and ptrs[2, 3] == 2003 and ptrs[2, 2] == 0
    assert list(got_sizes) == sizes
    assert np.allclose(scal[:, :2], [0.1, 0.2]) and not scal[:, 2:].any()
    seen = [np.zeros(n, int) for n in sizes]
    for k, s in zip(tensor, start):
        seen[k][s:s + K.CHUNK] += 1
    assert all((x == 1).all() for x in seen)
    assert list(toff) == list(np.cumsum([0] + sizes[:-1]))


@pytest.mark.parametrize("name", ["sgd", "nag", "adam", "adamw", "adagrad", "rmsprop", "lamb"])
@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=needs_bfloat16),
                                   "float32", "float64"])
def test_kernel_sources_are_complete(name, dtype):
    """Every rule yields CUDA source with every hyper-parameter and switch defined."""
    from gpukv.device.cuda import optim_kernels as K
    opt = optim.create(name, clip_gradient=1.0)
    for phase in ((1, 2) if name == "lamb" else (0,)):
        src = K.kernel_source(opt, np.dtype(dtype) if dtype != "bfloat16" else
                              np.dtype(__import__("ml_dtypes").bfloat16), phase)
        for h in opt.hyper_names:
            assert f"const ct {h} = (ct)hp[" in src
        assert "BODY" not in src and "HYPER_DECLS" not in src
        assert f"#define PHASE {phase}" in src


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LAZY_CASES))
def test_gpu_row_sparse_matches_mxnet(name):
    """On a GPU, row-sparse pushes give MXNet 1.9.1's numbers bit for bit (the inputs
    hold no float32 subnormals, which the GPU would flush to zero)."""
    import cupy as cp
    case = LAZY_CASES[name]
    _assert_no_subnormals(*case["init"])
    shapes = [tuple(s) for s in case["shapes"]]
    keys = case["keys"]
    kv = gpukv.create("device")
    with cp.cuda.Device(0):
        kv.init(keys, [cp.asarray(_array(v, s, np.float32))
                       for v, s in zip(case["init"], shapes)])
        kv.set_optimizer(optim.create(case["optimizer"], **case["kwargs"]))
        for step in range(LAZY["steps"]):
            grads = []
            for i, s in enumerate(shapes):
                part = _rsp_parts(case, step, i, s, 1)[0]
                grads.append(gpukv.RowSparse(cp.asarray(part.indices), cp.asarray(part.data),
                                             s))
            kv.push(keys, grads)
            outs = [cp.zeros(s, np.float32) for s in shapes]
            kv.pull(keys, out=outs)
            for i, (o, s) in enumerate(zip(outs, shapes)):
                assert np.array_equal(cp.asnumpy(o), _array(case["after"][step][i], s,
                                                            np.float32)), (name, step)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_lazy_rows_match_host(dtype):
    """GPU lazy updates (gather, one launch, scatter) give the host's bits, master too."""
    import cupy as cp
    rng = np.random.default_rng(5)
    shape = (300, 33)
    w0 = rng.standard_normal(shape).astype(dtype)
    _assert_no_subnormals(w0)
    host, gpu = gpukv.create("local"), gpukv.create("device")
    host.init("e", w0)
    with cp.cuda.Device(0):
        gpu.init("e", cp.asarray(w0))
    for kv in (host, gpu):
        kv.set_optimizer(optim.Adam(learning_rate=0.01, wd=1e-3))
    for _ in range(3):
        rows = np.sort(rng.choice(shape[0], 40, replace=False))
        g = rng.standard_normal((40, shape[1])).astype(np.float32)
        _assert_no_subnormals(g)
        host.push("e", gpukv.RowSparse(rows, g, shape))
        with cp.cuda.Device(0):
            gpu.push("e", gpukv.RowSparse(cp.asarray(rows), cp.asarray(g), shape))
    a = np.zeros(shape, dtype)
    host.pull("e", out=a)
    with cp.cuda.Device(0):
        b = cp.zeros(shape, dtype)
        gpu.pull("e", out=b)
        assert np.array_equal(cp.asnumpy(b), a)
        for x, y in zip(gpu._updater.states["e"].arrays, host._updater.states["e"].arrays):
            assert np.array_equal(cp.asnumpy(x), y)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_matches_host_bit_for_bit(name):
    """On a GPU the multi-tensor kernels give the host's numbers (LAMB: within 1e-6);
    the inputs hold no float32 subnormals, which the GPU would flush to zero."""
    import cupy as cp
    case = CASES[name]
    _assert_no_subnormals(*case["init"], *case["grads"])
    host, dtype, shapes = _store("local", case)
    gpu = gpukv.create("device")
    with cp.cuda.Device(0):
        gpu.init(case["keys"], [cp.asarray(_array(v, s, dtype))
                                for v, s in zip(case["init"], shapes)])
    gpu.set_optimizer(_optimizer(case))
    for step in range(REFERENCE["steps"]):
        _push_step(host, case, step, dtype, shapes)
        grads = [cp.asarray(_array(v, s, dtype)) for v, s in zip(case["grads"][step], shapes)]
        gpu.push(case["keys"], grads)
    outs = [cp.zeros(s, dtype) for s in shapes]
    gpu.pull(case["keys"], out=outs)
    for got, want in zip(outs, _pull(host, case, dtype, shapes)):
        if case["optimizer"] == "lamb":
            _close(cp.asnumpy(got), want, name)
        else:
            assert np.array_equal(cp.asnumpy(got), want), name


def test_set_learning_rate_changes_the_next_updates():
    """`Optimizer.set_learning_rate` (MXNet's way to change the rate between epochs) takes
    effect at the next push, and is refused while a schedule drives the rate."""
    kv = gpukv.create("local")
    kv.init(0, np.zeros(3, np.float32))
    opt = gpukv.optim.SGD(learning_rate=1.0)
    kv.set_optimizer(opt)
    kv.push(0, np.ones(3, np.float32))
    opt.set_learning_rate(0.25)
    kv.push(0, np.ones(3, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out, np.full(3, -1.25, np.float32))
    assert opt.learning_rate == 0.25
    scheduled = gpukv.optim.SGD(learning_rate=1.0,
                                lr_scheduler=gpukv.optim.lr_scheduler.FactorScheduler(step=2))
    with pytest.raises(gpukv.ArgumentError, match="lr_scheduler"):
        scheduled.set_learning_rate(0.5)


@pytest.mark.parametrize("name", ["sgd", "nag", "adam", "adamw", "adagrad", "rmsprop", "lamb"])
def test_every_option_is_a_keyword_parameter(name):
    """help() and type checkers see every option of every optimizer: its own and the
    base ones, as named keyword parameters (no **kwargs)."""
    import inspect

    from gpukv.optim._base import BASE_OPTIONS
    cls = type(optim.create(name))
    params = inspect.signature(cls).parameters
    assert set(BASE_OPTIONS) <= set(params)
    assert all(p.kind is not p.VAR_KEYWORD for p in params.values())
    assert set(cls.option_names) <= set(params)  # what a checkpoint's options rebuild


def test_update_counts_stay_a_live_view_across_a_restore():
    """`Optimizer.update_counts` is a read-only view that still shows the counts after
    `restore_update_counts` took over saved ones."""
    opt = optim.create("sgd")
    counts = opt.update_counts
    opt.restore_update_counts({3: 7, "w": 2}, 7)
    assert dict(counts) == {3: 7, "w": 2} and opt.num_update == 7
    with pytest.raises(TypeError):
        counts[3] = 1  # type: ignore[index]


def test_multi_precision_lamb_takes_the_norm_of_the_stored_weight():
    """A float16 key's trust ratio comes from ||stored float16 weight||, as MXNet 1.9.1's
    multi_mp_lamb_update: its master copies stay within a few float32 ulps of MXNet's
    (the norm of the master copy instead puts them 2-4x further off)."""
    case = CASES["lamb_fp16_mp"]
    kv, dtype, shapes = _store("local", case)
    for step in range(REFERENCE["steps"]):
        _push_step(kv, case, step, dtype, shapes)
    for key, shape in zip(case["keys"], shapes):
        master = kv._updater.states[key].master
        want = _array(case["states"][str(key)]["master"], shape, np.float32)
        np.testing.assert_allclose(master, want, rtol=0, atol=1.5e-6, err_msg=str(key))


def test_create_refuses_options_beside_an_optimizer_already_made():
    """Options given with an Optimizer instance would be dropped: an ArgumentKindError
    naming them, and the optimizer unchanged; alone, the instance comes back as it is."""
    sgd = optim.SGD(learning_rate=0.1)
    assert optim.create(sgd) is sgd
    with pytest.raises(ArgumentKindError, match="options learning_rate, momentum given with"):
        optim.create(sgd, momentum=0.9, learning_rate=5.0)
    assert sgd.lr == 0.1 and sgd.momentum == 0.0


@pytest.mark.parametrize("setter", ["set_lr_mult", "set_wd_mult"])
def test_multiplier_keys_are_the_stores_keys(setter, tmp_path):
    """A NumPy integer key is its int (it matches the key and saves); a key of another
    kind is a KeyKindError naming it, and the multipliers set before stay."""
    opt = optim.SGD(learning_rate=1.0)
    getattr(opt, setter)({np.int64(3): 0.5, "fc_weight": 2.0})
    table = opt.lr_mult if setter == "set_lr_mult" else opt.wd_mult
    assert table == {3: 0.5, "fc_weight": 2.0} and type(next(iter(table))) is int
    with pytest.raises(gpukv.KeyKindError, match=r"key 1\.5: expected a key"):
        getattr(opt, setter)({1.5: 0.5})
    assert (opt.lr_mult if setter == "set_lr_mult" else opt.wd_mult) == table
    kv = gpukv.create("local")
    kv.init(3, np.ones(2, np.float32))
    kv.set_optimizer(opt)
    kv.push(3, np.ones(2, np.float32))
    path = tmp_path / "states"
    kv.save_optimizer_states(str(path), dump_optimizer=True)
    again = gpukv.create("local")
    again.init(3, np.ones(2, np.float32))
    again.set_optimizer(optim.SGD(learning_rate=1.0))
    again.load_optimizer_states(str(path))
    assert (again._optimizer.lr_mult if setter == "set_lr_mult"
            else again._optimizer.wd_mult) == table


class _Forwarding(optim.SGD):
    """MXNet's habit: its own option, the rest handed on through **kwargs."""

    def __init__(self, nesterovish: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.nesterovish = nesterovish

    option_names = optim.SGD.option_names + ("nesterovish",)


@pytest.mark.parametrize("name,options,says", [
    ("sgd", {"lr": 0.1}, "lr (gpukv names it learning_rate)"),
    ("adam", {"betas": (0.9, 0.99), "eps": 1e-8},
     "betas (gpukv names it beta1 and beta2), eps (gpukv names it epsilon)"),
    ("adamw", {"weight_decay": 0.01}, "weight_decay (gpukv names it wd)"),
    ("sgd", {"betas": (0.9, 0.99)}, "betas; its"),  # (SGD has no beta1: no name to give)
])
def test_pytorchs_name_for_an_option_is_answered_with_gpukvs(name, options, says):
    """An option given by PyTorch's name (lr, weight_decay, eps, betas) is refused with the
    name gpukv gives it, where the optimizer has one."""
    with pytest.raises(ArgumentKindError, match=re.escape(f"unknown option(s) {says}")):
        optim.create(name, **options)


def test_a_subclass_that_hands_its_options_on_takes_its_bases(tmp_path):
    """A rule whose __init__ takes **kwargs for its base takes the base's options, and
    refuses unknown ones naming every option it has; a file saved with its options
    loads back into it."""
    opt = _Forwarding(learning_rate=0.2, momentum=0.9, nesterovish=0.25)
    assert (opt.lr, opt.momentum, opt.nesterovish) == (0.2, 0.9, 0.25)
    with pytest.raises(ArgumentKindError, match=r"unknown option\(s\) lr \(gpukv names it "
                                                r"learning_rate\); its options are "
                                                r"nesterovish, momentum, lazy_update, "
                                                r"learning_rate"):
        _Forwarding(lr=0.2)
    kv = gpukv.create("local")
    kv.init(0, np.ones(2, np.float32))
    kv.set_optimizer(opt)
    kv.push(0, np.ones(2, np.float32))
    kv.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    other = gpukv.create("local")
    other.init(0, np.ones(2, np.float32))
    loaded = _Forwarding()
    other.set_optimizer(loaded)
    other.load_optimizer_states(tmp_path / "s")
    assert (loaded.lr, loaded.momentum, loaded.nesterovish) == (0.2, 0.9, 0.25)


class _MXNetStyle(optim.Optimizer):
    """MXNet's interface, which gpukv does not call."""

    def create_state(self, index, weight):
        return np.zeros_like(weight)

    def update(self, index, weight, grad, state):
        weight -= self.learning_rate * grad


@pytest.mark.parametrize("cls", optim.registered(), ids=lambda cls: cls.__name__)
def test_every_rule_of_gpukv_has_an_update_rule(cls):
    cls().check_rule()


@pytest.mark.parametrize("kind", ["local", "device"])
def test_a_rule_without_host_chunk_is_refused_at_set_optimizer(kind):
    """A subclass with MXNet's create_state/update alone is an ArgumentKindError naming
    what gpukv calls, at set_optimizer, not a bare NotImplementedError at the first
    push; the store keeps its optimizer."""
    kv = gpukv.create(kind)
    kv.init(0, np.ones(2, np.float32))
    kv.set_optimizer(optim.SGD(learning_rate=0.5))
    with pytest.raises(ArgumentKindError, match=r"_MXNetStyle: no update rule \(it has "
                                                r"MXNet's create_state and update.*host_chunk"):
        kv.set_optimizer(_MXNetStyle(learning_rate=0.1))
    kv.push(0, np.ones(2, np.float32))
    out = np.empty(2, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [0.5, 0.5]


def test_a_function_schedule_saves_the_rate_it_gives_next(tmp_path):
    """With dump_optimizer=True a function schedule is left out and its rate saved: an
    optimizer without a schedule of its own takes the rate the function gives the next
    update, the fifth (not the fourth's, nor the default 0.01)."""
    kv = gpukv.create("local")
    kv.init(0, np.ones(2, np.float32))
    kv.set_optimizer(optim.SGD(lr_scheduler=lambda n: 0.1 / (1 + n)))
    for _ in range(4):
        kv.push(0, np.ones(2, np.float32))
    kv.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    other = gpukv.create("local")
    other.init(0, np.ones(2, np.float32))
    loaded = optim.SGD(learning_rate=7.0)
    other.set_optimizer(loaded)
    other.load_optimizer_states(tmp_path / "s")
    assert loaded.lr == pytest.approx(0.1 / 6) and loaded.lr_scheduler is None


@pytest.mark.parametrize("saved,loaded,words", [
    (np.float16, np.float32, "holds a float32 master copy, kept for 16-bit weights; the key "
                             "is float32"),
    (np.float32, np.float16, "holds no float32 master copy, which 16-bit weights keep; the "
                             "key is float16")])
def test_states_of_a_key_of_another_width_name_the_master_copy(tmp_path, saved, loaded, words):
    """Momentum saved from a float16 key, loaded into a float32 one (or back): a
    CheckpointError saying what the master copy is, and the store unchanged."""
    kv = gpukv.create("local")
    kv.init("w", np.ones(2, saved))
    kv.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
    kv.push("w", np.ones(2, saved))
    kv.save_optimizer_states(tmp_path / "s")
    other = gpukv.create("local")
    other.init("w", np.ones(2, loaded))
    other.set_optimizer(optim.SGD(learning_rate=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=f"key 'w': the file {words}"):
        other.load_optimizer_states(tmp_path / "s")
    assert other._optimizer.num_update == 0

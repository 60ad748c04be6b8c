"""Compressed pulls ('sign' compresses both ways): what a store's pulls return against a
plain NumPy statement of the rule, with and without an updater; with an updater without
momentum, the served value within the owner's residual of the value; with an optimizer
that settles compressed pulls (SGD's momentum), the value settled to what workers hold;
what setting the compression again, a checkpoint and MXNet's one-way codecs do."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import gpukv

from .test_sign import reference_step

SIGN = {"type": "sign"}
finite = st.floats(-1e3, 1e3, width=32, allow_subnormal=False)


def _store(n: int, compression=SIGN):
    kv = gpukv.create("device")
    kv.set_gradient_compression(compression)
    kv.init("w", np.zeros(n, np.float32))
    return kv


def _pulled(kv) -> np.ndarray:
    out = np.empty(kv.entries()["w"].value.shape, np.float32)
    kv.pull("w", out=out)
    return out


def _pushed(grads: list, residuals: list) -> np.ndarray:
    """The float32 sum the home gets of `grads`, each compressed with its own residual
    (moved on in place), in source order."""
    total = np.zeros(grads[0].size, np.float32)
    for j, g in enumerate(grads):
        decoded, residuals[j][...] = reference_step(g, residuals[j])
        total = (total + decoded).astype(np.float32)
    return total


@settings(max_examples=25, deadline=None)
@given(arrays(np.float32, st.integers(1, 700), elements=finite), st.integers(1, 4))
def test_without_an_updater_a_pull_is_the_sum_compressed_with_the_homes_residual(g, rounds):
    """A push assigns the sum; a pull returns D(C(sum + residual)), the home's residual
    carried from round to round, bit for bit."""
    kv = _store(g.size)
    residuals = [np.zeros(g.size, np.float32) for _ in range(2)]
    home_residual = np.zeros(g.size, np.float32)
    for r in range(rounds):
        grads = [g * np.float32(r + 1), -g * np.float32(0.5) + np.float32(r)]
        kv.push("w", [x.astype(np.float32) for x in grads])
        want, home_residual = reference_step(_pushed(grads, residuals), home_residual)
        assert _pulled(kv).tobytes() == want.tobytes()


def _sgd(key, merged, stored):
    stored -= np.float32(0.1) * merged


@settings(max_examples=25, deadline=None)
@given(arrays(np.float32, st.integers(1, 700), elements=finite), st.integers(1, 4))
def test_with_an_updater_a_pull_follows_the_value_by_its_compressed_change(g, rounds):
    """With an updater the home keeps the value apart; a pull returns the served value
    moved on by D(C(value - served)) after each push, bit for bit."""
    kv = _store(g.size)
    kv.set_updater(_sgd)
    residuals = [np.zeros(g.size, np.float32)]
    value = np.zeros(g.size, np.float32)
    served = np.zeros(g.size, np.float32)
    for r in range(rounds):
        grad = (g * np.float32(r + 1)).astype(np.float32)
        kv.push("w", [grad])
        _sgd("w", _pushed([grad], residuals), value)
        change, _ = reference_step((value - served).astype(np.float32),
                                   np.zeros(g.size, np.float32))
        served = (served + change).astype(np.float32)
        assert _pulled(kv).tobytes() == served.tobytes()
        assert kv.entries()["w"].stored.tobytes() == value.tobytes()


@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e4])
def test_the_served_value_stays_within_the_owners_residual(scale):
    """Over 300 steps of SGD without momentum, of gradients of changing size, what
    workers hold differs from the value by a bounded residual: under 4x the largest
    change of one step."""
    rng = np.random.default_rng(7)
    n = 2000
    kv = _store(n)
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.1))
    largest, worst = 0.0, 0.0
    before = kv.entries()["w"].stored.copy()
    for step in range(300):
        size = scale * (1 + 9 * (step % 50 == 0))
        kv.push("w", [(rng.standard_normal(n) * size).astype(np.float32)])
        value = kv.entries()["w"].stored
        largest = max(largest, float(np.abs(value - before).max()))
        worst = max(worst, float(np.abs(value - _pulled(kv)).max()))
        before = value.copy()
    assert 0 < worst < 4 * largest, (worst, largest)


@pytest.mark.parametrize("optimizer", [
    {"name": "sgd", "momentum": 0.9}, {"name": "sgd", "momentum": 0.5},
    {"name": "rmsprop", "centered": True}])
def test_with_a_heavy_ball_momentum_the_value_takes_the_compressed_step(optimizer):
    """With SGD's or centered RMSProp's momentum, a pull returns the value before the push
    moved on by D(C(step)), the optimizer's step compressed without a residual of the
    home's own, and the value is that, bit for bit: the store takes the step workers
    take. The steps come from a twin store without compression given the same sums
    and set to the same value before each."""
    rng = np.random.default_rng(5)
    n = 700
    kv, twin = _store(n), gpukv.create("device")
    twin.init("w", np.zeros(n, np.float32))
    for store in (kv, twin):
        store.set_optimizer(gpukv.optim.create(learning_rate=0.1, **optimizer))
    assert kv.settles_pulls()
    residuals = [np.zeros(n, np.float32) for _ in range(2)]
    value = np.zeros(n, np.float32)
    for _ in range(5):
        grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        kv.push("w", grads)
        twin.entries()["w"].value[...] = value
        twin.push("w", [_pushed(grads, residuals)])
        step, _ = reference_step((twin.entries()["w"].value - value).astype(np.float32),
                                 np.zeros(n, np.float32))
        value = (value + step).astype(np.float32)
        assert _pulled(kv).tobytes() == value.tobytes()
        assert kv.entries()["w"].stored.tobytes() == value.tobytes()


@pytest.mark.parametrize("name,options,settles", [
    ("sgd", {}, False), ("sgd", {"momentum": 0.9}, True), ("nag", {"momentum": 0.9}, False),
    ("adam", {}, False), ("adamw", {}, False), ("lamb", {}, False), ("adagrad", {}, False),
    ("rmsprop", {}, False), ("rmsprop", {"centered": True}, True),
    ("rmsprop", {"centered": True, "gamma2": 0.0}, False)])
def test_which_optimizers_settle_compressed_pulls(name, options, settles):
    """A heavy-ball momentum on the step settles them: SGD's `momentum`, centered
    RMSProp's `gamma2`, above 0. Nesterov's momentum and the Adam-like rules keep the
    value apart (they trained closer to uncompressed so: docs/optimizers.md)."""
    assert gpukv.optim.create(name, **options).settles_compressed_pulls is settles


@pytest.mark.parametrize("optimizer,apart", [
    (gpukv.optim.SGD(momentum=0.0), True), (gpukv.optim.SGD(momentum=0.9), False),
    (gpukv.optim.NAG(momentum=0.9), True), (gpukv.optim.Adam(), True)])
def test_the_optimizer_decides_whether_the_value_is_kept_apart(optimizer, apart):
    """SGD without momentum has nothing to carry what a step's code did not send, and
    NAG and Adam trained closer to uncompressed so: the home keeps the value apart, as
    with an updater function; SGD's momentum settles it."""
    rng = np.random.default_rng(6)
    kv = _store(500)
    optimizer.set_learning_rate(0.1)
    kv.set_optimizer(optimizer)
    for _ in range(3):
        kv.push("w", [rng.standard_normal(500).astype(np.float32)])
    held = _pulled(kv)
    assert (kv.entries()["w"].stored.tobytes() != held.tobytes()) == apart


def test_with_momentum_what_workers_hold_is_the_value_step_after_step():
    """Over 300 steps of SGD with momentum, of gradients of changing size, a pull
    returns the value the optimizer updates, bit for bit, after every step, and the
    steps move it."""
    rng = np.random.default_rng(7)
    n = 2000
    kv = _store(n)
    kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.1, momentum=0.9))
    first = kv.entries()["w"].stored.copy()
    for step in range(300):
        size = 1 + 9 * (step % 50 == 0)
        kv.push("w", [(rng.standard_normal(n) * size).astype(np.float32)])
        assert _pulled(kv).tobytes() == kv.entries()["w"].stored.tobytes(), step
    assert np.abs(kv.entries()["w"].stored - first).max() > 1


def test_setting_the_compression_again_serves_the_value_held():
    """Setting a compression starts every residual afresh, the home's too: the value
    becomes what workers hold, and pulls are unchanged by it."""
    rng = np.random.default_rng(1)
    kv = _store(500)
    kv.set_updater(_sgd)
    for _ in range(3):
        kv.push("w", [rng.standard_normal(500).astype(np.float32) for _ in range(2)])
    held = _pulled(kv)
    assert kv.entries()["w"].stored.tobytes() != held.tobytes()
    kv.set_gradient_compression(None)
    assert _pulled(kv).tobytes() == held.tobytes()
    assert kv.entries()["w"].stored.tobytes() == held.tobytes()


def test_a_checkpoint_holds_the_value_and_loads_as_what_workers_hold(tmp_path):
    """A checkpoint holds the value the updater updates; loaded, it is what pulls return."""
    rng = np.random.default_rng(2)
    kv = _store(300)
    kv.set_updater(_sgd)
    for _ in range(3):
        kv.push("w", [rng.standard_normal(300).astype(np.float32) for _ in range(2)])
    value = kv.entries()["w"].stored.copy()
    assert value.tobytes() != _pulled(kv).tobytes()
    kv.save(tmp_path / "w.gpukv")
    again = _store(300)
    again.set_updater(_sgd)
    again.load(tmp_path / "w.gpukv")
    assert _pulled(again).tobytes() == value.tobytes()
    kv.load(tmp_path / "w.gpukv")
    assert _pulled(kv).tobytes() == value.tobytes()


@pytest.mark.parametrize("compression", [{"type": "2bit", "threshold": 0.5},
                                         {"type": "1bit"}, {"type": "fp16"}])
def test_mxnets_codecs_pull_the_value_as_it_is(compression):
    """MXNet's codecs compress one way: a pull returns the updated value itself."""
    rng = np.random.default_rng(3)
    kv = _store(400, compression)
    kv.set_updater(_sgd)
    for _ in range(3):
        kv.push("w", [rng.standard_normal(400).astype(np.float32)])
    assert kv.entries()["w"].stored is kv.entries()["w"].value
    assert _pulled(kv).tobytes() == kv.entries()["w"].value.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_keys_of_other_float_dtypes_pull_the_rule_rounded_to_their_dtype(dtype):
    """A float16 or float64 key: the change decoded in float32, added in the key's
    precision (float32 for float16), rounded once to its dtype."""
    rng = np.random.default_rng(4)
    kv = gpukv.create("device")
    kv.set_gradient_compression(SIGN)
    kv.init("w", np.zeros(256, dtype))
    kv.set_updater(_sgd)
    grad = rng.standard_normal(256).astype(dtype)
    kv.push("w", [grad])
    value = kv.entries()["w"].stored
    change, _ = reference_step(value.astype(np.float32), np.zeros(256, np.float32))
    out = np.empty(256, dtype)
    kv.pull("w", out=out)
    assert out.tobytes() == change.astype(dtype).tobytes()


@pytest.mark.parametrize("compression", [SIGN, {"type": "ternary"}])
@pytest.mark.parametrize("optimizer", [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9}),  # the value settled by the pulls
    ("adam", {"learning_rate": 0.1}),  # the value kept apart, lazily updated rows
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "lazy_update": False}),  # every row
    (None, {})])  # row-sparse pushes assign
def test_a_row_sparse_push_reaches_the_pulls_of_a_compressed_key(compression, optimizer):
    """Row-sparse pushes are not compressed: after the key's compressed dense pushes,
    what they change is pulled as it is, the same as without compression."""
    name, options = optimizer
    n, d = 8, 64
    pulled = []
    for comp in (compression, None):
        kv = gpukv.create("device")
        if comp is not None:
            kv.set_gradient_compression(comp)
        kv.init("emb", np.zeros((n, d), np.float32))
        if name is not None:
            kv.set_optimizer(gpukv.optim.create(name, **options))
        kv.push("emb", np.full((n, d), 0.01, np.float32))
        dense = np.zeros((n, d), np.float32)
        kv.pull("emb", out=dense)
        for _ in range(3):
            kv.push("emb", gpukv.RowSparse(np.array([5, 2]), np.ones((2, d), np.float32),
                                           (n, d)))
        out = np.zeros((n, d), np.float32)
        kv.pull("emb", out=out)
        rows = gpukv.RowSparse.zeros((n, d), np.float32)
        kv.row_sparse_pull("emb", out=rows, row_ids=np.array([2, 5]))
        if comp is not None and name == "adam":  # lazily: the other rows pull as before
            untouched = [r for r in range(n) if r not in (2, 5)]
            np.testing.assert_array_equal(out[untouched], dense[untouched])
        pulled.append((out, rows.data))
    # (the dense push is a constant, which both codecs send exactly)
    np.testing.assert_allclose(pulled[0][0], pulled[1][0], rtol=1e-6)
    np.testing.assert_allclose(pulled[0][1], pulled[1][1], rtol=1e-6)


def test_a_row_sparse_push_that_moves_every_row_is_pulled_whole():
    """SGD with multi_precision updates every row of a float16 key for a row-sparse
    gradient (as MXNet's, which has no row-sparse form): with the value kept apart (no
    momentum), every row it moved is pulled as it is, the same as without compression."""
    n, d = 8, 64
    pulled = []
    for comp in (SIGN, None):
        kv = gpukv.create("device")
        if comp is not None:
            kv.set_gradient_compression(comp)
        kv.init("emb", np.ones((n, d), np.float16))
        kv.set_optimizer(gpukv.optim.SGD(learning_rate=0.1, wd=0.1, multi_precision=True))
        kv.push("emb", np.full((n, d), 0.01, np.float16))
        dense = np.zeros((n, d), np.float16)
        kv.pull("emb", out=dense)
        for _ in range(3):
            kv.push("emb", gpukv.RowSparse(np.array([5, 2]), np.ones((2, d), np.float16),
                                           (n, d)))
        out = np.zeros((n, d), np.float16)
        kv.pull("emb", out=out)
        untouched = [r for r in range(n) if r not in (2, 5)]
        assert (out[untouched] != dense[untouched]).all(), comp  # weight decay moved them
        pulled.append(out)
    np.testing.assert_array_equal(pulled[0], pulled[1])

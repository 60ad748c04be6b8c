"""Learning-rate schedules across a save and a resume: a job resumed from saved optimizer
state (`save_optimizer_states`, or a snapshot and `kv.resume`) takes the rates the job
that never stopped takes, for function schedules and gpukv's schedule classes alike."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpukv
from gpukv import optim
from gpukv._errors import ArgumentError, ArgumentKindError
from gpukv.checkpoints.checkpoint import read_archive

KEYS = [0, 1, 2]
GRAD = np.ones(2, np.float32)


def _inverse(n):
    return 1.0 / n


def _store(opt, value=None, keys=KEYS):
    kv = gpukv.create("local")
    kv.init(list(keys), [np.zeros(2, np.float32) if value is None else value[k].copy()
                         for k in keys])
    kv.set_optimizer(opt)
    return kv


def _push(kv, keys):
    kv.push(list(keys), [GRAD * (i + 1) for i in range(len(keys))])


def _values(kv, keys=KEYS):
    outs = [np.full(2, 7, np.float32) for _ in keys]
    kv.pull(list(keys), out=outs)
    return dict(zip(keys, outs))


def _saved(kv, folder: Path, how: str) -> Path:
    """Save `kv`'s optimizer state under `folder` as `how` says; the path to load."""
    if how == "snapshot":
        kv.snapshot(folder / "snaps", 1)
        kv.finish_snapshots()
        return folder / "snaps"
    path = folder / "opt.states"
    kv.save_optimizer_states(path, dump_optimizer=how == "dump")
    return path


def _resumed(opt, path: Path, how: str, value: dict, keys=KEYS):
    """A fresh store with `opt` set, resumed from what `_saved` wrote."""
    if how == "snapshot":
        kv = gpukv.create("local")
        kv.set_optimizer(opt)
        assert kv.resume(path) is not None
        return kv
    kv = _store(opt, value, keys)
    kv.load_optimizer_states(path)
    return kv


@pytest.mark.parametrize("how", ["dump", "snapshot"])
def test_a_function_schedule_resumes_at_the_rate_of_the_next_update(tmp_path, how):
    """SGD with lr_scheduler=1/n, one push, saved: the file holds 0.5, the rate of the
    second update, and a store resumed from it without a schedule of its own takes its
    next step at 0.5 (-1.5), as the job that never stopped does, not at 1.0 (-2.0)."""
    kv = _store(optim.SGD(lr_scheduler=_inverse), keys=["w"])
    kv.push("w", GRAD)
    path = _saved(kv, tmp_path, how)
    if how == "dump":
        assert read_archive(path)[0]["options"]["learning_rate"] == 0.5
    middle = _values(kv, ["w"])
    kv.push("w", GRAD)
    resumed = _resumed(optim.SGD(), path, how, middle, ["w"])
    resumed.push("w", GRAD)
    assert _values(resumed, ["w"])["w"].tolist() == [-1.5, -1.5]
    assert _values(kv, ["w"])["w"].tolist() == [-1.5, -1.5]


def test_a_function_schedule_with_no_update_yet_saves_its_first_rate(tmp_path):
    """Saved before any push, a function schedule is asked for update 1 (1/n is not
    asked at 0, which it cannot answer)."""
    kv = _store(optim.SGD(lr_scheduler=_inverse, begin_num_update=0))
    kv.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    assert read_archive(tmp_path / "s")[0]["options"]["learning_rate"] == 1.0


class _Factor(optim.FactorScheduler):
    """A schedule of one's own that keeps books as MXNet's do (its state is not saved)."""


def test_saving_does_not_move_a_schedule_that_keeps_books(tmp_path):
    """The rate saved for a schedule of one's own is asked of a copy: the running job's
    schedule has not counted the next update, so a key behind the others still takes
    the rate at num_update (1.0 here, where the next update of key 0 would take 0.5)."""
    rates = []
    for save in (False, True):
        opt = optim.SGD(lr_scheduler=_Factor(step=2, factor=0.5, base_lr=1.0))
        kv = _store(opt, keys=[0, 1])
        _push(kv, [0, 1])
        _push(kv, [0])
        if save:
            kv.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
            assert read_archive(tmp_path / "s")[0]["options"]["learning_rate"] == 0.5
        rates.append(opt.next_scalars(1)[0])
    assert rates == [1.0, 1.0]


@pytest.mark.parametrize("make", [
    lambda: optim.PolyScheduler(max_update=3, base_lr=1.0, pwr=2, final_lr=0.1),
    lambda: optim.CosineScheduler(max_update=3, base_lr=1.0, final_lr=0.1, warmup_steps=1),
], ids=["poly", "cosine"])
@pytest.mark.parametrize("first", [4, 5, 40])
def test_a_decaying_schedule_first_asked_past_max_update_gives_its_final_rate(make, first):
    """A Poly or Cosine schedule asked first past max_update (a resumed job's own, whose
    update counts are past it) gives the rate one asked at every update gives there."""
    asked_throughout = make()
    want = [asked_throughout(n) for n in range(1, first + 1)][-1]
    assert want == pytest.approx(0.1)
    assert make()(first) == want


# ------------------------------------------------------------------- random runs
def _table_schedule(rates):
    return lambda n: rates[n]


#: name -> (the schedule's class, or None for a function of a table of rates; what it is
#: made with)
SCHEDULES = {
    "factor": (optim.FactorScheduler, st.fixed_dictionaries({
        "step": st.integers(1, 3), "factor": st.sampled_from([0.5, 0.9, 1.0]),
        "stop_factor_lr": st.sampled_from([1e-8, 0.2]), "base_lr": st.just(0.5)})),
    "factor_warmup": (optim.FactorScheduler, st.fixed_dictionaries({
        "step": st.integers(1, 3), "factor": st.just(0.5), "base_lr": st.just(0.5),
        "warmup_steps": st.integers(1, 5), "warmup_begin_lr": st.just(0.05),
        "warmup_mode": st.sampled_from(["linear", "constant"])})),
    "multifactor": (optim.MultiFactorScheduler, st.fixed_dictionaries({
        "step": st.sets(st.integers(1, 10), min_size=1, max_size=3).map(sorted),
        "factor": st.just(0.5), "base_lr": st.just(0.5), "warmup_steps": st.integers(0, 2)})),
    "poly": (optim.PolyScheduler, st.fixed_dictionaries({
        "max_update": st.integers(3, 8), "base_lr": st.just(0.5),
        "pwr": st.sampled_from([0, 1, 2]), "final_lr": st.sampled_from([0.0, 0.01]),
        "warmup_steps": st.integers(0, 2)})),
    "cosine": (optim.CosineScheduler, st.fixed_dictionaries({
        "max_update": st.integers(3, 8), "base_lr": st.just(0.5),
        "final_lr": st.sampled_from([0.0, 0.01]), "warmup_steps": st.integers(0, 2),
        "warmup_mode": st.sampled_from(["linear", "constant"])})),
    "function": (None, st.fixed_dictionaries({"rates": st.lists(
        st.sampled_from([0.5, 0.25, 0.125, 0.1, 0.03]), min_size=30, max_size=30)})),
}
SUBSETS = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(sorted(SCHEDULES)),
       how=st.sampled_from(["plain", "dump", "snapshot"]),
       before=st.lists(SUBSETS, min_size=0, max_size=10),
       after=st.lists(SUBSETS, min_size=1, max_size=5),
       begin=st.integers(0, 3), mult=st.sampled_from([1.0, 0.5, 3.0]))
def test_a_resumed_job_takes_the_rates_of_the_job_that_never_stopped(
        data, kind, how, before, after, begin, mult):
    """Random pushes of random subsets of keys (so keys have different update counts),
    a multiplier on one key, saved (with or without options, or as a snapshot) and
    resumed into a store whose optimizer has the same schedule, made afresh: every later
    push gives both stores the same values, bit for bit."""
    cls, options = SCHEDULES[kind]
    made = data.draw(options)

    def make_opt():
        schedule = cls(**made) if cls is not None else _table_schedule(made["rates"])
        opt = optim.SGD(momentum=0.9, lr_scheduler=schedule, begin_num_update=begin)
        opt.set_lr_mult({1: mult})
        return opt

    kv = _store(make_opt())
    for keys in before:
        _push(kv, keys)
    with tempfile.TemporaryDirectory() as folder:
        path = _saved(kv, Path(folder), how)
        middle = _values(kv)
        resumed = _resumed(make_opt(), path, how, middle)
    for keys in after:
        _push(kv, keys)
        _push(resumed, keys)
        want, got = _values(kv), _values(resumed)
        for key in KEYS:
            assert got[key].tobytes() == want[key].tobytes(), (key, keys)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rates=st.lists(st.floats(0.0625, 2.0, width=32), min_size=20, max_size=20),
       pushes=st.integers(0, 12), begin=st.integers(0, 3),
       how=st.sampled_from(["dump", "snapshot"]))
def test_a_function_schedules_saved_rate_is_the_next_updates(rates, pushes, begin, how):
    """A function schedule is not saved, but its rate for the next update is: a store
    whose optimizer has no schedule, resumed after any number of pushes of every key,
    takes its next step at the rate the job that never stopped takes it."""
    kv = _store(optim.SGD(lr_scheduler=_table_schedule(rates), begin_num_update=begin))
    for _ in range(pushes):
        _push(kv, KEYS)
    with tempfile.TemporaryDirectory() as folder:
        path = _saved(kv, Path(folder), how)
        middle = _values(kv)
        resumed = _resumed(optim.SGD(learning_rate=7.0), path, how, middle)
    _push(kv, KEYS)
    _push(resumed, KEYS)
    want, got = _values(kv), _values(resumed)
    for key in KEYS:
        assert got[key].tobytes() == want[key].tobytes(), key


# --------------------------------------------- fine-tuning under a schedule of one's own
def _trained(tmp_path, dump: bool, updates: int = 100) -> Path:
    """SGD with momentum (and weight decay 0.01) after `updates` pushes of every key,
    its state saved (with its options when `dump`)."""
    kv = _store(optim.SGD(learning_rate=0.1, momentum=0.9, wd=0.01))
    for _ in range(updates):
        _push(kv, KEYS)
    path = tmp_path / "pretrained.states"
    kv.save_optimizer_states(path, dump_optimizer=dump)
    return path


def _cosine() -> optim.CosineScheduler:
    return optim.CosineScheduler(max_update=50, base_lr=0.1)


@pytest.mark.parametrize("dump", [False, True])
def test_restarted_counts_follow_a_new_schedule_from_its_start(tmp_path, dump):
    """States saved after 100 updates, loaded into SGD with a cosine schedule over 50:
    with the saved counts (the default) the next update is past the schedule's end, at
    its final rate 0, and the weights move by the momentum alone; with
    update_counts='restart' every count starts over and the schedule from its start,
    which its own store keeps over a saved one, while the momenta are the file's."""
    path = _trained(tmp_path, dump)
    stores, optimizers = {}, {}
    for counts in ("saved", "restart"):
        opt = optimizers[counts] = optim.SGD(momentum=0.9, lr_scheduler=_cosine())
        kv = stores[counts] = _store(opt)
        kv.load_optimizer_states(path, update_counts=counts)
        _push(kv, KEYS)
    saved, restarted = optimizers["saved"], optimizers["restart"]
    assert (saved.num_update, dict(saved.update_counts)) == (101, {0: 101, 1: 101, 2: 101})
    assert (restarted.num_update, dict(restarted.update_counts)) == (1, {0: 1, 1: 1, 2: 1})
    assert isinstance(restarted.lr_scheduler, optim.CosineScheduler)
    assert restarted.lr_scheduler.max_update == 50
    first = _cosine()(1)
    before = np.zeros(2, np.float32)  # every store's weights start at zero
    momentum_alone = _values(stores["saved"])
    for i, key in enumerate(KEYS):
        grad = GRAD * (i + 1)
        got = _values(stores["restart"])[key]
        assert np.allclose(got - momentum_alone[key], -first * grad, rtol=1e-5), key
        assert not np.array_equal(momentum_alone[key], before)  # the file's momenta
    if dump:  # the file's other options are taken
        assert restarted.wd == saved.wd == 0.01


def test_restarted_counts_start_at_the_optimizers_begin_num_update(tmp_path):
    """update_counts='restart' puts every key back at begin_num_update, as a new
    optimizer's: the next update of each is begin_num_update + 1."""
    path = _trained(tmp_path, dump=False, updates=3)
    opt = optim.SGD(momentum=0.9, learning_rate=0.1, begin_num_update=7)
    kv = _store(opt)
    kv.load_optimizer_states(path, update_counts="restart")
    assert opt.num_update == 7
    _push(kv, KEYS)
    assert (opt.num_update, dict(opt.update_counts)) == (8, {0: 8, 1: 8, 2: 8})


@pytest.mark.parametrize("store", ["local", "device"])
@pytest.mark.parametrize("value,error", [
    ("reset", ArgumentError), ("Saved", ArgumentError), (None, ArgumentKindError),
    (True, ArgumentKindError), (0, ArgumentKindError)])
def test_a_bad_update_counts_is_refused_typed_before_the_file_is_read(tmp_path, store, value,
                                                                      error):
    """update_counts other than 'saved' or 'restart' is an ArgumentError (of a str) or an
    ArgumentKindError (of anything else) naming it, raised before the file is read
    (here there is none) and changing nothing."""
    opt = optim.SGD(learning_rate=0.1, momentum=0.9)
    kv = gpukv.create(store)
    kv.init(KEYS, [np.zeros(2, np.float32)] * len(KEYS))
    kv.set_optimizer(opt)
    _push(kv, KEYS)
    with pytest.raises(error, match=r"update_counts.*'saved', 'restart'"):
        kv.load_optimizer_states(tmp_path / "missing.states", update_counts=value)
    assert (opt.num_update, dict(opt.update_counts)) == (1, {0: 1, 1: 1, 2: 1})

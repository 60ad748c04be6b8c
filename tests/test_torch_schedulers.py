"""torch's learning-rate schedulers drive a Trainer through `trainer.torch_optimizer`: its
group's 'lr' (and 'momentum' or 'betas') set the next step's, as with a torch optimizer."""
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.optim import lr_scheduler  # noqa: E402

import gpukv  # noqa: E402
import gpukv.torch as gt  # noqa: E402

STEPS = 8


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def make_batches(n=32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
            for _ in range(STEPS)]


def backward(models, x, y):
    """Each replica's mean loss over its shard (DDP's convention)."""
    for model, xs, ys in zip(models, x.chunk(len(models)), y.chunk(len(models))):
        nn.functional.cross_entropy(model(xs), ys).backward()


def train(optimizer, schedule, models, step=None):
    """STEPS steps of `optimizer` under `schedule(optimizer)`; the group each step ran
    with. `step`: what takes the step (the optimizer's own step by default)."""
    scheduler = schedule(optimizer)
    seen = []
    for x, y in make_batches():
        optimizer.zero_grad()
        backward(models, x, y)
        group = optimizer.param_groups[0]
        seen.append((group["lr"], group.get("momentum"), group.get("betas")))
        (step or optimizer.step)()
        scheduler.step()
    return seen


def assert_close(models, reference):
    for model in models:
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


SCHEDULES = {
    "one cycle": (lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=STEPS + 1,
                                                    cycle_momentum=False)),
    "step": lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.3),
    "warmup then cosine": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
            lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)], milestones=[3]),
}


@pytest.mark.parametrize("on_store", [True, False], ids=["on store", "on replicas"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_torch_scheduler_drives_the_trainer_as_torch_sgd(schedule, on_store):
    base = make_model()
    models, reference = [copy.deepcopy(base) for _ in range(2)], copy.deepcopy(base)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.2}, kvstore="local",
                         update_on_kvstore=on_store)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warnings about the order of the steps
        ours = train(trainer.torch_optimizer, SCHEDULES[schedule], models)
    theirs = train(torch.optim.SGD(reference.parameters(), lr=0.2), SCHEDULES[schedule],
                   [reference])
    assert [lr for lr, _, _ in ours] == [lr for lr, _, _ in theirs]
    assert len(set(lr for lr, _, _ in ours)) > 2  # the schedule moved the rate
    assert trainer.learning_rate == trainer.torch_optimizer.param_groups[0]["lr"]
    assert_close(models, reference)


@pytest.mark.parametrize("on_store", [True, False], ids=["on store", "on replicas"])
def test_one_cycle_cycles_adams_betas_as_torch_adam(on_store):
    base = make_model()
    models, reference = [copy.deepcopy(base) for _ in range(2)], copy.deepcopy(base)
    trainer = gt.Trainer(models, "adam", {"learning_rate": 0.001}, kvstore="local",
                         update_on_kvstore=on_store)

    def schedule(o):
        return lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=STEPS + 1)
    ours = train(trainer.torch_optimizer, schedule, models)
    theirs = train(torch.optim.Adam(reference.parameters(), lr=0.001), schedule,
                   [reference])
    assert [(lr, betas) for lr, _, betas in ours] == [
        (lr, betas) for lr, _, betas in theirs]
    assert len(set(betas for _, _, betas in ours)) > 2
    assert_close(models, reference)


@pytest.mark.parametrize("on_store", [True, False], ids=["on store", "on replicas"])
def test_a_cycled_momentum_is_the_momentum_of_each_step(on_store):
    """SGD's momentum (MXNet's rule, which differs from torch's under a changing rate):
    the steps OneCycleLR drives are those of setting each step's rate and momentum by
    hand, with trainer.step(batch_size) taking them (a scheduler counts it as a step)."""
    base = make_model()
    models, by_hand = ([copy.deepcopy(base) for _ in range(2)] for _ in range(2))
    options = {"learning_rate": 0.1, "momentum": 0.9}
    trainer = gt.Trainer(models, "sgd", options, kvstore="local",
                         update_on_kvstore=on_store)
    batch = len(make_batches()[0][0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seen = train(trainer.torch_optimizer,
                     lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.3, total_steps=STEPS + 1),
                     models, step=lambda: trainer.step(batch))
    assert len(set(m for _, m, _ in seen)) > 2
    other = gt.Trainer(by_hand, "sgd", options, kvstore="local", update_on_kvstore=on_store)
    for (lr, momentum, _), (x, y) in zip(seen, make_batches()):
        other.zero_grad()
        backward(by_hand, x, y)
        other.set_learning_rate(lr)
        other.optimizer.momentum = momentum
        other.step(batch)
    for a, b in zip(models, by_hand):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)


def test_the_view_takes_a_grad_scalers_step_as_the_trainer_does():
    """scaler.step(trainer.torch_optimizer): the Trainer's scaled step, skipped when a
    gradient holds an inf, the same weights as scaler.step(trainer)."""
    results = []
    for through_view in (False, True):
        models = [make_model() for _ in range(2)]
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        target = trainer.torch_optimizer if through_view else trainer
        for i, (x, y) in enumerate(make_batches()[:3]):
            target.zero_grad()
            for model, xs, ys in zip(models, x.chunk(2), y.chunk(2)):
                scaler.scale(nn.functional.cross_entropy(model(xs), ys)).backward()
            if i == 1:
                with torch.no_grad():
                    models[1][0].weight.grad[0, 0] = float("inf")
            scaler.step(target)
            scaler.update()
        results.append(([p.detach().clone() for p in models[0].parameters()],
                        trainer.steps, scaler.get_scale()))
    (plain, steps, scale), (viewed, viewed_steps, viewed_scale) = results
    assert all(torch.equal(p, q) for p, q in zip(plain, viewed))
    assert (steps, scale) == (viewed_steps, viewed_scale) == (2, 2.0 ** 9)


def _trained_view():
    models = [make_model() for _ in range(2)]
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="local")
    x, y = make_batches()[0]
    trainer.zero_grad()
    backward(models, x, y)
    trainer.step()
    trainer.zero_grad()
    backward(models, x, y)
    return trainer, models


@pytest.mark.parametrize("option, value, message", [
    ("lr", -0.1, r"lr=-0.1 is out of range"),
    ("lr", float("nan"), r"lr=nan is out of range"),
    ("lr", "fast", r"lr: expected a number"),
    ("momentum", 0.0, r"momentum cannot reach 0"),
    ("momentum", 1.0, r"momentum=1.0 is out of range"),
])
def test_a_bad_value_in_the_group_is_refused_before_the_step_changes_anything(
        option, value, message):
    trainer, models = _trained_view()
    view = trainer.torch_optimizer
    view.param_groups[0]["lr"] = 0.05  # a good change beside the bad one, not taken
    view.param_groups[0][option] = value
    before = [p.detach().clone() for p in models[0].parameters()]
    with pytest.raises(gpukv.GpukvError, match=message):
        view.step()
    assert trainer.steps == 1
    assert (trainer.optimizer.lr, trainer.optimizer.momentum) == (0.1, 0.9)
    assert all(torch.equal(p, q) for p, q in zip(before, models[0].parameters()))


def test_what_the_view_cannot_do_is_refused():
    trainer, models = _trained_view()
    view = trainer.torch_optimizer
    with pytest.raises(gpukv.ArgumentError, match="takes no closure"):
        view.step(lambda: 0.0)
    with pytest.raises(gpukv.ArgumentError, match="set_lr_mult"):
        view.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert trainer.steps == 1
    trainer.set_learning_rate(0.01)  # the Trainer's own change shows in the group
    assert view.param_groups[0]["lr"] == trainer.learning_rate == 0.01
    view.zero_grad()
    assert all(p.grad is None for m in models for p in m.parameters())


def test_a_gpukv_schedule_and_a_torch_one_are_refused_together():
    schedule = gpukv.optim.lr_scheduler.FactorScheduler(step=2, factor=0.5)
    trainer = gt.Trainer(make_model(), "sgd", {"learning_rate": 0.1,
                                               "lr_scheduler": schedule}, kvstore="local")
    with pytest.raises(gpukv.ArgumentError, match="follows a gpukv lr_scheduler"):
        assert trainer.torch_optimizer is None  # (not reached)


def test_a_resumed_schedule_goes_on_bit_for_bit(tmp_path):
    """The recipe of docs/trainer.md: the scheduler's and the view's state_dict in
    user_state, a snapshot after scheduler.step(), both loaded after a resume."""
    def run(folder, stop):
        model = make_model()
        trainer = gt.Trainer(model, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                             kvstore="local", checkpoint_dir=folder)
        scheduler = lr_scheduler.OneCycleLR(trainer.torch_optimizer, max_lr=0.4,
                                            total_steps=STEPS + 1)
        if trainer.resumed_from is not None:
            saved = trainer.saved_user_state(0)
            trainer.torch_optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
        for x, y in make_batches()[trainer.steps:stop]:
            trainer.zero_grad()
            backward([model], x, y)
            trainer.step()
            scheduler.step()
            trainer.user_state.update(optimizer=trainer.torch_optimizer.state_dict(),
                                      scheduler=scheduler.state_dict())
            if trainer.steps % 2 == 0:
                trainer.snapshot()
        trainer.finish_snapshots()
        return [p.detach().clone() for p in model.parameters()]

    whole = run(tmp_path / "whole", STEPS)
    run(tmp_path / "parts", STEPS // 2 + 1)  # stops after the snapshot of step 4
    resumed = run(tmp_path / "parts", STEPS)
    assert all(torch.equal(p, q) for p, q in zip(whole, resumed))


def test_saved_user_state_is_a_workers_own_and_refuses_what_it_cannot_give(tmp_path):
    model = make_model()
    trainer = gt.Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         checkpoint_dir=tmp_path)
    with pytest.raises(gpukv.ArgumentError, match="resumed from no snapshot"):
        trainer.saved_user_state()
    trainer.user_state["position"] = 7
    trainer.close()
    again = gt.Trainer(make_model(), "sgd", {"learning_rate": 0.1}, kvstore="local",
                       checkpoint_dir=tmp_path)
    assert again.saved_user_state(0) == {"position": 7} == again.user_state
    for bad in (1, -1, True, "0"):
        with pytest.raises(gpukv.ArgumentError, match="the snapshot has workers 0 to 0"):
            again.saved_user_state(bad)


def test_an_option_set_on_the_optimizer_itself_counts_beside_the_view():
    """With the view made, options set on trainer.optimizer still count (docs/trainer.md):
    learning_rate says so, the group shows them, and a scheduler that moves only the
    rate leaves a momentum set by hand as it is (each option apart: the last change
    wins)."""
    trainer, models = _trained_view()
    view = trainer.torch_optimizer
    trainer.optimizer.set_learning_rate(0.02)
    trainer.optimizer.momentum = 0.5
    assert trainer.learning_rate == 0.02
    scheduler = lr_scheduler.StepLR(trainer.torch_optimizer, step_size=1, gamma=0.5)
    assert view.param_groups[0]["lr"] == 0.02  # the scheduler started from the new rate
    view.step()
    scheduler.step()
    assert (trainer.optimizer.lr, trainer.optimizer.momentum) == (0.02, 0.5)
    assert trainer.learning_rate == 0.01  # the next step's, the scheduler's
    trainer.zero_grad()
    backward(models, *make_batches()[0])
    view.step()
    assert (trainer.optimizer.lr, trainer.optimizer.momentum) == (0.01, 0.5)
    assert view.param_groups[0]["momentum"] == 0.5

"""gpukv.torch.Trainer under torch.amp.GradScaler: `scaler.step(trainer)` and
`scaler.update()`, as with a torch optimizer. Scales are powers of two, so a scaled step
is the unscaled step bit for bit; a step with an inf or NaN changes nothing."""
import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import gpukv  # noqa: E402
import gpukv.torch as gt  # noqa: E402


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def make_batches(steps, n=48):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
            for _ in range(steps)]


def backward(models, x, y, scaler=None):
    """Each replica's mean loss over its shard (DDP's convention), scaled by `scaler`."""
    loss_fn = nn.CrossEntropyLoss()
    for model, xs, ys in zip(models, x.chunk(len(models)), y.chunk(len(models))):
        loss = loss_fn(model(xs), ys)
        (scaler.scale(loss) if scaler is not None else loss).backward()


def poison(models, value=float("inf")):
    """An inf (or NaN) in one gradient of the last replica, as an overflow leaves it."""
    with torch.no_grad():
        models[-1][0].weight.grad[0, 0] = value


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bits(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b)), max(
        (x - y).abs().max().item() for x, y in zip(a, b))


def setup(scaled, replicas=2, optimizer="sgd", kvstore="local", **options):
    """Replicas of one model, their Trainer, and a GradScaler when `scaled` (else None)."""
    base = make_model()
    models = [copy.deepcopy(base) for _ in range(replicas)]
    params = ({"learning_rate": 0.01} if optimizer == "adam"
              else {"learning_rate": 0.1, "momentum": 0.9})
    trainer = gt.Trainer(models, optimizer, params, kvstore=kvstore, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
    return models, trainer, scaler


def train(scaled, steps=6, bad=(2,), replicas=2, optimizer="sgd", kvstore="local",
          **options):
    """Weights, steps and scales after `steps` steps; at the steps in `bad` one gradient is
    an inf. Unscaled, those steps are left out (what a skipped step should be)."""
    models, trainer, scaler = setup(scaled, replicas, optimizer, kvstore, **options)
    scales = []
    for i, (x, y) in enumerate(make_batches(steps)):
        trainer.zero_grad()
        backward(models, x, y, scaler)
        if i in bad:
            poison(models)
        if scaler is not None:
            scaler.step(trainer)
            scaler.update()
            scales.append(scaler.get_scale())
        elif i not in bad:
            trainer.step()
    for model in models[1:]:
        assert_bits(weights(model), weights(models[0]))
    return weights(models[0]), trainer.steps, scales


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("on_store,overlap", [
    (True, False), (True, True), (False, False), (False, True)])
def test_a_scaled_step_is_the_unscaled_one_and_an_inf_skips_it(on_store, overlap, optimizer):
    """The weights of every replica are those of unscaled steps without the bad ones; the
    scale halves after each bad step; a skipped step is not counted."""
    options = dict(update_on_kvstore=on_store, overlap=overlap, optimizer=optimizer)
    want, want_steps, _ = train(False, **options)
    got, steps, scales = train(True, **options)
    assert_bits(got, want)
    assert steps == want_steps == 5
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0]


@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_unscaled_before_the_step_are_taken_as_they_are(overlap):
    """`scaler.unscale_(trainer)` before `scaler.step(trainer)`, the optimizer on the
    store: the step takes the gradients as unscaled (with overlap, reduced again)."""
    def run(scaled):
        models, trainer, scaler = setup(scaled, 2, overlap=overlap)
        for x, y in make_batches(3):
            trainer.zero_grad()
            backward(models, x, y, scaler)
            if scaler is None:
                trainer.step()
                continue
            scaler.unscale_(trainer)
            scaler.step(trainer)
            scaler.update()
        return weights(models[0])
    assert_bits(run(True), run(False))


def test_a_nan_is_skipped_as_an_inf_is():
    base = make_model()
    models = [copy.deepcopy(base) for _ in range(2)]
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="local")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before = weights(models[0])
    x, y = make_batches(1)[0]
    backward(models, x, y, scaler)
    poison(models, float("nan"))
    scaler.step(trainer)
    scaler.update()
    assert_bits(weights(models[0]), before)
    assert trainer.steps == 0 and scaler.get_scale() == 512.0


@pytest.mark.parametrize("compression", [{"type": "sign"}, {"type": "2bit", "threshold": 0.01},
                                         {"type": "fp16"}])
def test_compressors_on_the_store_take_unscaled_gradients(compression):
    """With the optimizer on the store, a scaled run with compression is the unscaled run
    bit for bit: the residuals never hold a scale, nor the inf of a skipped step."""
    want, _, _ = train(False, kvstore="device", compression_params=compression)
    got, steps, _ = train(True, kvstore="device", compression_params=compression)
    assert_bits(got, want)
    assert steps == 5


@pytest.mark.parametrize("replicas", [1, 3])
def test_unscale_and_clip_between_allreduce_and_step_is_the_unscaled_recipe(replicas):
    """update_on_kvstore=False, DDP's recipe: allreduce_grads(), scaler.unscale_(trainer),
    clip at num_replicas x max_norm, scaler.step(trainer): the unscaled recipe's weights
    (allreduce_grads, clip, update), with the bad step left out."""
    def run(scaled):
        models, trainer, scaler = setup(scaled, replicas, update_on_kvstore=False)
        for i, (x, y) in enumerate(make_batches(5)):
            trainer.zero_grad()
            backward(models, x, y, scaler)
            if i == 1:
                poison(models)
            trainer.allreduce_grads()
            if scaler is not None:
                scaler.unscale_(trainer)
            for model in models:
                torch.nn.utils.clip_grad_norm_(model.parameters(),
                                               0.05 * trainer.num_replicas)
            if scaler is not None:
                scaler.step(trainer)
                scaler.update()
            elif i != 1:
                trainer.update()
        return weights(models[0]), trainer.steps
    want, want_steps = run(False)
    got, steps = run(True)
    assert_bits(got, want)
    assert steps == want_steps == 4


def test_a_step_after_allreduce_grads_takes_the_scale_off_the_sums():
    """update_on_kvstore=False: allreduce_grads() then scaler.step(trainer) (no unscale_):
    the sums lose the scale, as an unscaled allreduce_grads() and update() do."""
    def run(scaled):
        models, trainer, scaler = setup(scaled, 2, update_on_kvstore=False)
        for x, y in make_batches(3):
            trainer.zero_grad()
            backward(models, x, y, scaler)
            trainer.allreduce_grads()
            if scaler is not None:
                scaler.step(trainer)
                scaler.update()
            else:
                trainer.update()
        return weights(models[0])
    assert_bits(run(True), run(False))


def test_compression_with_local_updates_is_refused_changing_nothing():
    """update_on_kvstore=False with compression: the compressors would take scaled
    gradients; refused before anything changes, and the next plain step is unscaled."""
    base = make_model()
    models = [copy.deepcopy(base) for _ in range(2)]
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="device",
                         update_on_kvstore=False, compression_params={"type": "sign"})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before = weights(models[0])
    x, y = make_batches(1)[0]
    backward(models, x, y, scaler)
    grads = [p.grad.clone() for p in models[0].parameters()]
    with pytest.raises(gpukv.ArgumentError, match="update_on_kvstore=True"):
        scaler.step(trainer)
    assert_bits(weights(models[0]), before)
    assert_bits([p.grad for p in models[0].parameters()], grads)
    assert trainer.steps == 0
    assert not hasattr(trainer, "found_inf") and not hasattr(trainer, "grad_scale")
    trainer.step()  # a plain step: no scale is taken off
    assert trainer.steps == 1


def test_a_disabled_scaler_steps_as_usual():
    want, _, _ = train(False, bad=())
    base = make_model()
    models = [copy.deepcopy(base) for _ in range(2)]
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="local")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for x, y in make_batches(6):
        trainer.zero_grad()
        backward(models, x, y, scaler)
        scaler.step(trainer)
        scaler.update()
    assert_bits(weights(models[0]), want)


def test_param_groups_hold_every_replicas_trainable_parameters():
    base = make_model()
    base[0].bias.requires_grad_(False)
    models = [copy.deepcopy(base) for _ in range(3)]
    trainer = gt.Trainer(models, "sgd", kvstore="local")
    (group,) = trainer.param_groups
    want = {id(p) for m in models for p in m.parameters() if p.requires_grad}
    assert {id(p) for p in group["params"]} == want and len(group["params"]) == len(want)


def test_autocast_float16_trains_like_pytorch_with_its_scaler():
    """float16 autocast on the CPU: the Trainer under GradScaler against torch.optim.SGD
    under its own GradScaler, the same batches (the same arithmetic up to rounding)."""
    base = make_model()
    model = copy.deepcopy(base)
    trainer = gt.Trainer([model], "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="local")
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]
    loss_fn = nn.CrossEntropyLoss()
    for x, y in make_batches(5):
        for net, step, scaler in ((model, trainer, scalers[0]), (ref, opt, scalers[1])):
            step.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(step)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_snapshot_taken_after_the_update_resumes_the_scale(tmp_path):
    """docs/trainer.md's recipe: the scaler's state in user_state, a snapshot after
    scaler.update(); a resumed run ends with the uninterrupted run's weights and scale
    (a step with an inf on each side of the snapshot)."""
    batches = make_batches(6)

    def run(steps, folder):
        base = make_model()
        models = [copy.deepcopy(base) for _ in range(2)]
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                             kvstore="local", checkpoint_dir=folder)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        first = 0
        if trainer.resumed_from is not None:
            scaler.load_state_dict(trainer.user_state["scaler"])
            first = trainer.user_state["batch"]
        for i in range(first, steps):
            x, y = batches[i]
            trainer.zero_grad()
            backward(models, x, y, scaler)
            if i in (1, 4):
                poison(models)
            scaler.step(trainer)
            scaler.update()
            trainer.user_state.update(scaler=scaler.state_dict(), batch=i + 1)
            if i == 2:
                trainer.snapshot()
        trainer.finish_snapshots()
        return weights(models[0]), scaler.get_scale(), trainer.steps

    want = run(6, tmp_path / "whole")
    run(3, tmp_path / "cut")
    got = run(6, tmp_path / "cut")
    assert_bits(got[0], want[0])
    assert got[1:] == want[1:] == (256.0, 4)


def test_float16_replicas_summed_by_the_step_are_refused_and_summed_first_are_skipped():
    """Two float16 replicas, update_on_kvstore=False: the step would sum the scaled
    gradients in float16 after GradScaler looked at each replica's (1.25 x 4 x 32768 each
    fits; their sum does not): refused, nothing changed. Summed first by allreduce_grads,
    GradScaler sees the inf in the sums: the step is skipped and the scale lowered."""
    def backward_of_new_replicas():
        """(replicas, their Trainer, the scaler) after one scaled backward each."""
        made = [nn.Linear(4, 1, bias=False).half() for _ in range(2)]
        for m in made:
            nn.init.ones_(m.weight)
        trainer = gt.Trainer(made, "sgd", {"learning_rate": 1e-5}, kvstore="local",
                             update_on_kvstore=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 15)
        trainer.zero_grad()
        for m in made:
            scaler.scale(m(torch.full((1, 4), 1.25, dtype=torch.half)).sum()).backward()
        return made, trainer, scaler

    models, trainer, scaler = backward_of_new_replicas()
    with pytest.raises(gpukv.ArgumentError, match="call trainer.allreduce_grads"):
        scaler.step(trainer)
    assert trainer.steps == 0
    for m in models:
        assert torch.equal(m.weight, torch.ones(1, 4, dtype=torch.half))

    models, trainer, scaler = backward_of_new_replicas()
    trainer.allreduce_grads()
    scaler.step(trainer)
    scaler.update()
    assert trainer.steps == 0 and scaler.get_scale() == 2.0 ** 14
    for m in models:
        assert torch.equal(m.weight, torch.ones(1, 4, dtype=torch.half))


@pytest.mark.parametrize("split", [False, True])
def test_a_backward_onto_the_sums_a_scaled_step_left_is_refused(split):
    """update_on_kvstore=False under GradScaler: the sums a scaled step leaves in .grad
    (made by it, or by allreduce_grads) are not to be added to either; the next step is
    an ArgumentError naming a parameter, the weights unchanged, and after zero_grad it
    goes on."""
    models, trainer, scaler = setup(True, update_on_kvstore=False)
    (x, y), (x2, y2) = make_batches(2)

    def scaled_step():
        if split:
            trainer.allreduce_grads()
        scaler.step(trainer)
        scaler.update()

    trainer.zero_grad()
    backward(models, x, y, scaler)
    scaled_step()
    backward(models, x2, y2, scaler)  # no zero_grad: onto the sums
    before = weights(models[0])
    with pytest.raises(gpukv.ArgumentError, match="backward added its gradient to the sum"):
        if split:
            trainer.allreduce_grads()
        else:
            scaler.step(trainer)
    assert_bits(weights(models[0]), before)
    trainer.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # (a refused step: anew)
    backward(models, x2, y2, scaler)
    scaled_step()
    assert not all(torch.equal(a, b) for a, b in zip(weights(models[0]), before))

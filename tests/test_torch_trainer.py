"""gpukv.torch.Trainer: data-parallel PyTorch training on a store, checked against PyTorch."""
import copy
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import gpukv  # noqa: E402
import gpukv.torch as gt  # noqa: E402

from .bfloat16 import needs_bfloat16  # noqa: E402


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def make_data(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def replicas_of(model, n):
    return [copy.deepcopy(model) for _ in range(n)]


def backward_shards(models, x, y):
    """Each replica takes its shard of the batch; losses are per-sample sums (as gluon)."""
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for model, xs, ys in zip(models, x.chunk(len(models)), y.chunk(len(models))):
        loss_fn(model(xs), ys).backward()


def train_trainer(models, optimizer, params, steps=5, **kw):
    trainer = gt.Trainer(models, optimizer, params, kvstore="local", **kw)
    x, y = make_data()
    for _ in range(steps):
        trainer.zero_grad()
        backward_shards(models, x, y)
        trainer.step(len(x))
    return trainer


def train_torch(model, make_opt, steps=5):
    opt = make_opt(model.parameters())
    x, y = make_data()
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model


def assert_same_weights(models, reference, rtol=1e-5, atol=1e-6):
    for model in models:
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=rtol,
                                       atol=atol, err_msg=name)


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_bytes", [gt.BUCKET_BYTES, 256, 0])
def test_sgd_momentum_matches_torch(replicas, bucket_bytes):
    """SGD with momentum and weight decay over N replicas gives torch.optim.SGD's weights on
    the whole batch, whatever the bucketing."""
    base = make_model()
    models = replicas_of(base, replicas)
    train_trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
                  bucket_bytes=bucket_bytes)
    ref = train_torch(copy.deepcopy(base),
                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3))
    assert_same_weights(models, ref)


@pytest.mark.parametrize("replicas", [2, 4])
def test_adam_matches_one_replica_and_torch(replicas):
    """Adam over N replicas gives the weights of one replica on the whole batch, and
    torch.optim.Adam's up to Adam's sign-like sensitivity to tiny gradients."""
    base = make_model()
    models = replicas_of(base, replicas)
    one = replicas_of(base, 1)
    train_trainer(models, "adam", {"learning_rate": 0.01, "epsilon": 1e-8})
    train_trainer(one, "adam", {"learning_rate": 0.01, "epsilon": 1e-8})
    assert_same_weights(models, one[0], rtol=1e-5, atol=1e-5)
    ref = train_torch(copy.deepcopy(base), lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-8))
    assert_same_weights(models, ref, rtol=0, atol=5e-4)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "lamb"])
def test_update_on_kvstore_false_matches_true(optimizer):
    """Updating on each replica (update_on_kvstore=False) gives the weights updating on
    the store does."""
    base = make_model()
    params = {"learning_rate": 0.05, "wd": 1e-4}
    if optimizer == "sgd":
        params["momentum"] = 0.9
    on_store = replicas_of(base, 3)
    local = replicas_of(base, 3)
    train_trainer(on_store, optimizer, dict(params))
    train_trainer(local, optimizer, dict(params), update_on_kvstore=False)
    for a, b in zip(local, on_store):
        for p, q in zip(a.parameters(), b.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-6,
                                       atol=1e-7)


@pytest.mark.parametrize("kvstore", ["local", "device"])
def test_deterministic_given_wins_over_a_malformed_variable(kvstore, monkeypatch):
    """Trainer(deterministic=True) reads no GPUKV_DETERMINISTIC, in the stores it makes for
    itself too (each replica's, and the early sums'): the same weights as with the
    variable unset."""
    base = make_model()
    a, b = replicas_of(base, 2), replicas_of(base, 2)
    for models, value in ((a, None), (b, "x")):
        if value is not None:
            monkeypatch.setenv("GPUKV_DETERMINISTIC", value)
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore=kvstore,
                             update_on_kvstore=False, deterministic=True)
        x, y = make_data()
        for _ in range(3):
            trainer.zero_grad()
            backward_shards(models, x, y)
            trainer.step(len(x))
    assert_same_weights(b, a[0], rtol=0, atol=0)


def test_allreduce_then_update_equals_step():
    """allreduce_grads() then update(batch_size) is step(batch_size), and allreduce leaves
    the summed gradient in every replica's .grad."""
    base = make_model()
    a, b = replicas_of(base, 2), replicas_of(base, 2)
    x, y = make_data()
    ta = gt.Trainer(a, "sgd", {"learning_rate": 0.1}, kvstore="local", update_on_kvstore=False)
    tb = gt.Trainer(b, "sgd", {"learning_rate": 0.1}, kvstore="local", update_on_kvstore=False)
    backward_shards(a, x, y)
    backward_shards(b, x, y)
    expected = [p.grad.clone() + q.grad for p, q in zip(a[0].parameters(), a[1].parameters())]
    ta.allreduce_grads()
    for model in a:
        for p, g in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, g)
    ta.update(len(x))
    tb.step(len(x))
    assert_same_weights(a, b[0], rtol=0, atol=0)


@pytest.mark.parametrize("replicas", [1, 3])
def test_clipping_by_the_global_norm_between_allreduce_and_update_is_ddps(replicas):
    """The recipe of docs/trainer.md: mean losses, `allreduce_grads()`, every replica
    clipped at num_replicas x max_norm, `update()`: plain PyTorch's weights with the
    gradient of the whole batch clipped at max_norm (the clip bites: the norm is larger)."""
    base = make_model()
    models = replicas_of(base, replicas)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="local", update_on_kvstore=False)
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x, y = make_data()
    max_norm = 0.05
    for _ in range(4):
        trainer.zero_grad()
        for model, xs, ys in zip(models, x.chunk(replicas), y.chunk(replicas)):
            loss_fn(model(xs), ys).backward()
        trainer.allreduce_grads()
        for model in models:
            torch.nn.utils.clip_grad_norm_(model.parameters(),
                                           max_norm * trainer.num_replicas)
        trainer.update()
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        assert norm > 2 * max_norm
        opt.step()
    assert_same_weights(models, ref)


def test_an_update_of_unsummed_gradients_warns_once_where_replicas_would_drift():
    """update() without allreduce_grads() applies each replica's own gradient (as gluon
    does): with several replicas it says once that they drift apart; after
    allreduce_grads(), or with one replica, it says nothing."""
    models = replicas_of(make_model(), 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         update_on_kvstore=False)
    x, y = make_data()
    backward_shards(models, x, y)
    with pytest.warns(UserWarning, match=r"update\(\) without allreduce_grads\(\): each of "
                                         r"the 2 replicas applies its own gradient"):
        trainer.update(len(x))
    pairs = zip(models[0].parameters(), models[1].parameters())
    assert not all(torch.equal(p, q) for p, q in pairs)
    for model, reduce in [(models, False), (models, True), ([make_model()], False)]:
        t = trainer if len(model) == 2 else gt.Trainer(
            model, "sgd", {"learning_rate": 0.1}, kvstore="local", update_on_kvstore=False)
        t.zero_grad()
        backward_shards(model, x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if reduce:
                t.allreduce_grads()
            t.update(len(x))


def test_sums_of_allreduce_grads_are_not_summed_again():
    """After allreduce_grads(), step() and a second allreduce_grads() would sum the sums:
    refused, changing nothing; update() applies them as the step would have; zero_grad()
    drops them."""
    base = make_model()
    models, ref = replicas_of(base, 2), replicas_of(base, 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         update_on_kvstore=False)
    stepped = gt.Trainer(ref, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         update_on_kvstore=False)
    x, y = make_data()
    backward_shards(models, x, y)
    backward_shards(ref, x, y)
    trainer.allreduce_grads()
    sums = [p.grad.clone() for p in models[0].parameters()]
    before = [p.detach().clone() for p in models[0].parameters()]
    for call in (lambda: trainer.step(len(x)), trainer.allreduce_grads):
        with pytest.raises(gpukv.ArgumentError, match="sum them again"):
            call()
        assert all(torch.equal(p.grad, s) for p, s in zip(models[0].parameters(), sums))
        assert all(torch.equal(p, b) for p, b in zip(models[0].parameters(), before))
    trainer.update(len(x))
    stepped.step(len(x))
    assert_same_weights(models, ref[0], rtol=0, atol=0)
    trainer.zero_grad()
    backward_shards(models, x, y)
    trainer.allreduce_grads()
    trainer.zero_grad()
    backward_shards(models, x, y)
    trainer.step(len(x))  # the sums dropped: a step of fresh gradients
    assert trainer.steps == 2


def test_allreduce_needs_update_on_kvstore_false():
    """allreduce_grads and update are refused when the store runs the optimizer."""
    t = gt.Trainer(replicas_of(make_model(), 2), "sgd", kvstore="local")
    with pytest.raises(gpukv.ArgumentError, match="update_on_kvstore=False"):
        t.allreduce_grads()
    with pytest.raises(gpukv.ArgumentError, match="update_on_kvstore=False"):
        t.update(4)


def test_replicas_start_from_replica_zero():
    """At construction every replica takes replica 0's weights, in place."""
    models = [make_model(seed=s) for s in range(3)]
    before = [[p.detach().clone() for p in m.parameters()] for m in models]
    gt.Trainer(models, "sgd", kvstore="local")
    for model in models:
        for p, q in zip(model.parameters(), before[0]):
            torch.testing.assert_close(p.detach(), q)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_weights_and_grads_stay_in_place(update_on_kvstore):
    """Steps write the replicas' weights and gradients in place: their data_ptr never
    changes, and fused ones are views of one buffer per replica."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   update_on_kvstore=update_on_kvstore)
    assert len(t.keys) == 1  # five small parameters, one key
    ptrs = [[(p.data_ptr(), p.grad.data_ptr()) for p in m.parameters()] for m in models]
    x, y = make_data()
    old = [p.detach().clone() for p in models[0].parameters()]
    for _ in range(3):
        t.zero_grad()
        backward_shards(models, x, y)
        t.step(len(x))
    assert ptrs == [[(p.data_ptr(), p.grad.data_ptr()) for p in m.parameters()]
                    for m in models]
    assert any(not torch.equal(p.detach(), q) for p, q in zip(models[0].parameters(), old))
    for m in models:
        ps = list(m.parameters())
        step = ps[0].element_size()
        assert all(b.data_ptr() == a.data_ptr() + a.numel() * step for a, b in zip(ps, ps[1:]))


def write_between_steps(model, step):
    """What a program may do to its weights between two steps: clamp them through
    `.data` (as WGAN's weight clipping), load a layer's state, set a layer afresh."""
    if step == 1:
        for p in model.parameters():
            p.data.clamp_(-0.2, 0.2)
    elif step == 2:
        model[2].load_state_dict(make_model(seed=7)[2].state_dict())
    elif step == 3:
        with torch.no_grad():
            model[4].weight.fill_(0.05)


def steps_with_writes(models, step):
    """Four steps, with `write_between_steps` on every replica after each; `step()`
    steps on the whole batch."""
    x, y = make_data()
    for i in range(4):
        if models[0][0].weight.grad is not None:
            for model in models:
                model.zero_grad()
        backward_shards(models, x, y)
        step(len(x))
        for model in models:
            write_between_steps(model, i + 1)


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("bucket_bytes", [gt.BUCKET_BYTES, 0])
def test_writes_to_the_weights_between_steps_are_updated_with_update_on_kvstore_false(
        replicas, bucket_bytes):
    """update_on_kvstore=False updates the parameters in place, as a PyTorch optimizer:
    what the program writes into them between steps is what the next step updates."""
    base = make_model()
    models = replicas_of(base, replicas)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="local", update_on_kvstore=False, bucket_bytes=bucket_bytes)
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps_with_writes(models, trainer.step)
    x, y = make_data()
    for i in range(4):
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        opt.step()
        write_between_steps(ref, i + 1)
    assert_same_weights(models, ref)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16,
                                   pytest.param(torch.bfloat16, marks=needs_bfloat16)])
def test_writes_to_16_bit_weights_between_steps_reach_their_master_copies(dtype, replicas):
    """16-bit parameters update through float32 master copies: with
    update_on_kvstore=False a write between steps (load_state_dict, fill_ under
    no_grad) is what the next step updates, element by element, on every replica; an
    element written with the value it holds keeps the master's precision, so rewriting
    the weights as they are changes no bit of the run."""
    def run(write):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(8, 3)).to(dtype)
        models = replicas_of(base, replicas)
        trainer = gt.Trainer(models, "adam", {"learning_rate": 0.01}, kvstore="local",
                             update_on_kvstore=False)
        x = torch.randn(8, 8).to(dtype)
        for i in range(5):
            trainer.zero_grad()
            for m in models:
                m(x).square().sum().backward()
            trainer.step()
            if i == 2:
                for m in models:
                    write(m)
        return [m[0].weight.detach().clone() for m in models], [
            m[0].bias.detach().clone() for m in models]

    kept, _ = run(lambda m: None)
    same, _ = run(lambda m: m.load_state_dict(copy.deepcopy(m.state_dict())))
    for a, b in zip(kept, same):
        assert torch.equal(a, b)

    def clamp_bias(m):
        with torch.no_grad():
            m[0].bias.fill_(5.0)
    weights, biases = run(clamp_bias)
    for b in biases:  # two Adam steps of at most about lr each from 5, not from the old bias
        assert (b.float() - 5.0).abs().max() < 0.05, b
    for w in weights[1:]:
        assert torch.equal(w, weights[0])


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_write_between_steps_on_the_store_is_replaced_with_one_warning(replicas):
    """With update_on_kvstore=True the store holds the weights: the step after a write
    pulls the store's weights over it, warning (once) that it does, naming the
    parameter; the weights are those of a run without the write."""
    base = make_model()
    written, plain = replicas_of(base, replicas), replicas_of(base, replicas)
    x, y = make_data()
    t1 = gt.Trainer(written, "sgd", {"learning_rate": 0.1}, kvstore="local")
    t2 = gt.Trainer(plain, "sgd", {"learning_rate": 0.1}, kvstore="local")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            for models, trainer in ((written, t1), (plain, t2)):
                trainer.zero_grad()
                backward_shards(models, x, y)
            with torch.no_grad():  # after backward: the gradients are those of `plain`
                for model in written:
                    model[2].bias.add_(1.0)
            t1.step(len(x))
            t2.step(len(x))
    lost = [w for w in seen if issubclass(w.category, gt.WeightWritesLost)]
    assert len(lost) == 1 and len(seen) == 1, [str(w.message) for w in seen]
    assert "parameter '2.bias' was written" in str(lost[0].message)
    assert_same_weights(written, plain[0], rtol=0, atol=0)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_the_trainers_own_writes_warn_of_nothing(update_on_kvstore, tmp_path):
    """Steps, a snapshot and a resume write the weights without a WeightWritesLost."""
    models = replicas_of(make_model(), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                       kvstore="local", update_on_kvstore=update_on_kvstore,
                       checkpoint_dir=tmp_path, checkpoint_every=2)
        x, y = make_data()
        for _ in range(3):
            t.zero_grad()
            backward_shards(models, x, y)
            t.step(len(x))
        t.finish_snapshots()
        again = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                           kvstore="local", update_on_kvstore=update_on_kvstore,
                           checkpoint_dir=tmp_path, checkpoint_every=2)
        for _ in range(2):
            again.zero_grad()
            backward_shards(models, x, y)
            again.step(len(x))
        assert again.steps == 4


def test_many_small_parameters_make_few_keys():
    """A model of 1000 small parameters is held in a handful of keys."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(500)])
    t = gt.Trainer(replicas_of(model, 2), "sgd", kvstore="local")
    assert sum(1 for _ in model.parameters()) == 1000
    assert len(t.keys) <= 4


def test_big_parameters_get_own_keys_named_after_them():
    """A bucket of one parameter is keyed by the parameter's name; fused keys name their
    first and last parameter."""
    model = make_model()
    t = gt.Trainer(model, "sgd", kvstore="local", bucket_bytes=0)
    assert sorted(t.keys) == sorted(n for n, _ in model.named_parameters())
    t = gt.Trainer(make_model(), "sgd", kvstore="local")
    assert t.keys == ["0.weight..4.bias"]


def test_buckets_fill_in_backward_order_the_first_up_to_1mb():
    """The parameters backward reaches first (the last layers) make a bucket of at most
    1 MiB, the rest buckets of up to bucket_bytes, every one in parameter order."""
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))  # 1.6 MB of float32 parameters
    t = gt.Trainer(model, "sgd", kvstore="local")
    assert t.buckets == {"0.weight..2.weight": ["0.weight", "0.bias", "2.weight"],
                         "2.bias..4.bias": ["2.bias", "4.weight", "4.bias"]}
    t = gt.Trainer(model, "sgd", kvstore="local", bucket_bytes=600_000)
    assert list(t.buckets.values()) == [["0.weight", "0.bias"], ["2.weight"],
                                        ["2.bias", "4.weight", "4.bias"]]


def test_stale_grad_is_an_error_naming_the_parameter():
    """A parameter whose .grad is None at step raises an ArgumentError naming it, before
    any weight or option changes."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    backward_shards(models, *make_data())
    models[1][4].bias.grad = None
    before = [p.detach().clone() for p in models[0].parameters()]
    with pytest.raises(gpukv.ArgumentError, match=r"'4\.bias' of replica 1"):
        t.step(8)
    assert t.optimizer.rescale_grad == 1.0
    for p, q in zip(models[0].parameters(), before):
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("bucket_bytes", [0, gt.BUCKET_BYTES])
def test_ignore_stale_grad(bucket_bytes):
    """With ignore_stale_grad=True a replica without a gradient contributes none, and a
    parameter without a gradient anywhere keeps its weight (plain SGD)."""
    base = make_model()
    models = replicas_of(base, 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   bucket_bytes=bucket_bytes)
    x, y = make_data()
    backward_shards(models, x, y)
    g1 = models[1][0].weight.grad.clone()
    w0, b4 = models[0][0].weight.detach().clone(), models[0][4].bias.detach().clone()
    models[0][0].weight.grad = None
    for m in models:
        m[4].bias.grad = None
    t.step(1, ignore_stale_grad=True)
    for m in models:
        torch.testing.assert_close(m[0].weight.detach(), w0 - 0.1 * g1)
        assert torch.equal(m[4].bias.detach(), b4)


def test_new_grad_tensors_are_taken_into_the_buckets():
    """After model.zero_grad() (grads set to None) a backward makes new .grad tensors; the
    step uses them and gives the same weights as the in-place buffers."""
    base = make_model()
    a, b = replicas_of(base, 2), replicas_of(base, 2)
    ta = gt.Trainer(a, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore="local")
    tb = gt.Trainer(b, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore="local")
    x, y = make_data()
    for _ in range(3):
        for m in a:
            m.zero_grad(set_to_none=True)
        tb.zero_grad()
        backward_shards(a, x, y)
        backward_shards(b, x, y)
        ta.step(len(x))
        tb.step(len(x))
    assert_same_weights(a, b[0], rtol=0, atol=0)


def test_frozen_parameters_are_left_out():
    """Parameters with requires_grad=False are no keys and keep their values."""
    models = replicas_of(make_model(), 2)
    for m in models:
        m[0].weight.requires_grad_(False)
    frozen = models[0][0].weight.detach().clone()
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local", bucket_bytes=0)
    assert "0.weight" not in t.keys and "0.bias" in t.keys
    backward_shards(models, *make_data())
    t.step(8)
    assert models[0][0].weight.grad is None
    assert torch.equal(models[0][0].weight.detach(), frozen)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_frozen_parameters_start_as_replica_0s(update_on_kvstore):
    """Replicas made one by one (each its own random init): every replica's frozen
    parameters start as replica 0's, as its trainable ones do, so the replicas run one
    model and train as plain PyTorch does on the whole batch."""
    models = [make_model(seed) for seed in range(3)]
    for m in models:
        m[0].requires_grad_(False)
    reference = copy.deepcopy(models[0])
    plain = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   update_on_kvstore=update_on_kvstore)
    for m in models:
        assert torch.equal(m[0].weight, reference[0].weight)
        assert torch.equal(m[0].bias, reference[0].bias)
    x, y = make_data()
    for _ in range(3):
        t.zero_grad()
        backward_shards(models, x, y)
        t.step(len(x))
        plain.zero_grad()
        (nn.CrossEntropyLoss(reduction="sum")(reference(x), y) / len(x)).backward()
        plain.step()
    assert_same_weights(models, reference)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_save_and_load_states_round_trip(tmp_path, update_on_kvstore):
    """Optimizer state saved after some steps and loaded back continues exactly where a
    trainer that never stopped goes, its schedule and the learning_rate it reports too."""
    base = make_model()
    x, y = make_data()
    a = replicas_of(base, 2)

    def params():
        return {"learning_rate": 0.01,
                "lr_scheduler": gpukv.optim.FactorScheduler(step=2, factor=0.5)}
    ta = gt.Trainer(a, "adam", params(), kvstore="local",
                    update_on_kvstore=update_on_kvstore)

    def run(trainer, models, steps):
        for _ in range(steps):
            trainer.zero_grad()
            backward_shards(models, x, y)
            trainer.step(len(x))

    run(ta, a, 3)
    path = tmp_path / "states.bin"
    ta.save_states(path)
    b = [copy.deepcopy(m) for m in a]
    tb = gt.Trainer(b, "adam", params(), kvstore="local",
                    update_on_kvstore=update_on_kvstore)
    tb.load_states(path)
    assert tb.learning_rate == ta.learning_rate == 0.005
    run(ta, a, 2)
    run(tb, b, 2)
    assert tb.learning_rate == ta.learning_rate == 0.0025
    assert_same_weights(b, a[0], rtol=0, atol=0)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_load_states_can_start_the_update_counts_over(tmp_path, update_on_kvstore):
    """load_states(update_counts='restart') takes the saved moments but starts the
    counts over: the schedule of the Trainer loading them from its first rate, where
    'saved' goes on from the file's; a bad value is refused before anything changes."""
    base = make_model()
    x, y = make_data()

    def trained(steps):
        models = replicas_of(base, 2)
        trainer = gt.Trainer(models, "adam", {
            "learning_rate": 0.01, "lr_scheduler": gpukv.optim.FactorScheduler(
                step=2, factor=0.5)}, kvstore="local", update_on_kvstore=update_on_kvstore)
        for _ in range(steps):
            trainer.zero_grad()
            backward_shards(models, x, y)
            trainer.step(len(x))
        return trainer

    path = tmp_path / "states.bin"
    trained(5).save_states(path)
    fresh = trained(0)
    with pytest.raises(gpukv.ArgumentError, match="update_counts"):
        fresh.load_states(path, update_counts="fresh")
    fresh.load_states(path, update_counts="restart")
    assert fresh.learning_rate == 0.01
    fresh.load_states(path)
    assert fresh.learning_rate == 0.0025


def test_learning_rate():
    """learning_rate reads the optimizer's rate and set_learning_rate changes the steps."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   update_on_kvstore=False)
    assert t.learning_rate == pytest.approx(0.1)
    t.set_learning_rate(0.0)
    assert t.learning_rate == 0.0
    before = [p.detach().clone() for p in models[0].parameters()]
    backward_shards(models, *make_data())
    t.step(8)
    for p, q in zip(models[1].parameters(), before):
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("compression", [None, {"type": "fp16"}])
def test_device_store_and_compression(compression):
    """The default 'device' store (reducing on the host for CPU tensors) trains as the
    'local' one, with gradient compression passed to it."""
    base = make_model()
    a, b = replicas_of(base, 2), replicas_of(base, 2)
    x, y = make_data()
    ta = gt.Trainer(a, "sgd", {"learning_rate": 0.1}, compression_params=compression)
    tb = gt.Trainer(b, "sgd", {"learning_rate": 0.1}, kvstore="local")
    assert ta.kvstore.type == "device"
    assert (ta.kvstore.gradient_compression is None) == (compression is None)
    for t, models in ((ta, a), (tb, b)):
        backward_shards(models, x, y)
        t.step(len(x))
    assert_same_weights(a, b[0], rtol=1e-3, atol=1e-4)


def test_powersgd_on_the_store_given_keys_every_matrix_and_set_later_is_refused():
    """PowerSGD compresses a key's own matrix: a store given with it set gives the
    Trainer the keys compression_params would (the same weights), and PowerSGD set on
    the store after the Trainer was made, whose buckets hold flattened matrices it would
    send uncompressed, is an ArgumentError at the next step, which changes nothing."""
    powersgd = {"type": "powersgd", "rank": 2}
    x, y = make_data()
    base = make_model()

    def trained(**options):
        models = replicas_of(base, 2)
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, **options)
        for _ in range(3):
            trainer.zero_grad()
            backward_shards(models, x, y)
            trainer.step(len(x))
        return trainer, models

    given, a = trained(compression_params=powersgd)
    kv = gpukv.create("device")
    kv.set_gradient_compression(powersgd)
    on_store, b = trained(kvstore=kv)
    assert on_store.keys == given.keys and "0.weight" in on_store.keys
    assert_same_weights(a, b[0], rtol=0, atol=0)

    models = replicas_of(base, 2)
    late = gt.Trainer(models, "sgd", {"learning_rate": 0.1})
    late.kvstore.set_gradient_compression(powersgd)
    backward_shards(models, x, y)
    with pytest.raises(gpukv.ArgumentError, match="PowerSGD, set after this Trainer was "
                                                  "made: its buckets hold parameter "
                                                  "'0.weight' flattened"):
        late.step(len(x))
    assert late.steps == 0
    for p, q in zip(models[0].parameters(), base.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_optimizer_instance_and_store_instance():
    """An Optimizer instance and a KVStore instance are used as given."""
    opt = gpukv.optim.SGD(learning_rate=0.2)
    kv = gpukv.create("local")
    t = gt.Trainer(make_model(), opt, kvstore=kv)
    assert t.optimizer is opt and t.kvstore is kv
    with pytest.raises(gpukv.ArgumentError, match="optimizer_params"):
        gt.Trainer(make_model(), opt, {"momentum": 0.9}, kvstore="local")


@pytest.mark.parametrize("modules, error", [
    ([], gpukv.ArgumentKindError),
    ("model", gpukv.ArgumentKindError),
    ([nn.Linear(2, 2), nn.Linear(3, 2)], gpukv.ShapeError),
    ([nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16)], gpukv.DTypeError),
])
def test_bad_modules(modules, error):
    """Modules that are not one architecture per device are typed errors."""
    with pytest.raises(error):
        gt.Trainer(modules, "sgd", kvstore="local")


def test_bad_batch_size():
    """A batch size that is not a positive number is an ArgumentError; one that is no
    number at all (a str, a bool) an ArgumentKindError, a TypeError."""
    t = gt.Trainer(make_model(), "sgd", kvstore="local")
    with pytest.raises(gpukv.ArgumentError, match="batch_size"):
        t.step(0)
    for bad in ("4", True, torch.tensor(True), torch.tensor([4, 4])):
        with pytest.raises(gpukv.ArgumentKindError,
                           match=r"batch_size=.*got (str|bool|Tensor)"):
            t.step(bad)
    with pytest.raises(gpukv.ArgumentError, match=r"batch_size=0: expected a number > 0"):
        t.step(torch.tensor(0))


@pytest.mark.parametrize("batch_size", [torch.tensor(8), torch.tensor([8.0]),
                                        torch.tensor(8, dtype=torch.int32)])
def test_a_batch_size_given_as_one_number_in_a_tensor_is_that_number(batch_size):
    """step(batch_size) takes a tensor of one number (`len(labels)` kept as a tensor, or a
    count summed on the device) as that number: the same weights as step(8)."""
    x, y = make_data()
    weights = []
    for size in (8, batch_size):
        model = make_model()
        t = gt.Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore="local")
        for _ in range(2):
            t.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
            t.step(size)
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_import_gpukv_does_not_import_torch():
    """`import gpukv` leaves PyTorch unimported; `import gpukv.torch` without PyTorch is a
    BackendError that says how to install it."""
    code = ("import sys, gpukv; assert 'torch' not in sys.modules\n"
            "sys.modules['torch'] = None\n"
            "try:\n    import gpukv.torch\nexcept gpukv.BackendError as e:\n"
            "    assert 'pip install torch' in str(e), e\nelse:\n    raise SystemExit(1)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_multipliers_set_first_give_their_parameters_own_keys(update_on_kvstore):
    """lr_mult and wd_mult set before the Trainer is made: their parameters get keys of
    their own, and training matches torch.optim.SGD with those per-parameter rates."""
    base = make_model()
    models = replicas_of(base, 2)
    names = [n for n, _ in base.named_parameters()]
    sgd = gpukv.optim.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3)
    sgd.set_lr_mult({names[2]: 0.25})
    sgd.set_wd_mult({names[3]: 0.0})
    trainer = gt.Trainer(models, sgd, kvstore="local", update_on_kvstore=update_on_kvstore)
    assert names[2] in trainer.keys and names[3] in trainer.keys
    x, y = make_data()
    for _ in range(5):
        trainer.zero_grad()
        backward_shards(models, x, y)
        trainer.step(len(x))
    model = copy.deepcopy(base)
    opt = torch.optim.SGD([{"params": [p], "lr": 0.1 * (0.25 if i == 2 else 1.0),
                            "weight_decay": 0.0 if i == 3 else 1e-3}
                           for i, p in enumerate(model.parameters())], momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(5):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    assert_same_weights(models, model)


def test_a_multiplier_on_a_shared_key_is_refused():
    """A multiplier set after the Trainer on a parameter fused with others would apply to
    no key: the step is an ArgumentError naming the parameter, and changes nothing."""
    models = replicas_of(make_model(), 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    name = next(n for n in trainer.buckets[trainer.keys[0]])
    assert len(trainer.buckets[trainer.keys[0]]) > 1  # the model's parameters share a key
    trainer.optimizer.set_lr_mult({name: 0.5})
    before = [p.detach().clone() for p in models[0].parameters()]
    x, y = make_data()
    backward_shards(models, x, y)
    with pytest.raises(gpukv.ArgumentError, match=repr(name)):
        trainer.step(len(x))
    assert all(torch.equal(a, b) for a, b in zip(before, models[0].parameters()))


class WithExtra(nn.Module):
    """make_model()'s layers, and one more parameter that replica 0 lacks."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.extra = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.body(x) + self.extra


class WithFrozenExtra(WithExtra):
    """WithExtra, its extra parameter frozen."""

    def __init__(self):
        super().__init__()
        self.extra.requires_grad_(False)


def body_only():
    torch.manual_seed(0)
    module = nn.Module()
    module.body = make_model()
    return module


def frozen_weight(trainable_in_zero: bool):
    models = [body_only(), body_only()]
    models[0 if not trainable_in_zero else 1].body[0].weight.requires_grad_(False)
    return models


@pytest.mark.parametrize("models, message", [
    (lambda: [body_only(), WithExtra()],
     r"parameter 'extra': trainable in replica 1 but missing in replica 0"),
    (lambda: [WithExtra(), body_only()],
     r"parameter 'extra': trainable in replica 0 but missing in replica 1"),
    (lambda: frozen_weight(False),
     r"parameter 'body.0.weight': trainable in replica 1 but frozen in replica 0"),
    (lambda: frozen_weight(True),
     r"parameter 'body.0.weight': frozen in replica 1 but trainable in replica 0"),
    (lambda: [WithFrozenExtra(), body_only()],
     r"parameter 'extra': frozen in replica 0 but missing in replica 1"),
], ids=["extra-in-1", "extra-in-0", "frozen-in-0", "frozen-in-1", "frozen-extra-in-0"])
def test_replicas_are_checked_both_ways(models, message):
    """A parameter one replica has (or trains) and another lacks (or freezes) is an
    ArgumentError naming it and the replica, whichever replica is replica 0."""
    with pytest.raises(gpukv.ArgumentError, match=message):
        gt.Trainer(models(), "sgd", kvstore="local")


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("replica", [0, 1])
def test_a_parameter_unfrozen_after_the_trainer_is_refused(update_on_kvstore, replica):
    """A parameter frozen when the Trainer is made and trainable at the step is an
    ArgumentError naming it and its replica; nothing changes."""
    models = replicas_of(make_model(), 2)
    for m in models:
        m[0].weight.requires_grad_(False)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   update_on_kvstore=update_on_kvstore)
    models[replica][0].weight.requires_grad_(True)
    backward_shards(models, *make_data())
    before = [p.detach().clone() for p in models[1].parameters()]
    message = rf"'0\.weight' of replica {replica}.*requires_grad=False"
    with pytest.raises(gpukv.ArgumentError, match=message):
        t.step(8)
    assert all(torch.equal(p.detach(), q) for p, q in zip(models[1].parameters(), before))


def step_once(trainer, models, x=None, y=None):
    """One zero_grad, backward and step on every replica."""
    if x is None:
        x, y = make_data()
    trainer.zero_grad()
    backward_shards(models, x, y)
    trainer.step(len(x))


def weights(models):
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def assert_unchanged(models, before):
    assert all(torch.equal(p.detach(), q) for m, ws in zip(models, before)
               for p, q in zip(m.parameters(), ws))


TRAINER_WAYS = [dict(update_on_kvstore=u, overlap=o) for u in (True, False)
                for o in (False, True)]
WAY_IDS = ["store", "store-overlap", "local", "local-overlap"]


@pytest.mark.parametrize("way", TRAINER_WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("zero_grad", [True, False])
@pytest.mark.parametrize("bucket_bytes", [0, gt.BUCKET_BYTES])
def test_a_step_without_backward_is_refused(way, zero_grad, bucket_bytes):
    """A second step with no backward since the first (after zero_grad or not) is an
    ArgumentError naming replica 0's parameters, and changes no weight or option."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore="local",
                   bucket_bytes=bucket_bytes, **way)
    step_once(t, models)
    if zero_grad:
        t.zero_grad()
    before = weights(models)
    with pytest.raises(gpukv.ArgumentError,
                       match=r"parameters '0\.weight', .* of replica 0: stale gradient"):
        t.step(48)
    assert t.optimizer.rescale_grad == 1 / 48
    assert_unchanged(models, before)


@pytest.mark.parametrize("way", TRAINER_WAYS, ids=WAY_IDS)
def test_backward_on_some_replicas_only_is_refused(way):
    """After a step, backward on replica 0 alone: the step is an ArgumentError naming
    replica 1, and changes nothing."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local", **way)
    x, y = make_data()
    step_once(t, models, x, y)
    t.zero_grad()
    backward_shards(models[:1], x[:24], y[:24])
    before = weights(models)
    with pytest.raises(gpukv.ArgumentError, match=r"'4\.bias' of replica 1: stale"):
        t.step(len(x))
    assert_unchanged(models, before)


@pytest.mark.parametrize("way", TRAINER_WAYS, ids=WAY_IDS)
def test_ignore_stale_grad_leaves_a_stale_replica_out(way):
    """With ignore_stale_grad=True a replica whose gradients are stale contributes none:
    plain SGD moves every replica by replica 0's gradient alone."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local", **way)
    x, y = make_data()
    step_once(t, models, x, y)
    t.zero_grad()
    backward_shards(models[:1], x[:24], y[:24])
    grads = [p.grad.clone() for p in models[0].parameters()]
    before = weights(models)
    t.step(2, ignore_stale_grad=True)
    for m in models:
        for p, w, g in zip(m.parameters(), before[0], grads):
            torch.testing.assert_close(p.detach(), w - 0.1 * g / 2)


class Skips(nn.Module):
    """make_model() and a layer its forward pass does not use."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("way", TRAINER_WAYS, ids=WAY_IDS)
def test_a_parameter_the_forward_pass_skips_is_stale_in_a_fused_key(way):
    """A layer left out of the forward pass, sharing a key with used ones: the step is an
    ArgumentError naming its parameters; with ignore_stale_grad it keeps its weights."""
    torch.manual_seed(0)
    models = replicas_of(Skips(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local", **way)
    assert len(t.keys) == 1
    x, y = make_data()
    unused = weights([m.unused for m in models])
    backward_shards(models, x, y)
    with pytest.raises(gpukv.ArgumentError,
                       match=r"parameters 'unused\.weight', 'unused\.bias' of replica 0"):
        t.step(len(x))
    t.step(len(x), ignore_stale_grad=True)
    assert_unchanged([m.unused for m in models], unused)


def test_allreduce_grads_and_update_refuse_stale_gradients():
    """allreduce_grads() and update() without backward since the last update are
    ArgumentErrors; allreduce_grads(ignore_stale_grad=True) then update() leaves the
    stale replica out as step does."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   update_on_kvstore=False)
    x, y = make_data()
    backward_shards(models, x, y)
    t.allreduce_grads()
    t.update(len(x))
    before = weights(models)
    with pytest.raises(gpukv.ArgumentError, match="stale gradient"):
        t.allreduce_grads()
    with pytest.raises(gpukv.ArgumentError, match="stale gradient"):
        t.update(len(x))
    assert_unchanged(models, before)
    t.zero_grad()
    backward_shards(models[:1], x[:24], y[:24])
    grads = [p.grad.clone() for p in models[0].parameters()]
    t.allreduce_grads(ignore_stale_grad=True)
    t.update(2)
    for m in models:
        for p, w, g in zip(m.parameters(), before[0], grads):
            torch.testing.assert_close(p.detach(), w - 0.1 * g / 2)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("batch_size", [1e-320, 5e-324, float("inf"), 10 ** 400, 1e308, 1e-300],
                         ids=["1e-320", "5e-324", "inf", "10**400", "rescale-1e-318",
                              "reciprocal-1e300"])
def test_a_batch_size_without_a_normal_reciprocal_is_refused(update_on_kvstore, batch_size):
    """A batch size whose reciprocal (or the rescale it gives) is not a finite normal
    number is an ArgumentError before anything is pushed; no weight becomes NaN."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "rescale_grad": 1e-10},
                   kvstore="local", update_on_kvstore=update_on_kvstore)
    pushed = []
    push = t.kvstore.push
    t.kvstore.push = lambda *a, **k: pushed.append(a) or push(*a, **k)
    backward_shards(models, *make_data())
    before = weights(models)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused in words, without NumPy's own warnings
        with pytest.raises(gpukv.ArgumentError, match="batch_size=.*not a finite normal"):
            t.step(batch_size)
    assert pushed == []
    assert_unchanged(models, before)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_a_batch_size_whose_rescale_is_no_normal_float32_is_refused(update_on_kvstore):
    """The optimizers take the rescale as a float32: a batch size of 1e38 (1/1e38 is a
    float64 normal, a float32 subnormal) is an ArgumentError, nothing pushed."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   update_on_kvstore=update_on_kvstore)
    backward_shards(models, *make_data())
    before = weights(models)
    with pytest.raises(gpukv.ArgumentError, match="batch_size=1e.38.*not a finite normal"):
        t.step(1e38)
    assert_unchanged(models, before)


@pytest.mark.parametrize("ignore_stale_grad", [False, True])
def test_a_parameter_frozen_after_the_trainer_is_refused(ignore_stale_grad):
    """A parameter trainable when the Trainer is made and frozen at the step (backward
    skips it) is an ArgumentError saying so, even with ignore_stale_grad, where its key
    would still move it through weight decay and momentum; nothing changes."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1, "momentum": 0.9},
                   kvstore="local")
    step_once(t, models)
    for m in models:
        m[0].weight.requires_grad_(False)
    t.zero_grad()
    backward_shards(models, *make_data())
    before = weights(models)
    with pytest.raises(gpukv.ArgumentError, match=r"'0\.weight' of replica 0.*frozen now"):
        t.step(48, ignore_stale_grad=ignore_stale_grad)
    assert_unchanged(models, before)


@pytest.mark.parametrize("dropped_by", ["zero_grad", "a refused step"])
def test_gradients_dropped_by_zero_grad_are_stale(dropped_by):
    """A backward whose gradients zero_grad dropped (a skipped batch, or a step refused
    and then zero_grad) makes nothing fresh: a parameter frozen since, or a replica
    backward skipped after it, is refused at the next step, and nothing changes."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1, "momentum": 0.9},
                   kvstore="local")
    step_once(t, models)
    backward_shards(models, *make_data())
    if dropped_by == "a refused step":
        with pytest.raises(gpukv.ArgumentError, match="batch_size"):
            t.step(0)
    t.zero_grad()
    for m in models:
        m[0].weight.requires_grad_(False)
    backward_shards(models, *make_data())
    before = weights(models)
    with pytest.raises(gpukv.ArgumentError, match=r"'0\.weight' of replica 0.*frozen now"):
        t.step(48)
    assert_unchanged(models, before)
    for m in models:
        m[0].weight.requires_grad_(True)
    t.zero_grad()
    backward_shards(models[:1], *make_data())  # replica 1 skipped
    with pytest.raises(gpukv.ArgumentError, match=r"of replica 1: stale gradient"):
        t.step(48)
    assert_unchanged(models, before)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_a_new_trainer_knows_the_gradients_its_predecessor_stepped(update_on_kvstore):
    """A new Trainer on the same modules (to change the optimizer) takes the gradients a
    step of the old one used as stale: its step with no backward since is refused."""
    models = replicas_of(make_model(), 2)
    first = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    step_once(first, models)
    second = gt.Trainer(models, "adam", {"learning_rate": 0.01}, kvstore="local",
                        update_on_kvstore=update_on_kvstore)
    before = weights(models)
    with pytest.raises(gpukv.ArgumentError, match="stale gradient"):
        second.step(48)
    assert_unchanged(models, before)
    second.zero_grad()
    backward_shards(models, *make_data())
    second.step(48)  # after a backward, the new Trainer steps
    moved = [not torch.equal(p.detach(), q) for p, q in zip(models[0].parameters(), before[0])]
    assert any(moved)


def test_update_applies_a_gradient_replaced_after_allreduce_grads():
    """A .grad replaced by a new tensor between allreduce_grads() and update() (clipping
    out of place) is the gradient update() applies."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   update_on_kvstore=False)
    backward_shards(models, *make_data())
    t.allreduce_grads()
    before = weights(models)
    for m in models:
        for p in m.parameters():
            p.grad = torch.full_like(p, 2.0)
    t.update(1)
    for m, ws in zip(models, before):
        for p, w in zip(m.parameters(), ws):
            torch.testing.assert_close(p.detach(), w - 0.2)


def test_a_failed_allreduce_grads_leaves_no_sums_for_update():
    """allreduce_grads() refused (stale) after an earlier one whose sums zero_grad()
    dropped: the update() that follows checks the gradients again rather than take the
    old sums."""
    models = replicas_of(make_model(), 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   update_on_kvstore=False)
    backward_shards(models, *make_data())
    t.allreduce_grads()
    t.update(48)
    t.zero_grad()
    backward_shards(models[:1], *make_data(24))
    t.allreduce_grads(ignore_stale_grad=True)
    t.zero_grad()
    backward_shards(models[:1], *make_data(24))
    with pytest.raises(gpukv.ArgumentError, match="stale gradient"):
        t.allreduce_grads()
    before = weights(models)
    with pytest.raises(gpukv.ArgumentError, match="stale gradient"):
        t.update(48)
    assert_unchanged(models, before)


def test_a_new_trainer_changes_the_optimizer():
    """To change optimizers, a new Trainer on the same modules: it starts from their
    weights as they are, with a fresh optimizer state, as a Trainer on copies would."""
    models = replicas_of(make_model(), 2)
    first = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                       kvstore="local")
    for _ in range(2):
        step_once(first, models)
    copies = [copy.deepcopy(m) for m in models]
    adam = gt.Trainer(models, "adam", {"learning_rate": 0.01}, kvstore="local")
    reference = gt.Trainer(copies, "adam", {"learning_rate": 0.01}, kvstore="local")
    for _ in range(2):
        step_once(adam, models)
        step_once(reference, copies)
    assert_same_weights(models, copies[0], rtol=0, atol=0)


def backward_means(models, x, y):
    """DDP's habit: each replica's loss is the mean over its shard of the batch."""
    loss_fn = nn.CrossEntropyLoss()
    for model, xs, ys in zip(models, x.chunk(len(models)), y.chunk(len(models))):
        loss_fn(model(xs), ys).backward()


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_step_without_a_batch_size_averages_mean_losses_as_ddp(replicas, update_on_kvstore):
    """step() with mean losses per replica (DDP's convention) gives torch.optim.SGD's
    weights on the whole batch, as step(batch_size) does with sum losses."""
    base = make_model()
    models = replicas_of(base, replicas)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="local", update_on_kvstore=update_on_kvstore)
    x, y = make_data()
    for _ in range(5):
        trainer.zero_grad()
        backward_means(models, x, y)
        if update_on_kvstore:
            trainer.step()
        else:
            trainer.allreduce_grads()
            trainer.update()
    ref = train_torch(copy.deepcopy(base),
                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert_same_weights(models, ref)
    assert trainer.num_replicas == replicas


def test_a_mean_loss_with_a_batch_size_is_not_the_mean():
    """The two conventions differ by the batch per replica: a mean loss given step(batch)
    moves the weights 1/(batch per replica) as far (what the README warns of)."""
    base = make_model()
    sums, means = replicas_of(base, 4), replicas_of(base, 4)
    x, y = make_data()
    t_sum = gt.Trainer(sums, "sgd", {"learning_rate": 0.1}, kvstore="local")
    t_mean = gt.Trainer(means, "sgd", {"learning_rate": 0.1}, kvstore="local")
    backward_shards(sums, x, y)
    backward_means(means, x, y)
    t_sum.step(len(x))
    t_mean.step(len(x))
    moved_sum = (sums[0][0].weight - base[0].weight).abs().sum().item()
    moved_mean = (means[0][0].weight - base[0].weight).abs().sum().item()
    assert moved_mean == pytest.approx(moved_sum / (len(x) // 4), rel=1e-4)


def test_replica_indices_shard_data_with_distributed_sampler():
    """DistributedSampler(num_replicas=trainer.num_replicas, rank=trainer.replica_index(r))
    gives every replica its own share of the data, together all of it."""
    from torch.utils.data import DistributedSampler, TensorDataset
    models = replicas_of(make_model(), 3)
    trainer = gt.Trainer(models, "sgd", kvstore="local")
    data = TensorDataset(torch.arange(30))
    shares = [list(DistributedSampler(data, num_replicas=trainer.num_replicas,
                                      rank=trainer.replica_index(r), shuffle=True, seed=4))
              for r in range(3)]
    assert all(len(s) == 10 for s in shares)
    assert sorted(i for s in shares for i in s) == list(range(30))
    for bad in (3, -1, 1.0, True):
        with pytest.raises(gpukv.ArgumentError, match="replica="):
            trainer.replica_index(bad)


@pytest.mark.parametrize("variable", ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"])
def test_snapshots_of_a_one_process_store_in_a_job_of_several_are_refused(
        tmp_path, monkeypatch, variable):
    """Under `gpukv run -n 2` (or mpiexec, torchrun) a Trainer on a one-process store with
    a checkpoint_dir is refused at construction, naming why, and writes nothing; with
    one process, or without snapshots, it is made."""
    monkeypatch.setenv(variable, "2")
    folder = tmp_path / "ckpt"
    with pytest.raises(gpukv.ArgumentError, match=f"a job of 2 processes \\({variable}=2\\)"
                                                  ".*dist store"):
        gt.Trainer(make_model(), "sgd", kvstore="local", checkpoint_dir=folder)
    assert not folder.exists()
    gt.Trainer(make_model(), "sgd", kvstore="local")
    monkeypatch.setenv(variable, "1")
    gt.Trainer(make_model(), "sgd", kvstore="local", checkpoint_dir=folder)


# ----------------------------------------------------- what a DDP user tries in week one
@pytest.mark.parametrize("on_store", [True, False])
def test_a_trainer_that_fails_to_start_leaves_the_running_one_its_parameters(on_store):
    """A second Trainer refused late in its making (here: the first one's keys already
    in the store) puts every parameter back: the first Trainer goes on training as if
    the second had never been tried."""
    base = make_model()
    models, twins = replicas_of(base, 2), replicas_of(base, 2)
    kv = gpukv.create("local")
    params = {"learning_rate": 0.1, "momentum": 0.9}
    first = gt.Trainer(models, "sgd", params, kvstore=kv, update_on_kvstore=on_store)
    with pytest.raises(gpukv.DuplicateKeyError):
        gt.Trainer(models, "sgd", params, kvstore=kv, update_on_kvstore=on_store)
    twin = gt.Trainer(twins, "sgd", params, kvstore="local", update_on_kvstore=on_store)
    x, y = make_data()
    for trainer, group in ((first, models), (twin, twins)):
        for _ in range(3):
            trainer.zero_grad()
            backward_shards(group, x, y)
            trainer.step(len(x))
    assert_same_weights(models, twins[0], rtol=0, atol=0)
    assert not torch.equal(models[0][0].weight, base[0].weight)


def test_a_trainer_whose_modules_a_newer_one_took_refuses_to_step():
    """A newer Trainer on the same modules holds their parameters: the older one's step
    (which would move nothing) is an ArgumentError saying so."""
    models = replicas_of(make_model(), 2)
    old = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    new = gt.Trainer(models, "adam", {"learning_rate": 0.01}, kvstore="local")
    x, y = make_data()
    backward_shards(models, x, y)
    with pytest.raises(gpukv.ArgumentError, match="taken over by a newer Trainer"):
        old.step(len(x))
    new.step(len(x))


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_a_trainer_part_of_whose_model_a_newer_one_took_refuses_to_step(update_on_kvstore):
    """A newer Trainer made on one layer of the model (a head trained apart) holds that
    layer's parameters: the older Trainer's step is an ArgumentError naming the first
    parameter taken over, and changes nothing; a Trainer made on another model since
    leaves the older one stepping."""
    models = replicas_of(make_model(), 2)
    old = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                     update_on_kvstore=update_on_kvstore)
    gt.Trainer(make_model(1), "sgd", kvstore="local")  # another model: nothing taken
    x, y = make_data()
    old.zero_grad()
    backward_shards(models, x, y)
    old.step(len(x))
    gt.Trainer(models[1][4], "sgd", {"learning_rate": 0.1}, kvstore="local")
    before = [p.detach().clone() for m in models for p in m.parameters()]
    old.zero_grad()
    backward_shards(models, x, y)
    with pytest.raises(gpukv.ArgumentError, match=r"parameter '4\.weight' of replica 1 "
                                                  r".*taken over by a newer Trainer"):
        old.step(len(x))
    assert all(torch.equal(a, b) for a, b in
               zip(before, [p for m in models for p in m.parameters()]))


def test_replicas_that_share_a_parameter_among_themselves_are_refused():
    """Replicas 1 and 2 sharing a layer (replica 0 apart) would train wrong: refused,
    naming both replicas and the parameter."""
    models = replicas_of(make_model(), 3)
    models[2][2] = models[1][2]
    with pytest.raises(gpukv.ArgumentError,
                       match=r"replica 2 shares parameters with replica 1 \('2.weight'\)"):
        gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")


@pytest.mark.parametrize("on_store", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_sparse_embedding_trains_after_model_zero_grad(overlap, on_store):
    """nn.Embedding(sparse=True) with `.grad` set to None by model.zero_grad(): backward
    makes a sparse gradient, which the Trainer takes as its rows (on the store) or, with
    a warning, as its dense sum, and plain SGD steps as torch.optim.SGD does."""
    from gpukv.torch.rows import SparseGradientsMadeDense
    torch.manual_seed(0)
    base = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 1))
    models, reference = replicas_of(base, 2), copy.deepcopy(base)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                             update_on_kvstore=on_store, overlap=overlap)
    dense = [w for w in said if w.category is SparseGradientsMadeDense]
    assert len(dense) == (0 if on_store else 1)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3], [3, 4, 5], [1, 1, 9], [0, 2, 2]])
    for _ in range(3):
        for model in models:
            model.zero_grad()
        for model, part in zip(models, ids.chunk(2)):
            model(part).sum().backward()
        trainer.step(1)
        opt.zero_grad()
        reference(ids).sum().backward()
        opt.step()
    assert_same_weights(models, reference)


@pytest.mark.parametrize("on_store", [True, False])
def test_learning_rate_and_option_changes_hold_with_either_update(on_store):
    """trainer.learning_rate follows the schedule by the Trainer's steps, and an option
    changed on trainer.optimizer counts, whichever optimizer copies do the updates."""
    models = replicas_of(make_model(), 2)
    schedule = gpukv.optim.MultiFactorScheduler(step=[2, 4], factor=0.1, base_lr=0.1)
    trainer = gt.Trainer(models, "sgd", {"lr_scheduler": schedule}, kvstore="local",
                         update_on_kvstore=on_store)
    x, y = make_data()
    seen = []
    for _ in range(5):
        seen.append(trainer.learning_rate)
        trainer.zero_grad()
        backward_shards(models, x, y)
        trainer.step(len(x))
    assert seen == pytest.approx([0.1, 0.1, 0.1, 0.01, 0.01])  # (MXNet: past step 2, 4)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         update_on_kvstore=on_store)
    trainer.optimizer.set_learning_rate(0.0)  # on the optimizer, not the Trainer
    before = [p.detach().clone() for p in models[0].parameters()]
    trainer.zero_grad()
    backward_shards(models, x, y)
    trainer.step(len(x))
    assert all(torch.equal(a, b) for a, b in zip(before, models[0].parameters()))


def test_a_multiplier_naming_no_parameter_is_refused():
    """A multiplier under a name no parameter has (a typo, DDP's 'module.' prefix,
    torch.compile's '_orig_mod.') would do nothing: refused at the step, naming it."""
    models = replicas_of(make_model(), 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    trainer.optimizer.set_lr_mult({"module.0.weight": 0.5})
    x, y = make_data()
    backward_shards(models, x, y)
    before = [p.detach().clone() for p in models[0].parameters()]
    with pytest.raises(gpukv.ArgumentError, match="'module.0.weight' names no parameter"):
        trainer.step(len(x))
    assert all(torch.equal(a, b) for a, b in zip(before, models[0].parameters()))


@pytest.mark.parametrize("bad", ["no", None, 1])
def test_ignore_stale_grad_is_a_bool(bad):
    models = replicas_of(make_model(), 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    with pytest.raises(gpukv.ArgumentKindError, match="ignore_stale_grad: expected True or"):
        trainer.step(8, ignore_stale_grad=bad)


def test_a_parameter_added_after_the_trainer_is_refused_at_the_step():
    """A layer added to the replicas after the Trainer was made has no key: the step is
    an ArgumentError saying so, before anything changes, not a layer left untrained."""
    models = replicas_of(make_model(), 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    for model in models:
        model.append(nn.Linear(3, 3))
    x, y = make_data()
    backward_shards(models, x, y)
    before = [p.detach().clone() for p in models[0].parameters()]
    with pytest.raises(gpukv.ArgumentError, match="parameter '5.weight' of replica 0 is not "
                                                  "one the Trainer was made with"):
        trainer.step(len(x))
    assert all(torch.equal(a, b) for a, b in zip(before, models[0].parameters()))


def test_a_layer_replaced_after_the_trainer_is_named_at_the_step():
    """load_state_dict(assign=True) replaces the Parameter objects the Trainer holds: the
    step names the first new one, rather than calling the old ones' gradients stale."""
    models = replicas_of(make_model(), 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    fresh = make_model(seed=3)
    for model in models:
        model.load_state_dict(fresh.state_dict(), assign=True)
    x, y = make_data()
    backward_shards(models, x, y)
    with pytest.raises(gpukv.ArgumentError, match="parameter '0.weight' of replica 0 is not "
                                                  "one the Trainer was made with"):
        trainer.step(len(x))


@pytest.mark.parametrize("overlap", [False, True])
def test_zero_grad_set_to_none_trains_as_torch(overlap):
    """trainer.zero_grad(set_to_none=True), torch.optim's spelling: every .grad is None
    after it, and the training gives torch.optim.SGD's weights."""
    base = make_model()
    models, reference = replicas_of(base, 2), copy.deepcopy(base)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                         kvstore="local", update_on_kvstore=False, overlap=overlap)
    x, y = make_data()
    for _ in range(3):
        trainer.zero_grad(set_to_none=True)
        assert all(p.grad is None for m in models for p in m.parameters())
        backward_shards(models, x, y)
        trainer.step(len(x))
    with pytest.raises(gpukv.ArgumentKindError, match="set_to_none: expected True or False"):
        trainer.zero_grad(set_to_none="yes")
    train_torch(reference, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), steps=3)
    assert_same_weights(models, reference)


def test_buffers_start_as_replica_0s():
    """Replicas built apart (spectral_norm's random vectors; running statistics loaded
    into replica 0 alone) hold replica 0's buffers once the Trainer is made, as DDP's
    constructor gives every rank rank 0's."""
    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.utils.spectral_norm(nn.Linear(6, 8)), nn.BatchNorm1d(8),
                             nn.Linear(8, 3))
    models = [build(seed) for seed in range(3)]
    with torch.no_grad():
        models[0][1].running_mean.fill_(0.5)
    gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    for model in models[1:]:
        for (name, mine), theirs in zip(model.named_buffers(), models[0].buffers()):
            assert torch.equal(mine, theirs), name


@pytest.mark.parametrize("how", ["double", "channels_last", "data"])
def test_a_parameter_given_new_memory_after_the_trainer_is_refused(how):
    """model.double(), a memory format set, or a `.data` assigned after the Trainer was
    made leave the parameter outside the buffers the steps update: the step is an
    ArgumentError naming it (before, nothing trained any more, silently), nothing
    changes."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    models = replicas_of(base, 2)
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    convert = {"double": lambda m: m.double(),
               "channels_last": lambda m: m.to(memory_format=torch.channels_last),
               "data": lambda m: setattr(m[2].bias, "data", m[2].bias.data.clone())}[how]
    for m in models:
        convert(m)
    dtype = next(models[0].parameters()).dtype
    for m in models:
        m(torch.ones(2, 3, 6, 6, dtype=dtype)).sum().backward()
    before = weights(models)
    name = "2.bias" if how == "data" else "0.weight"
    with pytest.raises(gpukv.ArgumentError, match=rf"'{name}' of replica 0 no longer holds "
                                                  rf"the weights the Trainer updates"):
        t.step(4)
    assert_unchanged(models, before)


def test_a_multiplier_on_a_tied_name_says_which_name_to_use():
    """An output layer tied to the embedding is one parameter under two names: a
    multiplier set on the second is an ArgumentError naming the first."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return self.out(self.emb(ids)).sum()
    models = [Tied(), Tied()]
    t = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    for m in models:
        m(torch.tensor([1, 2])).backward()
    t.optimizer.set_lr_mult({"out.weight": 0.5})
    with pytest.raises(gpukv.ArgumentError, match=r"'out.weight' is parameter 'emb.weight' "
                                                  r"under a second name.*name it 'emb.weight'"):
        t.step(2)


def test_modules_without_a_trainable_parameter_are_refused():
    model = make_model().requires_grad_(False)
    with pytest.raises(gpukv.ArgumentError, match="no trainable parameter"):
        gt.Trainer([model], "sgd", kvstore="local")


def test_a_second_trainer_on_one_store_says_to_give_it_its_own():
    """Two Trainers (a GAN's two models) on one store object: the second is a
    DuplicateKeyError saying to give each Trainer a store of its own."""
    kv = gpukv.create("local")
    gt.Trainer([make_model()], "sgd", kvstore=kv)
    with pytest.raises(gpukv.DuplicateKeyError, match="give each Trainer a store of its own"):
        gt.Trainer([make_model(1)], "sgd", kvstore=kv)


def _zeroings(models, trainer):
    """Ways a program drops the gradients a step left (each before its backward)."""
    def in_place():
        for m in models:
            for p in m.parameters():
                p.grad.zero_()
    return {"trainer": lambda: trainer.zero_grad(),
            "set_to_none": lambda: [m.zero_grad() for m in models],
            "in_place": in_place}


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("bucket_bytes", [gt.BUCKET_BYTES, 0])
def test_a_backward_onto_the_sums_a_step_left_is_refused(split, bucket_bytes):
    """update_on_kvstore=False leaves the replicas' sum in every .grad (gluon's): a
    backward adding to it without a zero_grad, and a step (or allreduce_grads) would sum
    the sums again. It is an ArgumentError naming a parameter and its replica, before
    anything changes; after a zero_grad, the step is taken and the weights are plain
    torch's. Every way of zeroing first is taken as it is."""
    base = make_model()
    models = replicas_of(base, 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         update_on_kvstore=False, bucket_bytes=bucket_bytes)
    zeroings = _zeroings(models, trainer)
    x, y = make_data()

    def take_step():
        if split:
            trainer.allreduce_grads()
            trainer.update(len(x))
        else:
            trainer.step(len(x))

    steps = 0
    for zeroing in ("trainer", None, "set_to_none", None, "in_place"):
        if zeroing is not None:
            zeroings[zeroing]()
        backward_shards(models, x, y)
        if zeroing is None:  # the gradients of the step before, and this backward's
            before = [p.detach().clone() for m in models for p in m.parameters()]
            with pytest.raises(gpukv.ArgumentError,
                               match=r"parameter '.*' of replica \d: backward added its "
                                     r"gradient to the sum"):
                take_step()
            assert all(torch.equal(a, b) for a, b in
                       zip(before, [p for m in models for p in m.parameters()]))
            continue
        take_step()
        steps += 1
    ref = train_torch(copy.deepcopy(base), lambda p: torch.optim.SGD(p, lr=0.1), steps=steps)
    assert_same_weights(models, ref)


def test_gradients_added_to_across_steps_with_the_optimizer_on_the_store_are_torchs():
    """update_on_kvstore=True leaves each replica's own gradient in .grad: backward adding
    to it across steps (no zero_grad) sums as plain torch does, and is taken."""
    base = make_model()
    models = replicas_of(base, 2)
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = make_data()
    trainer.zero_grad()
    opt.zero_grad()
    for _ in range(3):
        backward_shards(models, x, y)
        trainer.step(len(x))
        nn.CrossEntropyLoss()(ref(x), y).backward()
        opt.step()
    assert_same_weights(models, ref)


# ------------------------------------------------------- one optimizer, one Trainer
@pytest.mark.parametrize("runs_it", ["trainer", "store"])
@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_an_optimizer_another_trainer_or_store_runs_is_refused(runs_it, update_on_kvstore):
    """A Trainer given the optimizer a live Trainer (or store) runs is an ArgumentError
    saying what to do, before it touches its modules; with a copy it trains beside the
    first, whose weights and counts are those it has beside a Trainer of its own."""
    def adam():
        return gpukv.optim.create("adam", learning_rate=0.1)

    def train(share):
        a, b = make_model(0), make_model(1)
        opt = adam()
        ta = gt.Trainer(a, opt, kvstore="local", update_on_kvstore=update_on_kvstore)
        given, kv = opt, None
        if runs_it == "store":
            given, kv = adam(), gpukv.create("local")
            kv.set_optimizer(given)
        if share:
            before = weights([b])
            with pytest.raises(gpukv.ArgumentError,
                               match=r"optimizer 'adam': a 'local' store of this process "
                                     r".* runs this optimizer object already.*"
                                     r"copy\.deepcopy\(optimizer\)"):
                gt.Trainer(b, given, kvstore="local", update_on_kvstore=update_on_kvstore)
            assert_unchanged([b], before)
            given = copy.deepcopy(given)
        else:
            given = adam()
        tb = gt.Trainer(b, given, kvstore="local", update_on_kvstore=update_on_kvstore)
        x, y = make_data()
        for _ in range(3):
            step_once(ta, [a], x, y)
            step_once(tb, [b], x, y)
        return a, dict(opt.update_counts)

    apart, counts = train(share=False)
    refused, refused_counts = train(share=True)
    assert_same_weights([refused], apart, rtol=0, atol=0)
    assert refused_counts == counts
    assert set(counts.values()) == ({3} if update_on_kvstore else set())  # (else copies')


def test_a_trainer_made_again_on_its_modules_takes_its_optimizer_over():
    """A Trainer made again on the same modules with the same optimizer takes it over
    from the live one; the store a program set it on takes it too; and a Trainer of
    other modules is still refused it, the older one closed or not."""
    models = replicas_of(make_model(), 2)
    opt = gpukv.optim.create("adam", learning_rate=0.01)
    old = gt.Trainer(models, opt, kvstore="local")
    step_once(old, models)
    new = gt.Trainer(models, opt, kvstore="local")
    step_once(new, models)
    assert set(dict(opt.update_counts).values()) == {2}
    old.close()
    with pytest.raises(gpukv.ArgumentError, match="runs this optimizer object already"):
        gt.Trainer(make_model(1), opt, kvstore="local")
    kv = gpukv.create("local")
    other = gpukv.optim.create("sgd", learning_rate=0.1)
    kv.set_optimizer(other)
    third = make_model(2)
    step_once(gt.Trainer(third, other, kvstore=kv), [third])


@pytest.mark.parametrize("how", ["closed", "with", "dropped"])
def test_a_trainer_closed_or_dropped_frees_its_optimizer(how):
    """The optimizer of a Trainer closed (or left by its `with` block) or dropped goes
    to another Trainer; a closed one stepped again while the other holds it is refused,
    changing nothing."""
    first = replicas_of(make_model(), 2)
    opt = gpukv.optim.create("sgd", learning_rate=0.1)
    trainer = gt.Trainer(first, opt, kvstore="local")
    if how == "with":
        with trainer:
            step_once(trainer, first)
    elif how == "closed":
        trainer.close()
    else:
        del trainer
    second = make_model(1)
    taker = gt.Trainer(second, opt, kvstore="local")
    step_once(taker, [second])
    if how == "dropped":
        return
    before = weights(first)
    with pytest.raises(gpukv.ArgumentError, match="runs this optimizer object already"):
        step_once(trainer, first)
    assert_unchanged(first, before)

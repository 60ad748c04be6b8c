"""gpukv.torch.Trainer(overlap=True): gradient reductions started from backward's hooks."""
import contextlib
import copy
import threading

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import gpukv  # noqa: E402
import gpukv.torch as gt  # noqa: E402

from .bfloat16 import needs_bfloat16  # noqa: E402
from .test_torch_trainer import backward_shards, make_data, make_model  # noqa: E402

WORKER = "gpukv-reduce"
SGD = ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3})
ADAM = ("adam", {"learning_rate": 0.01})


def record_pushes(store):
    """The names of the threads that push to `store`, in order."""
    names = []
    push = store.push
    store.push = lambda *a, **k: names.append(threading.current_thread().name) or push(*a, **k)
    return names


def train(overlap, update_on_kvstore=True, optimizer=SGD, replicas=3, steps=4, passes=1,
          no_sync=False, set_to_none=False, bucket_bytes=256, model=None, compression=None,
          **step_kw):
    """Weights of replica 0 after `steps` steps, the trainer, and its models.
    `compression`: set on the Trainer's store (a 'device' one) after it was made."""
    models = [copy.deepcopy(model or make_model()) for _ in range(replicas)]
    trainer = gt.Trainer(models, optimizer[0], dict(optimizer[1]),
                         kvstore="local" if compression is None else "device",
                         update_on_kvstore=update_on_kvstore, bucket_bytes=bucket_bytes,
                         overlap=overlap)
    if compression is not None:
        trainer.kvstore.set_gradient_compression(compression)
    x, y = make_data()
    for _ in range(steps):
        if set_to_none:
            for m in models:
                m.zero_grad(set_to_none=True)
        else:
            trainer.zero_grad()
        for k in range(passes):
            last = k == passes - 1
            with trainer.no_sync() if no_sync and not last else contextlib.nullcontext():
                backward_shards(models, x, y)
        trainer.step(len(x) * passes, **step_kw)
    return [p.detach().clone() for p in models[0].parameters()], trainer, models


def assert_equal(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("bucket_bytes", [gt.BUCKET_BYTES, 256, 0])
@pytest.mark.parametrize("replicas", [1, 3])
def test_overlap_gives_the_same_weights(update_on_kvstore, optimizer, bucket_bytes, replicas):
    kw = dict(update_on_kvstore=update_on_kvstore, optimizer=optimizer,
              bucket_bytes=bucket_bytes, replicas=replicas)
    want, _, _ = train(False, **kw)
    got, trainer, _ = train(True, **kw)
    assert trainer.overlap
    assert_equal(got, want)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_every_bucket_is_reduced_during_backward(update_on_kvstore):
    """The reducing store sees one push per bucket per step, each from the background
    thread; with update_on_kvstore the store itself sees one push per step, at the step."""
    models = [copy.deepcopy(make_model()) for _ in range(3)]
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         update_on_kvstore=update_on_kvstore, bucket_bytes=256, overlap=True)
    assert len(trainer.keys) > 2
    reducing = trainer.kvstore if not update_on_kvstore else trainer._update.sums
    early = record_pushes(reducing)
    on_store = record_pushes(trainer.kvstore) if update_on_kvstore else []
    x, y = make_data()
    for step in range(3):
        trainer.zero_grad()
        backward_shards(models, x, y)
        trainer.step(len(x))
        assert early == [WORKER + "_0"] * (len(trainer.keys) * (step + 1)), early
    if update_on_kvstore:
        assert on_store == [threading.current_thread().name] * 3


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("no_sync", [False, True])
def test_gradient_accumulation(update_on_kvstore, no_sync):
    """Two backward passes per step: the same weights as without overlap; outside no_sync
    the second pass makes the first's reductions stale (reduced again at the step),
    inside it every bucket is reduced once."""
    kw = dict(update_on_kvstore=update_on_kvstore, passes=2, no_sync=no_sync)
    want, _, _ = train(False, **kw)
    got, trainer, models = train(True, **kw)
    assert_equal(got, want)
    reducing = trainer.kvstore if not update_on_kvstore else trainer._update.sums
    pushes = record_pushes(reducing)
    x, y = make_data()
    trainer.zero_grad()
    with trainer.no_sync() if no_sync else contextlib.nullcontext():
        backward_shards(models, x, y)
    # the first pass's reductions have read their gradients before the second pass
    # changes them (else, on a slow machine, they read the final ones and are not stale)
    trainer._early._worker.submit(lambda: None).result()
    backward_shards(models, x, y)
    trainer.step(2 * len(x))
    early = [WORKER + "_0"] * len(trainer.keys)
    if no_sync:
        assert pushes == early
    else:  # started by the first pass, all of them again (in one call) at the step
        assert pushes == early + [threading.current_thread().name], pushes


def test_gradients_set_to_none_between_steps():
    """model.zero_grad() (set_to_none) instead of trainer.zero_grad(): the hooks adopt
    the new gradient tensors into the buckets."""
    want, _, _ = train(False, set_to_none=True)
    got, trainer, models = train(True, set_to_none=True)
    assert_equal(got, want)
    for p, view in zip(models[1].parameters(),
                       [v for b in trainer._buckets for v in b.views[1]]):
        assert p.grad is view


def test_a_parameter_backward_does_not_reach():
    """A layer left out of the forward pass: its bucket never completes, and neither do
    the ones after it in order; the step reduces those itself (ignore_stale_grad)."""
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = make_model()
            self.unused = nn.Linear(3, 3)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    model = Skips()
    for bucket_bytes in (256, 0):
        kw = dict(model=model, bucket_bytes=bucket_bytes, ignore_stale_grad=True)
        want, _, _ = train(False, **kw)
        got, trainer, _ = train(True, **kw)
        assert_equal(got, want)


def test_an_early_reduction_that_fails_is_raised_by_the_step():
    """The error of a reduction on the background thread comes out of step(), which
    then changes nothing; the next step trains as if it never happened."""
    models = [copy.deepcopy(make_model()) for _ in range(2)]
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         update_on_kvstore=False, bucket_bytes=256, overlap=True)
    push = trainer.kvstore.push
    failures = [gpukv.PeerError("a peer is gone")]

    def failing_push(*a, **k):
        if failures and threading.current_thread().name.startswith(WORKER):
            raise failures.pop()
        return push(*a, **k)
    trainer.kvstore.push = failing_push
    before = [p.detach().clone() for p in models[0].parameters()]
    x, y = make_data()
    trainer.zero_grad()
    backward_shards(models, x, y)
    with pytest.raises(gpukv.PeerError, match="a peer is gone"):
        trainer.step(len(x))
    assert_equal([p.detach() for p in models[0].parameters()], before)
    trainer.step(len(x))  # every bucket reduced at the step this time
    reference = [copy.deepcopy(make_model()) for _ in range(2)]
    ref = gt.Trainer(reference, "sgd", {"learning_rate": 0.1}, kvstore="local",
                     update_on_kvstore=False, overlap=False)
    ref.zero_grad()
    backward_shards(reference, x, y)
    ref.step(len(x))
    assert_equal([p.detach() for p in models[0].parameters()],
                 [p.detach() for p in reference[0].parameters()])


def test_zero_grad_drops_the_reductions_started():
    """backward, zero_grad, backward, step: the first pass's reductions are waited for
    and forgotten; the weights are those of one pass."""
    want, _, _ = train(False, steps=1)
    models = [copy.deepcopy(make_model()) for _ in range(3)]
    trainer = gt.Trainer(models, SGD[0], dict(SGD[1]), kvstore="local",
                         bucket_bytes=256, overlap=True)
    x, y = make_data()
    backward_shards(models, x, y)
    trainer.zero_grad()
    backward_shards(models, x, y)
    trainer.step(len(x))
    assert_equal([p.detach().clone() for p in models[0].parameters()], want)


def test_a_new_trainer_takes_the_hooks_over():
    """A second Trainer on the same modules: the first one's hooks start nothing more."""
    models = [copy.deepcopy(make_model()) for _ in range(2)]
    first = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                       update_on_kvstore=False, overlap=True)
    old = record_pushes(first.kvstore)
    for overlap in (False, True):
        second = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                            update_on_kvstore=False, overlap=overlap)
        new = record_pushes(second.kvstore)
        x, y = make_data()
        second.zero_grad()
        backward_shards(models, x, y)
        second.step(len(x))
        assert old == [] and len(new) == 1, (old, new)
        assert new[0].startswith(WORKER) == overlap


def test_overlap_option():
    models = [copy.deepcopy(make_model()) for _ in range(2)]
    for update_on_kvstore in (True, False):  # CPU replicas of one process: off
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                             update_on_kvstore=update_on_kvstore)
        assert not trainer.overlap
        with trainer.no_sync():  # nothing to do, but allowed
            pass
    with pytest.raises(gpukv.ArgumentKindError, match="overlap: expected True or False"):
        gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local", overlap="yes")


TWO_BIT = {"type": "2bit", "threshold": 0.5}


def test_overlap_with_compression_on_the_store_is_refused_for_several_replicas():
    """With the optimizer on the store, an early reduction pushes the replicas' sum,
    where a compressor takes each replica's gradient with its own residual; a lone
    replica's sum is its gradient, so one replica per process may overlap."""
    models = [copy.deepcopy(make_model()) for _ in range(2)]
    with pytest.raises(gpukv.ArgumentError, match="with several replicas in a process and "
                                                  "compression"):
        gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="device", overlap=True,
                   compression_params=TWO_BIT)
    alone = gt.Trainer(models[:1], "sgd", {"learning_rate": 0.1}, kvstore="device",
                       overlap=True, compression_params=TWO_BIT)
    assert alone.overlap


@pytest.mark.parametrize("dtype", [torch.float16,
                                   pytest.param(torch.bfloat16, marks=needs_bfloat16)])
def test_16_bit_replicas_sum_in_float32_with_the_store_updating_whatever_the_overlap(dtype):
    """With the optimizer on the store, the store sums 16-bit replicas' gradients in
    float32: an early reduction would sum them in their own dtype first (2 x 40000 is inf
    in float16, and rounded in bfloat16). So overlap stays off for them, and
    overlap=True is refused; update_on_kvstore=False overlaps, pushing each replica's
    gradient, with the same result as without the overlap."""
    def replicas():
        made = [torch.nn.Linear(4, 1, bias=False).to(dtype) for _ in range(2)]
        for m in made:
            torch.nn.init.ones_(m.weight)
        return made

    def step(models, trainer):
        trainer.zero_grad()
        for m in models:
            m(torch.full((1, 4), 40000.0, dtype=dtype)).sum().backward()
        trainer.step()
        return models[0].weight.detach().float()

    models = replicas()
    with pytest.raises(gpukv.ArgumentError, match="float16/bfloat16 parameters"):
        gt.Trainer(models, "sgd", {"learning_rate": 1e-6}, kvstore="device", overlap=True)
    default = gt.Trainer(models, "sgd", {"learning_rate": 1e-6}, kvstore="device")
    assert not default.overlap
    expected = torch.tensor(1 - 1e-6 * 40000.0, dtype=dtype).float()  # the mean, 40000
    torch.testing.assert_close(step(models, default), expected.expand(1, 4))
    results = []
    for overlap in (False, True):
        models = replicas()
        on_replicas = gt.Trainer(models, "sgd", {"learning_rate": 1e-6}, kvstore="device",
                                 update_on_kvstore=False, overlap=overlap)
        assert on_replicas.overlap == overlap
        results.append(step(models, on_replicas))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_overlap_keeps_each_replicas_gradient_for_compression(update_on_kvstore):
    """Compression set on the store after the Trainer was made, overlap on: the weights of
    the same steps without the overlap (each replica's gradient compressed alone)."""
    kw = dict(update_on_kvstore=update_on_kvstore, optimizer=("sgd", {"learning_rate": 1.0}),
              compression=TWO_BIT)
    want, _, _ = train(False, **kw)
    got, trainer, _ = train(True, **kw)
    assert trainer.overlap
    assert_equal(got, want)


@pytest.mark.parametrize("update_on_kvstore, replicas, expected", [
    (True, 1, False),   # the store's round waits for the step: nothing starts early
    (True, 2, True),    # the sum of this process's replicas starts early
    (False, 1, True),   # the store's sums start early
    (False, 2, True)])
def test_overlap_by_default_on_gpus_where_it_starts_work_early(
        monkeypatch, update_on_kvstore, replicas, expected):
    """overlap=None on GPU replicas: on, unless the store runs the optimizer for a process
    of one replica (`torchrun`'s layout)."""
    from gpukv.torch import trainer as trainer_module
    monkeypatch.setattr(trainer_module, "_on_gpus", lambda buckets: True)
    models = [copy.deepcopy(make_model()) for _ in range(replicas)]
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         update_on_kvstore=update_on_kvstore)
    assert trainer.overlap == expected


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("change", ["clip", "replace", "data", "numpy"])
def test_gradients_changed_between_backward_and_step(update_on_kvstore, change):
    """Clipping each replica's gradients in place, assigning new .grad tensors, or
    writing through `.data` or NumPy (which PyTorch's version counters do not see), after
    backward: the reductions started from backward are stale, and the step reduces the
    changed gradients (the same weights as without overlap)."""
    weights = {}
    for overlap in (False, True):
        models = [copy.deepcopy(make_model()) for _ in range(3)]
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                             update_on_kvstore=update_on_kvstore, bucket_bytes=256,
                             overlap=overlap)
        x, y = make_data()
        for _ in range(3):
            trainer.zero_grad()
            backward_shards(models, x, y)
            for m in models:
                if change == "clip":
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                for p in m.parameters():
                    if change == "replace":
                        p.grad = p.grad * 0.5
                    elif change == "data":
                        p.grad.data.mul_(0.5)
                    elif change == "numpy":
                        p.grad.numpy()[...] *= 0.5
            trainer.step(len(x))
        weights[overlap] = [p.detach().clone() for p in models[0].parameters()]
    assert_equal(weights[True], weights[False])


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_a_gradient_penalty_through_grad_trains_as_without_the_overlap(update_on_kvstore):
    """backward(create_graph=True) leaves a `.grad` with a graph, which the program
    differentiates again (a penalty on the gradient's norm): the overlap leaves it as it
    is (the step takes it then), so the penalty counts as without the overlap."""
    x, y = make_data()
    results = []
    for overlap in (False, True):
        models = [copy.deepcopy(make_model()) for _ in range(2)]
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                             update_on_kvstore=update_on_kvstore, overlap=overlap)
        for _ in range(3):
            trainer.zero_grad(set_to_none=True)
            for model, xs, ys in zip(models, x.chunk(2), y.chunk(2)):
                params = list(model.parameters())
                nn.functional.cross_entropy(model(xs), ys).backward(create_graph=True,
                                                                    inputs=params)
                penalty = sum((p.grad ** 2).sum() for p in params)
                assert penalty.requires_grad
                (0.5 * penalty).backward(inputs=params)
            trainer.step(len(x))
        results.append([p.detach().clone() for p in models[0].parameters()])
    assert_equal(results[1], results[0])


class Skipping(nn.Module):
    """Its middle layer `b` left out of the forward pass when `use_b` is False."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.use_b = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b(h)) if self.use_b else h)


@pytest.mark.parametrize("bucket_bytes", [0, gt.BUCKET_BYTES])
def test_a_step_of_several_workers_pushes_the_buckets_left_before_agreeing(bucket_bytes):
    """With the early reductions pushing to a store of several workers (one here that
    says it has two), a step pushes every bucket no early reduction started (b's,
    whose forward pass left it out, and those after it in order), each once and in
    order, before any agreement (the buckets some worker steps, those to reduce again):
    another worker, whose early reductions pushed them all, is still in those pushes.
    b used in the next step starts its reduction again; the weights are those of
    overlap=False."""
    weights, orders = {}, {}
    x, y = make_data()
    for overlap in (False, True):
        models = [Skipping() for _ in range(2)]
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                             kvstore="local", update_on_kvstore=False,
                             bucket_bytes=bucket_bytes, overlap=overlap)
        store = trainer.kvstore
        store.__class__ = type("TwoWorkers", (type(store),),
                               {"num_workers": property(lambda self: 2)})
        calls = []  # (background thread?, call, key)
        push, workers_max = store.push, store.workers_max
        store.push = lambda key, *a, **k: calls.append(
            (threading.current_thread().name.startswith(WORKER), "push", key)) or push(
            key, *a, **k)
        store.workers_max = lambda values, what: calls.append(
            (False, "max", what)) or workers_max(values, what)
        for step in range(3):
            for m in models:
                m.use_b = step != 1
            trainer.zero_grad()
            calls.clear()
            backward_shards(models, x, y)
            trainer.step(len(x), ignore_stale_grad=True)
            orders[overlap, step] = calls[:]
        weights[overlap] = [p.detach().clone() for p in models[0].parameters()]
    assert_equal(weights[True], weights[False])
    keys = list(reversed(trainer.keys))  # the order reductions start in
    b_first = next(i for i, k in enumerate(keys)
                   if any(n.startswith("b.") for n in trainer.buckets[k]))
    for step, early_ones in ((0, len(keys)), (1, b_first), (2, len(keys))):
        calls = orders[True, step]
        pushed = [(early, k) for early, call, k in calls if call == "push"]
        assert [k for _, k in pushed] == keys, (step, calls)
        assert [early for early, _ in pushed] == [i < early_ones for i in range(len(keys))]
        # (then the two agreements: the buckets some worker steps, those to reduce again)
        assert [call for _, call, _ in calls][len(keys):] == ["max", "max"], (step, calls)

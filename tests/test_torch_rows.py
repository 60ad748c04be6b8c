"""gpukv.torch.Trainer with nn.Embedding(sparse=True): a step pushes the rows backward
touched, and the store's optimizer updates those rows only (its lazy_update), as gluon's
Trainer does with Embedding(sparse_grad=True); where it cannot, the rows go dense, with a
warning."""
import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import gpukv  # noqa: E402
import gpukv.torch as gt  # noqa: E402
from gpukv.torch.rows import SparseGradientsMadeDense  # noqa: E402

from .bfloat16 import needs_bfloat16  # noqa: E402

VOCAB, DIM = 12, 4


class Bag(nn.Module):
    """An embedding table (sparse gradients unless `dense`) and a linear layer on it."""

    def __init__(self, dense: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=not dense)
        self.out = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.out(self.emb(ids)).sum()


def replicas(n=2, dense=False):
    torch.manual_seed(0)
    base = Bag(dense)
    return [copy.deepcopy(base) for _ in range(n)]


def backward(models, batches):
    for model, ids in zip(models, batches):
        model(torch.tensor(ids)).backward()


def table(model) -> np.ndarray:
    return model.emb.weight.detach().numpy().copy()


OPTIMIZERS = [("sgd", {"learning_rate": 0.1, "momentum": 0.9}),
              ("sgd", {"learning_rate": 0.1, "wd": 0.1}),
              ("adam", {"learning_rate": 0.1}),
              ("adagrad", {"learning_rate": 0.1})]


@pytest.mark.parametrize("kvstore", ["local", "device"])
@pytest.mark.parametrize("optimizer,options", OPTIMIZERS)
def test_a_step_updates_the_rows_the_batches_touched_only(kvstore, optimizer, options):
    """Rows no replica's batch touched stay as they are, momentum, weight decay and
    Adam's moments notwithstanding, and the rows touched are what the store's lazy rule
    makes of each replica's rows pushed as RowSparse."""
    models = replicas()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SparseGradientsMadeDense)
        trainer = gt.Trainer(models, optimizer, dict(options), kvstore=kvstore)
    reference = gpukv.create("local")
    reference.init("w", table(models[0]))
    reference.set_optimizer(gpukv.optim.create(optimizer, **options))
    for batches in ([[1, 2, 2], [2, 3]], [[7], [7, 8]], [[7], [8]]):
        trainer.zero_grad()
        before = table(models[0])
        backward(models, batches)
        grads = [m.emb.weight.grad.detach().numpy() for m in models]
        trainer.step(1)
        reference.push("w", [gpukv.RowSparse(np.unique(ids), g[np.unique(ids)], (VOCAB, DIM))
                             for ids, g in zip(batches, grads)])
        expected = np.empty((VOCAB, DIM), np.float32)
        reference.pull("w", out=expected)
        touched = sorted({i for ids in batches for i in ids})
        others = [r for r in range(VOCAB) if r not in touched]
        for model in models:
            np.testing.assert_array_equal(table(model)[others], before[others])
            np.testing.assert_array_equal(table(model), expected)


def test_without_lazy_updates_every_row_moves_as_with_dense_gradients():
    """With lazy_update=False the store's standard rule updates every row, the rows no
    batch touched with a zero gradient: the same weights as the dense Embedding's."""
    options = {"learning_rate": 0.1, "momentum": 0.9, "lazy_update": False}
    sparse, dense = replicas(), replicas(dense=True)
    trainers = [gt.Trainer(ms, "sgd", dict(options), kvstore="local") for ms in (sparse, dense)]
    for batches in ([[1, 2], [2, 3]], [[7], [8]]):
        for trainer, models in zip(trainers, (sparse, dense)):
            trainer.zero_grad()
            backward(models, batches)
            trainer.step(1)
    np.testing.assert_allclose(table(sparse[0]), table(dense[0]), rtol=1e-6, atol=1e-7)
    assert not np.array_equal(table(sparse[0])[1], table(replicas()[0])[1])


@pytest.mark.parametrize("kvstore", ["local", "device"])
def test_a_float16_table_under_multi_precision_sgd_moves_every_row(kvstore):
    """SGD with multi_precision updates every row of a float16 table, as MXNet's
    multi-precision SGD (which has no row-sparse form) does: the rows no batch touched
    move too (momentum, weight decay), and every replica holds the store's weights, the
    bits of lazy_update=False."""
    options = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1, "multi_precision": True}
    tables = []
    for lazy in (True, False):
        models = [m.to(torch.float16) for m in replicas()]
        first = table(models[0])
        kv = gpukv.create(kvstore)
        trainer = gt.Trainer(models, "sgd", dict(options, lazy_update=lazy), kvstore=kv)
        for batches in ([[1, 2], [2, 3]], [[7], [8]]):
            trainer.zero_grad()
            backward(models, batches)
            trainer.step(1)
        stored = np.empty((VOCAB, DIM), np.float16)
        kv.pull("emb.weight", out=stored)
        tables.append([table(m) for m in models] + [stored])
    untouched = [r for r in range(VOCAB) if r not in (1, 2, 3, 7, 8)]
    assert (tables[0][0][untouched] != first[untouched]).any(axis=1).all()
    for lazy, standard in zip(*tables):
        np.testing.assert_array_equal(lazy, standard)


def test_the_overlap_sums_the_rows_as_the_step_does():
    """With overlap the replicas' gradients are summed during backward; the step pushes
    the rows of the sum any replica touched: the weights of the Trainer without it."""
    options = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1}
    results = []
    for overlap in (False, True):
        models = replicas()
        trainer = gt.Trainer(models, "sgd", dict(options), kvstore="local", overlap=overlap)
        assert trainer.overlap == overlap
        for batches in ([[1, 2], [2, 3]], [[7], [8]], [[7], [8]]):
            trainer.zero_grad()
            backward(models, batches)
            trainer.step(1)
        trainer.zero_grad()  # gradients of row 4 that cancel in the sum: still pushed
        models[0](torch.tensor([4])).backward()
        (-models[1](torch.tensor([4]))).backward()
        trainer.step(1)
        results.append(table(models[0]))
        assert np.array_equal(results[-1][5], table(replicas()[0])[5])  # untouched
        assert not np.array_equal(results[-1][4], table(replicas()[0])[4])  # decayed
    np.testing.assert_array_equal(results[0], results[1])


def test_zero_grad_forgets_the_rows_of_the_gradients_it_drops():
    """A backward whose gradients zero_grad dropped leaves its rows out of the step."""
    models = replicas()
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1}, kvstore="local")
    before = table(models[0])
    backward(models, [[1], [1]])
    trainer.zero_grad()
    backward(models, [[4], [5]])
    trainer.step(1)
    np.testing.assert_array_equal(table(models[0])[1], before[1])
    assert not np.array_equal(table(models[0])[4], before[4])


def _grads_of_the_table(models) -> list:
    return [m.emb.weight.grad for m in models]


def _add_to_row_5(models):
    with torch.no_grad():
        for grad in _grads_of_the_table(models):
            grad[5] += 1.0


def _scale(models):
    with torch.no_grad():
        for grad in _grads_of_the_table(models):
            grad.mul_(0.5)


def _clip(models):
    for model in models:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def _dense_backward(models):
    for model, ids in zip(models, ([6], [7])):
        model.out(nn.functional.embedding(torch.tensor(ids), model.emb.weight)).sum().backward()


#: what a program may do to the gradients between backward and the Trainer's zero_grad
BETWEEN = {"nothing": lambda models: None,
           "a second backward": lambda models: backward(models, [[9], [1, 10]]),
           "an add of its own to an untouched row": _add_to_row_5,
           "a scaling in place": _scale,
           "clipping": _clip,
           "a dense backward": _dense_backward,
           "model.zero_grad() then backward": lambda models: (
               [m.zero_grad() for m in models], backward(models, [[3], [11]]))}


@pytest.mark.parametrize("step", [True, False])
@pytest.mark.parametrize("between", list(BETWEEN))
def test_zero_grad_leaves_every_gradient_zero(between, step):
    """Whatever wrote the table's gradients since the last zero_grad (backward alone, or
    the program too), the Trainer's zero_grad leaves every row of every replica's
    gradient 0, with or without a step in between, round after round."""
    models = replicas()
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    for batches in ([[1, 2], [2, 3]], [[4], [8, 4]], [[0], [11]]):
        trainer.zero_grad()
        for grad in _grads_of_the_table(models):
            assert grad is not None and not grad.any()
        backward(models, batches)
        BETWEEN[between](models)
        if step:
            trainer.step(1, ignore_stale_grad=True)
    trainer.zero_grad()
    for grad in _grads_of_the_table(models):
        assert not grad.any(), between


def test_zero_grad_zeroes_the_rows_backward_wrote_alone():
    """Where backward alone wrote the table's gradient since the last zero_grad, the
    next one zeroes the rows it wrote, not the whole table (a write no counter sees,
    through `.data`, shows which); after a write of the program's own, the whole."""
    models = replicas()
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    trainer.zero_grad()
    unseen = models[0].emb.weight.grad.data
    unseen[5] = 7.0
    backward(models, [[1, 2], [3]])
    trainer.step(1)
    trainer.zero_grad()
    assert unseen[5].tolist() == [7.0] * DIM
    assert not unseen[[1, 2, 3]].any()
    backward(models, [[1], [3]])
    _add_to_row_5(models[1:])  # (replica 1's own write: replica 0's rows alone again)
    trainer.zero_grad()
    assert unseen[5].tolist() == [7.0] * DIM
    assert not models[1].emb.weight.grad.any()
    backward(models, [[1], [3]])
    _scale(models)
    trainer.zero_grad()
    assert not unseen.any()


def test_a_write_of_the_programs_own_before_backward_is_zeroed_too():
    """A write into the table's gradient after zero_grad and before backward (which
    then writes the gradient again) is zeroed by the next zero_grad."""
    models = replicas()
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    trainer.zero_grad()
    _add_to_row_5(models)
    backward(models, [[1], [3]])
    trainer.zero_grad()
    for grad in _grads_of_the_table(models):
        assert not grad.any()


def test_a_replica_that_did_not_use_the_table_pushes_no_rows():
    """With ignore_stale_grad, a replica whose batch left the table alone adds nothing:
    the rows the other touched move, the others stay."""
    models = replicas()
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1}, kvstore="local")
    before = table(models[0])
    models[0](torch.tensor([3])).backward()
    models[1].out(torch.ones(1, DIM)).sum().backward()  # (the table is left alone)
    trainer.step(1, ignore_stale_grad=True)
    changed = np.flatnonzero((table(models[0]) != before).any(axis=1)).tolist()
    assert changed == [3]
    np.testing.assert_array_equal(table(models[1]), table(models[0]))


def test_a_gradient_made_dense_by_backward_is_pushed_dense():
    """A step after a backward that made the table's gradient dense (the functional
    embedding, without sparse=True) pushes it dense: every row is updated."""
    models = replicas()
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1}, kvstore="local")
    before = table(models[0])
    for model, ids in zip(models, ([1], [2])):
        x = nn.functional.embedding(torch.tensor(ids), model.emb.weight)
        model.out(x).sum().backward()
    trainer.step(1)
    assert (table(models[0]) != before).all(axis=1).all()  # (weight decay moves every row)


def test_rows_of_a_backward_the_program_dropped_are_not_pushed():
    """Rows whose gradient the program dropped (`model.zero_grad()`, with or without
    set_to_none) or never accumulated (`torch.autograd.grad`) stay as they are."""
    for drop in ("none", "zero", "grad"):
        models = replicas()
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1},
                             kvstore="local")
        before = table(models[0])
        for model in models:
            loss = model(torch.tensor([9, 10]))
            if drop == "grad":
                torch.autograd.grad(loss, model.emb.weight)
            else:
                loss.backward()
                model.zero_grad(set_to_none=drop == "none")
        backward(models, [[1], [2]])
        trainer.step(1)
        changed = np.flatnonzero((table(models[0]) != before).any(axis=1)).tolist()
        assert changed == [1, 2], (drop, changed)


def test_a_write_to_the_table_between_steps_is_replaced_by_the_stores():
    """A write to a replica's table between steps (a pretrained table loaded into
    replica 0 only) is replaced at the next step by the store's whole table, as for
    any parameter, so every replica holds the store's weights, untouched rows too."""
    models = replicas()
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    with torch.no_grad():
        models[0].emb.weight.add_(1.0)
    with pytest.warns(gt.WeightWritesLost):
        backward(models, [[1], [2]])
        trainer.step(1)
    stored = np.empty((VOCAB, DIM), np.float32)
    trainer.kvstore.pull("emb.weight", out=stored)
    for model in models:
        np.testing.assert_array_equal(table(model), stored)


def test_a_gradient_the_program_assigned_is_pushed_dense():
    """A `.grad` the program set to a dense tensor of its own is taken whole."""
    models = replicas()
    trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local")
    before = table(models[0])
    for model in models:
        model.emb.weight.grad = torch.ones(VOCAB, DIM)
        model.out(torch.ones(1, DIM)).sum().backward()
    trainer.step(1)
    np.testing.assert_allclose(table(models[0]), before - 0.2, rtol=1e-6)


def test_an_older_trainer_kept_alive_notes_nothing():
    """A new Trainer on the same modules takes their rows over: the older one's hooks,
    while it lives, note no more."""
    models = replicas()
    old = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1}, kvstore="local")
    new = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1}, kvstore="local")
    before = table(models[0])
    backward(models, [[1], [2]])
    assert list(old._rows._noted.values()) == [[[], []]]
    assert [len(n) for notes in new._rows._noted.values() for n in notes] == [1, 1]
    new.step(1)
    changed = np.flatnonzero((table(models[0]) != before).any(axis=1)).tolist()
    assert changed == [1, 2]


def test_a_snapshot_resumes_whichever_way_the_table_is_pushed(tmp_path):
    """The table has a key of its own with rows pushed or dense: a snapshot taken with
    update_on_kvstore=True resumes with update_on_kvstore=False, and back."""
    for first, then in ((True, False), (False, True)):
        folder = tmp_path / f"{first}-{then}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SparseGradientsMadeDense)
            models = replicas()
            trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1}, kvstore="local",
                                 update_on_kvstore=first, checkpoint_dir=str(folder),
                                 checkpoint_every=1)
            backward(models, [[1], [2]])
            trainer.step(1)
            trainer.close()  # (its folder, free for the next Trainer)
            saved = table(models[0])
            resumed = replicas()
            again = gt.Trainer(resumed, "sgd", {"learning_rate": 0.1}, kvstore="local",
                               update_on_kvstore=then, checkpoint_dir=str(folder),
                               checkpoint_every=1)
        assert again.steps == 1
        np.testing.assert_array_equal(table(resumed[0]), saved)


@pytest.mark.parametrize("why,options", [
    ("update_on_kvstore=False", {"update_on_kvstore": False}),
    ("deterministic store", {"deterministic": True})])
def test_where_rows_cannot_go_the_trainer_warns_and_pushes_dense(why, options):
    """With update_on_kvstore=False (each replica's optimizer updates the sums), and to
    a deterministic store (whose bits must not depend on the layout), the table's
    gradients are summed and updated dense, every row, with a warning naming the
    parameter and why."""
    models = replicas()
    with pytest.warns(SparseGradientsMadeDense, match=rf"'emb.weight'.*{why}"):
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.1, "wd": 0.1},
                             kvstore="local", **options)
    before = table(models[0])
    backward(models, [[1], [2]])
    trainer.step(1)
    assert (table(models[0]) != before).all(axis=1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=needs_bfloat16)], ids=str)
def test_tables_of_every_float_width_step_as_dense_ones(dtype):
    """Plain SGD moves the rows touched alone either way: a table of float32, float16 or
    bfloat16 pushed as rows ends with the bits of the same table pushed dense."""
    weights = []
    for dense in (False, True):
        models = [m.to(dtype) for m in replicas(dense=dense)]
        trainer = gt.Trainer(models, "sgd", {"learning_rate": 0.5}, kvstore="local")
        for batches in ([[1, 2, 2], [2, 3]], [[7], [7, 8]], [[0], [11]]):
            trainer.zero_grad()
            backward(models, batches)
            trainer.step(1)
        weights.append([m.emb.weight.detach().clone() for m in models])
    for rows, dense in zip(*weights):
        assert torch.equal(rows, dense) and rows.dtype == dtype

"""gpukv.torch.Trainer's snapshots: a Trainer stopped early and made again on a fresh
model resumes its steps, user_state and weights, and ends where an uninterrupted run
does, bit for bit; wrong options and other layouts are refused."""
from __future__ import annotations

import copy
import logging
import os
import pathlib
import re
import signal
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import gpukv  # noqa: E402
import gpukv.torch as gt  # noqa: E402
from gpukv.checkpoints import snapshots  # noqa: E402

from .bfloat16 import needs_bfloat16  # noqa: E402

STEPS = 6
PARAMS = {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3}


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _run(models, steps, directory=None, every=None, update_on_kvstore=True,
         kvstore="local", **options):
    """A Trainer over `models` (its checkpoints in `directory`), stepped until `steps` are
    done; each step's data comes from a generator kept in user_state."""
    trainer = gt.Trainer(models, "sgd", dict(PARAMS), kvstore=kvstore,
                         update_on_kvstore=update_on_kvstore, checkpoint_dir=directory,
                         checkpoint_every=every, **options)
    if "generator" in trainer.user_state:
        g = torch.Generator()
        g.set_state(trainer.user_state["generator"])
    else:
        g = torch.Generator().manual_seed(1)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    while trainer.steps < steps:
        x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
        trainer.zero_grad()
        for m, xs, ys in zip(models, x.chunk(len(models)), y.chunk(len(models))):
            loss_fn(m(xs), ys).backward()
        trainer.user_state = {"generator": g.get_state(), "seen": trainer.steps + 1}
        trainer.step(12)
    trainer.finish_snapshots()
    return trainer


def _bits(models):
    return [p.detach().numpy().tobytes() for m in models for p in m.parameters()]


@pytest.mark.parametrize("compression", [{"type": "sign"}, {"type": "powersgd", "rank": 2}],
                         ids=lambda c: c["type"])
def test_a_compressed_trainer_resumes_to_the_bit(tmp_path, compression):
    """With gradient compression on its store, a Trainer made again also resumes what
    the compression carries from step to step (residuals, served values, warm starts):
    it ends with the weights of an uninterrupted run, to the bit."""
    base = _model()
    options = {"kvstore": "device", "compression_params": compression}
    reference = [copy.deepcopy(base) for _ in range(2)]
    _run(reference, STEPS, **options)
    first = [copy.deepcopy(base) for _ in range(2)]
    _run(first, 3, tmp_path, 3, **options)
    again = [copy.deepcopy(base) for _ in range(2)]
    trainer = _run(again, STEPS, tmp_path, 3, **options)
    assert trainer.resumed_from is not None and trainer.resumed_from.step == 3
    assert _bits(again) == _bits(reference)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_a_resume_says_when_compression_residuals_start_afresh(tmp_path, caplog,
                                                               update_on_kvstore):
    """A compressed Trainer that updates its replicas itself does not keep the residuals
    of the store that sums its gradients: its resume says so at INFO; one that updates
    on the store keeps them and says nothing of the kind."""
    base = _model()
    options = {"kvstore": "device", "compression_params": {"type": "2bit", "threshold": 0.1}}
    _run([copy.deepcopy(base) for _ in range(2)], 2, tmp_path, 2, update_on_kvstore,
         **options)
    with caplog.at_level("INFO", logger="gpukv"):
        resumed = _run([copy.deepcopy(base) for _ in range(2)], 0, tmp_path, 2,
                       update_on_kvstore, **options)
    assert resumed.resumed_from is not None
    said = [r.getMessage() for r in caplog.records if "start afresh" in r.getMessage()]
    assert len(said) == (0 if update_on_kvstore else 1), said


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("stop,every", [(4, 2), (3, 1), (5, 2)])
def test_a_new_trainer_resumes_and_ends_as_an_uninterrupted_run(tmp_path, capfd, stop,
                                                                every, update_on_kvstore):
    """A Trainer stopped after `stop` steps and made again on a fresh model resumes from
    the last snapshot (its steps, user_state with a generator's state, resumed_from, one
    line on stderr) and ends with the weights of an uninterrupted run, to the bit."""
    base = _model()
    reference = [copy.deepcopy(base) for _ in range(2)]
    _run(reference, STEPS, update_on_kvstore=update_on_kvstore)
    first = [copy.deepcopy(base) for _ in range(2)]
    _run(first, stop, tmp_path, every, update_on_kvstore)
    capfd.readouterr()

    fresh = [_model(seed=7) for _ in range(2)]
    resumed = _run(fresh, 0, tmp_path, every, update_on_kvstore)  # takes no step
    saved = stop - stop % every
    assert resumed.steps == saved and resumed.resumed_from.step == saved
    assert resumed.user_state["seen"] == saved
    assert resumed.resumed_from.path == gpukv.latest_snapshot(tmp_path).path
    err = capfd.readouterr().err
    assert err.count("gpukv: resumed from") == 1, err
    assert f"gpukv: resumed from {resumed.resumed_from.path} (step {saved}" in err, err
    done = _run(fresh, STEPS, tmp_path, every, update_on_kvstore)
    assert done.steps == STEPS
    assert _bits(fresh) == _bits(reference)


def test_a_resumed_trainer_logs_it_at_info_with_its_rank(tmp_path, caplog):
    """A Trainer made again over a folder with snapshots logs at INFO, with its worker's
    rank, the snapshot it resumed from and its step."""
    _run([_model()], 2, tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="gpukv"):
        resumed = _run([_model(seed=7)], 0, tmp_path, 2)
    said = [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and r.getMessage().startswith("gpukv: worker")]
    assert len(said) == 1, said
    assert said[0].startswith(f"gpukv: worker 0 resumed from {resumed.resumed_from.path} "
                              "(step 2, saved by 1 worker(s), now 1) in "), said


def test_no_snapshot_starts_from_the_model(tmp_path, capfd):
    """A Trainer whose checkpoint_dir holds no snapshot starts at step 0 from its own
    weights and says nothing."""
    models = [_model()]
    before = _bits(models)
    trainer = gt.Trainer(models, "sgd", dict(PARAMS), checkpoint_dir=tmp_path / "new")
    assert (trainer.steps, trainer.resumed_from, trainer.user_state) == (0, None, {})
    assert _bits(models) == before
    assert "resumed" not in capfd.readouterr().err


def test_another_layout_is_refused_naming_the_keys(tmp_path):
    """A snapshot of a Trainer with other keys (other bucket_bytes) is refused with a
    CheckpointError naming both key lists; the model keeps its weights."""
    _run([_model()], 2, tmp_path, 1)
    models = [_model(seed=3)]
    before = _bits(models)
    with pytest.raises(gpukv.CheckpointError, match=r"its keys \(.*\) are not this "
                       r"Trainer's \(.*\).*bucket_bytes"):
        gt.Trainer(models, "sgd", dict(PARAMS), kvstore="local", bucket_bytes=0,
                   checkpoint_dir=tmp_path)
    assert _bits(models) == before


def test_a_bare_store_snapshot_is_refused(tmp_path):
    """A bare store's snapshot in checkpoint_dir is not a Trainer's: CheckpointError."""
    kv = gpukv.create("local")
    kv.init(0, np.ones(3, np.float32))
    kv.snapshot(tmp_path, 1)
    kv.finish_snapshots()
    del kv  # (its folder, free for the Trainer's store)
    with pytest.raises(gpukv.CheckpointError, match="not a Trainer's snapshot"):
        gt.Trainer([_model()], "sgd", dict(PARAMS), checkpoint_dir=tmp_path)


BAD_OPTIONS = [
    ({"checkpoint_every": 2}, gpukv.ArgumentError, "checkpoint_every needs a checkpoint_dir"),
    ({"checkpoint_dir": "D", "checkpoint_every": 0}, gpukv.ArgumentError,
     "checkpoint_every=0"),
    ({"checkpoint_dir": "D", "checkpoint_every": True}, gpukv.ArgumentError,
     "checkpoint_every=True"),
    ({"checkpoint_dir": "D", "checkpoint_every": 1.5}, gpukv.ArgumentError,
     "checkpoint_every=1.5"),
    ({"checkpoint_dir": "D", "checkpoint_keep": 0}, gpukv.ArgumentError, "checkpoint_keep=0"),
    ({"checkpoint_dir": "F"}, gpukv.CheckpointError, "is a file"),
]


@pytest.mark.parametrize("options,error,message", BAD_OPTIONS,
                         ids=[m.split("=")[0] + str(i) for i, (_, _, m) in
                              enumerate(BAD_OPTIONS)])
def test_bad_checkpoint_options_are_refused_first(tmp_path, options, error, message):
    """Bad checkpoint options raise a typed error naming the option before anything
    changes: no store is made from the model, no folder is written."""
    (tmp_path / "F").write_text("a file")
    options = {k: (str(tmp_path / v) if k == "checkpoint_dir" else v)
               for k, v in options.items()}
    kv = gpukv.create("local")
    models = [_model()]
    with pytest.raises(error, match=message):
        gt.Trainer(models, "sgd", dict(PARAMS), kvstore=kv, **options)
    assert len(kv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["F"]


def test_snapshot_without_a_folder_is_refused():
    """Trainer.snapshot() without a checkpoint_dir is an ArgumentError."""
    trainer = gt.Trainer([_model()], "sgd", dict(PARAMS))
    with pytest.raises(gpukv.ArgumentError, match="checkpoint_dir"):
        trainer.snapshot()


def _trained(folder, model, steps=3, **kw):
    trainer = gt.Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         checkpoint_dir=folder, **kw)
    x = torch.randn(8, 4)
    for _ in range(steps):
        trainer.zero_grad()
        model(x).sum().backward()
        trainer.step()
    return trainer


def test_export_writes_every_parameter_by_name_to_safetensors(tmp_path):
    """`python -m gpukv export` (and export_safetensors) write the newest snapshot's
    parameters under their state_dict names, values as trained: safetensors' own
    loader reads them into a fresh model."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from gpukv.torch.export import export_safetensors
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with _trained(tmp_path / "ckpt", model):  # the final snapshot, at the end of the block
        pass
    out = tmp_path / "model.safetensors"
    names = export_safetensors(tmp_path / "ckpt", out)
    assert names == [n for n, _ in model.named_parameters()]
    loaded = safetensors_torch.load_file(str(out))
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fresh.load_state_dict(loaded)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    cli = tmp_path / "cli.safetensors"
    done = subprocess.run([sys.executable, "-m", "gpukv", "export", str(tmp_path / "ckpt"),
                           str(cli)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4 tensors" in done.stdout
    assert safetensors_torch.load_file(str(cli)).keys() == loaded.keys()
    bad = subprocess.run([sys.executable, "-m", "gpukv", "export", str(tmp_path / "none"),
                          str(tmp_path / "x.safetensors")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and f"{tmp_path / 'none'}: does not exist" in bad.stderr
    (tmp_path / "empty").mkdir()
    with pytest.raises(gpukv.CheckpointError, match="no complete snapshot here"):
        export_safetensors(tmp_path / "empty", tmp_path / "x.safetensors")


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bfloat16),
                                   torch.float16], ids=str)
def test_export_keeps_a_narrow_dtype_bit_for_bit(tmp_path, dtype):
    """A model trained in bfloat16 (which NumPy has through ml_dtypes only) or float16
    is exported in its own dtype, the trained bits, to a file safetensors loads."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from gpukv.torch.export import export_safetensors
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(dtype)
    trainer = gt.Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         checkpoint_dir=tmp_path / "ckpt")
    with trainer:
        trainer.zero_grad()
        model(torch.randn(8, 4, dtype=dtype)).float().sum().backward()
        trainer.step()
    out = tmp_path / "model.safetensors"
    export_safetensors(tmp_path / "ckpt", out)
    loaded = safetensors_torch.load_file(str(out))
    for name, p in model.named_parameters():
        assert loaded[name].dtype == dtype
        assert torch.equal(loaded[name].view(torch.int16), p.detach().view(torch.int16))


def test_a_failed_snapshot_write_is_raised_after_the_next_steps_snapshot_started(
        tmp_path, monkeypatch):
    """A snapshot whose write fails (a full disk) raises at the next due snapshot, in a
    step that was taken: the error says so (taking it again would apply it twice), and
    that step's snapshot is taken all the same."""
    import errno

    import gpukv.checkpoints.checkpoint as checkpoint
    from gpukv.checkpoints import snapshots
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    trainer = gt.Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore="local",
                         checkpoint_dir=tmp_path, checkpoint_every=1, checkpoint_keep=10)
    write, failing = checkpoint._write_member, [False]

    def full_disk(*args):
        if failing[0]:
            failing[0] = False
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(*args)
    monkeypatch.setattr(checkpoint, "_write_member", full_disk)

    def step():
        trainer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        trainer.step()
    step()
    trainer.finish_snapshots()
    failing[0] = True
    step()  # its snapshot fails in the background
    raised = None
    while raised is None:  # step 3 or, once step 2's buffers are needed again, step 4
        assert trainer.steps < 4
        try:
            step()
        except gpukv.CheckpointError as exc:
            raised = exc
    steps = trainer.steps
    assert str(raised).startswith(f"step {steps} was taken (do not take it again) and its "
                                  f"snapshot started, but an earlier one failed: ")
    assert "No space left on device" in str(raised)
    trainer.finish_snapshots()
    assert [found.step for found in snapshots.complete_snapshots(tmp_path)] == [
        1, *range(3, steps + 1)]


@pytest.mark.parametrize("why", ["a file in the way", "not writable", "sysfs"])
def test_a_checkpoint_dir_that_cannot_be_written_is_refused_when_the_trainer_is_made(
        tmp_path, monkeypatch, why):
    """Not at the first snapshot, hours later: a CheckpointError naming the folder, and
    the modules keep their parameters. (/sys refuses a new file even where permissions
    would let root write.)"""
    import os

    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "ckpt"
    if why == "sysfs":
        if not os.path.isdir("/sys/kernel"):
            pytest.skip("no /sys here")
        folder = pathlib.Path("/sys/kernel/gpukv-ckpt")
    if why == "not writable":  # (as root, only a read-only file system refuses)
        folder = tmp_path / "ckpt"
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: False if os.fspath(path) == str(
            tmp_path) else real(path, mode))
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(gpukv.CheckpointError) as raised:
        gt.Trainer(model, "sgd", dict(PARAMS), kvstore="local", checkpoint_dir=folder)
    assert str(raised.value).startswith(f"{folder}: cannot write snapshots there: ")
    if why != "sysfs":
        assert ("is a file" if why == "a file in the way" else "is not writable") in str(
            raised.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    gt.Trainer(model, "sgd", dict(PARAMS), kvstore="local")  # the modules are free


@pytest.mark.parametrize("damaged", ["shard-*", "worker-*"])
def test_a_damaged_newest_snapshot_says_how_to_start_from_an_older_one(tmp_path, damaged):
    """A file of the newest snapshot cut to half its size (a shard of the store, or
    worker 0's file, which the Trainer reads first): a CheckpointError naming the file
    that says how to start from an older snapshot."""
    with _trained(tmp_path, nn.Linear(4, 2), steps=2, checkpoint_every=1):
        pass
    newest = gpukv.latest_snapshot(tmp_path)
    cut, = pathlib.Path(newest.path).glob(damaged)
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    with pytest.raises(gpukv.CheckpointError,
                       match=rf"^{re.escape(str(cut))}: .* \(to start from an older "
                             rf"snapshot, make the Trainer with resume=<its folder>, or "
                             rf"move this one out of {re.escape(str(tmp_path))}\)$"):
        gt.Trainer(nn.Linear(4, 2), "sgd", {"learning_rate": 0.1}, kvstore="local",
                   checkpoint_dir=tmp_path)


def _batchnorm_model(width=8, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.BatchNorm1d(width), nn.Tanh(),
                         nn.Linear(width, 3))


def _buffers(model):
    return {name: b.clone() for name, b in model.named_buffers()}


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_a_resume_gives_every_replica_the_running_statistics_of_replica_0(
        tmp_path, update_on_kvstore):
    """BatchNorm's running statistics (buffers, which the store does not sum) are in a
    snapshot as replica 0 had them, and a resume on fresh models gives them to every
    replica; the run then ends as an uninterrupted one does (replica 0's weights and
    statistics, bit for bit)."""
    whole = [_batchnorm_model() for _ in range(2)]
    _run(whole, STEPS, tmp_path / "whole", update_on_kvstore=update_on_kvstore)
    first = [_batchnorm_model() for _ in range(2)]
    _run(first, 4, tmp_path / "ckpt", every=2, update_on_kvstore=update_on_kvstore)
    saved = _buffers(first[0])
    assert not all(torch.equal(a, b) for a, b in zip(saved.values(),
                                                     _buffers(first[1]).values()))
    fresh = [_batchnorm_model(seed=5) for _ in range(2)]
    trainer = gt.Trainer(fresh, "sgd", dict(PARAMS), kvstore="local",
                         update_on_kvstore=update_on_kvstore, checkpoint_dir=tmp_path / "ckpt")
    assert trainer.steps == 4
    for model in fresh:
        for name, b in _buffers(model).items():
            assert torch.equal(b, saved[name]), name
    _run(fresh, STEPS, tmp_path / "ckpt", update_on_kvstore=update_on_kvstore)
    assert _bits(fresh[:1]) == _bits(whole[:1])
    # replica 0's statistics went on as in the uninterrupted run
    for name, b in _buffers(whole[0]).items():
        assert torch.equal(b, _buffers(fresh[0])[name]), name


def test_a_snapshot_of_other_buffers_is_refused_naming_them(tmp_path):
    """A model whose buffers differ from the snapshot's (a BatchNorm keeping no running
    statistics) is refused before anything changes, naming them as PyTorch's
    load_state_dict does."""
    _run([_batchnorm_model()], 2, tmp_path, every=1)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False),
                          nn.Tanh(), nn.Linear(8, 3))
    before = _bits([other])
    with pytest.raises(gpukv.CheckpointError,
                       match="buffer missing in the snapshot: 1.running_mean|buffer not in "
                             "the model: 1.running_mean"):
        gt.Trainer(other, "sgd", dict(PARAMS), kvstore="local", checkpoint_dir=tmp_path)
    assert _bits([other]) == before


def test_export_holds_the_buffers_for_a_strict_load(tmp_path):
    """The export of a model with BatchNorm holds its running statistics: a fresh model
    loads it with strict=True and computes as the trained one in eval mode."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from gpukv.torch.export import export_safetensors
    model = _batchnorm_model()
    _run([model], 3, tmp_path / "ckpt", every=3)
    out = tmp_path / "model.safetensors"
    names = export_safetensors(tmp_path / "ckpt", out)
    assert set(names) == set(model.state_dict())
    fresh = _batchnorm_model(seed=9)
    fresh.load_state_dict(safetensors_torch.load_file(str(out)), strict=True)
    x = torch.randn(5, 6)
    model.eval()
    fresh.eval()
    assert torch.equal(model(x), fresh(x))


def _fine_tuned_model(seed=0, bias=True):
    """A body frozen before the Trainer is made (as a pretrained one is) and a head."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8, bias=bias), nn.Tanh(), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    return model


def _frozen(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if not p.requires_grad}


def test_frozen_parameters_are_in_snapshots_resumes_and_exports(tmp_path):
    """Parameters frozen when the Trainer was made, which the store does not hold, are in
    a snapshot as replica 0 has them: a resume on fresh models (other frozen values)
    gives them to every replica and then ends as the uninterrupted run, bit for bit; the
    export holds the whole model, for a strict load that computes as the trained one."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from gpukv.torch.export import export_safetensors
    whole = [_fine_tuned_model() for _ in range(2)]
    _run(whole, STEPS, tmp_path / "whole")
    first = [_fine_tuned_model() for _ in range(2)]
    _run(first, 4, tmp_path / "ckpt", every=2)
    saved = _frozen(first[0])
    fresh = [_fine_tuned_model(seed=5) for _ in range(2)]
    assert not any(torch.equal(p, saved[n]) for n, p in _frozen(fresh[0]).items())
    trainer = gt.Trainer(fresh, "sgd", dict(PARAMS), kvstore="local",
                         checkpoint_dir=tmp_path / "ckpt")
    assert trainer.steps == 4
    for model in fresh:
        for name, p in _frozen(model).items():
            assert torch.equal(p, saved[name]) and not p.requires_grad, name
    _run(fresh, STEPS, tmp_path / "ckpt")
    assert _bits(fresh) == _bits(whole)
    out = tmp_path / "model.safetensors"  # (of the newest snapshot: step 4's)
    assert set(export_safetensors(tmp_path / "ckpt", out)) == set(first[0].state_dict())
    loaded = _fine_tuned_model(seed=9)
    loaded.load_state_dict(safetensors_torch.load_file(str(out)), strict=True)
    x = torch.randn(5, 6)
    assert torch.equal(loaded(x), first[0](x))


def test_a_snapshot_of_other_frozen_parameters_is_refused_naming_them(tmp_path):
    """A model whose frozen parameters differ from the snapshot's (a body without a
    bias) is refused before anything changes, naming them as load_state_dict does."""
    _run([_fine_tuned_model()], 2, tmp_path, every=1)
    other = _fine_tuned_model(bias=False)
    before = _bits([other])
    with pytest.raises(gpukv.CheckpointError,
                       match="frozen parameter not in the model: 0.bias"):
        gt.Trainer(other, "sgd", dict(PARAMS), kvstore="local", checkpoint_dir=tmp_path)
    assert _bits([other]) == before


class _TiedModel(nn.Module):
    """An embedding tied to the output layer, as in a language model: `state_dict()`
    holds the one parameter under two names."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(self.emb(x))


def test_tied_parameters_are_named_beside_the_first():
    """A parameter under several names: each name after the first, to the first (the
    one `named_parameters()` and the Trainer keep)."""
    from gpukv.torch import buffers
    assert buffers.tied_parameters(_TiedModel()) == {"out.weight": "emb.weight"}
    assert buffers.tied_parameters(_model()) == {}


def test_export_writes_a_tied_parameter_under_each_of_its_names(tmp_path):
    """A snapshot records the names a parameter is tied under: the export holds it under
    each of them (copies: safetensors refuses shared memory), so that the model loads it
    with strict=True, and the file's metadata names the tie as safetensors' save_model
    does."""
    safetensors = pytest.importorskip("safetensors")
    from gpukv.torch.export import export_safetensors
    model = _TiedModel()
    with gt.Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore="local",
                    checkpoint_dir=tmp_path / "ckpt") as trainer:
        trainer.zero_grad()
        model(torch.arange(4)).sum().backward()
        trainer.step(4)
    out = tmp_path / "model.safetensors"
    assert export_safetensors(tmp_path / "ckpt", out) == ["emb.weight", "out.weight"]
    loaded = _TiedModel(seed=9)
    loaded.load_state_dict(safetensors.torch.load_file(str(out)), strict=True)
    assert torch.equal(loaded.out.weight, model.emb.weight)
    with safetensors.safe_open(str(out), "pt") as f:
        assert f.metadata()["out.weight"] == "emb.weight"


def _exported(folder):
    """A Trainer's snapshot in `folder`, to export."""
    with _trained(folder, nn.Linear(4, 2), steps=1):
        pass


@pytest.mark.parametrize("out,says", [
    ("missing/model.safetensors", "its folder .*missing does not exist"),
    ("afile/model.safetensors", "its folder .*afile is not a folder"),
    ("ckpt", "is a folder; name the .safetensors file to write"),
], ids=["missing folder", "under a file", "a folder"])
def test_an_export_that_cannot_be_written_is_refused_naming_it(tmp_path, out, says):
    """OUT in a missing folder, under a file, or a folder itself: a CheckpointError naming
    OUT, before anything is written."""
    pytest.importorskip("safetensors")
    from gpukv.torch.export import export_safetensors
    _exported(tmp_path / "ckpt")
    (tmp_path / "afile").write_text("not a folder")
    before = sorted(tmp_path.rglob("*"))
    named = re.escape(str(tmp_path / out))
    with pytest.raises(gpukv.CheckpointError, match=f"^{named}: .*{says}"):
        export_safetensors(tmp_path / "ckpt", tmp_path / out)
    assert sorted(tmp_path.rglob("*")) == before


def test_the_export_command_refuses_a_folder_in_one_line(tmp_path):
    """`gpukv export SNAPSHOT FOLDER`: one line naming it, status 1, no traceback."""
    pytest.importorskip("safetensors")
    _exported(tmp_path / "ckpt")
    done = subprocess.run([sys.executable, "-m", "gpukv", "export", str(tmp_path / "ckpt"),
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"gpukv export: {tmp_path}: is a folder; name the "
                                        f".safetensors file to write"], done.stderr


@pytest.mark.parametrize("error,raised,says", [
    (OSError(28, "No space left on device"), gpukv.CheckpointError,
     "{out}: cannot write the export: [Errno 28] No space left on device"),
    (KeyboardInterrupt(), KeyboardInterrupt, ""),
], ids=["disk full", "interrupted"])
def test_a_failed_export_leaves_no_file_behind(tmp_path, monkeypatch, error, raised, says):
    """A write that fails half way (a full disk; an OS error is a CheckpointError naming
    OUT) or is interrupted leaves neither OUT nor a temporary file."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from gpukv.torch.export import export_safetensors
    _exported(tmp_path / "ckpt")

    def half_written(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise error
    monkeypatch.setattr(safetensors_torch, "save_file", half_written)
    out = tmp_path / "model.safetensors"
    with pytest.raises(raised) as caught:
        export_safetensors(tmp_path / "ckpt", out)
    assert str(caught.value) == says.format(out=out)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_export_is_reachable_from_gpukv_torch_without_safetensors():
    """After `import gpukv.torch`, `gpukv.torch.export.export_safetensors` (as the docs
    spell it) is there, and safetensors, optional, is not imported yet."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, gpukv.torch\n"
         "print(callable(gpukv.torch.export.export_safetensors), 'safetensors' in "
         "sys.modules)"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def test_close_takes_the_final_snapshot_once(tmp_path):
    """A run of 5 steps snapshotting every 2 ends, after close(), with a snapshot of step
    5; a close right after a snapshot of the last step takes none more."""
    model = nn.Linear(4, 2)
    trainer = _trained(tmp_path / "a", model, steps=5, checkpoint_every=2)
    trainer.close()
    found = snapshots.latest_snapshot(tmp_path / "a")
    assert found.step == 5
    trainer = _trained(tmp_path / "b", nn.Linear(4, 2), steps=4, checkpoint_every=2)
    trainer.close()
    steps = [s.step for s in snapshots.complete_snapshots(tmp_path / "b")]
    assert steps == [2, 4]


def test_a_changed_model_is_named_per_parameter_as_pytorch_does(tmp_path):
    """Resuming a snapshot of another model names each parameter that differs: its size
    on both sides, or on which side it is missing."""
    with _trained(tmp_path / "ckpt", nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 2))):
        pass
    with pytest.raises(gpukv.CheckpointError,
                       match=r"size mismatch for 0\.weight: \[64, 4\] in the snapshot, "
                             r"\[32, 4\] in the model"):
        gt.Trainer(nn.Sequential(nn.Linear(4, 32), nn.Linear(32, 2)), "sgd",
                   kvstore="local", checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(gpukv.CheckpointError, match=r"missing in the snapshot: 2\.weight"):
        gt.Trainer(nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 2), nn.Linear(2, 2)),
                   "sgd", kvstore="local", checkpoint_dir=tmp_path / "ckpt")


def test_a_changed_model_is_refused_naming_every_mismatch_at_once(tmp_path):
    """A model grown wider (its parameters, frozen parameters and BatchNorm's running
    statistics all differ): one CheckpointError naming every one, as load_state_dict
    does, not the buffers alone."""
    def model(width):
        torch.manual_seed(0)
        made = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 1))
        made[0].bias.requires_grad_(False)
        return made
    with _trained(tmp_path, model(3), steps=1):
        pass
    with pytest.raises(gpukv.CheckpointError) as raised:
        gt.Trainer(model(5), "sgd", {"learning_rate": 0.1}, kvstore="local",
                   checkpoint_dir=tmp_path)
    said = str(raised.value)
    assert said.startswith(f"{gpukv.latest_snapshot(tmp_path).path}: another model's "
                           f"snapshot: size mismatch for ")
    differ = {"0.weight": ([3, 4], [5, 4]), "1.weight": ([3], [5]), "1.bias": ([3], [5]),
              "2.weight": ([1, 3], [1, 5]), "0.bias": ([3], [5]),  # (frozen)
              "1.running_mean": ([3], [5]), "1.running_var": ([3], [5])}
    for name, (saved, mine) in differ.items():
        assert (f"size mismatch for {name}: {saved} in the snapshot, {mine} in the model"
                in said), name
    assert said.count("size mismatch for ") == len(differ), said


def test_resume_never_starts_afresh_and_keeps_the_old_runs_snapshots(tmp_path):
    """resume='never' in a folder of an earlier run: trains from the model as given,
    keeps its own `checkpoint_keep` newest snapshots and removes none of the old run's."""
    folder = tmp_path / "ckpt"
    _trained(folder, nn.Linear(4, 2), steps=6, checkpoint_every=1).close()
    old = {s.path for s in snapshots.complete_snapshots(folder)}
    assert len(old) == 2
    torch.manual_seed(5)
    model = nn.Linear(4, 2)
    start = copy.deepcopy(model)
    trainer = gt.Trainer(model, "sgd", {"learning_rate": 0.0}, kvstore="local",
                         checkpoint_dir=folder, checkpoint_every=1, resume="never")
    assert trainer.steps == 0 and trainer.resumed_from is None
    assert torch.equal(model.weight, start.weight)  # not the old run's weights
    x = torch.randn(8, 4)
    for _ in range(4):
        trainer.zero_grad()
        model(x).sum().backward()
        trainer.step()
    trainer.close()
    now = {s.path for s in snapshots.complete_snapshots(folder)}
    assert old <= now and len(now - old) == 2


def test_resume_from_a_chosen_snapshot(tmp_path):
    """resume=PATH starts from that snapshot (an older one here), not the newest."""
    folder = tmp_path / "ckpt"
    _trained(folder, nn.Linear(4, 2), steps=4, checkpoint_every=1, checkpoint_keep=4).close()
    older = snapshots.complete_snapshots(folder)[1]
    trainer = gt.Trainer(nn.Linear(4, 2), "sgd", kvstore="local", checkpoint_dir=folder,
                         resume=older.path)
    assert trainer.steps == older.step == 2
    with pytest.raises(gpukv.CheckpointError, match="not a snapshot's folder"):
        gt.Trainer(nn.Linear(4, 2), "sgd", kvstore="local", checkpoint_dir=folder,
                   resume=str(tmp_path))
    for bad in ("sometimes", 3):
        with pytest.raises((gpukv.ArgumentError, gpukv.CheckpointError), match="resume="):
            gt.Trainer(nn.Linear(4, 2), "sgd", kvstore="local", checkpoint_dir=folder,
                       resume=bad)
    with pytest.raises(gpukv.ArgumentError, match="needs a checkpoint_dir"):
        gt.Trainer(nn.Linear(4, 2), "sgd", kvstore="local", resume="never")


def test_a_trainer_refused_for_its_snapshot_leaves_the_store_as_it_was(tmp_path):
    """A snapshot of another model in checkpoint_dir: the Trainer is refused before it
    touches the store it was given (no key, no optimizer), which another Trainer can
    then take."""
    _run([_model()], 2, tmp_path, 1)
    kv = gpukv.create("local")
    other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    with pytest.raises(gpukv.CheckpointError, match="another model's snapshot"):
        gt.Trainer(other, "sgd", dict(PARAMS), kvstore=kv, checkpoint_dir=tmp_path)
    assert kv.keys() == [] and not kv.has_updater
    trainer = gt.Trainer(other, "sgd", dict(PARAMS), kvstore=kv)
    assert kv.keys() == list(trainer.buckets) and kv.has_updater


def _linear(seed):
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


def _step(trainer, model):
    trainer.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    trainer.step()


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_two_trainers_of_one_process_in_one_folder_are_refused(tmp_path, update_on_kvstore):
    """A second Trainer (a GAN's discriminator beside its generator) made with the
    checkpoint_dir a live Trainer of the process snapshots into is an ArgumentError
    naming the folder, before it resumes the other model's weights; the first goes on,
    and the second can be made with a folder of its own."""
    generator, discriminator = _linear(1), _linear(2)
    options = {"update_on_kvstore": update_on_kvstore, "checkpoint_every": 1}
    g = _trained(tmp_path / "gan", generator, steps=2, **options)
    before = _bits([discriminator])
    with pytest.raises(gpukv.ArgumentError,
                       match=re.escape(f"{tmp_path / 'gan'}: a 'local' store of this "
                                       f"process snapshots into this folder already")
                       + ".*Give each model its own checkpoint_dir"):
        gt.Trainer(discriminator, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   checkpoint_dir=tmp_path / "gan", **options)
    assert _bits([discriminator]) == before
    d = _trained(tmp_path / "d", discriminator, steps=1, **options)
    assert d.resumed_from is None
    _step(g, generator)  # (the generator's Trainer steps and snapshots on)
    g.close()
    assert [s.step for s in snapshots.complete_snapshots(tmp_path / "gan")] == [2, 3]


def test_a_trainer_made_again_in_its_folder_takes_it_over(tmp_path):
    """The folder of a live Trainer goes to one made again on its modules (which the
    old one steps no more), back to it when the new one fails to resume, and to one on
    a fresh model once the last is closed (a `with` block left by an exception)."""
    model = _linear(1)
    old = _trained(tmp_path, model, steps=2, checkpoint_every=1)
    old.finish_snapshots()
    newest = snapshots.latest_snapshot(tmp_path)
    shard = pathlib.Path(newest.path) / snapshots.shard_file(0, 1)
    shard.write_bytes(b"damaged")
    with pytest.raises(gpukv.CheckpointError, match=re.escape(str(shard))) as refused:
        gt.Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore="local",
                   checkpoint_dir=tmp_path)
    _step(old, model)  # (the folder, and the modules, are the old one's again)
    assert refused.traceback  # (which keeps the Trainer that failed, and its store)
    old.finish_snapshots()
    again = _trained(tmp_path, model, steps=0, checkpoint_every=1)
    assert again.resumed_from.step == 3
    with pytest.raises(RuntimeError, match="stopped"):
        with again:
            _step(again, model)
            raise RuntimeError("stopped")
    fresh = _linear(3)
    last = _trained(tmp_path, fresh, steps=1, checkpoint_every=1)
    assert last.resumed_from.step == 4 and last.steps == 5
    assert old is not None and again is not None  # (both live)


def test_a_trainer_made_again_resumes_the_snapshot_still_being_written(tmp_path,
                                                                       monkeypatch):
    """A Trainer made again on the modules of one whose last snapshot is still being
    written waits for it, and resumes from it, not from the one before."""
    model = _linear(1)
    old = _trained(tmp_path, model, steps=1, checkpoint_every=1)
    old.finish_snapshots()
    writing, may_end = threading.Event(), threading.Event()
    write_archive = snapshots.write_archive

    def slow_write(*args, **kw):
        writing.set()
        assert may_end.wait(30), "the write was never let end"
        return write_archive(*args, **kw)

    monkeypatch.setattr(snapshots, "write_archive", slow_write)
    _step(old, model)  # (its snapshot of step 2 waits in its writer thread)
    assert writing.wait(30)
    threading.Timer(0.2, may_end.set).start()
    again = gt.Trainer(model, "sgd", {"learning_rate": 0.1}, kvstore="local",
                       checkpoint_dir=tmp_path)
    assert (again.resumed_from.step, again.steps) == (2, 2)
    assert old is not None  # (live)


def test_a_trainer_stepped_after_close_frees_its_folder_at_the_next_close(tmp_path):
    """A closed Trainer that steps again takes its folder back at its snapshot; closing
    it again frees the folder for a Trainer on another model."""
    model = _linear(1)
    trainer = _trained(tmp_path, model, steps=1, checkpoint_every=1)
    trainer.close()
    _step(trainer, model)
    trainer.close()
    fresh = _linear(2)
    other = gt.Trainer(fresh, "sgd", {"learning_rate": 0.1}, kvstore="local",
                       checkpoint_dir=tmp_path, resume="never", checkpoint_every=1)
    _step(other, fresh)
    other.finish_snapshots()
    newest = snapshots.latest_snapshot(tmp_path)  # (the other model's, a run of its own)
    assert (newest.step, newest.run) == (1, 2)
    assert trainer is not None  # (still live)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_a_user_state_a_due_snapshot_cannot_save_is_refused_before_the_step(
        tmp_path, update_on_kvstore):
    """The step a snapshot is due after checks that it can save user_state first: an
    ArgumentError naming the place, the weights and `steps` unchanged, and the same step
    taken once the state is fixed."""
    model = _model()
    trainer = gt.Trainer(model, "sgd", dict(PARAMS), kvstore="local",
                         update_on_kvstore=update_on_kvstore, checkpoint_dir=tmp_path,
                         checkpoint_every=2)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    trainer.user_state = {"epoch_of": {3: "x"}}  # an int key: JSON keeps str keys only
    for expected_steps in (1, 2):
        trainer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if expected_steps == 1:  # no snapshot due: the state is not checked yet
            trainer.step()
            continue
        before = _bits([model])
        with pytest.raises(gpukv.ArgumentError,
                           match=r"trainer.user_state\['epoch_of'\]: key 3"):
            trainer.step()
        assert _bits([model]) == before and trainer.steps == 1
    trainer.user_state = [("epoch", 3)]  # no dict at all: the same, as a TypeError
    with pytest.raises(gpukv.ArgumentKindError, match=r"trainer.user_state: expected a dict"):
        trainer.step()
    assert _bits([model]) == before and trainer.steps == 1
    trainer.user_state = {"epoch_of": {"3": "x"}}
    trainer.step()
    trainer.finish_snapshots()
    assert trainer.steps == 2
    assert snapshots.latest_snapshot(tmp_path).step == 2


def test_auto_resumes_the_last_run_not_an_earlier_runs_higher_step(tmp_path):
    """A run started afresh (resume='never') in the folder of a run that reached a
    higher step, then restarted with resume='auto': it resumes its own newest snapshot."""
    folder = tmp_path / "ckpt"
    _trained(folder, nn.Linear(4, 2), steps=6, checkpoint_every=1).close()
    torch.manual_seed(7)
    model = nn.Linear(4, 2)
    _trained(folder, model, steps=2, checkpoint_every=1, resume="never").close()
    again = gt.Trainer(nn.Linear(4, 2), "sgd", {"learning_rate": 0.1}, kvstore="local",
                       checkpoint_dir=folder)
    assert again.steps == 2 and again.resumed_from.run == 2
    assert _bits([again._modules[0]]) == _bits([model])


def test_a_run_resumed_from_an_older_snapshot_keeps_its_own(tmp_path):
    """resume=PATH of an older snapshot, then steps: pruning keeps the new snapshots (the
    newest, though an earlier run reached higher steps), and 'auto' resumes them."""
    folder = tmp_path / "ckpt"
    _trained(folder, nn.Linear(4, 2), steps=4, checkpoint_every=1, checkpoint_keep=4).close()
    older = snapshots.complete_snapshots(folder)[0]
    model = nn.Linear(4, 2)
    trainer = _trained(folder, model, steps=1, checkpoint_every=1, resume=older.path)
    trainer.close()
    assert trainer.steps == older.step + 1
    newest = gpukv.latest_snapshot(folder)
    assert (newest.run, newest.step) == (2, older.step + 1)
    again = gt.Trainer(nn.Linear(4, 2), "sgd", {"learning_rate": 0.1}, kvstore="local",
                       checkpoint_dir=folder)
    assert again.resumed_from.path == newest.path
    assert _bits([again._modules[0]]) == _bits([model])


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_an_export_gets_a_new_files_permissions_or_the_old_ones(tmp_path, umask):
    """The safetensors file has what `open` would give a new file (0o666 less the umask:
    another account can read it where the umask lets it), not safetensors' 0o600; one
    exported over keeps its own."""
    pytest.importorskip("safetensors")
    from gpukv.torch.export import export_safetensors
    _exported(tmp_path / "ckpt")
    out = tmp_path / "model.safetensors"
    before = os.umask(umask)
    try:
        export_safetensors(tmp_path / "ckpt", out)
        assert out.stat().st_mode & 0o777 == 0o666 & ~umask
        out.chmod(0o604)
        export_safetensors(tmp_path / "ckpt", out)
        assert out.stat().st_mode & 0o777 == 0o604
    finally:
        os.umask(before)


def test_exports_to_one_file_at_once_each_write_their_own(tmp_path, monkeypatch):
    """Four threads exporting to one OUT at once (each written, none renamed yet): every
    one succeeds, OUT is a whole export and no temporary file or folder is left."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from gpukv.torch.export import export_safetensors
    _exported(tmp_path / "ckpt")
    real = safetensors_torch.save_file
    written = threading.Barrier(4, timeout=60)

    def at_once(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        written.wait()
    monkeypatch.setattr(safetensors_torch, "save_file", at_once)
    out = tmp_path / "model.safetensors"
    errors: list = []

    def export():
        try:
            export_safetensors(tmp_path / "ckpt", out)
        except Exception as exc:  # a raw OS error as well as a CheckpointError
            errors.append(exc)
    threads = [threading.Thread(target=export) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.safetensors"]
    assert sorted(safetensors_torch.load_file(str(out))) == ["bias", "weight"]


def test_an_export_is_fsynced_before_and_after_its_rename(tmp_path, monkeypatch):
    """As `kv.save` writes: the file is fsynced (before it is renamed to OUT), then the
    folder that holds OUT."""
    pytest.importorskip("safetensors")
    from gpukv.torch.export import export_safetensors
    _exported(tmp_path / "ckpt")
    real = os.fsync
    synced: list = []

    def fsync(fd):
        st = os.fstat(fd)
        synced.append((stat.S_ISDIR(st.st_mode), st.st_ino))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "model.safetensors"
    export_safetensors(tmp_path / "ckpt", out)
    file, folder = (False, out.stat().st_ino), (True, tmp_path.stat().st_ino)
    assert file in synced and folder in synced
    assert synced.index(file) < len(synced) - 1 - synced[::-1].index(folder)


def test_an_export_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path):
    """OUT a symlink: the file it names is written (with that file's permissions), the
    link stays a link, and nothing is left beside either."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from gpukv.torch.export import export_safetensors
    _exported(tmp_path / "ckpt")
    target = tmp_path / "kept" / "model.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"an older export")
    target.chmod(0o640)
    link = tmp_path / "model.safetensors"
    link.symlink_to(target)
    export_safetensors(tmp_path / "ckpt", link)
    assert link.is_symlink() and link.resolve() == target
    assert sorted(safetensors_torch.load_file(str(target))) == ["bias", "weight"]
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "kept", "model.safetensors"]
    assert [p.name for p in target.parent.iterdir()] == ["model.safetensors"]


@pytest.mark.parametrize("written", [False, True], ids=["before the write", "written"])
def test_a_killed_export_leaves_one_hidden_folder_named_after_it(tmp_path, written):
    """A process killed while it exports (before safetensors writes, or once it has
    written and before the rename) leaves OUT as it was and, beside it, one hidden
    folder `.OUT.<random letters>.tmp` holding at most the file written."""
    pytest.importorskip("safetensors")
    _exported(tmp_path / "ckpt")
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"an older export")
    script = (
        "import os, signal, gpukv.torch, safetensors.torch\n"
        "from gpukv.torch.export import export_safetensors\n"
        "real = safetensors.torch.save_file\n"
        "def killed(tensors, path, metadata=None):\n"
        f"    if {written}:\n"
        "        real(tensors, path, metadata=metadata)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "safetensors.torch.save_file = killed\n"
        f"export_safetensors({str(tmp_path / 'ckpt')!r}, {str(out)!r})\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert out.read_bytes() == b"an older export"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 3 and left[1:] == ["ckpt", "model.safetensors"], left
    assert re.fullmatch(r"\.model\.safetensors\.[^.]+\.tmp", left[0]), left
    assert (tmp_path / left[0]).is_dir()
    inside = [p.name for p in (tmp_path / left[0]).iterdir()]
    assert inside == (["model.safetensors"] if written else [])

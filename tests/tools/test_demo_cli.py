"""The `gpukv` command line: `python -m gpukv demo`, `--help`, and dispatch to bench / info."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv import __main__ as cli
from gpukv.tools import demo as _demo

from .. import gpu_env

REPO = Path(__file__).resolve().parents[2]


def _run(*args, code=None, timeout=60, gpus=False):
    """`python -m gpukv *args` (or `-c code`): on the host, or with this run's GPUs."""
    env = gpu_env.subprocess_env(gpus=gpus)
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "gpukv", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO, stdin=subprocess.DEVNULL)


TUTORIAL_LINES = [
    "kv.init(3, ones*2); kv.pull(3, out=a)",
    "update on key: 3",
    "update on key: 9",
    "b[1][1]",
    "tutorial: all 10 steps match",
]


def test_demo_default():
    """`python -m gpukv demo` checks the tutorial, trains, and exits 0 with a falling loss."""
    done = _run("demo")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for line in TUTORIAL_LINES + ["training: loss fell from", "demo: OK"]:
        assert line in out
    assert "MISMATCH" not in out and "FAILED" not in out
    assert "-> all 2   ok" in out and "-> all 11   ok" in out


def test_demo_on_host_devices():
    """--cpu --devices N trains on N host devices and logs the loss at regular steps."""
    done = _run("demo", "--cpu", "--devices", "3", "--steps", "40", "--progress", "plain")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    out = done.stdout
    assert "on 3 host device(s) (NumPy)" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps[0].startswith("step    1/40") and steps[-1].startswith("step   40/40")
    losses = [float(line.split("loss")[1].split()[0]) for line in steps]
    assert losses[-1] < 0.8 * losses[0]


def test_demo_with_numpy_only():
    """Without tqdm, rich, CuPy, torch or ml_dtypes the demo still runs (plain progress)."""
    code = textwrap.dedent("""
        import sys
        for name in ("tqdm", "rich", "cupy", "torch", "ml_dtypes", "jax"):
            sys.modules[name] = None  # makes `import name` fail
        from gpukv.__main__ import main
        sys.exit(main(["demo", "--steps", "30", "--progress", "tqdm"]))
    """)
    done = _run(code=code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo: OK" in done.stdout
    assert "tqdm is not installed" in done.stderr


def test_demo_with_tqdm():
    """With tqdm the bar goes to stderr and the loss lines still reach stdout."""
    pytest.importorskip("tqdm")
    done = _run("demo", "--cpu", "--skip-tutorial", "--steps", "30", "--progress", "tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step   30/30" in done.stdout and "demo: OK" in done.stdout


def test_demo_fails_on_wrong_values(monkeypatch, capsys):
    """A store that returns wrong values makes the demo report MISMATCH and exit 1."""
    from gpukv.store.local import LocalStore  # the demo's stores are one-process ones
    real_pull = LocalStore.pull

    def wrong_pull(self, key, out=None, priority=0, ignore_sparse=True):
        real_pull(self, key, out=out, priority=priority, ignore_sparse=ignore_sparse)
        if isinstance(out, np.ndarray):
            out += 1

    monkeypatch.setattr(LocalStore, "pull", wrong_pull)
    assert cli.main(["demo", "--cpu", "--steps", "5", "--progress", "plain"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH: expected all 2" in out and "demo: FAILED" in out


def test_demo_fails_when_loss_does_not_fall(capsys):
    """With a zero learning rate the loss stays put, and the demo says so and exits 1."""
    assert _demo.main(["--cpu", "--skip-tutorial", "--steps", "5", "--lr", "0",
                       "--progress", "plain"]) == 1
    out = capsys.readouterr().out
    assert "the loss did not fall" in out and "demo: FAILED" in out


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--devices", "-1"], ["--nope"],
                                 ["--seed", "-1"]])
def test_demo_bad_options(bad, capsys):
    """Bad demo options are usage errors (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *bad])
    assert exc.value.code == 2


@pytest.mark.parametrize("lr", ["-1", "nan", "inf", "-1e-3", "fast"])
def test_demo_bad_learning_rate_is_a_usage_error(lr, capsys):
    """A learning rate that is negative, not finite or no number is one argparse
    `error:` line naming --lr and the value (exit 2), not a traceback from the optimizer."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--lr", lr, "--cpu", "--skip-tutorial", "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert "argument --lr" in line and repr(lr) in line


def test_a_malformed_setting_is_one_line_and_status_2(monkeypatch, capsys):
    """GPUKV_DETERMINISTIC=maybe: `gpukv demo` says so in one line (exit 2), as
    `gpukv demo --dist` does, rather than with a traceback."""
    monkeypatch.setenv("GPUKV_DETERMINISTIC", "maybe")
    assert cli.main(["demo", "--cpu", "--skip-tutorial", "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        "gpukv demo: GPUKV_DETERMINISTIC='maybe': expected 1 (on) or 0 (off)\n")


@pytest.mark.parametrize("argv", [["export", "--help"], ["export", "ckpt", "m.safetensors"]])
def test_a_command_whose_library_is_missing_says_what_to_install(argv):
    """Without PyTorch, `gpukv export --help` shows its usage (exit 0), and an export
    is one line with the install hint (exit 2)."""
    done = _run(code=textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # makes `import torch` fail
        from gpukv.__main__ import main
        sys.exit(main({argv!r}))
    """))
    if "--help" in argv:
        assert done.returncode == 0 and done.stdout.startswith("usage: gpukv export"), (
            done.stdout + done.stderr)
        assert "snapshot" in done.stdout and "PyTorch" in done.stdout
        return
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "gpukv export: gpukv.torch needs PyTorch: pip install torch (and for exports "
        "safetensors and ml_dtypes: pip install 'gpukv[torch]')"]


def test_help():
    """`python -m gpukv --help` lists the commands and exits 0."""
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    for command in ("demo", "bench", "info"):
        assert command in done.stdout
    assert done.stdout.startswith("usage: gpukv")


def test_demo_help():
    """`python -m gpukv demo --help` shows the demo's own options."""
    done = _run("demo", "--help")
    assert done.returncode == 0, done.stderr
    for option in ("--devices", "--steps", "--cpu", "--progress"):
        assert option in done.stdout


def test_no_command_and_unknown_command():
    """No command or an unknown one is a usage error (exit status 2)."""
    assert _run().returncode == 2
    done = _run("frobnicate")
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_version():
    """`--version` prints the package version."""
    done = _run("--version")
    assert done.returncode == 0 and gpukv.__version__ in done.stdout


@pytest.mark.parametrize("command", ["bench", "info"])
def test_dispatch_forwards_arguments(monkeypatch, command):
    """`gpukv bench ...` / `gpukv info ...` hand every later argument to that module's main."""
    seen = []
    fake = types.ModuleType(f"gpukv.tools.{command}")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, f"gpukv.tools.{command}", fake)
    assert cli.main([command, "--json", "x.json", "--help"]) == 7
    assert seen == [["--json", "x.json", "--help"]]


def test_dispatch_missing_module(monkeypatch, capsys):
    """A command whose module is not installed says so and exits 2."""
    monkeypatch.setitem(sys.modules, "gpukv.tools.info", None)
    assert cli.main(["info"]) == 2
    assert "not available" in capsys.readouterr().err


def test_console_script_declared():
    """pyproject declares the `gpukv` console script as gpukv.__main__:main."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["gpukv"] == "gpukv.__main__:main"


@pytest.mark.gpu
def test_demo_on_gpus():
    """With GPUs the demo runs the tutorial and the training on them, with CuPy arrays."""
    done = _run("demo", "--steps", "40", timeout=300, gpus=True)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "tutorial: gpukv.create('device') with CuPy arrays" in out
    assert out.count("tutorial: all 10 steps match") == 2
    assert "(CuPy)" in out and "demo: OK" in out


def test_demo_passes_when_the_final_loss_is_below_the_first(capsys):
    """A short training whose loss ends below where it started passes (exit 0, 'loss fell')."""
    assert _demo.main(["--cpu", "--skip-tutorial", "--steps", "10", "--progress", "plain"]) == 0
    out = capsys.readouterr().out
    assert "training: loss fell from" in out and "demo: OK" in out
    assert "FAILED" not in out


def test_demo_fails_when_the_loss_diverges(capsys):
    """A learning rate so large that the loss ends above where it started fails (exit 1)."""
    assert _demo.main(["--cpu", "--skip-tutorial", "--steps", "10", "--lr", "50",
                       "--progress", "plain"]) == 1
    out = capsys.readouterr().out
    assert "the loss did not fall" in out and "demo: FAILED" in out


@pytest.mark.parametrize("option", ["--devices", "--steps"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_demo_counts_below_one_are_usage_errors(option, value, capsys):
    """--devices and --steps below 1 are argparse errors (exit 2) that name the option."""
    with pytest.raises(SystemExit) as exc:
        _demo.main([option, value, "--cpu", "--skip-tutorial", "--progress", "plain"]
                   + (["--steps", "1"] if option == "--devices" else []))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "at least 1" in err


@pytest.mark.parametrize("buffered", [True, False])
@pytest.mark.parametrize("args, status", [(["demo", "--steps", "2"], 1), (["info"], 1),
                                          (["bench", "--help"], None), (["--help"], None)])
def test_closed_stdout_ends_quietly(args, status, buffered):
    """Every command whose reader has gone away (`gpukv demo | head -1`) stops with no
    traceback, and with exit status 1 (argparse's --help already ignores a failed write)."""
    import os
    env = gpu_env.subprocess_env(gpus=False)
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        done = subprocess.run([sys.executable, "-m", "gpukv", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO,
                              env=env, stdin=subprocess.DEVNULL)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    if status is not None:
        assert done.returncode == status


def test_tutorial_output_reads_as_an_aligned_table():
    """The tutorial's rows keep one column for '->', and what its updater prints is shown
    indented under the row of the call that ran it, never as a row of its own."""
    import io
    out = io.StringIO()
    assert _demo.run_tutorial(_demo._Place(4, []), out=out)
    lines = out.getvalue().splitlines()
    body = lines[1:-1]  # between the "tutorial: ..." header and its verdict
    rows = [line for line in body if " -> " in line]
    assert len(rows) == 10
    assert len({row.index(" -> ") for row in rows}) == 1
    printed = [line for line in body if " -> " not in line]
    assert [line.split("update on key: ")[1] for line in printed] == \
        ["3", "5", "7", "9", "5", "7", "9"]
    assert all(line.startswith("      ") for line in printed)
    assert body.index(printed[0]) == body.index(next(r for r in rows if "push(3, ones)" in r)) + 1


HIDE_TORCH = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # makes `import torch` fail, as in a venv without it
    from gpukv.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


def _step_losses(out: str) -> list:
    return [float(line.split("loss")[1].split()[0]) for line in out.splitlines()
            if line.startswith("step ")]


def test_demo_trains_with_the_torch_trainer_when_torch_is_installed(capsys):
    """With PyTorch importable the training runs CPU replicas through gpukv.torch.Trainer
    and passes (loss fell, replicas agree)."""
    pytest.importorskip("torch")
    import torch  # noqa: F401  (the test is about the path taken when it imports)
    assert _demo.main(["--cpu", "--skip-tutorial", "--steps", "20", "--progress", "plain"]) == 0
    out = capsys.readouterr().out
    assert "training with gpukv.torch.Trainer on 4 replicas" in out
    assert "gpukv.create('local'), 4 keys" not in out
    assert "training: loss fell from" in out and "demo: OK" in out and "FAILED" not in out
    lines = out.splitlines()
    final = next(line for line in lines if line.startswith("final"))
    last_step = [line for line in lines if line.startswith("step ")][-1]
    assert final.index("loss") == last_step.index("loss")  # one column for the losses


def test_demo_without_torch_trains_on_arrays():
    """With `import torch` failing the demo trains on NumPy arrays against the store
    directly, says so as before, and passes."""
    done = _run("demo", "--cpu", "--skip-tutorial", "--steps", "20", "--progress", "plain",
                code=HIDE_TORCH)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "gpukv.torch.Trainer" not in out
    assert "training: gpukv.create('local'), 4 keys ['w1', 'b1', 'w2', 'b2']" in out
    assert "training: loss fell from" in out and "demo: OK" in out


def test_demo_engines_train_the_same_model():
    """The Trainer and the array path train the same MLP on the same data with the same
    SGD, so their step losses agree (up to float32 rounding)."""
    pytest.importorskip("torch")
    args = ("demo", "--cpu", "--skip-tutorial", "--steps", "20", "--progress", "plain")
    with_torch = _run(*args)
    without = _run(*args, code=HIDE_TORCH)
    assert "gpukv.torch.Trainer" in with_torch.stdout
    assert "gpukv.torch.Trainer" not in without.stdout
    assert _step_losses(with_torch.stdout) == pytest.approx(_step_losses(without.stdout),
                                                            abs=2e-3)


def test_demo_trainer_replicas_that_drift_apart_fail(monkeypatch, capsys):
    """If the Trainer's replicas end with different weights the demo says so and exits 1."""
    pytest.importorskip("torch")
    import torch

    import gpukv.torch as gt
    real_step = gt.Trainer.step

    def drifting_step(self, batch_size, ignore_stale_grad=False):
        real_step(self, batch_size, ignore_stale_grad)
        with torch.no_grad():
            next(self._modules[-1].parameters()).add_(1e-3)

    monkeypatch.setattr(gt.Trainer, "step", drifting_step)
    assert _demo.main(["--cpu", "--skip-tutorial", "--steps", "5", "--progress", "plain"]) == 1
    out = capsys.readouterr().out
    assert "the devices pulled different weights" in out and "demo: FAILED" in out


def test_demo_trainer_replicas_follow_the_demo_devices(monkeypatch):
    """Host devices give CPU replicas; GPU devices give CUDA replicas on the same GPUs only
    when PyTorch sees them, else None (the array path trains)."""
    pytest.importorskip("torch")
    import torch
    gpus = [types.SimpleNamespace(physical=0, xp=np), types.SimpleNamespace(physical=1, xp=np)]
    assert _demo._torch_devices(_demo._Place(3, [])) == [torch.device("cpu")] * 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _demo._torch_devices(_demo._Place(3, gpus)) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _demo._torch_devices(_demo._Place(3, gpus)) is None  # GPU 1 unseen by PyTorch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _demo._torch_devices(_demo._Place(3, gpus)) == \
        [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0)]


# ------------------------------------------------------------- --dist: across MPI processes


def _dist_demo(*args, torch: bool = True, **options):
    """`mpiexec -n N python -m mpi4py -m gpukv demo --dist *args` (skips without MPI);
    with `torch=False` as where PyTorch is not installed."""
    from ..distributed.mpirun import run
    if torch:
        pytest.importorskip("torch")
        program, module = "gpukv", True
    else:
        program, module = "demo_without_torch.py", False
    return run(program, options.pop("n", 3), "demo", "--dist", "--progress", "plain", *args,
               module=module, **options)


@pytest.mark.mpi
@pytest.mark.parametrize("torch", [True, False])
def test_demo_dist_trains_across_three_processes(torch):
    """`mpiexec -n 3 ... gpukv demo --dist`: three workers, each serving a shard, train
    with a falling loss and the same weights (gpukv.torch.Trainer with PyTorch, arrays
    pushed to the store without); only worker 0 prints."""
    from ..distributed.mpirun import ok
    out = ok(_dist_demo("--steps", "20", torch=torch))
    assert "demo across 3 MPI process(es)" in out
    kind = "PyTorch" if torch else "NumPy"
    assert f"3 worker process(es), each serving a shard ({kind})" in out
    if torch:
        assert "gpukv.torch.Trainer on 1 replicas: gpukv.create('dist_sync')" in out
        assert "step(batch_size=1536)" in out  # every worker's samples
    else:
        assert ("gpukv.create('dist_sync', num_servers=0), 4 keys ['w1', 'b1', 'w2', 'b2']"
                in out)
    assert "training: loss fell from" in out and "FAILED" not in out
    assert out.count("demo: OK") == 1 and out.count("step    1/20") == 1  # the others are silent


@pytest.mark.mpi
def test_demo_dist_with_a_dedicated_server():
    """`--num-servers 1` on 3 processes: rank 0 serves, the 2 others train."""
    from ..distributed.mpirun import ok
    out = ok(_dist_demo("--num-servers", "1", "--steps", "20", torch=False))
    assert "2 worker process(es), 1 dedicated server(s)" in out
    assert "num_servers=1" in out
    assert "training: loss fell from" in out and out.count("demo: OK") == 1


@pytest.mark.mpi
@pytest.mark.parametrize("torch", [True, False])
def test_demo_dist_losses_match_the_one_process_demo(torch):
    """Three workers on dist_sync train exactly what one process does on 3 host devices:
    the same data shards, weights and SGD, so the same step losses (up to rounding)."""
    from ..distributed.mpirun import ok
    dist = ok(_dist_demo("--steps", "20", torch=torch))
    local = _run("demo", "--cpu", "--devices", "3", "--skip-tutorial", "--steps", "20",
                 "--progress", "plain", code=None if torch else HIDE_TORCH)
    assert local.returncode == 0, local.stdout + local.stderr
    assert len(_step_losses(dist)) == 11  # step 1 and every 2nd
    assert _step_losses(dist) == pytest.approx(_step_losses(local.stdout), abs=2e-4)


@pytest.mark.mpi
def test_demo_dist_fails_when_loss_does_not_fall():
    """With a zero learning rate every worker reports failure: a non-zero exit status."""
    done = _dist_demo("--steps", "3", "--lr", "0")
    assert done.returncode != 0
    assert "the loss did not fall" in done.stdout and "demo: FAILED" in done.stdout


@pytest.mark.mpi
def test_demo_dist_fails_when_workers_drift_apart(tmp_path):
    """A worker whose weights differ from the others' at the end fails the demo."""
    from ..distributed.mpirun import run
    program = tmp_path / "drift.py"
    program.write_text(textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # the array training, whose copies are plain arrays
        from gpukv.tools import demo
        real_step = demo._ArrayWorker.step

        def drifting_step(self):
            result = real_step(self)
            if self.kv.rank == 1:
                self.local["b2"] += 1e-3  # after the pull: this worker's copy only
            return result

        demo._ArrayWorker.step = drifting_step
        sys.exit(demo.main(["--dist", "--steps", "5", "--progress", "plain"]))
    """))
    done = run(program, 3)
    assert done.returncode != 0
    assert "FAILED: the workers hold different weights" in done.stdout


@pytest.mark.mpi
def test_demo_dist_without_mpiexec_trains_one_worker():
    """`python -m gpukv demo --dist` outside an MPI job trains a single worker."""
    from ..distributed.mpirun import require_mpi
    require_mpi()
    done = _run("demo", "--dist", "--steps", "10", "--progress", "plain")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 worker process(es)" in done.stdout and "demo: OK" in done.stdout


@pytest.mark.parametrize("bad, says", [
    (["--dist", "--devices", "2"], "--devices: with --dist each process is one worker"),
    (["--num-servers", "1"], "--num-servers needs --dist"),
    (["--dist", "--num-servers", "-1"], "argument --num-servers: must be at least 0")])
def test_demo_dist_usage_errors(bad, says, capsys):
    """--devices with --dist, --num-servers without it, or below 0: usage errors (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        _demo.main(bad)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err

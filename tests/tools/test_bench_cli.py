"""Command lines of `gpukv bench` and benchmarks/*.py: bad values are argparse errors,
skips and failures are told apart, the progress bar and the usage line fit the caller."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpukv.tools import bench as _bench
from gpukv.tools import benchutil

from .. import gpu_env

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# One case of one strategy, as small and short as a run gets.
TINY = ["--host", "--sizes", "4K", "--devices", "2", "--strategies", "local",
        "--cases", "sweep", "--warmup", "0", "--iters", "1", "--copy-size", "64K"]


def _bench_main(argv):
    """(exit status, stdout, stderr) of `gpukv bench argv` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = _bench.main(argv)
        except SystemExit as exc:
            status = exc.code
    return status, out.getvalue(), err.getvalue()


def _record(folder):
    """The one strategies_*.json `gpukv bench --out folder` wrote."""
    (path,) = Path(folder).glob("strategies_*.json")
    return json.loads(path.read_text())


def _script(name, *args):
    """benchmarks/<name> run with `args` in a child process."""
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=gpu_env.subprocess_env())


# ----------------------------------------------------------------- gpukv bench: names
@pytest.mark.parametrize("option, value, valid", [
    ("--strategies", "home,foo", "tree"), ("--baselines", "loop,bar", "torch_stack"),
    ("--cases", "sweep,nope", "small"), ("--goal-strategy", "fast", "ring"),
])
def test_bench_unknown_name_is_an_argument_error(option, value, valid):
    """An unknown strategy, baseline or case stops `gpukv bench` at parsing (exit 2),
    naming the bad value and the valid ones."""
    bad = value.split(",")[-1]
    status, out, err = _bench_main(["--host", option, value, "--out", "-"])
    assert status == 2
    assert f"argument {option}" in err and repr(bad) in err and valid in err
    assert out == ""  # nothing ran


def test_python_m_gpukv_bench_unknown_strategy_exits_2():
    """`python -m gpukv bench --strategies foo` exits 2 with a usage error naming 'foo'."""
    proc = subprocess.run([sys.executable, "-m", "gpukv", "bench", "--strategies", "foo"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=gpu_env.subprocess_env())
    assert proc.returncode == 2
    assert "usage: gpukv bench" in proc.stderr and "'foo'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["--warmup", "-1"], ["--iters", "0"]])
def test_bench_bad_counts_are_argument_errors(argv):
    """Negative warm-up or zero iterations are usage errors (exit 2)."""
    status, _, err = _bench_main(["--host"] + argv + ["--out", "-"])
    assert status == 2 and "usage: gpukv bench" in err


# ----------------------------------------------------- gpukv bench: skips and failures
@pytest.mark.parametrize("argv", [["--sizes", "-4K"], ["--sizes=-4K"], ["--sizes", "4K,-1K"],
                                  ["--small-size", "-4K"]])
def test_bench_negative_size_says_what_is_wrong_with_it(argv):
    """A negative size, even written as a separate word that looks like an option, is an
    argparse error naming the option and saying the size is negative (exit 2)."""
    status, out, err = _bench_main(["--host"] + argv + ["--out", "-"])
    assert status == 2 and out == ""
    assert f"argument {argv[0].split('=')[0]}" in err and "is negative" in err


@pytest.mark.parametrize("option, size, says", [
    ("--small-size", "1", "below one float32 (4 bytes)"),
    ("--goal-size", "0", "below one float32 (4 bytes)"),
    ("--copy-size", "1", "below 4K"), ("--copy-size", "0", "below 4K")])
def test_bench_sizes_too_small_to_measure_are_argument_errors(option, size, says):
    """A key smaller than one float32, or a copy too small to time a bandwidth (which
    divided by zero, and with --calibrate wrote that bandwidth into the file the
    strategies read; 0 took the default silently): exit 2 naming the option."""
    status, out, err = _bench_main(["--host", option, size, "--out", "-"])
    assert status == 2 and out == ""
    assert f"argument {option}: size {size!r}: {says}" in err


@pytest.mark.parametrize("option, size", [("--sizes", "5"), ("--sizes", "4K,6"),
                                          ("--small-size", "6"), ("--goal-size", "4097")])
def test_bench_key_sizes_of_no_whole_number_of_float32_are_argument_errors(option, size):
    """A key size of 5 bytes timed one float32 (4 bytes) and called it 5: a size that
    is not a whole number of float32 values is an argparse error naming the option."""
    status, out, err = _bench_main(["--host", option, size, "--out", "-"])
    assert status == 2 and out == ""
    assert f"argument {option}: size" in err and "not a whole number of 4-byte items" in err


@pytest.mark.parametrize("below", [False, True], ids=["file", "below-a-file"])
def test_bench_out_that_cannot_be_a_folder_is_a_usage_error(tmp_path, below):
    """--out naming a file (or a path below one) is an argparse error at once (exit 2),
    before anything runs, not a FileExistsError once the benchmark is done."""
    file = tmp_path / "results.json"
    file.write_text("{}")
    out_arg = str(file / "r" if below else file)
    status, out, err = _bench_main(TINY + ["--baselines", "", "--out", out_arg])
    assert status == 2 and out == "" and "Traceback" not in err
    assert "argument --out" in err and "file" in err and repr(out_arg) in err
    assert file.read_text() == "{}"


@pytest.mark.parametrize("argv, value", [(["--lr", "-1e-3"], "-1e-3"), (["--n", "-4K"], "-4K"),
                                         (["--n", "-.5"], "-.5"), (["--n=-4K"], "-4K")])
def test_parser_takes_a_negative_looking_word_as_the_value(argv, value):
    """benchutil.ArgumentParser gives a word starting with '-' and a digit to the option
    before it, where plain argparse takes it for an option."""
    parser = benchutil.ArgumentParser()
    parser.add_argument("--lr")
    parser.add_argument("--n")
    args = parser.parse_args(argv)
    assert value in (args.lr, args.n)


def test_missing_torch_baseline_is_skipped_not_failed(monkeypatch, tmp_path):
    """Without PyTorch its baselines are skipped with the reason, and the run exits 0."""
    monkeypatch.setattr(_bench, "_torch", lambda: None)
    status, out, _ = _bench_main(TINY + ["--baselines", "loop,torch_stack", "--out",
                                         str(tmp_path), "--no-progress"])
    assert status == 0
    row = next(r for r in _record(tmp_path)["results"]
               if r["name"] == "torch_stack")
    assert row["path"] == "skipped" and "torch" in row["error"]
    assert "failed" not in out and "skipped" in out


def test_failing_case_makes_the_exit_status_nonzero(monkeypatch, tmp_path):
    """A case that raises is a 'failed' row and makes `gpukv bench` exit non-zero."""
    def broken(name, w):
        raise RuntimeError("broken strategy")
    monkeypatch.setattr(_bench, "_store_step", broken)
    status, out, _ = _bench_main(TINY + ["--baselines", "loop", "--out", str(tmp_path),
                                         "--no-progress"])
    assert status == 1
    row = next(r for r in _record(tmp_path)["results"] if r["name"] == "local")
    assert row["path"] == "error" and "broken strategy" in row["error"]
    assert "failed" in out


# ------------------------------------------------------------------- progress and prog
def test_no_progress_bar_when_stderr_is_not_a_terminal():
    """The tqdm bar is not drawn into a stderr that is not a terminal."""
    pytest.importorskip("tqdm")
    status, _, err = _bench_main(TINY + ["--baselines", "", "--out", "-"])
    assert status == 0
    assert "\r" not in err and "case" not in err


def test_progress_bar_on_request():
    """--progress draws the bar even when stderr is not a terminal."""
    pytest.importorskip("tqdm")
    status, _, err = _bench_main(TINY + ["--baselines", "", "--out", "-", "--progress"])
    assert status == 0 and "case" in err


def test_bench_help_names_gpukv_bench():
    """`gpukv bench --help` starts with 'usage: gpukv bench'."""
    status, out, _ = _bench_main(["--help"])
    assert status == 0 and out.startswith("usage: gpukv bench")


def test_bench_strategies_script_help_names_the_script():
    """benchmarks/bench_strategies.py --help names the script, not `gpukv bench`."""
    proc = _script("bench_strategies.py", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: bench_strategies.py")


# ---------------------------------------------------------------- benchmarks/*.py values
@pytest.mark.parametrize("script, option, value", [
    ("bench_host.py", "--sizes", "4X"),
    ("bench_host.py", "--keys", "10xQ"),
    ("bench_strategies.py", "--sizes", "4X"),
    ("bench_compression.py", "--sizes", "1M,4X"),
    ("bench_compression.py", "--kinds", "3bit"),
    ("bench_optimizers.py", "--sizes", "4X"),
    ("bench_optimizers.py", "--rules", "rmsprop"),
    ("bench_checkpoint.py", "--keys", "10,ten"),
    ("bench_checkpoint.py", "--shape", "2xy"),
    ("simulate_topologies.py", "--machines", "foo"),
    ("simulate_topologies.py", "--sizes", "4X"),
    ("simulate_topologies.py", "--devices", "2,x"),
    ("bench_host.py", "--devices", "0"),
    ("bench_optimizers.py", "--devices", "2,x"),
    ("bench_compression.py", "--iters", "0"),
    ("bench_checkpoint.py", "--warmup", "-1"),
    ("bench_dist.py", "--sizes", "4X"),
    ("bench_dist.py", "--sizes", "-4K"),
    ("bench_cluster.py", "--ways", "s0,fast"),
    ("bench_cluster.py", "--rates", "1gigabit"),
    ("bench_cluster.py", "--hosts", "2,1"),
    ("bench_cluster.py", "--sizes", "16MB,resnet51"),
    ("simulate_topologies.py", "--sizes", "4K,-1K"),
    ("bench_compression.py", "--out", "README.md"),
    ("bench_trainer.py", "--models", "resnet"),
    ("bench_trainer_dist.py", "--models", "resnet"),
    ("bench_trainer_dist.py", "--devices", "2,x"),
    ("bench_trainer_dist.py", "--bucket-mb", "0"),
])
def test_benchmark_script_bad_value_is_an_argument_error(script, option, value):
    """A malformed size, count or name given to a benchmark script is an argparse error
    (exit 2) naming the option and the bad value, not a traceback."""
    if script == "bench_trainer.py":  # it trains PyTorch models: nothing to run without
        pytest.importorskip("torch")
    proc = _script(script, option, value)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"usage: {script}" in proc.stderr and f"argument {option}" in proc.stderr
    bad = value.split(",")[-1]
    assert bad in proc.stderr


@pytest.mark.parametrize("script, argv", [
    ("bench_trainer.py", ["--batch", "3", "--devices", "4"]),
    ("bench_embedding.py", ["--batch", "3", "--devices", "4"]),
    ("bench_accuracy.py", ["--quick", "--batch", "2", "--replicas", "4"]),
])
def test_a_batch_smaller_than_the_replicas_is_a_usage_error(script, argv):
    """A replica without samples has no gradient: a usage error (exit 2), not failed
    cases or meaningless accuracies."""
    pytest.importorskip("torch")
    proc = _script(script, *argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "replicas needs a sample at least" in proc.stderr


def test_the_recorded_command_of_the_gpukv_command_runs_again(monkeypatch):
    """`python -m gpukv bench ...` is recorded as that, not as the path of gpukv's
    __main__.py (which cannot run as a file)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "gpukv" / "__main__.py"), "bench", "--host"])
    assert benchutil.command_line().endswith(" -m gpukv bench --host")
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_dist.py", "--sizes", "4K"])
    assert benchutil.command_line().endswith(" benchmarks/bench_dist.py --sizes 4K")


def test_a_record_names_the_settings_it_ran_with(monkeypatch, tmp_path):
    """A result is read against what changed it: GPUKV_* (and MXNet's MXNET_KVSTORE_*)
    variables set are recorded, others not."""
    for name in [n for n in dict(os.environ)
                 if n.startswith(("GPUKV_", "MXNET_KVSTORE_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GPUKV_DETERMINISTIC", "1")
    monkeypatch.setenv("GPUKV_HOST_THREADS", "2")
    monkeypatch.setenv("MXNET_KVSTORE_TREE_ARRAY_BOUND", "9")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    payload = {"settings": {"sizes": [4096]}, "x": 1}  # (gpukv bench's options, say)
    path = benchutil.write_record(tmp_path / "r.json", payload, "now")
    record = json.loads(path.read_text())
    assert record["environment_variables"] == {
        "GPUKV_DETERMINISTIC": "1", "GPUKV_HOST_THREADS": "2",
        "MXNET_KVSTORE_TREE_ARRAY_BOUND": "9"}
    assert record["settings"] == {"sizes": [4096]} and record["x"] == 1


def test_a_record_names_the_source_and_numba_it_ran_with(tmp_path):
    """A result names the commit of the source that made it (and whether its files had
    changes beside it), and Numba's version (the host codecs' speed follows it)."""
    record = json.loads(benchutil.write_record(tmp_path / "r.json", {}, "now").read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode:  # (a copy of the source outside git: nothing to name)
        assert record["source"] is None
    else:
        assert record["source"]["commit"] == head.stdout.strip()
        assert isinstance(record["source"]["modified"], bool)
    from importlib import metadata
    assert record["numba"] == metadata.version("numba")


def test_a_plot_carries_the_command_that_made_it(monkeypatch, tmp_path):
    """A PNG met alone says how to make it again: the command is written under it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_dist.py", "--sizes", "4K"])
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    written = []
    monkeypatch.setattr(fig, "savefig", lambda path, **kw: written.append(
        ([t.get_text() for t in fig.texts], kw)))
    benchutil.save_figure(fig, tmp_path / "plot.png")
    (texts, options), = written
    assert any(t.endswith(" benchmarks/bench_dist.py --sizes 4K") for t in texts), texts
    assert options.get("bbox_inches") == "tight"  # (the text under the axes is kept)


@pytest.mark.parametrize("text, sizes", [
    ("4K", [4096]), ("4KB,1MiB", [4096, 1 << 20]), ("300", [300]), ("2b", [2]),
    ("4K..64K", [4096, 16384, 65536]),
])
def test_shared_size_parser(text, sizes):
    """benchutil.parse_sizes takes K/M/G (binary), optional B/iB, and A..B ranges."""
    assert benchutil.parse_sizes(text) == sizes


def test_shared_size_parser_errors_are_value_errors():
    """A bad size is both a ValueError and an argparse type error, naming the text."""
    with pytest.raises(ValueError, match="4X") as info:
        benchutil.parse_sizes("1K,4X")
    assert isinstance(info.value, argparse.ArgumentTypeError)


# ------------------------------------------------------------ the shared convention
SCRIPTS = ("bench_host.py", "bench_compression.py", "bench_optimizers.py",
           "bench_checkpoint.py", "bench_trainer.py", "bench_trainer_dist.py", "bench_dist.py",
           "bench_cluster.py", "bench_deterministic.py", "simulate_topologies.py",
           "bench_embedding.py")
OLD_FLAGS = ("--json", "--no-json", "--plot", "--no-plot", "--png", "--replicas")


def _load(name):
    """benchmarks/<name> imported as a module (benchmarks/ on sys.path while it loads)."""
    if name in ("bench_trainer.py", "bench_embedding.py"):
        pytest.importorskip("torch")
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"_script_{Path(name).stem}",
                                                      BENCHMARKS / name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def _parser(name):
    return _bench.build_parser() if name == "gpukv bench" else _load(name).build_parser()


def _options(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


def _parse_error(parser, argv) -> int:
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(argv)
    return info.value.code


@pytest.mark.parametrize("name", SCRIPTS + ("gpukv bench",))
def test_every_option_has_a_help_text(name):
    """Every option of every benchmark script and of `gpukv bench` is explained."""
    parser = _parser(name)
    missing = [a.option_strings for a in parser._actions
               if a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize("name", SCRIPTS + ("gpukv bench",))
def test_shared_options_mean_the_same_everywhere(name):
    """--warmup, --iters and --out everywhere; --sizes in bytes with units and --devices a
    list of counts where a script has them; none of the old output flags."""
    parser = _parser(name)
    options = _options(parser)
    assert {"--warmup", "--iters", "--out"} <= set(options)
    assert not set(OLD_FLAGS) & set(options)
    for option in ("--warmup", "--iters", "--out"):
        assert options[option].help
    assert _parse_error(parser, ["--iters", "0"]) == 2
    assert _parse_error(parser, ["--warmup", "-1"]) == 2
    assert parser.parse_args(["--out", "-"]).out == "-"
    if "--sizes" in options:
        assert parser.parse_args(["--sizes", "4KB,1MB"]).sizes == [4096, 1 << 20]
        assert parser.parse_args(["--sizes", "4K..64K"]).sizes == [4096, 16384, 65536]
        assert _parse_error(parser, ["--sizes", "4X"]) == 2
        assert "bytes" in options["--sizes"].help
    if "--devices" in options:
        assert parser.parse_args(["--devices", "1,2,4"]).devices == [1, 2, 4]
        assert _parse_error(parser, ["--devices", "auto"]) == 2
    if "--host" in options or "--gpu" in options:  # one style of choosing where to run
        assert {"--host", "--gpu"} <= set(options) and "--on" not in options
        assert _parse_error(parser, ["--host", "--gpu"]) == 2


def test_simulation_says_it_ignores_warmup_and_iters():
    """simulate_topologies.py accepts --warmup/--iters and says it ignores them."""
    options = _options(_parser("simulate_topologies.py"))
    assert "ignored" in options["--warmup"].help and "ignored" in options["--iters"].help


# ------------------------------------------------- gpukv bench: where results go
def test_gpukv_bench_without_out_writes_nothing_and_says_so(tmp_path, monkeypatch):
    """Without --out `gpukv bench` writes no file (not into the current folder either)
    and says how to keep the results; `--out -` writes nothing, quietly."""
    monkeypatch.chdir(tmp_path)
    status, out, _ = _bench_main(TINY + ["--baselines", "", "--no-progress"])
    assert status == 0 and "--out DIR" in out and "wrote" not in out
    status, out, _ = _bench_main(TINY + ["--baselines", "", "--no-progress", "--out", "-"])
    assert status == 0 and "--out DIR" not in out and "wrote" not in out
    assert list(tmp_path.iterdir()) == []


def test_gpukv_bench_out_dir_gets_the_json_and_the_chart(tmp_path):
    """--out DIR receives strategies_<device>.json and, with matplotlib, its .png."""
    status, out, _ = _bench_main(TINY + ["--baselines", "", "--no-progress",
                                         "--out", str(tmp_path / "r")])
    assert status == 0
    record = _record(tmp_path / "r")
    assert record["settings"]["sizes"] == [4096]
    pngs = list((tmp_path / "r").glob("strategies_*.png"))
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(pngs) == 1 and f"wrote {pngs[0]}" in out


def test_bench_strategies_default_folder_is_the_callers(tmp_path):
    """benchmarks/bench_strategies.py hands main a default folder (benchmarks/results/):
    without --out the files go there."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = _bench.main(TINY + ["--baselines", "", "--no-progress"],
                             prog="bench_strategies.py", out_default=tmp_path)
    assert status == 0
    assert _record(tmp_path)["benchmark"] == "strategies"


@pytest.mark.skipif(not gpu_env.EMULATED, reason="a GPU may be present")
@pytest.mark.parametrize("script", ["bench_strategies.py", "bench_compression.py",
                                    "bench_optimizers.py"])
def test_gpu_flag_without_a_gpu_exits_1(script):
    """--gpu where no GPU is visible is an error with exit status 1, naming --gpu."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--gpu",
                           "--out", "-"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=gpu_env.subprocess_env(gpus=False))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--gpu" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------- benchmarks/*.py: bytes, files, exit status
def _run(module, argv, capsys) -> tuple[int, str]:
    status = module.main(argv)
    return status, capsys.readouterr().out


def _written(folder, prefix):
    (path,) = Path(folder).glob(f"{prefix}_*.json")
    return json.loads(path.read_text())


def test_compression_sizes_are_bytes_and_a_failed_case_exits_1(tmp_path, monkeypatch,
                                                               capsys):
    """bench_compression.py --sizes 4KB runs 1024 float32 elements and records both; a
    compressor that raises is a failed row and the exit status is 1."""
    mod = _load("bench_compression.py")
    argv = ["--host", "--sizes", "4KB", "--kinds", "fp16", "--warmup", "0", "--iters", "1",
            "--out", str(tmp_path)]
    status, out = _run(mod, argv, capsys)
    assert status == 0 and "1024" in out
    (rec,) = _written(tmp_path, "compression")["results"]
    assert (rec["size"], rec["bytes"]) == (1024, 4096)

    def broken():
        raise RuntimeError("broken compressor")
    monkeypatch.setitem(mod.KINDS, "fp16", broken)
    status, out = _run(mod, argv, capsys)
    assert status == 1 and "failed" in out
    assert "broken compressor" in _written(tmp_path, "compression")["results"][0]["error"]


def test_optimizers_sizes_are_bytes_and_a_failed_case_exits_1(tmp_path, monkeypatch,
                                                              capsys):
    """bench_optimizers.py --sizes 4KB updates keys of 1024 float32 elements, runs every
    device count of --devices, and exits 1 when an update raises."""
    mod = _load("bench_optimizers.py")
    argv = ["--host", "--sizes", "4KB", "--keys", "2", "--rules", "sgd_mom",
            "--devices", "1,2", "--warmup", "0", "--iters", "1", "--out", str(tmp_path)]
    status, _ = _run(mod, argv, capsys)
    assert status == 0
    records = _written(tmp_path, "optimizers_host")["results"]
    assert [(r["size"], r["bytes"], r["devices"]) for r in records] == [
        (1024, 4096, 1), (1024, 4096, 2)]

    def broken():
        raise RuntimeError("broken rule")
    monkeypatch.setitem(mod.RULES, "sgd_mom", broken)
    status, out = _run(mod, argv, capsys)
    assert status == 1 and "failed" in out


def test_host_sizes_are_bytes_and_a_failed_case_exits_1(tmp_path, monkeypatch, capsys):
    """bench_host.py names and records its cases by bytes (and float32 elements), runs
    every device count, and exits 1 when a case's store fails."""
    mod = _load("bench_host.py")
    monkeypatch.delenv("MXNET_PYTHON", raising=False)
    monkeypatch.setattr(mod, "copy_limit", lambda threads: {
        "limit_Bps": 1e10, "limit_threads": 1, "runs": []})
    argv = ["--sizes", "4KB", "--keys", "3x1KB", "--devices", "2,4", "--rounds", "1",
            "--warmup", "0", "--iters", "1", "--min-time", "0", "--out", str(tmp_path)]
    status, _ = _run(mod, argv, capsys)
    assert status == 0
    results = _written(tmp_path, "host")["results"]
    assert set(results) == {"4K/2dev", "3x1K/2dev", "4K/4dev", "3x1K/4dev"}
    assert (results["4K/4dev"]["bytes_per_key"], results["4K/4dev"]["floats_per_key"]) \
        == (4096, 1024)
    assert results["3x1K/2dev"]["floats_per_key"] == 256

    def broken(case):
        raise RuntimeError("wrong result pulled")
    monkeypatch.setattr(mod, "gpukv_step", broken)
    status, out = _run(mod, argv[:-2] + ["--out", "-"], capsys)
    assert status == 1 and "failed" in out


def test_checkpoint_failed_case_exits_1(tmp_path, monkeypatch, capsys):
    """bench_checkpoint.py runs with --warmup/--iters/--out, and exits 1 on a failure."""
    mod = _load("bench_checkpoint.py")
    argv = ["--keys", "10", "--optimizer", "none", "--warmup", "1", "--iters", "1",
            "--out", str(tmp_path)]
    status, _ = _run(mod, argv, capsys)
    assert status == 0 and _written(tmp_path, "checkpoint")["results"][0]["ok"]

    def broken(*args):
        raise OSError("disk full")
    monkeypatch.setattr(mod, "run_case", broken)
    status, out = _run(mod, argv, capsys)
    assert status == 1 and "FAILED" in out


def test_simulation_writes_json_and_png_into_out(tmp_path, capsys):
    """simulate_topologies.py --out DIR writes simulated_topologies.json (and .png)."""
    mod = _load("simulate_topologies.py")
    status, _ = _run(mod, ["--sizes", "4KB", "--devices", "2", "--machines", "dgx1-v100",
                           "--out", str(tmp_path)], capsys)
    assert status == 0
    record = json.loads((tmp_path / "simulated_topologies.json").read_text())
    assert {r["bytes"] for r in record["results"]} == {4096}
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "simulated_topologies.png").exists()


def test_embedding_benchmark_records_every_way(tmp_path):
    """bench_embedding.py, a small table and one timed step: a record per optimizer and
    way, each with its times and its ratios to the Trainer's rows."""
    pytest.importorskip("torch")
    proc = _script("bench_embedding.py", "--vocab", "500", "--batch", "16", "--warmup", "0",
                   "--iters", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (found,) = tmp_path.glob("embedding_*.json")
    records = json.loads(found.read_text())["results"]
    assert {(r["optimizer"], r["way"]) for r in records} == {
        (o, w) for o in ("sgd", "adam") for w in ("rows", "dense", "torch")}
    for r in records:
        assert r["step_s"] > 0 and r["iteration_s"] >= r["step_s"]
        assert r["step_over_rows"] == pytest.approx(
            r["step_s"] / next(x["step_s"] for x in records
                               if x["way"] == "rows" and x["optimizer"] == r["optimizer"]))


def test_timeline_benchmark_times_steps_with_it_on_and_off(tmp_path):
    """bench_timeline.py, a few rounds: it starts and stops the timeline into the same
    folders again and again, reads a trace back, and writes its JSON and picture."""
    pytest.importorskip("torch")
    proc = _script("bench_timeline.py", "--replicas", "2", "--rounds", "3",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (found,) = tmp_path.glob("timeline_*.json")
    record = json.loads(found.read_text())
    assert set(record["median_step_s"]) == {"off", "on", "off again", "off first"}
    assert record["on_over_off"] == pytest.approx(
        record["median_step_s"]["on"] / record["median_step_s"]["off"])
    assert record["spans_per_step"] > 0
    assert list(tmp_path.glob("timeline_*.png"))
    # the noise ratio's table rows show both of its medians, as the JSON has them
    first, again = (benchutil.format_seconds(record["median_step_s"][k])
                    for k in ("off first", "off again"))
    assert re.search(rf"noise run: off +{re.escape(first)} ", proc.stdout), proc.stdout
    assert re.search(rf"noise run: off again +{re.escape(again)} ", proc.stdout)


def test_jax_benchmark_records_every_way(tmp_path):
    """bench_jax.py on two of JAX's host devices: each way's median, and optax's steps
    beside the store equal to pmean's."""
    pytest.importorskip("jax")
    proc = _script("bench_jax.py", "--devices", "2", "--leaves", "6", "--steps", "2",
                   "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (found,) = tmp_path.glob("jax_*.json")
    record = json.loads(found.read_text())
    assert record["leaves"]["leaves"] == 6
    assert all(ms > 0 for ms in record["leaves"]["median_ms"].values())
    assert all(ms > 0 for ms in record["mlp"]["median_ms"].values())
    assert record["mlp"]["optax_10_steps_largest_difference"][
        "against pmean then the same update"] == 0


@pytest.mark.parametrize("script, argv, says", [
    ("bench_resume.py", ["--hosts", "1"], "argument --hosts: must be at least 2, got 1"),
    ("bench_resume.py", ["--rate", "1zbit"], "argument --rate: link rate '1zbit'"),
    ("bench_resume.py", ["--every", "0"], "argument --every: must be at least 1"),
    ("bench_resume.py", ["--timeout", "0"], "argument --timeout: must be above 0"),
    ("bench_accuracy.py", ["--lr", "0"], "argument --lr: expected a finite number above 0"),
    ("bench_dist.py", ["--libs", "mxnet"], "--libs mxnet needs an interpreter"),
    ("bench_host.py", ["--mxnet-python", "/nonexistent/python"], "no such interpreter"),
    ("bench_trainer_dist.py", ["--devices", "4", "--batch", "2"],
     "--batch 2: each of the 4 replicas needs a sample at least"),
])
def test_benchmark_usage_errors_are_one_line(script, argv, says):
    """A value a benchmark cannot run with is a usage error (exit 2) naming the option,
    before anything runs: no traceback, no emulated hosts built, no run that fails."""
    if script in ("bench_accuracy.py", "bench_trainer_dist.py"):  # (they import it)
        pytest.importorskip("torch")
    proc = _script(script, *argv, "--out", "-")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


#: every benchmark a user runs (the files starting with _ are their helpers)
PUBLIC_SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def _options_without_help(text: str) -> list[str]:
    """The options of an argparse --help text listed with no help after them."""
    lines = text.splitlines()
    lacking = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-{1,2}[\w-]+)(?: [A-Z_.\[\], ]+)?$", line)
        after = lines[i + 1] if i + 1 < len(lines) else ""
        if m and not re.match(r"^ {8,}\S", after):  # nothing beside it, nothing below
            lacking.append(m.group(1))
    return lacking


@pytest.mark.parametrize("name", PUBLIC_SCRIPTS)
def test_every_scripts_help_answers_and_explains_every_option(name):
    """`python benchmarks/NAME --help`, for every benchmark script: status 0, its usage,
    and a help text for every option."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr
    assert _options_without_help(done.stdout) == [], done.stdout

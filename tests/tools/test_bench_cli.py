"""Command lines of `gpukv bench` and benchmarks/*.py: bad values are argparse errors,
skips and failures are told apart, the progress bar and the usage line fit the caller."""
from __future__ import annotations

import contextlib
import io
import json
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
        "--cases", "sweep", "--warmup", "0", "--iters", "1", "--copy-size", "64K",
        "--no-plot"]


def _bench_main(argv):
    """(exit status, stdout, stderr) of `gpukv bench argv` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = _bench.main(argv)
        except SystemExit as exc:
            status = exc.code
    return status, out.getvalue(), err.getvalue()


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
    status, out, err = _bench_main(["--host", option, value, "--no-json", "--no-plot"])
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
    status, _, err = _bench_main(["--host"] + argv + ["--no-json"])
    assert status == 2 and "usage: gpukv bench" in err


# ----------------------------------------------------- gpukv bench: skips and failures
def test_missing_torch_baseline_is_skipped_not_failed(monkeypatch, tmp_path):
    """Without PyTorch its baselines are skipped with the reason, and the run exits 0."""
    monkeypatch.setattr(_bench, "_torch", lambda: None)
    path = tmp_path / "r.json"
    status, out, _ = _bench_main(TINY + ["--baselines", "loop,torch_stack", "--json",
                                         str(path), "--no-progress"])
    assert status == 0
    row = next(r for r in json.loads(path.read_text())["results"]
               if r["name"] == "torch_stack")
    assert row["path"] == "skipped" and "torch" in row["error"]
    assert "failed" not in out and "skipped" in out


def test_failing_case_makes_the_exit_status_nonzero(monkeypatch, tmp_path):
    """A case that raises is a 'failed' row and makes `gpukv bench` exit non-zero."""
    def broken(name, w):
        raise RuntimeError("broken strategy")
    monkeypatch.setattr(_bench, "_store_step", broken)
    path = tmp_path / "r.json"
    status, out, _ = _bench_main(TINY + ["--baselines", "loop", "--json", str(path),
                                         "--no-progress"])
    assert status == 1
    row = next(r for r in json.loads(path.read_text())["results"] if r["name"] == "local")
    assert row["path"] == "error" and "broken strategy" in row["error"]
    assert "failed" in out


# ------------------------------------------------------------------- progress and prog
def test_no_progress_bar_when_stderr_is_not_a_terminal():
    """The tqdm bar is not drawn into a stderr that is not a terminal."""
    pytest.importorskip("tqdm")
    status, _, err = _bench_main(TINY + ["--baselines", "", "--no-json"])
    assert status == 0
    assert "\r" not in err and "case" not in err


def test_progress_bar_on_request():
    """--progress draws the bar even when stderr is not a terminal."""
    pytest.importorskip("tqdm")
    status, _, err = _bench_main(TINY + ["--baselines", "", "--no-json", "--progress"])
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
])
def test_benchmark_script_bad_value_is_an_argument_error(script, option, value):
    """A malformed size, count or name given to a benchmark script is an argparse error
    (exit 2) naming the option and the bad value, not a traceback."""
    proc = _script(script, option, value)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"usage: {script}" in proc.stderr and f"argument {option}" in proc.stderr
    bad = value.split(",")[-1]
    assert bad in proc.stderr


@pytest.mark.parametrize("text, sizes", [
    ("4K", [4096]), ("4KB,1MiB", [4096, 1 << 20]), ("300", [300]), ("2b", [2]),
    ("4K..64K", [4096, 16384, 65536]),
])
def test_shared_size_parser(text, sizes):
    """benchutil.parse_sizes takes K/M/G (binary), optional B/iB, and A..B ranges."""
    assert benchutil.parse_sizes(text) == sizes


def test_shared_size_parser_errors_are_value_errors():
    """A bad size is both a ValueError and an argparse type error, naming the text."""
    import argparse
    with pytest.raises(ValueError, match="4X") as info:
        benchutil.parse_sizes("1K,4X")
    assert isinstance(info.value, argparse.ArgumentTypeError)

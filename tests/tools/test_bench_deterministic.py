"""benchmarks/bench_deterministic.py: what each side passes to the store, its command line,
and a quick run's record."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .. import gpu_env
from ..distributed.mpirun import require_mpi
from .test_bench_cli import BENCHMARKS, ROOT, _load

SIDES = ["default", "deterministic"]
STATS = {"median_s", "min_s", "max_s", "mean_s", "stdev_s", "iters", "spread", "samples_s",
         "of_limit"}


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, str(BENCHMARKS / "bench_deterministic.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=gpu_env.subprocess_env(gpus=False))


@pytest.mark.parametrize("same_order, options", [
    (False, [("default", {}), ("deterministic", {"deterministic": True})]),
    (True, [("default", {}), ("deterministic", {})]),
])
def test_only_the_deterministic_side_passes_the_option(same_order, options):
    """The default side makes its store with no option; the deterministic side passes
    deterministic=True, or nothing under --same-order."""
    assert _load("bench_deterministic.py").side_options(same_order) == options


@pytest.mark.parametrize("option, value", [("--scopes", "process,gpus"),
                                           ("--processes", "2,1"), ("--servers", "2"),
                                           ("--rates", "1gigabit"), ("--sizes", "16MiB,4X")])
def test_bad_value_is_a_usage_error(option, value):
    """A malformed or out-of-range option exits 2 naming the option and the value, before
    anything runs."""
    proc = _run(option, value, "--out", "-")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage: bench_deterministic.py" in proc.stderr
    assert f"argument {option}" in proc.stderr and value.split(",")[-1] in proc.stderr
    assert "Traceback" not in proc.stderr


def _check_case(case: dict) -> None:
    assert case["ok"], case
    for side in SIDES:
        stats = case[side]
        assert STATS <= set(stats)
        assert len(stats["samples_s"]) == stats["iters"] == 2
        assert 0 < stats["min_s"] <= stats["median_s"] <= stats["max_s"]
        assert stats["of_limit"] == pytest.approx(case["limit"]["seconds"] / stats["median_s"])
    assert case["ratio"] == pytest.approx(case["deterministic"]["median_s"]
                                          / case["default"]["median_s"])
    paired = case["ratio_paired"]
    assert paired["min"] <= paired["median"] <= paired["max"]
    assert case["limit"]["seconds"] > 0


def test_quick_run_in_one_process_records_both_sides_and_the_limit(tmp_path):
    """--quick over the one-process stores writes deterministic_<machine>.json and .png:
    per store and size, both sides' timings, their ratio and the memory-bandwidth limit."""
    proc = _run("--quick", "--same-order", "--scopes", "process", "--devices", "2",
                "--iters", "2", "--sizes", "4K,64K", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "took" in proc.stdout and "ratio" in proc.stdout
    (path,) = tmp_path.glob("deterministic_*.json")
    assert list(tmp_path.glob("deterministic_*.png"))
    record = json.loads(path.read_text())
    assert record["settings"]["sides"] == {"default": {}, "deterministic": {}}
    assert record["memory_bandwidth"]["median_Bps"] > 0
    assert record["summary"]["failed"] == 0 and record["summary"]["worst_ratio"] > 0
    cases = record["cases"]
    assert [(c["store"], c["bytes"]) for c in cases] == [
        ("device", 4096), ("device", 65536), ("local", 4096), ("local", 65536)]
    for case in cases:
        _check_case(case)
        assert case["scope"] == "process" and case["devices"] == 2
        assert case["limit"]["seconds"] == pytest.approx(
            2 * 3 * case["bytes"] / record["memory_bandwidth"]["median_Bps"])


def test_quick_run_over_mpi_times_both_sides_and_allreduce_in_one_job(tmp_path):
    """2 processes under mpiexec, S = 0: both sides and the raw Allreduce limit of the same
    bytes, from one job."""
    require_mpi()
    proc = _run("--quick", "--same-order", "--scopes", "processes", "--servers", "0",
                "--iters", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (path,) = tmp_path.glob("deterministic_*.json")
    (case,) = json.loads(path.read_text())["cases"]
    _check_case(case)
    assert (case["scope"], case["processes"], case["workers"], case["servers"]) == (
        "processes", 2, 2, 0)
    assert case["limit"]["kind"] == "MPI Allreduce" and len(case["jobs_s"]) == 1
    assert case["bytes"] == 64 << 10

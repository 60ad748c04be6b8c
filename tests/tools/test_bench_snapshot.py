"""benchmarks/bench_snapshot.py: its command line, and a quick run's record."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from .. import gpu_env
from .test_bench_cli import BENCHMARKS, ROOT, _load

pytest.importorskip("torch")


def _run(*args):
    return subprocess.run([sys.executable, str(BENCHMARKS / "bench_snapshot.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=gpu_env.subprocess_env())


def test_model_has_resnet50s_parameter_count():
    """The default model has ResNet-50's 25.6M parameters (within 0.2%)."""
    mod = _load("bench_snapshot.py")
    count = sum(p.numel() for p in mod.make_model(*mod.FULL).parameters())
    assert abs(count - 25_557_032) / 25_557_032 < 0.002


@pytest.mark.parametrize("argv, bad", [(["--every", "0"], "0"), (["--every", "10,x"], "x"),
                                       (["--store", "nccl"], "nccl"), (["--iters", "0"], "0")])
def test_bad_value_is_a_usage_error(argv, bad):
    """A malformed or out-of-range option exits 2 naming the option and the value, before
    anything runs."""
    proc = _run(*argv, "--out", "-")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage: bench_snapshot.py" in proc.stderr and f"argument {argv[0]}" in proc.stderr
    assert bad in proc.stderr and "Traceback" not in proc.stderr


def test_quick_run_records_every_way_and_the_limits(tmp_path):
    """--quick times the way without snapshots and each --every way, with their staging
    and write times, the memcpy and disk limits and the snapshots' file system, into
    snapshot_<N>threads_<machine>.json in --out."""
    proc = _run("--quick", "--every", "2,1", "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = tmp_path.glob("snapshot_1threads_*.json")
    record = json.loads(path.read_text())["results"]
    assert list(record["ways"]) == ["none", "every 2", "every 1"]
    for name in ("every 2", "every 1"):
        way = record["ways"][name]
        assert way["staging_s"]["median"] > 0 and way["write_s"]["median"] > 0
        assert way["iteration_s"]["n"] == 2
    assert record["ways"]["none"]["staging_s"] is None
    assert record["limits"]["memcpy_s"]["median"] > 0
    assert record["limits"]["disk_write_s"]["median"] > 0
    assert record["file_system"]["type"] and record["threads"] == 1


@pytest.mark.parametrize("samples", [[0.0553, 0.1404], [3.0, 1.0, 2.0], [5.0]])
def test_the_quartiles_lie_within_the_samples(samples):
    """The record's quartiles are the samples' own (NumPy's 'linear'), never outside
    their range, as the exclusive method put them for two samples."""
    pytest.importorskip("torch")
    found = _load("bench_snapshot.py").spread(samples)
    assert found["min"] <= found["q1"] <= found["median"] <= found["q3"] <= found["max"]
    assert found["q1"] == pytest.approx(float(np.percentile(samples, 25)))
    assert found["q3"] == pytest.approx(float(np.percentile(samples, 75)))

"""benchmarks/bench_cluster.py: its ResNet-50 case, and a small run across emulated hosts."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpukv.tools import cluster

from .. import gpu_env
from ..distributed.mpirun import require_mpi
from .test_bench_cli import BENCHMARKS, ROOT, _load

#: torchvision's ResNet-50: 25,557,032 parameters, 4 bytes each
RESNET50_PARAMETERS = 25_557_032


def require_cluster() -> None:
    """Skips without root or ip/tc; fails instead under GPUKV_TEST_CLUSTER=1 (CI)."""
    why = cluster.unavailable()
    if why:
        if os.environ.get("GPUKV_TEST_CLUSTER") == "1":
            pytest.fail(f"{why}; GPUKV_TEST_CLUSTER=1 asks for the cluster tests to run")
        pytest.skip(why)


def test_resnet50_case_has_160_tensors_of_resnet50s_parameters():
    """The 100 MB case is ResNet-50's parameters, its classifier's bias folded into the
    weight: 160 tensors, torchvision's parameter count in all."""
    shapes = _load("bench_cluster.py").resnet50_shapes()
    counts = [math.prod(shape) for _, shape in shapes]
    assert len(shapes) == 160
    assert sum(counts) == RESNET50_PARAMETERS


def test_resnet50_case_goes_through_the_trainers_buckets():
    """The ResNet-50 keys are the Trainer's buckets: every byte in one of them, none over
    the bucket capacity, the classifier (backward's first gradient) in a bucket alone."""
    pytest.importorskip("torch")
    from gpukv.torch.buckets import BUCKET_BYTES

    buckets = _load("bench_cluster.py").resnet50_buckets()
    assert sum(buckets) == 4 * RESNET50_PARAMETERS
    assert 1 < len(buckets) < 160
    assert buckets[-1] == 4 * 1000 * 2049
    assert max(buckets[:-1]) <= BUCKET_BYTES


def test_small_run_across_two_hosts_writes_times_fractions_and_chart(tmp_path):
    """2 emulated hosts at 10 Gb/s, 4 MB: gpukv S=0 and MPI Allreduce (and MXNet given
    MXNET_PYTHON) each time a push+pull, its fraction of the link-bound limit is reported,
    and the JSON and PNG are written."""
    require_cluster()
    require_mpi()
    ways = ["s0", "mpi"] + (["mx-spn"] if os.environ.get("MXNET_PYTHON") else [])
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_cluster.py"), "--hosts", "2",
         "--rates", "10gbit", "--sizes", "4MB", "--ways", ",".join(ways), "--warmup", "1",
         "--iters", "5", "--timeout", "60", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
        env=gpu_env.subprocess_env(gpus=False))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (record,) = [json.loads(p.read_text()) for p in Path(tmp_path).glob("cluster_*.json")]
    assert list(Path(tmp_path).glob("cluster_*.png"))
    cases = {c["way"]: c for c in record["cases"]}
    assert sorted(cases) == sorted(ways)
    limit = 2 * (2 - 1) / 2 * (4 << 20) / (10e9 / 8)
    for way, case in cases.items():
        assert case["ok"], (way, case["error"])
        assert case["limit_s"] == pytest.approx(limit)
        assert 0 < case["min_s"] <= case["median_s"] <= case["max_s"]
        assert case["iters"] == 5
        assert case["fraction_of_limit"] == pytest.approx(limit / case["median_s"])
    assert "gpukv S=0" in proc.stdout and "MPI Allreduce" in proc.stdout


@pytest.mark.parametrize("lib", ["gpukv", "mpi"])
def test_plan_entry_of_several_keys_is_one_checked_iteration(lib, tmp_path):
    """A plan entry whose bytes are a list is one iteration over all those keys (gpukv:
    push then pull of every key; mpi: one Allreduce each), checked and timed under the
    entry's label, beside a one-key entry."""
    mpiexec = require_mpi()
    result = tmp_path / "result.json"
    plan = [[[4096, 12288, 400], 0, 2], [8192, 0, 2]]
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, str(BENCHMARKS / "bench_dist.py"), "--child",
         lib, "--layout", "2w0s", "--plan", json.dumps(plan), "--result", str(result),
         "--no-halves"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(gpu_env.subprocess_env(gpus=False), GPUKV_DIST_TIMEOUT="30"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    timings = json.loads(result.read_text())["timings"]
    assert sorted(timings) == ["3x16784", "8192"]
    assert all(t["check"] and t["iters"] == 2 for t in timings.values())


def _trainer_across_two_hosts(tmp_path, rate: str, ways: str):
    """bench_trainer_dist.py --cluster 2 at `rate` with `ways` (the mlp, no warmup asked,
    2 iterations): the finished process and the JSON it wrote."""
    require_cluster()
    require_mpi()
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_trainer_dist.py"), "--cluster", "2",
         "--rate", rate, "--models", "mlp", "--ways", ways,
         "--warmup", "0", "--iters", "2", "--timeout", "120", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=200, cwd=ROOT,
        env=gpu_env.subprocess_env(gpus=False))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (result,) = Path(tmp_path).glob("trainer_dist_*.json")
    return proc, json.loads(result.read_text())


def test_trainer_benchmark_across_two_hosts_matches_ddp(tmp_path):
    """bench_trainer_dist.py --cluster 2 runs DDP and the Trainer one process per emulated
    host (gloo's master on host 0), reports the link-bound floor, and the Trainer ends with
    DDP's weights."""
    _, payload = _trainer_across_two_hosts(tmp_path, "10gbit", "off,store-overlap")
    assert payload["cluster"] == {"hosts": 2, "rate": "10gbit"}
    (record,) = payload["results"]
    assert set(record["ways"]) == {"compute", "ddp", "trainer", "trainer on store overlap"}
    assert record["link_bound_s"] == pytest.approx(4 * record["parameters"] / (10e9 / 8))
    for way in ("trainer", "trainer on store overlap"):
        assert record["ways"][way]["relative_difference_from_ddp"] < 1e-5, record["ways"]


def test_trainer_benchmark_compressed_ways_across_two_hosts(tmp_path):
    """bench_trainer_dist.py --ways sign,powersgd,ddp-powersgd across 2 emulated hosts at
    1 Gb/s: the Trainer with sign, the Trainer with PowerSGD (two allreduces per push)
    and DDP with PyTorch's PowerSGD hook (on gloo, its buckets kept in order) all run,
    with their iteration over DDP's; their weights differ from DDP's by design, so they
    are marked lossy and the case passes, and the warmup is raised past the hook's
    uncompressed iterations."""
    proc, payload = _trainer_across_two_hosts(tmp_path, "1gbit", "sign,powersgd,ddp-powersgd")
    assert "--warmup 0 raised to 3" in proc.stderr
    assert payload["warmup"] == 3
    (record,) = payload["results"]
    ways = record["ways"]
    assert set(ways) == {"compute", "ddp", "trainer sign", "trainer powersgd", "ddp powersgd"}
    for way in ("trainer sign", "trainer powersgd", "ddp powersgd"):
        assert ways[way]["lossy"] and ways[way]["iteration_s"] > 0, ways[way]
        assert ways[way]["iteration_over_ddp"] == pytest.approx(
            ways[way]["iteration_s"] / ways["ddp"]["iteration_s"])
    assert "(lossy)" in proc.stdout


def test_resume_benchmark_times_a_host_powered_off(tmp_path):
    """bench_resume.py on 3 emulated hosts: one host powered off after the snapshot of step
    2 (step lines come prefixed by their rank), the job ended, resumed on 2 workers from
    the last snapshot, and the times of each stage recorded."""
    pytest.importorskip("torch")  # (its workers train a Trainer)
    require_cluster()
    require_mpi()
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_resume.py"), "--hosts", "3", "--params",
         "10000", "--every", "2", "--timeout", "5", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env=gpu_env.subprocess_env(gpus=False))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (found,) = tmp_path.glob("resume_*.json")
    result = json.loads(found.read_text())["result"]
    assert result["steps_before_fault"] >= 4 and result["resumed_step"] % 2 == 0
    assert result["steps_lost"] == result["last_step_seen"] - result["resumed_step"] >= 0
    assert 0 < result["fault_to_job_ended_s"] < result["fault_to_resumed_s"] \
        <= result["fault_to_first_step_s"] < result["goal_s"]


def test_rounds_within_a_links_burst_are_noted_as_not_held_to_the_rate():
    """tbf passes its bucket (64 KiB, or 2 ms at the rate) unshaped: a round whose
    bytes per host fit in it can pass 100% of the limit, and the report says why, for
    those sizes only."""
    m = _load("bench_cluster.py")
    assert cluster.burst_bytes("100mbit") == 65536
    assert cluster.burst_bytes("10gbit") == int(10e9 / 8 * 0.002)

    def case(hosts, rate, size, nbytes, ok=True):
        return {"hosts": hosts, "rate": rate, "size": size, "bytes": nbytes, "ok": ok}
    notes = m.burst_notes([case(16, "100mbit", "4 KB", 4096),
                           case(2, "100mbit", "32 KB", 32768),   # 32 KB each way: fits
                           case(2, "100mbit", "64 KB", 65537),   # just over
                           case(2, "10gbit", "4 MB", 4 << 20),   # 2.5 MB bucket: over
                           case(2, "1gbit", "4 KB", 4096, ok=False)])
    assert len(notes) == 2
    assert notes[0].startswith("32 KB at 100mbit: ") and "(64K)" in notes[0]
    assert notes[1].startswith("4 KB at 100mbit: ") and "can pass 100%" in notes[1]

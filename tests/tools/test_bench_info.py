"""Smoke tests of `gpukv bench`, `gpukv info` and the examples, on host devices."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from gpukv.tools import bench as _bench
from gpukv.tools import info as _info

from .. import gpu_env

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--host", "--sizes", "4K,16K", "--devices", "2,3", "--strategies", "local,cpu",
        "--baselines", "loop", "--warmup", "0", "--iters", "2", "--small-keys", "6",
        "--small-devices", "3", "--goal-size", "8K", "--goal-devices", "2",
        "--copy-size", "1M", "--no-progress"]


def _env(gpus: bool = False):
    return gpu_env.subprocess_env(gpus=gpus)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny host benchmark run: (exit status, JSON record, PNG path, stdout)."""
    out = tmp_path_factory.mktemp("bench")
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = _bench.main(TINY + ["--out", str(out)])
    (json_path,) = out.glob("strategies_*.json")
    return status, json.loads(json_path.read_text()), json_path.with_suffix(".png"), \
        buf.getvalue()


def test_bench_exits_zero_and_prints_a_table(tiny_run):
    """A tiny host run succeeds and prints the table headers and the goals summary."""
    status, _, _, text = tiny_run
    assert status == 0
    for word in ("algbw GB/s", "busbw GB/s", "of copy", "vs loop", "goals", "no GPU"):
        assert word in text


def test_bench_json_has_machine_versions_and_copy_bandwidth(tiny_run):
    """The JSON names the device, the library versions and the copy bandwidth measured."""
    _, record, _, _ = tiny_run
    assert record["benchmark"] == "strategies"
    assert record["device"]["kind"] == "host" and record["device"]["name"]
    assert record["versions"]["numpy"] and "cupy" in record["versions"]
    assert record["copy_bandwidth"]["best_GBps"] >= record["copy_bandwidth"]["GBps"] > 0
    assert record["copy_bandwidth"]["bytes"] == 1 << 20
    assert record["settings"]["sizes"] == [4096, 16384]
    assert "busbw_GBps" in record["definitions"]


def test_bench_rows_cover_every_point_with_consistent_numbers(tiny_run):
    """Every size x devices x strategy has a correct, timed row; algbw/busbw follow nccl-tests."""
    _, record, _, _ = tiny_run
    sweep = [r for r in record["results"] if r["case"] == "sweep"]
    for size in (4096, 16384):
        for n in (2, 3):
            for name in ("local", "cpu", "loop"):
                row = next(r for r in sweep if (r["size_bytes"], r["devices"], r["name"])
                           == (size, n, name))
                assert row["time_s"] > 0
                assert row["algbw_GBps"] == pytest.approx(size / row["time_s"] / 1e9)
                assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (n - 1) / n)
                assert row["min_bytes"] == 2 * (n + 1) * size
                assert row["copy_fraction"] == pytest.approx(
                    row["eff_GBps"] / record["copy_bandwidth"]["best_GBps"])
                if name != "loop":
                    assert row["check"] == "ok"
                    assert row["speedup"]["loop"] > 0


def test_bench_small_keys_and_goal_cases(tiny_run):
    """The many-small-keys case (list vs per-key calls) and the large-key case are reported."""
    _, record, _, _ = tiny_run
    small = [r for r in record["results"] if r["case"] == "small"]
    assert {r["name"] for r in small} >= {"local", "store_per_key", "loop"}
    assert all(r["keys"] == 6 and r["devices"] == 3 for r in small)
    goal = [r for r in record["results"] if r["case"] == "goal"]
    assert {r["size_bytes"] for r in goal} == {8192}
    goals = record["goals"]
    assert goals["small_keys"]["vs_loop"] > 0
    assert set(goals["large_key"]["by_devices"]) == {"2"}


def test_bench_writes_a_png(tiny_run):
    """The chart is a PNG file."""
    _, _, png, _ = tiny_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_torch_baselines():
    """With PyTorch installed, the torch.stack and _foreach_add_ baselines are timed."""
    pytest.importorskip("torch")
    import argparse
    args = argparse.Namespace(warmup=0, iters=2)
    bar = _bench._progress(0, False)
    rows = _bench.bench_point(_bench.HostEnv(), "sweep", 2, 3, 4096, ["local"],
                              ["torch_stack", "torch_foreach"], args, bar, 10.0)
    timed = {r["name"]: r for r in rows if r.get("time_s")}
    assert set(timed) == {"local", "torch_stack", "torch_foreach"}
    assert set(timed["local"]["speedup"]) == {"torch_stack", "torch_foreach"}


@pytest.mark.parametrize("text, sizes", [
    ("4K", [4096]), ("4KB,1MiB", [4096, 1 << 20]), ("1G", [1 << 30]),
    ("4K..1M", [4096, 16384, 65536, 262144, 1 << 20]), ("4K..10K", [4096, 10240]),
])
def test_parse_sizes(text, sizes):
    """Sizes take K/M/G (binary) suffixes and A..B ranges in x4 steps."""
    assert _bench.parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", "abc", "2", "1M..4K"])
def test_parse_sizes_rejects_bad_input(text):
    """Malformed sizes are argument errors."""
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        _bench.parse_sizes(text)


def test_python_m_gpukv_bench_runs(tmp_path):
    """`python -m gpukv bench` runs the benchmark from the command line."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "gpukv", "bench", "--host", "--sizes", "4K", "--devices", "2",
         "--strategies", "local", "--baselines", "loop", "--cases", "sweep", "--iters", "1",
         "--warmup", "0", "--copy-size", "1M", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("strategies_*.json")
    assert json.loads(path.read_text())["results"][0]["check"] == "ok"


@pytest.mark.gpu
def test_gpu_benchmark_runs_and_records_its_device(tmp_path):
    """The GPU benchmark (CUDA-event timing) runs unchanged on this run's GPUs: every row
    checks out and the JSON names the GPUs it measured."""
    from gpukv.device.cuda.device import gpu_devices
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "gpukv", "bench", "--gpu", "--sizes", "4K", "--devices", "2",
         "--strategies", "home,tree,ring,nccl", "--baselines", "loop", "--small-keys", "8",
         "--small-devices", "2", "--goal-size", "64K", "--goal-devices", "2",
         "--copy-size", "1M", "--warmup", "0", "--iters", "1", "--no-progress",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=_env(gpus=True), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("strategies_*.json")
    record = json.loads(path.read_text())
    assert record["device"]["kind"] == "gpu" and record["device"]["gpus"]
    assert len(record["device"]["gpus"]) == len({d.physical for d in gpu_devices()})
    assert all(r["error"] is None for r in record["results"])
    assert {r["check"] for r in record["results"] if r["path"] == "store"} == {"ok"}


# ------------------------------------------------------------------------------ info
def test_info_reports_devices_nccl_mpi_and_strategy():
    """`gpukv info` says which devices, NCCL, MPI and default strategy this machine has."""
    proc = subprocess.run([sys.executable, "-m", "gpukv", "info"], capture_output=True,
                          text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "devices:" in out and "NCCL:" in out and "MPI:" in out and "mpiexec:" in out
    assert "default strategy:" in out
    from gpukv.device.cuda.device import gpu_count
    if gpu_count() == 0:
        assert "no GPU: host only" in out


def test_info_json_collects_every_section():
    """`collect()` returns every section, and strategy names from the registry."""
    from gpukv.comm.registry import STRATEGIES
    info = _info.collect()
    for key in ("gpukv", "cupy", "gpus", "topology", "nccl", "mpi", "strategy"):
        assert key in info
    assert info["strategy"]["names"] == list(STRATEGIES)
    assert isinstance(info["nccl"]["available"], bool)
    assert isinstance(info["mpi"]["available"], bool)
    json.dumps(info, default=str)


@pytest.mark.parametrize("name, n", [("dgx1", 8), ("nvswitch", 4), ("pcie", 6)])
def test_info_simulate_plans_trees_and_a_ring(name, n, capsys):
    """`--simulate` prints one tree per root and a ring over every device."""
    args = ["--simulate", name] + (["--gpus", str(n)] if name != "dgx1" else [])
    assert _info.main(args + ["--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulated"]
    assert [t["root"] for t in sim["trees"]] == list(range(n))
    assert sorted(sim["ring"]) == list(range(n))
    assert _info.main(args) == 0
    text = capsys.readouterr().out
    assert f"simulated {name}" in text and "root 0:" in text and "ring: 0 ->" in text


def test_info_renders_gpus_without_a_gpu(monkeypatch):
    """The GPU part of `info` (names, logical devices, peer access, links, trees) renders
    against a stand-in CUDA runtime with two GPUs and three logical devices."""
    import gpukv.device.cuda.device as cuda

    class Runtime:
        cudaDevP2PAttrPerformanceRank = 1
        cudaDevP2PAttrAccessSupported = 2

        @staticmethod
        def getDeviceProperties(i):
            return {"name": b"Stand-in GPU", "totalGlobalMem": 80 << 30, "major": 9,
                    "minor": 0, "multiProcessorCount": 132}

        @staticmethod
        def deviceCanAccessPeer(a, b):
            return 1

        @staticmethod
        def deviceGetP2PAttribute(attr, a, b):
            return 1 if attr == 2 else 0

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=Runtime))
    logical = [types.SimpleNamespace(physical=0, slot=0), types.SimpleNamespace(physical=1,
               slot=0), types.SimpleNamespace(physical=0, slot=1)]
    monkeypatch.setattr(cuda, "gpu_count", lambda: 2)
    monkeypatch.setattr(cuda, "cupy_module", lambda: fake)
    monkeypatch.setattr(cuda, "gpu_devices", lambda: logical)
    gpus = _info.gpu_info()
    assert [g["name"] for g in gpus["gpus"]] == ["Stand-in GPU"] * 2
    topo = _info.topology_info(gpus)
    assert topo["peer_access"] == [[True, True], [True, True]]
    assert len(topo["trees"]) == 3 and sorted(topo["ring"]) == [0, 1, 2]
    text = _info.render({**_info.collect(), "gpus": gpus, "topology": topo})
    assert "2 GPU(s)" in text and "GPU 1: Stand-in GPU, 80.0 GiB" in text
    assert "peer access" in text and "root 0.1:" in text


# -------------------------------------------------------------------------- examples
@pytest.mark.parametrize("script", ["cupy_mlp.py", "torch_training.py",
                                    "torch_training_by_hand.py", "train_set_optimizer.py",
                                    "train_embedding_sparse.py"])
def test_examples_train(script):
    """The examples train to a lower loss on host devices (they exit non-zero otherwise)."""
    if script.startswith("torch"):
        pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loss" in proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("script, args", [
    ("cupy_mlp.py", ["--steps", "60"]), ("train_set_optimizer.py", []),
    ("train_embedding_sparse.py", [])])
def test_examples_train_on_gpus(script, args):
    """The GPU examples train on every GPU of this run (eight virtual ones), with CuPy."""
    env = _env(gpus=True)
    env["GPUKV_VIRTUAL_GPUS"] = "8"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loss" in proc.stdout and "no GPU" not in proc.stdout


# ------------------------------------------------------------------------- layering
def _cupy_uses(path: Path) -> list:
    """(line, what) of every CuPy import or `cupy_module` use in the Python file `path`."""
    import ast
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] in ("cupy", "cupyx")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in ("cupy", "cupyx"):
            found.append((node.lineno, node.module))
        elif isinstance(node, (ast.Name, ast.Attribute)) and "cupy_module" in (
                getattr(node, "id", None), getattr(node, "attr", None)):
            found.append((node.lineno, "cupy_module"))
        elif isinstance(node, ast.alias) and node.name == "cupy_module":
            found.append((node.lineno, "cupy_module"))
    return found


def test_only_the_device_layer_touches_cupy():
    """Outside gpukv/device no module imports CuPy or asks for it: tools, strategies and
    planners reach GPUs through the device layer."""
    package = ROOT / "gpukv"
    offenders = {str(p.relative_to(ROOT)): uses for p in sorted(package.rglob("*.py"))
                 if "device" not in p.relative_to(package).parts[:1]
                 for uses in [_cupy_uses(p)] if uses}
    assert offenders == {}


def test_calibration_loading_imports_no_tools(tmp_path):
    """Reading a calibration file (as the strategies do) loads nothing of gpukv.tools."""
    code = ("import json, sys; from gpukv.comm.plan import simulate as S; "
            f"p = {str(tmp_path / 'c.json')!r}; "
            "open(p, 'w').write(json.dumps({'format': S.CALIBRATION_FORMAT, 'version': 1, "
            "'created_utc': 'x', 'machine': {'cpu_model': 'Other CPU', 'gpus': ['G']}, "
            "'constants': {}})); "
            "assert S.load_calibration(p) is None; "
            "assert not [m for m in sys.modules if m.startswith('gpukv.tools')], sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr

"""Cost-model calibration: `gpukv bench --calibrate` writes it, `simulate` reads and applies it."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from gpukv.comm.plan import simulate as S
from gpukv.comm.plan import topology as T
from gpukv.device.cuda.probe import cpu_model
from gpukv.tools import bench as _bench
from gpukv.tools import calibrate as _calibrate
from tests.fake_cupy import Costs, FakeCupy
from tests.fake_gpu import FakeGpu

MB = 1 << 20
FAST = ["--calibrate", "--host", "--copy-size", "1M", "--warmup", "1", "--iters", "5", "-q"]
# DGX-1's first four GPUs plus a fifth reached only through the host (weight 0).
MATRIX = np.array([[0, 3, 1, 2, 0], [3, 0, 2, 1, 0], [1, 2, 0, 3, 0], [2, 1, 3, 0, 0],
                   [0, 0, 0, 0, 0]], float)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Each test starts with no calibration file, a private cache folder and no cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("GPUKV_CALIBRATION", raising=False)
    S.reset_calibration()
    yield
    S.reset_calibration()


def record(constants=None, links=(), **top) -> dict:
    """A valid calibration record of this machine with the given constants."""
    out = {"format": S.CALIBRATION_FORMAT, "version": S.CALIBRATION_VERSION,
           "created_utc": "2025-01-02T03:04:05Z",
           "machine": {"hostname": "here", "cpu_model": cpu_model(), "gpus": []},
           "versions": {"gpukv": "test"},
           "constants": {k: {"value": v, "unit": S.CALIBRATED[k][0], "method": "test"}
                         for k, v in (constants or {}).items()},
           "links": [{"weight": w, "gbps": {"value": g, "unit": "GB/s"},
                      "latency_us": {"value": lat, "unit": "us"}} for w, g, lat in links]}
    out.update(top)
    return out


def use(tmp_path, monkeypatch, rec) -> str:
    """Write `rec` and point GPUKV_CALIBRATION at it."""
    path = tmp_path / "calibration.json"
    path.write_text(rec if isinstance(rec, str) else json.dumps(rec))
    monkeypatch.setenv("GPUKV_CALIBRATION", str(path))
    return str(path)


# ----------------------------------------------------------------- bench --calibrate
def test_bench_calibrate_on_host_writes_a_valid_file(tmp_path, capsys):
    """`bench --calibrate --host` writes a versioned file with the host constants, their
    units and methods, the machine and library versions, and it loads back."""
    path = tmp_path / "sub" / "cal.json"
    assert _bench.main(FAST + ["--calibration-file", str(path)]) == 0
    assert str(path) in capsys.readouterr().out
    rec = json.loads(path.read_text())
    assert (rec["format"], rec["version"]) == (S.CALIBRATION_FORMAT, S.CALIBRATION_VERSION)
    assert rec["created_utc"].endswith("Z") and rec["versions"]["numpy"] == np.__version__
    assert rec["machine"]["cpu_model"] == cpu_model() and rec["machine"]["gpus"] == []
    assert set(rec["constants"]) == {"host_sum_gbps", "host_sum_us"}
    for name, entry in rec["constants"].items():
        assert entry["unit"] == S.CALIBRATED[name][0] and entry["value"] > 0 and entry["method"]
    assert rec["links"] == [] and "gpu" in rec["skipped"]
    cal = S.load_calibration(path)
    assert cal.constants == {k: e["value"] for k, e in rec["constants"].items()}
    assert cal.costs().host_sum_us == rec["constants"]["host_sum_us"]["value"]
    assert not list(path.parent.glob("*.tmp"))


def test_bench_calibrate_defaults_to_the_env_file_then_the_user_cache(tmp_path, monkeypatch):
    """Without --calibration-file it writes GPUKV_CALIBRATION's file, else the XDG cache
    file, and this process uses the new file at once."""
    cache = tmp_path / "cache" / "gpukv" / "calibration.json"
    assert S.calibrated_costs() is S.COSTS
    assert _bench.main(FAST) == 0
    assert cache.is_file()
    assert S.calibrated_costs().host_sum_us == S.load_calibration(cache).constants["host_sum_us"]
    env = tmp_path / "env.json"
    monkeypatch.setenv("GPUKV_CALIBRATION", str(env))
    assert _bench.main(FAST) == 0
    assert env.is_file()
    assert S.calibration_status()["path"] == str(env)


@pytest.mark.parametrize("where", ["folder", "below-a-file"])
def test_bench_calibrate_refuses_a_path_it_cannot_write_before_measuring(tmp_path,
                                                                         monkeypatch, where):
    """--calibration-file naming a folder, or a path below a file, fails at once, before
    the measuring (which it used to do first, to fail only when writing)."""
    file = tmp_path / "a-file"
    file.write_text("")
    path = tmp_path if where == "folder" else file / "calibration.json"

    def measured(**_):
        raise AssertionError("measured before checking where it writes")
    monkeypatch.setattr(_calibrate, "calibrate", measured)
    with pytest.raises(SystemExit, match=f"cannot write {path}: "):
        _bench.main(FAST + ["--calibration-file", str(path)])
    assert file.read_text() == ""


def test_bench_calibrate_with_calibration_off_needs_a_path(monkeypatch):
    """GPUKV_CALIBRATION=off and no --calibration-file: an error, nothing written."""
    monkeypatch.setenv("GPUKV_CALIBRATION", "off")
    with pytest.raises(SystemExit, match="--calibration-file"):
        _bench.main(FAST)


# ------------------------------------------------------------------- applying it
def test_slower_host_sum_makes_cpu_predictions_slower(tmp_path, monkeypatch):
    """A file with a much slower host summation raises the 'cpu' prediction and leaves
    the strategies that do not sum on the host alone."""
    matrix = T.dgx1_v100()[:4, :4]
    before = {s: S.predict(s, 16 * MB, 4, S.calibrated_machine(matrix),
                           costs=S.calibrated_costs()) for s in ("cpu", "home")}
    use(tmp_path, monkeypatch, record({"host_sum_gbps": 0.1, "host_sum_us": 500.0}))
    m, costs = S.calibrated_machine(matrix), S.calibrated_costs()
    assert (m.host_sum_gbps, costs.host_sum_us) == (0.1, 500.0)
    after = {s: S.predict(s, 16 * MB, 4, m, costs=costs) for s in ("cpu", "home")}
    assert after["cpu"] > 10 * before["cpu"]
    assert after["home"] == before["home"]


def test_measured_constants_and_links_replace_the_generic_ones(tmp_path, monkeypatch):
    """Every calibrated constant and link class reaches the model; the named profiles
    (other machines) are not calibrated."""
    consts = {"launch_us": 1.5, "kernel_us": 2.5, "host_copy_us": 7.0, "host_sum_us": 3.0,
              "nccl_base_us": 30.0, "hbm_gbps": 2500.0, "host_gbps": 50.0,
              "host_total_gbps": 120.0, "host_sum_gbps": 20.0}
    links = [(3.0, 90.0, 2.0), (2.0, 45.0, 2.5), (1.0, 20.0, 9.0), (0.0, 6.0, 30.0),
             (64.0, 1500.0, 1.0)]
    dgx_before = S.predict_all(4 * MB, 8, "dgx1-v100")
    use(tmp_path, monkeypatch, record(consts, links))
    costs = S.calibrated_costs()
    for name in ("launch_us", "kernel_us", "host_copy_us", "host_sum_us", "nccl_base_us"):
        assert getattr(costs, name) == consts[name]
    m = S.calibrated_machine(MATRIX)
    for name in ("hbm_gbps", "host_gbps", "host_total_gbps", "host_sum_gbps"):
        assert getattr(m, name) == consts[name]
    assert (m.link(0, 1).gbps, m.link(0, 1).latency_us) == (90.0, 2.0)
    assert m.link(0, 3).gbps == 45.0 and m.link(0, 2).gbps == 20.0
    assert m.link(0, 2).port == "pcie" and m.link(0, 1).port is None
    assert (m.link(0, 4).gbps, m.link(0, 4).latency_us) == (6.0, 30.0)
    assert m.ports["pcie"] == 50.0  # no slower than the fastest transfer measured through it
    assert S.calibrated_machine(np.array([[0, 64.0], [64.0, 0]])).link(0, 1).gbps == 1500.0
    assert S.predict_all(4 * MB, 8, "dgx1-v100") == dgx_before
    assert S.machine("dgx1-v100") is S.MACHINES["dgx1-v100"]


def test_calibration_is_loaded_once_until_reset(tmp_path, monkeypatch):
    """The file is read once per process; `reset_calibration` reads it again."""
    path = use(tmp_path, monkeypatch, record({"launch_us": 2.0}))
    assert S.calibrated_costs().launch_us == 2.0
    with open(path, "w") as f:
        json.dump(record({"launch_us": 3.0}), f)
    assert S.calibrated_costs().launch_us == 2.0
    S.reset_calibration()
    assert S.calibrated_costs().launch_us == 3.0


def test_calibration_off_ignores_the_cache_file(tmp_path, monkeypatch):
    """GPUKV_CALIBRATION=off: the defaults, even with a cache file present."""
    cache = tmp_path / "cache" / "gpukv" / "calibration.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(record({"launch_us": 2.0})))
    assert S.calibrated_costs().launch_us == 2.0
    S.reset_calibration()
    monkeypatch.setenv("GPUKV_CALIBRATION", "off")
    assert S.calibrated_costs() is S.COSTS
    assert S.calibration_status() == {"in_use": False, "path": None,
                                      "reason": "GPUKV_CALIBRATION=off"}


def test_missing_default_cache_file_is_silent(caplog):
    """No cache file: the defaults, without a warning."""
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        assert S.calibrated_costs() is S.COSTS
        assert repr(S.calibrated_machine(MATRIX)) == repr(S.generic_machine(MATRIX, "measured"))
    assert not caplog.records


BAD = {
    "malformed JSON": ("{not json", "not valid JSON"),
    "a list": ("[]", "not a gpukv calibration file"),
    "foreign format": (json.dumps({"benchmark": "strategies", "results": []}),
                       "not a gpukv calibration file"),
    "newer version": (record({"launch_us": 2.0}, version=S.CALIBRATION_VERSION + 1),
                      "newer"),
    "version text": (record({"launch_us": 2.0}, version="1"), "version '1'"),
    "wrong unit": (dict(record(), constants={"launch_us": {"value": 2.0, "unit": "ms"}}),
                   "unit 'ms'"),
    "unknown constant": (dict(record(), constants={"warp_us": {"value": 2.0, "unit": "us"}}),
                         "unknown constant 'warp_us'"),
    "negative value": (record({"hbm_gbps": -5.0}), "not a positive number"),
    "text value": (dict(record(), constants={"hbm_gbps": {"value": "fast", "unit": "GB/s"}}),
                   "not a positive number"),
    "bad link": (dict(record(), links=[{"weight": -1, "gbps": {}, "latency_us": {}}]),
                 "weight -1"),
    "no machine": (dict(record({"launch_us": 2.0}), machine=None), "'machine'"),
    "another CPU": (dict(record({"launch_us": 2.0}),
                         machine={"cpu_model": "Some Other CPU 9000", "gpus": []}),
                    "another machine"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unusable_files_warn_and_fall_back_to_defaults(case, tmp_path, monkeypatch, caplog):
    """A malformed, foreign, newer or other machine's file is never used: one warning
    naming the file and the problem, and the default constants."""
    content, problem = BAD[case]
    path = use(tmp_path, monkeypatch,
               content if isinstance(content, str) else json.dumps(content))
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        assert S.calibrated_costs() is S.COSTS
        assert repr(S.calibrated_machine(MATRIX)) == repr(S.generic_machine(MATRIX, "measured"))
        assert S.load_calibration() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # loaded once
    assert path in warnings[0].getMessage() and problem in warnings[0].getMessage()
    status = S.calibration_status()
    assert not status["in_use"] and problem in status["reason"]


def test_missing_env_file_warns(tmp_path, monkeypatch, caplog):
    """GPUKV_CALIBRATION naming a missing file is a warning, and the defaults."""
    monkeypatch.setenv("GPUKV_CALIBRATION", str(tmp_path / "nope.json"))
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        assert S.calibrated_costs() is S.COSTS
    assert "nope.json" in caplog.text and "no such file" in caplog.text


def test_other_gpus_make_the_file_foreign(tmp_path, monkeypatch, caplog):
    """A file measured on other GPU models than this process sees is not used."""
    use(tmp_path, monkeypatch, dict(record({"launch_us": 2.0}),
                                    machine={"cpu_model": cpu_model(), "gpus": ["GPU A"]}))
    monkeypatch.setattr(S, "_local_gpu_names", lambda: ["GPU B", "GPU B"])
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        assert S.calibrated_costs() is S.COSTS
    assert "another machine" in caplog.text and "GPU B" in caplog.text
    S.reset_calibration()
    monkeypatch.setattr(S, "_local_gpu_names", lambda: ["GPU A"])
    assert S.calibrated_costs().launch_us == 2.0


def test_info_says_whether_a_calibration_is_in_use(tmp_path, monkeypatch):
    """`gpukv info` names the calibration file and its date, or says it uses defaults."""
    from gpukv.tools import info as _info
    text = _info.render(_info.collect())
    assert "cost model: default constants (no calibration file" in text
    path = use(tmp_path, monkeypatch, record({"launch_us": 2.0}))
    S.reset_calibration()
    info = _info.collect()
    assert info["calibration"]["in_use"] and info["calibration"]["path"] == path
    text = _info.render(info)
    assert f"cost model: calibrated from {path}" in text and "2025-01-02T03:04:05Z" in text


# ---------------------------------------------------------- the strategies use it
def _gpus(n):
    log, current = [], {}
    return [FakeGpu(i, log, current) for i in range(n)]


def test_auto_models_its_gpus_with_the_calibration(tmp_path, monkeypatch):
    """'auto' ranks strategies for its GPUs with the calibrated model: a machine whose host
    path is measured to be very fast sends a large key through the host."""
    from gpukv.comm import nccl
    from gpukv.comm.auto import AutoStrategy
    from gpukv.comm.plan import links as _links
    monkeypatch.setattr(_links, "link_matrix", lambda nodes: T.pcie_two_socket(len(nodes)))
    monkeypatch.setattr(nccl, "nccl_available", lambda: False)
    gpus = _gpus(4)
    assert AutoStrategy().choose("k", 64 * MB, gpus, gpus[0]) != "cpu"
    use(tmp_path, monkeypatch, record({"host_gbps": 1e5, "host_total_gbps": 1e6,
                                       "host_sum_gbps": 1e6, "host_copy_us": 0.1,
                                       "host_sum_us": 0.1}))
    assert AutoStrategy().choose("k", 64 * MB, gpus, gpus[0]) == "cpu"
    # a given machine stands for another one: never calibrated
    assert AutoStrategy(machine="pcie-2socket").choose("k", 64 * MB, gpus, gpus[0]) != "cpu"


def test_tree_plans_its_gpus_on_the_calibrated_model(tmp_path, monkeypatch):
    """The tree's slicing model of its GPUs is the calibrated one; a given matrix is not."""
    from gpukv.comm.plan import links as _links
    from gpukv.comm.tree import TreeStrategy
    monkeypatch.setattr(_links, "link_matrix",
                        lambda nodes: T.dgx1_v100()[:len(nodes), :len(nodes)])
    use(tmp_path, monkeypatch, record({"launch_us": 1.0}, [(3.0, 99.0, 1.0)]))
    gpus = _gpus(4)
    plan = TreeStrategy()._plan(gpus)
    assert plan.calibrated and plan.machine.link(0, 3).gbps == 99.0
    assert plan.costs.launch_us == 1.0
    given = TreeStrategy(matrix=T.dgx1_v100())._plan(gpus)
    assert not given.calibrated and given.machine.link(0, 3).gbps == 50.0
    assert given.costs is S.COSTS


# ---------------------------------------------------------- GPU measurement (fake)
LINK_COSTS = {3.0: (5e-6, 50e9), 2.0: (6e-6, 25e9), 1.0: (10e-6, 12e9), 0.0: (15e-6, 8e9)}


def test_gpu_probe_recovers_a_simulated_machine():
    """Against a CuPy stand-in whose device clock advances by known costs, every GPU
    constant and each link weight class present (plus same-GPU copies) is recovered."""
    costs = Costs(kernel_s=3e-6, hbm=2e12, same=(2e-6, 1e12), host=(8e-6, 20e9),
                  links=LINK_COSTS, nccl_s=40e-6)
    fake = FakeCupy(MATRIX, costs)
    rec = _calibrate.calibrate(cupy=fake, nccl=fake.nccl, matrix=MATRIX, nbytes=4 * MB,
                               warmup=1, iters=5)
    got = {k: e["value"] for k, e in rec["constants"].items()}
    approx = lambda v: pytest.approx(v, rel=1e-3)  # noqa: E731
    assert got["kernel_us"] == approx(3.0)
    assert got["hbm_gbps"] == approx(2000.0)
    assert got["host_gbps"] == approx(20.0) and got["host_copy_us"] == approx(8.0)
    assert got["host_total_gbps"] == approx(5 * 20.0)  # five GPUs, no shared bus simulated
    assert got["nccl_base_us"] == approx(40.0 - 2 * 4 * S.COSTS.nccl_step_us)
    assert got["launch_us"] > 0 and got["host_sum_gbps"] > 0
    links = {link["weight"]: link for link in rec["links"]}
    assert set(links) == {64.0, 3.0, 2.0, 1.0, 0.0}
    assert links[64.0]["pair"] == [0, 0] and links[0.0]["pair"] == [0, 4]
    for w, (lat, bw) in LINK_COSTS.items():
        assert links[w]["gbps"]["value"] == approx(bw / 1e9)
        assert links[w]["latency_us"]["value"] == approx(lat * 1e6)
    assert rec["machine"]["gpus"] == ["Fake GPU"] * 5 and rec["skipped"] == {}
    assert rec["machine"]["link_matrix"] == MATRIX.tolist()
    assert fake.nccl.ranks == [0, 1, 2, 3, 4]


def test_gpu_calibration_round_trips_into_the_model(tmp_path, monkeypatch):
    """`bench --calibrate` on a (stand-in) GPU writes a file whose link speeds and
    latencies become the model of this machine; NCCL failing to load is recorded."""
    import gpukv.device.cuda.device as cuda
    fake = FakeCupy(MATRIX[:4, :4], Costs(links=LINK_COSTS))
    monkeypatch.setattr(cuda, "gpu_count", lambda: fake.count)
    monkeypatch.setattr(cuda, "cupy_module", lambda: fake)
    monkeypatch.setattr(_calibrate, "_link_matrix", lambda count: MATRIX[:count, :count])
    monkeypatch.setattr(S, "_local_gpu_names", lambda: ["Fake GPU"] * 4)
    import gpukv.device.cuda.nccl as nccl_mod

    def no_nccl():
        raise RuntimeError("no libnccl here")
    monkeypatch.setattr(nccl_mod, "nccl_module", no_nccl)
    path = tmp_path / "gpu.json"
    assert _bench.main(["--calibrate", "--calibration-file", str(path), "--copy-size", "1M",
                        "--warmup", "1", "--iters", "5", "-q"]) == 0
    rec = json.loads(path.read_text())
    assert "no libnccl" in rec["skipped"]["nccl_base_us"]
    assert "nccl_base_us" not in rec["constants"]
    monkeypatch.setenv("GPUKV_CALIBRATION", str(path))
    S.reset_calibration()
    m = S.calibrated_machine(MATRIX[:4, :4])
    assert m.link(0, 1).gbps == pytest.approx(50.0, rel=1e-3)
    assert m.link(0, 1).latency_us == pytest.approx(5.0, rel=1e-3)
    assert m.hbm_gbps == pytest.approx(rec["constants"]["hbm_gbps"]["value"])
    assert S.calibrated_costs().nccl_base_us == S.COSTS.nccl_base_us


@pytest.mark.gpu
def test_gpu_calibration_on_this_gpu(tmp_path):
    """On a real GPU, calibration measures every GPU constant and the file loads back."""
    path = tmp_path / "real.json"
    assert _bench.main(["--calibrate", "--calibration-file", str(path), "--copy-size", "16M",
                        "-q"]) == 0
    rec = json.loads(path.read_text())
    for name in ("launch_us", "kernel_us", "hbm_gbps", "host_gbps", "host_copy_us",
                 "host_total_gbps", "host_sum_gbps", "host_sum_us"):
        assert rec["constants"][name]["value"] > 0, name
    assert any(link["weight"] == T.SAME_DEVICE_WEIGHT for link in rec["links"])
    cal = S.load_calibration(path)
    assert cal is not None
    assert cal.constants == {k: e["value"] for k, e in rec["constants"].items()}

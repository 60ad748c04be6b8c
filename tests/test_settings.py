"""The GPUKV_* settings: every variable the package reads is listed (gpukv._env.SETTINGS) and
documented (docs/settings.md), and one that is none of them, a misspelling, is named by
`create` (once per process) and by `gpukv info` rather than silently without effect."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest

import gpukv
from gpukv import _env
from gpukv.api import factory
from gpukv.tools import info as _info

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"GPUKV_[A-Z0-9_]*[A-Z0-9]\b")


@pytest.fixture
def alone(monkeypatch):
    """A process no launcher started (no rank in its environment), which has said no
    unknown setting yet."""
    for name in _env.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(factory, "_UNKNOWN_SAID", set())


def test_every_variable_the_package_reads_is_a_listed_setting():
    """A variable named anywhere in the package's code is in SETTINGS (or is the test
    suite's): a new setting left out of the list would be warned of as unknown."""
    named = {name for path in (ROOT / "gpukv").rglob("*.py")
             for name in NAME.findall(path.read_text())}
    unlisted = sorted(name for name in named - set(_env.SETTINGS)
                      if not name.startswith(_env.TEST_PREFIXES))
    assert not unlisted, f"read by the package but not in gpukv._env.SETTINGS: {unlisted}"


def test_every_setting_is_documented_on_the_settings_page():
    page = (ROOT / "docs" / "settings.md").read_text()
    rows = set(re.findall(r"^\| `(GPUKV_[A-Z0-9_]+)` \|", page, flags=re.M))
    assert rows == set(_env.SETTINGS)


@pytest.mark.parametrize("environ,unknown", [
    ({"GPUKV_DIST_TIMOUT": "5"}, {"GPUKV_DIST_TIMOUT": "GPUKV_DIST_TIMEOUT"}),
    ({"GPUKV_NUM_SERVER": "1"}, {"GPUKV_NUM_SERVER": "GPUKV_NUM_SERVERS"}),
    ({"GPUKV_DETERMINISTC": "1"}, {"GPUKV_DETERMINISTC": "GPUKV_DETERMINISTIC"}),
    ({"GPUKV_SOMETHING_ELSE": "1"}, {"GPUKV_SOMETHING_ELSE": ""}),
    ({"GPUKV_determinstic": "1"}, {"GPUKV_determinstic": "GPUKV_DETERMINISTIC"}),
    ({"GPUKV_DIST_TIMEOUT": "5", "GPUKV_TEST_GPU": "1", "GPUKV_EMU_RACES": "0",
      "MXNET_KVSTORE_TREE_ARRAY_BOUND": "10", "GPUKVX": "1"}, {}),
])
def test_unknown_settings_are_named_with_the_one_they_resemble(environ, unknown):
    """Known settings, the test suite's switches and other programs' variables are not
    named; a misspelling is, with the closest setting; an unrelated name alone."""
    assert _env.unknown_settings(environ) == unknown


def test_create_warns_once_per_process_of_an_unknown_setting(alone, monkeypatch, caplog):
    monkeypatch.setenv("GPUKV_DIST_TIMOUT", "5")
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        gpukv.create("local")
        gpukv.create("device")
    said = [r.getMessage() for r in caplog.records if "no such setting" in r.getMessage()]
    assert said == ["gpukv reads no such setting, so it has no effect: GPUKV_DIST_TIMOUT "
                    "(did you mean GPUKV_DIST_TIMEOUT?) (the Settings page lists those "
                    "it reads)"]
    monkeypatch.setenv("GPUKV_OTHER_TYPO", "1")  # a new one is said in its turn
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        gpukv.create("local")
    assert [r.getMessage() for r in caplog.records] == [
        "gpukv reads no such setting, so it has no effect: GPUKV_OTHER_TYPO (the Settings "
        "page lists those it reads)"]


def test_create_says_nothing_when_every_setting_is_known(alone, monkeypatch, caplog):
    monkeypatch.setenv("GPUKV_DIST_TIMEOUT", "5")
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        gpukv.create("local")
    assert not [r for r in caplog.records if "no such setting" in r.getMessage()]


def test_info_lists_unknown_settings(monkeypatch):
    assert "not a setting gpukv reads" not in _info.render(_info.collect())
    monkeypatch.setenv("GPUKV_STRATEGYY", "tree")
    text = _info.render(_info.collect())
    assert ("not a setting gpukv reads (without effect): GPUKV_STRATEGYY (did you mean "
            "GPUKV_STRATEGY?)") in text


TREE_SETTINGS = [("GPUKV_TREE_ARRAY_BOUND", "abc"), ("GPUKV_TREE_BACKTRACK", "x"),
                 ("GPUKV_TREE_LINK_USAGE_PENALTY", "2"),
                 ("MXNET_KVSTORE_TREE_ARRAY_BOUND", "-1")]
GPU_SETTINGS = [("GPUKV_STRATEGY", "bogus"), ("GPUKV_VIRTUAL_GPUS", "0")]
# (GPUKV_HOST_THREADS too, but once a process: the first store's pool of threads stays)
EVERY_STORES_SETTINGS = [("GPUKV_HOST_JIT", "yes"), ("GPUKV_DETERMINISTIC", "x")]


def _round_trip(kv):
    kv.init(0, np.ones(2, np.float32))
    kv.push(0, [np.ones(2, np.float32)] * 3)
    out = np.zeros(2, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [3, 3]


@pytest.mark.parametrize("name,value", TREE_SETTINGS + GPU_SETTINGS + EVERY_STORES_SETTINGS)
def test_a_gpu_store_refuses_a_malformed_setting_when_made(name, value, monkeypatch):
    """A 'device' store (its default strategy 'auto' plans trees) refuses every setting it
    reads when it is made, not at the first call that happens to read it (a tree
    variable at the first push over several devices, on a GPU only)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(gpukv.GpukvError, match=f"{name}={value!r}"):
        gpukv.create("device")


@pytest.mark.parametrize("name,value", TREE_SETTINGS)
def test_a_host_store_given_the_tree_refuses_a_malformed_tree_setting(name, value,
                                                                      monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(gpukv.GpukvError, match=f"{name}={value!r}"):
        gpukv.create("local", strategy="tree")


@pytest.mark.parametrize("name,value", EVERY_STORES_SETTINGS)
def test_a_host_store_refuses_a_malformed_setting_it_reads(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(gpukv.GpukvError, match=f"{name}={value!r}"):
        gpukv.create("local")


@pytest.mark.parametrize("store,options,name,value", [
    *[("local", {}, name, value) for name, value in TREE_SETTINGS + GPU_SETTINGS],
    *[(store, options, name, value) for name, value in TREE_SETTINGS + GPU_SETTINGS[:1]
      for store, options in (("nccl", {}), ("device", {"strategy": "ring"}))]])
def test_a_store_that_does_not_read_a_setting_leaves_it_alone(store, options, name, value,
                                                              monkeypatch):
    """A host store sums on the host, 'nccl' and a ring plan no tree: a setting they do
    not read does not concern them, malformed or not (GPUKV_STRATEGY with a strategy
    named: 'nccl' names its own). Every GPU store deals its devices by
    GPUKV_VIRTUAL_GPUS."""
    monkeypatch.setenv(name, value)
    _round_trip(gpukv.create(store, **options))


@pytest.mark.parametrize("name,value,options", [
    ("GPUKV_TREE_ARRAY_BOUND", "abc", {"strategy": "tree", "array_bound": 10}),
    ("GPUKV_STRATEGY", "bogus", {"strategy": "cpu"}),
    ("GPUKV_DETERMINISTIC", "maybe", {"deterministic": False})])
def test_an_option_given_wins_over_its_variable_malformed_or_not(name, value, options,
                                                                 monkeypatch):
    monkeypatch.setenv(name, value)
    _round_trip(gpukv.create("device", **options))


def test_a_strategy_made_with_its_bound_wins_over_the_variable(monkeypatch):
    from gpukv.comm.tree import TreeStrategy
    monkeypatch.setenv("GPUKV_TREE_ARRAY_BOUND", "abc")
    _round_trip(gpukv.create("device", strategy=TreeStrategy(array_bound=100)))
    with pytest.raises(gpukv.ArgumentError, match="GPUKV_TREE_ARRAY_BOUND='abc'"):
        TreeStrategy()


def test_several_malformed_settings_are_refused_in_one_error():
    """What a dist store says when a process's environment holds several (all at once,
    rather than one per try)."""
    def bad(name):
        def check():
            raise gpukv.ArgumentError(f"{name}='x': malformed")
        return check
    with pytest.raises(gpukv.ArgumentError) as caught:
        _env.refuse_malformed({"GPUKV_A": bad("GPUKV_A"), "GPUKV_B": bad("GPUKV_B"),
                               "GPUKV_C": lambda: None})
    assert str(caught.value) == ("malformed settings: GPUKV_A='x': malformed; "
                                 "GPUKV_B='x': malformed")
    with pytest.raises(gpukv.ArgumentError, match="^GPUKV_A='x': malformed$"):
        _env.refuse_malformed({"GPUKV_A": bad("GPUKV_A")})


def test_info_names_each_malformed_setting_once(monkeypatch):
    """Every malformed variable on its own line, those read together (the tree's, the
    dist store's) and gpukv run's included, none twice."""
    bad = {"GPUKV_STRATEGY": "x", "GPUKV_DETERMINISTIC": "x", "GPUKV_VIRTUAL_GPUS": "x",
           "GPUKV_HOST_THREADS": "x", "GPUKV_HOST_JIT": "x", "GPUKV_TREE_ARRAY_BOUND": "x",
           "GPUKV_TREE_LINK_USAGE_PENALTY": "x", "GPUKV_TREE_BACKTRACK": "x",
           "GPUKV_NUM_SERVERS": "x", "GPUKV_DIST_TIMEOUT": "x", "GPUKV_BIGARRAY_BOUND": "x",
           "GPUKV_DIST_CHUNK_BYTES": "x", "GPUKV_RUN_VERBOSE": "x",
           "GPUKV_CUDA_EMULATION": "x"}
    for name, value in bad.items():
        monkeypatch.setenv(name, value)
    lines = [ln for ln in _info.render(_info.collect()).splitlines()
             if ln.startswith("malformed setting")]
    assert sorted(ln.split("): ", 1)[1].split("=")[0] for ln in lines) == sorted(bad)
    assert ("malformed setting (gpukv run refuses it): GPUKV_RUN_VERBOSE='x': expected 1 "
            "(on) or 0 (off)") in lines
    assert ("malformed setting (gpukv gpucheck refuses it): GPUKV_CUDA_EMULATION='x': "
            "expected 1 (on) or 0 (off)") in lines
    assert ("malformed setting (the tree and auto strategies refuse it): "
            "GPUKV_TREE_BACKTRACK='x': expected an integer (0: off, else on)") in lines
    assert ("malformed setting (dist stores refuse it): GPUKV_DIST_TIMEOUT='x': expected "
            "finite seconds > 0") in lines


def test_too_many_servers_from_the_environment_name_the_variable(monkeypatch):
    """The job's size decides how many servers fit: `info` checks the value alone, and
    `create` names the variable when the job is too small for it."""
    from gpukv.distributed import store as dist_store
    monkeypatch.setenv("GPUKV_NUM_SERVERS", "2")
    assert "GPUKV_NUM_SERVERS" not in _info.settings_errors()
    with pytest.raises(gpukv.ArgumentError, match=r"^GPUKV_NUM_SERVERS='2': expected 0 "
                                                  r"\(every process serves\) up to 1"):
        dist_store._options("dist_sync", None, None, None, 2)
    with pytest.raises(gpukv.ArgumentError, match=r"^num_servers=3: expected 0"):
        dist_store._options("dist_sync", 3, None, None, 2)
    monkeypatch.setenv("GPUKV_NUM_SERVERS", "-1")
    assert _info.settings_errors()["GPUKV_NUM_SERVERS"] == \
        "GPUKV_NUM_SERVERS='-1': expected an integer >= 0"


def test_mxnets_bigarray_bound_is_read_when_gpukvs_is_unset(monkeypatch):
    from gpukv.distributed import store as dist_store
    monkeypatch.setenv("MXNET_KVSTORE_BIGARRAY_BOUND", "64")
    assert dist_store._options("dist_sync", None, None, None, 2)[2] == 64
    monkeypatch.setenv("GPUKV_BIGARRAY_BOUND", "32")
    assert dist_store._options("dist_sync", None, None, None, 2)[2] == 32


def test_a_blank_chunk_size_is_unset(monkeypatch):
    from gpukv.distributed.mpi.chunks import chosen_chunk_bytes
    monkeypatch.setenv("GPUKV_DIST_CHUNK_BYTES", " ")
    assert chosen_chunk_bytes() is None


@pytest.mark.parametrize("variable,rank,warned", [
    ("RANK", "0", True), ("RANK", "1", False), ("PMI_RANK", "3", False),
    ("OMPI_COMM_WORLD_RANK", "0", True), (None, None, True)])
def test_an_unknown_setting_is_said_by_rank_0_alone(variable, rank, warned, alone,
                                                    monkeypatch, caplog):
    """The ranks of a job share an environment: one line for the job, not one a rank."""
    if variable:
        monkeypatch.setenv(variable, rank)
    monkeypatch.setenv("GPUKV_DIST_TIMOUT", "5")
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        gpukv.create("local")
    assert any("GPUKV_DIST_TIMOUT" in r.getMessage() for r in caplog.records) == warned

"""The GPUKV_* settings: every variable the package reads is listed (gpukv._env.SETTINGS) and
documented (docs/settings.md), and one that is none of them, a misspelling, is named by
`create` (once per process) and by `gpukv info` rather than silently without effect."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

import gpukv
from gpukv import _env
from gpukv.api import factory
from gpukv.tools import info as _info

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"GPUKV_[A-Z0-9_]*[A-Z0-9]\b")


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
    ({"GPUKV_DIST_TIMEOUT": "5", "GPUKV_TEST_GPU": "1", "GPUKV_EMU_RACES": "0",
      "MXNET_KVSTORE_TREE_ARRAY_BOUND": "10", "GPUKVX": "1"}, {}),
])
def test_unknown_settings_are_named_with_the_one_they_resemble(environ, unknown):
    """Known settings, the test suite's switches and other programs' variables are not
    named; a misspelling is, with the closest setting; an unrelated name alone."""
    assert _env.unknown_settings(environ) == unknown


def test_create_warns_once_per_process_of_an_unknown_setting(monkeypatch, caplog):
    monkeypatch.setattr(factory, "_UNKNOWN_SAID", set())
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


def test_create_says_nothing_when_every_setting_is_known(monkeypatch, caplog):
    monkeypatch.setattr(factory, "_UNKNOWN_SAID", set())
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

"""`gpukv info` options: --gpus only where it means something, within the planner's reach,
and install hints that work from a source checkout."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpukv.tools import info as _info

from .. import gpu_env

REPO = Path(__file__).resolve().parents[2]


def _usage_error(argv, capsys) -> str:
    """Run `gpukv info argv`, expect an argparse error (exit 2) and return its message."""
    with pytest.raises(SystemExit) as exc:
        _info.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def no_planning(monkeypatch):
    """Makes any use of the planner fail the test (refusals must come before it)."""
    def plan(matrix):
        raise AssertionError("the planner ran")
    monkeypatch.setattr(_info, "plan", plan)


@pytest.mark.parametrize("argv", [["--gpus", "4"], ["--simulate", "dgx1", "--gpus", "4"]])
def test_info_gpus_without_a_resizable_simulation_is_refused(argv, no_planning, capsys):
    """--gpus without --simulate, or with dgx1 (always 8 GPUs), is a usage error naming
    the simulations it applies to."""
    err = _usage_error(argv, capsys)
    assert "--gpus" in err and "nvswitch" in err and "pcie" in err


@pytest.mark.parametrize("gpus", ["0", "-2", f"{_info.MAX_SIMULATED_GPUS + 1}", "100"])
def test_info_gpus_out_of_range_is_refused_with_the_limit(gpus, no_planning, capsys):
    """--gpus below 1 or above the planner's limit is a usage error that says the range."""
    err = _usage_error(["--simulate", "nvswitch", "--gpus", gpus], capsys)
    assert "argument --gpus" in err and f"1..{_info.MAX_SIMULATED_GPUS}" in err


def test_info_simulates_the_largest_allowed_machine(capsys):
    """The largest --gpus allowed is planned: one tree per root and a ring over all."""
    n = _info.MAX_SIMULATED_GPUS
    assert _info.main(["--simulate", "pcie", "--gpus", str(n), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulated"]
    assert len(sim["trees"]) == n and sorted(sim["ring"]) == list(range(n))


def test_info_without_cupy_says_how_to_install_from_a_checkout():
    """Without CuPy, `info` suggests installing the CUDA extra from the source tree
    (gpukv is not on PyPI), never `pip install 'gpukv[cuda12]'`."""
    code = textwrap.dedent("""
        import sys
        sys.modules["cupy"] = None  # makes `import cupy` fail
        from gpukv.__main__ import main
        sys.exit(main(["info"]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=gpu_env.subprocess_env(gpus=False),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "pip install '.[cuda12]'" in done.stdout
    assert "gpukv[" not in done.stdout


@pytest.mark.parametrize("on_gpu", [True, False], ids=["gpu", "host"])
def test_info_names_a_malformed_setting_the_stores_refuse(on_gpu, monkeypatch):
    """A GPUKV_STRATEGY or GPUKV_DETERMINISTIC that stores refuse is named by `info`,
    the diagnosis command, on a machine with GPUs and on one without."""
    monkeypatch.setenv("GPUKV_STRATEGY", "bogus")
    monkeypatch.setenv("GPUKV_DETERMINISTIC", "maybe")
    strategy = _info.strategy_info(on_gpu=on_gpu)
    text = _info.render({**_info.collect(), "strategy": strategy})
    assert "malformed setting (GPU stores refuse it): GPUKV_STRATEGY='bogus': unknown" in text
    assert ("malformed setting (stores refuse it): GPUKV_DETERMINISTIC='maybe': expected "
            "1 (on) or 0 (off)") in text
    # (on a host too: no '-> cpu' for a setting a GPU store refuses)
    assert "-> error: ArgumentError: GPUKV_STRATEGY='bogus'" in text and "-> cpu" not in text


@pytest.mark.parametrize("name,value,says", [
    ("GPUKV_HOST_JIT", "yes", "expected 1 (on) or 0 (off)"),
    ("GPUKV_HOST_THREADS", "0", "expected a positive integer"),
    ("GPUKV_VIRTUAL_GPUS", "-3", "expected a positive integer"),
    ("GPUKV_TREE_ARRAY_BOUND", "-1", "expected a positive integer"),
    ("GPUKV_DIST_CHUNK_BYTES", "x", "expected a positive number of bytes"),
    ("GPUKV_NUM_SERVERS", "x", "expected an integer >= 0"),
    ("GPUKV_DIST_TIMEOUT", "-5", "expected finite seconds > 0"),
    ("GPUKV_BIGARRAY_BOUND", "-1", "expected a positive integer")])
def test_info_names_every_malformed_setting_a_store_would_refuse(name, value, says,
                                                                 monkeypatch):
    """Each GPUKV_* setting a store refuses at create is named by `info` with its value,
    as the store's own parser words it; with none set, none is named."""
    assert "malformed setting" not in _info.render(_info.collect())
    monkeypatch.setenv(name, value)
    text = _info.render(_info.collect())
    who = {"GPUKV_VIRTUAL_GPUS": "GPU stores", "GPUKV_HOST_JIT": "stores",
           "GPUKV_HOST_THREADS": "stores", "GPUKV_TREE_ARRAY_BOUND": "the tree and auto "
           "strategies"}.get(name, "dist stores")
    assert f"malformed setting ({who} refuse it): {name}={value!r}: {says}" in text


def test_a_dist_store_after_info_in_the_same_process_starts_mpi():
    """`gpukv info` asks for the MPI library's version without starting MPI; a dist store
    made later in the same process still starts it (before, MPICH ended the process:
    'Attempting to use an MPI routine before initializing')."""
    pytest.importorskip("mpi4py")
    program = ("import gpukv\n"
               "from gpukv.tools import info\n"
               "assert info.mpi_info()['available']\n"
               "kv = gpukv.create('dist_sync')\n"
               "assert (kv.rank, kv.num_workers) == (0, 1)\n"
               "print('made', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "made\n", proc.stdout + proc.stderr

"""Every file of the tree passes the static checks: mypy over the package, ruff and flake8
over the package, the tests, the benchmarks and the examples (settings in pyproject.toml and
setup.cfg)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: every folder of Python the project keeps; nothing is left to a tool's default exclusions
TREES = ["gpukv", "tests", "benchmarks", "examples"]


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_mypy_reports_no_error():
    """`python -m mypy` (the [tool.mypy] settings: files, optional libraries) exits 0."""
    done = _run("mypy")
    assert done.returncode == 0, f"mypy found errors:\n{done.stdout}{done.stderr}"


def test_ruff_reports_no_error():
    """`ruff check` (the [tool.ruff] rules) finds nothing in any tree."""
    done = _run("ruff", "check", "--no-cache", *TREES)
    assert done.returncode == 0, f"ruff found errors:\n{done.stdout}{done.stderr}"


def test_flake8_reports_no_error():
    """flake8 (setup.cfg's [flake8]) finds nothing in any tree."""
    done = _run("flake8", *TREES)
    assert done.returncode == 0, f"flake8 found errors:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("tree", TREES)
def test_the_linters_read_every_file(tree):
    """A folder a tool skips as build output (`dist`, `build`) would hide its files from
    the lint: ruff lists every .py file of the tree as checked."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / tree).rglob("*.py")
             if ".venv" not in p.parts}
    done = _run("ruff", "check", "--no-cache", "--show-files", tree)
    listed = {Path(line.strip()).resolve().relative_to(ROOT).as_posix()
              for line in done.stdout.splitlines() if line.strip().endswith(".py")}
    assert files and not files - listed, sorted(files - listed)


def test_no_module_reads_another_class_private_members():
    """`ruff check --select SLF001` (private member accessed) finds nothing in the package:
    where a layer needs more of a class than users do, the class offers it publicly."""
    done = _run("ruff", "check", "--no-cache", "--select", "SLF001", "gpukv")
    assert done.returncode == 0, f"private members read:\n{done.stdout}{done.stderr}"

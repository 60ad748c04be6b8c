"""The package type-checks: mypy, configured in pyproject.toml, finds no error."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_reports_no_error():
    """`python -m mypy` (the [tool.mypy] settings: files, optional libraries) exits 0."""
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"mypy found errors:\n{done.stdout}{done.stderr}"

"""The README's Python examples run as written."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_python_examples():
    """The README carries the API tour as runnable code."""
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    """Each README example runs in order after the ones before it, without error (the
    PyTorch one where PyTorch is installed)."""
    monkeypatch.chdir(tmp_path)
    if "import torch" in BLOCKS[index]:
        pytest.importorskip("torch")
    has_torch = importlib.util.find_spec("torch") is not None
    namespace: dict = {}
    for block in BLOCKS[: index + 1]:
        if "import torch" in block and not has_torch:
            continue
        exec(compile(block, f"README block {index}", "exec"), namespace)

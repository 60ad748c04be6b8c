"""The README's Python examples run as written."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
_OPTIONAL = ("torch", "jax")  # libraries a README example may need
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_python_examples():
    """The README carries the API tour as runnable code."""
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    """Each README example runs in order after the ones before it, without error (the
    PyTorch and JAX ones where those are installed)."""
    monkeypatch.chdir(tmp_path)
    for lib in _OPTIONAL:
        if f"import {lib}" in BLOCKS[index]:
            pytest.importorskip(lib)
    missing = [lib for lib in _OPTIONAL if importlib.util.find_spec(lib) is None]
    namespace: dict = {}
    for block in BLOCKS[: index + 1]:
        if any(f"import {lib}" in block for lib in missing):
            continue
        exec(compile(block, f"README block {index}", "exec"), namespace)

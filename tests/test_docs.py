"""The guides under docs/ run as written: every Python block of every page on its own, in
a fresh namespace, where the libraries it imports are installed."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).parents[1] / "docs"
BLOCKS = [(page.name, i, block) for page in sorted(DOCS.glob("*.md"))
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(),
                                               flags=re.S))]
#: libraries a page's example may need; a block that imports one runs where it is installed
_OPTIONAL = ("torch", "jax", "optax")


def _needs(block: str) -> list[str]:
    return [lib for lib in _OPTIONAL
            if re.search(rf"^\s*(import|from)\s[^\n]*\b{lib}\b", block, flags=re.M)]


def test_the_guides_have_examples():
    assert {page for page, _, _ in BLOCKS} >= {"jax.md", "trainer.md"}


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_a_guide_example_runs_on_its_own(page, index, block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files an example writes land in a scratch folder
    missing = [lib for lib in _needs(block) if importlib.util.find_spec(lib) is None]
    if missing:
        pytest.skip(f"{page} block {index} needs {', '.join(missing)}")
    exec(compile(block, f"{page} block {index}", "exec"), {})

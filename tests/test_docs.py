"""The guides under docs/ run as written: every Python block of every page on its own, in
a fresh namespace, where the libraries it imports are installed; every shell command runs
from the project's virtual environment; and every page is in the site's navigation."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from .test_readme import commands_outside_the_venv

ROOT = pathlib.Path(__file__).parents[1]
DOCS = pathlib.Path(__file__).parents[1] / "docs"
BLOCKS = [(page.name, i, block) for page in sorted(DOCS.glob("*.md"))
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(),
                                               flags=re.S))]
SHELL_BLOCKS = [(page.name, i, block) for page in sorted(DOCS.glob("*.md"))
                for i, block in enumerate(re.findall(r"```bash\n(.*?)```", page.read_text(),
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
    # (an optimizer an example registers stays in this page's example alone)
    from gpukv.optim import _base
    monkeypatch.setattr(_base, "_REGISTRY", dict(_base._REGISTRY))
    missing = [lib for lib in _needs(block) if importlib.util.find_spec(lib) is None]
    if missing:
        pytest.skip(f"{page} block {index} needs {', '.join(missing)}")
    exec(compile(block, f"{page} block {index}", "exec"), {})


@pytest.mark.parametrize("page,index,block", SHELL_BLOCKS,
                         ids=[f"{p}-{i}" for p, i, _ in SHELL_BLOCKS])
def test_a_guide_command_runs_from_the_virtual_environment(page, index, block):
    """Every Python, pip, mpiexec, pytest, gpukv or mkdocs a shell block of a guide runs is
    the one in .venv/bin, as the README's are."""
    outside = commands_outside_the_venv(block)
    assert not outside, f"{page}: " + "; ".join(outside)


def test_every_page_is_in_the_navigation():
    """mkdocs.yml's nav lists every page under docs/ (a page left out would be built but
    found by no one), and the README links every guide."""
    nav = (ROOT / "mkdocs.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []
    guides = [p for p in pages if "/" not in p and p != "index.md"]
    assert [p for p in guides if f"(docs/{p})" not in readme] == []

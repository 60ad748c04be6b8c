"""The README's examples run as written: every Python block on its own, and every shell
command through the project's virtual environment."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex

import pytest

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
SHELL_BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
#: libraries a README example may need; a block that imports one is run where it is installed
_OPTIONAL = ("torch", "jax", "optax")
#: the commands a shell block may run, each from the virtual environment's bin/
_VENV_COMMANDS = ("python", "python3", "pip", "pip3", "mpiexec", "mpirun", "pytest", "gpukv",
                  "mkdocs")


def _needs(block: str) -> list[str]:
    """The optional libraries `block` imports."""
    return [lib for lib in _OPTIONAL
            if re.search(rf"^\s*(import|from)\s[^\n]*\b{lib}\b", block, flags=re.M)]


def test_readme_has_python_examples():
    """The README carries the API tour as runnable code."""
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_on_its_own(index, tmp_path, monkeypatch):
    """Each README example runs by itself, copied alone into a fresh interpreter namespace
    (its imports included), without error; one that imports PyTorch or JAX where that
    library is installed."""
    monkeypatch.chdir(tmp_path)  # files an example writes land in a scratch folder
    missing = [lib for lib in _needs(BLOCKS[index]) if importlib.util.find_spec(lib) is None]
    if missing:
        pytest.skip(f"README block {index} needs {', '.join(missing)}")
    exec(compile(BLOCKS[index], f"README block {index}", "exec"), {})


def commands_outside_the_venv(block: str) -> list[str]:
    """The commands of a shell block that run a Python, pip, mpiexec, pytest, gpukv or
    mkdocs other than the one in .venv/bin (only `python3 -m venv`, which makes it, may)."""
    found = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if (word.rsplit("/", 1)[-1] not in _VENV_COMMANDS or word.startswith(".venv/bin/")
                    or words[i - 1:i] == ["-m"]):  # `python -m gpukv`: a module, no command
                continue
            if words[i:i + 3] != ["python3", "-m", "venv"]:
                found.append(f"{line.strip()!r} runs {word!r}, not .venv/bin/{word}")
    return found


@pytest.mark.parametrize("index", range(len(SHELL_BLOCKS)))
def test_readme_commands_run_from_the_virtual_environment(index):
    """Every Python, pip or mpiexec a shell block of the README runs is the one in .venv/bin
    (the venv its first commands make), as the other blocks' are; only `python3 -m venv`,
    which makes it, runs outside."""
    assert not commands_outside_the_venv(SHELL_BLOCKS[index]), \
        "README: " + "; ".join(commands_outside_the_venv(SHELL_BLOCKS[index]))


def test_readme_is_short():
    """The README stays an entry point (what gpukv is, the set-up commands, a quick start,
    where the guides are); the guides live under docs/."""
    assert len(README.splitlines()) <= 250


@pytest.mark.parametrize("marker,install", [("<!-- demo-command -->", "."),
                                            ("<!-- test-command -->", "'.[test]'")])
def test_readme_keeps_the_commands_ci_runs(marker, install):
    """.ci/run reads the demo and test commands from the line after their markers, inside
    the first shell block after each; the demo installs gpukv alone, the tests their
    tools too."""
    after = README.split(marker, 1)[1].lstrip("\n")
    assert after.startswith(f"```bash\npython3 -m venv .venv && .venv/bin/pip install -q "
                            f"{install} && ")

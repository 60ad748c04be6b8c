"""The layering rule, read from the code: above the device layer, no module reaches into
`gpukv.device.cuda`; CUDA is asked for through `gpukv.device`'s verbs and public face
(`gpukv/tools/` alone may ask `device.cuda` for CUDA facts)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpukv

PACKAGE = Path(gpukv.__file__).resolve().parent
#: the packages (and modules) above the device layer that must keep to its face
ABOVE_DEVICE = ["comm", "encoding", "layout", "checkpoints", "store", "distributed", "api", "optim",
                "torch", "jax"]
FORBIDDEN = "gpukv.device.cuda"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every module that code of package `package`
    imports, relative imports resolved; `from P import name` counts as importing both P
    and P.name (which may be a submodule)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _package_of(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _reaches_cuda(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


def _files(place: str) -> list[Path]:
    target = PACKAGE / place
    return [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("place", ABOVE_DEVICE)
def test_no_module_above_the_device_layer_imports_device_cuda(place):
    """No module of `place` imports `gpukv.device.cuda` or anything in it, absolutely or
    relatively: each such import names a verb `gpukv.device` should offer."""
    files = _files(place)
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {module}" for path in files
             for line, module in imported_modules(path.read_text(), _package_of(path))
             if _reaches_cuda(module)]
    assert files
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("source", "reaches"), [
    ("from ..device.cuda import nccl", True),
    ("from ..device import cuda", True),
    ("from ..device.cuda.probe import p2p_ranks", True),
    ("import gpukv.device.cuda.device", True),
    ("from gpukv.device.cuda.device import gpu_count", True),
    ("from ..device import gpu_count", False),
    ("from ..device.nccl import nccl_module", False),
    ("from . import cuda", False),
    ("from ...device.cuda import probe", False),
])
def test_the_import_reader_resolves_every_form(source, reaches):
    """The checker sees a `device.cuda` import in each form it can be written in a module
    of gpukv.comm (absolute, relative, the package or one of its modules), and no other:
    relative imports resolve from the module's package, and one that climbs above gpukv
    names no module of it."""
    modules = [module for _, module in imported_modules(source, "gpukv.comm")]
    assert any(_reaches_cuda(m) for m in modules) is reaches


def test_the_launcher_imports_no_store_nor_engine():
    """gpukv/launcher/ (the supervisor of `gpukv run`) imports nothing of gpukv but its
    own modules, the error types and the environment's readers (which import nothing
    but the error types): the ranks reach it only through `run_report`."""
    files = _files("launcher")
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {module}" for path in files
             for line, module in imported_modules(path.read_text(), _package_of(path))
             if module.startswith("gpukv.") and not module.startswith(
                 ("gpukv.launcher", "gpukv._errors", "gpukv._env"))]
    assert files
    assert not found, "\n".join(found)


def test_the_canonical_order_stands_alone():
    """gpukv/canonical/ (the tree and its sums on NumPy) imports nothing of gpukv but its
    own modules: every layer that sums in the canonical order (the device layer's host
    sum included) can use it."""
    files = _files("canonical")
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {module}" for path in files
             for line, module in imported_modules(path.read_text(), _package_of(path))
             if module.startswith("gpukv.") and not module.startswith("gpukv.canonical")]
    assert files
    assert not found, "\n".join(found)

"""The API reference has something to say about every public name: each public function,
class, method and property of the documented modules has a docstring, and a callable's
docstring names each of its parameters."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import types

import pytest

#: the modules the reference documents (docs/api/), with the library each needs
MODULES = {"gpukv": None, "gpukv.optim": None, "gpukv.optim.lr_scheduler": None,
           "gpukv._errors": None, "gpukv.torch": "torch", "gpukv.jax": "jax",
           "gpukv.timeline": None}


def _public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:  # a module without __all__: what it defines itself
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
    return sorted(names)


def _own(cls: type) -> list[tuple[str, object]]:
    """The public members of `cls` that gpukv defines (not those of `object` or built-in
    exceptions), each once, from the class that defines it."""
    members = []
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is not cls or not owner.__module__.startswith("gpukv"):
            continue
        members.append((name, vars(cls)[name]))
    return members


def _parameters(func) -> list[str]:
    """The names a docstring of `func` must mention: all but self and cls."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return []
    return [p.name for p in signature.parameters.values() if p.name not in ("self", "cls")]


def _missing(doc: str | None, params: list[str]) -> list[str]:
    if not doc:
        return ["(no docstring)"]
    return [p for p in params if not re.search(rf"(?<![\w.]){re.escape(p)}\b", doc)]


def _entries(module_name: str):
    """(qualified name, what the docstring lacks) for every documented object of a module."""
    module = importlib.import_module(module_name)
    for name in _public_names(module):
        obj = getattr(module, name)
        qualname = f"{module_name}.{name}"
        if isinstance(obj, types.ModuleType):
            yield qualname, [] if obj.__doc__ else ["(no docstring)"]
        elif inspect.isclass(obj):
            yield from _class_entries(qualname, obj)
        elif callable(obj):
            yield qualname, _missing(inspect.getdoc(obj), _parameters(obj))


def _inherited(cls: type, name: str) -> list[tuple[str | None, list[str]]]:
    """(docstring, parameters) of `name` in `cls` and in each gpukv class it derives from:
    what an override or a subclass's constructor may leave to the base that documents it."""
    found = []
    for base in cls.__mro__:
        if name not in vars(base) or not base.__module__.startswith("gpukv"):
            continue
        member = vars(base)[name]
        if isinstance(member, property):
            found.append((member.__doc__, []))
        else:
            func = getattr(member, "__func__", member)
            doc = base.__doc__ if name == "__init__" else func.__doc__
            if name == "__init__" and func.__doc__:
                doc = "\n".join(d for d in (doc, func.__doc__) if d)
            found.append((inspect.cleandoc(doc) if doc else None, _parameters(func)))
    return found


def _missing_in(cls: type, name: str) -> list[str]:
    """What the docstrings of `cls.name` lack: a parameter counts as documented where the
    member's own docstring names it, or where a gpukv base class's docstring of the same
    member (of its constructor, for `__init__`) names it and takes it too."""
    chain = _inherited(cls, name)
    own_doc, params = chain[0]
    if own_doc is None:
        own_doc = next((doc for doc, _ in chain if doc), None)
    lacking = _missing(own_doc, params)
    return [p for p in lacking if not any(p in base_params and not _missing(doc, [p])
                                          for doc, base_params in chain[1:])]


def _class_entries(qualname: str, cls: type):
    doc = inspect.getdoc(cls) if cls.__doc__ else None  # not one inherited from a base
    if "__init__" in vars(cls) and cls.__module__.startswith("gpukv"):
        yield qualname, _missing(doc, []) or _missing_in(cls, "__init__")
    else:
        yield qualname, _missing(doc, [])
    for name, member in _own(cls):
        if isinstance(member, property) or inspect.isfunction(getattr(member, "__func__",
                                                                      member)):
            yield f"{qualname}.{name}", _missing_in(cls, name)


@pytest.mark.parametrize("module_name", sorted(MODULES))
def test_every_public_name_is_documented_with_its_parameters(module_name):
    """Every public function, class, method and property of a module the API reference
    shows has a docstring, and each parameter of a callable (self and cls aside) is named
    in it (a class's in the class's or its __init__'s docstring)."""
    needs = MODULES[module_name]
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{module_name} needs {needs}")
    lacking = {name: missing for name, missing in _entries(module_name) if missing}
    assert not lacking, "docstrings lacking (name: what is missing):\n" + "\n".join(
        f"  {name}: {', '.join(missing)}" for name, missing in sorted(lacking.items()))


def test_the_reference_pages_document_every_module():
    """Each module the test above checks has its `::: module` block in docs/api/; the
    errors, whose module is private, are listed by name under `::: gpukv` (their public
    names) on errors.md, every one of them."""
    import pathlib
    folder = pathlib.Path(__file__).parents[1] / "docs" / "api"
    pages = "\n".join(p.read_text() for p in folder.glob("*.md"))
    documented = set(re.findall(r"^::: ([\w.]+)", pages, flags=re.M))
    assert set(MODULES) - {"gpukv._errors"} <= documented, sorted(set(MODULES) - documented)
    errors = (folder / "errors.md").read_text()
    assert re.search(r"^::: gpukv$", errors, flags=re.M), errors
    listed = set(re.findall(r"^ +- (\w+)$", errors, flags=re.M))
    assert set(_public_names(importlib.import_module("gpukv._errors"))) == listed

"""The public API: what the faces export resolves and documents itself, the faces are lists of
re-exports of ``tenplex_jax._src``, the implementation never imports a face, and the faces a
launcher or a store server imports start no JAX.

A face is ``tenplex_jax`` or one of the modules and packages under it that are not ``_src``; its
``__all__`` is its public names. Each test names every offender, not just the first.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import inspect
import itertools
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tenplex_jax

ROOT = pathlib.Path(tenplex_jax.__file__).parent
FACES = (
    "tenplex_jax",
    "tenplex_jax.data",
    "tenplex_jax.pipelining",
    "tenplex_jax.typing",
    "tenplex_jax.errors",
    "tenplex_jax.elastic",
    "tenplex_jax.planner",
    "tenplex_jax.multihost",
    "tenplex_jax.multihost.store",
    "tenplex_jax.simulator",
    "tenplex_jax.wsp",
)
# the faces' own modules, which ``_src`` must never import (the first part after tenplex_jax)
FACE_PARTS = frozenset(
    (
        "data",
        "pipelining",
        "typing",
        "errors",
        "elastic",
        "planner",
        "multihost",
        "simulator",
        "wsp",
    )
)
# what a face may import besides ``tenplex_jax._src``: what a lazy module needs
FACE_STDLIB = frozenset(("__future__", "importlib", "sys", "typing"))
# faces the launcher, the store server and the command line import before they need JAX
LIGHT = (
    "tenplex_jax",
    "tenplex_jax.multihost",
    "tenplex_jax.multihost.store",
    "tenplex_jax.errors",
)
TOP_LEVEL_MAX = 14


def _public() -> list[tuple[str, str, object]]:
    """(face, name, object) for every name in every face's ``__all__``."""
    out = []
    for face in FACES:
        module = importlib.import_module(face)
        out += [(face, name, getattr(module, name)) for name in module.__all__]
    return out


def _documented(obj) -> bool:
    return inspect.isclass(obj) or inspect.isfunction(obj)


def _own_doc(obj) -> str:
    """The object's own docstring: not a base class's, not the one ``dataclass`` writes."""
    doc = obj.__doc__ or ""
    if (
        inspect.isclass(obj)
        and dataclasses.is_dataclass(obj)
        and doc.startswith(obj.__name__ + "(")
    ):
        return ""  # dataclass's generated "Name(field: type, ...)"
    return inspect.cleandoc(doc)


def _parameters(fn, *, skip_first: bool = False) -> list[str]:
    """The parameters a caller passes: not self/cls, ``*args``/``**kwargs``, or ``_private``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: Exception.__init__
        return []
    if skip_first and params and params[0].kind is not inspect.Parameter.VAR_POSITIONAL:
        params = params[1:]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name
        for p in params
        if p.kind not in variadic and not p.name.startswith("_") and p.name not in ("self", "cls")
    ]


def _constructor_parameters(cls) -> list[str]:
    # __init__, not the class: a class with a __new__(cls, *args, **kwargs) (ElasticJob) would
    # hide its real parameters from inspect.signature(cls)
    return _parameters(cls.__init__, skip_first=True)


def _labelled(doc: str, name: str) -> bool:
    """``name`` is an entry of an Args or Attributes section: ``name: ...`` on a line of its own."""
    return re.search(rf"^\s+{re.escape(name)}( \([^)]*\))?:", doc, re.MULTILINE) is not None


def _mentioned(doc: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", doc) is not None


def _members(cls) -> list[tuple[str, object]]:
    """The public methods and properties of a public class, its private bases' included (what a
    user calls on it), but not those of classes outside tenplex_jax (``Exception.add_note``)."""
    out = []
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next(k for k in cls.__mro__ if name in vars(k))
        if not owner.__module__.startswith("tenplex_jax"):
            continue
        member = vars(owner)[name]
        if isinstance(member, (classmethod, staticmethod)):
            member = member.__func__
        if isinstance(member, property) or inspect.isfunction(member):
            out.append((name, member))
    return out


def _face_file(face: str) -> pathlib.Path:
    parts = face.split(".")[1:]
    path = ROOT.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _source_of(face: str, name: str) -> pathlib.Path:
    """The ``_src`` module a face imports ``name`` from (the top level: its ``_EXPORTS``)."""
    if face == "tenplex_jax":
        return ROOT / "_src" / (tenplex_jax._EXPORTS[name].replace(".", "/") + ".py")
    for node in ast.walk(ast.parse(_face_file(face).read_text())):
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            path = ROOT.parent.joinpath(*node.module.split("."))
            return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    raise AssertionError(f"{face} does not import {name}")


def _attribute_doc(path: pathlib.Path, name: str) -> str:
    """The docstring under a module-level assignment (``NAME = ...`` then a string, as Sphinx
    reads it): how a constant or a type alias is documented."""
    body = ast.parse(path.read_text()).body
    for node, after in itertools.pairwise(body):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        assigned = any(isinstance(t, ast.Name) and t.id == name for t in targets)
        if assigned and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            return str(after.value.value)
    return ""


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file; relative imports resolved."""
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # ``from tenplex_jax import data`` imports the module tenplex_jax.data
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


# -- what the faces export -------------------------------------------------------------------


def test_top_level_is_small():
    assert len(tenplex_jax.__all__) <= TOP_LEVEL_MAX, tenplex_jax.__all__
    assert sorted(tenplex_jax.__all__) == sorted(tenplex_jax._EXPORTS)


def test_every_public_name_resolves_and_has_a_docstring():
    missing = []
    for face in FACES:
        module = importlib.import_module(face)
        if not (module.__doc__ or "").strip():
            missing.append(f"{face} (the module)")
        for name in module.__all__:
            obj = getattr(module, name, None)  # a lazy name that does not resolve raises here
            if obj is None:
                missing.append(f"{face}.{name}: does not resolve")
            elif _documented(obj):
                if len(_own_doc(obj)) < 20:
                    missing.append(f"{face}.{name}: no docstring of its own")
            elif inspect.ismodule(obj):
                missing.append(f"{face}.{name}: a module in __all__")
            elif len(_attribute_doc(_source_of(face, name), name)) < 20:
                missing.append(f"{face}.{name}: no docstring under its assignment")
    assert not missing, "\n".join(missing)


def test_every_argument_is_documented():
    """Every parameter of a public function or class constructor (a dataclass's fields) is an
    entry of its docstring's Args or Attributes section (the class docstring for a class)."""
    undocumented = []
    for face, name, obj in _public():
        if inspect.isclass(obj):
            params = _constructor_parameters(obj)
        elif inspect.isfunction(obj):
            params = _parameters(obj)
        else:
            continue
        doc = _own_doc(obj)
        undocumented += [f"{face}.{name}({p})" for p in params if not _labelled(doc, p)]
    assert not undocumented, "undocumented arguments:\n" + "\n".join(undocumented)


def test_every_public_method_and_property_is_documented():
    """A public class's methods and properties each have a docstring that names every
    parameter."""
    undocumented = []
    for face, name, obj in _public():
        if not inspect.isclass(obj):
            continue
        for member_name, member in _members(obj):
            where = f"{face}.{name}.{member_name}"
            doc = inspect.cleandoc(member.__doc__ or "")
            if not doc:
                undocumented.append(f"{where}: no docstring")
                continue
            if isinstance(member, property):
                continue
            for p in _parameters(member):
                if not _mentioned(doc, p):
                    undocumented.append(f"{where}({p})")
    assert not undocumented, "undocumented:\n" + "\n".join(undocumented)


def _examples() -> list:
    """Every ``>>>`` example in the docstrings of the public names and their members."""
    finder, tests, seen = doctest.DocTestFinder(recurse=False), [], set()
    for face, name, obj in _public():
        if not _documented(obj):
            continue
        globs = {"np": np, "jax": jax, "jnp": jnp, "tj": tenplex_jax}
        globs |= {n: getattr(importlib.import_module(face), n) for n in FACE_NAMES[face]}
        globs |= vars(sys.modules[obj.__module__])  # the names its own module uses
        members = _members(obj) if inspect.isclass(obj) else []
        for label, item in [(name, obj)] + [(f"{name}.{m}", f) for m, f in members]:
            target = item.fget if isinstance(item, property) else item
            if id(target) in seen or ">>>" not in (target.__doc__ or ""):
                continue
            seen.add(id(target))
            tests += finder.find(target, f"{face}.{label}", globs=dict(globs))
    return [t for t in tests if t.examples]


FACE_NAMES = {face: importlib.import_module(face).__all__ for face in FACES}


@pytest.mark.parametrize("example", _examples(), ids=lambda t: t.name)
def test_docstring_examples_run(example):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(example)
    assert runner.failures == 0, f"{example.name}: {runner.failures} examples failed (above)"


# -- what the faces and the implementation import ----------------------------------------------


def test_faces_import_only_from_src():
    faces = sorted(p for p in ROOT.rglob("*.py") if "_src" not in p.relative_to(ROOT).parts)
    wrong = [
        f"{path.relative_to(ROOT.parent)}:{line}: imports {module}"
        for path in faces
        for line, module in _imports(path)
        if not module.startswith("tenplex_jax._src.") and module.split(".")[0] not in FACE_STDLIB
    ]
    assert faces and not wrong, "a face re-exports tenplex_jax._src only:\n" + "\n".join(wrong)


def test_src_never_imports_a_face():
    src = sorted((ROOT / "_src").rglob("*.py"))
    wrong = []
    for path in src:
        for line, module in _imports(path):
            parts = module.split(".")
            if parts[0] != "tenplex_jax" or (len(parts) > 1 and parts[1] == "_src"):
                continue
            if len(parts) == 1 or parts[1] in FACE_PARTS or parts[1] in tenplex_jax._EXPORTS:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: imports {module}")
    assert src and not wrong, "tenplex_jax._src imports only itself:\n" + "\n".join(wrong)


# the layers, lowest first: each imports only its own and the ones below. The core is what a
# one-process user needs; the wings stand on it; the command line stands on them all.
LAYERS = ("core", "multihost", "wsp|simulator", "cli")
WINGS = {"multihost": "multihost", "wsp": "wsp|simulator", "simulator": "wsp|simulator"}
# what opens sockets or starts processes: the wings' business, never the core's
NOT_IN_CORE = ("socket", "socketserver", "subprocess", "multiprocessing", "http", "runpy")


def _layer(module: str) -> str | None:
    """The layer of a tenplex_jax module (a face's or ``_src``'s), None outside tenplex_jax."""
    parts = module.split(".") + [""]
    if parts[0] != "tenplex_jax":
        return None
    area = parts[2] if parts[1] == "_src" else parts[1]
    return "cli" if area in ("cli", "__main__") else WINGS.get(area, "core")


def test_each_layer_imports_only_its_own_and_the_layers_below():
    """The core (layout, plan, reshard, data, checkpoint, the one-process loop, the planner)
    imports no wing and opens no socket; multihost stands on the core; wsp and the simulator
    on both; the command line on all. No import of the repository's benchmarks anywhere."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        mine = _layer(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
        for line, imported in _imports(path):
            top, theirs = imported.split(".")[0], _layer(imported)
            up = theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine)
            forbidden = top == "tenplex_jax_benchmarks" or (mine == "core" and top in NOT_IN_CORE)
            if up or forbidden:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {mine} imports {imported}")
    assert not wrong, "an import up the layers:\n" + "\n".join(wrong)


@pytest.mark.parametrize("face", LIGHT)
def test_light_faces_do_not_import_jax(face):
    code = f"import {face}, sys; assert 'jax' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, f"import {face} imports jax:\n{done.stderr[-2000:]}"

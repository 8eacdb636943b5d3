"""Modules keep to their own names: no private names across modules, no re-exports.

Read from the source (``ast``), nothing is imported. Within ``asyncckpt/``:

* no ``from x import _name`` of another module's private function, class or
  constant (importing a private *module*, ``from asyncckpt._engine import
  _copy``, is fine: its public names are its interface);
* no ``module._name`` on a module bound by an import (``_copy._helper``);
* a module other than a public namespace's ``__init__`` (``asyncckpt``,
  ``asyncckpt.tf``, ``.jax``, ``.keras``, ``.preemption``, ``.storage``,
  ``.jobrunner``: where the public API is listed) lists in ``__all__`` only
  names it defines, and keeps no import only to be imported from it
  (``# noqa: F401``): a user imports a name from where it is defined;
* one exception, deliberate, documented and time-limited: the deprecation
  shim ``asyncckpt/engine/__init__.py`` (the engine's old name, for one
  release) hands out ``asyncckpt._engine``'s names and modules. It is the only
  module that puts modules into ``sys.modules``, the only one besides the
  public ``__init__``s with a module ``__getattr__``, it must warn
  (``asyncckpt._deprecation``), and no module of the library, the benchmarks,
  the examples or the tests imports it (``tests/test_public_api.py`` does, to
  check that it warns).

Private attributes and methods of *objects* whose class another module
defines cannot be told apart statically; those are kept out by review.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncckpt"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _sources()
ALL_MODULES = {_module_name(p) for p in PACKAGE.rglob("*.py")}
#: Where the public API is listed (``tests/test_public_api.py`` pins each ``__all__``).
PUBLIC_NAMESPACES = {"asyncckpt", "asyncckpt.tf", "asyncckpt.jax", "asyncckpt.keras",
                     "asyncckpt.preemption", "asyncckpt.storage", "asyncckpt.jobrunner"}
#: The deprecation shim of ``asyncckpt.engine`` (now ``asyncckpt._engine``), removed in 0.3.
SHIM = "asyncckpt.engine"
#: Files that may import the shim: the test that checks it warns, and this checker's examples.
SHIM_IMPORTERS = {"tests/test_public_api.py", "tests/test_module_boundaries.py"}


def _shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _source_module(current: str, path: pathlib.Path, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    package = current.split(".")
    if path.name != "__init__.py":
        package.pop()
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def private_uses(current: str, path: pathlib.Path, tree: ast.AST) -> list[str]:
    """``from x import _y`` and ``x._y`` of another asyncckpt module's private names."""
    found = []
    modules: dict[str, str] = {}  # local name -> asyncckpt module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source_module(current, path, node)
            if not source or source.split(".")[0] != "asyncckpt":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in ALL_MODULES:
                    modules[alias.asname or alias.name] = full
                elif _private(alias.name) and source != current:
                    found.append(f"{_shown(path)}:{node.lineno}: "
                                 f"from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ALL_MODULES and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            target = modules[node.value.id]
            if f"{target}.{node.attr}" not in ALL_MODULES and target != current:
                found.append(f"{_shown(path)}:{node.lineno}: "
                             f"{node.value.id}.{node.attr} ({target})")
    return found


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def re_exports(name: str, path: pathlib.Path, tree: ast.Module) -> list[str]:
    """Names a module lists in ``__all__`` but does not define (public ``__init__``s may)."""
    if name in PUBLIC_NAMESPACES or name == SHIM:
        return []
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            defined = _defined(tree)
            found += [f"{_shown(path)}: __all__ lists {n!r}, defined elsewhere"
                      for n in ast.literal_eval(node.value) if n not in defined]
    found += [f"{_shown(path)}:{i}: an import kept only to be re-exported"
              for i, line in enumerate(path.read_text().splitlines(), 1)
              if "noqa: F401" in line]
    return found


def forwarding(name: str, path: pathlib.Path, tree: ast.Module) -> list[str]:
    """Ways of handing out other modules' names besides ``__all__``, outside their places.

    A module ``__getattr__`` (lazy or deprecated names) belongs in a public
    namespace's ``__init__`` or the shim; assigning into ``sys.modules``
    (module aliases) in the shim only.
    """
    found = []
    for node in tree.body:
        getattr_here = (
            (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")
            or (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__getattr__" for t in node.targets)))
        if getattr_here and name not in PUBLIC_NAMESPACES and name != SHIM:
            found.append(f"{_shown(path)}:{node.lineno}: a module __getattr__ outside the "
                         "public namespaces' __init__s and the asyncckpt.engine shim")
    if name != SHIM:
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules"
                    for t in node.targets)):
                found.append(f"{_shown(path)}:{node.lineno}: a module put into sys.modules "
                             "outside the asyncckpt.engine shim")
    return found


def shim_imports(path: pathlib.Path, tree: ast.AST) -> list[str]:
    """Imports of the ``asyncckpt.engine`` shim (or its modules)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(n == SHIM or n.startswith(SHIM + ".") for n in names):
            found.append(f"{_shown(path)}:{node.lineno}: imports the deprecated {SHIM} "
                         "(use asyncckpt's public names, or asyncckpt._engine's modules)")
    return found


#: Living benchmark code (``benchmarks/`` but its archive) that imports a private module of
#: asyncckpt because no public name does what it needs. Every other import there is public.
BENCHMARK_PRIVATE_IMPORTS = {
    # Kills located in their save phase: the campaign wraps the real save jobs and writers
    # to mark each phase of a save (docs/reliability.md); no public hook reaches inside them.
    "benchmarks/crash_zygote.py": {"asyncckpt.tf._job", "asyncckpt.jax._job",
                                   "asyncckpt._engine.files", "asyncckpt.jax._ocdbt"},
    # A slow disk: the real save job, its write delayed by the grid cell's write time.
    "benchmarks/suite/preemption.py": {"asyncckpt.tf._job", "asyncckpt.jax._job"},
    # The Keras row's floor copies exactly the arrays a backup copies (mid-epoch, the JAX
    # trainer's live values, not the variables'), which only asyncckpt.keras selects.
    "benchmarks/suite/keras_case.py": {"asyncckpt.keras._state"},
    # The CRC32C floor of the durable breakdown: the checksum a save computes, by the same
    # implementation (hardware CRC32C where there is one), over the state's bytes.
    "benchmarks/suite/engines.py": {"asyncckpt._engine"},
    # The breakdown's "other" and "retention wait": which recorded phases of
    # SaveStats.phases overlap the writer's path and which come after the commit.
    "benchmarks/suite/runner.py": {"asyncckpt._engine.metrics"},
}


def private_imports(tree: ast.AST) -> set[str]:
    """The private asyncckpt modules (or private names) a file imports."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if _private(a.name)]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] == "asyncckpt"
                  and any(_private(part) for part in n.split(".")[1:])}
    return found


def test_living_benchmarks_import_public_asyncckpt_modules_but_the_listed_exceptions():
    """The suite and the crash campaign measure the library from outside where they can.

    ``benchmarks/archive`` (not maintained, not run) is exempt.
    """
    found = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("benchmarks/archive/"):
            continue
        private = private_imports(ast.parse(path.read_text(), filename=str(path)))
        if private != BENCHMARK_PRIVATE_IMPORTS.get(rel, set()):
            found[rel] = sorted(private)
    assert not found, f"private imports differ from BENCHMARK_PRIVATE_IMPORTS: {found}"
    assert private_imports(ast.parse(
        "import asyncckpt.jax\nfrom asyncckpt import catalog\nimport asyncckpt._threads\n"
        "from asyncckpt.keras import _state\nfrom asyncckpt._engine.files import W\n")) == {
        "asyncckpt._threads", "asyncckpt.keras._state", "asyncckpt._engine.files"}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_names_of_other_modules_and_no_re_exports(name):
    path = MODULES[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    found = (private_uses(name, path, tree) + re_exports(name, path, tree)
             + forwarding(name, path, tree) + shim_imports(path, tree) * (name != SHIM))
    assert not found, "\n".join(found)


def test_the_engine_shim_is_only_a_shim():
    """``asyncckpt/engine/`` is one ``__init__`` that defines nothing and warns on import."""
    shim = PACKAGE / "engine"
    assert sorted(p.name for p in shim.glob("*.py")) == ["__init__.py"]
    tree = ast.parse((shim / "__init__.py").read_text())
    defined = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined == []
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert {"_deprecation.warn", "_deprecation.moved"} <= calls
    private = ast.parse((PACKAGE / "_engine" / "__init__.py").read_text())
    assert [type(n).__name__ for n in private.body] == ["Expr"]  # a docstring: exports nothing


def test_nothing_outside_its_test_imports_the_engine_shim():
    roots = [ROOT / d for d in ("asyncckpt", "benchmarks", "examples", "tests")]
    found = []
    for path in sorted(p for r in roots for p in r.rglob("*.py")):
        if (path.is_relative_to(PACKAGE / "engine")
                or str(path.relative_to(ROOT)) in SHIM_IMPORTERS):
            continue
        found += shim_imports(path, ast.parse(path.read_text(), filename=str(path)))
    assert not found, "\n".join(found)


def test_the_checker_finds_what_it_forbids(tmp_path):
    """Each rule fires on a module that breaks it (a checker that finds nothing proves nothing)."""
    here = PACKAGE / "storage" / "lazy.py"  # any module path: the rules read the tree only
    bad = ast.parse(
        "from asyncckpt.storage.protocol import _pool_map\n"
        "from asyncckpt._engine import _pages, writer\n"
        "import asyncckpt._engine.lock as lock_mod\n"
        "_pages._prefault(x)\n"
        "writer._helper()\n"
        "lock_mod._after_fork_in_child()\n"
        "from asyncckpt._engine._copy import copy_arrays\n"
        "from asyncckpt.storage import _not_a_module\n"
    )
    found = private_uses("asyncckpt.storage.lazy", here, bad)
    assert [f.split(": ", 1)[1] for f in found] == [
        "from asyncckpt.storage.protocol import _pool_map",
        "from asyncckpt.storage import _not_a_module",
        "_pages._prefault (asyncckpt._engine._pages)",
        "writer._helper (asyncckpt._engine.writer)",
        "lock_mod._after_fork_in_child (asyncckpt._engine.lock)",
    ]
    module = tmp_path / "mod.py"
    module.write_text("from asyncckpt._engine._copy import copy_arrays  # noqa: F401\n"
                      "def own(): ...\n__all__ = ['own', 'copy_arrays']\n")
    tree = ast.parse(module.read_text())
    found = re_exports("asyncckpt.storage.mod", module, tree)
    assert len(found) == 2 and "'copy_arrays'" in found[0] and "re-exported" in found[1]
    assert re_exports("asyncckpt.storage", module, tree) == []  # a public __init__ lists its API
    assert len(re_exports("asyncckpt._engine", module, tree)) == 2  # a private one does not
    forwards = ast.parse("import sys\nimport asyncckpt.engine.writer\n"
                         "def __getattr__(name): ...\nsys.modules['x'] = sys\n")
    found = forwarding("asyncckpt.storage.mod", module, forwards)
    assert [f.split(": ", 1)[1].split(" ")[:4] for f in found] == [
        ["a", "module", "__getattr__", "outside"], ["a", "module", "put", "into"]]
    assert len(forwarding("asyncckpt.storage", module, forwards)) == 1  # sys.modules: shim only
    assert forwarding(SHIM, module, forwards) == []
    assert len(shim_imports(module, forwards)) == 1
    assert len(shim_imports(module, ast.parse("from asyncckpt import engine\n"))) == 1


def test_architecture_lists_every_module_once():
    """``docs/architecture.md``'s table of modules matches the tree, one line per module."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2].strip() for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")][1:]  # no header
    listed = [cell.strip("`") for cell in rows]
    tree = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    assert sorted(listed) == tree
    assert len(listed) == len(set(listed))

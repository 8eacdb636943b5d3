"""Modules keep to their own names: no private names across modules, no re-exports.

Read from the source (``ast``), nothing is imported. Within ``asyncckpt/``:

* no ``from x import _name`` of another module's private function, class or
  constant (importing a private *module*, ``from asyncckpt._engine import
  _copy``, is fine: its public names are its interface);
* no ``module._name`` on a module bound by an import (``_copy._helper``);
* a module other than a package's ``__init__`` lists in ``__all__`` only
  names it defines, and keeps no import only to be imported from it
  (``# noqa: F401``): a user imports a name from where it is defined.

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


def re_exports(path: pathlib.Path, tree: ast.Module) -> list[str]:
    """Names a module other than an ``__init__`` lists in ``__all__`` but does not define."""
    if path.name == "__init__.py":
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


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_names_of_other_modules_and_no_re_exports(name):
    path = MODULES[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    found = private_uses(name, path, tree) + re_exports(path, tree)
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
    found = re_exports(module, tree)
    assert len(found) == 2 and "'copy_arrays'" in found[0] and "re-exported" in found[1]


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

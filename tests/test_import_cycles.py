"""No import cycle anywhere: in the library, the benchmarks, the examples, the test servers.

Two checks. Statically, each module's imports are read with ``ast`` and split
into *top-level* ones (run when the module is imported: the module body,
including ``if``/``try``/``with`` blocks and class bodies, but not
``if TYPE_CHECKING:``) and *lazy* ones (inside a function); a cycle among the
top-level imports makes the import order decide whether a name exists yet, and
a cycle through a lazy import still ties the modules together (a module run
with ``python -m`` that is imported back through one is executed twice, as the
old demos were). Neither kind is allowed. At runtime, a fresh interpreter
imports each module first, that is with none of asyncckpt's (or the
benchmarks' or examples') modules loaded, so every module is once the entry
point from which a cycle would show as a partially initialized module.

An import edge goes to the module whose namespace is read: ``import a.b`` and
``from a import b`` (``b`` a submodule) to ``a.b``; ``from a import name`` to
``a`` itself. The implicit import of a module's parent packages is not an edge:
Python enters them first and nothing of theirs is read.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, subprocess_env

#: The packages checked, and single modules outside them.
PACKAGES = ("asyncckpt", "benchmarks", "examples")
MODULES = ("tests/servers.py",)
#: Imported first in a fresh interpreter, one by one (the benchmark scripts are left out:
#: importing one runs nothing but builds its argument parser at most, and each is checked
#: statically).
RUNTIME_PACKAGES = ("asyncckpt", "benchmarks.suite", "examples")


@dataclass(frozen=True)
class Import:
    target: str  # the module imported
    lazy: bool  # inside a function
    line: int


def module_files(root: Path, packages=PACKAGES, modules=MODULES) -> dict[str, Path]:
    """Dotted module name to file, for every ``.py`` file of ``packages`` and ``modules``."""
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    files += [root / m for m in modules]
    out = {}
    for path in files:
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    """The imports of module ``name`` that reach a module in ``known``."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def base_of(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = name.split(".") if is_package else name.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def visit(nodes: list[ast.stmt], lazy: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend(Import(a.name, lazy, node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = base_of(node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.append(Import(sub if sub in known else base, lazy, node.lineno))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(node.body, True)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse, lazy)  # the body never runs
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child], lazy)
                    elif isinstance(child, ast.excepthandler):
                        visit(child.body, lazy)

    visit(ast.parse(path.read_text(), str(path)).body, False)
    return [i for i in found if i.target in known]


def import_graph(files: dict[str, Path]) -> dict[str, list[Import]]:
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def cycles(graph: dict[str, list[Import]], *, lazy: bool) -> list[list[tuple[str, Import]]]:
    """One cycle per strongly connected component (Tarjan), as ``(module, import)`` steps.

    With ``lazy=False`` only top-level imports are edges; with ``lazy=True`` every import.
    """
    edges = {m: [i for i in imps if lazy or not i.lazy] for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # iterative: no recursion limit on a deep graph
        work = [(v, iter(edges[v]))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            step = next(it, None)
            if step is not None:
                w = step.target
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on_stack:
                    low[node] = min(low[node], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == node:
                        break
                if len(comp) > 1 or any(i.target == node for i in edges[node]):
                    components.append(comp)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [_one_cycle(edges, comp) for comp in components]


def _one_cycle(edges: dict[str, list[Import]], comp: set[str]) -> list[tuple[str, Import]]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(comp)
    came: dict[str, tuple[str, Import]] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for i in edges[m]:
                if i.target not in comp:
                    continue
                if i.target == start:
                    path = [(m, i)]
                    while m != start:
                        m, step = came[m]
                        path.append((m, step))
                    return path[::-1]
                if i.target not in came:
                    came[i.target] = (m, i)
                    nxt.append(i.target)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(comp)}")


def describe(cycle: list[tuple[str, Import]]) -> str:
    return " -> ".join(f"{m} (line {i.line}{', lazy' if i.lazy else ''})" for m, i in cycle) + \
        f" -> {cycle[0][0]}"


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    return import_graph(module_files(REPO_ROOT))


def test_the_graph_sees_every_module_and_their_imports(graph):
    assert "asyncckpt.cli" in graph and "benchmarks.suite.cli" in graph
    assert {i.target for i in graph["benchmarks.__main__"]} == {"benchmarks.suite.cli"}
    assert "examples.demo" in graph and "tests.servers" in graph
    jax_demo = {i.target for i in graph["examples.jax_demo"] if not i.lazy}
    assert {"asyncckpt", "asyncckpt.jax", "examples.demo_report"} <= jax_demo
    suite_cli = {i.target for i in graph["benchmarks.suite.cli"] if i.lazy}
    assert {"benchmarks.suite.restore", "benchmarks.suite.engines"} <= suite_cli


def test_the_library_imports_nothing_that_sits_beside_it(graph):
    """The wheel holds ``asyncckpt`` only: it imports no benchmark, example or test module."""
    beside = ("benchmarks", "examples", "tests")
    found = [f"{m} (line {i.line}) imports {i.target}" for m, imports in graph.items()
             if m.split(".")[0] == "asyncckpt" for i in imports
             if i.target.split(".")[0] in beside]
    assert not found, "\n".join(found)


def test_no_cycle_among_top_level_imports(graph):
    found = cycles(graph, lazy=False)
    assert not found, "import cycles:\n" + "\n".join(describe(c) for c in found)


def test_no_cycle_through_lazy_imports(graph):
    found = cycles(graph, lazy=True)
    assert not found, ("import cycles through imports inside functions (move the shared "
                       "code into a module both import):\n" + "\n".join(describe(c) for c in found))


def test_the_checker_finds_top_level_and_lazy_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "from . import b\nA = 1\n",
        "b.py": "import pkg.sub.c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import A\n",  # top-level: a -> b -> sub.c -> a
        "d.py": "def f():\n    from pkg.e import E\n",
        "e.py": "from pkg import d\nE = 1\n",  # lazy: d -> e (top-level) -> d
        "f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.g import G\n",
        "g.py": "from pkg.f import *\nclass G:\n    from pkg import h\n",
        "h.py": "try:\n    import pkg.i\nexcept ImportError:\n    pass\n",
        "i.py": "with open(__file__):\n    import pkg.h\n",  # top-level: h -> i -> h
    }
    for rel, text in sources.items():
        (pkg / rel).write_text(text)
    g = import_graph(module_files(tmp_path, packages=("pkg",), modules=()))
    assert {i.target for i in g["pkg.g"]} == {"pkg.f", "pkg.h"}  # class bodies run at import
    assert g["pkg.f"] == []  # TYPE_CHECKING imports never run
    top = sorted(sorted(m for m, _ in c) for c in cycles(g, lazy=False))
    assert top == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.h", "pkg.i"]]
    every = sorted(sorted(m for m, _ in c) for c in cycles(g, lazy=True))
    assert every == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.d", "pkg.e"], ["pkg.h", "pkg.i"]]
    lazy_only = [c for c in cycles(g, lazy=True) if any(i.lazy for _, i in c)]
    assert describe(lazy_only[0]) == "pkg.d (line 2, lazy) -> pkg.e (line 1) -> pkg.d"


IMPORT_EACH_FIRST = textwrap.dedent("""
    import importlib, json, sys, traceback
    names, prefixes = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2]))
    ours = lambda m: any(m == p or m.startswith(p + ".") for p in prefixes)
    failed, skipped, loaded, entries = {}, {}, {}, 0
    for name in sorted(names, key=lambda n: (n.count("."), n)):  # packages before their modules
        parent = name.rpartition(".")[0]
        if name in loaded.get(parent, ()):
            # Importing it first imports its parent first, which imports it: the same run.
            loaded[name] = loaded[parent]
            continue
        for m in [m for m in sys.modules if ours(m)]:
            del sys.modules[m]  # every module of ours imported afresh, this one first
        entries += 1
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and ours(e.name):
                failed[name] = traceback.format_exc(limit=-3)
            else:
                skipped[name] = str(e)  # an optional dependency that is not installed
        except Exception:
            failed[name] = traceback.format_exc(limit=-3)
        loaded[name] = {m for m in sys.modules if ours(m)}
    print(json.dumps({"failed": failed, "skipped": skipped, "entries": entries,
                      "imported": sorted(set().union(*loaded.values()))}))
""")


def test_every_module_imports_first_in_a_fresh_interpreter(tmp_path):
    """Each module imported with none of ours loaded, in one fresh interpreter.

    A module that its parent package's import already loads needs no run of its
    own (importing it first is importing the parent first), so about a third
    of the modules are entry points; the third-party frameworks are imported once.
    """
    names = [n for n in module_files(REPO_ROOT)
             if any(n == p or n.startswith(p + ".") for p in RUNTIME_PACKAGES)
             and not n.endswith("__main__")]  # __main__ modules run their command
    assert len(names) > 100
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_FIRST, json.dumps(names),
         json.dumps(["asyncckpt", "benchmarks", "examples", "tests"])],
        cwd=REPO_ROOT, env=subprocess_env(TMPDIR=str(tmp_path)), capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["failed"], "\n\n".join(f"{n}:\n{tb}" for n, tb in result["failed"].items())
    assert set(names) - set(result["skipped"]) <= set(result["imported"])
    print(f"{result['entries']} entry points for {len(names)} modules")
    if result["skipped"]:
        print("not imported (dependency missing):", result["skipped"])

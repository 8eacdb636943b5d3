"""The preemption package's shape: its public names, no import cycles, one coordination layer.

The JAX manager's multi-process commit protocol and the preemption handler
share ``asyncckpt._coordination`` (one key-value wrapper, one error
hierarchy); the protocol is exercised here over the in-process store with
threads as processes (the real ``jax.distributed`` store is covered by
``tests/test_jax_multiprocess.py``).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import threading

import pytest

import asyncckpt
import asyncckpt.preemption as preemption
from asyncckpt import _coordination as coord
from asyncckpt._closing import ClosingContext
from asyncckpt._engine.files import FileRecord
from asyncckpt.jax import _distributed, _parts
from tests.helpers import subprocess_env

PUBLIC = {
    "AgreementOptions",
    "GraceOptions",
    "Platform",
    "PreemptionCheckpointHandler",
    "PreemptionSave",
    "TerminationConfig",
    "detect_platform",
}


def test_public_names_are_what_a_user_writes():
    assert set(preemption.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(preemption, name) is not None


@pytest.mark.parametrize("module", ["config", "platform", "watchers", "grace", "agreement",
                                    "handler", "_targets"])
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    # A cycle shows up as an ImportError (partially initialised module) when
    # the import starts from the wrong end; the package __init__ runs first
    # either way, so each module is also checked to import no framework.
    code = (f"import sys, importlib; importlib.import_module('asyncckpt.preemption.{module}'); "
            "print('tensorflow' in sys.modules, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False"]


def _package_imports() -> dict[str, set[str]]:
    """Module -> modules of ``asyncckpt.preemption`` it imports, at any depth of its code."""
    root = pathlib.Path(preemption.__file__).parent
    graph = {}
    for path in root.glob("*.py"):
        name = f"asyncckpt.preemption.{path.stem}" if path.stem != "__init__" else None
        if name is None:
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "asyncckpt.preemption":
                    deps |= {f"asyncckpt.preemption.{a.name}" for a in node.names}
                elif node.module.startswith("asyncckpt.preemption."):
                    deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("asyncckpt.preemption.")}
        graph[name] = deps - {name}
    return graph


def test_the_package_has_no_import_cycle_not_even_through_deferred_imports():
    graph = _package_imports()
    assert "asyncckpt.preemption.platform" in graph["asyncckpt.preemption.config"]
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in graph.get(node, ()):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, node, dep])
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_one_error_hierarchy_for_every_coordination_user():
    assert issubclass(_distributed.DistributedSaveError, asyncckpt.CoordinationError)
    assert issubclass(asyncckpt.CoordinationTimeoutError, asyncckpt.CoordinationError)
    assert issubclass(asyncckpt.CoordinationTimeoutError, TimeoutError)
    assert issubclass(asyncckpt.PeerFailedError, asyncckpt.CoordinationError)
    assert issubclass(asyncckpt.CoordinationError, asyncckpt.AsyncCkptError)
    # "Coordinator" is the key-value store; the JAX commit protocol over it has its own name.
    assert "Coordinator" not in _distributed.__all__
    assert _distributed.Coordinator is coord.Coordinator
    assert _distributed.CommitCoordinator.for_this_run(timeout_s=1.0) is None  # one process


def _run(fns):
    results, errors = [None] * len(fns), [None] * len(fns)

    def call(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_jax_commit_protocol_runs_over_the_shared_store():
    # Managers are named by their directory (and how many this process made
    # for it), so both "processes" of this interpreter agree on the keys.
    stores = coord.InProcessCoordinator.group(2)
    p0, p1 = (_distributed.CommitCoordinator(s, timeout_s=30, directory="run/ckpts/")
              for s in stores)
    assert p0.prefix == p1.prefix
    assert p0.primary and not p1.primary
    tokens, errors = _run([lambda: p0.join(lambda: "run-token"), lambda: p1.join(lambda: "x")])
    assert tokens == ["run-token", "run-token"] and errors == [None, None]
    key = p0.save_key(0, 7)
    assert key == p1.save_key(0, 7)
    record = FileRecord("a/b", 3, 123)

    digest = _parts.encode(1, [record])[1]

    def primary():
        digests, failures = p0.collect(key)
        p0.announce(key)
        return digests, failures

    def other():
        p1.report_done(key, digest)
        p1.wait_committed(key, 7)

    results, errors = _run([primary, other])
    assert errors == [None, None] and results[0] == ({1: digest}, {})
    # A failure on one process reaches the other.
    key = p0.save_key(1, 8)
    p1.report_done(key, None, error=OSError("No space left on device"))
    assert "No space left" in p0.collect(key)[1][1]
    p0.announce(key, error=OSError("disk"))
    with pytest.raises(_distributed.DistributedSaveError, match="step 8 failed: process 0: OSE"):
        p1.wait_committed(key, 8)


def test_a_missing_answer_is_a_timeout_of_the_shared_hierarchy():
    stores = coord.InProcessCoordinator.group(2)
    p1 = _distributed.CommitCoordinator(stores[1], timeout_s=0.05)
    with pytest.raises(coord.CoordinationTimeoutError, match="primary's first save"):
        p1.join(lambda: "never called")
    with pytest.raises(coord.CoordinationTimeoutError):
        stores[0].barrier("b", 0.05)
    assert stores[0].wait("k", 0.01, "k") if stores[1].claim("k", "v") else False
    stores[1].delete("k")
    assert stores[0].try_get("k") is None
    with pytest.raises(coord.CoordinationError, match="already set"):
        stores[0].set("j", "1") or stores[1].set("j", "2")


class _Resource(ClosingContext):
    def __init__(self, fail: bool):
        self.fail, self.closed = fail, 0

    def close(self) -> None:
        self.closed += 1
        if self.fail:
            raise OSError("close failed")


def test_closing_context_closes_and_never_masks_the_body_error():
    with _Resource(fail=False) as r:
        pass
    assert r.closed == 1
    with pytest.raises(OSError, match="close failed"), _Resource(fail=True):
        pass
    r = _Resource(fail=True)
    with pytest.raises(KeyError), r:
        raise KeyError("body")
    assert r.closed == 1

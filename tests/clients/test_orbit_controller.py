"""orbit's own controller tests, run unchanged against asyncckpt.tf.CheckpointManager.

TF Model Garden's ``orbit.Controller`` takes a ``tf.train.CheckpointManager``
and asserts ``isinstance(checkpoint_manager, tf.train.CheckpointManager)``.
Its test file is loaded from the installed package and run in a pytest
subprocess with ``tests.clients.tf_manager_plugin``, which makes every
``tf.train.CheckpointManager(...)`` it constructs an asyncckpt manager while
the instance checks stay TensorFlow's.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import subprocess_env

pytestmark = pytest.mark.slow


def _installed(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None:
        pytest.fail(f"{module} is not installed: install the test extras "
                    "(`make test`, or pip install -e '.[clients]' and tf-models-official "
                    "with --no-deps)")
    return Path(spec.origin)


def _test_methods(test_file: Path) -> dict[str, bool]:
    """Each test method's name, and whether its code constructs ``tf.train.CheckpointManager``."""
    methods = {}
    for node in ast.walk(ast.parse(test_file.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            methods[node.name] = any(
                isinstance(call, ast.Call)
                and ast.unparse(call.func) == "tf.train.CheckpointManager"
                for call in ast.walk(node))
    return methods


def _method_of(case: str, methods: dict[str, bool]) -> str:
    # A parameterized case is named after its method plus a suffix.
    return max((m for m in methods if case == m or case.startswith(m + "_")), key=len)


def test_orbits_controller_tests_pass_with_asyncckpt_managers(tmp_path):
    test_file = _installed("orbit").parent / "controller_test.py"
    for module in ("tf_keras", "tensorboard"):  # orbit's tests import and summarize with them
        _installed(module)
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")  # not this project's configuration
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-c", str(ini), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-p", "tests.clients.tf_manager_plugin", str(test_file)],
        cwd=tmp_path,
        env=subprocess_env(ASYNCCKPT_CLIENTS_REPORT=str(report),
                           TEST_TMPDIR=str(tmp_path / "absl")),
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    cases = json.loads(report.read_text())
    ran = {nodeid.rsplit("::", 1)[1]: entry for nodeid, entry in cases.items()
           if entry["outcome"] != "skipped"}
    assert len(ran) >= 30, sorted(ran)  # orbit 2.20's file has 30
    assert all(entry["outcome"] == "passed" for entry in ran.values()), ran

    # Not vacuous: every case whose code builds a manager built asyncckpt's,
    # and the cases that saved wrote asyncckpt checkpoints (with manifests).
    methods = _test_methods(test_file)
    expected = {case for case in ran if methods[_method_of(case, methods)]}
    assert len(expected) >= 24, sorted(expected)
    assert {case for case, entry in ran.items() if entry["managers"] > 0} == expected
    saved = {case for case in expected if ran[case]["saved"]}
    assert len(saved) >= 12, ran
    assert all(ran[case]["asyncckpt_checkpoints"] > 0 for case in saved), ran

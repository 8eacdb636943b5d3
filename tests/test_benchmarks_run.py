"""The living benchmarks run: ``python -m benchmarks`` in each of its modes, at tiny sizes.

The suite (``benchmarks/suite``) wraps real engines, TensorFlow's and orbax's
too, and some of its benchmarks reach into asyncckpt's internals (the
preemption benchmark slows the real save job down), so a change of the
library can break it without any other test noticing. Each mode runs here
once, all of them one after the other in one child process (one import of
TensorFlow and JAX), through the real entry point ``python -m benchmarks``;
each must finish and print its result lines. Speed is not checked (see
benchmarks/). The scale benchmark (``--scale``) has its own test,
tests/test_bench_scale.py; the crash campaign runs in the durability tests.
The archived scripts (``benchmarks/archive``) are not run.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Runs ``python -m benchmarks`` (its ``__main__``) once per argument list, in this process.
RUN_EACH = textwrap.dedent("""
    import json, runpy, sys
    for argv in json.loads(sys.argv[1]):
        print("== python -m benchmarks " + " ".join(argv), flush=True)
        sys.argv = ["benchmarks", *argv]
        try:
            runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code:
                raise
""")


@pytest.mark.slow
def test_every_mode_of_the_benchmark_suite_runs_and_reports(tmp_path):
    out = tmp_path / "out"
    runs = {
        "default": ["--sizes", "4", "--reps", "1", "--train-size", "0", "--keras-size", "0",
                    "--quiet", "--out", str(out / "default")],
        "restore": ["--restore", "--no-recovery", "--sizes", "4", "--reps", "1", "--quiet",
                    "--out", str(out / "restore")],
        # Last: it replaces the save job classes in its process with slowed ones.
        "preemption": ["--preemption", "--trials", "1", "--grace", "2", "--step", "0.05",
                       "--write", "0.25", "--noise", "none", "--warmup", "2",
                       "--warmup-preemptions", "1"],
    }
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", RUN_EACH, json.dumps(list(runs.values()))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    parts = dict(zip(runs, proc.stdout.split("== python -m benchmarks ")[1:], strict=True))
    # Every engine and floor, their ratios and the targets; the command as it ran.
    for line in ("memcpy jax arrays", "asyncckpt tf ", "asyncckpt jax ", "orbax async",
                 "asyncckpt jax blocking / memcpy jax arrays:", "== targets",
                 "command: python -m benchmarks --sizes 4 --reps 1"):
        assert line in parts["default"], (line, parts["default"][-4000:])
    results = json.loads((out / "default" / "results.json").read_text())
    assert results["command"].startswith("python -m benchmarks --sizes 4")
    # Cold restores against TensorFlow's, orbax's and a raw read; the eviction checked.
    for line in ("asyncckpt tf", "asyncckpt jax", "orbax"):
        assert line in parts["restore"], (line, parts["restore"][-4000:])
    assert json.loads((out / "restore" / "restore.json").read_text())["sizes"]
    assert "all cells: asyncckpt 1/1 in time" in parts["preemption"], parts["preemption"][-4000:]


def test_the_preemption_benchmark_refuses_the_suites_own_options(capsys):
    from benchmarks.suite.cli import main

    assert main(["--quick", "--preemption", "--trials", "1"]) == 2
    assert "--quick" in capsys.readouterr().err


def _checkpoints_on_disk(directory: Path) -> set[int]:
    found = set()
    for name in os.listdir(directory):
        if name.isdigit():  # a JAX step directory (orbax's and ours)
            found.add(int(name))
        elif name.startswith("ckpt-") and "." in name:  # a TensorFlow prefix's files
            found.add(int(name[len("ckpt-"):name.index(".")]))
    return found


def test_bench_engines_keep_the_newest_checkpoints_only_and_restore_the_last(tmp_path):
    """At 1 GiB the full bench wrote 13 checkpoints per engine: 65 GB of scratch."""
    from benchmarks.suite import engines as eng

    states = {"tf": eng.TFState(1 << 20, 2), "jax": eng.JAXState(1 << 20, 2)}
    for cls in eng.ENGINES.values():
        directory = tmp_path / cls.name.replace(" ", "_")
        e = cls(states[cls.framework], str(directory))
        try:
            for _ in range(4):
                e.save()
                e.wait()
                e.prune()
            e.restore()
        finally:
            e.close()  # the managers delete in the background: close() waits for that
        assert _checkpoints_on_disk(directory) == {3, 4}, (cls.name, os.listdir(directory))


def test_the_device_to_host_floor_puts_the_state_into_pinned_host_memory():
    """The floor a JAX save has on an accelerator (measured there only; callable on CPU)."""
    import jax

    from benchmarks.suite import engines as eng

    state = eng.JAXState(1 << 20, 2)
    assert state.platform == jax.devices()[0].platform
    floor = state.pinned_host_floor()
    if floor is None:
        pytest.skip("no pinned_host memory on this backend")
    floor()  # one device_put of every leaf into pinned host memory, waited for


def test_no_test_runs_an_archived_benchmark():
    """``benchmarks/archive`` is a record, not maintained: no test imports or names a script."""
    script = re.compile(r"benchmarks[/.]archive[/.]\w")  # the folder alone may be mentioned
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue  # this check names it
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                hit = any(a.name.startswith("benchmarks.archive") for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                hit = (node.module or "").startswith("benchmarks.archive") or (
                    node.module == "benchmarks" and any(a.name == "archive" for a in node.names))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                hit = bool(script.search(node.value))
            else:
                continue
            if hit:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found

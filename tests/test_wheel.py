"""The wheel holds the library only; the benchmarks run from a checkout (``python -m benchmarks``).

The wheel is built from a copy of the source tree (pip, no build isolation: no network), so
the checkout gets no ``build/`` or ``.egg-info``. Benchmarks (``benchmarks/``), the demo
(``examples/``) and the test servers (``tests/servers.py``) sit beside the package and must
not be in it; ``asyncckpt bench``, the benchmarks' old entry point, says where they are.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

#: What the build reads, and the trees beside the package that it must leave out.
SOURCES = ("pyproject.toml", "README.md", "asyncckpt", "benchmarks", "examples", "tests")


def _env_without_checkout() -> dict[str, str]:
    """The environment with no ``PYTHONPATH``: the checkout is not on the child's path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300, env=_env_without_checkout())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("asyncckpt-*.whl")
    return built


def test_the_wheel_holds_the_library_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not n.startswith("asyncckpt/")
               and not (n.startswith("asyncckpt-") and ".dist-info/" in n)]
    assert outside == []
    modules = {n for n in names if n.endswith(".py")}
    library = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "asyncckpt").rglob("*.py")}
    assert modules == library  # the whole library, and only it
    assert not [n for n in modules if any(w in n for w in ("bench", "demo", "servers"))]


def test_asyncckpt_bench_says_where_the_benchmarks_are_and_imports_none(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    run = textwrap.dedent("""
        import sys
        import asyncckpt.cli
        print("from", asyncckpt.cli.__file__)
        code = asyncckpt.cli.main(sys.argv[1:])
        assert not [m for m in sys.modules if m.split(".")[0] == "benchmarks"]
        sys.exit(code)
    """)
    env = _env_without_checkout()
    proc = subprocess.run([sys.executable, "-c", run, "bench", "--quick", "--sizes", "4"],
                          cwd=site, env=env, capture_output=True, text=True, timeout=300)
    assert f"from {site / 'asyncckpt' / 'cli.py'}" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "`python -m benchmarks [options]`" in proc.stderr
    # The same from the checkout itself: its benchmarks are beside the package, not imported.
    proc = subprocess.run([sys.executable, "-c", run, "bench", "--help"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert f"from {REPO_ROOT / 'asyncckpt' / 'cli.py'}" in proc.stdout, proc.stderr
    assert proc.returncode == 2 and "`python -m benchmarks [options]`" in proc.stderr
    # The other commands work from the wheel.
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, "-c", run, "list", str(tmp_path / "empty")],
                          cwd=site, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "no checkpoints in" in proc.stdout, proc.stderr

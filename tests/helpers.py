"""Helpers for tests that run real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports this checkout of asyncckpt."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def write_script(directory: Path, name: str, code: str) -> Path:
    """Writes a dedented Python script and returns its path."""
    path = Path(directory) / name
    path.write_text(textwrap.dedent(code))
    return path


def run_python(
    script: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs a script with this interpreter and returns the finished process."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_python(
    script: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Starts a script with this interpreter; output is captured as text."""
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env or subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

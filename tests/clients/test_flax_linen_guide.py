"""Flax's Linen checkpointing guide, run with asyncckpt's manager and checkpointers.

``flax_linen_guide.py`` follows the guide's steps with orbax's manager and
checkpointers taken from ``asyncckpt.jax`` (see its docstring). It runs
twice in subprocesses with 8 CPU devices: with asyncckpt, and with orbax's
own classes as the control. Every step must come out the same: the same
leaves (type, dtype, values, sharding), or the same exception type where
orbax 0.12.8 itself departs from the guide. The asyncckpt run ends by
restoring its files with orbax's own checkpointer and manager.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

from asyncckpt import layout
from tests.helpers import run_python, subprocess_env

GUIDE = Path(__file__).with_name("flax_linen_guide.py")


def _run(base: Path, lib: str) -> dict:
    base.mkdir()
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = run_python(GUIDE, str(base), lib, env=env, timeout=300)
    assert proc.returncode == 0 and "GUIDE OK" in proc.stdout, (
        f"{lib}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    steps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("STEP "):
            _, name, body = line.split(" ", 2)
            steps[name] = json.loads(body)
    return steps


def test_flax_linen_checkpointing_guide_runs_as_with_orbax(tmp_path):
    ours = _run(tmp_path / "asyncckpt", "asyncckpt")
    theirs = _run(tmp_path / "orbax", "orbax")
    assert list(ours) == list(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name
    assert ours["listdir"] == ["3", "4"] and ours["latest_step"] == 4
    # Where orbax 0.12.8 departs from the guide, asyncckpt departs the same way.
    for name in ("scenario1", "scenario2_plain", "mp_restore"):
        assert ours[name]["value_error"], name
    assert "raised" not in ours["scenario2_transforms"] and "raised" not in ours["mp_restored"]
    # asyncckpt wrote them (its manifest beside orbax's files).
    for path in ("orbax/single_save", "orbax/single_save_async", "orbax/managed/4",
                 "flax_ckpt/checkpoint_3"):
        assert (tmp_path / "asyncckpt" / path / layout.JAX_MANIFEST_NAME).is_file(), path

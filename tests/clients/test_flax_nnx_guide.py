"""Flax NNX's checkpointing guide, run with asyncckpt's ``StandardCheckpointer``.

``flax_nnx_guide.py`` follows the guide's steps with only the orbax import
changed (see its docstring); it runs in a subprocess with 8 CPU devices, and
its last part restores the same files with orbax's own checkpointer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")

from asyncckpt import layout
from tests.helpers import run_python, subprocess_env

GUIDE = Path(__file__).with_name("flax_nnx_guide.py")


def test_flax_nnx_checkpointing_guide(tmp_path):
    ckpt_dir = tmp_path / "my-checkpoints"
    ckpt_dir.mkdir()
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = run_python(GUIDE, str(ckpt_dir), env=env, timeout=300)
    assert proc.returncode == 0 and "GUIDE OK" in proc.stdout, (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    # asyncckpt wrote them (its manifest, with every file checksummed), at the paths given.
    for name in ("state", "pure_dict", "checkpoint_name"):
        manifest = json.loads((ckpt_dir / name / layout.JAX_MANIFEST_NAME).read_text())
        assert manifest["framework"] == "jax" and manifest["label"] == name
        assert all("crc32c" in f or "crc32" in f for f in manifest["files"])
        assert (ckpt_dir / name / "manifest.ocdbt").is_file()  # orbax's default layout: OCDBT
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["checkpoint_name", "pure_dict", "state"]

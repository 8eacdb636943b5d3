"""The JAX demo runs end to end (small sizes) and its restores match."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

from examples.jax_demo import run_jax_demo


def test_jax_demo_trains_saves_and_restores(tmp_path, capsys):
    assert run_jax_demo(str(tmp_path), steps=10, every=5, width=256) is True
    out = capsys.readouterr().out
    assert "restored step 10 with asyncckpt.jax: all values match" in out
    assert "with orbax.checkpoint.CheckpointManager: all values match" in out

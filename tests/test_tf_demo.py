"""The TensorFlow demo (the README's main job) runs end to end and its restore matches."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

from examples.tf_demo import run_tf_demo


def test_tf_demo_trains_saves_and_restores(tmp_path, capsys):
    assert run_tf_demo(str(tmp_path), steps=10, every=5, width=64) is True
    out = capsys.readouterr().out
    assert "restored" in out and "plain tf.train.Checkpoint: all values match" in out
    assert "speed-up vs sync" in out
    # Retention kept both saves and the state file names the last one.
    assert (tmp_path / "tf" / "ckpt-10.index").exists()
    assert (tmp_path / "tf" / "ckpt-5.index").exists()

"""Engine rules as the TensorFlow and JAX front ends see them.

Publish is the line (a failing state file does not fail a save), a failed
commit leaks no fsync thread, a missing manifest on asyncckpt's own
checkpoint is corruption, and a re-saved prefix restores (the kill-safety of
re-saving is tested in test_engine_publish.py).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from asyncckpt import CorruptCheckpointError

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as atf  # noqa: E402
from asyncckpt.tf import checkpoint as checkpoint_module  # noqa: E402
from asyncckpt.tf._job import TFSaveJob  # noqa: E402
from tests.tfrestore import restore_both  # noqa: E402


def _values(path, n=100):
    """``v`` at ``path``, restored by TensorFlow's reader and asyncckpt's (which must agree)."""
    got = restore_both(path, lambda: {"v": tf.Variable(tf.zeros(n))}, lambda o: None,
                       verdict="expect_partial")
    ours, theirs = (got[r]["v"].numpy() for r in ("asyncckpt", "tensorflow"))
    np.testing.assert_array_equal(ours, theirs)
    return ours


def test_tf_state_file_failure_after_publish_is_not_a_failed_save(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)  # the state file cannot be written
    ckpt = atf.Checkpoint(v=tf.Variable(tf.range(100, dtype=tf.float32)))
    path = ckpt.save(str(run / "ckpt"))
    ckpt.sync()  # the checkpoint is published: no error
    stats = ckpt.last_save.result(30)
    assert "IsADirectoryError" in stats.post_commit_error
    assert ckpt.engine.post_commit_errors == 1
    assert atf.verify_checkpoint(path)
    np.testing.assert_array_equal(_values(path), np.arange(100))
    ckpt.close()


class _IndexTurnsIntoDirectory(TFSaveJob):
    """Fault injection: the written index becomes unreadable before the commit."""

    def write(self):
        super().write()
        index = os.path.join(self.transaction.workdir, self.label + ".index")
        os.unlink(index)
        os.mkdir(index)


def _fsync_threads():
    return [t for t in threading.enumerate() if t.name == "asyncckpt-fsync"]


def test_failed_tf_commit_stops_its_fsync_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "TFSaveJob", _IndexTurnsIntoDirectory)
    before = set(_fsync_threads())
    ckpt = atf.Checkpoint(v=tf.Variable(tf.ones(10)))
    ckpt.write(str(tmp_path / "bad"))
    # IsADirectoryError when the index is read back (SaveV2), a size mismatch
    # when its checksum is known from the bundle writer.
    with pytest.raises(OSError, match=r"bad\.index"):
        ckpt.sync()
    leaked = [t for t in _fsync_threads() if t not in before]
    for t in leaked:
        t.join(30)
    assert not [t for t in leaked if t.is_alive()]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".asyncckpt-tmp-")]
    ckpt.close()


def test_tf_missing_manifest_is_corruption_and_the_manager_falls_back(tmp_path):
    v = tf.Variable(tf.zeros(100))
    ckpt = atf.Checkpoint(v=v)
    with atf.CheckpointManager(ckpt, str(tmp_path / "run"), max_to_keep=3) as mgr:
        for step in (1, 2):
            v.assign(tf.fill([100], float(step)))
            mgr.save()
        mgr.sync()
        newest = mgr.latest_checkpoint
        os.unlink(newest + ".asyncckpt-manifest.json")
        with pytest.raises(CorruptCheckpointError, match="manifest"):
            atf.verify_checkpoint(newest)
        older = mgr.newest_valid_checkpoint()
        assert older is not None and older != newest
        assert mgr.restore_or_initialize() == older
        assert float(v[0]) == 1.0
    # A checkpoint plain TensorFlow wrote has no manifest and is accepted unverified.
    plain = tf.train.Checkpoint(v=tf.Variable(tf.ones(100))).write(str(tmp_path / "plain" / "c"))
    assert atf.verify_checkpoint(plain) is False
    # Plain TensorFlow writing over one of asyncckpt's prefixes: no longer claimed.
    tf.train.Checkpoint(v=tf.Variable(tf.ones(7))).write(newest)
    assert atf.verify_checkpoint(newest) is False


def test_jax_missing_manifest_is_corruption_and_restore_falls_back(tmp_path):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import asyncckpt.jax as aj

    def state(step):
        return {"w": jnp.full((4, 4), float(step)), "step": step}

    with aj.CheckpointManager(tmp_path / "run") as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
        mgr.wait_until_finished()
        os.unlink(tmp_path / "run" / "2" / "asyncckpt.manifest.json")
        with pytest.raises(CorruptCheckpointError, match="manifest"):
            mgr.restore(2, target=state(0))
        assert mgr.restore(target=state(0))["step"] == 1


def test_tf_resave_of_a_prefix_is_restorable(tmp_path):
    v = tf.Variable(tf.zeros(100))
    ckpt = atf.Checkpoint(v=v)
    prefix = str(tmp_path / "model")
    for value in (1.0, 2.0):
        v.assign(tf.fill([100], value))
        ckpt.write(prefix)
        ckpt.sync()
    assert atf.verify_checkpoint(prefix)
    assert _values(prefix)[0] == 2.0
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".asyncckpt-tmp-")]
    ckpt.close()

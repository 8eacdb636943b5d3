"""asyncckpt.tf.CheckpointManager as a drop-in for tf.train.CheckpointManager."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt.tf._job import TFSaveJob  # noqa: E402
from tests.tfrestore import restore_both  # noqa: E402


def _files(directory) -> set[str]:
    return set(os.listdir(directory))


def test_drop_in_save_and_restore(ckpt_dir):
    v = tf.Variable(np.arange(6, dtype=np.float32))
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=3)
    paths = []
    for _ in range(5):
        v.assign_add(tf.ones(6))
        paths.append(mgr.save())
    mgr.sync()
    assert paths == [str(ckpt_dir / f"ckpt-{i}") for i in range(1, 6)]
    assert mgr.checkpoints == paths[-3:]
    assert mgr.latest_checkpoint == paths[-1]
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == paths[-1]
    assert not (ckpt_dir / "ckpt-1.index").exists() and not (ckpt_dir / "ckpt-2.index").exists()
    assert not any(n.startswith("ckpt-1.") or n.startswith("ckpt-2.") for n in _files(ckpt_dir))
    # TensorFlow's own manager reads the directory the same way.
    tf_mgr = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=3)
    assert tf_mgr.checkpoints == paths[-3:]
    restore_both(mgr.latest_checkpoint, lambda: {"v": tf.Variable(tf.zeros(6))},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), np.arange(6) + 5))
    mgr.close()


def test_state_file_never_names_a_checkpoint_in_flight_but_the_view_does(ckpt_dir, gate):
    v = tf.Variable([1.0])
    mgr = at.CheckpointManager(gate.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    first = mgr.save()
    mgr.sync()
    gate.open.clear()
    second = mgr.save()
    assert gate.entered.acquire(timeout=30) and gate.entered.acquire(timeout=30)
    # The second save is staged and being written, not durable.
    assert not mgr.last_save.done()
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == first
    # The in-process view changes at the call, as TensorFlow's does.
    assert mgr.latest_checkpoint == second
    assert mgr.checkpoints == [first, second]
    assert not os.path.exists(second + ".index")
    gate.open.set()
    mgr.sync()
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == second
    assert mgr.checkpoints == [first, second]
    mgr.close()


def test_retention_deletes_only_after_the_new_checkpoint_is_durable(ckpt_dir, gate):
    v = tf.Variable([1.0])
    mgr = at.CheckpointManager(gate.Checkpoint.wrap(tf.train.Checkpoint(v=v)), str(ckpt_dir),
                               max_to_keep=1)
    first = mgr.save()
    mgr.sync()
    gate.open.clear()
    mgr.save()
    assert gate.entered.acquire(timeout=30) and gate.entered.acquire(timeout=30)
    assert os.path.exists(first + ".index")  # still the only durable checkpoint
    gate.open.set()
    mgr.sync()
    assert not os.path.exists(first + ".index")
    assert not any(n.startswith("ckpt-1.") for n in _files(ckpt_dir))
    mgr.close()


def test_keep_checkpoint_every_n_hours_preserves(ckpt_dir):
    v = tf.Variable([1.0])
    # A tiny interval: every checkpoint older than the last preserved one by
    # more than 1e-9 hours is preserved instead of deleted.
    mgr = at.CheckpointManager(
        tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=1, keep_checkpoint_every_n_hours=1e-9
    )
    paths = [mgr.save() for _ in range(3)]
    mgr.sync()
    assert mgr.checkpoints == [paths[-1]]
    for p in paths:
        assert os.path.exists(p + ".index"), p
    mgr.close()


def test_manager_recovers_checkpoints_from_directory(ckpt_dir):
    v = tf.Variable([1.0])
    with at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2) as mgr:
        paths = [mgr.save() for _ in range(3)]
    again = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    assert again.checkpoints == paths[-2:]
    assert again.latest_checkpoint == paths[-1]
    # A fresh tf.train.Checkpoint counts from zero again, as with TensorFlow's manager.
    assert again.save() == str(ckpt_dir / "ckpt-1")
    again.sync()
    assert again.checkpoints == [paths[-1], str(ckpt_dir / "ckpt-1")]
    assert not os.path.exists(paths[-2] + ".index")
    again.close()


def test_restore_or_initialize(ckpt_dir):
    v = tf.Variable([0.0])
    calls = []
    mgr = at.CheckpointManager(
        tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=None,
        init_fn=lambda: (calls.append(1), v.assign([42.0])),
    )
    assert mgr.restore_or_initialize() is None
    assert calls == [1] and v.numpy()[0] == 42.0
    path = mgr.save()
    v.assign([0.0])
    assert mgr.restore_or_initialize() == path  # waits for the save in flight
    assert v.numpy()[0] == 42.0 and calls == [1]
    mgr.close()
    restore_both(path, lambda: {"v": tf.Variable([0.0])},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), [42.0]))


def test_checkpoint_interval_and_number(ckpt_dir):
    step = tf.Variable(0, dtype=tf.int64)
    v = tf.Variable([1.0])
    mgr = at.CheckpointManager(
        tf.train.Checkpoint(v=v, step=step), str(ckpt_dir), max_to_keep=None,
        step_counter=step, checkpoint_interval=10,
    )
    saved = []
    for s in range(25):
        step.assign(s)
        path = mgr.save(checkpoint_number=step)
        if path:
            saved.append(path)
    assert mgr.save(checkpoint_number=step) is None  # same step again
    step.assign(26)
    assert mgr.save(checkpoint_number=step, check_interval=False) == str(ckpt_dir / "ckpt-26")
    mgr.sync()
    assert saved == [str(ckpt_dir / f"ckpt-{n}") for n in (0, 10, 20)]
    assert mgr.checkpoints[-1] == str(ckpt_dir / "ckpt-26")
    mgr.close()


def test_bad_arguments_are_refused(ckpt_dir):
    v = tf.Variable([1.0])
    with pytest.raises(ValueError, match="max_to_keep"):
        at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=0)
    with pytest.raises(ValueError, match="step_counter"):
        at.CheckpointManager(
            tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=1, checkpoint_interval=5
        )
    with pytest.raises(TypeError, match=r"tf\.train\.Checkpoint"):
        at.CheckpointManager({"v": v}, str(ckpt_dir), max_to_keep=1)


def test_manager_with_relative_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    v = tf.Variable([3.0])
    with at.CheckpointManager(tf.train.Checkpoint(v=v), "rel", max_to_keep=2) as mgr:
        path = mgr.save()
    assert path == os.path.join("rel", "ckpt-1")
    assert tf.train.latest_checkpoint("rel") == path
    restore_both(path, lambda: {"v": tf.Variable([0.0])},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), [3.0]))


def test_saving_a_name_again_while_another_commits_keeps_the_state_file_valid(ckpt_dir):
    release = threading.Event()
    entered = threading.Event()
    hold = threading.Event()

    class HoldCkpt2(TFSaveJob):  # the real writer, holding the second write of ckpt-2
        def write_bundle(self, prefix, state):
            if os.path.basename(prefix) == "ckpt-2" and hold.is_set():
                entered.set()
                assert release.wait(60)
            return super().write_bundle(prefix, state)

    class Ckpt(at.Checkpoint):
        _job_class = HoldCkpt2

    v = tf.Variable([1.0])
    first = at.CheckpointManager(Ckpt.wrap(tf.train.Checkpoint(v=v)), str(ckpt_dir),
                                 max_to_keep=3)
    one, two = first.save(), first.save()
    first.sync()
    hold.set()
    assert first.save(checkpoint_number=2) == two  # saved again, held in flight
    assert entered.wait(30)
    second = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=3)
    assert second.save() == one  # a fresh counter saves ckpt-1 again, and commits
    second.sync()
    # ckpt-1 is durable; ckpt-2's new files are not: the state file must still
    # be valid and name the newest durable one last.
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == one
    # The view is by save call, as in TensorFlow: ckpt-2, then ckpt-1 again.
    assert second.checkpoints == first.checkpoints == [two, one]
    assert first.latest_checkpoint == one
    release.set()
    first.sync()
    state = tf.train.get_checkpoint_state(str(ckpt_dir))
    assert state.model_checkpoint_path == one
    assert list(state.all_model_checkpoint_paths) == [two, one]
    first.close()
    second.close()

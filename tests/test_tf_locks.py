"""TensorFlow's managers share a directory between processes; only one checkpoint conflicts.

Model Garden's trainer and evaluator both export into one directory, and
TensorFlow lets them. asyncckpt's TensorFlow managers lock per checkpoint
(``.asyncckpt-locks/<name>``, docs/reliability.md item 7): a save of another
checkpoint goes on, a save of the checkpoint another process is writing waits
for it, and a dead writer's checkpoint is taken over. The directory-wide rule
of the other front ends is tests/behaviour/test_durability.py's.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from tests.helpers import LineWatcher, start_python, write_script  # noqa: E402
from tests.tfrestore import restore_both  # noqa: E402

# A second process: its manager writes ckpt-5, its bundle write held (through the
# save job's write_bundle seam) until the test says so on stdin.
LOCK_HOLDER = """
import sys, threading
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.tf._job import TFSaveJob

gate = threading.Event()


class HeldJob(TFSaveJob):
    def write_bundle(self, prefix, state):
        print("writing", flush=True)
        gate.wait(120)
        return super().write_bundle(prefix, state)


HeldCheckpoint = type("HeldCheckpoint", (at.Checkpoint,), {"_job_class": HeldJob})
ckpt = HeldCheckpoint.wrap(tf.train.Checkpoint(v=tf.Variable([1.0])))
mgr = at.CheckpointManager(ckpt, sys.argv[1], max_to_keep=2)
mgr.save(checkpoint_number=5)  # ckpt-5: written (held) while the test saves
sys.stdin.readline()
gate.set()
mgr.sync()
print("saved", mgr.checkpoints, flush=True)
mgr.close()
"""


def _restores(path: str, value: list) -> None:
    """``path`` holds ``v == value``: restored by TensorFlow's reader and by asyncckpt's."""
    restore_both(path, lambda: {"v": tf.Variable(np.zeros(len(value), np.float32))},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), value),
                 verdict="expect_partial")


def test_two_processes_write_one_directory_and_only_the_same_checkpoint_waits(
        ckpt_dir, tmp_path):
    """As TensorFlow's managers: other checkpoints go on; a save of the checkpoint another
    process is writing waits for it, then replaces it."""
    script = write_script(tmp_path, "holder.py", LOCK_HOLDER)
    proc = start_python(script, str(ckpt_dir), stdin=True)
    try:
        LineWatcher(proc.stdout).wait_for("writing")
        v = tf.Variable([2.0])
        mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
        first = mgr.save(checkpoint_number=1)  # another checkpoint: no DirectoryLockedError
        mgr.sync()
        same: dict = {}
        waiter = threading.Thread(
            target=lambda: same.setdefault("path", mgr.save(checkpoint_number=5)))
        waiter.start()
        waiter.join(2.0)
        assert waiter.is_alive() and not same  # waits for the other process's ckpt-5
        proc.stdin.write("\n")
        proc.stdin.flush()
        waiter.join(120)
        assert same["path"] == str(ckpt_dir / "ckpt-5")
        mgr.sync()
        assert proc.wait(120) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    assert mgr.checkpoints == [first, same["path"]]
    for path in (same["path"], first):
        _restores(path, [2.0])
    # One lock file per checkpoint kept, and the state file's and the ownership record's.
    assert set(os.listdir(ckpt_dir / ".asyncckpt-locks")) <= {
        "ckpt-1", "ckpt-5", "checkpoint", ".asyncckpt-owned.json"}
    mgr.close()


def test_a_dead_writers_checkpoint_is_taken_over_and_its_temporaries_removed(ckpt_dir,
                                                                             tmp_path):
    script = write_script(tmp_path, "holder.py", LOCK_HOLDER)
    proc = start_python(script, str(ckpt_dir), stdin=True)
    LineWatcher(proc.stdout).wait_for("writing")
    proc.send_signal(signal.SIGKILL)  # killed while it writes ckpt-5
    proc.wait(30)
    assert [n for n in os.listdir(ckpt_dir) if n.startswith(".asyncckpt-tmp")]
    v = tf.Variable([3.0])
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    path = mgr.save(checkpoint_number=5)  # its lock died with it
    mgr.sync()
    assert not [n for n in os.listdir(ckpt_dir) if n.startswith(".asyncckpt-tmp")]
    _restores(path, [3.0])
    # A second manager in the same process shares the directory (and its view).
    other = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    second = other.save()
    assert mgr.checkpoints == other.checkpoints and mgr.latest_checkpoint == second
    mgr.close()
    other.save()
    other.close()

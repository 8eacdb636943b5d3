"""A TF manager killed between a commit and its state file keeps the committed checkpoint.

The state file is written after the checkpoint is committed (nothing after the
commit can fail the save), so a process can die in between: its checkpoint is
durable and was reported saved, yet the state file names the previous one. A
manager opening the directory must take it in as the newest; leftovers of
retention (older than the state file) must not come back.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("tensorflow")
import tensorflow as tf

import asyncckpt.tf as at
from tests.helpers import run_python, subprocess_env
from tests.tfrestore import restore_both

KILLED = r"""
import os, sys
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.tf import _dirview


class KilledBeforeTheStateFile(_dirview.ManagedCheckpoints):
    def write_state_file(self, deleting):
        if "ckpt-2" in self._state_text(deleting):
            os._exit(9)  # killed after checkpoint 2 is committed, before the state file names it
        return super().write_state_file(deleting)


class Manager(at.CheckpointManager):
    _view_class = KilledBeforeTheStateFile


v = tf.Variable(np.zeros(1000, np.float32))
mgr = Manager(tf.train.Checkpoint(v=v), sys.argv[1], max_to_keep=3)
for step in (1, 2):
    v.assign(np.full(1000, step, np.float32))
    mgr.save()
    mgr.sync()
"""


def test_a_checkpoint_committed_before_the_state_file_is_taken_in(tmp_path):
    directory = tmp_path / "ckpts"
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = run_python(script, str(directory), env=subprocess_env())
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert tf.train.latest_checkpoint(str(directory)).endswith("ckpt-1")  # the stale state file

    v = tf.Variable(np.zeros(1000, np.float32))
    ckpt = tf.train.Checkpoint(v=v)
    with at.CheckpointManager(ckpt, str(directory), max_to_keep=3) as mgr:
        assert mgr.latest_checkpoint.endswith("ckpt-2")
        assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-1", "ckpt-2"]
        restored = mgr.restore_or_initialize()
        np.testing.assert_array_equal(v.numpy(), np.full(1000, 2, np.float32))
        restore_both(restored, lambda: {"v": tf.Variable(np.zeros(1000, np.float32))},
                     lambda o: np.testing.assert_array_equal(o["v"].numpy(),
                                                             np.full(1000, 2, np.float32)))
        mgr.save()  # numbering goes on after it, and the state file names all three
        mgr.sync()
    assert tf.train.latest_checkpoint(str(directory)).endswith("ckpt-3")


def test_retention_leftovers_older_than_the_state_file_stay_out(tmp_path):
    directory = tmp_path / "ckpts"
    v = tf.Variable(np.zeros(100, np.float32))
    ckpt = tf.train.Checkpoint(v=v)
    aside = tmp_path / "aside"
    aside.mkdir()
    with at.CheckpointManager(ckpt, str(directory), max_to_keep=2) as mgr:
        mgr.save()
        mgr.sync()
        for name in os.listdir(directory):
            if name.startswith("ckpt-1"):
                shutil.copy2(directory / name, aside / name)  # keeps the mtime
        mgr.save()
        mgr.save()
        mgr.sync()
    assert not any(n.startswith("ckpt-1") for n in os.listdir(directory))  # retention ran
    for name in os.listdir(aside):  # as if the deletion had been killed half-way
        shutil.copy2(aside / name, directory / name)
    with at.CheckpointManager(ckpt, str(directory), max_to_keep=2) as mgr:
        assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-2", "ckpt-3"]

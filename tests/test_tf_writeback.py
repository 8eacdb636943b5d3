"""Early writeback of the files TensorFlow is still writing (issue 13.2)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import tensorflow as tf

import asyncckpt.tf as at
from asyncckpt.tf import _writeback

pytestmark = pytest.mark.skipif(_writeback._SFR is None, reason="no sync_file_range here")


class _Recording:
    """Wraps the real sync_file_range: records which files it was called on."""

    def __init__(self, real):
        self.real = real
        self.paths: list[str] = []
        self.seen = threading.Event()
        self.want: str | None = None

    def __call__(self, fd, offset, nbytes, flags):
        path = os.path.realpath(f"/proc/self/fd/{fd}")
        self.paths.append(path)
        if self.want is not None and path == self.want:
            self.seen.set()
        return self.real(fd, offset, nbytes, flags)


def test_files_written_inside_are_flushed_while_they_are_written(tmp_path, monkeypatch):
    rec = _Recording(_writeback._SFR)
    monkeypatch.setattr(_writeback, "_SFR", rec)
    path = tmp_path / "growing.data"
    rec.want = os.path.realpath(path)
    with _writeback.EarlyWriteback(str(tmp_path)), open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        # The file is still open and growing: writeback has started on it anyway.
        assert rec.seen.wait(60)
        f.write(os.urandom(1 << 20))
    assert os.path.getsize(path) == 2 << 20


def test_a_tensorflow_save_goes_through_early_writeback_and_restores(tmp_path, monkeypatch):
    rec = _Recording(_writeback._SFR)
    monkeypatch.setattr(_writeback, "_SFR", rec)
    v = tf.Variable(np.random.default_rng(0).random((256, 256)).astype(np.float32))
    with at.Checkpoint(v=v) as ckpt:
        ckpt.write(str(tmp_path / "c"))
        ckpt.sync()
    fresh = tf.Variable(tf.zeros_like(v))
    tf.train.Checkpoint(v=fresh).read(str(tmp_path / "c")).assert_consumed()
    np.testing.assert_array_equal(fresh.numpy(), v.numpy())
    # No helper thread or file descriptor outlives the write.
    assert not any(t.name == "asyncckpt-writeback" for t in threading.enumerate())

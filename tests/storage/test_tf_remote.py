"""TF manager on s3:// and gs:// directories, and with a local + remote tier."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt.storage import UnsupportedURLError, open_store  # noqa: E402
from asyncckpt.storage.protocol import list_committed  # noqa: E402
from asyncckpt.storage.tier import RemoteOptions  # noqa: E402


def _ckpt(seed: int):
    rng = np.random.default_rng(seed)
    v = tf.Variable(rng.standard_normal((128, 64)).astype(np.float32))
    n = tf.Variable(seed, dtype=tf.int64)
    return tf.train.Checkpoint(v=v, n=n)


def test_url_directory_round_trip(remote_url):
    ckpt = _ckpt(0)
    saved = {}
    with at.CheckpointManager(ckpt, remote_url, max_to_keep=2) as mgr:
        for i in range(1, 4):
            ckpt.v.assign(ckpt.v + 1.0)
            ckpt.n.assign(i)
            mgr.save()
            saved[i] = ckpt.v.numpy().copy()
        mgr.sync()
    remote = list_committed(open_store(remote_url))
    assert [c.name for c in remote] == ["ckpt-2", "ckpt-3"]
    fresh = _ckpt(99)
    with at.CheckpointManager(fresh, remote_url, max_to_keep=2) as mgr:
        path = mgr.restore_or_initialize()
    assert os.path.basename(path) == "ckpt-3"
    assert int(fresh.n.numpy()) == 3 and np.array_equal(fresh.v.numpy(), saved[3])


def test_unsupported_directory_fails_at_construction(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedURLError, match="s3://"):
        at.CheckpointManager(_ckpt(0), "hdfs://nn/run", max_to_keep=1)
    assert os.listdir(tmp_path) == []


def test_two_tiers_restore_newest_across_tiers(remote_url, tmp_path):
    local = str(tmp_path / "local")
    ckpt = _ckpt(0)
    opts = RemoteOptions(every_n_steps=2)
    with at.CheckpointManager(ckpt, local, max_to_keep=3, remote=remote_url,
                              remote_options=opts) as mgr:
        for i in range(1, 6):
            ckpt.n.assign(i)
            mgr.save(checkpoint_number=i)
            mgr.sync()
    assert [c.name for c in list_committed(open_store(remote_url))] == ["ckpt-2", "ckpt-4"]
    fresh = _ckpt(1)
    with at.CheckpointManager(fresh, local, max_to_keep=3, remote=remote_url,
                              remote_options=opts) as mgr:
        assert os.path.basename(mgr.restore_or_initialize()) == "ckpt-5"  # local is newer
    shutil.rmtree(local)
    fresh = _ckpt(2)
    with at.CheckpointManager(fresh, str(tmp_path / "other"), max_to_keep=3, remote=remote_url,
                              remote_options=opts) as mgr:
        assert os.path.basename(mgr.restore_or_initialize()) == "ckpt-4"
    assert int(fresh.n.numpy()) == 4

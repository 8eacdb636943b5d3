"""TF manager on s3:// and gs:// directories, and with a local + remote tier."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt.storage import UnsupportedURLError  # noqa: E402
from asyncckpt.storage.protocol import list_committed  # noqa: E402
from asyncckpt.storage.stores import open_store  # noqa: E402
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


def test_preemption_final_save_of_a_tf_manager_reaches_the_remote_tier(s3_server, tmp_path):
    """A real SIGTERM; the TF manager's final save is planned for, and durable on, S3."""
    import signal

    from asyncckpt.preemption import (
        GraceOptions,
        PreemptionCheckpointHandler,
        TerminationConfig,
    )
    from tests.storage.test_preemption_remote import _SlowMarkerStore

    url = f"s3://asyncckpt-test/tf-preempt-{os.getpid()}-{id(tmp_path)}"
    v = tf.Variable(np.zeros(64 * 1024, np.float32))
    ckpt = tf.train.Checkpoint(v=v)
    with at.CheckpointManager(ckpt, str(tmp_path / "local"), max_to_keep=3,
                              remote=url) as mgr:
        remote = mgr._tiers.remote
        real = remote.store
        # Measured uploads 0.5 s slower than the final one will be (as in the JAX
        # test): this test is about the plan, not about an upload outrunning its bound.
        remote.store = _SlowMarkerStore(real, 0.5)
        for i in range(1, 5):  # measured saves and uploads, for the grace margin
            v.assign_add(tf.ones_like(v))
            mgr.save(checkpoint_number=i)
            mgr.sync()
        remote.store = real
        slowest = max(e["total_seconds"] for e in remote.stats)
        # The slack covers a stall of the test process of up to 2 s (a CI run had a
        # 1.5 s one in the grace period); the upload's bound is the measured one.
        config = TerminationConfig(grace_period=3 * slowest + 4.0, exit_fn=lambda: None,
                                   platform="other")
        values = {}  # run -> the value every element of v holds (each step adds 1 to all)

        def step():
            v.assign_add(tf.ones_like(v))

        with PreemptionCheckpointHandler(mgr, termination_config=config,
                                         grace_options=GraceOptions(slack_s=2.0)) as handler:
            start = handler.total_run_calls
            while not handler.preempted:
                values[handler.total_run_calls] = v.numpy()[0]
                if handler.total_run_calls == start + 2 and not handler.noticed:
                    os.kill(os.getpid(), signal.SIGTERM)
                handler.run(step)
        final = handler.saves[-1]
        assert final.final and handler.final_tier == "remote", handler.saves
        assert final.remote_error is None
    name = os.path.basename(final.location)
    assert name in [c.name for c in list_committed(open_store(url))]
    # A fresh manager on the URL alone restores exactly the state at the final step.
    fresh = tf.train.Checkpoint(v=tf.Variable(np.zeros(64 * 1024, np.float32)))
    with at.CheckpointManager(fresh, url, max_to_keep=3) as again:
        assert os.path.basename(again.restore_or_initialize()) == name
    np.testing.assert_array_equal(fresh.v.numpy(),
                                  np.full(64 * 1024, values[final.run], np.float32))

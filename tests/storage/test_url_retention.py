"""A URL directory keeps what its manager's retention keeps, in the bucket too.

The remote tier of an ``s3://`` / ``gs://`` directory has no retention of its
own: what the manager's policy drops (``max_to_keep``) is deleted in the
bucket, and what it preserves (JAX ``keep_period``, TensorFlow
``keep_checkpoint_every_n_hours``) stays there. Two-tier mode keeps its own
``RemoteOptions.max_to_keep`` (``test_jax_remote.py``, ``test_tf_remote.py``).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from asyncckpt.storage import RetryPolicy
from asyncckpt.storage.protocol import download_checkpoint, list_committed
from asyncckpt.storage.stores import open_store
from asyncckpt.storage.tier import RemoteOptions
from tests.storage.conftest import BUCKET


@pytest.fixture
def s3_url(s3_server):
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"


def _in_bucket(url: str) -> list[str]:
    store = open_store(url)
    try:
        return [c.name for c in list_committed(store)]
    finally:
        store.close()


def _download(url: str, name: str, directory) -> None:
    """Checkpoint ``name`` of the bucket, verified, into a local directory (for the framework)."""
    store = open_store(url)
    try:
        remote = next(c for c in list_committed(store) if c.name == name)
        download_checkpoint(store, remote, str(directory), retry=RetryPolicy())
    finally:
        store.close()


def test_jax_url_directory_keeps_keep_period_steps_in_the_bucket(s3_url, tmp_path):
    pytest.importorskip("jax")
    ocp = pytest.importorskip("orbax.checkpoint")
    import asyncckpt.jax as aj

    def state(step):
        return {"w": np.full((16, 8), step, np.float32), "step": step}

    with aj.CheckpointManager(s3_url, max_to_keep=1, keep_period=2) as mgr:
        for step in range(1, 6):
            assert mgr.save(step, state(step))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 4, 5]
    assert _in_bucket(s3_url) == ["2", "4", "5"]  # the count alone would keep ["5"]
    # A new process (a fresh scratch directory) applies the same policy to the
    # steps it finds in the bucket, reading their records from there.
    with aj.CheckpointManager(s3_url, max_to_keep=1, keep_period=2) as mgr:
        assert mgr.all_steps() == [2, 4, 5]
        assert mgr.save(7, state(7))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 4, 7]
        assert _in_bucket(s3_url) == ["2", "4", "7"]
        mgr.delete(4)  # a step deleted by hand goes from the bucket too
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 7]
        got = mgr.restore(2, target=state(0))
        assert np.array_equal(np.asarray(got["w"]), state(2)["w"])
    assert _in_bucket(s3_url) == ["2", "7"]
    _download(s3_url, "2", tmp_path / "local")  # the preserved step, whole: orbax reads it
    with ocp.CheckpointManager(str(tmp_path / "local")) as theirs:
        got = theirs.restore(2, args=ocp.args.StandardRestore(state(0)))
    assert np.array_equal(np.asarray(got["w"]), state(2)["w"])


def test_tf_url_directory_keeps_preserved_checkpoints_in_the_bucket(s3_url, tmp_path):
    tf = pytest.importorskip("tensorflow")
    import asyncckpt.tf as at

    v = tf.Variable(np.zeros(8, np.float32))
    ckpt = tf.train.Checkpoint(v=v)
    # One checkpoint per 3.6 microseconds is preserved: every one that leaves
    # the max_to_keep window stays, as TensorFlow's manager keeps its files.
    with at.CheckpointManager(ckpt, s3_url, max_to_keep=1,
                              keep_checkpoint_every_n_hours=1e-9) as mgr:
        for i in range(1, 4):
            v.assign(np.full(8, i, np.float32))
            mgr.save()
        mgr.sync()
        assert mgr.checkpoints == [f"{s3_url}/ckpt-3"]
    assert _in_bucket(s3_url) == ["ckpt-1", "ckpt-2", "ckpt-3"]  # the count alone: ckpt-3
    restored = tf.train.Checkpoint(v=tf.Variable(np.zeros(8, np.float32)))
    at.Checkpoint.wrap(restored).restore(f"{s3_url}/ckpt-1")
    assert np.array_equal(restored.v.numpy(), np.full(8, 1, np.float32))
    _download(s3_url, "ckpt-1", tmp_path)  # the preserved checkpoint, whole: TensorFlow reads it
    theirs = tf.train.Checkpoint(v=tf.Variable(np.zeros(8, np.float32)))
    theirs.restore(str(tmp_path / "ckpt-1")).assert_consumed()
    assert np.array_equal(theirs.v.numpy(), np.full(8, 1, np.float32))


def test_tf_url_directory_keeps_preserved_checkpoints_across_restarts_as_tensorflow(
        s3_url, tmp_path):
    """A new manager leaves what an earlier one preserved, as TensorFlow's does (state file)."""
    tf = pytest.importorskip("tensorflow")
    import asyncckpt.tf as at

    def run(make, directory):
        v = tf.Variable(np.zeros(8, np.float32))
        ckpt = tf.train.Checkpoint(v=v)
        first = make(ckpt, directory, max_to_keep=1, keep_checkpoint_every_n_hours=1e-9)
        for _ in range(3):
            first.save()
        getattr(first, "sync", lambda: None)()
        # A restart with a longer period: ckpt-1 and ckpt-2 were preserved, ckpt-3
        # was managed and is now dropped by the next save.
        second = make(ckpt, directory, max_to_keep=1, keep_checkpoint_every_n_hours=1.0)
        managed = [p.rsplit("/", 1)[-1] for p in second.checkpoints]
        second.save()
        for m in (first, second):
            getattr(m, "close", lambda: None)()
        return managed

    theirs = run(tf.train.CheckpointManager, str(tmp_path / "tf"))
    kept_by_tf = sorted(p.name[:-len(".index")] for p in (tmp_path / "tf").glob("*.index"))
    ours = run(at.CheckpointManager, s3_url)
    assert ours == theirs == ["ckpt-3"]
    assert _in_bucket(s3_url) == kept_by_tf == ["ckpt-1", "ckpt-2", "ckpt-4"]
    assert at.latest_checkpoint(s3_url) == f"{s3_url}/ckpt-4"


def test_remote_max_to_keep_is_refused_for_a_url_directory():
    """The bucket of a URL directory keeps what the manager keeps: one spelling."""
    opts = RemoteOptions(max_to_keep=2)
    pytest.importorskip("tensorflow")
    import asyncckpt.tf as at

    with pytest.raises(ValueError, match="give max_to_keep"):
        at.CheckpointManager(at.Checkpoint(), "s3://bucket/run", max_to_keep=2,
                             remote_options=opts)
    with pytest.raises(ValueError, match="give max_to_keep"):
        at.Checkpoint(remote_options=opts)
    pytest.importorskip("jax")
    import asyncckpt.jax as aj

    with pytest.raises(ValueError, match="give max_to_keep"):
        aj.CheckpointManager("s3://bucket/run", max_to_keep=2, remote_options=opts)
    with pytest.raises(ValueError, match="todelete_subdir"):
        aj.CheckpointManager("s3://bucket/run", options=_orbax_soft_delete())


def _orbax_soft_delete():
    ocp = pytest.importorskip("orbax.checkpoint")
    return ocp.CheckpointManagerOptions(max_to_keep=2, todelete_subdir="trash")

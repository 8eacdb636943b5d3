"""URL-directory managers report URLs, not their local scratch directory.

``latest_checkpoint``, ``checkpoints``, ``newest_valid_checkpoint``, the path
``save()`` returns (TensorFlow), ``directory`` and ``step_dir`` (JAX): during
the run, after ``close()`` (when the scratch directory is gone) and in a new
process. What they name restores from that URL, with asyncckpt's reader
(TensorFlow cannot read ``s3://`` / ``gs://`` itself).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import subprocess_env, write_script

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402


def _ckpt(seed: int):
    return tf.train.Checkpoint(v=tf.Variable(np.full((64, 32), seed, np.float32)),
                               n=tf.Variable(seed, dtype=tf.int64))


def _restored(path: str) -> tuple[int, float]:
    fresh = at.Checkpoint(v=tf.Variable(np.zeros((64, 32), np.float32)),
                          n=tf.Variable(0, dtype=tf.int64))
    try:
        fresh.restore(path).assert_consumed()
        return int(fresh.n.numpy()), float(fresh.v.numpy()[0, 0])
    finally:
        fresh.close()


def test_tf_manager_on_a_url_reports_urls_during_after_close_and_in_a_new_process(
        remote_url, tmp_path):
    ckpt = _ckpt(0)
    mgr = at.CheckpointManager(ckpt, remote_url, max_to_keep=2)
    assert mgr.directory == remote_url
    paths = []
    for i in range(1, 4):
        ckpt.n.assign(i)
        ckpt.v.assign(np.full((64, 32), i, np.float32))
        paths.append(mgr.save())
        # Restorable from the URL at once: the restore waits for the save in flight.
        assert _restored(paths[-1]) == (i, float(i))
    assert paths == [f"{remote_url}/ckpt-{i}" for i in (1, 2, 3)]
    assert mgr.latest_checkpoint == f"{remote_url}/ckpt-3"
    assert mgr.checkpoints == [f"{remote_url}/ckpt-2", f"{remote_url}/ckpt-3"]
    mgr.close()
    assert mgr.latest_checkpoint == f"{remote_url}/ckpt-3"  # not the removed scratch path
    assert mgr.checkpoints == [f"{remote_url}/ckpt-2", f"{remote_url}/ckpt-3"]
    assert _restored(mgr.latest_checkpoint) == (3, 3.0)

    script = write_script(tmp_path, "child.py", f"""
        import json
        import numpy as np
        import tensorflow as tf
        import asyncckpt.tf as at

        ckpt = tf.train.Checkpoint(v=tf.Variable(np.zeros((64, 32), np.float32)),
                                   n=tf.Variable(0, dtype=tf.int64))
        with at.CheckpointManager(ckpt, {remote_url!r}, max_to_keep=2) as mgr:
            out = {{"directory": mgr.directory, "latest": mgr.latest_checkpoint,
                    "checkpoints": mgr.checkpoints,
                    "newest_valid": mgr.newest_valid_checkpoint(),
                    "restored": mgr.restore_or_initialize(), "n": int(ckpt.n.numpy())}}
            ckpt.n.assign(4)
            out["saved"] = mgr.save()
            out["after_save"] = mgr.checkpoints
        out["after_close"] = mgr.latest_checkpoint
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, str(script)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["directory"] == remote_url
    assert out["latest"] == out["newest_valid"] == out["restored"] == f"{remote_url}/ckpt-3"
    assert out["checkpoints"] == [f"{remote_url}/ckpt-2", f"{remote_url}/ckpt-3"]
    assert out["n"] == 3
    assert out["saved"] == out["after_close"] == f"{remote_url}/ckpt-4"
    # Retention counts what was already in the bucket, as TensorFlow's manager
    # counts what its state file names.
    assert out["after_save"] == [f"{remote_url}/ckpt-3", f"{remote_url}/ckpt-4"]
    assert _restored(f"{remote_url}/ckpt-4")[0] == 4
    assert at.latest_checkpoint(remote_url) == f"{remote_url}/ckpt-4"


def test_jax_manager_on_a_url_reports_its_url(remote_url, tmp_path):
    jax = pytest.importorskip("jax")
    import asyncckpt.jax as aj

    state = {"w": jax.numpy.arange(16.0)}
    with aj.CheckpointManager(remote_url, max_to_keep=2) as mgr:
        mgr.save(7, state)
        assert str(mgr.directory) == remote_url
        assert str(mgr.step_dir(7)) == f"{remote_url}/7"
    assert str(mgr.directory) == remote_url
    with aj.CheckpointManager(remote_url, max_to_keep=2) as again:
        assert str(again.directory) == remote_url
        assert again.latest_step() == 7
        assert str(again.step_dir(7)) == f"{remote_url}/7"
        restored = again.restore(7)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(16.0))

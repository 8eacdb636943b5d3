"""TensorFlow ``CheckpointManager.prepare``: staging memory built before the first save.

As for JAX (``test_jax_prepare.py``): without it the first save allocates
and faults in its staging slots on the training thread; each test has a
control that does, so the checks cannot pass vacuously.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt.errors import EngineClosedError  # noqa: E402
from tests.tfrestore import restore_both  # noqa: E402


def _variables(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": tf.Variable(rng.standard_normal((64, 32)).astype(np.float32)),
        "b": tf.Variable(tf.cast(rng.standard_normal(32), tf.bfloat16)),
        "step": tf.Variable(7, dtype=tf.int64),
        "ids": tf.Variable(np.arange(10, dtype=np.int32)),
    }


def _first_save_allocations(mgr) -> int:
    assert mgr.save() is not None
    allocated = max(s.allocations for s in mgr.engine._pool._slots)
    mgr.sync()
    return allocated


def _assert_restores(path: str, variables: dict) -> None:
    def check(fresh):
        for k, v in variables.items():
            assert np.array_equal(fresh[k].numpy(), v.numpy()), k

    restore_both(path, lambda: {k: tf.Variable(tf.zeros_like(v)) for k, v in variables.items()},
                 check, verdict="assert_existing_objects_matched")


def test_prepared_slots_leave_the_first_save_nothing_to_allocate(tmp_path):
    control = _variables()
    with at.CheckpointManager(tf.train.Checkpoint(**control), str(tmp_path / "control"),
                              max_to_keep=2) as mgr:
        assert _first_save_allocations(mgr) > 0

    variables = _variables(1)
    with at.CheckpointManager(tf.train.Checkpoint(**variables), str(tmp_path / "prepared"),
                              max_to_keep=2) as mgr:
        mgr.prepare()
        assert mgr.engine._pool.wait_prepared(60)
        assert mgr.engine.staging_bytes >= 2 * sum(v.numpy().nbytes for v in variables.values())
        assert mgr.checkpoints == []  # nothing is written
        assert _first_save_allocations(mgr) == 0
        _assert_restores(mgr.latest_checkpoint, variables)


def test_a_variable_created_after_prepare_is_allocated_by_the_first_save(tmp_path):
    variables = _variables(2)
    ckpt = tf.train.Checkpoint(**variables)
    with at.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2) as mgr:
        mgr.prepare()
        assert mgr.engine._pool.wait_prepared(60)
        ckpt.late = variables["late"] = tf.Variable(tf.ones((5, 5)))
        assert _first_save_allocations(mgr) == 1  # the new variable's buffer only
        _assert_restores(mgr.latest_checkpoint, variables)


def test_prepare_with_a_closed_checkpoint_raises(tmp_path):
    ckpt = at.Checkpoint(**_variables())
    mgr = at.CheckpointManager(ckpt, str(tmp_path), max_to_keep=1)
    mgr.save()
    ckpt.close()  # its engine and staging memory are gone
    with pytest.raises(EngineClosedError):
        mgr.save()
    with pytest.raises(EngineClosedError):
        mgr.prepare()


def test_the_preemption_handler_prepares_at_its_first_boundary(tmp_path):
    """The save at a notice then allocates nothing in the grace period."""
    import threading

    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

    notice = threading.Event()
    config = TerminationConfig(platform="other", exit_fn=lambda: None, poll_interval_s=0.01,
                               termination_watcher_fn=notice.is_set)
    variables = _variables(3)
    with at.CheckpointManager(tf.train.Checkpoint(**variables), str(tmp_path),
                              max_to_keep=2) as mgr, \
            PreemptionCheckpointHandler(mgr, termination_config=config) as handler:
        assert mgr.engine.staging_bytes == 0  # the control: nothing before a boundary
        handler.run(lambda: variables["step"].assign_add(1))
        assert mgr.engine._pool.wait_prepared(60)
        assert mgr.engine.staging_bytes > 0 and mgr.checkpoints == []
        notice.set()
        while not handler.preempted:
            handler.run(lambda: variables["step"].assign_add(1))
        assert handler.saves and mgr.checkpoints
        assert max(s.allocations for s in mgr.engine._pool._slots) == 0

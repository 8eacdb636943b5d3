"""asyncckpt.tf behaves as tf.train.Checkpoint / tf.train.CheckpointManager, case by case.

One test per row of the TensorFlow table in docs/compat.md. Each is written
from TensorFlow's documented behaviour, run against asyncckpt.tf with real
variables and real files.
"""

from __future__ import annotations

import copy
import logging
import os
import pathlib
import threading
import time
import weakref

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.checkpoint import checkpoint_management  # noqa: E402

import asyncckpt.tf as at  # noqa: E402
from asyncckpt import CheckpointNotFoundError  # noqa: E402
from tests.tfrestore import OwnReader, restore_both  # noqa: E402


def _value(path: str, like: np.ndarray, name: str = "v") -> np.ndarray:
    """The value at ``name``, read by TensorFlow's reader and asyncckpt's (which must agree)."""
    got = restore_both(path, lambda: {name: tf.Variable(np.zeros_like(like))}, lambda o: None,
                       method="read", verdict="expect_partial")
    theirs, ours = (got[r][name].numpy() for r in ("tensorflow", "asyncckpt"))
    np.testing.assert_array_equal(ours, theirs)
    return ours


def _closed_gate_save(gate, save):
    """Runs ``save`` with the writer held at the gate; returns its result."""
    gate.open.clear()
    result = save()
    assert gate.entered.acquire(timeout=30)
    return result


# -- tf.train.Checkpoint ---------------------------------------------------------


def test_is_a_tf_train_checkpoint():
    ckpt = at.Checkpoint(v=tf.Variable(1.0))
    assert isinstance(ckpt, tf.train.Checkpoint)


def test_attribute_assigned_after_construction_is_saved(ckpt_dir):
    ckpt = at.Checkpoint(v=tf.Variable([1.0]))
    ckpt.step = tf.Variable(5, dtype=tf.int64)
    ckpt.layers = [tf.Variable([2.0, 3.0])]  # tracked data structures too
    ckpt.checkpoint = tf.Variable([4.0])  # any name, even one asyncckpt uses
    ckpt.async_options = tf.Variable([5.0])
    path = ckpt.save(str(ckpt_dir / "ckpt"))
    ckpt.sync()

    def make():  # (not the constructor's keywords: async_options is one of asyncckpt's)
        return {"v": tf.Variable([0.0]), "step": tf.Variable(0, dtype=tf.int64),
                "layers": [tf.Variable([0.0, 0.0])], "checkpoint": tf.Variable([0.0]),
                "async_options": tf.Variable([0.0])}

    def check(o):
        assert int(o["step"].numpy()) == 5 and o["layers"][0].numpy().tolist() == [2.0, 3.0]
        assert o["checkpoint"].numpy()[0] == 4.0 and o["async_options"].numpy()[0] == 5.0

    fresh = make()
    tf.train.Checkpoint(**fresh).restore(path).assert_consumed()
    check(fresh)
    fresh = make()
    ours = at.Checkpoint(v=fresh.pop("v"), step=fresh.pop("step"))
    for name, value in fresh.items():  # assigned after construction, as when saved
        setattr(ours, name, value)
    with OwnReader() as spy:
        ours.restore(path).assert_consumed()
    check({**fresh, "step": ours.step})
    spy.assert_read_by_asyncckpt(path)


def test_nests_in_another_checkpoint(ckpt_dir):
    inner = at.Checkpoint(v=tf.Variable([4.0]))
    outer = tf.train.Checkpoint(inner=inner, w=tf.Variable([5.0]))
    path = outer.write(str(ckpt_dir / "outer"))

    def check(o):
        assert o["inner"].v.numpy()[0] == 4.0 and o["w"].numpy()[0] == 5.0

    restore_both(path, lambda: {"inner": tf.train.Checkpoint(v=tf.Variable([0.0])),
                                "w": tf.Variable([0.0])}, check, method="read")
    v = tf.Variable([4.0])
    # And the other way round: a tf.train.Checkpoint nested in an asyncckpt one.
    async_outer = at.Checkpoint(inner=tf.train.Checkpoint(v=v))
    v.assign([6.0])
    path = async_outer.write(str(ckpt_dir / "async_outer"))
    got = tf.Variable([0.0])
    at.Checkpoint(inner=tf.train.Checkpoint(v=got)).read(path).assert_consumed()
    assert got.numpy()[0] == 6.0


def test_deepcopy_has_its_own_variables_and_engine(ckpt_dir):
    ckpt = at.Checkpoint(v=tf.Variable([1.0]))
    ckpt.write(str(ckpt_dir / "orig"))  # the original has an engine and a thread now
    clone = copy.deepcopy(ckpt)
    assert clone.v is not ckpt.v and clone.engine is not ckpt.engine
    clone.v.assign([9.0])
    path = clone.write(str(ckpt_dir / "clone"))
    assert clone.restore_options == ckpt.restore_options
    clone.sync()
    assert _value(path, np.zeros(1, np.float32))[0] == 9.0
    assert ckpt.v.numpy()[0] == 1.0
    ckpt.close()
    clone.close()


def test_prefix_as_path_or_string_tensor(ckpt_dir):
    ckpt = at.Checkpoint(v=tf.Variable([2.0]))
    written = ckpt.write(tf.constant(str(ckpt_dir / "from_tensor")))
    assert written == str(ckpt_dir / "from_tensor")
    saved = ckpt.save(ckpt_dir / "from_path")
    assert saved == str(ckpt_dir / "from_path-1")
    got = tf.Variable([0.0])
    at.Checkpoint(v=got).read(pathlib.Path(written))
    assert got.numpy()[0] == 2.0
    at.Checkpoint(v=got).restore(pathlib.Path(saved)).assert_consumed()
    ckpt.close()


def test_write_inside_tf_function_uses_tensorflows_own_save(ckpt_dir):
    v = tf.Variable([3.0, 4.0])
    ckpt = at.Checkpoint(v=v)
    prefix = str(ckpt_dir / "in_function")

    @tf.function
    def write():
        v.assign_add([1.0, 1.0])
        return ckpt.write(prefix)

    assert write().numpy().decode() == prefix
    assert _value(prefix, np.zeros(2, np.float32)).tolist() == [4.0, 5.0]

    @tf.function
    def save():
        return ckpt.save(prefix)

    with pytest.raises(NotImplementedError, match="from a function"):  # as TensorFlow
        save()


def test_graph_mode_save_uses_tensorflows_own_save(ckpt_dir):
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        v = tf.Variable(3.0)
        ckpt = at.Checkpoint(v=v)
        sess.run(v.initializer)
        path = ckpt.save(str(ckpt_dir / "graph"))
    assert path == str(ckpt_dir / "graph-1")
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == path
    assert _value(path, np.float32(0.0)) == 3.0


def test_weakref_root_is_not_kept_alive_by_the_save_plan(ckpt_dir):
    root = tf.Module()
    root.v = tf.Variable(tf.ones(8))
    ckpt = at.Checkpoint(root=weakref.ref(root))
    for _ in range(3):  # the later saves reuse a cached plan
        ckpt.save(str(ckpt_dir / "ckpt"))
    ckpt.sync()
    root_ref, var_ref = weakref.ref(root), weakref.ref(root.v)
    del root  # reference counting alone frees both
    assert root_ref() is None and var_ref() is None
    ckpt.close()


def test_restores_a_saved_model_directory(tmp_path):
    module = tf.Module()
    module.v = tf.Variable([4.0, 5.0])
    tf.saved_model.save(module, str(tmp_path / "model"))
    fresh = tf.Module()
    fresh.v = tf.Variable([0.0, 0.0])
    at.Checkpoint(root=fresh).restore(str(tmp_path / "model")).expect_partial()
    assert fresh.v.numpy().tolist() == [4.0, 5.0]


def test_missing_path_raises_tensorflows_not_found_error(ckpt_dir):
    ckpt = at.Checkpoint(v=tf.Variable(1.0))
    for call in (ckpt.restore, ckpt.read):
        with pytest.raises(tf.errors.NotFoundError, match="checkpoint or SavedModel") as err:
            call(str(ckpt_dir / "nope-1"))
        # Also asyncckpt's (and Python's) own "not found".
        assert isinstance(err.value, CheckpointNotFoundError)
        assert isinstance(err.value, FileNotFoundError)


def test_checkpoint_options_are_honoured_or_refused(ckpt_dir):
    v = tf.Variable([1.0])
    ckpt = at.Checkpoint(v=v)
    seen = []

    def with_path(path):
        seen.append((path, os.path.exists(path + ".index"), threading.current_thread().name))

    options = tf.train.CheckpointOptions(
        enable_async=True,  # accepted: asyncckpt saves asynchronously anyway
        experimental_io_device="/job:localhost/replica:0/task:0/device:CPU:0",
        experimental_write_callbacks=[with_path, lambda: seen.append("no-arg")],
    )
    path = ckpt.save(str(ckpt_dir / "ckpt"), options=options)
    ckpt.sync()
    # Run once, after the commit (the files exist), on the writer thread.
    assert seen[0][:2] == (path, True) and seen[0][2] != threading.current_thread().name
    assert seen[1] == "no-arg" and len(seen) == 2
    assert ckpt._async_checkpointer_impl is None  # TensorFlow's own async helper unused
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == path
    written = ckpt.write(str(ckpt_dir / "plain"), options=options)
    ckpt.sync()
    assert seen[2][:2] == (written, True)

    class OwnSharding(tf.train.experimental.ShardingCallback):
        @property
        def description(self):
            return "own"

        def __call__(self, shardable_tensors):
            return []

    refused = tf.train.CheckpointOptions(experimental_sharding_callback=OwnSharding())
    with pytest.raises(NotImplementedError, match="sharding"):
        ckpt.save(str(ckpt_dir / "ckpt"), options=refused)
    assert int(ckpt.save_counter.numpy()) == 1  # the refused save was not counted
    ckpt.close()


def test_tensorflows_own_manager_saves_it_asynchronously(ckpt_dir, gate):
    ckpt = gate.Checkpoint(v=tf.Variable([7.0]))
    manager = tf.train.CheckpointManager(ckpt, str(ckpt_dir), max_to_keep=2)
    path = _closed_gate_save(gate, manager.save)
    assert tf.train.latest_checkpoint(str(ckpt_dir)) is None  # not durable yet
    gate.open.set()
    ckpt.sync()
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == path == manager.latest_checkpoint


def test_tensorflows_own_manager_sees_the_save_at_the_call(ckpt_dir, gate):
    """TensorFlow's manager records a save in its write callback, which runs at the
    ``save()`` call as over ``tf.train.Checkpoint``; the files follow, and a restore
    of the path waits for them. The user's own write callbacks still run once durable."""
    v = tf.Variable([1.0, 2.0])
    ckpt = gate.Checkpoint(v=v)
    inits = []
    manager = tf.train.CheckpointManager(ckpt, str(ckpt_dir), max_to_keep=3,
                                         init_fn=lambda: inits.append(1))
    seen = []
    options = tf.train.CheckpointOptions(experimental_write_callbacks=[
        lambda path: seen.append((path, os.path.exists(path + ".index")))])
    path = _closed_gate_save(gate, lambda: manager.save(options=options))
    # TensorFlow's bookkeeping, at the call: what code built on the manager reads.
    assert manager.latest_checkpoint == path and manager.checkpoints == [path]
    state = tf.train.get_checkpoint_state(str(ckpt_dir))
    assert state.model_checkpoint_path == path
    assert list(state.all_model_checkpoint_paths) == [path]
    # The files are not there yet: TensorFlow's latest_checkpoint checks for them.
    assert not os.path.exists(path + ".index")
    assert tf.train.latest_checkpoint(str(ckpt_dir)) is None
    assert seen == []  # the user's callback waits for durability
    # A recovery (orbit's RecoveryAction calls restore_or_initialize) restores the
    # save in flight once it is written, instead of initializing.
    v.assign([0.0, 0.0])
    done, result = threading.Event(), []
    t = threading.Thread(target=lambda: (result.append(manager.restore_or_initialize()),
                                         done.set()))
    t.start()
    assert not done.wait(0.5)  # waiting for the write
    gate.open.set()
    t.join(60)
    assert result == [path] and not inits and v.numpy().tolist() == [1.0, 2.0]
    ckpt.sync()
    assert seen == [(path, True)]
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == path
    np.testing.assert_array_equal(_value(path, np.zeros(2, np.float32)), [1.0, 2.0])
    ckpt.close()


def test_tensorflows_own_manager_deletes_a_checkpoint_in_flight_only_once_written(
        ckpt_dir, gate):
    """Its retention runs at the call too: a checkpoint it drops while that one is
    still being written is waited for, then deleted whole (its manifest too)."""
    v = tf.Variable([1.0])
    ckpt = gate.Checkpoint(v=v)
    manager = tf.train.CheckpointManager(ckpt, str(ckpt_dir), max_to_keep=1)
    first = _closed_gate_save(gate, manager.save)
    v.assign([2.0])
    done, second = threading.Event(), []
    t = threading.Thread(target=lambda: (second.append(manager.save()), done.set()))
    t.start()
    # The second save drops the first from max_to_keep=1: it waits for it to be written.
    assert not done.wait(0.5)
    assert not os.path.exists(first + ".index")
    gate.open.set()
    t.join(60)
    (second,) = second
    assert manager.checkpoints == [second] and manager.latest_checkpoint == second
    ckpt.sync()
    # The first was complete when TensorFlow deleted it: nothing of it is left.
    assert sorted(os.listdir(ckpt_dir)) == sorted([
        "checkpoint", os.path.basename(second) + ".index",
        os.path.basename(second) + ".data-00000-of-00001",
        os.path.basename(second) + ".asyncckpt-manifest.json"] + [
        n for n in os.listdir(ckpt_dir) if n.startswith(".asyncckpt")])
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == second
    assert at.verify_checkpoint(second)
    np.testing.assert_array_equal(_value(second, np.zeros(1, np.float32)), [2.0])
    ckpt.close()


def test_tensorflows_own_manager_has_recorded_a_save_that_fails_later(ckpt_dir):
    """The price of its bookkeeping at the call: a write that fails afterwards (a full
    disk) finds the save recorded and the checkpoint it pushed out deleted."""
    import errno

    from asyncckpt.tf._job import TFSaveJob

    fail = threading.Event()

    class FullDisk(TFSaveJob):  # the real writer, on a disk that fills up
        def write_bundle(self, prefix, state):
            if fail.is_set():
                raise OSError(errno.ENOSPC, "No space left on device", prefix)
            return super().write_bundle(prefix, state)

    class Ckpt(at.Checkpoint):
        _job_class = FullDisk

    v = tf.Variable([1.0])
    ckpt = Ckpt(v=v)
    manager = tf.train.CheckpointManager(ckpt, str(ckpt_dir), max_to_keep=1)
    first = manager.save()
    ckpt.sync()
    fail.set()
    second = manager.save()
    with pytest.raises(OSError, match="No space left"):
        ckpt.sync()
    assert manager.latest_checkpoint == second and manager.checkpoints == [second]
    assert not os.path.exists(first + ".index") and not os.path.exists(second + ".index")
    assert tf.train.latest_checkpoint(str(ckpt_dir)) is None
    with pytest.raises(tf.errors.NotFoundError):
        manager.restore_or_initialize()
    ckpt.close()


def test_restore_of_a_path_in_flight_waits_for_that_save(ckpt_dir, gate):
    v = tf.Variable([1.0, 2.0])
    writer = gate.Checkpoint(v=v)
    path = _closed_gate_save(gate, lambda: writer.save(str(ckpt_dir / "ckpt")))
    got = tf.Variable([0.0, 0.0])
    done = threading.Event()
    errors = []

    def restore():
        try:
            at.Checkpoint(v=got).restore(path)  # another Checkpoint object
        except BaseException as e:  # reported below
            errors.append(e)
        done.set()

    t = threading.Thread(target=restore)
    t.start()
    assert not done.wait(0.5)  # waiting for the write, not failing
    gate.open.set()
    t.join(60)
    assert not errors and got.numpy().tolist() == [1.0, 2.0]
    writer.close()


def test_partial_restore_says_what_was_skipped(ckpt_dir):
    model, opt = tf.Module(), tf.Module()
    model.kernel = tf.Variable([1.0, 2.0])
    opt.moment = tf.Variable([3.0])
    ckpt = at.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(str(ckpt_dir / "ckpt"))
    fresh = tf.Module()
    fresh.kernel = tf.Variable([0.0, 0.0])
    fresh.extra = tf.Variable([0.0])  # not in the checkpoint
    result = at.Checkpoint(model=fresh).restore_partial(path)
    assert fresh.kernel.numpy().tolist() == [1.0, 2.0]
    assert result.skipped_objects == ("optimizer/moment",)
    assert result.skipped_keys == ("optimizer/moment/.ATTRIBUTES/VARIABLE_VALUE",)
    assert result.unmatched == ("model/extra",)
    assert "model/kernel" in result.restored and not result.complete
    # A subset of this checkpoint's own objects: the optimizer is left alone.
    model.kernel.assign([0.0, 0.0])
    opt.moment.assign([-1.0])
    subset = ckpt.restore_partial(path, only=["model"])
    assert model.kernel.numpy().tolist() == [1.0, 2.0] and opt.moment.numpy()[0] == -1.0
    assert subset.skipped_objects == ("optimizer/moment",)
    ckpt.close()


def test_dropped_checkpoint_is_collected_and_its_save_completes(ckpt_dir, gate):
    v = tf.Variable(np.arange(4, dtype=np.float32))
    refs, paths = [], []
    for i in range(3):
        ckpt = gate.Checkpoint(v=v)
        paths.append(_closed_gate_save(gate, lambda c=ckpt, i=i: c.save(str(ckpt_dir / f"d{i}"))))
        refs.append(weakref.ref(ckpt))
        del ckpt
    gate.open.set()
    for path in paths:  # waits for each save in flight, then reads it
        got = tf.Variable(np.zeros(4, np.float32))
        at.Checkpoint(v=got).restore(path)
        assert got.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    # Gone by reference counting alone: nothing (no finished job) refers to them.
    assert [r() for r in refs] == [None, None, None]


# -- tf.train.CheckpointManager ----------------------------------------------------


def test_manager_is_a_tf_train_checkpoint_manager(ckpt_dir):
    step = tf.Variable(0, dtype=tf.int64)
    ckpt = tf.train.Checkpoint(v=tf.Variable([1.0]), step=step)

    def init_fn():
        pass

    args = dict(max_to_keep=2, keep_checkpoint_every_n_hours=1.5, checkpoint_name="model",
                step_counter=step, checkpoint_interval=1, init_fn=init_fn)
    with at.CheckpointManager(ckpt, ckpt_dir, **args) as mgr:
        assert isinstance(mgr, tf.train.CheckpointManager)
        for _ in range(3):
            step.assign_add(1)
            mgr.save()
    # Every attribute TensorFlow's own manager sets up on this directory (what
    # TensorFlow's code, e.g. tf.distribute's PreemptionCheckpointHandler,
    # reads from a manager) reads the same from asyncckpt's.
    ours = at.CheckpointManager(ckpt, ckpt_dir, **args)
    theirs = tf.train.CheckpointManager(ckpt, str(ckpt_dir), **args)
    assert set(vars(theirs)) >= {"_checkpoint", "_maybe_delete", "_latest_checkpoint"}
    for name, value in vars(theirs).items():
        mine = getattr(ours, name)
        assert (dict(mine) if name == "_maybe_delete" else mine) == value, name
    assert ours._prefix == theirs._prefix and ours.checkpoint is ckpt
    assert list(ours._maybe_delete) == [str(ckpt_dir / "model-2"), str(ckpt_dir / "model-3")]
    # Kept as asyncckpt's view: at the save() call, as in TensorFlow.
    step.assign_add(1)
    path = ours.save()
    assert ours._latest_checkpoint == path and list(ours._maybe_delete)[-1] == path
    # No method of TensorFlow's runs its synchronous behaviour on this manager:
    # each is overridden (``_prefix`` only reads ``_checkpoint_prefix``), and
    # TensorFlow's own retention and state-file writes are refused.
    inherited = [name for name, member in vars(tf.train.CheckpointManager).items()
                 if (callable(member) or isinstance(member, property))
                 and not name.startswith("__") and name not in vars(at.CheckpointManager)]
    assert inherited == ["_prefix"]
    with pytest.raises(NotImplementedError, match="once each save is durable"):
        ours._sweep()
    with pytest.raises(NotImplementedError, match="once each save is durable"):
        ours._record_state()
    with pytest.raises(AttributeError):
        ours._max_to_keep = 5  # set at construction; never silently ignored
    ours.close()


def test_manager_view_changes_at_save_call(ckpt_dir, gate):
    mgr = at.CheckpointManager(gate.Checkpoint.wrap(tf.train.Checkpoint(v=tf.Variable([1.0]))),
                               ckpt_dir, max_to_keep=1)
    first = mgr.save()
    mgr.sync()
    second = _closed_gate_save(gate, mgr.save)
    # As in TensorFlow: the new checkpoint is latest and the old one is out.
    assert mgr.latest_checkpoint == second and mgr.checkpoints == [second]
    # On disk nothing changed yet: the state file names only durable checkpoints.
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == first
    assert os.path.exists(first + ".index")
    gate.open.set()
    mgr.sync()
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == second
    assert not os.path.exists(first + ".index")
    mgr.close()


def test_restore_right_after_save_restores_the_new_checkpoint(ckpt_dir, gate):
    v = tf.Variable([1.0])
    mgr = at.CheckpointManager(gate.Checkpoint(v=v), ckpt_dir, max_to_keep=2)
    mgr.save()
    mgr.sync()
    v.assign([2.0])
    _closed_gate_save(gate, mgr.save)
    v.assign([0.0])
    got = tf.Variable([0.0])
    done = threading.Event()
    t = threading.Thread(
        target=lambda: (at.Checkpoint(v=got).restore(mgr.latest_checkpoint), done.set())
    )
    t.start()
    assert not done.wait(0.5)
    gate.open.set()
    t.join(60)
    assert got.numpy()[0] == 2.0
    v.assign([0.0])
    assert mgr.restore_or_initialize() == mgr.latest_checkpoint and v.numpy()[0] == 2.0
    mgr.close()


def test_timestamps_are_taken_at_the_save_call(ckpt_dir, gate):
    mgr = at.CheckpointManager(
        gate.Checkpoint.wrap(tf.train.Checkpoint(v=tf.Variable([1.0]))), ckpt_dir, max_to_keep=3,
        keep_checkpoint_every_n_hours=1.0,
    )
    _closed_gate_save(gate, mgr.save)
    returned = time.time()
    while time.time() <= returned:  # the commit surely happens later than `returned`
        pass
    gate.open.set()
    mgr.sync()
    state = tf.train.get_checkpoint_state(str(ckpt_dir))
    assert next(iter(state.all_model_checkpoint_timestamps)) <= returned
    mgr.close()


def test_numpy_ints_and_pathlib_are_accepted(tmp_path):
    directory = pathlib.Path(tmp_path) / "np"
    mgr = at.CheckpointManager(
        tf.train.Checkpoint(v=tf.Variable([1.0])), directory, max_to_keep=np.int64(2)
    )
    assert mgr.save(checkpoint_number=np.int64(7)) == str(directory / "ckpt-7")
    assert mgr.save(checkpoint_number=np.int32(8)) == str(directory / "ckpt-8")
    assert mgr.save() == str(directory / "ckpt-3")  # save_counter still counts
    mgr.sync()
    assert mgr.checkpoints == [str(directory / "ckpt-8"), str(directory / "ckpt-3")]
    mgr.close()


def test_warns_when_the_clock_is_behind_the_last_preserved_timestamp(ckpt_dir, caplog):
    ckpt = tf.train.Checkpoint(v=tf.Variable([1.0]))
    path = ckpt.save(str(ckpt_dir / "ckpt"))
    future = time.time() + 3600.0
    checkpoint_management.update_checkpoint_state_internal(
        str(ckpt_dir), path, all_model_checkpoint_paths=[path],
        all_model_checkpoint_timestamps=[future], last_preserved_timestamp=future,
        save_relative_paths=True,
    )
    with caplog.at_level(logging.WARNING):
        mgr = at.CheckpointManager(ckpt, ckpt_dir, max_to_keep=1)
    assert "behind the last preserved checkpoint timestamp" in caplog.text
    # As TensorFlow: known, but never deleted, so not among the managed ones.
    assert mgr.latest_checkpoint == path and mgr.checkpoints == []
    mgr.save()
    mgr.sync()
    assert os.path.exists(path + ".index")
    mgr.close()


def test_retention_failure_after_publish_does_not_fail_the_save(ckpt_dir):
    from asyncckpt.tf._dirview import ManagedCheckpoints

    broken = {"ckpt-1"}

    class FlakyDeletes(ManagedCheckpoints):  # the real view, on a disk refusing deletes
        def delete(self, name):
            if name in broken:
                raise PermissionError(13, "Permission denied", name)
            super().delete(name)

    class Manager(at.CheckpointManager):
        _view_class = FlakyDeletes

    mgr = Manager(tf.train.Checkpoint(v=tf.Variable([1.0])), ckpt_dir, max_to_keep=1)
    first = mgr.save()
    second = mgr.save()
    mgr.sync()  # does not raise: the second checkpoint is durable
    assert mgr.retention_failures == 1
    assert os.path.exists(first + ".index")
    # Not forgotten: still named by the state file, so a restart would see it.
    state = tf.train.get_checkpoint_state(str(ckpt_dir))
    assert list(state.all_model_checkpoint_paths) == [first, second]
    assert state.model_checkpoint_path == second
    broken.clear()
    third = mgr.save()  # the next save retries the deletion
    mgr.sync()
    assert not os.path.exists(first + ".index") and not os.path.exists(second + ".index")
    assert list(tf.train.get_checkpoint_state(str(ckpt_dir)).all_model_checkpoint_paths) == [
        third
    ]
    mgr.close()


def test_state_file_failure_after_publish_does_not_fail_the_save(ckpt_dir):
    from asyncckpt.tf._dirview import ManagedCheckpoints

    fail = [True]

    class FullDisk(ManagedCheckpoints):  # the real view, on a disk that is full a while
        def write_state_file(self, deleting):
            if fail[0]:
                raise OSError(28, "No space left on device", "checkpoint")
            super().write_state_file(deleting)

    class Manager(at.CheckpointManager):
        _view_class = FullDisk

    mgr = Manager(tf.train.Checkpoint(v=tf.Variable([1.0])), ckpt_dir, max_to_keep=2)
    first = mgr.save()
    mgr.sync()
    assert mgr.retention_failures == 1 and os.path.exists(first + ".index")
    fail[0] = False
    second = mgr.save()
    mgr.sync()
    state = tf.train.get_checkpoint_state(str(ckpt_dir))
    assert list(state.all_model_checkpoint_paths) == [first, second]
    mgr.close()


def test_two_managers_of_one_directory_in_one_process(ckpt_dir):
    checkpoint = tf.train.Checkpoint(v=tf.Variable([1.0]))
    manager = at.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=None)
    paths = [manager.save() for _ in range(3)]
    assert manager.checkpoints == paths
    del manager  # how TensorFlow's own tests model a restart
    manager = at.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=3)
    assert manager.checkpoints == paths
    other = at.CheckpointManager(tf.train.Checkpoint(v=tf.Variable([2.0])), ckpt_dir, 3)
    fourth = other.save(checkpoint_number=10)  # no DirectoryLockedError
    assert manager.checkpoints == other.checkpoints == [*paths[1:], fourth]
    assert manager.latest_checkpoint == fourth
    manager.sync()
    other.sync()
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == fourth
    assert not os.path.exists(paths[0] + ".index")
    manager.close()
    other.close()


def test_sync_of_a_new_manager_waits_for_a_dropped_managers_saves(ckpt_dir, gate):
    # A manager dropped for a restart keeps writing; the one that takes over
    # the directory settles (files, retention, state file) on its sync().
    checkpoint = tf.train.Checkpoint(v=tf.Variable([1.0]))
    first = at.CheckpointManager(gate.Checkpoint.wrap(checkpoint), ckpt_dir, max_to_keep=1)
    old = first.save()
    first.sync()
    held = _closed_gate_save(gate, first.save)
    del first
    manager = at.CheckpointManager(tf.train.Checkpoint(v=tf.Variable([2.0])), ckpt_dir, 1)
    with pytest.raises(TimeoutError, match="dropped manager"):
        manager.sync(timeout=0.2)
    assert os.path.exists(old + ".index") and not os.path.exists(held + ".index")
    gate.open.set()
    manager.sync()
    assert os.path.exists(held + ".index") and not os.path.exists(old + ".index")
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == held
    manager.close()


def test_dropped_managers_are_collected_and_their_saves_complete(ckpt_dir, gate):
    v = tf.Variable([5.0])
    refs, paths = [], []
    for i in range(3):
        directory = ckpt_dir / f"run{i}"
        mgr = at.CheckpointManager(gate.Checkpoint.wrap(tf.train.Checkpoint(v=v)), directory,
                                   max_to_keep=1)
        paths.append(_closed_gate_save(gate, mgr.save))
        refs.append(weakref.ref(mgr))
        del mgr
    gate.open.set()
    for path in paths:
        got = tf.Variable([0.0])
        at.Checkpoint(v=got).restore(path)
        assert got.numpy()[0] == 5.0
    # Gone by reference counting alone: nothing (no finished job) refers to them.
    assert [r() for r in refs] == [None, None, None]
    for path in paths:  # the state files followed, although the managers are gone
        assert tf.train.latest_checkpoint(os.path.dirname(path)) == path


def test_manager_in_graph_mode_is_refused_clearly(ckpt_dir):
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        v = tf.Variable(1.0)
        sess.run(v.initializer)
        mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), ckpt_dir, max_to_keep=1)
        with pytest.raises(NotImplementedError, match="eager"):
            mgr.save()
    assert not list(ckpt_dir.iterdir())


def test_partial_restore_of_a_subset_through_a_wrapped_checkpoint(ckpt_dir):
    model, opt = tf.Module(), tf.Module()
    model.kernel = tf.Variable([1.0])
    opt.moment = tf.Variable([2.0])
    plain = tf.train.Checkpoint(model=model, optimizer=opt)
    mgr = at.CheckpointManager(plain, ckpt_dir, max_to_keep=1)
    path = mgr.save()
    model.kernel.assign([0.0])
    opt.moment.assign([0.0])
    wrapped = at.Checkpoint.wrap(plain)
    assert wrapped.checkpoint is plain and isinstance(wrapped, tf.train.Checkpoint)
    result = wrapped.restore_partial(path, only=["model"])
    assert model.kernel.numpy()[0] == 1.0 and opt.moment.numpy()[0] == 0.0
    assert result.skipped_objects == ("optimizer/moment",)
    with pytest.raises(ValueError, match="no attribute"):
        wrapped.restore_partial(path, only=["nope"])
    mgr.close()


def test_save_in_tensorflows_preemption_save_context_is_durable_on_return(ckpt_dir, gate):
    from tensorflow.python.checkpoint import checkpoint_context

    ckpt = gate.Checkpoint(v=tf.Variable([1.0]))
    gate.open.clear()
    done = threading.Event()
    seen = []

    def final_save():
        # What tf.distribute's PreemptionCheckpointHandler does before exiting.
        with checkpoint_context.preemption_save_context():
            path = ckpt.save(str(ckpt_dir / "ckpt"))
        seen.append(os.path.exists(path + ".index"))
        done.set()

    t = threading.Thread(target=final_save)
    t.start()
    assert gate.entered.acquire(timeout=30)
    assert not done.wait(0.5)  # still writing: the save has not returned
    gate.open.set()
    t.join(60)
    assert seen == [True]
    ckpt.close()


def test_manager_saves_a_checkpoint_made_with_root_as_tensorflow_does(tmp_path):
    """``tf.train.Checkpoint(root=module)``: the manager saves exactly its graph."""
    module = tf.Module()
    module.v = tf.Variable([1.0, 2.0])
    module.inner = tf.Module()
    module.inner.w = tf.Variable(7, dtype=tf.int64)
    ckpt = tf.train.Checkpoint(root=module)
    with at.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2) as mgr:
        path = mgr.save()
        mgr.sync()
        reference = ckpt.write(str(tmp_path / "reference"))  # TensorFlow's own save of it
        assert int(ckpt.save_counter.numpy()) == 1  # the manager numbers with its counter
    ours, theirs = tf.train.load_checkpoint(path), tf.train.load_checkpoint(reference)
    assert ours.get_variable_to_dtype_map().keys() == theirs.get_variable_to_dtype_map().keys()
    key = "_CHECKPOINTABLE_OBJECT_GRAPH"
    assert ours.get_tensor(key) == theirs.get_tensor(key)  # no edge added by the wrapper

    def make():
        m = tf.Module()
        m.v = tf.Variable([0.0, 0.0])
        m.inner = tf.Module()
        m.inner.w = tf.Variable(0, dtype=tf.int64)
        return {"root": m}

    def check(objects):
        assert objects["root"].v.numpy().tolist() == [1.0, 2.0]
        assert int(objects["root"].inner.w.numpy()) == 7

    restore_both(path, make, check)


def test_restore_or_initialize_reads_the_checkpoint_once_with_asyncckpts_reader(tmp_path):
    v = tf.Variable(np.arange(64, dtype=np.float32))
    with at.CheckpointManager(tf.train.Checkpoint(v=v), str(tmp_path), max_to_keep=2) as mgr:
        mgr.save()
    fresh = tf.Variable(np.zeros(64, np.float32))
    with OwnReader() as spy, at.CheckpointManager(tf.train.Checkpoint(v=fresh), str(tmp_path),
                                                  max_to_keep=2) as mgr:
        assert mgr.restore_or_initialize() == os.path.join(str(tmp_path), "ckpt-1")
    assert spy.took == [True]  # the fast path read it (verifying as it read)
    assert not [k for _, k in spy.tf_reads if k.startswith("v/")]  # TensorFlow read no tensor
    np.testing.assert_array_equal(fresh.numpy(), np.arange(64, dtype=np.float32))

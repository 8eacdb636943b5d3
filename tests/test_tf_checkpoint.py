"""asyncckpt.tf.Checkpoint: round trips, snapshot semantics, slots, failures, bad input."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt import AsyncOptions, CheckpointNotFoundError  # noqa: E402
from asyncckpt.tf._job import TFSaveJob  # noqa: E402
from tests.helpers import LineWatcher, start_python, write_script  # noqa: E402
from tests.tfrestore import restore_both  # noqa: E402


def _values(variables) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def _assert_equal_values(expected, variables) -> None:
    got = _values(variables)
    assert len(got) == len(expected)
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(e, g)


def _temps(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(".asyncckpt-tmp-")]


def test_variables_round_trip_through_plain_tensorflow(ckpt_dir):
    v = {
        "f32": tf.Variable(np.arange(12, dtype=np.float32).reshape(3, 4)),
        "bf16": tf.Variable(tf.constant([1.5, -2.25, 3.0], dtype=tf.bfloat16)),
        "i64": tf.Variable(np.array([1, -2, 3], dtype=np.int64)),
        "i32": tf.Variable(np.int32(7)),
        "b": tf.Variable([True, False]),
        "f16": tf.Variable(np.array([0.5, 2.0], dtype=np.float16)),
    }
    expected = _values(v.values())
    with at.Checkpoint(**v) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        assert path == str(ckpt_dir / "ckpt-1")
        ckpt.sync()
    restore_both(path, lambda: {k: tf.Variable(tf.zeros_like(x)) for k, x in v.items()},
                 lambda fresh: _assert_equal_values(expected, fresh.values()))
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == path
    assert not _temps(ckpt_dir)


def test_write_keeps_prefix_and_does_not_touch_state_file(ckpt_dir):
    v = tf.Variable([1.0, 2.0])
    with at.Checkpoint(v=v) as ckpt:
        assert ckpt.write(str(ckpt_dir / "plain")) == str(ckpt_dir / "plain")
        ckpt.sync()
        assert int(ckpt.save_counter.numpy()) == 0
    assert not (ckpt_dir / "checkpoint").exists()
    restore_both(str(ckpt_dir / "plain"), lambda: {"v": tf.Variable([0.0, 0.0])},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), [1.0, 2.0]),
                 method="read")


def test_snapshot_holds_values_at_save_call(ckpt_dir, gate):
    v = tf.Variable(np.full((256, 256), 1.0, np.float32))
    gate.open.clear()
    with gate.Checkpoint(v=v) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        # The write has not even started copying to disk; mutate right away.
        v.assign(np.full((256, 256), 2.0, np.float32))
        v.assign_add(np.ones((256, 256), np.float32))
        gate.open.set()
        ckpt.sync()
    restore_both(path, lambda: {"v": tf.Variable(tf.zeros((256, 256)))},
                 lambda o: np.testing.assert_array_equal(
                     o["v"].numpy(), np.full((256, 256), 1.0, np.float32)), verdict=None)


def test_second_save_with_two_slots_does_not_wait_for_first_write(ckpt_dir, gate):
    v = tf.Variable(np.zeros(1000, np.float32))
    gate.open.clear()
    with gate.Checkpoint(v=v, async_options=AsyncOptions(num_slots=2)) as ckpt:
        ckpt.save(str(ckpt_dir / "ckpt"))
        first = ckpt.last_save
        assert gate.entered.acquire(timeout=30)
        v.assign_add(np.ones(1000, np.float32))
        ckpt.save(str(ckpt_dir / "ckpt"))  # returns although the first write is blocked
        second = ckpt.last_save
        assert second.staged.done()
        assert not first.done()
        gate.open.set()
        assert second.result(60).slot_wait_s >= 0
        assert first.result(60).label == "ckpt-1"
    for n, value in ((1, 0.0), (2, 1.0)):
        restore_both(str(ckpt_dir / f"ckpt-{n}"),
                     lambda: {"v": tf.Variable(np.full(1000, -1.0, np.float32))},
                     lambda o, value=value: np.testing.assert_array_equal(
                         o["v"].numpy(), np.full(1000, value, np.float32)), verdict=None)


def test_one_slot_makes_the_second_save_wait_for_the_first_write(ckpt_dir, gate):
    v = tf.Variable(np.zeros(10, np.float32))
    gate.open.clear()
    ckpt = gate.Checkpoint(v=v, async_options=AsyncOptions(num_slots=1, max_slots=1))
    ckpt.save(str(ckpt_dir / "ckpt"))
    assert gate.entered.acquire(timeout=30)
    returned = threading.Event()
    t = threading.Thread(target=lambda: (ckpt.save(str(ckpt_dir / "ckpt")), returned.set()))
    t.start()
    assert not returned.wait(0.5)  # still blocked behind the only slot
    gate.open.set()
    t.join(60)
    assert returned.is_set()
    ckpt.close()
    assert ckpt.engine.history[-1].slot_wait_s > 0


def test_a_burst_deeper_than_the_slots_gets_a_spare_slot_and_saves_exact_values(
    ckpt_dir, gate
):
    v = tf.Variable(np.zeros((64, 1000), np.float32))
    w = tf.Variable(np.arange(7, dtype=np.int64))
    gate.open.clear()
    options = AsyncOptions(num_slots=1, max_slots=2)
    with gate.Checkpoint(v=v, w=w, async_options=options) as ckpt:
        ckpt.save(str(ckpt_dir / "ckpt"))
        assert gate.entered.acquire(timeout=30)  # the only slot stays in flight
        v.assign_add(np.ones((64, 1000), np.float32))
        w.assign_add(np.ones(7, np.int64))
        # Finds no free slot: it can only have the spare the pool builds meanwhile.
        ckpt.save(str(ckpt_dir / "ckpt"))
        assert ckpt.engine._pool.num_slots == 2
        v.assign_add(np.ones((64, 1000), np.float32))
        w.assign_add(np.ones(7, np.int64))
        # At the cap: the third waits for a write, as with fixed slots.
        returned = threading.Event()
        t = threading.Thread(target=lambda: (ckpt.save(str(ckpt_dir / "ckpt")), returned.set()))
        t.start()
        assert not returned.wait(0.5)
        gate.open.set()
        t.join(60)
        assert returned.is_set()
        for _ in range(3):  # a second burst, written at once
            v.assign_add(np.ones((64, 1000), np.float32))
            w.assign_add(np.ones(7, np.int64))
            ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
        assert ckpt.engine._pool.num_slots == 2
    for n in range(1, 7):
        def check(o, n=n):
            np.testing.assert_array_equal(o["v"].numpy(),
                                          np.full((64, 1000), n - 1.0, np.float32))
            np.testing.assert_array_equal(o["w"].numpy(), np.arange(7) + n - 1)

        restore_both(str(ckpt_dir / f"ckpt-{n}"),
                     lambda: {"v": tf.Variable(np.full((64, 1000), -1.0, np.float32)),
                              "w": tf.Variable(np.zeros(7, np.int64))}, check, verdict=None)


class _BrokenDisk(TFSaveJob):
    """The real format writer, on a disk where every write fails."""

    def write_bundle(self, prefix, state):
        raise OSError(errno.EIO, "Input/output error", prefix)


def test_a_save_refused_for_an_earlier_failure_is_not_counted(ckpt_dir):
    """The failure itself reaching the next call, once, is a behaviour of every front
    end (tests/behaviour/test_failures.py); the count is TensorFlow's."""

    class Ckpt(at.Checkpoint):
        _job_class = _BrokenDisk

    ckpt = Ckpt(v=tf.Variable([1.0]))
    ckpt.save(str(ckpt_dir / "ckpt"))
    ckpt.last_save.committed.exception(60)
    with pytest.raises(OSError):
        ckpt.save(str(ckpt_dir / "ckpt"))
    assert int(ckpt.save_counter.numpy()) == 1  # the refused save did not count
    ckpt.save(str(ckpt_dir / "ckpt"))
    assert int(ckpt.save_counter.numpy()) == 2
    with pytest.raises(OSError):
        ckpt.close()


def test_subprocess_that_saves_and_exits_at_once_leaves_complete_checkpoint(tmp_path):
    script = write_script(
        tmp_path,
        "save_and_exit.py",
        """
        import sys
        import numpy as np
        import tensorflow as tf
        import asyncckpt.tf as at
        from asyncckpt.tf._job import TFSaveJob

        class HeldWrite(TFSaveJob):
            def write_bundle(self, prefix, state):
                # A disk that answers only when the test says so: the test lets the
                # write go on once the interpreter is exiting, so the save is in
                # flight at exit for sure.
                sys.stdin.readline()
                return super().write_bundle(prefix, state)

        class Ckpt(at.Checkpoint):
            _job_class = HeldWrite

        v = tf.Variable(np.arange(4 << 20, dtype=np.float32))  # 16 MiB
        ckpt = Ckpt(v=v)
        print(ckpt.save(sys.argv[1]), flush=True)
        # no sync, no close: the interpreter exits right away
        """,
    )
    proc = start_python(script, str(tmp_path / "out" / "ckpt"), stdin=True)
    out, err = LineWatcher(proc.stdout), LineWatcher(proc.stderr)
    try:
        path = out.wait_for(lambda line: "ckpt" in line)  # save() returned
        # The exit flush says what it does, and waits: the save is in flight at exit.
        err.wait_for("in-flight checkpoint")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(120) == 0, err.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    at.verify_checkpoint(path)
    restore_both(path, lambda: {"v": tf.Variable(tf.zeros(4 << 20))},
                 lambda o: np.testing.assert_array_equal(
                     o["v"].numpy(), np.arange(4 << 20, dtype=np.float32)))


def test_non_trackable_object_is_refused_at_construction():
    with pytest.raises(ValueError, match="trackable"):
        at.Checkpoint(x=5)


def test_directory_that_cannot_be_written_fails_the_save_call(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    ckpt = at.Checkpoint(v=tf.Variable(1.0))
    with pytest.raises(OSError, match="cannot write checkpoints into"):
        ckpt.save(str(blocker / "sub" / "ckpt"))
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(PermissionError, match="cannot write checkpoints into"):
            ckpt.save(str(ro / "ckpt"))
    ckpt.close()


def test_restoring_a_missing_path_is_a_clear_error(ckpt_dir):
    ckpt = at.Checkpoint(v=tf.Variable(1.0))
    with pytest.raises(CheckpointNotFoundError, match="no TensorFlow checkpoint"):
        ckpt.restore(str(ckpt_dir / "nope-3"))
    with pytest.raises(FileNotFoundError):
        ckpt.read(str(ckpt_dir / "nope-3"))
    ckpt.close()


def test_writing_a_prefix_again_replaces_the_checkpoint(ckpt_dir):
    """Kill-safety of writing again (the old checkpoint kept until the new index is in
    place) is tested in test_engine_publish.py."""
    v = tf.Variable(tf.zeros(100))
    prefix = str(ckpt_dir / "same")
    with at.Checkpoint(v=v) as ckpt:
        for value in (1.0, 2.0):
            v.assign(tf.fill([100], value))
            ckpt.write(prefix)
            ckpt.sync()
    assert at.verify_checkpoint(prefix)
    restore_both(prefix, lambda: {"v": tf.Variable(tf.zeros(100))},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), np.full(100, 2.0)),
                 method="read", verdict="expect_partial")
    assert not _temps(ckpt_dir)


def test_state_file_failure_after_publish_is_not_a_failed_save(tmp_path):
    """Publishing is the line: what ``save()`` does after it (the state file) cannot
    fail the save."""
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)  # the state file cannot be written
    ckpt = at.Checkpoint(v=tf.Variable(tf.range(100, dtype=tf.float32)))
    path = ckpt.save(str(run / "ckpt"))
    ckpt.sync()  # the checkpoint is published: no error
    stats = ckpt.last_save.result(30)
    assert "IsADirectoryError" in stats.post_commit_error
    assert ckpt.engine.post_commit_errors == 1
    assert at.verify_checkpoint(path)
    restore_both(path, lambda: {"v": tf.Variable(tf.zeros(100))},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), np.arange(100)),
                 verdict="expect_partial")
    ckpt.close()


def test_only_asyncckpts_own_checkpoints_need_a_manifest(tmp_path):
    """A missing manifest on asyncckpt's checkpoint is corruption, and the manager falls
    back (tests/behaviour/test_durability.py); other checkpoints are accepted unverified."""
    v = tf.Variable(tf.zeros(100))
    with at.CheckpointManager(at.Checkpoint(v=v), str(tmp_path / "run"), max_to_keep=3) as mgr:
        for step in (1, 2):
            v.assign(tf.fill([100], float(step)))
            mgr.save()
        mgr.sync()
        newest = mgr.latest_checkpoint
        os.unlink(newest + ".asyncckpt-manifest.json")
        older = mgr.newest_valid_checkpoint()
        assert older is not None and older != newest
    # A checkpoint plain TensorFlow wrote has no manifest and is accepted unverified.
    plain = tf.train.Checkpoint(v=tf.Variable(tf.ones(100))).write(str(tmp_path / "plain" / "c"))
    assert at.verify_checkpoint(plain) is False
    # Plain TensorFlow writing over one of asyncckpt's prefixes: no longer claimed.
    tf.train.Checkpoint(v=tf.Variable(tf.ones(7))).write(newest)
    assert at.verify_checkpoint(newest) is False


def test_save_stats_are_recorded(ckpt_dir):
    v = tf.Variable(np.ones(1 << 18, np.float32))
    with at.Checkpoint(v=v) as ckpt:
        ckpt.save(str(ckpt_dir / "ckpt"))
        stats = ckpt.last_save.result(60)
        assert stats.nbytes >= v.numpy().nbytes
        assert stats.blocking_s > 0 and stats.write_s > 0 and stats.commit_s > 0
        assert stats.durable_s >= stats.write_s
        assert ckpt.engine.estimated_write_s == pytest.approx(stats.background_s)


def test_graph_changes_between_saves_are_picked_up(ckpt_dir):
    module = tf.Module()
    module.layers = [tf.Variable([1.0])]
    with at.Checkpoint(root=module) as ckpt:
        for i in range(3):  # the later saves reuse the staging plan
            module.layers[0].assign([float(i)])
            ckpt.save(str(ckpt_dir / "ckpt"))
        module.layers.append(tf.Variable([5.0, 6.0]))  # the graph grows: new plan
        last = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    def make():
        fresh = tf.Module()
        fresh.layers = [tf.Variable([0.0]), tf.Variable([0.0, 0.0])]
        return {"root": fresh}

    def check(o):
        assert o["root"].layers[0].numpy().tolist() == [2.0]
        assert o["root"].layers[1].numpy().tolist() == [5.0, 6.0]

    restore_both(last, make, check)

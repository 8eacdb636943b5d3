"""Background host copies (``AsyncOptions(background_copy=True)``): the read is the snapshot.

Every test holds the background copy at a gate (a subclass of the real copy
worker), changes the state through one kind of TensorFlow update while the
save still holds only its reads, then lets the copy run and checks the files
against a synchronous ``tf.train.Checkpoint`` written at the save call.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt import AsyncOptions  # noqa: E402
from asyncckpt.tf import _compat, _copy, _snapshot  # noqa: E402
from tests.helpers import run_python, write_script  # noqa: E402
from tests.tfrestore import contents  # noqa: E402

BACKGROUND = AsyncOptions(background_copy=True)


class _GatedWorker(_copy._Worker):
    """The real copy worker, except that each copy waits for the test's gate."""

    def __init__(self):
        self.gate = threading.Event()
        self.submitted: list[_copy.DeferredCopy] = []
        super().__init__()

    def submit(self, copy):
        if copy is not None:
            self.submitted.append(copy)
        super().submit(copy)

    @contextlib.contextmanager
    def opened_at_exit(self):
        """Opens the gate when the block ends, so a failing test never waits on it."""
        try:
            yield
        finally:
            self.gate.set()

    def _loop(self):
        while True:
            copy = self._queue.get()
            if copy is None:
                return
            assert self.gate.wait(120), "test never opened the gate"
            copy.run()
            del copy


@pytest.fixture
def gated(monkeypatch):
    worker = _GatedWorker()
    monkeypatch.setattr(_copy, "_the_worker", worker)
    yield worker
    worker.gate.set()
    worker.submit(None)


def _address(variable) -> int:
    """Where the variable's buffer is now (the read shares it; dropped at once)."""
    read = _compat.read_variable(variable)
    return read._numpy().ctypes.data


def _reference(ckpt_dir, objects: dict) -> dict[str, np.ndarray]:
    """What a synchronous TensorFlow save writes now, by checkpoint key."""
    path = tf.train.Checkpoint(**objects).write(str(ckpt_dir / "reference"))
    return _contents(path)


def _contents(path: str) -> dict[str, np.ndarray]:
    return contents(path)  # read by TensorFlow's reader and asyncckpt's, which agree


def _assert_same(expected: dict, got: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def _differs(a: dict, b: dict) -> bool:
    return any(not np.array_equal(a[k], b[k]) for k in a)


def _save_update_check(ckpt_dir, gated, objects: dict, update) -> None:
    """Saves, runs ``update`` before the background copy, checks the saved values."""
    expected = _reference(ckpt_dir, objects)
    with at.Checkpoint(async_options=BACKGROUND, **objects) as ckpt, gated.opened_at_exit():
        path = ckpt.write(str(ckpt_dir / "ckpt"))
        copy = gated.submitted[-1]
        assert copy.pending > 0  # the save holds its reads; nothing is copied yet
        update()
        assert copy.pending > 0
        after = _contents(tf.train.Checkpoint(**objects).write(str(ckpt_dir / "after")))
        assert _differs(expected, after), "the update changed nothing: the test proves nothing"
        gated.gate.set()
        ckpt.sync()
        assert copy.pending == 0
    _assert_same(expected, _contents(path))


def _float_variables(n: int, rows: int = 64) -> dict[str, tf.Variable]:
    rng = np.random.default_rng(n)
    return {f"v{i}": tf.Variable(rng.standard_normal((rows, 8)).astype(np.float32))
            for i in range(n)}


# Few variables are read one eager op each, many by one traced function.
@pytest.mark.parametrize("n", [3, 40])
def test_assign_and_assign_add_after_the_save(ckpt_dir, gated, n):
    variables = _float_variables(n)

    def update():
        for i, v in enumerate(variables.values()):
            if i % 2:
                v.assign(v * 2.0 + 1.0)
            else:
                v.assign_add(tf.ones_like(v))

    _save_update_check(ckpt_dir, gated, variables, update)


def test_the_snapshot_is_shared_until_copied_then_released(ckpt_dir, gated):
    """Copy-on-write is what keeps the save exact: seen at the buffer's address."""
    v = tf.Variable(np.zeros((256, 64), np.float32))
    one = tf.ones((256, 64))
    v.assign_add(one)  # from here on the variable owns its buffer (not its initial value's)
    before = _address(v)
    v.assign_add(one)
    assert _address(v) == before  # unshared: updated in place
    with at.Checkpoint(async_options=BACKGROUND, v=v) as ckpt, gated.opened_at_exit():
        ckpt.write(str(ckpt_dir / "ckpt"))
        v.assign_add(one)
        moved = _address(v)
        assert moved != before  # shared with the save: TensorFlow wrote a copy
        gated.gate.set()
        ckpt.sync()
        v.assign_add(one)
        assert _address(v) == moved  # the save let go of its read
    np.testing.assert_array_equal(_contents(str(ckpt_dir / "ckpt"))["v/.ATTRIBUTES/VARIABLE_VALUE"],
                                  np.full((256, 64), 2, np.float32))


def test_keras_optimizer_step_after_the_save(ckpt_dir, gated):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.01)
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    step()  # builds the optimizer's slots
    _save_update_check(ckpt_dir, gated, {"model": model, "optimizer": optimizer}, step)


def test_xla_compiled_step_after_the_save(ckpt_dir, gated):
    variables = _float_variables(4)
    mix = tf.constant(np.eye(8, dtype=np.float32) * 0.5)

    @tf.function(jit_compile=True)
    def step():
        for v in variables.values():
            v.assign_add(tf.matmul(v, mix))
            v.assign(v * 3.0)

    step()  # compiled; XLA updates unshared variables in place
    _save_update_check(ckpt_dir, gated, variables, step)


@pytest.mark.parametrize("sparse_before", [False, True], ids=["dense", "copy-on-read"])
@pytest.mark.parametrize("n", [3, 40])
def test_scatter_and_sparse_updates_after_the_save(ckpt_dir, gated, sparse_before, n):
    variables = _float_variables(n)
    first = variables["v0"]
    if sparse_before:  # a sparsely updated variable reads by copy (copy-on-read mode)
        first.scatter_add(tf.IndexedSlices(tf.ones((1, 8)), tf.constant([3])))
    table = keras.layers.Embedding(100, 8)
    table.build((None,))
    optimizer = keras.optimizers.SGD(0.5)
    ids = tf.constant([1, 5, 5, 9])

    def update():
        first.scatter_update(tf.IndexedSlices(tf.fill((2, 8), 7.0), tf.constant([0, 2])))
        variables["v1"].scatter_add(tf.IndexedSlices(tf.ones((1, 8)), tf.constant([1])))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(table(ids))
        grads = tape.gradient(loss, table.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)  # a sparse update
        optimizer.apply_gradients(zip(grads, table.trainable_variables, strict=True))

    with tf.GradientTape() as tape:  # builds the optimizer
        loss = tf.reduce_sum(table(ids))
    optimizer.apply_gradients(zip(tape.gradient(loss, table.trainable_variables),
                                  table.trainable_variables, strict=True))
    _save_update_check(ckpt_dir, gated, {**variables, "table": table, "opt": optimizer}, update)


def test_small_and_odd_dtypes_after_the_save(ckpt_dir, gated):
    objects = {
        "flag": tf.Variable(True),
        "count": tf.Variable(np.int64(7)),
        "bytes": tf.Variable(np.array([1, -2, 3], np.int8)),
        "half": tf.Variable(np.array([0.5, 1.5, -2.0], np.float16)),
        "bf16": tf.Variable(tf.constant([1.0, 2.0], tf.bfloat16)),
        "name": tf.Variable("before"),
        "big": tf.Variable(np.arange(4096, dtype=np.float32)),
    }

    def update():
        objects["flag"].assign(False)
        objects["count"].assign_add(5)
        objects["bytes"].assign_add(tf.constant([1, 1, 1], tf.int8))
        objects["half"].assign(objects["half"] * 2)
        objects["bf16"].assign_add(tf.constant([1.0, 1.0], tf.bfloat16))
        objects["name"].assign("after")
        objects["big"].assign_add(tf.ones(4096))

    _save_update_check(ckpt_dir, gated, objects, update)


def test_lookup_tables_after_the_save(ckpt_dir, gated):
    """Lookup tables are copied at the save call, variables still in the background.

    A DenseHashTable exports its bucket arrays themselves, which the next
    insert overwrites in place: no copy-on-write protects them.
    """
    dense = tf.lookup.experimental.DenseHashTable(
        tf.int64, tf.float32, default_value=-1.0, empty_key=-1, deleted_key=-2)
    dense.insert(tf.range(100, dtype=tf.int64), tf.ones(100))
    mutable = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, default_value=-1.0)
    mutable.insert(tf.range(100, dtype=tf.int64), tf.ones(100))
    objects = {"dense": dense, "mutable": mutable, "v": tf.Variable(np.arange(64.0))}

    def update():
        dense.insert(tf.range(100, dtype=tf.int64), tf.fill([100], 5.0))
        mutable.insert(tf.range(100, dtype=tf.int64), tf.fill([100], 5.0))
        objects["v"].assign_add(tf.ones(64, tf.float64))

    _save_update_check(ckpt_dir, gated, objects, update)


class _InjectedCopyError(OSError):
    pass


def test_a_failed_background_copy_is_raised_and_releases_the_reads(ckpt_dir, gated,
                                                                   monkeypatch):
    real = _copy._copy_group
    calls = []

    def failing(group):  # wraps the real copy: the first group fails
        calls.append(len(group))
        if len(calls) == 1:
            raise _InjectedCopyError("injected copy failure")
        real(group)

    monkeypatch.setattr(_copy, "_copy_group", failing)
    v = tf.Variable(np.zeros((1024, 64), np.float32))
    one = tf.ones((1024, 64))
    v.assign_add(one)  # the variable owns its buffer (not its initial value's)
    with at.Checkpoint(async_options=BACKGROUND, v=v) as ckpt, gated.opened_at_exit():
        ckpt.write(str(ckpt_dir / "bad"))
        copy = gated.submitted[-1]
        gated.gate.set()
        with pytest.raises(_InjectedCopyError, match="injected"):
            ckpt.sync()
        assert copy.pending == 0
        where = _address(v)
        v.assign_add(one)
        assert _address(v) == where  # nothing shares the buffer any more
        assert not os.path.exists(str(ckpt_dir / "bad.index"))
        assert not [n for n in os.listdir(ckpt_dir) if n.startswith(".asyncckpt-tmp-")]
        path = ckpt.write(str(ckpt_dir / "good"))  # the engine keeps working
        ckpt.sync()
    np.testing.assert_array_equal(_contents(path)["v/.ATTRIBUTES/VARIABLE_VALUE"], v.numpy())


def test_the_bundle_is_written_while_the_background_copy_still_runs(ckpt_dir, monkeypatch):
    """Each range of the data file is written once the copy has reached it.

    4 variables of 4 MiB: two copy groups of 8 MiB. The real copy of the
    second group waits until a range of the data file has been written (the
    real write, recorded); a writer that waited for the whole copy first
    never writes one then, and the checks below fail after 20 s.
    """
    from asyncckpt._engine import datafile

    real_copy, real_range = _copy._copy_group, datafile._run_range
    copied: list[int] = []  # each group copied, by its tensor count
    written_between = threading.Event()

    def copy_group(group):
        if copied:  # the second group: after a range of the first is written
            written_between.wait(20)
        real_copy(group)
        copied.append(len(group))

    def run_range(fd, r, *args):
        if len(copied) == 1:
            written_between.set()
        return real_range(fd, r, *args)

    monkeypatch.setattr(_copy, "_copy_group", copy_group)
    monkeypatch.setattr(datafile, "_run_range", run_range)
    objects = {f"v{i}": tf.Variable(np.full(1 << 20, i, np.float32)) for i in range(4)}
    for v in objects.values():
        v.assign_add(tf.ones_like(v))  # each variable owns its buffer
    expected = _reference(ckpt_dir, objects)
    with at.Checkpoint(async_options=BACKGROUND, **objects) as ckpt:
        path = ckpt.write(str(ckpt_dir / "overlapped"))
        for v in objects.values():  # after the save call: not in the checkpoint
            v.assign_add(tf.ones_like(v))
        ckpt.sync()
    assert written_between.is_set()
    assert copied == [2, 2]
    _assert_same(expected, _contents(path))


class _RecordedCopy(_copy.DeferredCopy):
    """The real deferred copy, remembered by the test."""

    made: list[_copy.DeferredCopy] = []

    def __init__(self, pairs):
        super().__init__(pairs)
        self.made.append(self)


def test_a_save_that_fails_after_staging_cancels_its_copy_before_freeing_the_slot(
        ckpt_dir, gated, monkeypatch):
    monkeypatch.setattr(_snapshot, "DeferredCopy", _RecordedCopy)
    v = tf.Variable(np.ones((512, 64), np.float32))
    with at.Checkpoint(async_options=BACKGROUND, v=v) as ckpt, gated.opened_at_exit():
        ckpt.write(str(ckpt_dir / "first"))
        gated.gate.set()
        ckpt.sync()
        gated.gate.clear()
        pool = ckpt.engine._pool
        real_learn = pool.learn

        def failing_learn(slot):  # wraps the real pool: fails right after staging
            raise MemoryError("injected after staging")

        pool.learn = failing_learn
        try:
            with pytest.raises(MemoryError, match="injected"):
                ckpt.write(str(ckpt_dir / "second"))
        finally:
            pool.learn = real_learn
        copy = _RecordedCopy.made[-1]
        assert copy not in gated.submitted  # never started: the slot is not written to
        assert copy.pending == 0 and copy._future.cancelled()
        gated.gate.set()
        v.assign_add(tf.ones_like(v))
        path = ckpt.write(str(ckpt_dir / "third"))
        ckpt.sync()
    assert not os.path.exists(str(ckpt_dir / "second.index"))
    np.testing.assert_array_equal(_contents(path)["v/.ATTRIBUTES/VARIABLE_VALUE"], v.numpy())


_EXIT_BACKGROUND = """
import sys, threading
import numpy as np
import tensorflow as tf
import asyncckpt.tf as atf
from asyncckpt import AsyncOptions
from asyncckpt.tf import _copy

class AfterMainWorker(_copy._Worker):
    # Copies only once the main thread has finished: the exit flush waits for it.
    def _loop(self):
        threading.main_thread().join()
        print("copying after the main thread finished", flush=True)
        super()._loop()

_copy._the_worker = AfterMainWorker()
v = tf.Variable(np.arange(6 << 20, dtype=np.float32))  # 24 MiB: copied in pieces
ckpt = atf.Checkpoint(v=v, async_options=AsyncOptions(background_copy=True))
print("saved", ckpt.save(sys.argv[1]), flush=True)
v.assign_add(tf.ones_like(v))
# No sync(), no close(): the main thread ends here.
"""


def test_exit_flush_completes_a_background_copy_after_the_main_thread_ends(tmp_path):
    script = write_script(tmp_path, "exit_background.py", _EXIT_BACKGROUND)
    proc = run_python(script, str(tmp_path / "run" / "ckpt"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "copying after the main thread finished" in proc.stdout
    saved = _contents(str(tmp_path / "run" / "ckpt-1"))["v/.ATTRIBUTES/VARIABLE_VALUE"]
    np.testing.assert_array_equal(saved, np.arange(6 << 20, dtype=np.float32))

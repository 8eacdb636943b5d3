"""``tf.data`` iterators in asyncckpt's TensorFlow checkpoints: every kind through every trip.

An iterator's state is serialized at the save call (TensorFlow's
``SerializeIterator``, as ``tf.train.Checkpoint`` runs it) and written by
asyncckpt's own bundle writer in the background. Each (kind, trip) is its own
test: the restored iterator must go on exactly where the saved one was, with
asyncckpt's reader and with TensorFlow's.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt._engine import fastcrc  # noqa: E402
from asyncckpt.tf import _bundle, _job  # noqa: E402
from asyncckpt.tf._variant import CapturedVariant  # noqa: E402
from tests.conftest import TF_LOGICAL_CPUS  # noqa: E402

pytestmark = pytest.mark.skipif(not fastcrc.available(), reason="no native CRC32C")

KEY = "it/.ATTRIBUTES/ITERATOR_STATE"


def _still(ds: tf.data.Dataset) -> tf.data.Dataset:
    """The pipeline without the prefetch tf.data injects at its end by default.

    That prefetch fills its buffer on a background thread, so the state (the
    buffered elements) changes between two saves of an iterator nobody
    advanced; without it, two saves of the same iterator are the same bytes.
    """
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    return ds.with_options(options)


# kind -> (dataset factory, elements taken before the save; None: all of them)
KINDS = {
    "plain": (lambda: _still(tf.data.Dataset.range(24)), 5),
    "unstarted": (lambda: _still(tf.data.Dataset.range(12).batch(5)), 0),
    "shuffle_repeat_batch": (
        lambda: _still(tf.data.Dataset.range(30).shuffle(8, seed=4).repeat(2).batch(4)), 3),
    # Into the second epoch of a reshuffling pipeline: the seed generator's state counts.
    "mid_epoch": (lambda: _still(tf.data.Dataset.range(10).shuffle(10, seed=7).repeat(3)), 14),
    # tf.data's defaults, an injected prefetch included, and threads of its own.
    "prefetch": (lambda: tf.data.Dataset.range(40).map(
        lambda x: x * 3, num_parallel_calls=2).batch(3).prefetch(4), 4),
    "exhausted": (lambda: _still(tf.data.Dataset.range(6)), None),
}
# Pipelines without background threads: their state does not change between two saves.
STILL = ["plain", "unstarted", "shuffle_repeat_batch", "mid_epoch", "exhausted"]
READERS = {"asyncckpt": at.Checkpoint, "tensorflow": tf.train.Checkpoint}


def _reference(kind: str) -> list[np.ndarray]:
    return [e.numpy() for e in iter(KINDS[kind][0]())]


def _advanced(kind: str):
    """An iterator of the kind, advanced as the kind says, and what it yields from there."""
    factory, k = KINDS[kind]
    ref = _reference(kind)
    k = len(ref) if k is None else k
    it = iter(factory())
    for _ in range(k):
        next(it)
    return it, ref[k:]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _rest(it) -> list[np.ndarray]:
    return [e.numpy() for e in it]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _restore_rest(kind: str, path: str, reader: str, method: str = "restore",
                  step: int | None = None) -> list[np.ndarray]:
    """What a fresh iterator yields after ``reader`` restored ``path`` into it (all consumed)."""
    it = iter(KINDS[kind][0]())
    counter = tf.Variable(-1, dtype=tf.int64)
    ckpt = READERS[reader](it=it, step=counter)
    getattr(ckpt, method)(path).assert_consumed()
    if isinstance(ckpt, at.Checkpoint):
        ckpt.close()
    if step is not None:
        assert int(counter.numpy()) == step
    return _rest(it)


def _assert_both_readers(kind: str, path: str, expected, method: str = "restore",
                         step: int | None = None) -> None:
    for reader in READERS:
        got = _restore_rest(kind, path, reader, method, step)
        assert _same(got, expected), f"{reader} restored another position"


def _own_writer_spy(reference: str | None = None) -> tuple[type, list]:
    """A Checkpoint class whose saves record what their bundle writer returned.

    Non-empty: the checksums of asyncckpt's own writer; empty: TensorFlow's
    ``SaveV2`` wrote the files. With ``reference``, the very state each save
    captured is also written there by ``SaveV2``.
    """
    calls: list = []

    class Spied(_job.TFSaveJob):  # the real format writer, recorded
        def write_bundle(self, prefix, state):
            if reference is not None:
                _job.save_v2_bundle(reference, state)
            calls.append(super().write_bundle(prefix, state))
            return calls[-1]

    return type("SpiedCheckpoint", (at.Checkpoint,), {"_job_class": Spied}), calls


# --- the trips -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_asyncckpt_save_then_asyncckpt_restore(ckpt_dir, kind):
    spied, calls = _own_writer_spy()
    it, expected = _advanced(kind)
    with spied(it=it, step=tf.Variable(7, dtype=tf.int64)) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
        stats = ckpt.last_save.result()
    assert calls and all(calls)  # written by asyncckpt's own writer
    at.verify_checkpoint(path)
    entry = _bundle.parse_index(_read(path + ".index")).entries[KEY]
    assert entry.dtype == tf.variant.as_datatype_enum
    assert stats.nbytes >= entry.size  # the encoded state is counted
    assert _same(_restore_rest(kind, path, "asyncckpt", step=7), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_asyncckpt_save_then_tensorflow_restore(ckpt_dir, kind):
    it, expected = _advanced(kind)
    with at.Checkpoint(it=it, step=tf.Variable(7, dtype=tf.int64)) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    assert _same(_restore_rest(kind, path, "tensorflow", step=7), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_tensorflow_save_then_asyncckpt_restore(ckpt_dir, kind):
    it, expected = _advanced(kind)
    path = tf.train.Checkpoint(it=it, step=tf.Variable(7, dtype=tf.int64)).save(
        str(ckpt_dir / "ckpt"))
    assert _same(_restore_rest(kind, path, "asyncckpt", step=7), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_through_the_manager(ckpt_dir, kind):
    it, expected = _advanced(kind)
    step = tf.Variable(0, dtype=tf.int64)
    manager = at.CheckpointManager(at.Checkpoint(it=it, step=step), str(ckpt_dir),
                                   max_to_keep=2)
    first = manager.save()
    later = expected[2:]
    for _ in range(min(2, len(expected))):  # the second save is two elements on
        next(it)
    step.assign(1)
    second = manager.save()  # the kept plan serializes the iterator again
    manager.close()
    assert manager.checkpoints == [first, second]
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == second
    _assert_both_readers(kind, first, expected, step=0)
    _assert_both_readers(kind, second, later, step=1)


@pytest.mark.parametrize("kind", KINDS)
def test_write_then_read(ckpt_dir, kind):
    it, expected = _advanced(kind)
    with at.Checkpoint(it=it, step=tf.Variable(3, dtype=tf.int64)) as ckpt:
        path = ckpt.write(str(ckpt_dir / "written"))
        ckpt.sync()
    _assert_both_readers(kind, path, expected, method="read", step=3)


@pytest.mark.parametrize("kind", KINDS)
def test_advanced_right_after_save_returns(ckpt_dir, gate, kind):
    it, expected = _advanced(kind)
    step = tf.Variable(5, dtype=tf.int64)
    with gate.Checkpoint(it=it, step=step) as ckpt:
        gate.open.clear()  # the write waits until the iterator has run on
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        assert gate.entered.acquire(timeout=60)
        assert _same(_rest(it), expected)  # drained while the save is in flight
        step.assign(99)
        gate.open.set()
        ckpt.sync()
    _assert_both_readers(kind, path, expected, step=5)


def test_prepare_then_save_saves_the_position_at_the_save(ckpt_dir):
    """``prepare()`` builds the kept plan; the save still serializes the iterator anew."""
    it, expected = _advanced("mid_epoch")
    step = tf.Variable(6, dtype=tf.int64)
    manager = at.CheckpointManager(at.Checkpoint(it=it, step=step), str(ckpt_dir), max_to_keep=1)
    manager.prepare()
    for _ in range(3):
        next(it)
    path = manager.save()
    manager.close()
    _assert_both_readers("mid_epoch", path, expected[3:], step=6)


def _verdicts(path: str, kind: str) -> dict:
    """Each reader's verdicts on ``path``: everything restored, and the iterator alone."""
    out = {}
    for reader, cls in READERS.items():
        it = iter(KINDS[kind][0]())
        status = cls(it=it, step=tf.Variable(0, dtype=tf.int64)).restore(path)
        status.assert_consumed()
        out[reader, "all"] = "consumed"
        it = iter(KINDS[kind][0]())
        status = cls(it=it).restore(path)
        try:
            status.assert_consumed()
            out[reader, "iterator"] = "consumed"
        except AssertionError:
            out[reader, "iterator"] = "not consumed"
        status.expect_partial()
        status.assert_existing_objects_matched()
        out[reader, "iterator", "rest"] = len(_rest(it))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_assert_consumed_and_expect_partial_verdicts_equal_tensorflows(ckpt_dir, kind):
    it, expected = _advanced(kind)
    step = tf.Variable(4, dtype=tf.int64)
    with at.Checkpoint(it=it, step=step) as ckpt:
        ours = ckpt.save(str(ckpt_dir / "ours"))
        ckpt.sync()
    theirs = tf.train.Checkpoint(it=it, step=step).save(str(ckpt_dir / "theirs"))
    verdicts = _verdicts(ours, kind)
    assert verdicts == _verdicts(theirs, kind)
    assert verdicts["tensorflow", "iterator"] == "not consumed"  # the step was left out
    assert verdicts["asyncckpt", "iterator", "rest"] == len(expected)


@pytest.mark.parametrize("kind", KINDS)
def test_files_are_byte_identical_to_savev2s_of_the_same_state(ckpt_dir, kind):
    """The very state a save captured, written by SaveV2 beside asyncckpt's writer."""
    spied, calls = _own_writer_spy(reference=str(ckpt_dir / "ref"))
    it, _ = _advanced(kind)
    with spied(it=it) as ckpt:
        path = ckpt.write(str(ckpt_dir / "ours"))
        ckpt.sync()
    assert calls and calls[-1]
    for suffix in (".index", ".data-00000-of-00001"):
        assert _read(path + suffix) == _read(str(ckpt_dir / "ref") + suffix)


# --- beyond the matrix -----------------------------------------------------------------


@pytest.mark.parametrize("kind", STILL)
def test_files_are_byte_identical_to_tf_train_checkpoints(ckpt_dir, kind):
    it, _ = _advanced(kind)
    theirs = tf.train.Checkpoint(it=it).write(str(ckpt_dir / "theirs"))
    with at.Checkpoint(it=it) as ckpt:
        ours = ckpt.write(str(ckpt_dir / "ours"))
        ckpt.sync()
    for suffix in (".index", ".data-00000-of-00001"):
        assert _read(ours + suffix) == _read(theirs + suffix)


def test_the_state_is_serialized_on_the_calling_thread_and_encoded_by_the_writer(
        ckpt_dir, monkeypatch):
    """Serialization at the call, ``Variant::Encode`` later, off the calling thread."""
    caller = threading.get_ident()
    serialized, encoded = [], []
    from tensorflow.python.ops import gen_dataset_ops

    real_op = gen_dataset_ops.serialize_iterator

    def serialize_op(*args, **kwargs):
        serialized.append(threading.get_ident())
        return real_op(*args, **kwargs)

    real_elements = CapturedVariant.elements

    def elements(self):
        encoded.append(threading.get_ident())
        return real_elements(self)

    monkeypatch.setattr(gen_dataset_ops, "serialize_iterator", serialize_op)
    monkeypatch.setattr(CapturedVariant, "elements", elements)
    it, expected = _advanced("shuffle_repeat_batch")
    with at.Checkpoint(it=it, step=tf.Variable(2, dtype=tf.int64)) as ckpt:
        ckpt.save(str(ckpt_dir / "a"))
        assert serialized == [caller]
        next(it)
        path = ckpt.save(str(ckpt_dir / "b"))  # the kept plan serializes again, here
        assert serialized == [caller, caller]
        assert ckpt._asyncckpt.stager._plan is not None  # kept, holding no iterator state
        states = [e for e in ckpt._asyncckpt.stager._plan.entries if e.reread is not None]
        assert [e.key for e in states] == [KEY] and states[0].value is None
        ckpt.sync()
    assert len(encoded) == 2 and caller not in encoded
    _assert_both_readers("shuffle_repeat_batch", path, expected[1:], step=2)


def test_a_pipeline_tensorflow_cannot_serialize_fails_the_save_as_in_tensorflow(ckpt_dir):
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(range(5)), output_signature=tf.TensorSpec([], tf.int64))
    with pytest.raises(tf.errors.FailedPreconditionError) as theirs:
        tf.train.Checkpoint(it=iter(dataset)).write(str(ckpt_dir / "theirs"))
    ckpt = at.Checkpoint(it=iter(dataset), v=tf.Variable(1.0))
    with pytest.raises(tf.errors.FailedPreconditionError) as ours:
        ckpt.save(str(ckpt_dir / "ours"))  # at the call, not in the background
    assert "stateful" in str(ours.value) and "stateful" in str(theirs.value)
    assert int(ckpt.save_counter.numpy()) == 0
    assert not list(ckpt_dir.iterdir())
    ckpt.close()


def test_distributed_iterators_are_refused_as_by_tensorflow():
    """TensorFlow 2.21's ``DistributedIterator`` is not trackable: both refuse it alike."""
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(TF_LOGICAL_CPUS)])
    dist = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(16).batch(4)))
    errors = []
    for cls in READERS.values():
        with pytest.raises(ValueError, match="trackable") as e:
            cls(it=dist)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def _model_and_data():
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.05)
    x = np.random.default_rng(2).normal(size=(40, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(40, seed=5).batch(8).repeat()
    return model, optimizer, dataset


def _train(model, optimizer, it, steps: int) -> None:
    for _ in range(steps):
        x, y = next(it)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables, strict=True))


def test_training_resumes_exactly_with_model_optimizer_and_iterator(ckpt_dir):
    """A Keras model, its optimizer and ``iter(dataset)`` saved together, as fit-style loops do."""
    model, optimizer, dataset = _model_and_data()
    it = iter(dataset)
    _train(model, optimizer, it, 7)  # mid-epoch of the second epoch
    with at.Checkpoint(model=model, optimizer=optimizer, it=it) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        _train(model, optimizer, it, 6)  # right after save() returns
        ckpt.sync()
    final = [w.numpy() for w in model.weights]
    for cls in READERS.values():
        model2, optimizer2, dataset2 = _model_and_data()
        it2 = iter(dataset2)
        _train(model2, optimizer2, it2, 1)  # built, and at another position
        cls(model=model2, optimizer=optimizer2, it=it2).restore(path).assert_consumed()
        _train(model2, optimizer2, it2, 6)
        for a, b in zip(final, model2.weights, strict=True):
            np.testing.assert_allclose(b.numpy(), a, rtol=1e-6, atol=1e-7)

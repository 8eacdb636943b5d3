"""``tf.tpu.experimental.embedding.TPUEmbedding`` through every trip, and registered savers.

A ``TPUEmbedding`` has a registered TensorFlow saver (``tf.TPUEmbeddingCallback``)
whose save function calls the embedding's ``_retrieve_variables`` hook (TPU
memory to host variables) before anything is read, and whose restore function
calls ``_load_variables`` (host variables to TPU memory) after the restore.
asyncckpt calls that same registered save function at the save call, and
TensorFlow's restore (which asyncckpt's restore is) calls the restore function.

TensorFlow 2.21 builds a ``TPUEmbedding`` on CPU (outside a ``TPUStrategy``)
with plain host variables, where both hooks do nothing: kind ``cpu_placed``.
Kind ``device_resident`` is the real class with its tables' current values
kept apart from the host variables, as on a TPU, moved only by the two hooks
that TensorFlow's registered saver calls.
"""

from __future__ import annotations

import tempfile
import threading

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.saved_model import registration  # noqa: E402
from tensorflow.tpu.experimental.embedding import (  # noqa: E402
    SGD,
    Adagrad,
    FeatureConfig,
    TableConfig,
    TPUEmbedding,
)

import asyncckpt.tf as at  # noqa: E402
from asyncckpt.errors import UnsupportedObjectError  # noqa: E402

READERS = {"asyncckpt": at.Checkpoint, "tensorflow": tf.train.Checkpoint}


class DeviceResidentEmbedding(TPUEmbedding):
    """A ``TPUEmbedding`` whose tables live in a "device" dict beside the object.

    On a TPU, training updates the tables in TPU memory; ``_retrieve_variables``
    copies them into the host variables and ``_load_variables`` copies the host
    variables back. Here the dict stands for TPU memory; everything else is
    TensorFlow's class and its registered saver.
    """

    @property
    def device(self) -> dict:
        return self.__dict__.setdefault("_test_device", {})  # not checkpoint state

    @property
    def calls(self) -> list:
        return self.__dict__.setdefault("_test_calls", [])

    def _retrieve_variables(self):
        self.calls.append(("retrieve", threading.get_ident()))
        for table, slots in self._variables.items():
            for slot, var in slots.items():
                var.assign(self.device[table][slot])

    def _load_variables(self):
        self.calls.append(("load", threading.get_ident()))
        for table, slots in self._variables.items():
            for slot, var in slots.items():
                self.device.setdefault(table, {})[slot] = var.numpy()


KINDS = {"cpu_placed": TPUEmbedding, "device_resident": DeviceResidentEmbedding}


def _embedding(kind: str, seed: int):
    tables = [
        TableConfig(vocabulary_size=32, dim=4, name="users",
                    initializer=tf.initializers.RandomUniform(seed=seed)),
        TableConfig(vocabulary_size=16, dim=8, name="items",
                    initializer=tf.initializers.RandomUniform(seed=seed + 1)),
    ]
    optimizer = Adagrad(0.1) if kind == "device_resident" else SGD(0.1)
    emb = KINDS[kind](feature_config={t.name: FeatureConfig(table=t) for t in tables},
                      optimizer=optimizer)
    emb.build()
    if kind == "device_resident":
        emb._load_variables()  # the device starts as the host variables
        emb.calls.clear()
    return emb


def _host(emb) -> dict:
    return {(t, s): v.numpy() for t, slots in emb._variables.items() for s, v in slots.items()}


def _current(emb, kind: str) -> dict:
    """The embedding's tables as training sees them (on the device, if it has one)."""
    if kind == "device_resident":
        return {(t, s): np.array(a) for t, slots in emb.device.items() for s, a in slots.items()}
    return _host(emb)


def _train(emb, kind: str, value: float) -> dict:
    """Changes every table where training would (TPU memory, else the variables)."""
    for table, slots in emb._variables.items():
        for slot, var in slots.items():
            new = np.full(var.shape, value, np.float32) + np.arange(var.shape[-1])
            if kind == "device_resident":
                emb.device[table][slot] = new
            else:
                var.assign(new)
    return _current(emb, kind)


def _assert_restored(emb, kind: str, expected: dict) -> None:
    for key, value in expected.items():
        np.testing.assert_array_equal(_host(emb)[key], value)
    if kind == "device_resident":  # TensorFlow's restore function sent them to the "device"
        assert [c for c, _ in emb.calls] == ["load"]
        for key, value in expected.items():
            np.testing.assert_array_equal(_current(emb, kind)[key], value)


def _restore(kind: str, path: str, reader: str, expected: dict, method: str = "restore"):
    fresh = _embedding(kind, seed=40)
    ckpt = READERS[reader](embedding=fresh)
    getattr(ckpt, method)(path).assert_consumed()
    if isinstance(ckpt, at.Checkpoint):
        ckpt.close()
    _assert_restored(fresh, kind, expected)


def _restore_both(kind: str, path: str, expected: dict, method: str = "restore") -> None:
    for reader in READERS:
        _restore(kind, path, reader, expected, method)


@pytest.mark.parametrize("kind", KINDS)
def test_asyncckpt_save_then_asyncckpt_restore(ckpt_dir, kind):
    emb = _embedding(kind, seed=1)
    expected = _train(emb, kind, 2.0)
    with at.Checkpoint(embedding=emb) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        if kind == "device_resident":  # TensorFlow's hook ran at the call, on this thread
            assert emb.calls == [("retrieve", threading.get_ident())]
        ckpt.sync()
    at.verify_checkpoint(path)
    _restore(kind, path, "asyncckpt", expected)


@pytest.mark.parametrize("kind", KINDS)
def test_asyncckpt_save_then_tensorflow_restore(ckpt_dir, kind):
    emb = _embedding(kind, seed=1)
    expected = _train(emb, kind, 3.0)
    with at.Checkpoint(embedding=emb) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    _restore(kind, path, "tensorflow", expected)


@pytest.mark.parametrize("kind", KINDS)
def test_tensorflow_save_then_asyncckpt_restore(ckpt_dir, kind):
    emb = _embedding(kind, seed=1)
    expected = _train(emb, kind, 4.0)
    path = tf.train.Checkpoint(embedding=emb).save(str(ckpt_dir / "ckpt"))
    _restore(kind, path, "asyncckpt", expected)


@pytest.mark.parametrize("kind", KINDS)
def test_through_the_manager(ckpt_dir, kind):
    emb = _embedding(kind, seed=1)
    manager = at.CheckpointManager(at.Checkpoint(embedding=emb), str(ckpt_dir), max_to_keep=2)
    first_values = _train(emb, kind, 5.0)
    first = manager.save()
    second_values = _train(emb, kind, 6.0)
    second = manager.save()  # the kept plan runs the registered saver again
    manager.close()
    assert manager.checkpoints == [first, second]
    _restore_both(kind, first, first_values)
    _restore_both(kind, second, second_values)


def test_prepare_runs_no_retrieve_hook_and_the_save_runs_it(ckpt_dir):
    """``prepare()`` needs only the variables' sizes: no table leaves the "device" then."""
    emb = _embedding("device_resident", seed=1)
    manager = at.CheckpointManager(at.Checkpoint(embedding=emb), str(ckpt_dir), max_to_keep=1)
    manager.prepare()
    assert emb.calls == []
    expected = _train(emb, "device_resident", 6.5)
    path = manager.save()
    assert [c for c, _ in emb.calls] == ["retrieve"]
    manager.close()
    _restore_both("device_resident", path, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_write_then_read(ckpt_dir, kind):
    emb = _embedding(kind, seed=1)
    expected = _train(emb, kind, 7.0)
    with at.Checkpoint(embedding=emb) as ckpt:
        path = ckpt.write(str(ckpt_dir / "written"))
        ckpt.sync()
    _restore_both(kind, path, expected, method="read")


@pytest.mark.parametrize("kind", KINDS)
def test_trained_right_after_save_returns(ckpt_dir, gate, kind):
    emb = _embedding(kind, seed=1)
    expected = _train(emb, kind, 8.0)
    with gate.Checkpoint(embedding=emb) as ckpt:
        gate.open.clear()
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        assert gate.entered.acquire(timeout=60)
        _train(emb, kind, -1.0)  # on the device and, for the CPU kind, in the variables
        for slots in emb._variables.values():
            for var in slots.values():
                var.assign(tf.zeros_like(var))
        gate.open.set()
        ckpt.sync()
    _restore_both(kind, path, expected)


def _verdicts(kind: str, path: str) -> dict:
    out = {}
    for reader, cls in READERS.items():
        status = cls(embedding=_embedding(kind, seed=50),
                     extra=tf.Variable(0.0)).restore(path)
        status.assert_consumed()
        out[reader, "all"] = "consumed"
        status = cls(embedding=_embedding(kind, seed=50)).restore(path)
        try:
            status.assert_consumed()
            out[reader, "embedding"] = "consumed"
        except AssertionError:
            out[reader, "embedding"] = "not consumed"
        status.expect_partial()
        status.assert_existing_objects_matched()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_assert_consumed_and_expect_partial_verdicts_equal_tensorflows(ckpt_dir, kind):
    emb = _embedding(kind, seed=1)
    _train(emb, kind, 9.0)
    extra = tf.Variable(1.5)
    with at.Checkpoint(embedding=emb, extra=extra) as ckpt:
        ours = ckpt.save(str(ckpt_dir / "ours"))
        ckpt.sync()
    theirs = tf.train.Checkpoint(embedding=emb, extra=extra).save(str(ckpt_dir / "theirs"))
    verdicts = _verdicts(kind, ours)
    assert verdicts == _verdicts(kind, theirs)
    assert verdicts["tensorflow", "embedding"] == "not consumed"


# --- registered savers that write files of their own ------------------------------------


class _OwnFiles(tf.Module):
    """An object whose registered saver writes a bundle of its own for TensorFlow to merge."""

    def __init__(self):
        super().__init__()
        self.value = tf.Variable([1.0, 2.0])


def _save_own_files(trackables, file_prefix):
    names = list(trackables)
    tf.raw_ops.SaveV2(prefix=file_prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                      tensors=[t.value.read_value() for t in trackables.values()])
    return [file_prefix]


def _restore_own_files(trackables, merged_prefix):
    for name, t in trackables.items():
        (value,) = tf.raw_ops.RestoreV2(prefix=merged_prefix, tensor_names=[name],
                                        shape_and_slices=[""], dtypes=[tf.float32])
        t.value.assign(value)


registration.register_checkpoint_saver(
    package="asyncckpt_test", name="OwnFiles", predicate=lambda x: isinstance(x, _OwnFiles),
    save_fn=_save_own_files, restore_fn=_restore_own_files)


def test_a_registered_saver_that_writes_files_is_refused_at_the_save_call(
        ckpt_dir, tmp_path, monkeypatch):
    theirs = tf.train.Checkpoint(own=_OwnFiles()).save(str(ckpt_dir / "theirs"))  # TF merges
    restored = _OwnFiles()
    restored.value.assign([0.0, 0.0])
    tf.train.Checkpoint(own=restored).restore(theirs)
    np.testing.assert_array_equal(restored.value.numpy(), [1.0, 2.0])

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    ours = ckpt_dir / "ours"
    ours.mkdir()
    ckpt = at.Checkpoint(own=_OwnFiles(), v=tf.Variable(1.0))
    with pytest.raises(UnsupportedObjectError, match=r"asyncckpt_test\.OwnFiles"):
        ckpt.save(str(ours / "ckpt"))
    assert int(ckpt.save_counter.numpy()) == 0
    assert not list(ours.iterdir())
    assert not list(scratch.iterdir())  # the saver's scratch directory is gone
    ckpt.close()

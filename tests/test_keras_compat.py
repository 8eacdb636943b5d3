"""asyncckpt.keras where Keras 3.15's own callbacks define the behaviour.

Due backups taken before the callbacks listed after ``BackupAndRestore`` run
(and taken again when those change their state at the same point); a corrupt
or partial newest backup falling back to the previous one; ``ModelCheckpoint``
taking Keras's arguments by position; the file format written for each name
(legacy HDF5 for ``.h5``), read back by Keras's loaders and compared with the
file Keras itself writes. Runs on the pytest process's Keras backend;
``tests/clients/test_keras_own_tests.py`` runs Keras's own test cases on both.
"""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
ak = pytest.importorskip("asyncckpt.keras")
h5py = pytest.importorskip("h5py")

from asyncckpt.jobrunner.store import DATA_NAME, INDEX_NAME, ArrayStore  # noqa: E402
from tests.helpers import REPO_ROOT, flip_byte, subprocess_env  # noqa: E402


def _data(n=64, d=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = x.sum(1, keepdims=True).astype("float32")
    return x, y


def _model():
    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    # A loss object, not "mse": Keras 3.15's legacy HDF5 loader cannot deserialize the
    # string form in a compiled model (its own model.save("m.h5") files fail the same).
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.MeanSquaredError())
    return m


def _iterations(model) -> int:
    return int(np.asarray(model.optimizer.iterations.value))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


class Raise(keras.callbacks.Callback):
    """Raises in ``on_train_batch_end`` of the n-th batch, or ``on_epoch_end`` of an epoch."""

    def __init__(self, batches=None, epoch_end=None):
        super().__init__()
        self.batches, self.epoch_end, self.seen = batches, epoch_end, 0
        self.weights = None  # the model's weights when it raised

    def _raise(self):
        self.weights = self.model.get_weights()
        raise RuntimeError("a later callback raised")

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.batches:
            self._raise()

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch_end:
            self._raise()


def _backup_weights(restored, model) -> list[np.ndarray]:
    """The trainable and non-trainable arrays of a backup, in ``get_weights`` order."""
    by_path = {}
    for group in ("trainable", "non_trainable"):
        for i, path in enumerate(restored.metadata["paths"][group]):
            by_path[path] = restored.arrays[f"{group}/{i:04d}"]
    return [by_path[v.path] for v in model.weights]


# -- a due backup is taken at its batch or epoch end ---------------------------------------


@pytest.mark.parametrize("where", ["batch", "epoch"])
def test_a_due_backup_survives_a_later_callback_raising_right_after_it(tmp_path, where):
    """The backup due at the point where a later callback raises is there, and resumes."""
    x, y = _data()  # 4 batches of 16 per epoch
    if where == "batch":
        backup = ak.BackupAndRestore(tmp_path / "b", save_freq=3)
        interrupt, position, trained = Raise(batches=6), (1, 2), 6
    else:
        backup = ak.BackupAndRestore(tmp_path / "b")
        interrupt, position, trained = Raise(epoch_end=1), (2, 0), 8
    model = _model()
    with pytest.raises(RuntimeError, match="later callback"):
        model.fit(x, y, epochs=4, batch_size=16, verbose=0, callbacks=[backup, interrupt])
    backup.store.wait_until_finished()
    # asyncckpt's reader: the newest backup is the one due where the callback raised.
    saved = ArrayStore(tmp_path / "b").restore()
    meta = saved.metadata
    assert (meta["epoch"], meta["batch"], meta["global_batches"]) == (*position, trained)
    assert _same(_backup_weights(saved, model), interrupt.weights)
    # The callback's restore: a new fit resumes there and trains only what is left
    # (with plain arrays a mid-epoch backup reruns its epoch from batch 0, as Keras).
    resumed = _model()
    again = ak.BackupAndRestore(tmp_path / "b", save_freq=backup.save_freq)
    resumed.fit(x, y, epochs=4, batch_size=16, verbose=0, callbacks=[again])
    assert again.restored_position == position
    rerun = position[1] if where == "batch" else 0
    assert _iterations(resumed) == 16 + rerun


def test_a_callback_listed_after_the_backup_is_in_the_newest_backup(tmp_path):
    """EarlyStopping after BackupAndRestore: its epoch-end update is backed up too."""
    x, y = _data()
    backup = ak.BackupAndRestore(tmp_path / "b", double_checkpoint=True)
    early = keras.callbacks.EarlyStopping(monitor="loss", patience=100, min_delta=1e9)
    seen = {}

    class Stop(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                seen.update(wait=early.wait, best=float(early.best))
                raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        _model().fit(x, y, epochs=4, batch_size=16, verbose=0,
                     callbacks=[backup, early, Stop()])
    backup.store.wait_until_finished()
    store = ArrayStore(tmp_path / "b")
    # Each retaken backup replaced its first copy: the two kept are two positions.
    kept = [store.restore(s).metadata for s in store.all_steps()]
    assert [(m["epoch"], m["batch"]) for m in kept] == [(1, 0), (2, 0)]
    saved = store.restore()
    # min_delta=1e9: only epoch 0 improves; wait counts the epochs after it.
    assert seen["wait"] == 1
    state = saved.metadata["callbacks"]["0:EarlyStopping"]
    assert (state["wait"], state["best"]) == (seen["wait"], seen["best"])
    fresh = keras.callbacks.EarlyStopping(monitor="loss", patience=100, min_delta=1e9)
    again = ak.BackupAndRestore(tmp_path / "b")
    _model().fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[again, fresh])
    assert fresh.wait == 2  # restored 1, plus epoch 2


def test_an_epoch_backup_resumes_with_the_metrics_fit_resets(tmp_path):
    """Taken at an epoch end, after validation; the resumed epoch's metrics start afresh."""
    x, y = _data()
    fit = dict(epochs=3, batch_size=16, verbose=0, shuffle=False, validation_data=(x[:16], y[:16]))
    reference = _model().fit(x, y, **fit).history
    backup = ak.BackupAndRestore(tmp_path / "b")
    with pytest.raises(RuntimeError):
        _model().fit(x, y, callbacks=[backup, Raise(epoch_end=1)], **fit)
    resumed = _model().fit(x, y, callbacks=[ak.BackupAndRestore(tmp_path / "b")], **fit).history
    assert len(resumed["loss"]) == 1
    np.testing.assert_allclose(resumed["loss"][0], reference["loss"][2], rtol=1e-5)
    np.testing.assert_allclose(resumed["val_loss"][0], reference["val_loss"][2], rtol=1e-5)


# -- a corrupt or partial newest backup falls back to the previous one ----------------------


def _corrupt(step_dir, how):
    if how == "flipped":
        flip_byte(os.path.join(step_dir, DATA_NAME), offset=8)
    elif how == "overwritten":  # what Keras's own test does to its newest weights file
        with open(os.path.join(step_dir, DATA_NAME), "w") as f:
            f.write("0")
    else:  # partial: a file is missing
        os.remove(os.path.join(step_dir, INDEX_NAME))


@pytest.mark.parametrize("how", ["flipped", "partial"])  # overwritten: Keras's own test
def test_a_corrupt_newest_backup_falls_back_to_the_previous_one(tmp_path, caplog, how):
    x, y = _data()
    backup = ak.BackupAndRestore(tmp_path / "b", double_checkpoint=True)
    model = _model()
    with pytest.raises(RuntimeError):
        model.fit(x, y, epochs=4, batch_size=16, verbose=0,
                  callbacks=[backup, Raise(epoch_end=1)])
    newest, previous = backup._weights_path, backup._prev_weights_path  # Keras's names
    assert os.path.dirname(previous) != os.path.dirname(newest)
    assert backup._training_metadata_path == os.path.join(os.path.dirname(newest), INDEX_NAME)
    store = ArrayStore(tmp_path / "b")
    first, second = store.all_steps()
    assert store.restore(first).metadata["epoch"] == 1
    _corrupt(os.path.dirname(newest), how)

    again = ak.BackupAndRestore(tmp_path / "b", double_checkpoint=True,
                                delete_checkpoint=False)
    resumed = _model()
    with caplog.at_level(logging.WARNING, logger="asyncckpt.keras.backup"):
        history = resumed.fit(x, y, epochs=4, batch_size=16, verbose=0, callbacks=[again])
    assert again.restored_position == (1, 0)  # the previous backup: after epoch 0
    assert [r for r in caplog.records if f"backup(s) [{second}]" in r.getMessage()
            and "do not verify" in r.getMessage() and "removing them" in r.getMessage()]
    assert history.epoch == [1, 2, 3]
    assert _iterations(resumed) == 16
    # Later backups were taken (the corrupt one is gone) and verify.
    store = ArrayStore(tmp_path / "b")
    assert len(store.all_steps()) == 2
    for step in store.all_steps():
        store.restore(step)
    final = store.restore()
    assert (final.metadata["epoch"], final.metadata["global_batches"]) == (4, 16)
    assert _same(_backup_weights(final, resumed), resumed.get_weights())


def test_with_no_backup_that_verifies_the_resume_raises(tmp_path):
    x, y = _data()
    backup = ak.BackupAndRestore(tmp_path / "b")
    with pytest.raises(RuntimeError):
        _model().fit(x, y, epochs=3, batch_size=16, verbose=0,
                     callbacks=[backup, Raise(epoch_end=0)])
    _corrupt(os.path.dirname(backup._weights_path), "overwritten")
    from asyncckpt.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError):
        _model().fit(x, y, epochs=3, batch_size=16, verbose=0,
                     callbacks=[ak.BackupAndRestore(tmp_path / "b")])


# -- ModelCheckpoint: Keras's arguments and files ---------------------------------------------


def _positional(cls) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][1:]


def test_callbacks_take_keras_arguments_in_keras_order():
    assert _positional(ak.ModelCheckpoint) == _positional(keras.callbacks.ModelCheckpoint)
    assert _positional(ak.BackupAndRestore) == _positional(keras.callbacks.BackupAndRestore)
    args = ("m.keras", "loss", 1, True, False, "min", 5, 0.5)
    ours, theirs = ak.ModelCheckpoint(*args), keras.callbacks.ModelCheckpoint(*args)
    for name in ("filepath", "monitor", "verbose", "save_best_only", "save_weights_only",
                 "mode", "save_freq", "best"):
        assert getattr(ours, name) == getattr(theirs, name), name
    monitor = ak.ModelCheckpoint("m.keras", "val_loss")
    assert monitor.monitor == "val_loss"


@pytest.mark.parametrize("name, kwargs", [
    ("m.hdf5", {}),  # model.save() takes it; Keras's ModelCheckpoint does not
    ("m.txt", {}),
    ("m.keras", {"save_weights_only": True}),
    ("m.h5", {"save_weights_only": True}),
])
def test_names_keras_refuses_are_refused_at_construction(tmp_path, name, kwargs):
    path = str(tmp_path / name)
    with pytest.raises(ValueError) as theirs:
        keras.callbacks.ModelCheckpoint(path, **kwargs)
    with pytest.raises(ValueError) as ours:
        ak.ModelCheckpoint(path, **kwargs)
    assert str(ours.value) == str(theirs.value)


def _h5_tree(path) -> list:
    """Every group, dataset (shape, dtype, values) and attribute of an HDF5 file."""
    out = []

    def attrs(obj):
        return sorted((k, np.asarray(v).tolist()) for k, v in obj.attrs.items()
                      if k not in ("keras_version",))

    with h5py.File(path, "r") as f:
        out.append(("/", attrs(f)))

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out.append((name, obj.shape, str(obj.dtype), np.asarray(obj).tolist(),
                            attrs(obj)))
            else:
                out.append((name, attrs(obj)))

        f.visititems(visit)
    return out


@pytest.mark.parametrize("name", ["m.h5", "m.weights.h5"])
def test_an_h5_model_file_is_keras_legacy_hdf5(tmp_path, name):
    """``ModelCheckpoint("m.h5")`` writes what ``model.save("m.h5")`` writes."""
    x, y = _data()
    model = _model()
    path = str(tmp_path / name)
    cb = ak.ModelCheckpoint(path, "loss")

    class KerasSaves(keras.callbacks.Callback):  # Keras's own file of the same state
        def on_epoch_end(self, epoch, logs=None):
            self.model.save(str(tmp_path / "keras.h5"))

    model.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[cb, KerasSaves()])
    assert _h5_tree(path) == _h5_tree(tmp_path / "keras.h5")
    loaded = keras.saving.load_model(path)
    assert _same(loaded.get_weights(), model.get_weights())
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    if name == "m.h5":  # Keras reads a .weights.h5 name as its weights format, not this
        into = _model()
        into.load_weights(path)
        assert _same(into.get_weights(), model.get_weights())
    with h5py.File(path, "r") as f:  # the optimizer's state, as Keras stores it
        group = f["optimizer_weights"]
        names = [n.decode() if isinstance(n, bytes) else n for n in group.attrs["weight_names"]]
        for v in model.optimizer.variables:
            np.testing.assert_array_equal(np.asarray(group[v.path]), np.asarray(v.value))
        assert names == [v.path for v in model.optimizer.variables]


def test_h5_files_on_the_other_backend(tmp_path):
    """The ``m.h5`` case again, in a child on the Keras backend this process is not on."""
    other = "jax" if keras.backend.backend() == "tensorflow" else "tensorflow"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "keras_legacy_hdf5 and not weights", "--basetemp", str(tmp_path / "t")],
        cwd=REPO_ROOT, env=subprocess_env(KERAS_BACKEND=other), capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "1 passed" in proc.stdout

"""asyncckpt.keras in the pytest process (its Keras backend): files, semantics, signals."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from asyncckpt._engine.manifest import read_manifest, verify_files

keras = pytest.importorskip("keras")
ak = pytest.importorskip("asyncckpt.keras")

from asyncckpt.jobrunner.store import ArrayStore, _ArraysJob  # noqa: E402
from asyncckpt.keras.checkpoint import _FileJob  # noqa: E402


def _data(n=64, d=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x.sum(1, keepdims=True) > 0).astype("float32")
    return x, y


def _model(built=True):
    keras.utils.set_random_seed(3)
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    if built:
        layers.insert(0, keras.Input((6,)))
    m = keras.Sequential(layers)
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return m


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


class RaiseAt(keras.callbacks.Callback):
    def __init__(self, epoch=None, batches=None):
        super().__init__()
        self.epoch, self.batches, self.seen = epoch, batches, 0

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.batches:
            raise RuntimeError("interrupted")


# -- ResumableDataset ----------------------------------------------------------------------


def test_dataset_order_is_a_function_of_seed_and_epoch():
    x, y = _data(50)
    a = ak.ResumableDataset(x, y, batch_size=8, shuffle_seed=4)
    b = ak.ResumableDataset(x, y, batch_size=8, shuffle_seed=4)
    assert a.batches_per_epoch == 7
    np.testing.assert_array_equal(a.order(3), b.order(3))
    assert not np.array_equal(a.order(0), a.order(1))
    b.set_position(2, skip=3)
    b.on_epoch_begin()
    assert b.num_batches == 4
    for i in range(4):
        got, want = b[i], a.batch(2, 3 + i)
        np.testing.assert_array_equal(got[0], want[0])
    b.on_epoch_end()
    assert b.num_batches == 7
    with pytest.raises(ValueError, match="either x"):
        ak.ResumableDataset()


def test_dataset_over_a_sequence_of_batches():
    batches = [(np.full((2, 6), i, np.float32), np.zeros((2, 1), np.float32)) for i in range(5)]
    ds = ak.ResumableDataset(sequence=batches, shuffle_seed=None)
    ds.on_epoch_begin()
    assert [float(ds[i][0][0, 0]) for i in range(5)] == [0, 1, 2, 3, 4]


def test_dataset_refuses_keras_shuffling(tmp_path):
    x, y = _data()
    ds = ak.ResumableDataset(x, y, batch_size=4, shuffle_seed=1)  # 16 batches
    with pytest.raises(Exception, match="shuffle=False"):
        _model().fit(ds, epochs=1, verbose=0, shuffle=True)


# -- BackupAndRestore ------------------------------------------------------------------------


def test_epoch_backups_resume_at_the_interrupted_epoch(tmp_path):
    x, y = _data()
    backup = ak.BackupAndRestore(tmp_path / "b")
    model = _model()
    with pytest.raises(RuntimeError):
        model.fit(x, y, epochs=5, batch_size=16, callbacks=[backup, RaiseAt(epoch=3)], verbose=0)
    backup.store.wait_until_finished()  # the backup taken as epoch 2 ended may still be in flight
    assert ArrayStore(tmp_path / "b").all_steps() == [12]  # after epoch 2: 3 x 4 batches
    history = model.fit(x, y, epochs=5, batch_size=16, callbacks=[backup], verbose=0)
    assert backup.restored_position == (3, 0)
    assert len(history.history["loss"]) == 2
    assert not os.path.exists(tmp_path / "b")  # delete_checkpoint=True


def test_keep_backup_and_rerun_trains_nothing(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0,
              callbacks=[ak.BackupAndRestore(tmp_path / "b", delete_checkpoint=False)])
    weights = model.get_weights()
    again = ak.BackupAndRestore(tmp_path / "b", delete_checkpoint=False)
    fresh = _model()
    history = fresh.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[again])
    assert again.restored_position == (2, 0)
    assert history.history == {}
    assert _same(fresh.get_weights(), weights)


def test_restores_into_an_unbuilt_model_and_warns_without_resumable_data(tmp_path):
    x, y = _data()
    model = _model(built=False)
    backup = ak.BackupAndRestore(tmp_path / "b", save_freq=3)
    with pytest.raises(RuntimeError):
        model.fit(x, y, epochs=2, batch_size=16, verbose=0,
                  callbacks=[backup, RaiseAt(batches=6)])
    backup.store.wait_until_finished()
    saved = ArrayStore(tmp_path / "b").restore()
    # Due after the 6th batch (batch 1 of epoch 1), taken before RaiseAt raised there.
    assert (saved.metadata["epoch"], saved.metadata["batch"]) == (1, 2)
    other = _model(built=False)
    assert not other.built
    with pytest.warns(UserWarning, match="run again from its first batch"):
        other.fit(x, y, epochs=2, batch_size=16, verbose=0,
                  callbacks=[ak.BackupAndRestore(tmp_path / "b", save_freq=3)])
    # Restored after 6 batches, then epoch 1 again from its first batch (Keras's behaviour).
    assert int(np.asarray(other.optimizer.iterations.value)) == 6 + 4


def test_sigterm_backs_up_at_the_next_batch_and_exits(tmp_path):
    x, y = _data()
    data = ak.ResumableDataset(x, y, batch_size=8, shuffle_seed=2)  # 8 batches per epoch

    class Term(keras.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            Term.seen += 1
            if Term.seen == 11:
                os.kill(os.getpid(), signal.SIGTERM)

    backup = ak.BackupAndRestore(tmp_path / "b", save_freq=False, data=data,
                                 options=ak.BackupOptions(save_on_sigterm=True))
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        _model().fit(data, epochs=3, verbose=0, shuffle=False, callbacks=[backup, Term()])
    assert info.value.code == 143 and backup.preempted
    assert signal.getsignal(signal.SIGTERM) is previous
    saved = ArrayStore(tmp_path / "b").restore()
    assert (saved.metadata["epoch"], saved.metadata["batch"]) == (1, 3)
    assert saved.step == 11


def test_background_failure_surfaces_in_fit(tmp_path):
    class Failing(_ArraysJob):
        def _write_index(self, index):
            raise OSError("disk full (injected)")

    class Store(ArrayStore):
        job_class = Failing

    class Backup(ak.BackupAndRestore):
        def _make_store(self):
            return Store(self.backup_dir, max_to_keep=1)

    x, y = _data()
    with pytest.raises(OSError, match="disk full"):
        _model().fit(x, y, epochs=3, batch_size=16, verbose=0,
                     callbacks=[Backup(tmp_path / "b", save_freq=1)])
    assert ArrayStore(tmp_path / "b").all_steps() == []


# -- ModelCheckpoint -------------------------------------------------------------------------


def test_model_checkpoint_files_are_keras_files(tmp_path):
    x, y = _data()
    model = _model()
    weights_cb = ak.ModelCheckpoint(str(tmp_path / "w-{epoch}.weights.h5"), save_weights_only=True)
    model_cb = ak.ModelCheckpoint(str(tmp_path / "m.keras"))

    class Record(keras.callbacks.Callback):
        per_epoch: list = []

        def on_epoch_end(self, epoch, logs=None):
            Record.per_epoch.append(self.model.get_weights())

    model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[Record(), weights_cb, model_cb])
    for epoch in (1, 2, 3):
        m = _model()
        m.load_weights(str(tmp_path / f"w-{epoch}.weights.h5"))
        assert _same(m.get_weights(), Record.per_epoch[epoch - 1])
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    assert _same(loaded.get_weights(), model.get_weights())
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".asyncckpt-tmp")]
    # Each file committed through the engine's transaction: a manifest beside it.
    for name in ("w-3.weights.h5", "m.keras"):
        manifest = read_manifest(str(tmp_path / (name + ".asyncckpt-manifest.json")))
        assert [r.name for r in manifest.files] == [name] and manifest.framework == "keras"
        verify_files(str(tmp_path), manifest.files, checksums=True, checkpoint=name)


def test_model_checkpoint_writes_the_snapshot_not_later_values(tmp_path):
    gate = threading.Event()

    class Held(_FileJob):
        def write(self):
            assert gate.wait(60)
            super().write()

    class Checkpoint(ak.ModelCheckpoint):
        job_class = Held

    model = _model()
    before = model.get_weights()
    cb = Checkpoint(str(tmp_path / "w.weights.h5"), save_weights_only=True)
    cb.set_model(model)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_epoch_end(0, logs={"loss": 1.0})  # staged; the write waits for the gate
    model.set_weights([np.zeros_like(w) for w in before])
    gate.set()
    cb.on_train_end()  # waits until the file is written
    check = _model()
    check.load_weights(str(tmp_path / "w.weights.h5"))
    assert _same(check.get_weights(), before)


def test_model_checkpoint_best_survives_restarts(tmp_path):
    x, y = _data()
    path = str(tmp_path / "best.weights.h5")
    cb = ak.ModelCheckpoint(path, save_weights_only=True, monitor="loss", save_best_only=True)
    model = _model()
    model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[cb])
    assert np.isfinite(cb.best)
    again = ak.ModelCheckpoint(path, save_weights_only=True, monitor="loss", save_best_only=True)
    assert again.best == cb.best
    other = ak.ModelCheckpoint(path, save_weights_only=True, monitor="val_loss",
                               save_best_only=True)
    assert other.best != cb.best  # a different monitor starts afresh

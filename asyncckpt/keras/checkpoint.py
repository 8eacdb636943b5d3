"""``asyncckpt.keras.ModelCheckpoint``: Keras's files, written in the background.

Each file has the format Keras writes for its name, decided at construction
as Keras's ``ModelCheckpoint`` decides it: ``save_weights_only=True`` (name
ending in ``.weights.h5``): Keras's weights file; otherwise ``.keras``: the
zip of ``model.save``; ``.h5``: the legacy HDF5 model file of
``model.save("m.h5")``. Other names are refused at construction by Keras's
own checks.

Keras writes a file by walking the model on the training thread and handing
each value to a writer: the weights store (``saving_lib._save_state`` into an
``H5IOStore``) for ``.weights.h5`` and ``.keras``, an open ``h5py.File`` for
the legacy format (``legacy_h5_format.save_model_to_hdf5``). Here the walk
runs on the training thread into a stand-in writer that only copies each
value into a host staging slot and records where it goes; the background
writer then replays the same calls into a real ``H5IOStore`` or
``h5py.File``. The files are therefore Keras's own (``model.load_weights``
and ``keras.models.load_model`` read them), committed through the engine's
transaction: written into a temporary directory, checksummed in a manifest
(``<file>.asyncckpt-manifest.json``, beside the file), fsynced and renamed
into place, the file last.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h5py
import keras
from keras.src.legacy.saving import legacy_h5_format
from keras.src.saving import saving_lib

from asyncckpt import _deprecation, layout
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine._copy import copy_arrays
from asyncckpt._engine._jobs import SaveJob
from asyncckpt._engine.destinations import PrefixFiles
from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.slots import Slot
from asyncckpt._engine.transaction import Transaction
from asyncckpt._engine.writer import AsyncEngine
from asyncckpt.jobrunner.store import host_view
from asyncckpt.keras import _callbacks
from asyncckpt.options import AsyncOptions

logger = logging.getLogger(__name__)

STATE_SUFFIX = ".asyncckpt-best.json"


@dataclass
class _Group:
    path: str
    metadata: dict | None
    items: list[tuple[str, Any]] = field(default_factory=list)


class _CaptureStore(saving_lib.H5IOStore):
    """A write-mode weights store that copies values into a staging slot.

    Subclasses ``H5IOStore`` only so Keras's walk accepts it; it opens no file.
    """

    def __init__(self, slot: Slot):  # no super().__init__: there is no file
        self.mode = "w"
        self.archive = None
        self._slot = slot
        self.groups: list[_Group] = []
        self._pairs: list[tuple[Any, Any]] = []

    def __bool__(self) -> bool:
        return True

    def make(self, path, metadata=None):
        self.groups.append(_Group(path, dict(metadata) if metadata else None))
        return self

    def __setitem__(self, key, value):
        src = host_view(value)
        buf = self._slot.buffer(f"{len(self.groups)}/{key}", src.shape, src.dtype)
        self._pairs.append((buf, src))
        self.groups[-1].items.append((key, buf))

    def finish(self) -> int:
        copy_arrays(self._pairs)
        self._pairs = []
        return sum(buf.nbytes for g in self.groups for _, buf in g.items)

    def close(self):
        pass


def _replay(groups: list[_Group], store: saving_lib.H5IOStore) -> None:
    for g in groups:
        entry = store.make(g.path, metadata=g.metadata)
        for key, value in g.items:
            entry[key] = value


def _write_weights(groups: list[_Group], path: str) -> None:
    """Keras's ``.weights.h5`` file (``model.save_weights``)."""
    store = saving_lib.H5IOStore(path, mode="w")
    try:
        _replay(groups, store)
    finally:
        store.close()


def _write_keras(groups: list[_Group], config: tuple[str, str], path: str) -> None:
    """Keras's ``.keras`` zip (``model.save``): metadata, config and the weights file."""
    config_json, metadata_json = config
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(saving_lib._METADATA_FILENAME, metadata_json)
        zf.writestr(saving_lib._CONFIG_FILENAME, config_json)
        store = saving_lib.H5IOStore(saving_lib._VARS_FNAME_H5, archive=zf, mode="w")
        try:
            _replay(groups, store)
        finally:
            store.close()


class _CaptureH5:
    """An HDF5 group that records what is written into it; values go to a staging slot."""

    def __init__(self, ops: list[tuple], pairs: list[tuple[Any, Any]], slot: Slot, path: str):
        self._ops, self._pairs, self._slot, self._path = ops, pairs, slot, path
        self._attrs = _CaptureAttrs(ops, path)

    @property
    def attrs(self) -> _CaptureAttrs:
        return self._attrs

    def _child(self, name: str | bytes) -> str:
        return f"{self._path}/{name.decode() if isinstance(name, bytes) else name}"

    def create_group(self, name: str | bytes) -> _CaptureH5:
        path = self._child(name)
        self._ops.append(("group", path))
        return _CaptureH5(self._ops, self._pairs, self._slot, path)

    def create_dataset(self, name: str | bytes, shape: Any = None,
                       dtype: Any = None) -> _CaptureData:
        path = self._child(name)
        buf = self._slot.buffer(f"legacy{path}", tuple(shape), dtype)
        self._ops.append(("dataset", path, buf))
        return _CaptureData(buf, self._pairs)


class _CaptureAttrs:
    def __init__(self, ops: list[tuple], path: str):
        self._ops, self._path = ops, path

    def __setitem__(self, key: str, value: Any) -> None:
        self._ops.append(("attr", self._path, key, value))


class _CaptureData:
    def __init__(self, buf: Any, pairs: list[tuple[Any, Any]]):
        self._buf, self._pairs = buf, pairs

    def __setitem__(self, index: Any, value: Any) -> None:
        if index not in ((), slice(None)):
            raise TypeError(f"a partial write of a legacy HDF5 dataset ({index!r})")
        self._pairs.append((self._buf, host_view(value)))


class _CaptureLegacyFile(h5py.File, _CaptureH5):
    """Stands in for the open ``h5py.File`` that Keras's legacy HDF5 saver writes into.

    Subclasses ``h5py.File`` only so ``save_model_to_hdf5`` takes it as an
    open file; it opens none. ``replay`` writes the same calls into a real file.
    """

    def __init__(self, slot: Slot):  # no h5py.File.__init__: there is no file
        self.ops: list[tuple] = []
        self._values: list[tuple[Any, Any]] = []
        _CaptureH5.__init__(self, self.ops, self._values, slot, "")

    attrs = _CaptureH5.attrs
    create_group = _CaptureH5.create_group
    create_dataset = _CaptureH5.create_dataset
    __eq__ = object.__eq__  # h5py's compare and hash the (absent) file id
    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def finish(self) -> int:
        copy_arrays(self._values)
        self._values = []
        return sum(op[2].nbytes for op in self.ops if op[0] == "dataset")

    @staticmethod
    def replay(ops: list[tuple], path: str) -> None:
        with h5py.File(path, mode="w") as f:
            for op in ops:
                if op[0] == "attr":
                    (f[op[1]] if op[1] else f).attrs[op[2]] = op[3]
                elif op[0] == "group":
                    f.create_group(op[1])
                else:
                    data = f.create_dataset(op[1], op[2].shape, dtype=op[2].dtype)
                    data[()] = op[2]


class _FileJob(SaveJob):
    """The format writer of one Keras file; its transaction publishes it beside its manifest.

    The file is written into a temporary directory, then its manifest and it
    (last) are moved into place (``PrefixFiles``): an older file of the same
    name stays until the new one replaces it in one rename.
    """

    def __init__(self, owner: ModelCheckpoint, filepath: str,
                 write_file: Callable[[str], None], nbytes: int, best: dict | None):
        label = os.path.basename(filepath)
        directory = os.path.dirname(os.path.abspath(filepath))
        manifest = os.path.basename(layout.tf_manifest_path(filepath))
        super().__init__(label=label, step=None, nbytes=nbytes, transaction=Transaction(
            PrefixFiles(directory, label, fsync=owner.async_options.fsync,
                        replaces=lambda: [n for n in (label, manifest)
                                          if os.path.lexists(os.path.join(directory, n))]),
            framework="keras", label=label, step=None, manifest_name=manifest,
            options=owner.async_options))
        self._owner = owner
        self._write_file: Callable[[str], None] | None = write_file
        self._best = best

    def write(self) -> None:
        workdir = self.transaction.begin()
        write_file, self._write_file = self._write_file, None  # the slot is released after
        write_file(os.path.join(workdir, self.label))
        self.transaction.adopt([self.label])  # Keras's writer wrote it: read back for its CRC

    def after_commit(self, stats: SaveStats) -> None:
        """Published: ``best`` recorded beside it, for the next run."""
        if self._best is not None:
            commit_lib.write_text_atomic(
                self._owner.state_path, json.dumps(self._best),
                fsync=self._owner.async_options.fsync)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint``, with the file written in the background.

    Same arguments (by position and by keyword, in Keras's order), same
    decisions (``save_best_only``, ``save_freq``, ``{epoch}`` in file names)
    and the same files: Keras's weights file with ``save_weights_only=True``
    (name ending in ``.weights.h5``), otherwise the format Keras's
    ``model.save`` writes for the name: a ``.keras`` zip, or for ``.h5`` the
    legacy HDF5 model file (config, weights and optimizer state, read by
    ``keras.models.load_model`` and by ``model.load_weights``). Other names
    are refused at construction, as Keras refuses them. A save blocks only
    for the copy of the weights to host memory; the file is written under a
    temporary name, fsynced and renamed over the previous one, so a crash
    never leaves a half-written checkpoint file.

    ``best`` survives restarts: it is recorded in ``<filepath>`` +
    ``.asyncckpt-best.json`` each time a best file is committed (only for
    file names without ``{...}`` fields), and it is part of every
    ``asyncckpt.keras.BackupAndRestore`` backup in the same ``fit``.

    Not saved in ``.keras`` files: assets of layers that have them (lookup
    tables); use Keras's own callback for such models.

    Args:
        filepath, monitor, verbose, save_best_only, save_weights_only, mode,
        save_freq, initial_value_threshold: Keras's ``ModelCheckpoint``
            arguments, in its order.
        async_options: Staging slots, fsync of the engine.
    """

    job_class = _FileJob  # the background part of a save (tests subclass it)

    def __init__(
        self,
        filepath: str | os.PathLike,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
        *,
        async_options: AsyncOptions | None = None,
    ):
        super().__init__(
            filepath, monitor=monitor, verbose=verbose, save_best_only=save_best_only,
            save_weights_only=save_weights_only, mode=mode, save_freq=save_freq,
            initial_value_threshold=initial_value_threshold,
        )
        # What Keras's model.save / save_weights write for this name (Keras's own
        # checks above have refused every other name).
        if save_weights_only:
            self._file_format = "weights.h5"
        elif self.filepath.endswith(".keras"):
            self._file_format = "keras"
        else:
            self._file_format = "legacy.h5"
            logger.warning(
                "ModelCheckpoint(%r) writes Keras's legacy HDF5 model file, as "
                "model.save() does for a .h5 name; Keras recommends the .keras format",
                self.filepath)
        self.async_options = async_options or AsyncOptions()
        self._engine: AsyncEngine | None = None
        self.state_path = os.fspath(self.filepath) + STATE_SUFFIX
        self._load_best()

    def _load_best(self) -> None:
        if not self.save_best_only or "{" in self.filepath:
            return
        try:
            with open(self.state_path, encoding="utf-8") as f:
                saved = json.load(f)
        except (FileNotFoundError, ValueError):
            return
        if saved.get("monitor") == self.monitor and os.path.exists(self.filepath):
            self.best = _callbacks.from_json_value(saved.get("best"))

    # -- state for BackupAndRestore --------------------------------------------------------

    def get_state(self) -> dict:
        return {
            "best": _callbacks.to_json_value(self.best),
            "batches_seen": self._batches_seen_since_last_saving,
            "last_batch_seen": self._last_batch_seen,
        }

    def set_state(self, state: dict) -> None:
        self.best = _callbacks.from_json_value(state.get("best"))
        self._batches_seen_since_last_saving = int(state.get("batches_seen", 0))
        self._last_batch_seen = state.get("last_batch_seen")

    # -- saving ------------------------------------------------------------------------------

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None or self._engine.closed:
            self._engine = AsyncEngine(options=self.async_options,
                                       name="asyncckpt.keras.checkpoint")
        return self._engine

    def _save_model(self, epoch, batch, logs):
        filepath = self._get_file_path(epoch, batch, logs)
        if os.path.isdir(filepath):
            raise OSError(
                "Please specify a non-directory filepath for ModelCheckpoint. "
                f"Filepath used is an existing directory: {filepath}"
            )
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        model = self.model  # on JAX this syncs the trainer's state into the variables
        best = None
        if self.save_best_only and "{" not in self.filepath:
            best = {"monitor": self.monitor, "best": _callbacks.to_json_value(self.best)}
        config = (saving_lib._serialize_model_as_json(model)
                  if self._file_format == "keras" else None)

        def stage(slot: Slot) -> _FileJob:
            if self._file_format == "legacy.h5":
                legacy = _CaptureLegacyFile(slot)
                legacy_h5_format.save_model_to_hdf5(model, legacy)
                nbytes = legacy.finish()
                write = functools.partial(_CaptureLegacyFile.replay, legacy.ops)
                return self.job_class(self, filepath, write, nbytes, best)
            capture = _CaptureStore(slot)
            saving_lib._save_state(model, weights_store=capture, assets_store=None,
                                   inner_path="", visited_saveables=set())
            nbytes = capture.finish()
            if config is None:
                write = functools.partial(_write_weights, capture.groups)
            else:
                write = functools.partial(_write_keras, capture.groups, config)
            return self.job_class(self, filepath, write, nbytes, best)

        self.engine.save(stage, label=os.path.basename(filepath))

    def wait_until_finished(self) -> None:
        """Waits until every file saved so far is written; re-raises background errors."""
        if self._engine is not None:
            self._engine.wait_until_finished()

    sync = _deprecation.renamed_method("wait_until_finished", "sync", "ModelCheckpoint")

    def on_train_end(self, logs=None):
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.close()

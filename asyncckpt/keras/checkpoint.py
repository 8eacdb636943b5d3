"""``asyncckpt.keras.ModelCheckpoint``: Keras's files, written in the background.

Keras saves a model by walking it (``saving_lib._save_state``) and handing each
object's variables to a weights store, which writes them into an HDF5 file.
Here the walk runs on the training thread into a store that only copies each
value into a host staging slot and remembers where it goes; the background
writer then replays the same calls into Keras's own ``H5IOStore``. The files
are therefore Keras's own (``model.load_weights`` and
``keras.models.load_model`` read them), written under a temporary name,
fsynced and renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
import zipfile
from dataclasses import dataclass, field
from typing import Any

import keras
from keras.src.saving import saving_lib

from asyncckpt.engine import commit as commit_lib
from asyncckpt.engine.files import fsync_path
from asyncckpt.engine.metrics import SaveStats
from asyncckpt.engine.slots import Slot, copy_arrays
from asyncckpt.engine.writer import AsyncEngine
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


class _FileJob:
    def __init__(self, owner: ModelCheckpoint, filepath: str, groups: list[_Group],
                 config: tuple[str, str] | None, nbytes: int, best: dict | None):
        self.label = os.path.basename(filepath)
        self.step = None
        self.nbytes = nbytes
        self._owner = owner
        self._filepath = filepath
        self._groups = groups
        self._config = config
        self._best = best
        self._tmp: str | None = None

    def write(self) -> None:
        parent = os.path.dirname(os.path.abspath(self._filepath))
        os.makedirs(parent, exist_ok=True)
        self._tmp = os.path.join(
            parent, f"{commit_lib.TEMP_PREFIX}{self.label}-{uuid.uuid4().hex[:8]}"
        )
        if self._config is None:
            store = saving_lib.H5IOStore(self._tmp, mode="w")
            try:
                _replay(self._groups, store)
            finally:
                store.close()
        else:
            config_json, metadata_json = self._config
            with zipfile.ZipFile(self._tmp, "w") as zf:
                zf.writestr(saving_lib._METADATA_FILENAME, metadata_json)
                zf.writestr(saving_lib._CONFIG_FILENAME, config_json)
                store = saving_lib.H5IOStore(saving_lib._VARS_FNAME_H5, archive=zf, mode="w")
                try:
                    _replay(self._groups, store)
                finally:
                    store.close()
        self._groups = []
        if self._owner.async_options.fsync:
            fsync_path(self._tmp)

    def commit(self, stats: SaveStats) -> None:
        assert self._tmp is not None
        fsync = self._owner.async_options.fsync
        os.replace(self._tmp, self._filepath)
        self._tmp = None
        if fsync:
            fsync_path(os.path.dirname(os.path.abspath(self._filepath)))
        if self._best is not None:
            commit_lib.write_text_atomic(
                self._owner.state_path, json.dumps(self._best), fsync=fsync
            )

    def abort(self) -> None:
        if self._tmp is not None:
            commit_lib.remove_tree(self._tmp)
            self._tmp = None


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint``, with the file written in the background.

    Same arguments, same decisions (``save_best_only``, ``save_freq``,
    ``{epoch}`` in file names) and the same files: ``.weights.h5`` with
    ``save_weights_only=True``, ``.keras`` otherwise. A save blocks only
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
        filepath: As for Keras's ``ModelCheckpoint``.
        async_options: Staging slots, fsync of the engine.
        **kwargs: Keras's ``ModelCheckpoint`` arguments.
    """

    job_class = _FileJob  # the background part of a save (tests subclass it)

    def __init__(self, filepath, *, async_options: AsyncOptions | None = None, **kwargs):
        super().__init__(filepath, **kwargs)
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
            self.best = _callbacks._unplain(saved.get("best"))

    # -- state for BackupAndRestore --------------------------------------------------------

    def get_state(self) -> dict:
        return {
            "best": _callbacks._plain(self.best),
            "batches_seen": self._batches_seen_since_last_saving,
            "last_batch_seen": self._last_batch_seen,
        }

    def set_state(self, state: dict) -> None:
        self.best = _callbacks._unplain(state.get("best"))
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
            best = {"monitor": self.monitor, "best": _callbacks._plain(self.best)}
        config = None if self.save_weights_only else saving_lib._serialize_model_as_json(model)

        def stage(slot: Slot) -> _FileJob:
            capture = _CaptureStore(slot)
            saving_lib._save_state(model, weights_store=capture, assets_store=None,
                                   inner_path="", visited_saveables=set())
            nbytes = capture.finish()
            return self.job_class(self, filepath, capture.groups, config, nbytes, best)

        self.engine.save(stage, label=os.path.basename(filepath))

    def sync(self) -> None:
        """Waits until every file saved so far is written; re-raises background errors."""
        if self._engine is not None:
            self._engine.sync()

    def on_train_end(self, logs=None):
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.close()

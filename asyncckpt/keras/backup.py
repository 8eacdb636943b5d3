"""``asyncckpt.keras.BackupAndRestore``: Keras 3's callback, asynchronous and exact."""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import keras
from keras.src.trainers.epoch_iterator import EpochIterator

from asyncckpt.jobrunner.store import DATA_NAME, INDEX_NAME, ArrayStore, Restored
from asyncckpt.keras import _callbacks, _state, _tfdata
from asyncckpt.keras._preemption import METADATA_KEY, KerasTarget, PreemptionOptions
from asyncckpt.keras.data import ResumableDataset
from asyncckpt.options import AsyncOptions

logger = logging.getLogger(__name__)

# Stores left open by a fit() that raised (Keras calls no on_train_end then),
# by directory: a later BackupAndRestore of the same directory in this process
# flushes and closes them before it takes the directory over.
_OPEN: dict[str, ArrayStore] = {}
_OPEN_LOCK = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class BackupOptions:
    """How backups are written and what happens on a termination notice.

    Attributes:
        async_options: Staging slots, fsync, checksums of the engine.
        preemption: Run an ``asyncckpt.preemption.PreemptionCheckpointHandler``
            during ``fit``: on a notice (SIGTERM, GCE maintenance or Spot
            notices, a watcher function) the handler picks the batch
            boundary to back up at (with a grace period, as late as is safe),
            waits until the backup is durable and calls its ``exit_fn``.
        save_on_sigterm: Shorthand for ``preemption`` with only SIGTERM
            watched, no grace period and exit code ``sigterm_exit_code``:
            back up at the next batch boundary, wait until it is durable and
            raise ``SystemExit``. Only in the main thread.
        sigterm_exit_code: Exit code after such a save (143 = 128 + SIGTERM).
    """

    async_options: AsyncOptions | None = None
    preemption: PreemptionOptions | None = None
    save_on_sigterm: bool = False
    sigterm_exit_code: int = 143

    def preemption_options(self) -> PreemptionOptions | None:
        """What the handler is run with, or None for no handler."""
        if self.preemption is not None:
            return self.preemption
        if not self.save_on_sigterm:
            return None
        from asyncckpt.preemption.config import TerminationConfig, exit_process

        return PreemptionOptions(termination_config=TerminationConfig(
            platform="other", grace_period=0.0,
            exit_fn=functools.partial(exit_process, self.sigterm_exit_code)))


@dataclass
class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state in the background; resumes ``fit`` exactly.

    Same arguments and meaning as ``keras.callbacks.BackupAndRestore``:
    backups are taken every epoch or every ``save_freq`` batches, restored at
    the start of ``fit``, and deleted when ``fit`` completes (unless
    ``delete_checkpoint=False``). The differences:

    * a backup blocks training only for the copy of the state to host memory;
      writing, checksums, fsync and commit run on a background thread;
    * a backup is one atomic checkpoint holding the model's variables
      (BatchNorm statistics and seed-generator states included), the
      optimizer's (``iterations``, slots), the metric accumulators, the
      position (epoch, batch), and the state of the other stateful callbacks
      of the same ``fit`` (``EarlyStopping``, ``ModelCheckpoint``,
      ``ReduceLROnPlateau``, or any with ``get_state``/``set_state``);
    * a backup taken mid-epoch resumes at that batch: with ``data`` (a
      ``ResumableDataset``) the batches already applied are left out of the
      resumed epoch, so the run ends bit-identical to an uninterrupted one;
      without it, the resumed epoch starts from its first batch as Keras's
      own callback does (and a warning says so);
    * ``save_freq=False`` takes no periodic backups (use with
      ``BackupOptions(preemption=...)``); Keras's treats False as 0;
    * with ``BackupOptions(preemption=PreemptionOptions(...))`` a
      ``PreemptionCheckpointHandler`` decides at every batch boundary
      whether to back up and exit (``preemption_handler``).

    A backup that falls due is taken at the end of the batch or epoch it
    falls due on, when this callback's hook runs, before the callbacks listed
    after it run theirs (an exception they raise cannot lose it). One due at
    the last batch of an epoch is taken at that epoch's end (no step runs in
    between), after validation. If a callback listed after this one then
    changes its recorded state while it processes the same batch or epoch
    end (``EarlyStopping``, ``ReduceLROnPlateau``, ``ModelCheckpoint`` or a
    callback with ``get_state``), the backup is taken again at the next batch
    boundary, so the newest backup holds their state too; list this callback
    after those to save that second copy. With a ``tf.data`` input on the
    TensorFlow backend a backup due at an epoch end is taken as the next
    epoch's first batch begins, where the iterator whose state it holds
    exists.

    Restores read the newest backup that verifies: a corrupt or partial
    newest backup (``double_checkpoint=True``) is logged, removed, and the
    previous one is restored.

    Args:
        backup_dir: Directory of the backups; used by this callback only.
        save_freq: ``"epoch"``, a positive number of batches, or False.
        double_checkpoint: Keep the previous backup too (two in all); the
            newest that verifies is restored.
        delete_checkpoint: Delete the backups once ``fit`` completes.
        data: The ``ResumableDataset`` given to ``fit``, for exact mid-epoch
            resumes.
        options: Engine and SIGTERM options.
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        *,
        data: ResumableDataset | None = None,
        options: BackupOptions | None = None,
    ):
        super().__init__()
        if not backup_dir:
            raise ValueError("Empty `backup_dir` argument passed")
        if save_freq is False:
            save_freq = None
        elif save_freq != "epoch" and (
            not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1
        ):
            raise ValueError(
                f"Invalid value for argument `save_freq`. Received: save_freq={save_freq!r}. "
                "Expected 'epoch', a positive integer or False."
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.data = data
        self.options = options or BackupOptions()
        self._store: ArrayStore | None = None
        self._siblings: list[Any] = []
        self._after: list[Any] = []  # the siblings listed after this callback
        self._reader: Any = None  # TensorFlow: the batched variable read, kept across backups
        self._reset_run()

    def _reset_run(self) -> None:
        self._restored: Restored | None = None
        self._first_epoch = True
        self._epoch = 0
        self._offset = 0  # batches of the current epoch left out (resumed epoch)
        self._batch = 0  # next batch of the current epoch, counted in the full epoch
        self._global = 0  # batches trained in total, across restarts
        self._since = 0  # batches since the last backup
        self._pending = False  # due, to be taken at the next epoch end or boundary
        self._last_saved: int | None = None  # global batch count of the newest backup
        self._last_position: tuple[int, int] | None = None
        self._last_step: int | None = None
        self._saved_stopped = False
        self._next_step = 1
        # _callbacks.collect() of the callbacks listed after this one, when the newest
        # backup was taken at a due point: compared at the next boundary (_incomplete).
        self._recheck: tuple[dict, dict] | None = None
        self._epoch_done = False
        self._shortened: tuple[Any, int] | None = None
        self._tf_data: EpochIterator | None = None  # fit's epoch iterator over a tf.data input
        self._iterator_state: Any = None  # to restore before the resumed epoch's first batch
        self._at = (0, 0)  # the batch boundary the training thread is at
        self._handler: Any = None
        self._preemption: dict = {}
        self.preempted = False

    # -- introspection -----------------------------------------------------------

    @property
    def store(self) -> ArrayStore | None:
        """The backing ``ArrayStore`` during ``fit`` (stats: ``store.engine.history``)."""
        return self._store

    @property
    def preemption_handler(self) -> Any:
        """The ``PreemptionCheckpointHandler`` of the current (or last) ``fit``, or None."""
        return self._handler

    @property
    def restored_position(self) -> tuple[int, int] | None:
        """(epoch, batch) this ``fit`` resumed at, or None if it started fresh."""
        if self._restored is None:
            return None
        m = self._restored.metadata
        return int(m["epoch"]), int(m["batch"])

    # -- Keras's attribute names (its own tests, and code written for it, read them) --

    @property
    def _current_epoch(self) -> int:
        """The epoch a backup taken now resumes at (Keras: ``epoch + 1`` once it ended)."""
        return self._epoch + 1 if self._epoch_done else self._epoch

    @property
    def _last_batch_seen(self) -> int:
        """Index of the last batch of the current epoch trained (0 once it ended, as Keras)."""
        return 0 if self._epoch_done else max(self._batch - 1, 0)

    @property
    def _weights_path(self) -> str | None:
        """The newest backup's array file (Keras: ``latest.weights.h5``)."""
        return self._backup_file(-1, DATA_NAME)

    @property
    def _training_metadata_path(self) -> str | None:
        """The newest backup's index, which holds its position (Keras: a JSON file)."""
        return self._backup_file(-1, INDEX_NAME)

    @property
    def _prev_weights_path(self) -> str | None:
        """The previous backup's array file (``double_checkpoint=True``)."""
        return self._backup_file(-2, DATA_NAME)

    @property
    def _prev_training_metadata_path(self) -> str | None:
        """The previous backup's index (``double_checkpoint=True``)."""
        return self._backup_file(-2, INDEX_NAME)

    def _backup_file(self, which: int, name: str) -> str | None:
        """A file of the newest (-1) or previous (-2) backup once every save so far is durable.

        None if there is no such backup.
        """
        if self._store is not None:
            self._store.wait_until_finished()
        if self._store is not None:
            steps = self._store.all_steps()
        else:  # between fits: read only, no store is open
            steps = ArrayStore.committed_steps(os.path.abspath(self.backup_dir))
        if len(steps) < -which:
            return None
        return os.path.join(os.path.abspath(self.backup_dir), str(steps[which]), name)

    # -- fit lifecycle ---------------------------------------------------------------

    def on_train_begin(self, logs=None):
        if self._store is not None:  # a previous fit() raised; flush what it started
            self._finish()
        self._reset_run()
        self._siblings, self._after = _callbacks.find_siblings(self)
        self._tf_data = _tfdata.find_tf_data_input()
        store = self._make_store()
        with _OPEN_LOCK:
            left = _OPEN.pop(store.directory, None)
        if left is not None:
            left.close()
        self._store = store
        with _OPEN_LOCK:
            _OPEN[store.directory] = store
        steps = store.all_steps()
        if steps:
            self._restored = store.restore()  # the newest that verifies
            self._drop_unverified(store, [s for s in steps if s > self._restored.step])
            meta = self._restored.metadata
            self._global = self._last_saved = int(meta["global_batches"])
            self._since = int(meta.get("since", 0))
            epoch, batch = int(meta["epoch"]), int(meta["batch"])
            self._last_position = (epoch, batch)
            self._last_step = self._restored.step
            self._saved_stopped = bool(meta.get("stopped"))
            self._next_step = self._restored.step + 1
            if meta.get("stopped"):
                epoch = max(epoch, int(self.params.get("epochs", epoch)))
            self._model._initial_epoch = epoch
            if epoch >= int(self.params.get("epochs", epoch + 1)):
                # fit() will run no epoch: restore now, so the model ends as trained.
                self._apply_restored(callbacks=False)
            logger.info("resuming from backup %d in %s at epoch %d, batch %d",
                        self._restored.step, self.backup_dir, epoch, batch)
            if batch and self.data is None and not self._resumes_tf_data():
                warnings.warn(
                    f"the backup was taken at batch {batch} of epoch {epoch}; without "
                    "`data=ResumableDataset(...)` or a tf.data iterator state (TensorFlow "
                    "backend) the epoch is run again from its first batch",
                    stacklevel=2,
                )
        self._start_preemption()

    def _make_store(self) -> ArrayStore:
        return ArrayStore(
            self.backup_dir,
            # The newest (and with double_checkpoint the previous) backup; a
            # backup taken again at the same position replaces its first copy.
            max_to_keep=2 if self.double_checkpoint else 1,
            options=self.options.async_options,
            name="asyncckpt.keras.backup",
        )

    def _drop_unverified(self, store: ArrayStore, steps: list[int]) -> None:
        """Removes backups newer than the one restored: they did not verify."""
        if not steps:
            return
        logger.warning(
            "the newest backup(s) %s in %s do not verify (corrupt or partial); resuming "
            "from the previous backup %d, and removing them", steps, self.backup_dir,
            self._restored.step)
        for s in steps:
            store.delete(s)

    # -- preemption ---------------------------------------------------------------------

    def _start_preemption(self) -> None:
        opts = self.options.preemption_options()
        if opts is None:
            return
        from asyncckpt._coordination import auto_coordinator
        from asyncckpt.preemption import PreemptionCheckpointHandler

        coordinator = opts.coordinator or auto_coordinator(
            "jax" if keras.backend.backend() == "jax" else "tensorflow")
        self._handler = PreemptionCheckpointHandler(
            self, termination_config=opts.termination_config, coordinator=coordinator,
            grace_options=opts.grace_options, agreement_options=opts.agreement_options)

    def make_preemption_target(self, *, worker_id: int, num_workers: int) -> KerasTarget:
        """The handler's target (called by ``PreemptionCheckpointHandler``)."""
        del worker_id, num_workers  # every worker backs up into its own backup_dir
        if self.store is None:
            raise TypeError(
                "a BackupAndRestore's preemption handler is created by the callback during "
                "fit(): pass BackupOptions(preemption=PreemptionOptions(...)) instead of "
                "giving the callback to PreemptionCheckpointHandler yourself"
            )
        return KerasTarget(self.store, bookkeeping=self._preemption_bookkeeping,
                           track=self._preemption_track, save=self._preemption_save)

    def _preemption_bookkeeping(self) -> tuple[int, dict]:
        """The handler's run count (= batches trained) and estimates from the backup."""
        estimates = {}
        if self._restored is not None:
            estimates = dict(self._restored.metadata.get(METADATA_KEY, {}).get("estimates") or {})
        self._preemption = {"estimates": estimates}
        return self._global, estimates

    def _preemption_track(self, runs: int, estimates: dict | None) -> None:
        self._preemption["total_run_calls"] = runs
        if estimates is not None:
            self._preemption["estimates"] = estimates

    def _preemption_save(self) -> None:
        self._save(*self._at)

    def _preemption_boundary(self) -> None:
        """Tells the handler of each batch trained since the last boundary; it may save/exit.

        The handler is called before each batch (as TensorFlow's is before each
        step): the call at ``total_run_calls == self._global`` decides here,
        with the model holding that many batches, and counts the next one.
        """
        handler = self._handler
        try:
            while handler.total_run_calls <= self._global:
                handler.save_checkpoint_if_preempted()
        except BaseException:  # exit_fn's SystemExit, or a peer's failure
            self.preempted = handler.preempted
            self._finish()
            raise
        self.preempted = handler.preempted

    def on_epoch_begin(self, epoch, logs=None):
        if self._first_epoch:
            self._first_epoch = False
            offset = 0
            if self._restored is not None:
                saved_epoch = int(self._restored.metadata["epoch"])
                if epoch == saved_epoch and self.data is not None:
                    offset = int(self._restored.metadata["batch"])
                elif epoch == saved_epoch and self._resumes_tf_data():
                    offset = int(self._restored.metadata["batch"])
                    self._iterator_state = self._restored.arrays[_tfdata.ITERATOR_KEY]
                # The metric accumulators only where the epoch goes on from the saved
                # batch; otherwise fit() has just reset them for an epoch's start.
                self._apply_restored(metrics=offset > 0)
        else:
            offset = 0
            if self._tf_data is None:
                # With tf.data the epoch's iterator exists only once its first batch
                # is fetched: the boundary is taken at that batch instead.
                self._boundary(epoch, 0)
        self._epoch, self._offset, self._batch = epoch, offset, offset
        self._epoch_done = False
        if self.data is not None:
            self.data.set_position(epoch, offset)
        if offset:
            self._shorten_epoch(offset)

    def _resumes_tf_data(self) -> bool:
        return (self._tf_data is not None and self._restored is not None
                and _tfdata.ITERATOR_KEY in self._restored.arrays)

    def _shorten_epoch(self, offset: int) -> None:
        """Makes ``fit`` count ``offset`` fewer batches in this epoch.

        Letting the data run out instead is not safe on TensorFlow: the
        traced step that meets the end of the data can still run its
        data-independent ops (the optimizer's ``iterations += 1``) before the
        error stops it.
        """
        iterator = _callbacks.find_local("epoch_iterator", EpochIterator)
        if iterator is None or iterator.steps_per_epoch or not iterator._num_batches:
            raise RuntimeError(
                "cannot resume mid-epoch: fit()'s epoch iterator was not found or has "
                "steps_per_epoch set (exact resumes need steps_per_epoch=None)"
            )
        self._shortened = (iterator, iterator._num_batches)
        iterator._num_batches = iterator._num_batches - offset

    def on_train_batch_begin(self, batch, logs=None):
        if self._iterator_state is not None:
            state, self._iterator_state = self._iterator_state, None
            _tfdata.restore(self._tf_data, state)
        self._boundary(self._epoch, batch + self._offset)

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1 Keras reports the last batch of each
        # group, so count what the index advanced, not calls.
        done = batch + self._offset + 1
        ran = max(1, done - self._batch)
        self._batch = done
        self._global += ran
        if isinstance(self.save_freq, int):
            self._since += ran
            if self._since >= self.save_freq:
                self._since = 0
                steps = (self.params or {}).get("steps")
                if steps and done >= steps:
                    self._pending = True  # the epoch ends next: taken at its end
                else:
                    self._take_due(self._epoch, done, epoch_end=False)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_done = True
        if self._shortened is not None:
            iterator, full = self._shortened
            iterator._num_batches = full
            self._shortened = None
        if self.save_freq == "epoch" or self._pending:
            if self._tf_data is not None:
                # Exact resumes need the next epoch's iterator, which exists from that
                # epoch's first batch: the backup is taken there (_boundary).
                self._pending = True
            else:
                self._take_due(epoch + 1, 0, epoch_end=True)

    def on_train_end(self, logs=None):
        store = self._store
        try:
            if store is None:
                return
            if self._first_epoch and self._restored is not None:
                # No epoch ran (the backup is at the end): hand the callbacks their state.
                self._apply_restored(model=False)
            if self.delete_checkpoint:
                store.delete_all()
            else:
                position = (self._epoch + 1, 0) if self._epoch_done else (self._epoch, self._batch)
                stopped = bool(self._model.stop_training)
                retake = self._incomplete() or (stopped and not self._saved_stopped)
                # No iterator state: the iterator of an epoch that has not begun is
                # not the one that epoch will use (Keras makes another).
                self._save(*position, stopped=stopped, iterator=False, retake=retake)
                store.wait_until_finished()
        finally:
            self._finish()

    def _finish(self) -> None:
        if self._handler is not None:
            self._handler.close()  # the object stays readable (saves, preempted)
        if self._store is not None:
            store, self._store = self._store, None
            with _OPEN_LOCK:
                if _OPEN.get(store.directory) is store:
                    del _OPEN[store.directory]
            store.close()
        self._model._initial_epoch = None

    # -- saving ----------------------------------------------------------------------------

    def _boundary(self, epoch: int, batch: int) -> None:
        """Runs at a batch boundary: every callback has seen what came before it."""
        self._at = (epoch, batch)
        if self._incomplete():
            self._save(epoch, batch, retake=True)
        elif self._pending:
            self._save(epoch, batch)
        self._pending = False
        self._recheck = None
        if self._handler is not None:
            self._preemption_boundary()

    def _take_due(self, epoch: int, batch: int, *, epoch_end: bool) -> None:
        """Takes the backup that fell due, before the callbacks listed after this one run."""
        self._pending = False
        stopped = epoch_end and bool(self._model.stop_training)
        # No iterator state at an epoch end: the iterator of an epoch that has not
        # begun is not the one that epoch will use (Keras makes another).
        if self._save(epoch, batch, stopped=stopped, iterator=not epoch_end):
            # What the callbacks listed after this one may still change at this
            # batch or epoch end.
            self._recheck = _callbacks.collect(self._after)

    def _incomplete(self) -> bool:
        """Whether the newest backup, taken at a due point, misses what came after it.

        True when a callback listed after this one changed its recorded state
        while it processed the same batch or epoch end.
        """
        check = self._recheck
        if check is None or self._last_saved != self._global:
            return False
        return not _callbacks.same_state(check, _callbacks.collect(self._after))

    def _save(self, epoch: int, batch: int, *, stopped: bool = False,
              iterator: bool = True, retake: bool = False) -> bool:
        """Backs up the state at (epoch, batch); False if that backup exists already."""
        self._recheck = None
        if (not retake and self._last_saved == self._global
                and self._last_position == (epoch, batch)):
            return False  # nothing trained since the last backup, at the same position
        if self._reader is None and keras.backend.backend() == "tensorflow":
            self._reader = _state.tf_reader()
        arrays, paths = _state.snapshot_sources(self._model, self._reader)
        cb_states, cb_arrays = _callbacks.collect(self._siblings)
        arrays.update(cb_arrays)
        if iterator and self._tf_data is not None:
            state = _tfdata.serialize(self._tf_data)
            if state is not None:
                arrays[_tfdata.ITERATOR_KEY] = state
        metadata = {
            "epoch": epoch,
            "batch": batch,
            "global_batches": self._global,
            "since": self._since,
            "stopped": stopped,
            "paths": paths,
            "callbacks": cb_states,
            "backend": keras.backend.backend(),
            METADATA_KEY: self._preemption,
            "keras_version": keras.__version__,
        }
        # The global batch count, or one past the previous backup where that is more
        # (a backup taken again at the same position; steps must grow).
        step = max(self._global, self._next_step)
        replaces = ([self._last_step] if retake and self._last_saved == self._global
                    and self._last_step is not None else [])
        self._store.save(step, arrays, metadata, replaces=replaces)
        self._next_step = step + 1
        self._last_saved, self._last_position, self._last_step = self._global, (epoch, batch), step
        self._saved_stopped = stopped
        return True

    def _apply_restored(self, *, model: bool = True, callbacks: bool = True,
                        metrics: bool = True) -> None:
        r = self._restored
        if not model:
            _callbacks.apply(self._siblings, r.metadata.get("callbacks", {}), r.arrays)
            return
        model = self._model
        paths = r.metadata["paths"]

        def mismatch() -> bool:
            _state.ensure_optimizer_built(model)
            have = _state.count_variables(model)
            return any(len(paths.get(g, [])) != have[g] for g in _state.GROUPS)

        if mismatch() and not _state.fully_built(model):
            batch = self.data.batch(0, 0) if self.data is not None else _first_batch()
            if batch is None:
                raise ValueError(
                    f"cannot restore {self.backup_dir!r} into an unbuilt model: build it "
                    "(call it on a batch) before fit(), or pass data=ResumableDataset(...)"
                )
            # What the JAX trainer does before every fit; the TensorFlow trainer
            # builds lazily in the first step, too late for a restore.
            model._symbolic_build(data_batch=batch)
        if mismatch():
            have = _state.count_variables(model)
            raise ValueError(
                f"cannot restore {self.backup_dir!r}: the backup holds "
                f"{ {g: len(p) for g, p in paths.items()} } variables per group, the model "
                f"{have}. Build the model (and compile it the same way) before fit()."
            )
        _state.assign_state(model, r.arrays, paths,
                            groups=_state.GROUPS if metrics else _state.MODEL_GROUPS)
        if not callbacks:
            return
        matched = _callbacks.apply(self._siblings, r.metadata.get("callbacks", {}), r.arrays)
        logger.info("restored the model, the optimizer and %d callback(s) from backup %d",
                    matched, r.step)


def _first_batch() -> Any | None:
    """The first rows of fit()'s array input (NumPy arrays or tensors), if that is its input.

    Read from the arrays directly, so no iterator or random state is touched.
    For a ``tf.data`` input: its element spec (shapes and dtypes suffice).
    """
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    iterator = _callbacks.find_local("epoch_iterator", EpochIterator)
    adapter = getattr(iterator, "data_adapter", None)
    spec = _tfdata.input_spec(adapter)
    if spec is not None:
        return spec
    if not isinstance(adapter, ArrayDataAdapter):
        return None
    rows = adapter.batch_size or 1
    return keras.tree.map_structure(
        lambda a: None if a is None else keras.ops.convert_to_numpy(a[:rows]), adapter._inputs
    )

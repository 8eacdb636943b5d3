"""``asyncckpt.tf.Checkpoint``: a ``tf.train.Checkpoint`` whose saves are asynchronous."""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from asyncckpt import errors, layout
from asyncckpt._closing import ClosingContext
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.manifest import is_owned, load_manifest, verify_files
from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.writer import AsyncEngine, SaveHandle
from asyncckpt.options import AsyncOptions, RestoreOptions
from asyncckpt.storage.tier import RemoteOptions
from asyncckpt.storage.url import is_url
from asyncckpt.tf import _compat, _inflight, _partial, _restore, _snapshot, _urls
from asyncckpt.tf._compat import tf
from asyncckpt.tf._job import CommitCallback, TFSaveJob, delete_checkpoint, manifest_path
from asyncckpt.tf._partial import PartialRestore

logger = logging.getLogger(__name__)


class CheckpointNotFoundError(errors.CheckpointNotFoundError, tf.errors.NotFoundError):
    """No checkpoint at the path asked for.

    Both a ``tf.errors.NotFoundError`` (what ``tf.train.Checkpoint.restore``
    raises) and asyncckpt's ``CheckpointNotFoundError`` (a ``FileNotFoundError``).
    """

    def __init__(self, message: str):
        tf.errors.NotFoundError.__init__(self, None, None, message)
        errors.CheckpointNotFoundError.__init__(self, message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.message,))


def _fspath(path) -> str:
    """A path from a str, a path-like object or (eagerly) a string tensor, as TF takes."""
    if isinstance(path, os.PathLike):
        return os.fspath(path)
    if tf.is_tensor(path):
        value = path.numpy()
        return value.decode() if isinstance(value, bytes) else str(value)
    return str(path)


def _verified(prefix: str, *, checksums: bool) -> None:
    """A copy fetched from object storage: the fetch has verified it already."""


def verify_checkpoint(prefix: str, *, checksums: bool = True) -> bool:
    """Checks a TensorFlow checkpoint against its asyncckpt manifest.

    Returns:
        True if a manifest was found and every file matches it; False for a
        checkpoint without a manifest written by plain TensorFlow, which is
        accepted as is.

    Raises:
        CheckpointNotFoundError: No checkpoint exists at ``prefix`` (also a
            ``tf.errors.NotFoundError``).
        CorruptCheckpointError: A file is missing, truncated or corrupt, or
            the manifest of a checkpoint asyncckpt wrote is missing.
    """
    if not os.path.exists(prefix + ".index"):
        raise CheckpointNotFoundError(
            f"Error when restoring from checkpoint or SavedModel at {prefix!r}: "
            f"no TensorFlow checkpoint there (missing {prefix + '.index'!r}). Please "
            "double-check that the path is correct; you may be missing the checkpoint "
            "suffix (e.g. the '-1' in 'path/to/ckpt-1')."
        )
    owned = is_owned(prefix, marker_suffix=".index")  # then a missing manifest is corruption
    manifest = load_manifest(manifest_path(prefix), checkpoint=prefix, owned=owned)
    if manifest is None:
        logger.debug("%s has no asyncckpt manifest; restoring without verification", prefix)
        return False
    verify_files(
        os.path.dirname(os.path.abspath(prefix)),
        manifest.files,
        checksums=checksums,
        checkpoint=prefix,
    )
    return True


# -- tf.train.CheckpointOptions -------------------------------------------------


@dataclass(frozen=True)
class WriteOptions:
    """What asyncckpt takes from a ``tf.train.CheckpointOptions`` for a save."""

    io_device: str | None = None
    callbacks: tuple[Callable, ...] = ()


_DEFAULT_WRITE = WriteOptions()


def _callback_arity(callback: Callable) -> int:
    if not callable(callback):
        raise TypeError(f"experimental_write_callbacks holds a non-callable: {callback!r}")
    n = len(inspect.signature(callback).parameters)
    if n > 1:
        raise TypeError(
            "checkpoint write callbacks take 0 or 1 parameters (the save path), "
            f"{callback!r} takes {n}"
        )
    return n


def write_options(options) -> WriteOptions:
    """Validates ``options`` for an asynchronous save.

    ``enable_async``/``experimental_enable_async_checkpoint`` are accepted (the
    save is asynchronous anyway); ``experimental_skip_slot_variables`` only
    concerns restores; a sharding callback other than TensorFlow's default
    (one data file per task, which is what asyncckpt writes) is refused.
    """
    if options is None:
        return _DEFAULT_WRITE
    if not isinstance(options, tf.train.CheckpointOptions):
        raise TypeError(f"options must be a tf.train.CheckpointOptions, got {options!r}")
    if not _compat.is_default_sharding(options.experimental_sharding_callback):
        raise NotImplementedError(
            "asyncckpt.tf writes one data file per checkpoint and cannot honour "
            f"experimental_sharding_callback={options.experimental_sharding_callback!r}; "
            "save with tf.train.Checkpoint to shard the files"
        )
    callbacks = tuple(options.experimental_write_callbacks or ())
    for cb in callbacks:
        _callback_arity(cb)
    return WriteOptions(io_device=options.experimental_io_device, callbacks=callbacks)


def _synchronous_tf_options(options):
    """``options`` with TensorFlow's own async switched off (for the fallback path)."""
    if options is None:
        return None
    options = copy.copy(options)
    options.enable_async = False
    options.experimental_enable_async_checkpoint = False
    return options


class _OnCommitted:
    """Runs on the writer thread once a checkpoint is durable.

    The user's ``experimental_write_callbacks`` first (as TensorFlow does,
    before its own state-file update), then the internal bookkeeping, which
    runs even if a user callback raises. Holds no reference to the checkpoint.
    """

    def __init__(self, callbacks: tuple[Callable, ...], internal: CommitCallback | None):
        self.callbacks = callbacks
        self.internal = internal

    def __call__(self, path: str, stats: SaveStats) -> None:
        with _inflight.callback_scope():
            try:
                for cb in self.callbacks:
                    if _callback_arity(cb) == 0:
                        cb()
                    else:
                        cb(path)
            finally:
                if self.internal is not None:
                    self.internal(path, stats)


def _record_at_call(manager: tf.train.CheckpointManager, callback: Callable[[str], None],
                    prefix: str) -> None:
    """Runs a ``tf.train.CheckpointManager``'s bookkeeping of a save at the ``save()`` call.

    As over ``tf.train.Checkpoint``, whose synchronous write calls it before
    ``save()`` returns: ``latest_checkpoint``, ``checkpoints`` and the
    ``checkpoint`` state file name ``prefix`` at once, so code built on the
    manager (a ``SavedModel`` export kept per checkpoint, a recovery that
    calls ``restore_or_initialize()``) sees the new checkpoint. Its files
    follow once durable: ``restore()`` of ``prefix`` waits for them
    (``_inflight``); ``tf.train.latest_checkpoint`` returns None until then
    (TensorFlow checks the files exist).

    The manager's retention deletes the checkpoints that fall out of
    ``max_to_keep`` in the same call. One still being written (saves in
    flight beyond ``max_to_keep``) is waited for first, so TensorFlow
    deletes a complete checkpoint, never one whose files appear after (left
    behind, untracked) or half of one being published; the manifest each
    deleted checkpoint leaves (TensorFlow knows only the index and data
    files) goes too.
    """
    dropped = _compat.dropped_by_save(manager, prefix)
    for path in dropped:
        _inflight.wait_for(path)
    callback(prefix)
    for path in dropped:
        if not is_url(path) and not os.path.lexists(path + layout.TF_INDEX_SUFFIX):
            delete_checkpoint(path)  # deleted by the manager (not kept for the n hours)


_STATE_FILE_LOCK = threading.Lock()


def _record_latest(path: str, stats: SaveStats, *, fsync: bool) -> None:
    """What ``tf.train.Checkpoint.save`` does after writing: point the state file at it."""
    del stats
    directory = os.path.dirname(os.path.abspath(path))
    rel = os.path.basename(path)
    with _STATE_FILE_LOCK:
        text = _compat.checkpoint_state_text(directory, rel, [rel], [], 0.0)
        commit_lib.write_text_atomic(os.path.join(directory, "checkpoint"), text, fsync=fsync)


# -- per-checkpoint asynchronous state ------------------------------------------


class AsyncState:
    """The asynchronous machinery of one Checkpoint, invisible to tracking.

    Not a trackable, so ``tf.train.Checkpoint``'s dependency tracking ignores
    it; a deep copy of the checkpoint gets a fresh one (no engine, thread or
    lock is copied). The engine is created on the first save.
    """

    def __init__(self, options: AsyncOptions, restore_options: RestoreOptions,
                 wraps: tf.train.Checkpoint | None,
                 remote_options: RemoteOptions | None = None):
        self.options = options
        self.restore_options = restore_options
        self.wraps = wraps  # the tf.train.Checkpoint whose graph is saved (see wrap), or None
        self.urls = _urls.URLDirectories(remote_options)  # s3:// and gs:// prefixes
        self.stager = _snapshot.Stager()
        self.checked_dirs: set[str] = set()
        self.last_save: SaveHandle | None = None
        self._engine: AsyncEngine | None = None
        self._lock = threading.Lock()

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    self._engine = AsyncEngine(options=self.options, name="asyncckpt.tf")
        return self._engine

    @property
    def engine_if_any(self) -> AsyncEngine | None:
        return self._engine

    def __deepcopy__(self, memo) -> AsyncState:
        return AsyncState(self.options, self.restore_options, copy.deepcopy(self.wraps, memo),
                           self.urls.options)


class _Attribute:
    """A read-only attribute that yields to a tracked attribute of the same name.

    A non-data descriptor: ``ckpt.engine = tf.Variable(...)`` stores and
    tracks a child as ``tf.train.Checkpoint`` would (any name is allowed
    there), and from then on that child is what the name gives.
    """

    def __init__(self, getter):
        self._getter = getter
        self.__doc__ = getter.__doc__

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return self._getter(instance)


def _graph_checkpoint(instance):
    """The ``tf.train.Checkpoint`` whose graph is saved: the wrapped one, or itself."""
    state = instance.__dict__.get("_asyncckpt")
    if state is not None and state.wraps is not None:
        return state.wraps
    return instance


class Checkpoint(tf.train.Checkpoint, ClosingContext):
    """A ``tf.train.Checkpoint`` whose ``save()`` and ``write()`` are asynchronous.

    It is a ``tf.train.Checkpoint`` (dependency tracking, nesting, restore,
    SavedModel directories, ``CheckpointOptions``); ``save()`` and ``write()``
    block only while the values are snapshotted (read; GPU/TPU values copied
    to the host) and return the checkpoint path at once, while background
    threads copy and write TensorFlow-native files. Inside a ``tf.function`` or in graph mode, where
    no host copy can be taken, they run TensorFlow's own synchronous save.

    Example::

        ckpt = asyncckpt.tf.Checkpoint(model=model, optimizer=optimizer)
        ckpt.step = tf.Variable(0)               # tracked and saved, as in TF
        path = ckpt.save("/tmp/run/ckpt")        # returns after the snapshot
        ckpt.restore(path)                       # waits for that save first
        ckpt.sync()                              # or: wait until all are durable

    Args:
        root: As for ``tf.train.Checkpoint`` (a trackable or a weak reference).
        async_options: Staging slots, fsync and checksums.
        restore_options: Verification done by ``restore``/``read``.
        remote_options: Retries and parallelism of saves to and restores
            from ``s3://`` / ``gs://`` prefixes (its schedule does not apply:
            every such save is uploaded; ``max_to_keep`` is refused, as
            ``save()`` deletes nothing).
        **kwargs: Trackable objects to save, as for ``tf.train.Checkpoint``.
    """

    checkpoint = _Attribute(_graph_checkpoint)

    # The format writer of each save (the background part); a subclass may set a
    # TFSaveJob subclass of its own (one that holds or fails writes).
    _job_class: type[TFSaveJob] = TFSaveJob

    def __init__(
        self,
        root=None,
        *,
        async_options: AsyncOptions | None = None,
        restore_options: RestoreOptions | None = None,
        remote_options: RemoteOptions | None = None,
        **kwargs,
    ):
        super().__init__(root=root, **kwargs)
        self._asyncckpt = AsyncState(
            async_options or AsyncOptions(), restore_options or RestoreOptions(), wraps=None,
            remote_options=remote_options,
        )

    @classmethod
    def wrap(
        cls,
        checkpoint: tf.train.Checkpoint,
        *,
        async_options: AsyncOptions | None = None,
        restore_options: RestoreOptions | None = None,
        remote_options: RemoteOptions | None = None,
    ) -> Checkpoint:
        """An asyncckpt Checkpoint that saves ``checkpoint``'s object graph.

        Its saves write exactly what ``checkpoint.save``/``write`` would
        (``checkpoint`` is the root of the saved graph, and its
        ``save_counter`` numbers the saves); an ``asyncckpt.tf.Checkpoint``
        is returned as is.
        """
        if isinstance(checkpoint, Checkpoint):
            if (async_options, restore_options, remote_options) != (None, None, None):
                raise ValueError(
                    "cannot change the options of an existing asyncckpt.tf.Checkpoint"
                )
            return checkpoint
        if not isinstance(checkpoint, tf.train.Checkpoint):
            raise TypeError(
                f"expected a tf.train.Checkpoint, got {type(checkpoint).__name__}"
            )
        self = cls(async_options=async_options, restore_options=restore_options,
                   remote_options=remote_options)
        _compat.save_graph_of(self, checkpoint)
        self._asyncckpt.wraps = checkpoint
        return self

    # -- asyncckpt additions -----------------------------------------------------

    # Read-only attributes that yield to tracked children of the same name.

    @_Attribute
    def async_options(self) -> AsyncOptions:
        """Staging slots, fsync and checksums of the saves."""
        return self._asyncckpt.options

    @_Attribute
    def restore_options(self) -> RestoreOptions:
        """Verification done by ``restore``/``read``."""
        return self._asyncckpt.restore_options

    @_Attribute
    def last_save(self) -> SaveHandle | None:
        """Handle of the most recent save (``committed`` resolves when durable)."""
        return self._asyncckpt.last_save

    @_Attribute
    def engine(self) -> AsyncEngine:
        """The background engine: stats, ``estimated_write_s``, pending count."""
        return self._asyncckpt.engine

    def _check_dir(self, prefix: str) -> None:
        if self._asyncckpt.urls.target(prefix) is not None:  # s3:// / gs://; others raise
            return
        directory = os.path.dirname(os.path.abspath(prefix))
        checked = self._asyncckpt.checked_dirs
        if directory not in checked:
            commit_lib.ensure_writable_dir(directory)
            checked.add(directory)

    def write_async(
        self,
        file_prefix,
        *,
        step: int | None = None,
        on_committed: CommitCallback | None = None,
        extra: dict | None = None,
        options=None,
    ) -> SaveHandle:
        """Stages the state and returns a handle; the lower-level ``write``.

        Args:
            file_prefix: Checkpoint prefix, used as is.
            step: Step recorded in the manifest.
            on_committed: Called on the writer thread once the checkpoint is
                durable (managers use it to update the state file), after
                the write callbacks of ``options``.
            extra: Additional manifest data.
            options: A ``tf.train.CheckpointOptions``.
        """
        prefix = _fspath(file_prefix)
        if not prefix:
            raise ValueError("file_prefix must be a non-empty path")
        return stage_save(self, prefix, write_options(options), step, on_committed, extra)

    # -- tf.train.Checkpoint's saving API ----------------------------------------

    def write(self, file_prefix, options=None):
        """Writes without numbering or updating the ``checkpoint`` state file.

        Returns ``file_prefix`` at once; the files appear there once the save
        is durable (``sync()``, ``last_save``). Write callbacks in ``options``
        run on the writer thread after the commit, except the bookkeeping of
        a ``tf.train.CheckpointManager``, which runs before this returns (see
        ``_record_at_call``).
        """
        if isinstance(file_prefix, os.PathLike):
            file_prefix = os.fspath(file_prefix)
        return self._write(file_prefix, options)

    def _write(self, file_prefix, options=None):
        # tf.train.Checkpoint.save and tf.train.CheckpointManager.save both end here.
        if not _compat.executing_eagerly():
            return super()._write(file_prefix, _synchronous_tf_options(options))
        prefix = _fspath(file_prefix)
        if not prefix:
            raise ValueError("file_prefix must be a non-empty path")
        wopts = write_options(options)
        bookkeeping = [(m, cb) for cb in wopts.callbacks
                       if (m := _compat.manager_of_write_callback(cb)) is not None]
        if bookkeeping:  # the user's own callbacks still run once the save is durable
            done = {id(cb) for _, cb in bookkeeping}
            wopts = WriteOptions(io_device=wopts.io_device,
                                 callbacks=tuple(cb for cb in wopts.callbacks
                                                 if id(cb) not in done))
        stage_save(self, prefix, wopts, None, None, None)
        for manager, callback in bookkeeping:
            _record_at_call(manager, callback, prefix)
        return prefix

    def save(self, file_prefix, options=None):
        """Numbered save, like ``tf.train.Checkpoint.save``.

        Increments ``save_counter``, writes ``<file_prefix>-<counter>`` in the
        background, and records it in the directory's ``checkpoint`` file once
        it is durable, so ``tf.train.latest_checkpoint`` never names a partial
        checkpoint.

        Returns:
            The checkpoint path, ``<file_prefix>-<counter>``.
        """
        if not _compat.executing_eagerly():
            return super().save(file_prefix, _synchronous_tf_options(options))
        wopts = write_options(options)
        prefix = _fspath(file_prefix)
        self._check_dir(prefix)
        engine = self._asyncckpt.engine
        engine.raise_pending_error()  # before counting a save that would fail
        counter = self.save_counter
        number = int(counter.assign_add(1, read_value=True).numpy())
        path = f"{prefix}-{number}"
        record = functools.partial(_record_latest, fsync=self._asyncckpt.options.fsync)
        target = self._asyncckpt.urls.target(path)
        if target is not None:  # the state file goes to the bucket too
            record = functools.partial(target.record_latest, local=record.func,
                                       fsync=self._asyncckpt.options.fsync)
        try:
            stage_save(self, path, wopts, number, record, None)
        except BaseException:
            counter.assign_sub(1)  # nothing was saved under this number
            raise
        return path

    # -- waiting -------------------------------------------------------------------

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Waits until every save so far is durable; re-raises background errors.

        asyncckpt's one spelling of the wait, on every object that saves in
        the background; ``sync()`` is TensorFlow's, and the same.
        """
        engine = self._asyncckpt.engine_if_any
        if engine is not None:
            engine.wait_until_finished(timeout)

    def sync(self, timeout: float | None = None) -> None:
        """TensorFlow's ``tf.train.Checkpoint.sync()``: ``wait_until_finished``."""
        self.wait_until_finished(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flushes saves in flight and frees the staging memory."""
        engine = self._asyncckpt.engine_if_any
        try:
            if engine is not None:
                engine.close(timeout)
        finally:
            try:
                self._asyncckpt.urls.close(timeout)
            finally:
                self._asyncckpt.stager.clear()

    # -- restoring -----------------------------------------------------------------

    def _prepare_read(self, path: str, options=None) -> tuple[str, _restore.Serving]:
        """Waits for a save of ``path`` in flight and verifies it.

        Returns:
            What to read (for an ``s3://`` / ``gs://`` prefix, a verified local
            copy) and the context the TensorFlow read runs in (the fast
            restore path when it applies).
        """
        _inflight.wait_for(path)
        engine = self._asyncckpt.engine_if_any
        if engine is not None:
            engine.make_room_for_restore()  # idle staging gives way (host memory budget)
        checksums = self._asyncckpt.restore_options.checksums
        target = self._asyncckpt.urls.target(path)
        if target is None:
            return path, _restore.prepared(path, options=options, verify=verify_checkpoint,
                                           checksums=checksums, root=self)
        try:
            local = target.fetch(checksums=checksums, verify_local=functools.partial(
                verify_checkpoint, checksums=checksums))
        except errors.CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(str(e)) from None
        # Verified by the fetch: the fast path still checks what it reads.
        return local, _restore.prepared(local, options=options, verify=_verified,
                                        checksums=checksums, root=self)

    def restore(self, save_path, options=None):
        """Restores like ``tf.train.Checkpoint.restore``, after verifying the files.

        A path whose save is still in flight in this process is waited for
        first, so a path just returned by ``save()`` can be restored at once.
        A SavedModel directory restores its variables, as in TensorFlow.

        Raises:
            CheckpointNotFoundError: Nothing is saved at ``save_path`` (a
                ``tf.errors.NotFoundError``).
            CorruptCheckpointError: A file fails the manifest check.
        """
        options = _synchronous_tf_options(options)
        if save_path is None or not _compat.executing_eagerly():
            return super().restore(save_path, options)
        path = _fspath(save_path)
        if not is_url(path):
            path = _compat.saved_model_variables_path(path) or path
        path, context = self._prepare_read(path, options)
        with context:  # the save counter is created (and restored) inside: read by us
            status = tf.train.Checkpoint.read(self, path, options)
            self._maybe_create_save_counter()
            context.keep(status)  # deferred restorations of objects created later
        if _compat.is_name_based_status(status):
            status.add_to_optionally_restored(self.save_counter)
        return status

    def restore_partial(
        self, save_path, options=None, *, only: Iterable[str] | None = None
    ) -> PartialRestore:
        """Restores what matches and says what was skipped.

        Like ``restore(save_path).expect_partial()``, and returns a
        ``PartialRestore`` naming the checkpoint objects and keys that were
        not restored and this checkpoint's objects that got no value.

        Args:
            save_path: As for ``restore``.
            options: As for ``restore``.
            only: Restore only these attributes of this checkpoint (for
                example ``["model"]`` to leave the optimizer as it is);
                everything else in the file is reported as skipped.
        """
        if only is None:
            target = self
        else:
            root = _compat.graph_view_of(self).root  # what the saved paths start from
            names = list(only)
            children = {n: _compat.lookup_dependency(root, n) for n in names}
            missing = [n for n, child in children.items() if child is None]
            if missing:
                raise ValueError(f"this checkpoint has no attribute(s) {missing} to restore")
            target = Checkpoint(restore_options=self._asyncckpt.restore_options, **children)
        status = target.restore(save_path, options)
        return _partial.report(status, target)

    def read(self, save_path, options=None):
        """Like ``tf.train.Checkpoint.read`` (no ``save_counter`` expected)."""
        options = _synchronous_tf_options(options)
        if save_path is not None and _compat.executing_eagerly():
            save_path, context = self._prepare_read(_fspath(save_path), options)
            with context:
                status = super().read(save_path, options)
                context.keep(status)
                return status
        return super().read(save_path, options)


def stage_save(checkpoint: Checkpoint, prefix: str, wopts: WriteOptions, step: int | None,
               internal: CommitCallback | None, extra: dict | None, *,
               on_published: Callable[[str], None] | None = None) -> SaveHandle:
    """Stages a save of ``checkpoint`` to ``prefix``; what ``write_async`` and the managers call.

    Args:
        checkpoint: The checkpoint whose state is saved.
        prefix: Checkpoint prefix (a path, or an ``s3://`` / ``gs://`` URL).
        wopts: The save's ``tf.train.CheckpointOptions``, checked (``write_options``).
        step: Step recorded in the manifest.
        internal: Called on the writer thread once the checkpoint is durable,
            after the write callbacks of ``wopts``.
        extra: Additional manifest data.
        on_published: Called on the writer thread right after the local
            publish, as part of the commit (a manager's remote tier).
    """
    state = checkpoint._asyncckpt
    checkpoint._check_dir(prefix)
    on_committed = _OnCommitted(wopts.callbacks, internal)
    io_device = wopts.io_device
    url = prefix
    target = state.urls.target(prefix)
    if target is not None:
        # Written to a scratch directory, uploaded as part of the commit (_urls).
        if on_published is not None:
            raise ValueError("a URL prefix is uploaded by the Checkpoint itself")
        prefix, on_published = target.local_prefix, target.upload
        on_committed = _urls.AtURL(on_committed, target.url)

    job_class = type(checkpoint)._job_class

    def stage(slot):
        staged = state.stager.stage(checkpoint, slot, io_device=io_device,
                                    background_copy=state.options.background_copy)
        return job_class(
            prefix=prefix,
            state=staged,
            step=step,
            options=state.options,
            on_committed=on_committed,
            extra=extra,
            on_published=on_published,
        )

    handle = state.engine.save(stage, label=url, step=step)
    _inflight.register(url, handle)
    state.last_save = handle
    if _compat.in_preemption_save_context():
        # TensorFlow's PreemptionCheckpointHandler exits right after this
        # save: make it durable before returning, as TensorFlow does.
        handle.result()
    return handle


def async_state(checkpoint: Checkpoint) -> AsyncState:
    """The asynchronous machinery of ``checkpoint``, for the managers.

    Read here rather than through ``Checkpoint.engine`` and its siblings,
    which yield to tracked children of the same name.
    """
    return checkpoint._asyncckpt

"""``asyncckpt.tf.Checkpoint``: ``tf.train.Checkpoint`` with asynchronous saves."""

from __future__ import annotations

import logging
import os
import threading

from asyncckpt._closing import ClosingContext
from asyncckpt.engine import commit as commit_lib
from asyncckpt.engine.manifest import read_manifest, verify_files
from asyncckpt.engine.metrics import SaveStats
from asyncckpt.engine.writer import AsyncEngine, SaveHandle
from asyncckpt.errors import CheckpointNotFoundError
from asyncckpt.options import AsyncOptions, RestoreOptions
from asyncckpt.tf import _compat, _staging
from asyncckpt.tf._compat import tf
from asyncckpt.tf._job import CommitCallback, TFSaveJob, manifest_path

logger = logging.getLogger(__name__)


def _fspath(path) -> str:
    return os.fspath(path) if isinstance(path, os.PathLike) else str(path)


def verify_checkpoint(prefix: str, *, checksums: bool = True) -> bool:
    """Checks a TensorFlow checkpoint against its asyncckpt manifest.

    Returns:
        True if a manifest was found and every file matches it; False for a
        checkpoint without a manifest (written by plain TensorFlow), which is
        accepted as is.

    Raises:
        CheckpointNotFoundError: No checkpoint exists at ``prefix``.
        CorruptCheckpointError: A file is missing, truncated or corrupt.
    """
    if not os.path.exists(prefix + ".index"):
        raise CheckpointNotFoundError(
            f"no TensorFlow checkpoint at {prefix!r} (missing {prefix + '.index'!r})"
        )
    try:
        manifest = read_manifest(manifest_path(prefix))
    except FileNotFoundError:
        logger.debug("%s has no asyncckpt manifest; restoring without verification", prefix)
        return False
    verify_files(
        os.path.dirname(os.path.abspath(prefix)),
        manifest.files,
        checksums=checksums,
        checkpoint=prefix,
    )
    return True


class Checkpoint(ClosingContext):
    """Asynchronous counterpart of ``tf.train.Checkpoint``.

    Construct it exactly like ``tf.train.Checkpoint``; ``save()`` and
    ``write()`` block only while the values are copied to host memory and
    return the checkpoint path at once, while a background thread writes
    TensorFlow-native files that ``tf.train.Checkpoint(...).restore`` reads.

    Example::

        ckpt = asyncckpt.tf.Checkpoint(model=model, optimizer=optimizer)
        path = ckpt.save("/tmp/run/ckpt")      # returns after the host copy
        ...
        ckpt.sync()                              # wait until durable
        tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)

    Args:
        root: As for ``tf.train.Checkpoint``.
        async_options: Staging slots, fsync and checksums.
        restore_options: Verification done by ``restore``/``read``.
        **kwargs: Trackable objects to save, as for ``tf.train.Checkpoint``.
    """

    def __init__(
        self,
        root=None,
        *,
        async_options: AsyncOptions | None = None,
        restore_options: RestoreOptions | None = None,
        **kwargs,
    ):
        self._init(tf.train.Checkpoint(root=root, **kwargs), async_options, restore_options)

    @classmethod
    def wrap(
        cls,
        checkpoint: tf.train.Checkpoint,
        *,
        async_options: AsyncOptions | None = None,
        restore_options: RestoreOptions | None = None,
    ) -> Checkpoint:
        """Makes saves of an existing ``tf.train.Checkpoint`` asynchronous."""
        if not isinstance(checkpoint, tf.train.Checkpoint):
            raise TypeError(
                f"expected a tf.train.Checkpoint, got {type(checkpoint).__name__}"
            )
        self = cls.__new__(cls)
        self._init(checkpoint, async_options, restore_options)
        return self

    def _init(self, checkpoint, async_options, restore_options) -> None:
        self._tf = checkpoint
        self._options = async_options or AsyncOptions()
        self._restore_options = restore_options or RestoreOptions()
        self._engine = AsyncEngine(options=self._options, name="asyncckpt.tf")
        self._stager = _staging.Stager(checkpoint)
        self._checked_dirs: set[str] = set()
        self._last_save: SaveHandle | None = None
        self._state_lock = threading.Lock()

    # -- attributes of the wrapped checkpoint ---------------------------------

    def __getattr__(self, name: str):
        # Only reached for names this class lacks: ckpt.model, ckpt.optimizer...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._tf, name)

    @property
    def checkpoint(self) -> tf.train.Checkpoint:
        """The wrapped ``tf.train.Checkpoint`` (for restores, or plain saves)."""
        return self._tf

    @property
    def save_counter(self) -> tf.Variable:
        """Number of ``save()`` calls, saved in the checkpoint like TensorFlow's."""
        return self._tf.save_counter

    @property
    def last_save(self) -> SaveHandle | None:
        """Handle of the most recent save (``committed`` resolves when durable)."""
        return self._last_save

    @property
    def engine(self) -> AsyncEngine:
        """The background engine: stats, ``estimated_write_seconds``, pending count."""
        return self._engine

    # -- saving -------------------------------------------------------------

    def _check_dir(self, prefix: str) -> None:
        directory = os.path.dirname(os.path.abspath(prefix))
        if directory not in self._checked_dirs:
            commit_lib.ensure_writable_dir(directory)
            self._checked_dirs.add(directory)

    def write_async(
        self,
        file_prefix,
        *,
        step: int | None = None,
        on_committed: CommitCallback | None = None,
        extra: dict | None = None,
    ) -> SaveHandle:
        """Stages the state and returns a handle; the lower-level ``write``.

        Args:
            file_prefix: Checkpoint prefix, used as is.
            step: Step recorded in the manifest.
            on_committed: Called on the writer thread once the checkpoint is
                durable (managers use it to update the state file).
            extra: Additional manifest data.
        """
        prefix = _fspath(file_prefix)
        if not prefix:
            raise ValueError("file_prefix must be a non-empty path")
        self._check_dir(prefix)

        def stage(slot):
            state = self._stager.stage(slot)
            return TFSaveJob(
                prefix=prefix,
                state=state,
                step=step,
                options=self._options,
                on_committed=on_committed,
                extra=extra,
            )

        handle = self._engine.save(stage, label=prefix, step=step)
        self._last_save = handle
        return handle

    def write(self, file_prefix, options=None) -> str:
        """Saves without numbering or updating the ``checkpoint`` state file.

        Args:
            file_prefix: Checkpoint prefix, used as is.
            options: Accepted for compatibility with ``tf.train.Checkpoint``;
                its async flag is ignored (saves are always asynchronous).

        Returns:
            ``file_prefix``; the files appear there once the save is durable.
        """
        del options
        return self.write_async(file_prefix).label

    def save(self, file_prefix, options=None) -> str:
        """Numbered save, like ``tf.train.Checkpoint.save``.

        Increments ``save_counter``, writes ``<file_prefix>-<counter>`` in the
        background, and records it in the directory's ``checkpoint`` file once
        it is durable, so ``tf.train.latest_checkpoint`` never names a partial
        checkpoint.

        Returns:
            The checkpoint path, ``<file_prefix>-<counter>``.
        """
        del options
        prefix = _fspath(file_prefix)
        self._check_dir(prefix)
        number = int(self._tf.save_counter.assign_add(1, read_value=True).numpy())
        path = f"{prefix}-{number}"
        try:
            self.write_async(path, step=number, on_committed=self._record_latest)
        except BaseException:
            self._tf.save_counter.assign_sub(1)  # nothing was saved under this number
            raise
        return path

    def _record_latest(self, path: str, stats: SaveStats) -> None:
        # What tf.train.Checkpoint.save does after writing: point the
        # directory's state file at the new checkpoint.
        del stats
        directory = os.path.dirname(os.path.abspath(path))
        rel = os.path.basename(path)
        with self._state_lock:
            text = _compat.checkpoint_state_text(directory, rel, [rel], [], 0.0)
            commit_lib.write_text_atomic(
                os.path.join(directory, "checkpoint"), text, fsync=self._options.fsync
            )

    # -- waiting ------------------------------------------------------------

    def sync(self, timeout: float | None = None) -> None:
        """Waits until every save so far is durable; re-raises background errors."""
        self._engine.sync(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flushes saves in flight and frees the staging memory."""
        self._engine.close(timeout)


    # -- restoring ----------------------------------------------------------

    def _prepare_restore(self, save_path) -> str:
        self.sync()
        path = _fspath(save_path)
        verify_checkpoint(path, checksums=self._restore_options.verify_checksums)
        return path

    def restore(self, save_path, options=None):
        """Restores like ``tf.train.Checkpoint.restore``, after verifying the files.

        Waits for saves in flight first, so a path just returned by ``save()``
        can be restored at once.

        Raises:
            CheckpointNotFoundError: Nothing is saved at ``save_path``.
            CorruptCheckpointError: A file fails the manifest check.
        """
        if save_path is None:
            return self._tf.restore(None, options)
        return self._tf.restore(self._prepare_restore(save_path), options)

    def read(self, save_path, options=None):
        """Like ``tf.train.Checkpoint.read`` (no ``save_counter`` expected)."""
        return self._tf.read(self._prepare_restore(save_path), options)

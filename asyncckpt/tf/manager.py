"""``asyncckpt.tf.CheckpointManager``: a drop-in for ``tf.train.CheckpointManager``."""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time

from asyncckpt._closing import ClosingContext
from asyncckpt.engine import commit as commit_lib
from asyncckpt.engine import retention
from asyncckpt.engine.lock import DirectoryLock
from asyncckpt.engine.metrics import SaveStats
from asyncckpt.engine.writer import SaveHandle
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.options import AsyncOptions, RestoreOptions
from asyncckpt.tf import _compat
from asyncckpt.tf._compat import tf
from asyncckpt.tf._job import delete_checkpoint
from asyncckpt.tf.checkpoint import Checkpoint, verify_checkpoint

logger = logging.getLogger(__name__)


def _evaluate(value) -> int:
    """An int from an int, a variable or a tensor (like TensorFlow's manager)."""
    if isinstance(value, int):
        return value
    return int(value.numpy() if hasattr(value, "numpy") else value)


class CheckpointManager(ClosingContext):
    """Manages numbered asynchronous checkpoints in a directory.

    Same constructor, properties and methods as ``tf.train.CheckpointManager``,
    plus ``sync()``/``close()``. ``save()`` returns the new path as soon as the
    state is copied to host memory. The ``checkpoint`` state file, and with it
    ``latest_checkpoint``, ``checkpoints`` and retention deletions, change only
    once a checkpoint is durable: ``tf.train.latest_checkpoint(directory)``
    never names a partial checkpoint.

    Args:
        checkpoint: A ``tf.train.Checkpoint`` (its saves become asynchronous)
            or an ``asyncckpt.tf.Checkpoint``.
        directory: Where checkpoints are written.
        max_to_keep: Checkpoints to keep; None keeps all.
        keep_checkpoint_every_n_hours: Additionally preserve one checkpoint per
            this many hours.
        checkpoint_name: File name prefix of the checkpoints.
        step_counter: Variable or int read by ``save()`` when
            ``checkpoint_interval`` is set.
        checkpoint_interval: Minimum steps between saves.
        init_fn: Called by ``restore_or_initialize`` when there is nothing to
            restore.
        last_checkpoint_step: Step of the last checkpoint, for the interval.
        async_options: Engine options, used when ``checkpoint`` is a
            ``tf.train.Checkpoint``.
        restore_options: Verification on restore, likewise.
    """

    def __init__(
        self,
        checkpoint,
        directory,
        max_to_keep,
        keep_checkpoint_every_n_hours=None,
        checkpoint_name="ckpt",
        step_counter=None,
        checkpoint_interval=None,
        init_fn=None,
        last_checkpoint_step=None,
        *,
        async_options: AsyncOptions | None = None,
        restore_options: RestoreOptions | None = None,
    ):
        if isinstance(checkpoint, Checkpoint):
            self._ckpt = checkpoint
            self._owns_ckpt = False
            if async_options is not None or restore_options is not None:
                raise ValueError(
                    "async_options/restore_options apply only when the manager wraps a "
                    "tf.train.Checkpoint; set them on the asyncckpt.tf.Checkpoint instead"
                )
        elif isinstance(checkpoint, tf.train.Checkpoint):
            self._ckpt = Checkpoint.wrap(
                checkpoint, async_options=async_options, restore_options=restore_options
            )
            self._owns_ckpt = True
        else:
            raise TypeError(
                "checkpoint must be a tf.train.Checkpoint or an asyncckpt.tf.Checkpoint, "
                f"got {type(checkpoint).__name__}"
            )
        self._user_checkpoint = checkpoint
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep <= 0):
            raise ValueError(f"Expected a positive integer or `None` for `max_to_keep`, got "
                             f"{max_to_keep!r}.")
        self._policy = retention.RetentionPolicy(
            max_to_keep=max_to_keep, keep_every_n_hours=keep_checkpoint_every_n_hours
        )
        if not checkpoint_name or os.sep in checkpoint_name:
            raise ValueError(f"checkpoint_name must be a plain file name, got {checkpoint_name!r}")
        self._directory = os.fspath(directory)
        self._abs_dir = os.path.abspath(self._directory)
        self._checkpoint_name = checkpoint_name
        self._prefix = os.path.join(self._directory, checkpoint_name)
        self._init_fn = init_fn
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError(
                "`step_counter` should be passed if `checkpoint_interval` is not None."
            )
        self._checkpoint_interval = checkpoint_interval
        self._step_counter = step_counter
        self._last_checkpoint_step = last_checkpoint_step
        self._lock = threading.Lock()
        self._fsync = self._ckpt._options.fsync
        self._verify_checksums = self._ckpt._restore_options.verify_checksums
        # Taken on the first save, so a manager used only to restore locks nothing.
        self._dir_lock = DirectoryLock(self._abs_dir)
        self._recover_state()

    # -- state recovered from / written to the directory ----------------------

    def _recover_state(self) -> None:
        now = time.time()
        self._maybe_delete: collections.OrderedDict[str, float] = collections.OrderedDict()
        state = _compat.read_checkpoint_state(self._directory)
        if state is None:
            self._latest: str | None = None
            self._last_preserved = now - 1.0
            return
        self._latest = state.model_checkpoint_path or None
        self._last_preserved = min(state.last_preserved_timestamp, now)
        paths = list(state.all_model_checkpoint_paths)
        stamps = list(state.all_model_checkpoint_timestamps) or [self._last_preserved] * len(paths)
        for path, stamp in zip(paths, stamps, strict=False):
            if not os.path.exists(path + ".index"):
                logger.warning("%s is listed in %s/checkpoint but its files are gone; "
                               "no longer managing it", path, self._directory)
                continue
            stamp = min(stamp, now)
            if stamp > self._last_preserved:
                self._maybe_delete[path] = stamp

    def _rel(self, path: str) -> str:
        return os.path.relpath(os.path.abspath(path), self._abs_dir)

    def _write_state(self) -> None:
        paths = list(self._maybe_delete)
        text = _compat.checkpoint_state_text(
            self._abs_dir,
            self._rel(self._latest) if self._latest else "",
            [self._rel(p) for p in paths],
            list(self._maybe_delete.values()),
            self._last_preserved,
        )
        commit_lib.write_text_atomic(
            os.path.join(self._abs_dir, "checkpoint"), text, fsync=self._fsync
        )

    def _on_committed(self, path: str, stats: SaveStats) -> None:
        """Writer thread: record a durable checkpoint, then apply retention."""
        del stats
        with self._lock:
            self._maybe_delete.pop(path, None)
            self._maybe_delete[path] = time.time()
            self._latest = path
            decision = retention.apply(
                [retention.Candidate(p, None, t) for p, t in self._maybe_delete.items()],
                self._policy,
                last_preserved_timestamp=self._last_preserved,
            )
            for c in decision.delete + decision.preserve:
                del self._maybe_delete[c.key]
            self._last_preserved = decision.last_preserved_timestamp
            # The state file stops naming a checkpoint before its files go.
            self._write_state()
            for c in decision.delete:
                delete_checkpoint(c.key)
                logger.debug("retention deleted %s", c.key)

    # -- properties of tf.train.CheckpointManager --------------------------

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint_interval(self):
        return self._checkpoint_interval

    @property
    def latest_checkpoint(self) -> str | None:
        """Prefix of the newest durable checkpoint, or None."""
        with self._lock:
            return self._latest

    @property
    def checkpoints(self) -> list[str]:
        """Managed durable checkpoints, oldest first."""
        with self._lock:
            return list(self._maybe_delete)

    @property
    def checkpoint(self):
        """The checkpoint object this manager was given."""
        return self._user_checkpoint

    @property
    def last_save(self) -> SaveHandle | None:
        """Handle of the most recent save (``committed`` resolves when durable)."""
        return self._ckpt.last_save

    @property
    def engine(self):
        """The background engine (stats, ``estimated_write_seconds``)."""
        return self._ckpt.engine

    # -- saving and restoring ------------------------------------------------

    def save(self, checkpoint_number=None, check_interval: bool = True, options=None):
        """Stages a numbered checkpoint and returns its path (or None if skipped).

        Args:
            checkpoint_number: Number for the file name (an int, or a variable
                such as a global step); defaults to ``save_counter``.
            check_interval: Honour ``checkpoint_interval``.
            options: Accepted for compatibility; ignored.
        """
        del options
        if self._checkpoint_interval is not None:
            current = _evaluate(self._step_counter)
            if self._last_checkpoint_step is not None:
                if current == self._last_checkpoint_step:
                    return None
                if check_interval and current < (
                    self._last_checkpoint_step + self._checkpoint_interval
                ):
                    return None
            self._last_checkpoint_step = current
        self._take_directory()
        counter = self._ckpt.save_counter
        counter.assign_add(1)
        number = _evaluate(counter if checkpoint_number is None else checkpoint_number)
        prefix = f"{self._prefix}-{number}"
        try:
            self._ckpt.write_async(prefix, step=number, on_committed=self._on_committed)
        except BaseException:
            counter.assign_sub(1)
            raise
        return prefix

    def _take_directory(self) -> None:
        if not self._dir_lock.held:
            self._dir_lock.acquire()
            # Holding the lock, nobody else writes here: temporaries are stale.
            commit_lib.cleanup_stale_temps(self._abs_dir)
            self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Deletes files of this manager's checkpoints that never got their index.

        A process killed between publishing a checkpoint's data file and its
        index (the commit) leaves files no reader considers a checkpoint.
        """
        pattern = re.compile(
            re.escape(self._checkpoint_name)
            + r"-\d+(?=\.(?:data-\d{5}-of-\d{5}|asyncckpt-manifest\.json)$)"
        )
        orphans: dict[str, list[str]] = {}
        for name in os.listdir(self._abs_dir):
            m = pattern.match(name)
            if m:
                orphans.setdefault(m.group(0), []).append(name)
        for base, names in orphans.items():
            if not os.path.exists(os.path.join(self._abs_dir, base + ".index")):
                for name in names:
                    os.unlink(os.path.join(self._abs_dir, name))
                logger.warning("removed files of %s left without an index by an interrupted "
                               "save: %s", base, ", ".join(sorted(names)))

    def newest_valid_checkpoint(self) -> str | None:
        """The newest managed checkpoint whose files match their manifest.

        Damaged or incomplete checkpoints are skipped with a warning naming them
        and the file at fault.
        """
        self.sync()
        with self._lock:
            candidates = list(reversed(self._maybe_delete))
            if self._latest and self._latest not in candidates:
                candidates.insert(0, self._latest)
        for path in candidates:
            try:
                verify_checkpoint(path, checksums=self._verify_checksums)
                return path
            except (CorruptCheckpointError, CheckpointNotFoundError) as e:
                logger.warning("skipping checkpoint %s: %s", path, e)
        return None

    def restore_or_initialize(self):
        """Restores the newest valid checkpoint, or runs ``init_fn`` if there is none.

        Unlike TensorFlow's manager, a latest checkpoint that fails its manifest
        check (truncated, corrupt, incomplete) is skipped with a warning, and the
        newest one that verifies is restored instead.

        Returns:
            The restored path, or None.
        """
        path = self.newest_valid_checkpoint()
        if path is not None:
            self._ckpt.checkpoint.restore(path)  # verified just above
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = _evaluate(self._step_counter)
            return path
        if self._init_fn is not None:
            self._init_fn()
            logger.info("Customized initialization is done through the passed `init_fn`.")
        return None

    def sync(self, timeout: float | None = None) -> None:
        """Waits until every save is durable; re-raises background errors."""
        self._ckpt.sync(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flushes saves, releases the directory; closes the engine if it made it."""
        try:
            if self._owns_ckpt:
                self._ckpt.close(timeout)
            else:
                self._ckpt.sync(timeout)
        finally:
            self._dir_lock.release()

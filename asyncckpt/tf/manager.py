"""``asyncckpt.tf.CheckpointManager``: a drop-in for ``tf.train.CheckpointManager``."""

from __future__ import annotations

import collections
import functools
import logging
import numbers
import os
import re
import time
import types
from collections.abc import Callable

from asyncckpt import layout
from asyncckpt._closing import ClosingContext
from asyncckpt._engine import retention
from asyncckpt._engine.steps import Reservation, StepDirectory
from asyncckpt._engine.writer import SaveHandle
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.options import AsyncOptions, RestoreOptions
from asyncckpt.storage.tier import RemoteOptions, TieredDirectory, register_owner
from asyncckpt.tf import _compat, _dirview, _inflight, _statefile, _urls
from asyncckpt.tf._compat import tf
from asyncckpt.tf.checkpoint import (
    Checkpoint,
    async_state,
    stage_save,
    verify_checkpoint,
    write_options,
)

logger = logging.getLogger(__name__)


def _evaluate(value) -> int:
    """An int from an int (numpy ints too), a variable or a tensor, like TensorFlow."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return int(value.numpy() if hasattr(value, "numpy") else value)


class CheckpointManager(tf.train.CheckpointManager, ClosingContext):
    """Manages numbered asynchronous checkpoints in a directory.

    A ``tf.train.CheckpointManager`` (a subclass: ``isinstance`` checks in
    user code and libraries, such as orbit's ``Controller`` and
    ``tf.distribute``'s ``PreemptionCheckpointHandler``, accept it), with the
    same constructor, properties and methods, plus ``prepare()``,
    ``sync(timeout)`` and ``close()``. ``save()`` returns the new path as soon
    as the state is snapshotted (see ``AsyncOptions.background_copy``), and,
    as in TensorFlow, ``latest_checkpoint``, ``checkpoints`` and the retention
    decisions change at once. The
    ``checkpoint`` state file changes, and old checkpoints are deleted, only
    once the new checkpoint is durable, so ``tf.train.latest_checkpoint``
    never names a partial checkpoint. Restoring a path whose save is still in
    flight (``restore_or_initialize``, ``asyncckpt.tf.Checkpoint.restore``)
    waits for it.

    Managers of one directory in one process share that view (listings agree,
    one commits at a time); the directory lock keeps other processes out.

    TensorFlow's ``__init__`` is not run: it would read the state file into
    bookkeeping of its own, beside the directory view shared by this
    process's managers (and cannot read a URL directory). The attributes
    TensorFlow's code reads from a manager are set here or derived from that
    view: ``_checkpoint``, ``_directory``, ``_checkpoint_prefix``
    (``_prefix``), ``_step_counter``, ``_checkpoint_interval``,
    ``_last_checkpoint_step``, ``_init_fn``, and, read-only,
    ``_max_to_keep``, ``_keep_checkpoint_every_n_hours``,
    ``_latest_checkpoint``, ``_maybe_delete`` (a snapshot) and
    ``_last_preserved_timestamp``. Every method and property of TensorFlow's
    class is overridden (but ``_prefix``, which reads ``_checkpoint_prefix``);
    ``_sweep`` and ``_record_state`` (TensorFlow's synchronous retention and
    state-file write) are refused, as this manager does both once each save
    is durable.

    Args:
        checkpoint: A ``tf.train.Checkpoint`` (its saves through this manager
            become asynchronous) or an ``asyncckpt.tf.Checkpoint``.
        directory: Where checkpoints are written (str or path-like).
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
        remote: A persistent second tier (``s3://`` / ``gs://`` URL or a
            path) for a local ``directory``: saves commit locally and every
            ``remote_options.every_n_steps`` are uploaded in the background.
            ``directory`` itself may be such a URL (saves stage in a local
            scratch directory and are durable once committed remotely).
        remote_options: Schedule, retention and retries of the remote tier
            (default: every save, ``max_to_keep`` as above). A URL
            ``directory`` keeps what this manager's retention keeps
            (``max_to_keep``, ``keep_checkpoint_every_n_hours``): there
            ``RemoteOptions.max_to_keep`` is refused.
    """

    # The directory's bookkeeping (listing, state file, deletions), shared by its
    # managers; a subclass may set a ManagedCheckpoints subclass of its own.
    _view_class: type[_dirview.ManagedCheckpoints] = _dirview.ManagedCheckpoints

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
        remote: str | None = None,
        remote_options: RemoteOptions | None = None,
    ):
        # tf.train.CheckpointManager.__init__ is deliberately not called (see
        # the class docstring); what its methods and TensorFlow read is set here.
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
        # What the manager was given (TensorFlow's `checkpoint` property reads
        # it; tf.distribute's PreemptionCheckpointHandler attaches its run
        # counter to it, so it must be the object whose graph is saved).
        self._checkpoint = checkpoint
        self._save_counter_assign = None  # TensorFlow's graph-mode save op; never built here
        self._policy = retention.RetentionPolicy(
            max_to_keep=retention.check_max_to_keep(max_to_keep, allow_zero=False),
            keep_every_n_hours=keep_checkpoint_every_n_hours,
        )
        if not checkpoint_name or os.sep in checkpoint_name:
            raise ValueError(f"checkpoint_name must be a plain file name, got {checkpoint_name!r}")
        # A URL directory stages in a local scratch directory (storage tier).
        if remote_options is None and remote is not None:  # two tiers: the manager's count
            remote_options = RemoteOptions(max_to_keep=self._max_to_keep)
        self._tiers = TieredDirectory(directory, remote=remote, remote_options=remote_options)
        register_owner(self, self._tiers)  # the preemption handler's final upload uses them
        self._directory = (self._tiers.local_dir if self._tiers.remote_only
                           else os.fspath(directory))
        # What the manager reports: the URL for a URL directory (its scratch
        # directory is an implementation detail, removed at close()).
        self._shown_directory = (self._tiers.display if self._tiers.remote_only
                                 else self._directory)
        self._checkpoint_name = checkpoint_name
        self._checkpoint_prefix = os.path.join(self._directory, checkpoint_name)
        self._init_fn = init_fn
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError(
                "`step_counter` should be passed if `checkpoint_interval` is not None."
            )
        self._checkpoint_interval = checkpoint_interval
        self._step_counter = step_counter
        self._last_checkpoint_step = last_checkpoint_step
        self._state = async_state(self._ckpt)  # engine, options, stager of the checkpoint
        self._checksums = self._state.restore_options.checksums
        self._view = _dirview.view_for(self._directory, fsync=self._state.options.fsync,
                                       view_class=self._view_class)
        if self._tiers.remote_only:
            # A new process on a URL directory manages what is committed there,
            # as TensorFlow's manager does with what its state file names; what
            # its retention drops is deleted in the bucket.
            bucket_state = _urls.StateFileInBucket(self._tiers)
            found = bucket_state.read()
            self._view.adopt_remote(
                self._remote_checkpoints(),
                state=None if found is None else (found.managed, found.last_preserved),
                delete=self._tiers.delete_remote, upload_state=bucket_state.upload)

    # -- properties of tf.train.CheckpointManager --------------------------

    def _path(self, name: str | None) -> str | None:
        """The path the manager reports for checkpoint ``name`` (a URL prefix on a URL)."""
        if name is None:
            return None
        if self._tiers.remote_only:
            return f"{self._shown_directory}/{name}"
        return os.path.join(self._directory, name)

    def _local_path(self, name: str) -> str:
        """Where checkpoint ``name`` is written and read on this machine."""
        return os.path.join(self._directory, name)

    def _remote_checkpoints(self) -> list[tuple[str, float]]:
        """This manager's committed checkpoints in its URL directory, oldest first."""
        pattern = re.compile(re.escape(self._checkpoint_name) + r"-\d+")
        found = [(c.name, c.committed) for c in self._tiers.remote_checkpoints(fresh=True)
                 if c.framework == "tensorflow" and pattern.fullmatch(c.name)]
        return sorted(found, key=lambda entry: layout.tf_step_of(entry[0]) or -1)

    @property
    def directory(self) -> str:
        """The directory given to the manager (for ``s3://`` / ``gs://``, the URL)."""
        return self._shown_directory

    @property
    def checkpoint_interval(self):
        return self._checkpoint_interval

    @property
    def latest_checkpoint(self) -> str | None:
        """Prefix of the newest checkpoint, from its ``save()`` call on (as in TF)."""
        return self._path(self._view.steps.latest)

    @property
    def checkpoints(self) -> list[str]:
        """Managed checkpoints, oldest first, including saves still being written."""
        return [self._path(n) for n in self._view.steps.listed()]

    @property
    def checkpoint(self):
        """The checkpoint object this manager was given."""
        return self._checkpoint

    @property
    def last_save(self) -> SaveHandle | None:
        """Handle of the most recent save (``committed`` resolves when durable)."""
        return self._state.last_save

    @property
    def engine(self):
        """The background engine (stats, ``estimated_write_s``)."""
        return self._state.engine

    @property
    def retention_failures(self) -> int:
        """Failed state-file writes or deletions after a durable save (retried later)."""
        return self._view.steps.retention_failures

    # -- tf.train.CheckpointManager's private state, as TensorFlow reads it ----

    # Read-only: retention is configured at construction (assigning one of
    # these raises AttributeError rather than being ignored).

    @property
    def _max_to_keep(self) -> int | None:
        return self._policy.max_to_keep

    @property
    def _keep_checkpoint_every_n_hours(self):
        return self._policy.keep_every_n_hours

    @property
    def _latest_checkpoint(self) -> str | None:
        return self.latest_checkpoint

    @property
    def _maybe_delete(self) -> types.MappingProxyType:
        """Managed checkpoints and their timestamps, oldest first (a read-only snapshot)."""
        return types.MappingProxyType(collections.OrderedDict(
            (self._path(name), stamp) for name, stamp in self._view.entries()))

    @property
    def _last_preserved_timestamp(self) -> float:
        return self._view.steps.last_preserved

    def _sweep(self):
        raise NotImplementedError(
            "asyncckpt.tf.CheckpointManager applies retention itself once each save is "
            "durable; call save() (and sync() to wait for it), not _sweep()"
        )

    def _record_state(self):
        raise NotImplementedError(
            "asyncckpt.tf.CheckpointManager writes the checkpoint state file itself once "
            "each save is durable; call save() (and sync() to wait for it), not _record_state()"
        )

    # -- saving and restoring ------------------------------------------------

    def prepare(self) -> None:
        """Builds the host staging memory for saves of the checkpoint, in the background.

        Otherwise the first save allocates and faults in its staging slots on
        the calling thread (``num_slots`` states' worth: up to 3.6 s for 1 GiB
        on this project's 2-core VM). Called once the variables exist (e.g.
        after the model and optimizer are built), the first save then only
        reads and copies; what is not built by then (variables created
        later) it allocates itself. Nothing is written; the values are read,
        not copied. The memory is held from now on, as from a first save.

        Raises:
            EngineClosedError: The manager's checkpoint is closed.
            UnsupportedObjectError: The object graph holds something that
                cannot be staged.
            Exception: A failure of an earlier background save (as ``save``).
        """
        state = self._state
        state.engine.raise_pending_error()
        state.engine.prepare_staging(state.stager.staging_layout(self._ckpt))

    def save(self, checkpoint_number=None, check_interval: bool = True, options=None):
        """Stages a numbered checkpoint and returns its path (or None if skipped).

        Args:
            checkpoint_number: Number for the file name (an int, a numpy int,
                or a variable such as a global step); defaults to
                ``save_counter``, which is incremented either way.
            check_interval: Honour ``checkpoint_interval``.
            options: A ``tf.train.CheckpointOptions``; its write callbacks run
                on the writer thread once the checkpoint is durable.
        """
        if not _compat.executing_eagerly():
            raise NotImplementedError(
                "asyncckpt.tf.CheckpointManager.save needs eager execution; in graph mode "
                "use tf.train.CheckpointManager"
            )
        wopts = write_options(options)
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
        self._state.engine.raise_pending_error()  # before counting a save that would fail
        self._tiers.raise_pending_error()  # a failed upload surfaces here
        counter = self._ckpt.save_counter
        counter.assign_add(1)
        number = _evaluate(counter if checkpoint_number is None else checkpoint_number)
        prefix = f"{self._checkpoint_prefix}-{number}"
        shown = self._path(f"{self._checkpoint_name}-{number}")
        view = self._view
        res = view.record_save(view.rel(prefix), self._policy)
        try:
            handle = stage_save(
                self._ckpt, prefix, wopts, number, functools.partial(view.committed, res),
                {_statefile.MANAGED_KEY: True},
                on_published=(None if self._tiers.remote is None
                              else functools.partial(_hand_to_tiers, self._tiers)),
            )
        except BaseException:
            counter.assign_sub(1)
            view.steps.failed(res)
            raise
        handle.committed.add_done_callback(functools.partial(_undo_if_failed, view.steps, res))
        view.steps.attach(res, handle.committed)
        view.steps.track(handle.committed, self)
        if shown != prefix:
            _inflight.register(shown, handle)  # restore(url) waits for it, as for a path
        return shown

    def _take_directory(self) -> None:
        # The first writer of this directory in this process takes its lock and
        # removes what interrupted saves left (nobody else writes here then).
        self._view.steps.join(self)
        self._view.steps.prepare(self._remove_orphans)

    def _remove_orphans(self) -> None:
        """Deletes files of this manager's checkpoints that never got their index.

        A process killed between publishing a checkpoint's data file and its
        index (the commit) leaves files no reader considers a checkpoint.
        """
        pattern = re.compile(
            re.escape(self._checkpoint_name)
            + r"-\d+(?=\.(?:data-\d{5}-of-\d{5}|asyncckpt-manifest\.json)$)"
        )
        abs_dir = self._view.abs_dir
        steps = self._view.steps
        orphans: dict[str, list[str]] = {}
        for name in os.listdir(abs_dir):
            m = pattern.match(name)
            if m:
                orphans.setdefault(m.group(0), []).append(name)
        for base, names in orphans.items():
            # (another process publishing it moves its data and manifest first)
            if not os.path.exists(os.path.join(abs_dir, base + ".index")) and steps.is_free(base):
                for name in names:
                    os.unlink(os.path.join(abs_dir, name))
                logger.warning("removed files of %s left without an index by an interrupted "
                               "save: %s", base, ", ".join(sorted(names)))

    def newest_valid_checkpoint(self) -> str | None:
        """The newest managed checkpoint whose files match their manifest.

        Waits for a save of it still in flight; damaged or incomplete
        checkpoints are skipped with a warning naming them and the file at fault.
        """
        name = self._newest_valid_name()
        return None if name is None else self._path(name)

    def _newest_valid_name(self, use: Callable[[str], object] | None = None) -> str | None:
        """The newest checkpoint that verifies (``use``: that ``use(path)`` accepts).

        On a URL directory (or with a remote tier) the checkpoint is fetched
        into the local directory first. ``use`` raising
        ``CorruptCheckpointError`` or ``CheckpointNotFoundError`` skips to
        the next older checkpoint.
        """
        names = self._view.newest_first()
        if self._tiers.remote is not None:
            # Checkpoints only the remote tier has count too, ordered by step.
            known = set(names)
            names = sorted([*names, *(n for n in self._tiers.remote_names() if n not in known)],
                           key=lambda n: -(layout.tf_step_of(n) or -1))
        for name in names:
            path = self._local_path(name)
            _inflight.wait_for(path)
            try:
                self._tiers.ensure_local(name, checksums=self._checksums)
                if use is None:
                    verify_checkpoint(path, checksums=self._checksums)
                else:
                    use(path)
                return name
            except (CorruptCheckpointError, CheckpointNotFoundError) as e:
                logger.warning("skipping checkpoint %s: %s", self._path(name), e)
        return None

    def restore_or_initialize(self):
        """Restores the newest valid checkpoint, or runs ``init_fn`` if there is none.

        The checkpoint is read once, by asyncckpt's reader, which checks
        every file against the manifest as it reads it. Unlike TensorFlow's
        manager, a latest checkpoint that fails that check (truncated,
        corrupt, incomplete) is skipped with a warning, and the newest one
        that verifies is restored instead.

        Returns:
            The restored path, or None.
        """
        name = self._newest_valid_name(use=self._ckpt.restore)
        if name is not None:
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = _evaluate(self._step_counter)
            return self._path(name)
        if self._init_fn is not None:
            self._init_fn()
            logger.info("Customized initialization is done through the passed `init_fn`.")
        return None

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Waits until every save is durable; re-raises background errors.

        Also waits for saves of the same directory by managers of this process
        that were dropped without ``close()`` (as for a restart), so what they
        leave (files, retention, the state file) is settled when this returns.
        asyncckpt's one spelling of the wait; ``sync()`` is TensorFlow's, and
        the same.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._ckpt.wait_until_finished(timeout)
        if not self._view.steps.wait_orphans(_remaining(deadline)):
            raise TimeoutError(
                f"saves of {self._view.abs_dir} by a dropped manager still in flight after "
                f"{timeout} s"
            )
        self._tiers.wait_until_finished(_remaining(deadline))

    def sync(self, timeout: float | None = None) -> None:
        """TensorFlow's ``tf.train.CheckpointManager.sync()``: ``wait_until_finished``."""
        self.wait_until_finished(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flushes saves; the last manager of the directory releases its lock."""
        try:
            if self._owns_ckpt:
                self._ckpt.close(timeout)
            else:
                self._ckpt.wait_until_finished(timeout)
        finally:
            try:
                self._view.steps.leave(self)
            finally:
                self._tiers.close(timeout)



def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _hand_to_tiers(tiers: TieredDirectory, prefix: str) -> None:
    # Writer thread, right after the local publish: a URL directory uploads
    # here (the save is durable only once committed remotely); two tiers hand
    # the checkpoint to the background uploader.
    tiers.after_commit(os.path.basename(prefix))


def _undo_if_failed(steps: StepDirectory, res: Reservation, future) -> None:
    if future.exception() is not None:
        steps.failed(res)

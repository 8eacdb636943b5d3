"""``asyncckpt.jax.CheckpointManager``: orbax's ``CheckpointManager``, saving asynchronously."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import operator
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from asyncckpt._closing import ClosingContext
from asyncckpt._engine.commit import make_dirs
from asyncckpt._engine.steps import Reservation, StepRecord
from asyncckpt._engine.writer import AsyncEngine, SaveHandle
from asyncckpt.errors import (
    CheckpointNotFoundError,
    EngineClosedError,
    PeerFailedError,
)
from asyncckpt.jax import _args, _compat, _metadata, _options, _policies, _view
from asyncckpt.jax import _format as fmt
from asyncckpt.jax._distributed import CommitCoordinator, Saves
from asyncckpt.jax._handlers import HandlerSave, HandlerSaves
from asyncckpt.jax._job import JaxSaveJob, Peers, StepInfo, step_transaction
from asyncckpt.jax._metadata import RootMetadata, StepMetadata
from asyncckpt.jax._ocdbt import FormatOptions, ItemFormats
from asyncckpt.jax._restore import restore_listed, shared_verdicts
from asyncckpt.jax._snapshot import Snapshotter, StagedTree
from asyncckpt.jax._tiers import StepTiers
from asyncckpt.options import AsyncOptions, RestoreOptions
from asyncckpt.storage.tier import RemoteOptions

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager"]


def _own_async_options(options: Any) -> AsyncOptions:
    """The manager's ``async_options=``: asyncckpt's ``AsyncOptions``, or the default.

    orbax's class of the same name belongs in orbax's manager options, where
    orbax's ``CheckpointManager`` takes it; the two are told apart by type here.

    Raises:
        TypeError: anything else (orbax's ``AsyncOptions`` named with its place).
    """
    if options is None:
        return AsyncOptions()
    if isinstance(options, AsyncOptions):
        return options
    if type(options).__name__ == "AsyncOptions" and type(options).__module__.startswith("orbax."):
        raise TypeError(
            "async_options= takes asyncckpt.AsyncOptions (staging slots, fsync, checksums); "
            "orbax's AsyncOptions (timeout_secs, post_finalization_callback) goes where "
            "orbax's CheckpointManager takes it: "
            "options=ocp.CheckpointManagerOptions(async_options=ocp.AsyncOptions(...))")
    raise TypeError(f"async_options must be asyncckpt.AsyncOptions, got "
                    f"{type(options).__module__}.{type(options).__qualname__}")


def _delete_step(view: _view.StepView, todelete_subdir: str | None,
                 tiers: StepTiers | None, step: int) -> None:
    """Deletes ``step`` (retention, or ``delete``): here, and in a URL directory's bucket."""
    _view.delete_step_dir(view, step, todelete_subdir)
    if tiers is not None:
        tiers.delete(step)


class CheckpointManager(ClosingContext):
    """Numbered asynchronous checkpoints of pytrees, spelled and laid out as orbax's.

    ``save(step, args=ocp.args.StandardSave(state))`` (or ``save(step, state)``)
    returns once the state is copied to host memory; a background thread
    writes ``<directory>/<step>/`` in orbax's zarr layout, checksums and
    fsyncs it, and publishes it with one rename. The step is listed by
    ``all_steps()`` as soon as ``save`` returns (as orbax's async manager), and
    ``restore`` of a step still in flight waits for it. Two saves can be in
    flight at once (one per staging slot). Checkpoints restore with this
    manager (verified against their manifest, onto any sharding) or with
    ``orbax.checkpoint.CheckpointManager`` given the same options.

    Options come either as orbax's ``options=ocp.CheckpointManagerOptions(...)``
    (every field honoured or, if asyncckpt cannot, refused by name) or as
    the keyword arguments below. ``docs/compat.md`` lists each behaviour.

    With several JAX processes, every process calls ``save`` with the same
    step; each writes only its own shards and process 0 commits once all are
    done (see ``docs/jax.md``).

    Example::

        options = ocp.CheckpointManagerOptions(max_to_keep=3, save_interval_steps=100)
        with asyncckpt.jax.CheckpointManager("/ckpts", options=options) as mgr:
            for step in range(steps):
                state = train_step(state)
                mgr.save(step, args=ocp.args.StandardSave(state))  # blocks for the copy
            restored = mgr.restore(mgr.latest_step(),
                                   args=ocp.args.StandardRestore(abstract_state))

    Args:
        directory: Where step directories are written.
        checkpointers: orbax's older spelling (second positional argument):
            one orbax ``Checkpointer``/``AsyncCheckpointer`` (the unnamed item)
            or a dict of them by item name. Their handlers are taken as
            ``item_handlers``; saves are asynchronous if one is an
            ``AsyncCheckpointer`` (with its timeout), else synchronous, as in orbax.
        options: orbax ``CheckpointManagerOptions``; excludes the keyword
            options below.
        metadata: Manager-level metadata, written once per directory
            (``metadata()`` reads it).
        item_names: Names of the items saved with ``args=Composite(...)``.
        item_handlers: One orbax handler (the unnamed item) or handlers by
            item name; names are added to ``item_names``. Standard/PyTree
            items go through asyncckpt's host staging and writer, JSON items
            are written by it too, and any other handler (orbax's, a user's,
            grain's) saves and restores its item itself, inside the step's
            commit.
        logger: orbax's ``AbstractLogger``: ``log_entry`` gets the entry orbax
            logs for each save and restore.
        handler_registry: orbax's ``CheckpointHandlerRegistry``: handlers by
            (item, args type); excludes ``item_handlers`` and ``item_names``.
        max_to_keep: Checkpoints to keep (None keeps all). With ``best_fn``,
            the best ones by metric; the newest is never deleted.
        save_interval_steps: ``should_save`` is true on multiples of this.
        keep_period: Steps divisible by this are kept forever.
        best_fn: Maps the ``metrics`` of a save to the number ranked by
            ``best_mode``.
        best_mode: ``"max"`` or ``"min"``.
        keep_checkpoints_without_metrics: With ``best_fn``, keep checkpoints
            saved without metrics instead of deleting them.
        async_options: asyncckpt's ``AsyncOptions``: staging slots, fsync,
            checksums. orbax's ``AsyncOptions`` (its timeout and
            ``post_finalization_callback``) go where orbax's manager takes
            them, ``options=CheckpointManagerOptions(async_options=...)``;
            given here, it is refused with a ``TypeError`` naming that place.
        restore_options: Verification on restore.
        coordination_timeout_s: Multi-process: longest wait for another
            process during a save.
        remote: A persistent second tier (``s3://`` / ``gs://`` URL or a
            path) for a local ``directory``: saves commit locally and every
            ``remote_options.every_n_steps`` are uploaded in the background.
            ``directory`` itself may be such a URL (saves stage in a local
            scratch directory and are durable once committed remotely).
        remote_options: Schedule, retention and retries of the remote tier
            (default: every step, ``max_to_keep`` as above). A URL
            ``directory`` keeps in its bucket what this manager's retention
            keeps: there ``RemoteOptions.max_to_keep`` is refused.
        format_options: How arrays are stored (``FormatOptions``: orbax's
            OCDBT format or one zarr chunk file per shard; zarr v2 or v3).
            Handlers given as ``item_handlers`` decide for their items (their
            ``use_ocdbt``, ``use_zarr3``).

    Raises:
        ValueError: an orbax option asyncckpt cannot honour (named), or
            conflicting arguments.
    """

    # The format writer of each save (the background part); a subclass may set a
    # JaxSaveJob subclass of its own (one that holds or fails writes).
    _job_class: type[JaxSaveJob] = JaxSaveJob
    # Deletes one step (retention, delete()); a subclass may wrap it. A plain
    # function of the view, not a method: a dropped manager's saves still finish.
    _delete_step = staticmethod(_delete_step)

    def __init__(
        self,
        directory: str | os.PathLike,
        checkpointers: Any = None,
        options: Any = None,
        metadata: dict | None = None,
        item_names: Sequence[str] | None = None,
        item_handlers: Any = None,
        logger: Any = None,
        handler_registry: Any = None,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        keep_period: int | None = None,
        best_fn: Callable[[dict], float] | None = None,
        best_mode: Literal["max", "min"] = "max",
        keep_checkpoints_without_metrics: bool = True,
        async_options: AsyncOptions | None = None,
        restore_options: RestoreOptions | None = None,
        coordination_timeout_s: float = 1800.0,
        remote: str | None = None,
        remote_options: RemoteOptions | None = None,
        format_options: FormatOptions | None = None,
    ):
        register_with_orbax()  # orbax imported since this module was: register now
        if options is not None:
            if (max_to_keep, save_interval_steps, keep_period, best_fn, best_mode,
                    keep_checkpoints_without_metrics) != (None, 1, None, None, "max", True):
                raise ValueError("give either options= or the keyword options "
                                 "(max_to_keep, save_interval_steps, ...), not both")
            self._config = _options.from_orbax(options)
        else:
            self._config = _options.ManagerConfig(
                max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
                keep_period=keep_period, best_fn=best_fn, best_mode=best_mode,
                keep_checkpoints_without_metrics=keep_checkpoints_without_metrics,
            )
        if logger is not None and not callable(getattr(logger, "log_entry", None)):
            raise TypeError(f"logger {logger!r} has no log_entry method (orbax's AbstractLogger)")
        setup = _compat.item_setup(checkpointers, item_names, item_handlers, handler_registry)
        self._config = _options.with_checkpointers(
            self._config, use_async=setup.use_async, timeout_s=setup.timeout_s,
            async_options_given=getattr(options, "async_options", None) is not None)
        self._setup = setup
        # Items saved by their own handlers (given, or chosen by a save's args).
        self._handlers = setup.own_handlers
        self._handler_save: SaveHandle | None = None  # and its handle
        # How orbax's handler of each item restores the older items= spelling: its
        # PyTree handler takes the item for the structure only (PyTreeRestore).
        self._restore_kinds = {
            name: ("json" if setup.kinds.get(name) == "json" else
                   "pytree" if type(h).__name__ == "PyTreeCheckpointHandler" else "standard")
            for name, h in setup.handlers.items()}
        self._logger = logger
        self._item_names = None if setup.names is None else tuple(
            _args.check_item_name(n) for n in setup.names)
        self._tiers = StepTiers(directory, remote=remote, remote_options=remote_options,
                                config=self._config, owner=self)
        if self._tiers.remote_only and self._config.todelete_subdir is not None:
            raise ValueError(
                "todelete_subdir (orbax's soft delete) moves deleted steps into a subdirectory; "
                f"an s3:// / gs:// directory ({os.fspath(directory)!r}) has no renames: leave "
                "it unset there (retention deletes the steps it drops)")
        self._directory = self._tiers.local_dir
        self._options = _own_async_options(async_options)
        self._restore_options = restore_options or RestoreOptions()
        self._root_metadata = _compat.json_checked(metadata, "metadata")
        self._coord = CommitCoordinator.for_this_run(timeout_s=coordination_timeout_s,
                                               directory=directory)
        self._shards = self._tiers.multiprocess(self._coord)  # URL directory: per-process uploads
        self._primary = self._coord is None or self._coord.primary
        # [ocdbt] Which items are stored as OCDBT, and as zarr v3 (handlers'
        # use_ocdbt and use_zarr3, format_options).
        self._formats = ItemFormats(format_options, setup.handlers, os.fspath(directory))
        if self._config.create and not self._config.read_only:
            make_dirs(self._directory, mode=self._config.path_permission_mode)
        self._view = _view.view_for(self._directory, self._config.names,
                                    self._config.commit_marker, self._config.legacy_rename_ok)
        name = "asyncckpt.jax" if self._coord is None else (
            f"asyncckpt.jax[p{self._coord.process_index}]"  # log lines name the process
        )
        self._engine = AsyncEngine(options=self._options, name=name)
        self._snapshotter = Snapshotter(primary=self._primary)
        self._saves = Saves(self._coord, functools.partial(
            self._view.prepare, orbax_temps=self._config.cleanup_tmp_directories))
        # Fixed for the manager's life; made once rather than on every save.
        self._on_published = self._tiers.on_published()
        self._has_remote = self._tiers.has_remote
        # Deletes what a save condemned; holds the view, not the manager, so a
        # dropped manager's saves still finish. Only the primary deletes.
        self._delete = functools.partial(
            type(self)._delete_step, self._view, self._config.todelete_subdir,
            self._tiers if self._tiers.remote_only else None) if self._primary else None
        if self._tiers.remote_only:  # steps only the bucket holds: their records from there
            self._view.remote_record = functools.partial(
                _remote_record, self._tiers, checksums=self._restore_options.checksums)
        callback = self._config.post_finalization_callback
        self._finalized = (_compat.PostFinalization(callback)
                           if callback is not None and self._primary else None)
        self._deadline: float | None = None  # of the last save (AsyncOptions.timeout_secs)
        self._last_save: SaveHandle | None = None
        self._preemption: tuple[int, bool] | None = None
        self._closed = False
        self._view.steps.join(self)
        if (self._root_metadata is not None and self._primary and not self._config.read_only
                and self._config.save_root_metadata and os.path.isdir(self._directory)):
            _metadata.write_root_metadata(self._directory, self._root_metadata,
                                          fsync=self._options.fsync)

    # -- properties -----------------------------------------------------------

    @property
    def directory(self) -> Any:
        """The manager's directory, as orbax gives it: an ``etils.epath.Path`` (for
        ``s3://`` / ``gs://``, the URL, not the local scratch directory)."""
        from etils import epath

        return epath.Path(self._tiers.shown_dir)

    @property
    def engine(self) -> AsyncEngine:
        """The background engine: stats, history, ``estimated_write_s``."""
        return self._engine

    @property
    def last_save(self) -> SaveHandle | None:
        """Handle of the most recent save (``committed`` resolves when durable)."""
        return self._last_save

    # -- listing ----------------------------------------------------------------

    def all_steps(self, read: bool = False) -> list[int]:
        """Steps saved or being saved, oldest first, as orbax lists them.

        A step is listed from the moment ``save`` returns; steps that
        retention will delete once the newest save is durable are not.
        Temporaries of interrupted saves (asyncckpt's or orbax's) never are.
        ``read``: list the directory (and a remote tier's bucket) now rather
        than trust what was listed before, as orbax's ``read=True``.
        """
        if read:
            self._view.invalidate()
            return self._listed(fresh=True)
        return self._listed()

    def _listed(self, on_disk: frozenset[int] | None = None, *, fresh: bool = False) -> list[int]:
        """The listed steps: this directory's, and those only the remote tier has.

        A URL directory's steps in the bucket are the retention's to hide and
        delete; two tiers list the remote tier's steps as it keeps them.
        ``on_disk``: ``disk_steps()`` as just read; ``fresh``: list the bucket now.
        """
        if self._tiers.remote_only:
            return self._view.listed(on_disk, remote=self._tiers.remote_steps(fresh=fresh))
        return self._tiers.steps(self._view.listed(on_disk), fresh=fresh)

    def latest_step(self) -> int | None:
        """The newest listed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best listed step by ``best_fn`` (without ``best_fn``: the latest)."""
        if self._config.best_fn is None:
            return self.latest_step()
        ranked = [(self._config.metric(self._view.record(s).metrics), s)
                  for s in self.all_steps()]
        ranked = [(m, s) for m, s in ranked if m is not None]
        if not ranked:
            return None
        sign = 1.0 if self._config.best_mode == "max" else -1.0
        return max(ranked, key=lambda ms: (sign * ms[0], ms[1]))[1]

    def reload(self) -> None:
        """Forgets what was read from the directory (metrics, times), to read it afresh."""
        self._view.invalidate()
        self._view.steps.reload()

    def reached_preemption(self, step: int) -> bool:
        """Whether JAX's preemption sync point is ``step`` (every process agrees).

        False unless ``jax.distributed`` runs with its preemption service.
        Asked once per step; the answer is remembered for that step.
        """
        step = operator.index(step)
        if self._preemption is None or self._preemption[0] != step:
            self._preemption = (step, _compat.preemption_reached(step))
        return self._preemption[1]

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save, by orbax's rules.

        False for a step not after the latest; else true at a preemption
        sync point, on the save schedule (``save_interval_steps``,
        ``save_on_steps`` or ``should_save_fn``) and, without
        ``should_save_fn``, for the first save of an empty directory.
        """
        return self._should_save(operator.index(step), None)

    def _should_save(self, step: int, on_disk: frozenset[int] | None) -> bool:
        """``should_save``, from ``on_disk`` (one listing for all of a ``save``) if given."""
        if self._config.read_only:
            logger.warning("%s is read only: save of step %d skipped", self._directory, step)
            return False
        steps = self._listed(on_disk)
        latest = steps[-1] if steps else None
        if latest is not None and latest >= step:
            return False
        policy = self._config.save_decision_policy
        if policy is not None:  # orbax's object decides, from what orbax gives it
            return _policies.should_save(
                policy, step, self._view.policy_infos(steps),
                saving=self._config.saving_in_progress_check and self.is_saving_in_progress(),
                preempted=self.reached_preemption(step),
                multiprocessing_options=self._config.multiprocessing_options)
        if self.reached_preemption(step):
            return True
        if latest is None and self._config.should_save_fn is None:
            return True
        return self._config.on_schedule(step, latest)

    def is_saving_in_progress(self) -> bool:
        """Whether a save of this manager is not yet durable."""
        return self._engine.pending > 0

    def check_for_errors(self) -> None:
        """Raises the failure of a background save not yet reported, if any."""
        self._engine.raise_pending_error()
        if self._finalized is not None:
            self._finalized.raise_pending()

    def step_dir(self, step: int) -> str:
        """The directory of a step's checkpoint (a URL in a URL directory)."""
        step = operator.index(step)
        return self._tiers.shown_step_dir(step, self._view.step_dir(step))

    # -- metadata ---------------------------------------------------------------

    def metadata(self, step: int | None = None) -> StepMetadata | RootMetadata:
        """A step's metadata, or with no step the manager-level ``metadata=``.

        Raises:
            CheckpointNotFoundError: no such step.
        """
        if step is None:
            found = _metadata.read_root_metadata(self._directory)
            if found is not None:
                return found
            return RootMetadata(custom_metadata=dict(self._root_metadata or {}))
        step = self._existing_step(step)
        if self._tiers.has_remote:  # a step only the remote tier holds: its metadata files
            self._wait_for([step])
        remote = self._tiers.open_remote(step, checksums=self._restore_options.checksums)
        return _metadata.read_step_metadata(step, self._view.step_dir(step) if remote is None
                                            else remote.path)

    def metrics(self, step: int) -> Any:
        """The ``metrics`` saved with a step (None if none), as orbax's ``metrics(step)``.

        Raises:
            CheckpointNotFoundError: no such step.
        """
        return self.metadata(operator.index(step)).metrics  # type: ignore[union-attr]

    def item_metadata(self, step: int) -> Any:
        """Shapes and dtypes of a step's items (``metadata(step).item_metadata``)."""
        return self.metadata(operator.index(step)).item_metadata  # type: ignore[union-attr]

    def _existing_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"no checkpoints in {self._directory!r}")
            return steps[-1]
        step = operator.index(step)
        if step not in steps:
            shown = ", ".join(map(str, steps[-20:])) or "none"
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {self._directory!r} (steps there: {shown})"
            )
        return step

    # -- saving ---------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any = None,
        save_kwargs: Any = None,
        metrics: dict | None = None,
        force: bool = False,
        args: Any = None,
        custom_metadata: dict | None = None,
    ) -> bool:
        """Snapshots the state and writes it as step ``step`` in the background.

        Returns after every value is copied to host memory, so the state may
        be updated, donated or deleted at once. The step is listed at once;
        with ``enable_async_checkpointing=False`` this returns only once it
        is durable.

        Args:
            step: The step number (names the checkpoint's directory).
            state: A pytree of ``jax.Array``s, NumPy arrays and scalars (with
                a dict of ``checkpointers``: a dict of items by name).
            save_kwargs: orbax's older spelling with ``state``:
                ``{"save_args": tree of ocp.SaveArgs}`` (by item name with a
                dict of checkpointers).
            metrics: JSON-serializable metrics, ranked by ``best_fn``.
            force: Save even if ``should_save(step)`` is false.
            args: orbax's spelling instead of ``state``: ``StandardSave``,
                ``PyTreeSave`` or ``JsonSave``, or a ``Composite`` of named
                items; ``save_args`` of ``ocp.SaveArgs`` cast (``dtype``) and
                chunk (``chunk_byte_size``, ``shard_axes``) each leaf.
            custom_metadata: JSON-serializable data stored with the checkpoint
                (read back with ``metadata(step).custom_metadata``).

        Returns:
            Whether a save was started.

        Raises:
            StepAlreadyExistsError: ``step`` is already saved or being saved
                (a subclass of orbax's, and of ValueError).
            UnsupportedObjectError: a leaf cannot be saved (named in the message).
            Exception: a failure of an earlier background save (several
                processes: raised once this save is started, see docs/jax.md).
        """
        if self._closed or self._engine.closed:
            raise EngineClosedError(f"{self._directory}: cannot save after close()")
        t0 = time.time() if self._logger is not None else 0.0
        multi = self._coord is not None  # then earlier failures raise once staged
        if not multi:
            self._raise_pending()
        setup = self._setup
        items, named = _args.save_items(state, args, save_kwargs=save_kwargs,
                                        named_items=setup.named_items, kinds=setup.kinds,
                                        handlers=self._handlers)
        if self._item_names is not None:
            _args.check_items(items, named, self._item_names)
        for item in items:  # orbax keeps the handler an item's args chose, for later calls
            if item.kind == "handler":
                self._handlers.learn(item.name, item.handler)
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        # One process: one look at the directory serves the whole save.
        on_disk = None if multi else self._view.disk_steps()
        # should_save says (and logs) that a read-only manager never saves.
        started = (force and not self._config.read_only) or self._should_save(step, on_disk)
        t1 = time.time() if self._logger is not None else 0.0
        if started and not multi and self._handler_save is not None and any(
                i.kind == "handler" for i in items):
            # A handler writes one save at a time, so this save waits for the last
            # one with handler items: its failure is this call's, as orbax's save()
            # raises the failure of the save it waited for.
            concurrent.futures.wait([self._handler_save.committed])
            self._raise_pending()
        if started and multi:
            with self._saves.attempt(step) as (seq, save_key):  # every process numbers it
                self._start_save(step, items, metrics, custom_metadata, seq, save_key, None)
        elif started:
            self._start_save(step, items, metrics, custom_metadata, self._saves.next_seq(),
                             None, on_disk)
        if multi:
            self._raise_pending()
        if started and not self._config.enable_async:
            self._engine.wait_until_finished()
        if started and self._logger is not None:
            self._logger.log_entry(_compat.step_statistics(
                "save", step=step, directory=self._directory,
                reached_preemption=self.reached_preemption(step),
                synchronous=not self._config.enable_async,
                checkpointer_blocking_start_time=t1,
                checkpointer_blocking_duration_secs=time.time() - t1,
                checkpoint_manager_blocking_start_time=t0,
                checkpoint_manager_blocking_duration_secs=time.time() - t0))
        return started

    def prepare(self, state: Any = None, *, args: Any = None) -> None:
        """Builds the host staging memory for saves of ``state``, in the background.

        Otherwise the first save allocates and faults in its staging slots on
        the calling thread (``num_slots`` states: up to 3.6 s for 1 GiB on a
        2-core VM). Called once the state exists (e.g. while the first step
        compiles), the first save of that structure only copies; what is not
        built by then it allocates itself. Nothing is written; the memory is
        held from now on, as from a first save (read-only managers: none).

        Args:
            state: A pytree as ``save`` takes it (values are not read).
            args: orbax's spelling instead of ``state``, as for ``save``.

        Raises:
            EngineClosedError: The manager is closed.
            UnsupportedObjectError: a leaf cannot be saved.
        """
        if self._closed or self._engine.closed:
            raise EngineClosedError(f"{self._directory}: cannot prepare after close()")
        if self._config.read_only:
            return  # it never saves
        staging: dict[str, int] = {}
        setup = self._setup
        for item in _args.save_items(state, args, named_items=setup.named_items,
                                     kinds=setup.kinds, handlers=self._handlers)[0]:
            if item.kind == "pytree":
                ocdbt = self._formats.ocdbt_target(item.name, item.ocdbt_target_data_file_size)
                plan = self._snapshotter.plan(item.value, item.chunking, ocdbt,
                                              zarr3=self._formats.zarr3(item.name))[0]
                staging.update(plan.staging_layout(item.name))
        self._engine.prepare_staging(staging)

    def _raise_pending(self) -> None:  # a failed background upload surfaces here too
        # Asked only when a failure is stored (the engine's own test in its save()).
        if self._engine.has_stored_error:
            self._engine.raise_pending_error()
        if self._has_remote:
            self._tiers.raise_pending_error()
        if self._finalized is not None and self._finalized.failed:
            self._finalized.raise_pending()

    def _start_save(self, step: int, items: list[_args.SaveItem], metrics: Any,
                    custom_metadata: Any, seq: int, save_key: str | None,
                    on_disk: frozenset[int] | None) -> SaveHandle:
        """Reserves the step, stages the state and queues the write; raises before staging."""
        if self.reached_preemption(step):
            logger.info("saving step %d at the preemption sync point", step)
        metrics = _compat.json_checked(metrics, "metrics")
        custom_metadata = _compat.json_checked(custom_metadata, "custom_metadata")
        self._config.metric(metrics)
        res = self._view.reserve(step, metrics, _compat.step_already_exists_error, on_disk)
        try:
            return self._stage(res, step, items, metrics, custom_metadata, seq, save_key)
        except BaseException:
            self._view.settle(res, committed=False, deleter=None)
            raise

    def _stage(self, res: Reservation, step: int, items: list[_args.SaveItem], metrics: Any,
               custom_metadata: Any, seq: int, save_key: str | None) -> SaveHandle:
        view = self._view
        token = self._saves.token()
        remote = self._tiers.remote_steps() if self._tiers.remote_only else frozenset()
        if condemned := view.condemn(res, self._config, remote=remote):
            logger.debug("step %d condemns %s (deleted once it is durable)", step, condemned)
        ranked = self._config.best_fn is not None and self._config.write_metrics
        typestrs, extra = fmt.item_files(items, metrics if ranked else None,
                                         primary=self._primary)
        foreign = HandlerSaves([HandlerSave(i.name, i.handler, i.value)
                                for i in items if i.kind == "handler"])
        targets = {i.name: self._formats.ocdbt_target(i.name, i.ocdbt_target_data_file_size)
                   for i in items if i.kind == "pytree"}  # [ocdbt] None: plain zarr

        config = self._config
        timeout = config.save_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout

        peers = None if self._coord is None else Peers(self._coord, save_key, self._shards)
        path = view.step_dir(step)
        then = (None if self._on_published is None
                else functools.partial(self._on_published, step))

        job_class = self._job_class

        def stage(slot):
            trees = [self._snapshotter.stage(i.value, slot, item=i.name, chunking=i.chunking,
                                             ocdbt=targets[i.name],
                                             zarr3=self._formats.zarr3(i.name))
                     for i in items if i.kind == "pytree"]
            if extra or not trees:  # one pytree alone is staged as it is, not re-joined
                trees.append(StagedTree((), tuple(extra)))
            txn = step_transaction(path, options=self._options, step=step,
                                   token=f"{token}-{seq}", commit_marker=config.commit_marker,
                                   shared=self._coord is not None, then=then,
                                   mode=config.path_permission_mode, on_begin=view.refresh)
            if foreign:  # they write at the call, into the step's directory
                try:
                    foreign.start(txn.begin())
                except BaseException:
                    foreign.abandon()
                    txn.abort()
                    raise
            elif not config.create_directories_asynchronously:
                txn.begin()  # on this thread, as orbax makes it
            return job_class(
                transaction=txn,
                staged=StagedTree.combine(trees),
                info=StepInfo(metrics, custom_metadata, typestrs, started=res.record.timestamp),
                peers=peers,
                ocdbt={n: t for n, t in targets.items() if t is not None},
                deadline=deadline,
                on_committed=self._finalized,
                handlers=foreign or None,
            )

        try:
            handle = self._engine.save(stage, label=str(step), step=step,
                                       raise_pending=self._coord is None)
        except BaseException:
            if foreign:
                foreign.abandon()  # never started, or started and given up
            raise
        view.steps.attach(res, handle.committed)
        if foreign:
            self._handler_save = handle
        self._deadline = deadline
        deleter = self._delete  # not self: a dropped manager's saves still finish
        handle.committed.add_done_callback(
            lambda f: view.settle(res, committed=f.exception() is None, deleter=deleter)
        )
        self._last_save = handle
        return handle

    def delete(self, step: int) -> None:
        """Deletes a step (waiting first if it is still being saved).

        Raises:
            CheckpointNotFoundError: no such step (a FileNotFoundError, as orbax).
        """
        if self._config.read_only:
            logger.warning("%s is read only: delete of step %d skipped", self._directory, step)
            return
        step = self._existing_step(step)
        self._wait_for([step])
        self._view.delete(step, self._delete)  # without a deleter: hidden until deleted
        if self._delete is not None and not self._config.background_delete:
            # orbax's delete returns once the step's files are gone: so does this one
            # (the step was renamed out of the listing; its files go on the remover).
            self._view.steps.removals.wait()

    # -- waiting --------------------------------------------------------------------

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Waits until every save is durable (and, multi-process, committed).

        With orbax's ``AsyncOptions(timeout_secs=...)``, waits at most until the
        last save's timeout has passed (that save then fails, uncommitted).

        Raises:
            TimeoutError: saves still in flight after ``timeout`` (or the saves' own).
            Exception: a background failure not yet reported.
        """
        own = False
        if self._deadline is not None and self._engine.pending:
            left = max(0.0, self._deadline - time.monotonic()) + 1.0  # the job fails by then
            own = timeout is None or left < timeout
            timeout = left if own else timeout
        try:
            self._engine.wait_until_finished(timeout)
        except TimeoutError as e:
            # A save that failed (its own timeout included) carries the engine's
            # note; only the engine's "still in flight" is this timeout's.
            if not own or getattr(e, "__notes__", None):
                raise
            raise TimeoutError(  # a writer that makes no progress at all (orbax raises too)
                f"the save of step {self._last_save.label if self._last_save else '?'} did "
                f"not finish within the timeout of {self._config.save_timeout_s:.0f} s "
                "(AsyncOptions.timeout_secs); it will not be committed") from e
        if not self._config.background_delete:  # [retention] deleted steps' files gone too
            self._view.steps.removals.wait(timeout)
        self._tiers.wait_until_finished(timeout)
        if self._finalized is not None:
            self._finalized.raise_pending()

    def _wait_for(self, steps: Sequence[int] | None) -> None:
        """Waits for in-flight saves of these steps (None: all) of any manager here."""
        names = None if steps is None else [self._view.names.name(s) for s in steps]
        pending = self._view.steps.futures(names)
        if pending:
            concurrent.futures.wait(pending)
            # The futures resolve before their callbacks (retention) have run.
            self._view.steps.wait_settled(names)
            self._engine.raise_pending_error()

    def close(self, timeout: float | None = None) -> None:
        """Flushes saves in flight, frees the staging memory, releases the directory."""
        if self._closed:
            self._engine.close(timeout)
            return
        try:
            self._engine.close(timeout)
            self._view.steps.removals.wait(timeout)
        finally:
            self._closed = True
            self._view.steps.leave(self)  # the last one releases the directory lock
            self._tiers.close(timeout)

    # -- restoring ------------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        items: Any = None,
        restore_kwargs: Any = None,
        directory: str | os.PathLike | None = None,
        args: Any = None,
        *,
        target: Any = None,
    ) -> Any:
        """Restores a step (default: the newest that verifies).

        Waits for the step's save if it is still in flight. The files are
        checked against the manifest (sizes, and CRC32s unless
        ``RestoreOptions`` turns them off); only the arrays asked for are read.
        Without ``step``, a checkpoint that fails the check is skipped with a
        warning naming it and the file at fault, and the next older is tried.

        Args:
            step: The step to restore, or None for the newest valid one.
            items: A pytree like the saved one (orbax's older name; ``target=``
                is the same); each leaf says what to restore, as orbax's
                ``StandardRestore``: ``jax.ShapeDtypeStruct`` with a sharding
                (any mesh or device count; without one: the saved sharding, or
                NumPy for a leaf saved from NumPy), ``jax.Array`` (onto its
                sharding), NumPy arrays, NumPy or Python scalars, None and
                ``ocp.PLACEHOLDER`` (not read). With a manager made with a
                ``PyTreeCheckpointer`` (or its handler), only its structure
                counts, as orbax's ``PyTreeRestore``. With a dict of
                checkpointers: a dict of items by name. None returns nested
                dicts/lists, each leaf as it was saved (a ``jax.Array`` on its
                saved sharding, NumPy with its own dtype).
            args: orbax's spelling instead of ``items``: ``StandardRestore``,
                ``PyTreeRestore`` (``restore_args``, ``partial_restore``,
                ``transforms``), ``JsonRestore``, or a ``Composite`` of them by
                item name (returns a ``Composite``; items left out are not read).
            restore_kwargs: orbax's older spelling with ``items``:
                ``{"restore_args": tree of ocp.RestoreArgs, "transforms": ...}``
                (by item name with a dict of checkpointers).
            directory: Restore from this directory instead (same step names).
            target: ``items``, by asyncckpt's earlier name.

        Raises:
            CheckpointNotFoundError: no such step or item, or no checkpoint at all.
            CorruptCheckpointError: the step's files do not match the manifest
                (the file is named), or, for ``step=None``, none does.
            ValueError: ``target`` does not match the saved tree.
        """
        # Multi-process: integrity verdicts are shared, so all processes agree;
        # any other failure here is announced, so no process waits for this one.
        verdicts = None if self._coord is None else self._coord.restore_verdicts()
        self._engine.make_room_for_restore()  # idle staging gives way (host memory budget)
        t0, tried = time.time(), []
        if target is not None:
            if items is not None:
                raise TypeError("give items or target= (the same argument), not both")
            items = target
        try:
            requests, named = _args.restore_items(
                items, args, restore_kwargs, named_items=self._setup.named_items,
                kinds=self._restore_kinds, handlers=self._handlers)
            with shared_verdicts(verdicts):
                restored = self._restore(step, requests, named, directory, tried)
        except Exception as e:
            if verdicts is not None and not isinstance(e, PeerFailedError):
                verdicts.abort(e)
            raise
        if self._logger is not None:
            self._logger.log_entry(_compat.step_statistics(
                "restore", step=tried[-1] if tried else step,
                directory=os.fspath(directory or self._directory),
                checkpointer_start_time=t0, checkpointer_duration_secs=time.time() - t0,
                checkpoint_manager_start_time=t0,
                checkpoint_manager_duration_secs=time.time() - t0))
        return restored

    def _restore(self, step: int | None, requests: Any, named: bool,
                 directory: str | os.PathLike | None, tried: list[int]) -> Any:
        names, checksums = self._config.names, self._restore_options.checksums
        step = None if step is None else operator.index(step)
        if directory is None:
            self._wait_for(None if step is None else [step])
            root, steps = self._directory, self._listed(fresh=True)
            # [storage] A remote-only step is fetched file by file, as read, into a private cache.
            open_remote = functools.partial(self._tiers.open_remote, checksums=checksums)
            return restore_listed(root, steps, step, requests, named, names=names,
                                  checksums=checksums, open_remote=open_remote, tried=tried,
                                  handlers=self._handlers)
        root = os.path.abspath(os.fspath(directory))
        marker = self._view.commit_marker  # commit-file mode: committed steps only
        steps = sorted(s for s in (names.parse(n) for n in os.listdir(root))
                       if s is not None and os.path.isdir(os.path.join(root, names.name(s)))
                       and (marker is None or os.path.exists(
                           os.path.join(root, names.name(s), marker))))
        return restore_listed(root, steps, step, requests, named, names=names,
                              checksums=checksums, open_remote=None, tried=tried,
                              handlers=self._handlers)


_REGISTERED: list[bool] = []


def register_with_orbax() -> bool:
    """Makes ``CheckpointManager`` a virtual subclass of orbax's ``AbstractCheckpointManager``.

    Once orbax is imported (asyncckpt does not import it for the manager's
    sake: 0.2 s, and a manager works without it). Registration rather than
    subclassing: the base is a ``typing.Protocol`` of abstract methods only,
    so subclassing would inherit nothing but the import of orbax when
    ``asyncckpt.jax`` is imported. Either way ``abc``'s checks see it
    (``functools.singledispatch``, ``abc.ABCMeta.__instancecheck__``); a
    plain ``isinstance`` against that protocol raises ``TypeError`` in
    Python for every class, orbax's own manager included, as the protocol is
    not ``runtime_checkable``. Returns whether it is registered.
    """
    if _REGISTERED:
        return True
    module = sys.modules.get("orbax.checkpoint")
    base = getattr(module, "AbstractCheckpointManager", None)
    if base is None:  # not imported (or being imported): the next call registers
        return False
    base.register(CheckpointManager)
    _REGISTERED.append(True)
    return True


register_with_orbax()  # orbax imported before asyncckpt.jax: registered at once


def _remote_record(tiers: StepTiers, step: int, *, checksums: bool) -> StepRecord:
    """The record (creation time, metrics) of a step only the bucket holds, from its metadata."""
    remote = tiers.open_remote(step, checksums=checksums)
    if remote is None:
        raise CheckpointNotFoundError(f"step {step} is in neither tier")
    meta = _metadata.read_step_metadata(step, remote.path, with_items=False)
    return StepRecord(_view.save_time(meta), meta.metrics)

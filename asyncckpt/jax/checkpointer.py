"""orbax's checkpointers, saving through asyncckpt's engine: one pytree to one path.

``StandardCheckpointer().save(path, state)`` returns once the state is copied
into a host staging slot; the manager's background writer then writes
``path`` in orbax's layout (the pytree's files at the top of ``path``, as
orbax's checkpointers lay them out: OCDBT databases by default, as orbax,
zarr files with ``use_ocdbt=False``), checksums and fsyncs it, writes the
manifest and publishes ``path`` with one rename. So a save blocks exactly as
long as ``CheckpointManager.save`` does, and ``orbax.checkpoint``'s own
checkpointers restore the result.

The four classes are orbax's spellings: ``Checkpointer(handler)`` and
``PyTreeCheckpointer()`` return from ``save`` once the checkpoint is durable,
as orbax's synchronous ones; ``AsyncCheckpointer(handler)`` and
``StandardCheckpointer()`` return after the copy. When orbax is installed
each is a subclass of orbax's class of the same name (so
``isinstance(c, ocp.AsyncCheckpointer)`` holds, which Flax's
``checkpoints`` module tests before it waits for a save), as the
TensorFlow front end's manager subclasses TensorFlow's. Importing this
module imports orbax; ``import asyncckpt.jax`` does not. orbax's
constructors are deliberately not run: they build orbax's own handler
machinery, metadata store and background thread, none of which an
asyncckpt checkpointer uses; every method orbax's classes offer is
asyncckpt's own, or refuses by name (``cancel``, orbax's temporary-path
hooks). They expose orbax's handler object as ``handler``. What each orbax
option does here is in ``docs/compat.md``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from asyncckpt._closing import ClosingContext
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.writer import AsyncEngine, SaveHandle
from asyncckpt.errors import CheckpointNotFoundError, EngineClosedError, PeerFailedError
from asyncckpt.jax import _args, _compat, _handlers, _metadata
from asyncckpt.jax import _format as fmt
from asyncckpt.jax._distributed import CommitCoordinator, Saves
from asyncckpt.jax._handlers import HandlerSave, HandlerSaves
from asyncckpt.jax._job import JaxSaveJob, Peers, StepInfo, step_transaction
from asyncckpt.jax._metadata import StepMetadata
from asyncckpt.jax._ocdbt import FormatOptions, handler_uses_ocdbt, handler_uses_zarr3
from asyncckpt.jax._restore import restore_tree, shared_verdicts
from asyncckpt.jax._snapshot import Snapshotter, StagedTree
from asyncckpt.jax.manager import register_with_orbax
from asyncckpt.options import AsyncOptions, RestoreOptions
from asyncckpt.storage.url import is_url

try:
    from orbax.checkpoint import AsyncCheckpointer as _OrbaxAsyncCheckpointer
    from orbax.checkpoint import Checkpointer as _OrbaxCheckpointer
    from orbax.checkpoint import PyTreeCheckpointer as _OrbaxPyTreeCheckpointer
    from orbax.checkpoint import StandardCheckpointer as _OrbaxStandardCheckpointer
except ImportError:  # pragma: no cover - asyncckpt[jax] installs orbax
    _OrbaxCheckpointer = _OrbaxAsyncCheckpointer = object
    _OrbaxStandardCheckpointer = _OrbaxPyTreeCheckpointer = object

logger = logging.getLogger(__name__)

register_with_orbax()  # this module imports orbax: the manager is orbax's kind from now on

__all__ = ["AsyncCheckpointer", "Checkpointer", "PyTreeCheckpointer", "StandardCheckpointer"]

ROOT = fmt.ROOT_ITEM  # the pytree's files are at the top of the checkpoint's path
# orbax's commit marker: written inside the directory before it is renamed into
# place, so readers using orbax's commit-file atomicity see it as finalized too.
COMMIT_FILE = "commit_success.txt"
_COMMIT_TEXT = b"committed by asyncckpt"
# The multi-process key-value namespace of checkpointers (each one numbered).
_COORDINATION_NAME = "asyncckpt.jax.Checkpointer"
_DEFAULT_TIMEOUT_S = 1800.0

_STANDARD = "StandardCheckpointHandler"
_PYTREE = "PyTreeCheckpointHandler"
# What orbax records in _CHECKPOINT_METADATA for each handler (its typestr()).
_TYPESTR = {
    _STANDARD: fmt.STANDARD_HANDLER,
    _PYTREE: "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
}
_TEMPORARY_PATHS = ("AtomicRenameTemporaryPath", "CommitFileTemporaryPath")
_UNSET: Any = object()  # an argument left at orbax's default


def _orbax_type(obj: Any) -> str | None:
    cls = type(obj)
    return cls.__name__ if cls.__module__.startswith("orbax.") else None


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(f"{what} is not supported by asyncckpt's checkpointers: {why}")


_FOREIGN = "handler"  # any other handler: it saves and restores the checkpoint itself


def _handler_kind(handler: Any) -> str:
    """``_STANDARD`` or ``_PYTREE`` for one of orbax's pytree handlers (asyncckpt's fast
    path), ``_FOREIGN`` for any other handler, and for orbax's pytree handlers where
    customized (``_handlers.customized``): it writes the checkpoint's files itself,
    inside asyncckpt's transaction.

    Raises:
        ValueError: an object without orbax's handler methods.
    """
    kind = _orbax_type(handler)
    if kind in (_STANDARD, _PYTREE) and not _handlers.customized(handler):
        return kind
    if not _handlers.is_handler(handler):
        raise ValueError(
            f"{type(handler).__module__}.{type(handler).__qualname__} is not a checkpoint "
            "handler (orbax's CheckpointHandler methods save/async_save and restore are "
            "missing)")
    return _FOREIGN


def _check_recorded_items(path: str) -> None:
    """Before a handler reads the checkpoint at ``path``: the items its
    ``_CHECKPOINT_METADATA`` names (orbax's composite handler opens their
    directories) must be directories of the checkpoint.

    Raises:
        CorruptCheckpointError: an item name that leads elsewhere (named).
    """
    handlers = fmt.read_step_metadata(path).get("item_handlers")
    if isinstance(handlers, dict):
        _metadata.item_names(path, handlers)


def _check_flag(name: str, value: Any) -> None:
    """orbax's boolean handler settings must be bools (so ``handler_uses_ocdbt`` reads them)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_orbax_options(*, multiprocessing_options: Any, file_options: Any,
                         checkpoint_metadata_store: Any, temporary_path_class: Any) -> None:
    """Refuses the orbax options asyncckpt's checkpointers cannot honour (named)."""
    mp = multiprocessing_options
    if mp is not None:
        if getattr(mp, "primary_host", 0) != 0:
            raise _refuse(f"MultiprocessingOptions(primary_host={mp.primary_host!r})",
                          "process 0 writes the metadata and commits every save; leave it 0")
        if getattr(mp, "active_processes", None) is not None:
            raise _refuse("MultiprocessingOptions(active_processes=...)",
                          "every JAX process takes part in each save")
        # barrier_sync_key_prefix keeps orbax's barriers of several checkpointers
        # apart; asyncckpt's keys are per checkpointer already.
    # FileOptions.path_permission_mode is honoured (the checkpointer's mode).
    if getattr(file_options, "skip_sync_file_validations", False):
        raise _refuse("FileOptions(skip_sync_file_validations=True)",
                      "the destination is always checked (force=True replaces it)")
    if checkpoint_metadata_store is not None:
        raise _refuse("checkpoint_metadata_store",
                      "asyncckpt writes _CHECKPOINT_METADATA itself, with the checkpoint")
    if temporary_path_class is not None and getattr(
            temporary_path_class, "__name__", None) not in _TEMPORARY_PATHS:
        raise _refuse(f"temporary_path_class={temporary_path_class!r}",
                      "a checkpoint is published by rename with orbax's commit file inside, "
                      "which satisfies AtomicRenameTemporaryPath and CommitFileTemporaryPath")
    # atomicity_options: every mode is met for the same reason.


def _engine_settings(async_options: Any, timeout_s: float | None
                     ) -> tuple[AsyncOptions, float, Callable[[], None] | None]:
    """asyncckpt's ``AsyncOptions``, the coordination timeout and orbax's post-commit callback.

    ``async_options`` is asyncckpt's ``AsyncOptions`` (staging slots, fsync,
    checksums) or orbax's (its timeout and ``post_finalization_callback``).
    """
    if async_options is None or isinstance(async_options, AsyncOptions):
        return async_options or AsyncOptions(), timeout_s or _DEFAULT_TIMEOUT_S, None
    if _orbax_type(async_options) == "AsyncOptions":
        if getattr(async_options, "barrier_sync_fn", None) is not None:
            raise _refuse("orbax AsyncOptions(barrier_sync_fn=...)",
                          "processes agree through JAX's distributed key-value store")
        # create_directories_asynchronously: the writer thread creates them anyway.
        return (AsyncOptions(), timeout_s or float(async_options.timeout_secs),
                async_options.post_finalization_callback)
    raise TypeError(f"async_options must be asyncckpt.AsyncOptions or orbax's "
                    f"AsyncOptions, got {type(async_options).__qualname__}")


def _local_path(directory: str | os.PathLike) -> str:
    text = os.fspath(directory)
    if is_url(text):
        raise ValueError(f"{text!r}: asyncckpt's checkpointers write local (or mounted) paths; "
                         "for s3:// or gs:// use asyncckpt.jax.CheckpointManager(url)")
    return os.path.abspath(text)


class Checkpointer(ClosingContext, _OrbaxCheckpointer):
    """orbax's ``Checkpointer(handler)``: saves one pytree to a path, returning once durable.

    The base of asyncckpt's checkpointers; ``AsyncCheckpointer`` returns from
    ``save`` once the state is copied instead. Every save goes through
    asyncckpt's engine: staging slots, the background writer, the manifest
    with checksums and the commit by rename.

    Args:
        handler: ``ocp.StandardCheckpointHandler()`` or
            ``ocp.PyTreeCheckpointHandler()``; says which ``args`` the
            methods take (``StandardSave``/``PyTreeSave`` and the restores)
            and, by its ``use_ocdbt`` (orbax's default True), whether the
            pytree is stored in OCDBT databases or as zarr files, and by its
            ``use_zarr3`` (a ``PyTreeCheckpointHandler``'s; default False)
            whether its arrays are zarr v3 or v2.
        async_options: asyncckpt's ``AsyncOptions`` (staging slots, fsync,
            checksums) or orbax's (timeout, ``post_finalization_callback``,
            called on the writer thread once each checkpoint is published).
        multiprocessing_options, file_options, atomicity_options,
        checkpoint_metadata_store, temporary_path_class: orbax's options;
            what cannot be honoured is refused here, by name.
        restore_options: Verification on restore.
        coordination_timeout_s: Several processes: longest wait for another
            process during a save.

    Raises:
        ValueError: an option or handler setting asyncckpt cannot honour.
    """

    _blocking = True  # save() returns once the checkpoint is durable
    # Each save's format writer; a subclass may set its own (one that holds or fails writes).
    _job_class: type[JaxSaveJob] = JaxSaveJob

    def __init__(
        self,
        handler: Any,
        *,
        async_options: Any = None,
        multiprocessing_options: Any = None,
        file_options: Any = None,
        atomicity_options: Any = None,
        checkpoint_metadata_store: Any = None,
        temporary_path_class: Any = None,
        restore_options: RestoreOptions | None = None,
        coordination_timeout_s: float | None = None,
    ):
        if handler is None and type(self) in (Checkpointer, AsyncCheckpointer):
            raise TypeError(f"{type(self).__name__} needs orbax's handler: "
                            "ocp.StandardCheckpointHandler() or ocp.PyTreeCheckpointHandler()")
        self._kind = _STANDARD if handler is None else _handler_kind(handler)
        if self._kind == _FOREIGN:
            # A handler without registered args takes orbax's legacy arguments: orbax's
            # own wrapper, as orbax's checkpointers wrap it.
            handler = _handlers.with_registered_args(handler)
        # The format, as the handler says (orbax's default without orbax: OCDBT, zarr v2).
        own = handler is not None and self._kind != _FOREIGN
        self._format = FormatOptions(
            use_ocdbt=bool(handler_uses_ocdbt(handler)) if own else True,
            use_zarr3=bool(handler_uses_zarr3(handler)) if own else False)
        _check_orbax_options(multiprocessing_options=multiprocessing_options,
                             file_options=file_options,
                             checkpoint_metadata_store=checkpoint_metadata_store,
                             temporary_path_class=temporary_path_class)
        del atomicity_options  # every mode is met (see _check_orbax_options)
        # orbax's FileOptions.path_permission_mode: of the directories and files made.
        self._mode = getattr(file_options, "path_permission_mode", None)
        self._options, timeout_s, self._post_commit = _engine_settings(
            async_options, coordination_timeout_s)
        self._handler = handler
        self._typestr = (_handlers.typestr(handler) if self._kind == _FOREIGN
                         else _TYPESTR[self._kind])
        self._restore_options = restore_options or RestoreOptions()
        self._coord = CommitCoordinator.for_this_run(timeout_s=timeout_s,
                                                     directory=_COORDINATION_NAME)
        self._primary = self._coord is None or self._coord.primary
        # orbax's post_finalization_callback: after each commit, by the primary.
        self._finalized = (_compat.PostFinalization(self._post_commit)
                           if self._post_commit is not None and self._primary else None)
        name = "asyncckpt.jax.checkpointer" if self._coord is None else (
            f"asyncckpt.jax.checkpointer[p{self._coord.process_index}]")
        self._engine = AsyncEngine(options=self._options, name=name)
        self._snapshotter = Snapshotter(primary=self._primary)
        self._saves = Saves(self._coord, lambda: None)  # no directory of its own to lock
        self._extra = ((COMMIT_FILE, _COMMIT_TEXT),) if self._primary else ()
        self._joined: tuple[tuple, tuple] | None = None  # (a plan's metadata, + commit file)
        self._lock = threading.Lock()
        self._in_flight: dict[str, SaveHandle] = {}
        self._last_save: SaveHandle | None = None
        self._closed = False

    # -- properties ---------------------------------------------------------------

    @property
    def handler(self) -> Any:
        """orbax's handler object (None when orbax is not installed)."""
        return self._handler

    @property
    def engine(self) -> AsyncEngine:
        """The background engine: stats, history, ``estimated_write_s``."""
        return self._engine

    @property
    def last_save(self) -> SaveHandle | None:
        """Handle of the most recent save (``committed`` resolves when durable)."""
        return self._last_save

    # -- saving ---------------------------------------------------------------------

    def save(self, directory: str | os.PathLike, *args: Any, force: bool = False,
             custom_metadata: dict | None = None, **kwargs: Any) -> None:
        """Saves a pytree to ``directory`` (orbax's argument forms).

        ``save(path, tree)``, ``save(path, args=ocp.args.StandardSave(tree))``
        (``PyTreeSave`` for a PyTree handler) or the args' fields as keywords
        (``save(path, item=tree)``).

        Raises:
            ValueError: ``directory`` exists (or is being saved) and ``force``
                is false, as orbax; an argument asyncckpt cannot honour.
            UnsupportedObjectError: a leaf cannot be saved (named).
            Exception: a failure of an earlier background save.
        """
        if self._kind == _FOREIGN:
            item = _args.SaveItem(ROOT, "handler", self._foreign_args(args, kwargs, restore=False),
                                  handler=self._handler)
        else:
            item = self._save_item(args, kwargs)
        self._save(directory, item, force=force, custom_metadata=custom_metadata)

    def _foreign_args(self, args: tuple, kwargs: dict, *, restore: bool) -> Any:
        """A foreign handler's ``CheckpointArgs`` from orbax's argument forms (orbax's own
        construction: an args object as it is, else the handler's registered args class
        made from the arguments)."""
        from orbax.checkpoint._src.checkpointers import checkpointer as orbax_checkpointer

        return orbax_checkpointer.construct_checkpoint_args(
            self._handler, not restore, *args, **kwargs)

    def _save_item(self, args: tuple, kwargs: dict) -> _args.SaveItem:
        """The pytree of a save (with its ``SaveArgs`` chunking and target file size),
        from orbax's argument forms."""
        if len(args) == 1 and not kwargs:
            items, named = _args.save_items(args[0], None)
        else:
            items, named = _args.save_items(None, self._orbax_args(args, kwargs, restore=False))
        return self._one_item(items, named)

    def _orbax_args(self, args: tuple, kwargs: dict, *, restore: bool) -> Any:
        """One orbax ``CheckpointArgs`` from the forms orbax's checkpointers take.

        An args object passed positionally or by any keyword is used as is;
        otherwise the positional and keyword arguments are the handler's
        args' fields (``item``, ``save_args``, ``restore_args``...).
        """
        given = (*args, *kwargs.values())
        found = [a for a in given if _args.is_orbax_args(a)]
        if found:
            if len(given) != 1:
                raise TypeError("give the orbax args object alone (args=...)")
            return found[0]
        if not given and restore:
            return None
        try:
            from orbax.checkpoint import args as ocp_args
        except ImportError:  # pragma: no cover - asyncckpt[jax] installs orbax
            raise TypeError("without orbax installed, give the pytree alone") from None
        cls = {(False, _STANDARD): ocp_args.StandardSave, (False, _PYTREE): ocp_args.PyTreeSave,
               (True, _STANDARD): ocp_args.StandardRestore,
               (True, _PYTREE): ocp_args.PyTreeRestore}[(restore, self._kind)]
        return cls(*args, **kwargs)

    @staticmethod
    def _one_item(items: list, named: bool) -> Any:
        if named or len(items) != 1 or items[0].kind not in ("pytree", "auto"):
            raise ValueError("asyncckpt's checkpointers save and restore one pytree; for named "
                             "items (Composite) or JSON use asyncckpt.jax.CheckpointManager")
        return items[0]

    def _ocdbt_target(self, target: int | None) -> int | None:
        """How a save is written: None (zarr files), or in OCDBT with this target file size.

        ``target``: the save's own ``ocdbt_target_data_file_size`` (None:
        orbax's default for a local path, the only kind a checkpointer
        takes); a save as zarr files has no data files for it to size, as in
        orbax.
        """
        if self._format.use_ocdbt:
            return self._format.target_for("", target)
        return None

    def _save(self, directory: str | os.PathLike, item: _args.SaveItem, *, force: bool,
              custom_metadata: dict | None) -> None:
        if self._closed or self._engine.closed:
            raise EngineClosedError("cannot save after close()")
        multi = self._coord is not None  # then earlier failures raise once staged
        path = _local_path(directory)
        custom = _compat.json_checked(custom_metadata, "custom_metadata")
        ocdbt = (None if item.kind == "handler"
                 else self._ocdbt_target(item.ocdbt_target_data_file_size))
        if multi:
            with self._saves.attempt(None) as (seq, save_key):  # type: ignore[arg-type]
                self._check_destination(path, force)
                self._start_save(path, item, ocdbt, custom, force, seq, save_key)
            self._engine.raise_pending_error()
        else:
            self._check_destination(path, force)
            self._start_save(path, item, ocdbt, custom, force, self._saves.next_seq(), None)
        if self._blocking:
            self._engine.wait_until_finished()

    def _check_destination(self, path: str, force: bool) -> None:
        """orbax's rule: an existing destination is an error unless ``force``."""
        if force:
            return  # replaced once the new checkpoint is in place
        with self._lock:
            busy = path in self._in_flight
        if busy or os.path.lexists(path):
            raise ValueError(f"destination {path!r} already exists (or is being saved); "
                             "save with force=True to replace it")

    def _start_save(self, path: str, item: _args.SaveItem, ocdbt: int | None, custom: Any,
                    force: bool, seq: int, save_key: str | None) -> None:
        token = self._saves.token()
        value, chunking = item.value, item.chunking
        databases = None if ocdbt is None else {ROOT: ocdbt}
        # A foreign handler writes the checkpoint itself, into the transaction's
        # directory, at the call; one save at a time (see ``HandlerSaves``).
        foreign = HandlerSaves([HandlerSave(ROOT, item.handler, item.value)]
                               if item.kind == "handler" else [])

        def stage(slot):
            if foreign:
                staged = self._with_commit_file(StagedTree((), ()))
            else:
                staged = self._with_commit_file(self._snapshotter.stage(
                    value, slot, item=ROOT, chunking=chunking, ocdbt=ocdbt,
                    zarr3=self._format.use_zarr3))
            txn = step_transaction(path, options=self._options, step=None,
                                   token=f"{token}-{seq}", replace=force, mode=self._mode)
            recorded = self._typestr
            if foreign:
                try:
                    workdir = txn.begin()
                    foreign.start(workdir)
                    recorded = _handlers.recorded_handlers(item.handler, workdir)
                except BaseException:
                    foreign.abandon()
                    txn.abort()
                    raise
            return self._job_class(
                transaction=txn,
                staged=staged,
                info=StepInfo(custom_metadata=custom, item_handlers=recorded),
                peers=None if self._coord is None else Peers(self._coord, save_key),
                ocdbt=databases,
                on_committed=self._finalized,
                handlers=foreign or None,
            )

        try:
            handle = self._engine.save(stage, label=path, raise_pending=self._coord is None)
        except BaseException:
            if foreign:
                foreign.abandon()
            raise
        with self._lock:
            self._in_flight[path] = handle
        # Given the future, not the handle holding it: no reference cycle.
        handle.committed.add_done_callback(functools.partial(self._settled, path))
        self._last_save = handle

    def _with_commit_file(self, staged: StagedTree) -> StagedTree:
        """``staged`` plus orbax's commit file (the primary's), its chunk list untouched.

        The metadata files with it are joined once per plan (a plan hands out
        the same tuple from save to save), not on every save.
        """
        if not self._extra:
            return staged
        meta = staged.metadata_files
        joined = self._joined
        if joined is None or joined[0] is not meta:
            joined = self._joined = (meta, meta + self._extra)
        size = staged.size + len(_COMMIT_TEXT) if staged.size >= 0 else -1
        return StagedTree(staged.chunks, joined[1], staged.keepalive, size, staged.splits)

    def _settled(self, path: str, committed: concurrent.futures.Future) -> None:
        with self._lock:
            handle = self._in_flight.get(path)
            if handle is not None and handle.committed is committed:
                del self._in_flight[path]

    def prepare(self, state: Any) -> None:
        """Builds the host staging memory for saves of ``state``, in the background.

        As ``CheckpointManager.prepare``: the first save then only copies.

        Raises:
            EngineClosedError: The checkpointer is closed.
            UnsupportedObjectError: a leaf cannot be saved.
        """
        if self._closed or self._engine.closed:
            raise EngineClosedError("cannot prepare after close()")
        plan = self._snapshotter.plan(state, None, self._ocdbt_target(None),
                                      zarr3=self._format.use_zarr3)[0]
        self._engine.prepare_staging(plan.staging_layout(ROOT))

    # -- waiting ----------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Waits until every save is durable (and, multi-process, committed).

        Raises:
            Exception: a background failure not yet reported.
        """
        self._engine.wait_until_finished()
        if self._finalized is not None:
            self._finalized.raise_pending()

    def check_for_errors(self) -> None:
        """Raises the failure of a background save not yet reported, if any."""
        self._engine.raise_pending_error()
        if self._finalized is not None:
            self._finalized.raise_pending()

    def cancel(self) -> None:
        """orbax's ``AsyncCheckpointer.cancel``: not supported (raises).

        A save in flight cannot be withdrawn here: its state is staged and
        its write queued. Wait for it (``wait_until_finished``) and delete
        the path, or ``close()``.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "asyncckpt's checkpointers cannot cancel a save in flight: wait_until_finished() "
            "and delete the path, or close()")

    def get_temporary_path(self, directory: Any) -> Any:
        """orbax's hook for its own commit: not used by asyncckpt (raises).

        Raises:
            NotImplementedError: always (asyncckpt publishes by rename itself).
        """
        raise NotImplementedError("asyncckpt's checkpointers make and publish their "
                                  "temporary directory themselves; save(path, ...) directly")

    async def create_temporary_path(self, temporary_path: Any) -> None:
        """orbax's hook for its own commit: not used by asyncckpt (raises).

        Raises:
            NotImplementedError: always (asyncckpt publishes by rename itself).
        """
        raise NotImplementedError("asyncckpt's checkpointers make and publish their "
                                  "temporary directory themselves; save(path, ...) directly")

    def synchronize_next_awaitable_signal_operation_id(self) -> None:
        """orbax's hook for its own multi-process barriers: not used by asyncckpt (raises).

        Raises:
            NotImplementedError: always (asyncckpt's processes agree through
                JAX's distributed key-value store).
        """
        raise NotImplementedError("asyncckpt's checkpointers coordinate processes themselves; "
                                  "call save(path, ...) on every process")

    def _wait_for(self, path: str) -> None:
        """Waits for a save of ``path`` still in flight; raises its failure."""
        with self._lock:
            handle = self._in_flight.get(path)
        if handle is not None:
            concurrent.futures.wait([handle.committed])
            self._engine.raise_pending_error()

    def close(self) -> None:
        """Waits for saves in flight, frees the staging memory.

        Raises:
            Exception: a background failure not yet reported.
        """
        first, self._closed = not self._closed, True
        try:
            self._engine.close()
        finally:
            close = getattr(self._handler, "close", None)
            if first and close is not None:
                close()

    # -- restoring --------------------------------------------------------------------

    def restore(self, directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """Restores the pytree at ``directory`` (orbax's argument forms).

        ``restore(path)``, ``restore(path, target)``, ``restore(path,
        args=ocp.args.StandardRestore(target))`` (``PyTreeRestore`` with
        ``restore_args`` / ``partial_restore`` / ``transforms`` for a PyTree
        handler), or the args' fields as keywords (``restore(path,
        item=target, restore_args=...)``). Each leaf comes back as orbax's
        handler gives it back: a Standard handler's target says each leaf's
        type, a PyTree handler's item only the structure (see
        ``CheckpointManager.restore``). Waits for a save of ``path`` still
        in flight.

        Raises:
            CheckpointNotFoundError: nothing at ``directory`` (a FileNotFoundError).
            CorruptCheckpointError: the files do not match the manifest (named).
            ValueError: the target does not match the checkpoint (also
                ``UnsupportedLeafError`` and ``TopologyMismatchError``).
        """
        if self._kind == _FOREIGN:
            path = self._checkpoint_path(directory)
            _check_recorded_items(path)
            return _handlers.restore_item(path, ROOT, self._handler,
                                          self._foreign_args(args, kwargs, restore=True),
                                          checksums=self._restore_options.checksums)
        if len(args) == 1 and not kwargs and not _args.is_orbax_args(args[0]):
            # orbax's PyTreeRestore(item) for a PyTree handler: the structure only counts.
            items, named = _args.restore_items(args[0], None, kinds={
                fmt.ITEM: "standard" if self._kind == _STANDARD else "pytree"})
        else:
            items, named = _args.restore_items(None, self._orbax_args(args, kwargs,
                                                                       restore=True))
        request = None if items is None else self._one_item(items, named)
        return self._restore(directory, request)

    def _restore(self, directory: str | os.PathLike, request: _args.RestoreItem | None) -> Any:
        path = self._checkpoint_path(directory)
        verdicts = None if self._coord is None else self._coord.restore_verdicts()
        self._engine.make_room_for_restore()  # idle staging gives way (host memory budget)
        try:
            with shared_verdicts(verdicts):
                if request is None:
                    return restore_tree(path, checksums=self._restore_options.checksums,
                                        item=ROOT)
                return restore_tree(
                    path, request.target, checksums=self._restore_options.checksums,
                    item=ROOT, partial=request.partial, restore_args=request.restore_args,
                    by_target=request.by_target, transforms=request.transforms,
                    transforms_default_to_original=request.transforms_default_to_original)
        except Exception as e:
            if verdicts is not None and not isinstance(e, PeerFailedError):
                verdicts.abort(e)
            raise

    def _checkpoint_path(self, directory: str | os.PathLike) -> str:
        """``directory`` as a finished checkpoint (its save waited for)."""
        path = _local_path(directory)
        self._wait_for(path)
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"checkpoint at {path!r} not found")
        name = os.path.basename(path)
        if commit_lib.is_temp_name(name) or ".orbax-checkpoint-tmp" in name:
            raise ValueError(f"found incomplete checkpoint at {path!r}")
        return path

    def metadata(self, directory: str | os.PathLike) -> StepMetadata:
        """What the checkpoint at ``directory`` records besides its arrays.

        ``item_metadata`` is a tree of ``jax.ShapeDtypeStruct`` like the saved
        pytree (usable as a restore target), ``item_handlers`` the handler's
        name (as orbax's checkpointers record it), ``step`` None. Given a
        ``CompositeCheckpointHandler``, as orbax: that handler's metadata of
        the step (orbax's ``StepMetadata``, each item's by its handler).

        Raises:
            CheckpointNotFoundError: nothing at ``directory``.
        """
        import orbax.checkpoint as ocp

        path = self._checkpoint_path(directory)
        if self._kind == _FOREIGN:
            _check_recorded_items(path)
        if isinstance(self._handler, ocp.CompositeCheckpointHandler):
            # As orbax: the composite handler describes the whole step itself
            # (orbax's StepMetadata, its items' metadata by their handlers).
            return _handlers.item_metadata(path, ROOT, self._handler)
        meta = _metadata.read_step_metadata(0, path, with_items=False)
        handler = fmt.read_step_metadata(path).get("item_handlers")
        if self._kind == _FOREIGN:  # the handler's own description of what it wrote
            items = _handlers.item_metadata(path, ROOT, self._handler)
        else:  # zarr files or OCDBT, asyncckpt's or orbax's
            items = _metadata.describe_tree(path)
        return dataclasses.replace(meta, step=None, item_metadata=items,  # type: ignore[arg-type]
                                   item_handlers=handler)


class AsyncCheckpointer(Checkpointer, _OrbaxAsyncCheckpointer):
    """orbax's ``AsyncCheckpointer(handler)``: ``save`` returns once the state is copied.

    The write, checksums, fsync and commit run on the background writer, as
    for ``CheckpointManager.save``; two saves can be in flight at once (one
    per staging slot), where orbax's waits for the previous one. Call
    ``wait_until_finished()`` (or ``close()``) before reading the files with
    other tools; this class's ``restore``/``metadata`` wait for the path's
    save themselves.

    Args:
        handler: ``ocp.StandardCheckpointHandler()`` or ``ocp.PyTreeCheckpointHandler()``.
        timeout_secs: orbax's name for ``coordination_timeout_s`` (several processes).
        **kwargs: As ``Checkpointer``.
    """

    _blocking = False

    def __init__(self, handler: Any, timeout_secs: float | None = None, **kwargs: Any):
        if timeout_secs is not None:
            if kwargs.get("coordination_timeout_s") is not None:
                raise TypeError("give timeout_secs or coordination_timeout_s, not both")
            kwargs["coordination_timeout_s"] = timeout_secs
        super().__init__(handler, **kwargs)


class StandardCheckpointer(AsyncCheckpointer, _OrbaxStandardCheckpointer):
    """orbax's ``StandardCheckpointer()``: asynchronous saves of a pytree to a path.

    Example (Flax NNX)::

        checkpointer = asyncckpt.jax.StandardCheckpointer()
        checkpointer.save(path, nnx.state(model))     # returns after the copy
        abstract = nnx.state(nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0))))
        state = checkpointer.restore(path, abstract)  # waits for the save

    Args:
        **kwargs: ``Checkpointer``'s options; other keywords are
            ``ocp.StandardCheckpointHandler``'s: ``use_ocdbt`` (orbax's
            default True: OCDBT databases; False: a zarr directory per
            array), ``save_concurrent_gb``, ``restore_concurrent_gb`` (limits
            of orbax's own writer, with no effect here).
    """

    _OWN = frozenset({"async_options", "multiprocessing_options", "file_options",
                      "atomicity_options", "checkpoint_metadata_store", "temporary_path_class",
                      "restore_options", "coordination_timeout_s"})

    def __init__(self, **kwargs: Any):
        handler_kwargs = {k: v for k, v in kwargs.items() if k not in self._OWN}
        if "use_ocdbt" in handler_kwargs:
            _check_flag("use_ocdbt", handler_kwargs["use_ocdbt"])
        try:
            import orbax.checkpoint as ocp
        except ImportError:  # pragma: no cover - asyncckpt[jax] installs orbax
            if set(handler_kwargs) - {"use_ocdbt"}:
                raise TypeError(f"{sorted(handler_kwargs)} are orbax handler options; "
                                "install orbax-checkpoint") from None
            handler = None
        else:
            mp = kwargs.get("multiprocessing_options")
            handler = ocp.StandardCheckpointHandler(
                **handler_kwargs, **({} if mp is None else {"multiprocessing_options": mp}))
        super().__init__(handler, **{k: v for k, v in kwargs.items() if k in self._OWN})
        if handler is None:
            self._format = FormatOptions(use_ocdbt=handler_kwargs.get("use_ocdbt", True))

    def save(self, directory: str | os.PathLike, state: Any = None, *, args: Any = None,
             save_args: Any = None, force: bool = False,
             custom_metadata: dict | None = None) -> None:
        """Saves ``state`` (or ``args=ocp.args.StandardSave(state)``) to ``directory``.

        Returns once every value is copied to host memory: the state may be
        updated, donated or deleted at once.

        Raises:
            ValueError: ``directory`` exists (or is being saved) and ``force``
                is false, as orbax.
            UnsupportedObjectError: a leaf cannot be saved (named).
            Exception: a failure of an earlier background save.
        """
        if save_args is not None:
            if args is not None:
                raise TypeError("give save_args with the state, not with args=")
            from orbax.checkpoint import args as ocp_args

            args, state = ocp_args.StandardSave(state, save_args), None
        items, named = _args.save_items(state, args)
        self._save(directory, self._one_item(items, named), force=force,
                   custom_metadata=custom_metadata)

    def restore(self, directory: str | os.PathLike, target: Any = None, *, strict: bool = True,
                args: Any = None) -> Any:
        """Restores the pytree at ``directory`` into ``target``'s structure and shardings.

        ``target`` leaves: ``jax.ShapeDtypeStruct`` (with a sharding: any mesh
        or device count; without one: the saved sharding, or NumPy for a leaf
        saved from NumPy), ``jax.Array``, NumPy arrays, scalars, None and
        ``ocp.PLACEHOLDER`` (not read). ``target`` None returns nested dicts,
        each leaf as saved (``jax.Array``s on their saved shardings). Waits
        for a save of ``directory`` still in flight.

        Raises:
            CheckpointNotFoundError: nothing at ``directory`` (a FileNotFoundError).
            CorruptCheckpointError: the files do not match the manifest (named).
            ValueError: ``target`` does not match, or ``strict=False``
                (restoring into other shapes is not supported).
            TopologyMismatchError: no target sharding, and the saved one
                cannot be rebuilt on this run's devices (a ValueError).
        """
        if strict is not True:
            raise ValueError("strict=False (restoring into other shapes) is not supported; "
                             "shapes must match the checkpoint")
        items, named = _args.restore_items(target, args)
        return self._restore(directory, None if items is None else self._one_item(items, named))


class PyTreeCheckpointer(Checkpointer, _OrbaxPyTreeCheckpointer):
    """orbax's ``PyTreeCheckpointer()``: ``save`` returns once the checkpoint is durable.

    Takes orbax's ``PyTreeSave``/``PyTreeRestore`` forms (``restore_args``,
    ``partial_restore``, ``ocdbt_target_data_file_size``). Values are written
    uncompressed: ``use_compression`` left unset or False (orbax reads
    both); ``use_compression=True`` is refused.

    Args:
        primary_host: 0 (asyncckpt's process 0 commits).
        use_ocdbt: orbax's: store the pytree in OCDBT databases (the
            default, as orbax), or as a zarr directory per array (False).
        use_zarr3: orbax's: store the arrays as zarr v3 (True) or zarr v2
            (the default, as orbax); uncompressed either way.
        **kwargs: As ``Checkpointer``.
    """

    def __init__(self, primary_host: int | None = 0, use_ocdbt: bool = True,
                 use_zarr3: bool = False, use_compression: bool = _UNSET, **kwargs: Any):
        _check_flag("use_ocdbt", use_ocdbt)
        _check_flag("use_zarr3", use_zarr3)
        if use_compression is not _UNSET and use_compression is not False:
            raise _refuse(f"use_compression={use_compression!r}",
                          "asyncckpt writes values uncompressed (orbax reads them); leave "
                          "use_compression unset or False")
        if primary_host != 0:
            raise _refuse(f"primary_host={primary_host!r}",
                          "process 0 writes the metadata and commits every save; leave it 0")
        try:
            import orbax.checkpoint as ocp
        except ImportError:  # pragma: no cover - asyncckpt[jax] installs orbax
            handler = None
        else:
            handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
                                                  use_compression=False)
        super().__init__(handler, **kwargs)
        if handler is None:
            self._kind, self._typestr = _PYTREE, _TYPESTR[_PYTREE]
            self._format = FormatOptions(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)

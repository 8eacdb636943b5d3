"""orbax's checkpoint handlers inside asyncckpt's commit: any item orbax can save.

asyncckpt writes pytree items (``StandardSave``/``PyTreeSave``: host staging,
its own writer) and JSON items itself. Every other item is saved and restored
by its own handler, called as orbax's ``CompositeCheckpointHandler`` calls it,
inside the step's one transaction (``_engine/transaction.py``):

* at ``save()``, on the calling thread, the transaction's directory is made
  and the handler writes into the item's directory there: ``async_save``
  runs its blocking part (what it copies, it copies now) and returns futures;
  a synchronous handler's ``save`` runs whole, so the saved values are those
  of the call (grain's iterator state);
* on the writer thread, before the commit: the futures are awaited, then the
  handler's ``finalize``; its files are then adopted by the transaction
  (checksummed, fsynced, listed in the manifest) and published atomically
  with the rest of the step;
* at restore: the item's files are checked against the manifest, then the
  handler's own ``restore`` reads them.

A handler is anything with orbax's handler methods (``save`` or
``async_save``, and ``restore``): orbax's own (``JsonCheckpointHandler``,
``ProtoCheckpointHandler``, ``ArrayCheckpointHandler``,
``RandomKeyCheckpointHandler``, ``CompositeCheckpointHandler``), a user's
``AsyncCheckpointHandler`` subclass, or a duck-typed one (grain's). orbax is
imported only when a handler item is saved or restored.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncckpt import layout
from asyncckpt._engine.manifest import has_owner_marker, load_manifest, verify_files
from asyncckpt.errors import CheckpointNotFoundError

logger = logging.getLogger(__name__)


def is_handler(obj: Any) -> bool:
    """Whether ``obj`` has orbax's handler methods (``save``/``async_save``, ``restore``)."""
    return callable(getattr(obj, "restore", None)) and (
        callable(getattr(obj, "save", None)) or callable(getattr(obj, "async_save", None)))


def customized(handler: Any) -> str | None:
    """Why orbax's own ``handler`` must write its item itself, or None.

    asyncckpt's writer stands in for orbax's ``StandardCheckpointHandler`` and
    ``PyTreeCheckpointHandler`` with their stock serialization (``use_ocdbt``
    and ``use_zarr3`` are honoured by it). A handler given its own type
    handlers (``type_handler_registry``: custom leaf types), its own
    ``handler_impl``, or rich-type tree metadata (``pytree_metadata_options``)
    writes what only it knows how to write: such an item is saved by the
    handler, inside asyncckpt's transaction, like any other handler's.
    """
    if not type(handler).__module__.startswith("orbax."):
        return None
    impl = getattr(handler, "_impl", None)  # StandardCheckpointHandler wraps a PyTree one
    inner = impl if impl is not None else handler
    registry = getattr(inner, "_type_handler_registry", None)
    if registry is not None:
        from orbax.checkpoint._src.serialization import type_handler_registry

        if registry is not type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY:
            return "its own type_handler_registry"
    base = getattr(inner, "_handler_impl", None)
    if base is not None and type(base).__name__ != "BasePyTreeCheckpointHandler":
        return f"its own handler_impl ({type(base).__qualname__})"
    if getattr(getattr(inner, "_pytree_metadata_options", None), "support_rich_types", False):
        return "pytree_metadata_options(support_rich_types=True)"
    return None


def typestr(handler: Any) -> str:
    """What orbax records for ``handler`` in ``_CHECKPOINT_METADATA``'s ``item_handlers``."""
    named = getattr(handler, "typestr", None)
    if callable(named):
        return str(named())
    cls = type(handler)
    return f"{cls.__module__}.{cls.__qualname__}"


def with_registered_args(handler: Any) -> Any:
    """``handler``, or orbax's wrapper of it when it has no registered ``CheckpointArgs``
    (a handler of orbax's older API: its arguments are passed through, as orbax's
    checkpointers pass them)."""
    from orbax.checkpoint import checkpoint_args
    from orbax.checkpoint._src.checkpointers import checkpointer as orbax_checkpointer

    if checkpoint_args.has_registered_args(handler):
        return handler
    return orbax_checkpointer.get_legacy_handler_wrapper(handler)


def recorded_handlers(handler: Any, directory: str) -> Any:
    """What ``_CHECKPOINT_METADATA`` records as ``item_handlers`` for a checkpoint
    ``handler`` wrote whole (a checkpointer's), as orbax's checkpointers record it: a
    ``CompositeCheckpointHandler``'s items by name (read from what it has just started
    writing into ``directory``), any other handler's type."""
    per_item = getattr(handler, "metadata_from_temporary_paths", None)
    if per_item is not None:
        try:
            found = per_item(_path(directory)).item_handlers
        except (FileNotFoundError, NotImplementedError, ValueError, TypeError) as e:
            logger.warning("could not read the item handlers of %s (%r): the handler's "
                           "type is recorded instead", directory, e)
        else:
            if found:
                return dict(found)
    return typestr(handler)


def handler_for_args(args: Any) -> Any:
    """A new handler of the class orbax registered for ``args``' type.

    Raises:
        TypeError: ``args`` is not one of orbax's ``CheckpointArgs``.
        ValueError: no handler is registered for its type (orbax's error).
    """
    from orbax.checkpoint import checkpoint_args

    return checkpoint_args.get_registered_handler_cls(args)()


# The handlers whose items asyncckpt writes itself, as orbax records them (by class name).
_OWN_KINDS = {"StandardCheckpointHandler": "pytree", "PyTreeCheckpointHandler": "pytree",
              "JsonCheckpointHandler": "json"}


def recorded_kind(typestr: str) -> str:
    """``"pytree"`` or ``"json"`` for an item asyncckpt writes itself, else ``"handler"``."""
    return _OWN_KINDS.get(str(typestr).rsplit(".", 1)[-1], "handler")


def handler_for_typestr(item: str, typestr: str) -> Any:
    """A new handler of the type recorded for ``item`` (orbax's registry of handler types).

    Raises:
        ValueError: orbax knows no handler of that type (as orbax's manager
            raises it): the manager must be given it (``item_handlers``).
    """
    from orbax.checkpoint._src.handlers import handler_type_registry

    try:
        return handler_type_registry.get_handler_type(typestr)()
    except KeyError as e:
        raise ValueError(
            f'Item "{item}" was found in the checkpoint (saved by {typestr}), but could not be '
            "restored: give the manager its handler (item_handlers=...), or call restore with "
            "the handler's CheckpointArgs") from e


def save_args(handler: Any, value: Any, **kwargs: Any) -> Any:
    """orbax's save ``CheckpointArgs`` for ``handler`` from an older spelling's item.

    ``value`` already one of orbax's ``CheckpointArgs`` is returned as it is.
    """
    from orbax.checkpoint import checkpoint_args

    if isinstance(value, checkpoint_args.CheckpointArgs):
        return value
    save_cls, _ = checkpoint_args.get_registered_args_cls(handler)
    return save_cls(value, **kwargs)


def restore_args(handler: Any, value: Any) -> Any:
    """orbax's restore ``CheckpointArgs`` for ``handler`` from an older spelling's item."""
    from orbax.checkpoint import checkpoint_args

    if isinstance(value, checkpoint_args.CheckpointArgs):
        return value
    _, restore_cls = checkpoint_args.get_registered_args_cls(handler)
    return restore_cls(value)


def default_restore_args(name: str, handler: Any) -> Any:
    """The restore args orbax builds for an item restored without args (``restore(step)``).

    Raises:
        ValueError: the handler's restore args need an argument (grain's
            ``CheckpointRestore(item)``), as orbax raises it.
    """
    from orbax.checkpoint import checkpoint_args

    _, restore_cls = checkpoint_args.get_registered_args_cls(handler)
    try:
        return restore_cls()
    except TypeError as e:
        raise ValueError(
            f"item {name!r} was saved by {typestr(handler)}, whose restore arguments "
            f"({restore_cls.__name__}) cannot be made without values: restore it with "
            f"args=ocp.args.Composite({name}={restore_cls.__name__}(...))") from e


class ItemHandlers(Mapping):
    """The handlers of a manager's items that asyncckpt does not write itself.

    By item name (given as ``item_handlers``, a ``handler_registry``'s named
    entries, or chosen by an earlier save's args, as orbax keeps them), and
    by args type (a ``handler_registry``'s entries for any item).
    """

    def __init__(self, by_item: Mapping[str, Any] | None = None,
                 by_args: Mapping[type, Any] | None = None):
        self._by_item = dict(by_item or {})
        self._by_args = dict(by_args or {})

    def __getitem__(self, name: str) -> Any:
        return self._by_item[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_item)

    def __len__(self) -> int:
        return len(self._by_item)

    def for_args(self, args: Any) -> Any:
        """The registry's handler for ``args``' type (any item), or None."""
        return self._by_args.get(type(args))

    def learn(self, name: str, handler: Any) -> None:
        """Keeps the handler an item's save chose, for its later saves and restores."""
        self._by_item.setdefault(name, handler)


def _path(directory: str) -> Any:
    from etils import epath

    return epath.Path(directory)


@dataclass
class HandlerSave:
    """One item saved by its handler: started at ``save()``, finished before the commit.

    Attributes:
        subdir: The item's directory in the step (``""``: the checkpoint's root,
            a checkpointer's one handler).
        handler: The item's handler.
        args: Its save ``CheckpointArgs``.
    """

    subdir: str
    handler: Any
    args: Any
    _futures: list = field(default_factory=list)

    def start(self, workdir: str) -> None:
        """Runs the handler's blocking part into ``workdir/subdir`` (the saving thread)."""
        directory = os.path.join(workdir, self.subdir) if self.subdir else workdir
        os.makedirs(directory, exist_ok=True)
        path = _path(directory)
        async_save = getattr(self.handler, "async_save", None)
        if async_save is None:
            self.handler.save(path, args=self.args)
            return
        futures = async_save(path, args=self.args)
        if inspect.isawaitable(futures):  # orbax's handlers: a coroutine
            from orbax.checkpoint._src.asyncio_utils import run_sync

            futures = run_sync(futures)
        self._futures = [f for f in _flatten(futures or []) if f is not None]

    def abandon(self) -> None:
        """Waits for the handler's background writes; their errors are dropped."""
        futures, self._futures = self._futures, []
        for f in futures:
            try:
                f.result()
            except Exception as e:  # the save has failed already
                logger.debug("a handler's write of a failed save also failed: %r", e)

    def finish(self, workdir: str) -> None:
        """Waits for the handler's background writes, then its ``finalize`` (the writer thread)."""
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()
        finalize = getattr(self.handler, "finalize", None)
        if finalize is not None:
            directory = os.path.join(workdir, self.subdir) if self.subdir else workdir
            finalize(_path(directory))


def _flatten(futures: Any) -> list:
    """orbax's handlers return a list of futures, sometimes nested."""
    if isinstance(futures, (list, tuple)):
        return [f for part in futures for f in _flatten(part)]
    return [futures]


class HandlerSaves:
    """The handler items of one save (see the module docstring).

    orbax's handlers write one save at a time: a handler object keeps the
    state of its save until its ``finalize`` (orbax's composite and
    random-key handlers do), and their futures wait on signals keyed by the
    process's current operation id (orbax's ``OperationIdGenerator``), one
    for the whole process. orbax's checkpointers have one save in flight;
    asyncckpt up to one per staging slot, and managers side by side. So a
    save with handler items starts them only once the previous one of the
    process has finished its own (``start`` waits): saves of asyncckpt's own
    items are not held by this.
    """

    def __init__(self, saves: Sequence[HandlerSave]):
        self._saves = list(saves)
        self._done = threading.Event()
        self._operation: str | None = None

    def __bool__(self) -> bool:
        return bool(self._saves)

    @property
    def subdirs(self) -> list[str]:
        return [s.subdir for s in self._saves]

    def start(self, workdir: str) -> None:
        """Starts every handler's save into ``workdir`` (the saving thread).

        As orbax's checkpointers do before each save, a new operation id is
        taken first: orbax's handlers wait on signals (their directories made)
        keyed by it, so two saves in flight must not share one. Every process
        of a multi-process save calls ``save()``, in the same order, so each
        takes the same id.
        """
        from orbax.checkpoint._src.futures import synchronization

        global _LAST
        with _START_LOCK:
            if _LAST is not None and _LAST is not self:
                _LAST.wait_done()
            _LAST = self
            self._operation = str(synchronization.OperationIdGenerator.next_operation_id())
            for s in self._saves:
                s.start(workdir)

    def finish(self, workdir: str) -> None:
        try:
            for s in self._saves:
                s.finish(workdir)
        finally:
            self._forget_signals()
            self._done.set()

    def _forget_signals(self) -> None:
        """Drops the signals this save's handlers registered (orbax does it after a commit)."""
        if self._operation is None:
            return
        from orbax.checkpoint._src.futures import future

        future.AwaitableSignalsContract.remove_all_awaitable_signals(self._operation)
        self._operation = None

    def abandon(self) -> None:
        """The save failed: waits for the handlers' background writes, their errors dropped
        (the failure that stopped the save is reported), so none writes into a removed
        directory."""
        try:
            for s in self._saves:
                s.abandon()
        finally:
            self._forget_signals()
            self._done.set()

    def wait_done(self) -> None:
        """Waits until these handlers are done with their save (finished or abandoned)."""
        self._done.wait()

    def files(self, workdir: str, skip: frozenset[str] = frozenset()) -> list[str]:
        """Every file the handlers wrote (names relative to ``workdir``), less ``skip``."""
        names = []
        for sub in self.subdirs:
            root = os.path.join(workdir, sub) if sub else workdir
            for parent, dirs, files in os.walk(root):
                dirs.sort()
                rel = os.path.relpath(parent, workdir).replace(os.sep, "/")
                prefix = "" if rel == "." else rel + "/"
                names += [prefix + f for f in sorted(files) if prefix + f not in skip]
        return names


# The process's last ``HandlerSaves`` started (``HandlerSaves.start`` waits for it).
_LAST: HandlerSaves | None = None
_START_LOCK = threading.Lock()


def restore_item(step_dir: str, subdir: str, handler: Any, args: Any, *, checksums: bool,
                 remote: Any = None) -> Any:
    """Checks an item's files against the step's manifest, then restores it by its handler.

    ``subdir`` ``""``: the checkpoint's root (a checkpointer's one handler).
    ``remote``: ``step_dir`` is a remote step opened file by file; the item's
    files are fetched first (the handler reads them itself).

    Raises:
        CheckpointNotFoundError: the step has no such item.
        CorruptCheckpointError: a file of the item does not match the manifest.
    """
    item_dir = os.path.join(step_dir, subdir) if subdir else step_dir
    if not os.path.isdir(item_dir):
        raise CheckpointNotFoundError(f"checkpoint {step_dir!r} has no item {subdir!r}")
    manifest = load_manifest(layout.jax_manifest_path(step_dir), checkpoint=step_dir,
                             owned=has_owner_marker(step_dir))
    if manifest is not None:
        prefix = subdir + "/" if subdir else ""
        records = [r for r in manifest.files if r.name.startswith(prefix)]
        if remote is not None:
            remote.fetch_names([r.name for r in records])
        verify_files(step_dir, records, checksums=checksums, checkpoint=step_dir)
    else:
        logger.info("%s has no asyncckpt manifest (written by orbax?); restoring item %r "
                    "unverified", step_dir, subdir)
    return handler.restore(_path(item_dir), args=args)


def item_metadata(step_dir: str, subdir: str, handler: Any) -> Any:
    """The handler's ``metadata`` of an item (None where it has none)."""
    metadata = getattr(handler, "metadata", None)
    if metadata is None:
        return None
    return metadata(_path(os.path.join(step_dir, subdir) if subdir else step_dir))

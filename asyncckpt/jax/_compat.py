"""Small pieces of orbax compatibility: its error type, handlers and checkpointers,
format requests, the post-finalization callback, logger entries, preemption sync point.

orbax is imported only when one of these is used, never at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.errors import AsyncCkptError
from asyncckpt.jax import _handlers


@functools.cache
def step_already_exists_error() -> type[ValueError]:
    """``StepAlreadyExistsError``: a subclass of orbax's when orbax is installed."""
    try:
        from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError as base
    except ImportError:
        base = ValueError
    return type("StepAlreadyExistsError", (base, AsyncCkptError), {
        "__module__": "asyncckpt.jax",
        "__doc__": "The step is already saved, or being saved, in this directory.",
    })


# Values that a JSON round trip gives back unchanged (as the same type and value).
_JSON_SCALARS = frozenset((str, int, float, bool, type(None)))


def json_checked(value: Any, what: str) -> Any:
    """``value`` as JSON gives it back (a copy); raises TypeError if it is not JSON."""
    if value is None:
        return None
    # A flat dict of plain values (metrics, usually) comes back as a copy of
    # itself: made directly, without the encoder and decoder on a save's clock.
    if type(value) is dict and all(type(k) is str and type(v) in _JSON_SCALARS
                                   for k, v in value.items()):
        return dict(value)
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serializable: {e}") from e


# orbax's handlers asyncckpt writes items of, by class name: what the item holds.
_HANDLER_KINDS = {"StandardCheckpointHandler": "pytree", "PyTreeCheckpointHandler": "pytree",
                  "JsonCheckpointHandler": "json"}


@dataclass(frozen=True)
class ItemSetup:
    """What the manager's item arguments say (``item_names``, ``item_handlers``,
    the older positional ``checkpointers``).

    Attributes:
        names: The named items (``Composite`` saves), or None for the one
            unnamed ``default`` item.
        kinds: ``"pytree"``, ``"json"`` or ``"handler"`` (saved by its own
            handler) by item name, for items whose handler was given (a save
            of another kind is refused, as orbax does).
        named_items: Saves take ``save(step, {name: value})`` (a dict of
            checkpointers was given: orbax's legacy named items).
        use_async: From ``checkpointers``: whether orbax would save
            asynchronously (an ``AsyncCheckpointer`` among them); None when
            none were given.
        timeout_s: The longest ``AsyncCheckpointer`` timeout among them.
        handlers: orbax's handler objects by item name (``default`` for the
            unnamed item), however they were given: their ``use_ocdbt`` and
            ``use_zarr3`` decide each item's layout (``_ocdbt.ItemFormats``).
        by_args: A ``handler_registry``'s handlers for any item, by args
            type (those asyncckpt does not write itself).
    """

    names: tuple[str, ...] | None = None
    kinds: dict[str, str] = field(default_factory=dict)
    handlers: dict[str, Any] = field(default_factory=dict)
    named_items: bool = False
    use_async: bool | None = None
    timeout_s: float | None = None
    by_args: dict[type, Any] = field(default_factory=dict)

    @property
    def own_handlers(self) -> _handlers.ItemHandlers:
        """The handlers that save their items themselves (kind ``"handler"``), by item and
        by args type (a new, mutable record: the manager adds what saves choose)."""
        return _handlers.ItemHandlers(
            {n: h for n, h in self.handlers.items() if self.kinds.get(n) == "handler"},
            self.by_args)


def _handler_kind(name: str, handler: Any) -> str:
    """The kind of item ``handler`` saves: ``"pytree"`` and ``"json"`` are written by
    asyncckpt itself, ``"handler"`` by the handler (``_handlers``), orbax's pytree
    handlers too where customized (``_handlers.customized``).

    A pytree handler's format settings (``use_ocdbt``, ``use_zarr3``) are
    honoured by ``_ocdbt.ItemFormats``.

    Raises:
        ValueError: an object without orbax's handler methods.
    """
    kind = _HANDLER_KINDS.get(type(handler).__name__)
    if kind is None or not type(handler).__module__.startswith("orbax.") or (
            kind == "pytree" and _handlers.customized(handler)):
        if not _handlers.is_handler(handler):
            raise ValueError(f"item {name!r}: {type(handler).__name__} is not a checkpoint "
                             "handler (orbax's CheckpointHandler methods save/async_save and "
                             "restore are missing)")
        return "handler"
    return kind


def item_setup(checkpointers: Any, item_names: Any, item_handlers: Any,
               handler_registry: Any = None) -> ItemSetup:
    """The manager's items from orbax's four spellings of them.

    ``item_handlers`` is one handler (the unnamed ``default`` item) or a dict
    by item name; ``item_names`` adds names whose handler is decided by the
    first save; ``checkpointers`` (orbax's older positional argument) is one
    ``Checkpointer``/``AsyncCheckpointer`` or a dict of them, whose handlers
    are taken as ``item_handlers`` and whose kind decides synchronous or
    asynchronous saves, as in orbax; ``handler_registry`` (orbax's
    ``CheckpointHandlerRegistry``) maps (item, args type) to a handler, an
    item of None standing for any item.

    Raises:
        ValueError: combinations orbax refuses, or an object that is no handler.
    """
    given = [n for n, v in (("checkpointers", checkpointers), ("item_names", item_names),
                            ("item_handlers", item_handlers)) if v is not None]
    if handler_registry is not None:
        if given:
            raise ValueError(f"handler_registry and {given[0]} are mutually exclusive, "
                             "as in orbax")
        return _from_registry(handler_registry)
    if checkpointers is not None:
        if item_names is not None or item_handlers is not None:
            raise ValueError("checkpointers and item_names/item_handlers are mutually "
                             "exclusive, as in orbax")
        return _from_checkpointers(checkpointers)
    if item_handlers is None:
        names = None if item_names is None else tuple(item_names)
        return ItemSetup(names=names)
    if isinstance(item_handlers, Mapping):
        kinds = {str(n): _handler_kind(n, h) for n, h in item_handlers.items()}
        names = tuple(dict.fromkeys([*(item_names or ()), *kinds]))
        return ItemSetup(names=names, kinds=kinds,
                         handlers={str(n): h for n, h in item_handlers.items()})
    if item_names is not None:
        raise ValueError("item_handlers as one handler (the unnamed default item) and "
                         "item_names are mutually exclusive, as in orbax")
    return ItemSetup(kinds={"default": _handler_kind("default", item_handlers)},
                     handlers={"default": item_handlers})


def _from_registry(registry: Any) -> ItemSetup:
    """``item_setup`` from orbax's ``CheckpointHandlerRegistry`` (``get_all_entries``)."""
    entries = getattr(registry, "get_all_entries", None)
    if not callable(entries):
        raise TypeError(f"handler_registry {registry!r} is not orbax's "
                        "CheckpointHandlerRegistry (it has no get_all_entries)")
    kinds, handlers, by_args = {}, {}, {}
    for (item, args_type), handler in entries().items():
        if item is None:
            if _handler_kind(args_type.__name__, handler) == "handler":
                by_args[args_type] = handler
            continue
        kinds[str(item)] = _handler_kind(str(item), handler)
        handlers.setdefault(str(item), handler)
    return ItemSetup(kinds=kinds, handlers=handlers, by_args=by_args)


def _from_checkpointers(checkpointers: Any) -> ItemSetup:
    single = not isinstance(checkpointers, Mapping)
    by_name = {"default": checkpointers} if single else dict(checkpointers)
    kinds, asynchronous, timeouts, handlers = {}, [], [], {}
    for name, ckptr in by_name.items():
        handler = getattr(ckptr, "handler", None)
        if handler is None or not any(c.__name__ == "Checkpointer" for c in type(ckptr).__mro__):
            raise ValueError(f"checkpointers[{name!r}] is not an orbax Checkpointer: "
                             f"{type(ckptr).__name__}")
        kinds[str(name)] = _handler_kind(name, handler)
        handlers[str(name)] = handler
        is_async = any(c.__name__ == "AsyncCheckpointer" for c in type(ckptr).__mro__)
        asynchronous.append(is_async)
        if is_async:
            timeouts.append(async_checkpointer_timeout(ckptr))
    timeout = max((t for t in timeouts if t is not None), default=None)
    return ItemSetup(names=None if single else tuple(kinds), kinds=kinds,
                     named_items=not single, use_async=any(asynchronous), timeout_s=timeout,
                     handlers=handlers)


def async_checkpointer_timeout(ckptr: Any) -> float | None:
    """An orbax ``AsyncCheckpointer``'s timeout, which orbax's manager applies to its saves.

    orbax 0.12.8 keeps it on the checkpointer's private async manager and reads
    it from there itself (``CheckpointManager`` with ``checkpointers=``); None
    if a later orbax moved it.
    """
    manager = getattr(ckptr, "_async_manager", None)
    timeout = getattr(manager, "_timeout_secs", None)
    return None if timeout is None else float(timeout)


class PostFinalization:
    """orbax's ``AsyncOptions.post_finalization_callback``, run once a save is committed.

    Called on the writer thread, by the process that commits (process 0), as
    orbax calls it. The save is durable by then, so a failure of the callback
    does not undo it: it is kept and raised by the manager's next call.
    Holds the callback only, never the manager.
    """

    def __init__(self, callback: Any):
        self._callback = callback
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    def __call__(self, step: int, stats: Any, extra: Any) -> None:
        del stats, extra
        try:
            self._callback()
        except Exception as e:
            e.add_note(f"asyncckpt: raised by post_finalization_callback after step {step} "
                       "was committed")
            with self._lock:
                self._errors.append(e)

    @property
    def failed(self) -> bool:
        return bool(self._errors)

    def raise_pending(self) -> None:
        with self._lock:
            if not self._errors:
                return
            error, self._errors = self._errors[0], self._errors[1:]
        raise error


def step_statistics(kind: str, **values: Any) -> dict:
    """The entry orbax's manager gives its ``logger.log_entry`` for a save or restore.

    orbax's own ``SaveStepStatistics`` / ``RestoreStepStatistics`` as a dict
    (``dataclasses.asdict``), its fields set from ``values``.
    """
    from orbax.checkpoint.logging import step_statistics as stats

    cls = stats.SaveStepStatistics if kind == "save" else stats.RestoreStepStatistics
    return dataclasses.asdict(cls(**values))


@functools.cache
def _multihost_utils() -> Any:
    # Imported once: a ``from`` import of a package runs Python code on every call.
    from jax.experimental import multihost_utils

    return multihost_utils


def preemption_reached(step: int) -> bool:
    """JAX's preemption sync point: ``multihost_utils.reached_preemption_sync_point(step)``.

    Looked up on the module at each call, as orbax calls it, so a function
    put in its place (a test's, a scheduler's) decides. False without
    ``jax.distributed`` (JAX's own answer) and when JAX raises ``RuntimeError``
    because its preemption service is off (as orbax treats it).
    """
    try:
        return bool(_multihost_utils().reached_preemption_sync_point(step))
    except RuntimeError:
        return False

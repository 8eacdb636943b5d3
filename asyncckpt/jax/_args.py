"""orbax's ``args=`` spelling, turned into the items the manager saves and restores.

``save(step, args=ocp.args.StandardSave(tree))`` saves one unnamed item (the
``default`` directory, as orbax); ``ocp.args.Composite(a=..., b=...)`` saves
named items side by side (``<step>/a``, ``<step>/b``). Pytree items
(``StandardSave``/``PyTreeSave``) are written by asyncckpt's snapshot path,
JSON items (``JsonSave``) as orbax's ``JsonCheckpointHandler`` writes them;
every other item by its own handler (``_handlers``: the one given for the
item, or the one orbax registered for its args' type). orbax's own argument
objects are recognised by class name and read by attribute, so the short
forms work without orbax installed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from asyncckpt.jax import _format as fmt
from asyncckpt.jax import _handlers, _tree
from asyncckpt.jax._ocdbt import check_target_size

PLACEHOLDER = ...  # orbax's PLACEHOLDER: a target leaf that is not restored

_PYTREE_SAVE = ("StandardSave", "StandardSaveArgs", "PyTreeSave", "PyTreeSaveArgs")
_JSON_SAVE = ("JsonSave", "JsonSaveArgs")
_PYTREE_RESTORE = ("StandardRestore", "StandardRestoreArgs", "PyTreeRestore",
                   "PyTreeRestoreArgs")
_JSON_RESTORE = ("JsonRestore", "JsonRestoreArgs")
_COMPOSITE = ("Composite", "CompositeArgs")
# Containers that are never orbax arguments: the usual state skips the type check.
_PLAIN_TREES = frozenset((dict, list, tuple))


@dataclass(frozen=True)
class SaveItem:
    """One item of a save: a pytree (``kind="pytree"``), a JSON value (``"json"``), or
    one saved by its own handler (``"handler"``: ``value`` is its save args).

    ``chunking``: for a pytree saved with ``SaveArgs(chunk_byte_size=...)`` or
    ``shard_axes``, one ``(chunk_byte_size, shard_axes, itemsize)`` (or None)
    per leaf in ``_tree.flatten`` order, ``itemsize`` the element size before a
    ``dtype`` cast (orbax chooses the chunks by it); None when every leaf is
    written as it is.

    ``ocdbt_target_data_file_size``: the save's own (``StandardSave(...,
    ocdbt_target_data_file_size=...)``), None when not given.
    """

    name: str
    kind: Literal["pytree", "json", "handler"]
    value: Any
    chunking: tuple | None = None
    ocdbt_target_data_file_size: int | None = None
    handler: Any = None


# SaveArgs fields asyncckpt honours; any other one set is refused.
_SAVE_ARGS_FIELDS = frozenset({"aggregate", "dtype", "chunk_byte_size", "shard_axes"})


def _apply_save_args(name: str, tree: Any, save_args: Any) -> tuple[Any, tuple | None]:
    """``tree`` with orbax's per-leaf ``SaveArgs`` applied, and the chunking they ask for.

    ``dtype`` casts the leaf before it is staged (as orbax casts it before
    writing); ``chunk_byte_size`` and ``shard_axes`` choose the zarr chunks the
    leaf is written in (``_format.sub_chunk_shape``). Default ``SaveArgs()``
    change nothing.

    Raises:
        ValueError: ``save_args`` does not have the item's structure, or asks
            for something asyncckpt does not write (``aggregate=True``, as
            orbax's ``StandardCheckpointHandler`` refuses it too).
    """
    leaves, treedef = _tree.flatten(tree)
    args, args_def = _tree.flatten(save_args)
    if args_def != treedef:
        raise ValueError(f"item {name!r}: save_args must have the structure of the saved "
                         f"tree, one SaveArgs per leaf ({len(args)} given for {len(leaves)})")
    chunking: list[tuple[int | None, tuple[int, ...], int] | None] = []
    cast = False
    for i, (leaf, arg) in enumerate(zip(leaves, args, strict=True)):
        if arg is None or _tree.is_empty_leaf(leaf):
            chunking.append(None)
            continue
        if not dataclasses.is_dataclass(arg) or type(arg).__name__ != "SaveArgs":
            raise TypeError(f"item {name!r}: save_args holds {arg!r}, not orbax's SaveArgs")
        for f in dataclasses.fields(arg):
            if f.name not in _SAVE_ARGS_FIELDS and getattr(arg, f.name) != f.default:
                raise ValueError(f"item {name!r}: SaveArgs.{f.name} is not supported by "
                                 "asyncckpt (dtype, chunk_byte_size and shard_axes are)")
        if arg.aggregate:
            raise ValueError(f"item {name!r}: SaveArgs(aggregate=True) is not supported (orbax "
                             "deprecated it; its StandardCheckpointHandler refuses it too): "
                             "leave aggregate=False")
        itemsize = np.dtype(getattr(leaf, "dtype", type(leaf))).itemsize
        if arg.dtype is not None and np.dtype(arg.dtype) != np.dtype(getattr(leaf, "dtype",
                                                                             type(leaf))):
            leaves[i] = _cast(leaf, arg.dtype)
            cast = True
        size, axes = arg.chunk_byte_size, tuple(arg.shard_axes or ())
        chunking.append(None if size is None and not axes else (size, axes, itemsize))
    if cast:
        tree = treedef.unflatten(leaves)
    return tree, (tuple(chunking) if any(e is not None for e in chunking) else None)


def _cast(leaf: Any, dtype: Any) -> Any:
    """``leaf`` as ``dtype`` (a jax.Array stays one, on its devices)."""
    astype = getattr(leaf, "astype", None)
    if astype is not None:
        return astype(dtype)
    return np.asarray(leaf, dtype=dtype)


@dataclass(frozen=True)
class RestoreItem:
    """One item to restore.

    Attributes:
        name: The item's directory in the step.
        kind: ``pytree``, ``json``, ``handler`` (restored by ``handler`` with
            ``target`` as its restore args), or ``auto`` (decided by what is
            on disk).
        target: The pytree's target (None: rebuilt from the checkpoint).
        restore_args: orbax ``RestoreArgs`` tree, used when given.
        partial: The target may name a subset of the saved leaves.
        handler: The item's handler (``handler`` items).
        by_target: The target's leaves say what each leaf comes back as
            (``StandardRestore``, asyncckpt's short spelling); False: the
            target gives the structure only and leaves come back as saved,
            as orbax's PyTree handler restores its item (``PyTreeRestore``).
        transforms: orbax's ``transforms`` (None: none).
        transforms_default_to_original: orbax's flag of that name.
    """

    name: str
    kind: Literal["pytree", "json", "handler", "auto"]
    target: Any = None
    restore_args: Any = None
    partial: bool = False
    handler: Any = None
    by_target: bool = True
    transforms: Any = None
    transforms_default_to_original: bool = True


def _orbax_name(obj: Any) -> str | None:
    cls = type(obj)
    return cls.__name__ if cls.__module__.startswith("orbax.") else None


def is_orbax_args(obj: Any) -> bool:
    """Whether ``obj`` is one of orbax's ``CheckpointArgs`` (or a ``Composite``)."""
    return any(c.__name__ == "CheckpointArgs" and c.__module__.startswith("orbax.")
               for c in type(obj).__mro__) or _orbax_name(obj) in _COMPOSITE


def is_composite(obj: Any) -> bool:
    return _orbax_name(obj) in _COMPOSITE


def check_item_name(name: str) -> str:
    """``name`` if it can name an item (a plain directory name other than the metrics item)."""
    if (not isinstance(name, str) or not name or "/" in name or name.startswith(".")
            or name == fmt.METRICS_ITEM):
        raise ValueError(f"item name {name!r} is not usable (a plain directory name, not "
                         f"{fmt.METRICS_ITEM!r}, which holds the metrics)")
    return name


def _unsupported(what: Any, why: str) -> TypeError:
    return TypeError(f"{type(what).__module__}.{type(what).__qualname__}: {why}")


def _one_save(name: str, arg: Any, handler: Any = None) -> SaveItem:
    """One item from its orbax args; ``handler``: the one given for the item, if any."""
    kind = _orbax_name(arg)
    if handler is None and kind in _PYTREE_SAVE:
        target = getattr(arg, "ocdbt_target_data_file_size", None)
        try:
            check_target_size(target)
        except ValueError as e:
            raise ValueError(f"item {name!r}: {e}") from None
        if getattr(arg, "custom_metadata", None) is not None:
            raise ValueError(f"item {name!r}: per-item custom_metadata is not supported; pass "
                             "custom_metadata= to save() (stored for the step)")
        save_args = getattr(arg, "save_args", None)
        if save_args is None:
            return SaveItem(name, "pytree", arg.item, ocdbt_target_data_file_size=target)
        tree, chunking = _apply_save_args(name, arg.item, save_args)
        return SaveItem(name, "pytree", tree, chunking=chunking,
                        ocdbt_target_data_file_size=target)
    if handler is None and kind in _JSON_SAVE:
        return _json_item(name, arg.item)
    if not is_orbax_args(arg):
        raise _unsupported(arg, "args= takes orbax.checkpoint.args objects (and those "
                                "registered with ocp.args.register_with_handler)")
    # Any other item is saved by its own handler: given, or registered for its args.
    return SaveItem(name, "handler", arg,
                    handler=handler if handler is not None else _handlers.handler_for_args(arg))


def _legacy_save(name: str, value: Any, kind: str | None, kwargs: Any,
                 handler: Any = None) -> SaveItem:
    """One item of orbax's older ``save(step, items, save_kwargs)`` spelling."""
    if kind == "handler":
        return SaveItem(name, "handler", _handlers.save_args(handler, value, **(kwargs or {})),
                        handler=handler)
    kwargs = dict(kwargs or {})
    save_args = kwargs.pop("save_args", None)
    if kwargs:
        raise TypeError(f"item {name!r}: save_kwargs {sorted(kwargs)} are not supported "
                        "(save_args is)")
    if kind == "json":
        if save_args is not None:
            raise TypeError(f"item {name!r}: a JSON item takes no save_args")
        return _json_item(name, value)
    if save_args is None:
        return SaveItem(name, "pytree", value)
    return SaveItem(name, "pytree", *_apply_save_args(name, value, save_args))


def _json_item(name: str, value: Any) -> SaveItem:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"item {name!r}: JsonSave needs a JSON-serializable value: {e}") from e
    return SaveItem(name, "json", value)


def save_items(state: Any, args: Any, *, save_kwargs: Any = None, named_items: bool = False,
               kinds: Mapping[str, str] | None = None,
               handlers: _handlers.ItemHandlers | None = None
               ) -> tuple[list[SaveItem], bool]:
    """The items of a save and whether they were named (a ``Composite``).

    Args:
        state: The short spelling's state (or orbax's older ``items``).
        args: orbax's ``args=``.
        save_kwargs: orbax's older ``save_kwargs`` (``{"save_args": tree}``,
            by item name with ``named_items``).
        named_items: ``state`` is a dict of items by name (a manager made
            with a dict of checkpointers, orbax's older spelling).
        kinds: The handler kind of each item whose handler was given.
        handlers: By item name, the handlers that save their items themselves
            (kind ``"handler"``: given, or learned from an earlier save's args).

    Raises:
        TypeError: neither or both of ``state`` and ``args``, or an argument
            type asyncckpt does not save.
        ValueError: an option of the arguments that asyncckpt cannot honour,
            or an item saved with arguments its handler does not take.
    """
    own = handlers if handlers is not None else _handlers.ItemHandlers()
    items, named = _save_items(state, args, save_kwargs, named_items, kinds or {}, own)
    for item in items:
        want = (kinds or {}).get(item.name)
        if want is not None and want != item.kind and want != "handler":
            spelling = "StandardSave/PyTreeSave" if want == "pytree" else "JsonSave"
            raise ValueError(f"item {item.name!r} has a {want} handler: save it with "
                             f"ocp.args.{spelling}")
    return items, named


def _save_items(state: Any, args: Any, save_kwargs: Any, named_items: bool,
                kinds: Mapping[str, str], own: _handlers.ItemHandlers
                ) -> tuple[list[SaveItem], bool]:
    if state is not None and args is not None:
        raise TypeError("give either the state or args=, not both")
    if state is None and args is None:
        raise TypeError("save() needs the state: save(step, state) or save(step, args=...)")
    if save_kwargs is not None and state is None:
        raise TypeError("save_kwargs go with the state (orbax's older save(step, items, "
                        "save_kwargs)); with args= put save_args in the args")
    if args is None and named_items:
        if not isinstance(state, Mapping) or not state:
            raise TypeError("this manager was given a dict of checkpointers: save a dict of "
                            "its items by name")
        per_item = save_kwargs or {}
        return [_legacy_save(check_item_name(str(k)), v, kinds.get(str(k)), per_item.get(k),
                             own.get(str(k)))
                for k, v in state.items()], True
    if args is None and (save_kwargs is not None or fmt.ITEM in own):
        return [_legacy_save(fmt.ITEM, state, kinds.get(fmt.ITEM), save_kwargs,
                             own.get(fmt.ITEM))], False
    if args is None:
        if type(state) in _PLAIN_TREES or not is_orbax_args(state):
            return [SaveItem(fmt.ITEM, "pytree", state)], False
        args = state  # save(step, ocp.args.StandardSave(x)): the keyword was forgotten
    if is_composite(args):
        items = [_one_save(check_item_name(k), v, own.get(k) or own.for_args(v))
                 for k, v in args.items()]
        if not items:
            raise ValueError("a Composite with no items saves nothing")
        return items, True
    if not is_orbax_args(args):
        raise _unsupported(args, "args= takes orbax.checkpoint.args objects")
    return [_one_save(fmt.ITEM, args, own.get(fmt.ITEM) or own.for_args(args))], False


def check_items(items: list[SaveItem], named: bool, item_names: tuple[str, ...]) -> None:
    """Checks a save's items against a manager's ``item_names``.

    Raises:
        ValueError: the save is not a ``Composite``, or names an unknown item.
    """
    if not named:
        raise ValueError(f"this manager has item_names {list(item_names)}: save "
                         "with args=ocp.args.Composite(name=...)")
    unknown = [i.name for i in items if i.name not in item_names]
    if unknown:
        raise ValueError(f"items {unknown} are not among item_names {list(item_names)}")


def _one_restore(name: str, arg: Any, handler: Any = None) -> RestoreItem:
    """One item to restore from its orbax args; ``handler``: the one given for the item."""
    if arg is None:
        return RestoreItem(name, "auto", handler=handler)
    kind = _orbax_name(arg)
    if handler is None and kind in _PYTREE_RESTORE:
        for field, default in (("legacy_transform_fn", None),
                               ("fallback_sharding", None), ("support_layout", False)):
            if getattr(arg, field, default) not in (default,):
                raise ValueError(f"item {name!r}: {kind}.{field} is not supported by asyncckpt")
        if getattr(arg, "strict", True) is not True:
            raise ValueError(f"item {name!r}: strict=False (restoring into other shapes) is not "
                             "supported; shapes must match the checkpoint")
        return RestoreItem(name, "pytree", arg.item, getattr(arg, "restore_args", None),
                           bool(getattr(arg, "partial_restore", False)),
                           by_target=kind.startswith("Standard"),
                           transforms=getattr(arg, "transforms", None),
                           transforms_default_to_original=bool(
                               getattr(arg, "transforms_default_to_original", True)))
    if handler is None and kind in _JSON_RESTORE:
        return RestoreItem(name, "json")
    if not is_orbax_args(arg):
        raise _unsupported(arg, "args= takes orbax.checkpoint.args objects (and those "
                                "registered with ocp.args.register_with_handler)")
    return RestoreItem(name, "handler", arg,
                       handler=handler if handler is not None else _handlers.handler_for_args(arg))


# orbax's older restore_kwargs: the fields of its PyTreeRestore other than the item.
_RESTORE_KWARGS = frozenset({"restore_args", "transforms", "transforms_default_to_original",
                             "partial_restore"})


def _legacy_restore(name: str, target: Any, kwargs: Any, kind: str,
                    handler: Any = None) -> RestoreItem:
    """One item of orbax's older ``restore(step, items, restore_kwargs)`` spelling.

    ``kind``: ``standard``, ``pytree`` or ``json`` (see ``restore_items``);
    ``handler``: the item's own handler, which restores it (its restore args
    made from ``target``, as orbax makes them).
    """
    if handler is not None:
        return RestoreItem(name, "handler", _handlers.restore_args(handler, target),
                           handler=handler)
    if kind == "json":
        if kwargs:
            raise TypeError(f"item {name!r}: a JSON item takes no restore_kwargs")
        return RestoreItem(name, "json")
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - _RESTORE_KWARGS)
    if unknown:
        raise TypeError(f"item {name!r}: restore_kwargs {unknown} are not supported "
                        f"({', '.join(sorted(_RESTORE_KWARGS))} are)")
    return RestoreItem(name, "pytree", target, kwargs.get("restore_args"),
                       bool(kwargs.get("partial_restore", False)),
                       by_target=kind != "pytree",
                       transforms=kwargs.get("transforms"),
                       transforms_default_to_original=bool(
                           kwargs.get("transforms_default_to_original", True)))


def restore_items(target: Any, args: Any, restore_kwargs: Any = None, *,
                  named_items: bool = False, kinds: Mapping[str, str] | None = None,
                  handlers: _handlers.ItemHandlers | None = None
                  ) -> tuple[list[RestoreItem] | None, bool]:
    """What to restore: items (None: every item on disk) and whether a Composite was asked.

    ``target`` is also orbax's older ``items`` and ``restore_kwargs`` its
    older spelling of the restore's options (``{"restore_args": tree,
    "transforms": ...}``), by item name with ``named_items`` (a manager made
    with a dict of checkpointers).

    ``kinds``: by item name, the kind of its handler when one was given:
    ``standard`` (orbax's ``StandardCheckpointHandler``: the target's leaves
    say the types), ``pytree`` (its ``PyTreeCheckpointHandler``: the target
    gives the structure) or ``json``; an item not named there: ``standard``.
    ``handlers``: the items' own handlers (those not written by asyncckpt
    itself), by item name (and args type): they restore their items.

    Raises:
        TypeError: both ``target`` and ``args``, or an unknown argument type.
        ValueError: an option asyncckpt cannot honour.
    """
    kinds = kinds or {}
    own = handlers if handlers is not None else _handlers.ItemHandlers()
    if target is not None and args is not None:
        raise TypeError("give either the items (target) or args=, not both")
    if named_items and args is None and (target is not None or restore_kwargs is not None):
        if target is not None and not isinstance(target, Mapping):
            raise TypeError("this manager was given a dict of checkpointers: restore a dict "
                            "of its items by name")
        targets, per_item = dict(target or {}), dict(restore_kwargs or {})
        return [_legacy_restore(check_item_name(str(k)), targets.get(k), per_item.get(k),
                                kinds.get(str(k), "standard"), own.get(str(k)))
                for k in dict.fromkeys([*targets, *per_item])], True
    if restore_kwargs is not None:
        if args is not None:
            raise TypeError("restore_kwargs go with the target (orbax's older restore(step, "
                            "items, restore_kwargs)); with args= put restore_args in the args")
        return [_legacy_restore(fmt.ITEM, target, restore_kwargs,
                                kinds.get(fmt.ITEM, "standard"), own.get(fmt.ITEM))], False
    if args is None:
        if target is not None and is_orbax_args(target):
            args = target
        else:
            return ([_legacy_restore(fmt.ITEM, target, None, kinds.get(fmt.ITEM, "standard"),
                                     own.get(fmt.ITEM))]
                    if target is not None else None), False
    if is_composite(args):
        return [_one_restore(check_item_name(k), v, own.get(k) or own.for_args(v))
                for k, v in args.items()], True
    if not is_orbax_args(args):
        raise _unsupported(args, "args= takes orbax.checkpoint.args objects")
    return [_one_restore(fmt.ITEM, args, own.get(fmt.ITEM) or own.for_args(args))], False


class Items(Mapping):
    """Restored items by name, also readable as attributes (``result.state``).

    What a ``Composite`` restore returns when orbax is not installed; with
    orbax installed the result is orbax's own ``Composite``.
    """

    def __init__(self, items: Mapping[str, Any]):
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["_items"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Items({self._items!r})"


def composite(items: Mapping[str, Any]) -> Any:
    """orbax's ``Composite`` of ``items`` (or ``Items`` without orbax)."""
    try:
        from orbax.checkpoint import args as ocp_args
    except ImportError:
        return Items(items)
    return ocp_args.Composite(**items)

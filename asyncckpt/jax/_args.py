"""orbax's ``args=`` spelling, turned into the items the manager saves and restores.

``save(step, args=ocp.args.StandardSave(tree))`` saves one unnamed item (the
``default`` directory, as orbax); ``ocp.args.Composite(a=..., b=...)`` saves
named items side by side (``<step>/a``, ``<step>/b``). Pytree items
(``StandardSave``/``PyTreeSave``) are written by asyncckpt's snapshot path,
JSON items (``JsonSave``) as orbax's ``JsonCheckpointHandler`` writes them.
orbax is never imported here: its argument objects are recognised by class
name and read by attribute, so the short forms work without orbax installed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from asyncckpt.jax import _format as fmt
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
    """One item of a save: a pytree (``kind="pytree"``) or a JSON value (``"json"``).

    ``ocdbt_target_data_file_size``: the save's own (``StandardSave(...,
    ocdbt_target_data_file_size=...)``), None when not given.
    """

    name: str
    kind: Literal["pytree", "json"]
    value: Any
    ocdbt_target_data_file_size: int | None = None


@dataclass(frozen=True)
class RestoreItem:
    """One item to restore.

    Attributes:
        name: The item's directory in the step.
        kind: ``pytree``, ``json``, or ``auto`` (decided by what is on disk).
        target: The pytree's target (None: rebuilt from the checkpoint).
        restore_args: orbax ``RestoreArgs`` tree, used when given.
        partial: The target may name a subset of the saved leaves.
    """

    name: str
    kind: Literal["pytree", "json", "auto"]
    target: Any = None
    restore_args: Any = None
    partial: bool = False


def _orbax_name(obj: Any) -> str | None:
    cls = type(obj)
    return cls.__name__ if cls.__module__.startswith("orbax.") else None


def is_orbax_args(obj: Any) -> bool:
    """Whether ``obj`` is one of orbax's ``CheckpointArgs`` (or a ``Composite``)."""
    return any(c.__name__ == "CheckpointArgs" and c.__module__.startswith("orbax.")
               for c in type(obj).__mro__) or _orbax_name(obj) in _COMPOSITE


def is_composite(obj: Any) -> bool:
    return _orbax_name(obj) in _COMPOSITE


def _check_item_name(name: str) -> str:
    if (not isinstance(name, str) or not name or "/" in name or name.startswith(".")
            or name == fmt.METRICS_ITEM):
        raise ValueError(f"item name {name!r} is not usable (a plain directory name, not "
                         f"{fmt.METRICS_ITEM!r}, which holds the metrics)")
    return name


def _unsupported(what: Any, why: str) -> TypeError:
    return TypeError(f"{type(what).__module__}.{type(what).__qualname__}: {why}")


def _one_save(name: str, arg: Any) -> SaveItem:
    kind = _orbax_name(arg)
    if kind in _PYTREE_SAVE:
        if getattr(arg, "save_args", None) is not None:
            raise ValueError(f"item {name!r}: save_args (per-leaf dtype casts, aggregation) are "
                             "not supported; cast the arrays before saving")
        target = getattr(arg, "ocdbt_target_data_file_size", None)
        try:
            check_target_size(target)
        except ValueError as e:
            raise ValueError(f"item {name!r}: {e}") from None
        if getattr(arg, "custom_metadata", None) is not None:
            raise ValueError(f"item {name!r}: per-item custom_metadata is not supported; pass "
                             "custom_metadata= to save() (stored for the step)")
        return SaveItem(name, "pytree", arg.item, target)
    if kind in _JSON_SAVE:
        try:
            json.dumps(arg.item)
        except (TypeError, ValueError) as e:
            raise TypeError(f"item {name!r}: JsonSave needs a JSON-serializable value: {e}") from e
        return SaveItem(name, "json", arg.item)
    raise _unsupported(arg, "asyncckpt.jax saves StandardSave, PyTreeSave and JsonSave items "
                            "(alone or in a Composite)")


def save_items(state: Any, args: Any) -> tuple[list[SaveItem], bool]:
    """The items of a save and whether they were named (a ``Composite``).

    Raises:
        TypeError: neither or both of ``state`` and ``args``, or an argument
            type asyncckpt does not save.
        ValueError: an option of the arguments that asyncckpt cannot honour.
    """
    if state is not None and args is not None:
        raise TypeError("give either the state or args=, not both")
    if state is None and args is None:
        raise TypeError("save() needs the state: save(step, state) or save(step, args=...)")
    if args is None:
        if type(state) in _PLAIN_TREES or not is_orbax_args(state):
            return [SaveItem(fmt.ITEM, "pytree", state)], False
        args = state  # save(step, ocp.args.StandardSave(x)): the keyword was forgotten
    if is_composite(args):
        items = [_one_save(_check_item_name(k), v) for k, v in args.items()]
        if not items:
            raise ValueError("a Composite with no items saves nothing")
        return items, True
    if not is_orbax_args(args):
        raise _unsupported(args, "args= takes orbax.checkpoint.args objects")
    return [_one_save(fmt.ITEM, args)], False


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


def _one_restore(name: str, arg: Any) -> RestoreItem:
    if arg is None:
        return RestoreItem(name, "auto")
    kind = _orbax_name(arg)
    if kind in _PYTREE_RESTORE:
        for field, default in (("transforms", None), ("legacy_transform_fn", None),
                               ("fallback_sharding", None), ("support_layout", False)):
            if getattr(arg, field, default) not in (default,):
                raise ValueError(f"item {name!r}: {kind}.{field} is not supported by asyncckpt")
        if getattr(arg, "strict", True) is not True:
            raise ValueError(f"item {name!r}: strict=False (restoring into other shapes) is not "
                             "supported; shapes must match the checkpoint")
        return RestoreItem(name, "pytree", arg.item, getattr(arg, "restore_args", None),
                           bool(getattr(arg, "partial_restore", False)))
    if kind in _JSON_RESTORE:
        return RestoreItem(name, "json")
    raise _unsupported(arg, "asyncckpt.jax restores StandardRestore, PyTreeRestore and "
                            "JsonRestore items (alone or in a Composite)")


def restore_items(target: Any, args: Any) -> tuple[list[RestoreItem] | None, bool]:
    """What to restore: items (None: every item on disk) and whether a Composite was asked.

    Raises:
        TypeError: both ``target`` and ``args``, or an unknown argument type.
        ValueError: an option asyncckpt cannot honour.
    """
    if target is not None and args is not None:
        raise TypeError("give either target= or args=, not both")
    if args is None:
        if target is not None and is_orbax_args(target):
            args = target
        else:
            return ([RestoreItem(fmt.ITEM, "pytree", target)] if target is not None
                    else None), False
    if is_composite(args):
        return [_one_restore(_check_item_name(k), v) for k, v in args.items()], True
    if not is_orbax_args(args):
        raise _unsupported(args, "args= takes orbax.checkpoint.args objects")
    return [_one_restore(fmt.ITEM, args)], False


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

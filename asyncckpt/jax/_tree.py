"""Pytree <-> named leaves, named the way orbax names them on disk.

orbax stores each leaf of a pytree under a *parameter name*: the leaf's key
path joined with dots (``{"opt": [m, v]}`` -> ``opt.0``, ``opt.1``), and records
each key's kind (a sequence index or a dict key) in its tree metadata. This
module turns a pytree into those names and back, so asyncckpt's files line up
with orbax's, and checks that every name can be a directory name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from asyncckpt.errors import UnsupportedLeafError

# Key kinds of orbax's tree metadata.
SEQUENCE_KEY = 1
DICT_KEY = 2

# orbax's names for empty subtrees, which it records as skipped leaves.
EMPTY_TYPES: dict[type, str] = {type(None): "None", dict: "Dict", list: "List", tuple: "Tuple"}
_EMPTY_VALUES = {"None": lambda: None, "Dict": dict, "List": list, "Tuple": tuple}
EMPTY_NAMES = frozenset(_EMPTY_VALUES)  # the value types of empty subtrees in _METADATA

# Names used by the item directory's own files; a leaf may not take them.
RESERVED_NAMES = frozenset(
    {"_METADATA", "_sharding", "array_metadatas", "commit_success.txt", "manifest.ocdbt"}
)


@dataclass(frozen=True)
class LeafPath:
    """Where one leaf sits in the tree.

    Attributes:
        names: The key at each level, as text (dict key, index, attribute).
        kinds: ``SEQUENCE_KEY`` or ``DICT_KEY`` for each level.
    """

    names: tuple[str, ...]
    kinds: tuple[int, ...]

    @property
    def param(self) -> str:
        """orbax's parameter name: the directory the leaf's array lives in."""
        return ".".join(self.names)

    @property
    def display(self) -> str:
        """A readable key path for error messages (``opt[0]['mu']``)."""
        parts = []
        for name, kind in zip(self.names, self.kinds, strict=True):
            parts.append(f"[{name}]" if kind == SEQUENCE_KEY else f"[{name!r}]")
        return "".join(parts) or "<root>"

    @property
    def metadata_key(self) -> str:
        """The key of this leaf in orbax's ``_METADATA`` tree (``"('opt', '0')"``)."""
        return str(tuple(self.names))


def is_empty_leaf(x: Any) -> bool:
    """None and empty containers: subtrees orbax records as skipped leaves.

    Containers as orbax counts them: dicts, lists, tuples and other mappings,
    subclasses included, so an empty NamedTuple (optax's ``EmptyState()``) is one.
    """
    if x is None:
        return True
    if type(x) in EMPTY_TYPES:
        return not x
    return isinstance(x, (dict, list, tuple, Mapping)) and not x


def empty_type_name(x: Any) -> str | None:
    """orbax's name for an empty subtree, or None if ``x`` is not one.

    An empty NamedTuple is ``None``, as orbax records it by default (its
    ``PyTreeMetadataOptions`` without rich types).
    """
    if not is_empty_leaf(x):
        return None
    name = EMPTY_TYPES.get(type(x))
    if name is not None:
        return name
    if isinstance(x, tuple):
        return "None" if hasattr(x, "_fields") else "Tuple"
    return "List" if isinstance(x, list) else "Dict"


def empty_value(type_name: str) -> Any:
    """A fresh empty value from its orbax name."""
    return _EMPTY_VALUES[type_name]()


def key_of(entry: Any) -> tuple[str, int]:
    """A key path entry's name (as text) and kind (``SEQUENCE_KEY`` or ``DICT_KEY``)."""
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx), SEQUENCE_KEY
    if isinstance(entry, jax.tree_util.DictKey):
        return str(entry.key), DICT_KEY
    if isinstance(entry, jax.tree_util.GetAttrKey):  # namedtuples, dataclasses
        return entry.name, DICT_KEY
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return str(entry.key), SEQUENCE_KEY
    raise UnsupportedLeafError(f"unsupported pytree key {entry!r} ({type(entry).__name__})")


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """Leaves (empty subtrees included, as orbax does) and the tree definition."""
    return jax.tree_util.tree_flatten(tree, is_leaf=is_empty_leaf)


def leaf_paths(tree: Any) -> list[LeafPath]:
    """The path of every leaf, in ``flatten`` order, checked for usable names.

    Raises:
        UnsupportedLeafError: a key cannot be a file name, or two leaves get
            the same parameter name (``{"a.b": x, "a": {"b": y}}``).
    """
    return paths_of(tree, is_empty_leaf)


def paths_of(tree: Any, is_leaf: Callable[[Any], bool]) -> list[LeafPath]:
    """``leaf_paths`` with another leaf test (a tree of orbax ``RestoreArgs``)."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    if len(with_path) == 1 and not with_path[0][0] and is_empty_leaf(with_path[0][1]):
        raise UnsupportedLeafError(
            f"the state is empty ({with_path[0][1]!r}): there is nothing to save, as orbax "
            "says of an empty item")
    paths = []
    for keypath, _leaf in with_path:
        names, kinds = zip(*(key_of(k) for k in keypath), strict=True) if keypath else ((), ())
        paths.append(LeafPath(tuple(names), tuple(kinds)))
    check_names(paths)
    return paths


def check_names(paths: Sequence[LeafPath]) -> None:
    """Refuses parameter names that are not plain, unique directory names."""
    seen: dict[str, LeafPath] = {}
    for p in paths:
        name = p.param
        if not p.names:
            raise UnsupportedLeafError(
                "the state must be a container (dict, list, tuple...) of arrays, not a bare leaf"
            )
        if (
            not name
            or "/" in name
            or "\\" in name
            or "\x00" in name
            or name.startswith(".")
            or name in RESERVED_NAMES
        ):
            raise UnsupportedLeafError(
                f"leaf {p.display} cannot be saved: its name {name!r} is not usable as a "
                "directory name in the orbax layout (no '/', no leading '.', not one of "
                f"{sorted(RESERVED_NAMES)})"
            )
        if name in seen:
            raise UnsupportedLeafError(
                f"leaves {seen[name].display} and {p.display} would both be stored as "
                f"{name!r}; rename one of the keys"
            )
        seen[name] = p


def build_tree(items: Iterable[tuple[LeafPath, Any]]) -> Any:
    """Rebuilds nested dicts and lists from leaf paths (no target given).

    Sequence levels become lists and dict levels dicts, as orbax does when it
    restores without a target; tuples and custom nodes need a target.
    """
    root: Any = None

    def container(kind: int) -> Any:
        return [] if kind == SEQUENCE_KEY else {}

    for path, value in items:
        if not path.names:
            return value
        if root is None:
            root = container(path.kinds[0])
        node = root
        for depth, (name, kind) in enumerate(zip(path.names, path.kinds, strict=True)):
            last = depth == len(path.names) - 1
            child = value if last else None
            key: Any = int(name) if kind == SEQUENCE_KEY else name
            if isinstance(node, list):
                while len(node) <= key:
                    node.append(None)
                if last:
                    node[key] = child
                elif node[key] is None:
                    node[key] = container(path.kinds[depth + 1])
                node = node[key]
            else:
                if last:
                    node[key] = child
                elif key not in node:
                    node[key] = container(path.kinds[depth + 1])
                node = node[key]
    return {} if root is None else root

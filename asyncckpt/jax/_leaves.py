"""How each saved leaf of a pytree comes back: orbax's rules, leaf by leaf.

orbax decides the type, dtype and sharding of a restored leaf from, in this
order:

* ``restore_args`` (``RestoreArgs``/``ArrayRestoreArgs``), matched to the
  saved leaves by key path, not by tree structure (an optax ``EmptyState``,
  ``None`` or ``{}`` in the args is no leaf, as it is none on disk);
* the target of a ``StandardRestore`` (a PyTree handler takes its item for
  the structure only): a ``jax.Array`` or a ``jax.ShapeDtypeStruct`` with a
  sharding restores onto it; a ``ShapeDtypeStruct`` without one onto the
  sharding saved in ``_sharding`` (as a NumPy array if the leaf was saved
  from NumPy); a NumPy array as NumPy; ``int``/``float``/``bool`` as that
  type;
* what was saved: a ``jax.Array`` on its saved sharding, a NumPy array with
  its own dtype, a scalar as a Python scalar.

A target leaf that is ``None``, ``PLACEHOLDER`` or an empty subtree
(optax's ``MaskedNode``) is not read: it comes back as given. A leaf saved
empty (a ``MaskedNode`` is saved as ``None``) comes back empty whatever the
target holds there. NumPy keeps its dtype whatever JAX's x64 flag; a
``jax.Array`` of a dtype that JAX cannot hold with x64 off is narrowed, as
orbax narrows it, but never silently: a warning names the leaf. A typed PRNG
key is read as its key data and wrapped with the impl recorded in
``array_metadatas``, as orbax does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from asyncckpt.errors import TopologyMismatchError, UnsupportedLeafError
from asyncckpt.jax import _format as fmt
from asyncckpt.jax import _tree

logger = logging.getLogger(__name__)

PLACEHOLDER = ...  # orbax.checkpoint.PLACEHOLDER
NO_TARGET: Any = object()  # a leaf restored without a target

# How a leaf comes back (``Want.how``).
SKIP, JAX, NUMPY, PYTHON, NPSCALAR = "skip", "jax", "numpy", "python", "npscalar"

_RESTORE_ARGS = ("RestoreArgs", "ArrayRestoreArgs")
_PYTHON_TYPES = (bool, int, float)


@dataclass(frozen=True)
class Want:
    """How one saved leaf is restored.

    Attributes:
        how: ``SKIP`` (not read: ``value`` is returned), ``JAX``, ``NUMPY``,
            ``PYTHON`` or ``NPSCALAR``.
        value: What a skipped leaf comes back as.
        dtype: The dtype asked for (None: the saved one).
        sharding: ``JAX``: the sharding of the array read (for a PRNG key,
            of its key data).
        shape: The shape asked for, checked against the saved one (None: any).
        pytype: ``PYTHON`` / ``NPSCALAR``: the type (None: from the saved dtype).
        key_impl: Wrap the key data read as a typed PRNG key of this impl.
    """

    how: str
    value: Any = None
    dtype: Any = None
    sharding: Any = None
    shape: tuple[int, ...] | None = None
    pytype: Any = None
    key_impl: str | None = None


def _orbax_class(obj: Any, names: tuple[str, ...]) -> bool:
    return any(c.__name__ in names and c.__module__.startswith("orbax.")
               for c in type(obj).__mro__)


def is_restore_args(obj: Any) -> bool:
    """Whether ``obj`` is orbax's ``RestoreArgs`` (or ``ArrayRestoreArgs``, a subclass)."""
    return _orbax_class(obj, _RESTORE_ARGS)


def _is_args_leaf(x: Any) -> bool:
    return x is PLACEHOLDER or is_restore_args(x) or _tree.is_empty_leaf(x)


def args_by_path(restore_args: Any) -> dict[tuple[str, ...], Any]:
    """orbax ``RestoreArgs`` by key path (``LeafPath.names``), empty subtrees left out.

    orbax matches restore args to the checkpoint by key path: a tree of
    them made with ``jax.tree.map`` over a target keeps its empty subtrees
    (optax's ``EmptyState()``, ``None``), which are no leaves on disk.
    """
    if _tree.is_empty_leaf(restore_args):
        return {}
    leaves, _ = jax.tree_util.tree_flatten(restore_args, is_leaf=_is_args_leaf)
    paths = _tree.paths_of(restore_args, _is_args_leaf)
    return {p.names: a for p, a in zip(paths, leaves, strict=True)
            if a is PLACEHOLDER or is_restore_args(a)}


class SavedFacts:
    """What an item records about its arrays besides their values, read when asked.

    The sharding each ``jax.Array`` was saved with (``_sharding``, rebuilt
    with orbax's own ``ShardingMetadata``) and the impl of each typed PRNG
    key (``array_metadatas``).
    """

    def __init__(self, item_dir: str):
        self._dir = item_dir
        self._shardings: dict[str, str] | None = None
        self._impls: dict[str, str] | None = None

    def key_impl(self, param: str) -> str | None:
        if self._impls is None:
            self._impls = fmt.read_key_impls(self._dir)
        return self._impls.get(param)

    def sharding(self, entry: fmt.TreeEntry) -> Any:
        """The sharding ``entry`` was saved with, rebuilt on this run's devices.

        Without a record of it (a sharding orbax cannot describe, so no
        ``_sharding`` file) the default device's, with a warning.

        Raises:
            TopologyMismatchError: the saved sharding names devices (or a
                device count) this run does not have.
        """
        if self._shardings is None:
            self._shardings = fmt.read_shardings(self._dir)
        text = self._shardings.get(entry.path.param)
        if text is None:
            logger.warning("leaf %s: no saved sharding recorded; restoring it onto %s",
                           entry.path.display, jax.local_devices()[0])
            return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return _rebuild_sharding(text, entry.path.display)


def _rebuild_sharding(text: str, display: str) -> Any:
    from orbax.checkpoint import metadata as ocp_metadata

    kinds = {"NamedSharding": ocp_metadata.NamedShardingMetadata,
             "SingleDeviceSharding": ocp_metadata.SingleDeviceShardingMetadata}
    try:
        described = json.loads(text)
        kind = kinds[described["sharding_type"]]
        return kind.from_deserialized_dict(described).to_jax_sharding()
    except (ValueError, KeyError, TypeError) as e:
        raise TopologyMismatchError(
            f"leaf {display}: its saved sharding cannot be rebuilt here ({e}). Topology "
            "mismatch: the checkpoint was saved on other devices than this run's; give a "
            "target whose leaves carry the shardings to restore onto") from e


def resolve(entry: fmt.TreeEntry, target: Any, arg: Any, *, by_target: bool,
            facts: SavedFacts) -> Want:
    """How the saved leaf ``entry`` comes back (see the module's docstring).

    ``target``: the target's leaf (``NO_TARGET`` without a target);
    ``arg``: its ``RestoreArgs`` (None: none given); ``by_target``: the
    target's leaves say the types (``StandardRestore``), not only the
    structure (a PyTree handler's item).

    Raises:
        UnsupportedLeafError: a target leaf or restore type orbax does not restore.
        TopologyMismatchError: the saved sharding cannot be rebuilt here.
        ValueError: an option asyncckpt does not honour (``strict=False``).
    """
    if target is PLACEHOLDER or arg is PLACEHOLDER or (
            arg is not None and getattr(arg, "restore_type", None) is type(PLACEHOLDER)):
        return Want(SKIP, PLACEHOLDER)
    if entry.skipped:  # saved empty: comes back empty, whatever the target holds there
        if target is not NO_TARGET and _tree.is_empty_leaf(target):
            return Want(SKIP, target)
        if entry.value_type not in _tree.EMPTY_NAMES:
            raise UnsupportedLeafError(
                f"leaf {entry.path.display} was saved as {entry.value_type!r}, which "
                "asyncckpt does not read (jax.Array, NumPy arrays and scalars)")
        return Want(SKIP, _tree.empty_value(entry.value_type))
    if target is None or (target is not NO_TARGET and _tree.is_empty_leaf(target)):
        return Want(SKIP, target)  # None: skipped, as orbax; MaskedNode and co: kept
    if arg is not None:
        want = _from_args(entry, arg, facts, target)
    elif by_target and target is not NO_TARGET:
        want = _from_target(entry, target, facts)
    else:
        want = _from_saved(entry, facts, None)
    return _with_key(entry, want, facts)


def _from_saved(entry: fmt.TreeEntry, facts: SavedFacts, dtype: Any) -> Want:
    if entry.value_type == fmt.JAX_ARRAY:
        return Want(JAX, dtype=dtype, sharding=facts.sharding(entry))
    if entry.value_type == fmt.NUMPY_ARRAY:
        return Want(NUMPY, dtype=dtype)
    return Want(PYTHON)


def _from_target(entry: fmt.TreeEntry, target: Any, facts: SavedFacts) -> Want:
    if isinstance(target, jax.Array):
        return Want(JAX, dtype=target.dtype, sharding=target.sharding, shape=target.shape)
    if isinstance(target, jax.ShapeDtypeStruct):
        sharding = target.sharding
        if sharding is None and entry.value_type == fmt.JAX_ARRAY:
            sharding = facts.sharding(entry)  # as saved, where this run has its devices
        if sharding is None:  # saved from NumPy (or a scalar): NumPy, as orbax
            return Want(NUMPY, dtype=target.dtype, shape=tuple(target.shape))
        return Want(JAX, dtype=target.dtype, sharding=sharding, shape=tuple(target.shape))
    if isinstance(target, np.ndarray):
        return Want(NUMPY, dtype=target.dtype, shape=target.shape)
    if isinstance(target, np.generic):
        return Want(NPSCALAR, pytype=type(target), shape=())
    if type(target) in _PYTHON_TYPES:
        return Want(PYTHON, pytype=type(target), shape=())
    raise UnsupportedLeafError(
        f"target leaf {entry.path.display} is a {type(target).__module__}."
        f"{type(target).__qualname__}; give a jax.ShapeDtypeStruct, a jax.Array, a NumPy "
        "array or a scalar for each leaf (None to skip it)")


def _from_args(entry: fmt.TreeEntry, arg: Any, facts: SavedFacts, target: Any) -> Want:
    """``want`` from orbax's restore args; an ``ArrayRestoreArgs`` without a shape or
    dtype takes the target leaf's, as orbax fills them in (a PRNG key's excepted)."""
    display = entry.path.display
    restore_type = getattr(arg, "restore_type", None)
    dtype = getattr(arg, "dtype", None)
    if _orbax_class(arg, ("ArrayRestoreArgs",)) or restore_type is jax.Array:
        if getattr(arg, "strict", True) is False:
            raise ValueError(f"leaf {display}: ArrayRestoreArgs(strict=False) (padding or "
                             "truncating to another shape) is not supported; shapes must "
                             "match the checkpoint")
        sharding = getattr(arg, "sharding", None)
        mesh, axes = getattr(arg, "mesh", None), getattr(arg, "mesh_axes", None)
        if mesh is not None and axes is not None:
            sharding = jax.sharding.NamedSharding(mesh, axes)
        if sharding is not None and callable(getattr(sharding, "to_jax_sharding", None)):
            sharding = sharding.to_jax_sharding()  # orbax's ShardingMetadata
        if sharding is None:
            sharding = facts.sharding(entry)
        shape = getattr(arg, "global_shape", None)
        if shape is None:
            shape = getattr(arg, "shape", None)
        like = (target is not NO_TARGET and _orbax_class(arg, ("ArrayRestoreArgs",))
                and getattr(target, "shape", None) is not None
                and getattr(target, "dtype", None) is not None
                and not _is_key_dtype(target.dtype))
        if like:
            shape = tuple(target.shape) if shape is None else shape
            dtype = target.dtype if dtype is None else dtype
        return Want(JAX, dtype=dtype, sharding=sharding,
                    shape=None if shape is None else tuple(shape))
    if restore_type is np.ndarray:
        return Want(NUMPY, dtype=dtype)
    if restore_type in _PYTHON_TYPES:
        return Want(PYTHON, pytype=restore_type)
    if restore_type is None:
        want = _from_saved(entry, facts, dtype)
        return want if want.how != PYTHON else Want(PYTHON)  # a scalar keeps its type
    raise UnsupportedLeafError(f"leaf {display}: restore_type {restore_type!r} is not "
                               "restored by asyncckpt (jax.Array, np.ndarray, int, float, bool)")


@functools.cache
def _key_trailing(impl: str) -> tuple[int, ...]:
    """The trailing dimensions a key of ``impl`` adds to its key data."""
    key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    return tuple(jax.eval_shape(jax.random.key_data, key).shape)


def _is_key_dtype(dtype: Any) -> bool:
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _with_key(entry: fmt.TreeEntry, want: Want, facts: SavedFacts) -> Want:
    """``want`` for a saved typed PRNG key: its key data read, wrapped with its impl."""
    asks_key = _is_key_dtype(want.dtype)
    impl = facts.key_impl(entry.path.param) if want.how in (JAX, NUMPY) else None
    if impl is None:
        if asks_key:
            raise UnsupportedLeafError(
                f"leaf {entry.path.display}: the target asks for a typed PRNG key "
                f"({want.dtype}) but the checkpoint records no key impl for it")
        return want
    shape = want.shape
    if asks_key and shape is not None:  # the key's shape: its data's, less the impl's trailer
        shape = tuple(shape) + _key_trailing(impl)
    dtype = None if asks_key else want.dtype
    if want.how == NUMPY:  # as orbax: a NumPy restore of a key gives its key data
        return dataclasses.replace(want, dtype=dtype, shape=shape)
    return dataclasses.replace(want, dtype=dtype, shape=shape, key_impl=impl)


def check_shape(entry: fmt.TreeEntry, want: Want, saved: tuple[int, ...], step_dir: str) -> None:
    """Raises ValueError if ``want`` asks for another shape than the saved one."""
    shape = () if want.how in (PYTHON, NPSCALAR) else want.shape
    if shape is not None and tuple(shape) != tuple(saved):
        raise ValueError(
            f"leaf {entry.path.display}: checkpoint {step_dir!r} holds shape {tuple(saved)}, "
            f"the restore asks for {tuple(shape)}")


def read(entry: fmt.TreeEntry, array: Any, want: Want) -> Any:
    """The value of one leaf, read from ``array`` as ``want`` says."""
    if want.how == SKIP:
        return want.value
    if want.how == JAX:
        out = to_device(entry, array, want.dtype, want.sharding)
        return out if want.key_impl is None else jax.random.wrap_key_data(out, impl=want.key_impl)
    value = array.read()
    if want.how == NUMPY:
        # The buffer read is this restore's own (nothing else holds or reuses it): a
        # second copy only for a cast asked for, or where the read gave a read-only view.
        dtype = np.dtype(want.dtype or value.dtype)
        if dtype == value.dtype and value.flags.writeable:
            return value
        return value.astype(dtype, copy=True)
    scalar = value[()]
    if want.how == NPSCALAR:
        return want.pytype(scalar)
    return scalar.item() if want.pytype is None else want.pytype(scalar)


def to_device(entry: fmt.TreeEntry, array: Any, dtype: Any, sharding: Any) -> jax.Array:
    """``array`` placed on ``sharding`` with ``make_array_from_callback``: each device
    reads its own region. A dtype JAX cannot hold (x64 off) is narrowed, with a warning."""
    want = np.dtype(dtype) if dtype is not None else np.dtype(array.dtype)
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(want))
    if dtype != want:
        message = (f"leaf {entry.path.display}: restored as a {dtype} jax.Array, not {want}: "
                   "jax_enable_x64 is off, so values may be narrowed (restore it as a NumPy "
                   "array, or enable x64, to keep them)")
        warnings.warn(message, UserWarning, stacklevel=4)
        logger.warning("%s", message)
    seen: set[tuple] = set()

    def region(index: tuple[slice, ...]) -> np.ndarray:
        key = region_key(index, array.shape)
        data = array.read(index).astype(dtype, copy=False)
        if key in seen:
            # A replicated region: a private copy per device, since on CPU a
            # device buffer may alias the host array it is made from.
            data = data.copy()
        seen.add(key)
        return data

    return jax.make_array_from_callback(array.shape, sharding, region)


def region_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


# -- orbax's transforms (PyTreeRestore(transforms=...)) -----------------------------------

_TRANSFORMS = ("Transform", "RestoreTransform")


def _flat(tree: Any, is_leaf: Callable[[Any], bool]) -> dict[str, Any]:
    """``tree``'s leaves by their key path joined with ``/`` (orbax's flat keys)."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {"/".join(_tree.key_of(k)[0] for k in keypath): leaf for keypath, leaf in with_path}


def transformed_reads(entries: list[fmt.TreeEntry], item: Any, args: Mapping[tuple, Any],
                      transforms: Any, default_to_original: bool
                      ) -> list[tuple[fmt.TreeEntry, Any, Any]]:
    """The saved leaves a restore with orbax's ``transforms`` reads: ``(entry, target leaf,
    restore args)`` each, as orbax's PyTree handler decides them.

    A leaf renamed by a transform (``original_key``) is read with the restore
    args of the leaf it becomes; a leaf both saved and in ``item`` is read
    unless a ``use_fallback`` transform (or ``default_to_original=False``)
    takes it from ``item``; the others are not read.

    Raises:
        ValueError: no ``item``, or a ``multi_value_fn`` transform (not supported).
    """
    if item is None:
        raise ValueError("transforms need the item: the target tree they produce")
    flat_transforms = _flat(transforms, lambda x: _orbax_class(x, _TRANSFORMS))
    for key, t in flat_transforms.items():
        if getattr(t, "multi_value_fn", None) is not None:
            raise ValueError(f"transform {key!r}: multi_value_fn is not supported by asyncckpt; "
                             "restore without transforms and combine the values yourself")
    leaves, _ = _tree.flatten(item)
    flat_item = {"/".join(p.names): leaf
                 for p, leaf in zip(_tree.leaf_paths(item), leaves, strict=True)}
    by_slash = {"/".join(e.path.names): e for e in entries}
    args_by_slash = {"/".join(k): v for k, v in args.items()}
    out = []
    for key, entry in by_slash.items():
        found, arg = False, None
        for tkey, t in flat_transforms.items():
            if getattr(t, "use_fallback", False):
                continue
            for okey in flat_item:
                match = re.fullmatch(tkey, okey)
                if match is None:
                    continue
                original = okey if t.original_key is None else match.expand(t.original_key)
                if original == key:
                    found, arg = True, args_by_slash.get(okey)
                    break
            if found:
                break
        if not found and key in flat_item:
            fallback = any(getattr(t, "use_fallback", False) and re.fullmatch(tkey, key)
                           for tkey, t in flat_transforms.items())
            found = (not default_to_original) if fallback else default_to_original
            arg = args_by_slash.get(key)
        if found:
            # Only what the item skips counts here: orbax reads the others as the args (or
            # the checkpoint) say, without filling shapes in from the item.
            leaf = flat_item.get(key, NO_TARGET)
            skips = leaf is None or leaf is PLACEHOLDER or (
                leaf is not NO_TARGET and _tree.is_empty_leaf(leaf))
            out.append((entry, leaf if skips else NO_TARGET, arg))
    return out

"""Verified restore of a step directory into a target pytree, any sharding.

The files are first checked against the manifest (sizes always, CRC32s by
default); then each leaf's chunks are read with plain file reads into host
memory and placed on the target's sharding with
``jax.make_array_from_callback``: each device asks for its own region, which
may span several saved chunks or a part of one, so a checkpoint written on
one mesh restores onto any other (another device count, another process
count). Checkpoints written by orbax itself with compression or OCDBT are
handed to orbax.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from asyncckpt import layout
from asyncckpt.engine.manifest import Manifest, read_manifest, verify_files
from asyncckpt.errors import CorruptCheckpointError, UnsupportedObjectError
from asyncckpt.jax import _format as fmt
from asyncckpt.jax import _tree

logger = logging.getLogger(__name__)


def verify_step(step_dir: str, *, checksums: bool) -> Manifest | None:
    """Checks a step directory against its manifest.

    Returns:
        The manifest, or None for a checkpoint without one (written by orbax),
        which is accepted unverified.

    Raises:
        CorruptCheckpointError: naming the file that is missing, truncated or
            corrupt, or the damaged manifest.
    """
    try:
        manifest = read_manifest(layout.jax_manifest_path(step_dir))
    except FileNotFoundError:
        logger.info("%s has no asyncckpt manifest (written by orbax?); restoring unverified",
                    step_dir)
        return None
    verify_files(step_dir, manifest.files, checksums=checksums, checkpoint=step_dir)
    return manifest


def _needs_orbax(item_dir: str, entries: list[fmt.TreeEntry]) -> bool:
    if fmt.is_ocdbt(item_dir):
        return True
    for e in entries:
        if not e.skipped:
            try:
                return fmt.ZarrArray(os.path.join(item_dir, e.path.param),
                                     checkpoint=item_dir).compressed
            except CorruptCheckpointError:
                return False
    return False


def _restore_with_orbax(item_dir: str, target: Any) -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise CorruptCheckpointError(
            f"{item_dir!r} was written by orbax in a compressed or OCDBT format that only "
            "orbax reads; install orbax-checkpoint (pip install 'asyncckpt[jax]')",
            checkpoint=os.path.dirname(item_dir),
        ) from e
    logger.info("%s is an orbax (compressed/OCDBT) checkpoint: restoring through orbax",
                item_dir)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(item_dir, target)


def restore_tree(step_dir: str, target: Any = None) -> Any:
    """Reads the pytree of a (verified) step directory.

    Args:
        step_dir: The checkpoint's directory.
        target: A pytree like the saved one whose leaves say what to restore
            into: ``jax.ShapeDtypeStruct`` (with a sharding) or ``jax.Array``
            (onto its sharding), NumPy arrays and scalars, Python scalars.
            None restores nested dicts/lists, arrays on the default device.

    Raises:
        ValueError: ``target``'s structure or a leaf's shape does not match.
        UnsupportedObjectError: a target leaf of a type that cannot be restored.
        CorruptCheckpointError: a file is missing or damaged.
    """
    item_dir = os.path.join(step_dir, fmt.ITEM)
    entries = fmt.read_tree_metadata(item_dir)
    if _needs_orbax(item_dir, entries):
        return _restore_with_orbax(item_dir, target)
    if target is None:
        return _tree.build_tree(
            (e.path, _read_leaf(item_dir, e, None, step_dir)) for e in entries
        )
    leaves, treedef = _tree.flatten(target)
    paths = _tree.leaf_paths(target)
    by_param = {e.path.param: e for e in entries}
    missing = [p.display for p in paths if p.param not in by_param]
    wanted = {p.param for p in paths}
    extra = [e.path.display for e in entries if e.path.param not in wanted]
    if missing or extra:
        raise ValueError(
            f"the target's structure does not match checkpoint {step_dir!r}: "
            + "; ".join(
                part for part in (
                    f"not in the checkpoint: {', '.join(missing[:10])}" if missing else "",
                    f"in the checkpoint but not in the target: {', '.join(extra[:10])}"
                    if extra else "",
                ) if part
            )
        )
    values = [
        _read_leaf(item_dir, by_param[p.param], leaf, step_dir)
        for p, leaf in zip(paths, leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, values)


def _read_leaf(item_dir: str, entry: fmt.TreeEntry, target: Any, step_dir: str) -> Any:
    display = entry.path.display
    if entry.skipped:
        if target is None or _tree.is_empty_leaf(target):
            return _tree.empty_value(entry.value_type) if target is None else target
        raise ValueError(
            f"leaf {display}: the checkpoint holds an empty {entry.value_type} there, "
            f"the target a {type(target).__name__}"
        )
    array = fmt.ZarrArray(os.path.join(item_dir, entry.path.param), checkpoint=step_dir)
    if target is None:
        if entry.value_type == fmt.SCALAR:
            return array.read().item()
        if entry.value_type == fmt.NUMPY_ARRAY:
            return array.read()
        return jax.device_put(array.read())
    if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        _check_shape(display, array.shape, tuple(target.shape), step_dir)
        return _to_device(array, np.dtype(target.dtype), target.sharding)
    if isinstance(target, np.ndarray):
        _check_shape(display, array.shape, target.shape, step_dir)
        return array.read().astype(target.dtype, copy=False)
    if isinstance(target, np.generic):
        _check_shape(display, array.shape, (), step_dir)
        return target.dtype.type(array.read()[()])
    if type(target) in (bool, int, float):
        _check_shape(display, array.shape, (), step_dir)
        return type(target)(array.read().item())
    if _tree.is_empty_leaf(target):
        raise ValueError(
            f"leaf {display}: the checkpoint holds an array of shape {array.shape} there, "
            f"the target an empty {type(target).__name__}"
        )
    raise UnsupportedObjectError(
        f"target leaf {display} is a {type(target).__module__}.{type(target).__qualname__}; "
        "give a jax.ShapeDtypeStruct (with a sharding), a jax.Array, a NumPy array or a "
        "scalar for each leaf"
    )


def _check_shape(display: str, saved: tuple, wanted: tuple, step_dir: str) -> None:
    if tuple(saved) != tuple(wanted):
        raise ValueError(
            f"leaf {display}: checkpoint {step_dir!r} holds shape {tuple(saved)}, "
            f"the target asks for {tuple(wanted)}"
        )


def _to_device(array: fmt.ZarrArray, dtype: np.dtype, sharding: Any) -> jax.Array:
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    read: dict[tuple, np.ndarray] = {}

    def region(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple(s.indices(d)[:2] for s, d in zip(index, array.shape, strict=True))
        if key in read:
            # A replicated region: a private copy, since on CPU a device
            # buffer may alias the host array it was made from.
            return read[key].copy()
        data = array.read(index).astype(dtype, copy=False)
        read[key] = data
        return data

    return jax.make_array_from_callback(array.shape, sharding, region)

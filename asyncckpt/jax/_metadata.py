"""What a step records besides its arrays, and the manager-level metadata.

Read from orbax's files (``_CHECKPOINT_METADATA``, the ``metrics`` item,
``metadata/_ROOT_METADATA``) and asyncckpt's manifest, so the same calls
describe checkpoints written by either library.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from asyncckpt import layout
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine import contained
from asyncckpt._engine.manifest import read_manifest
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.jax import _args, _handlers, _tree, _tsarrays
from asyncckpt.jax import _format as fmt


@dataclass(frozen=True)
class StepMetadata:
    """What a checkpoint records besides its arrays.

    Attributes:
        step: The step.
        custom_metadata: The ``custom_metadata`` given to ``save`` ({} if none).
        metrics: The ``metrics`` given to ``save``, or None.
        stats: The save's timings (``SaveStats.to_dict``), if asyncckpt wrote it.
        created: When it was committed (``time.time()``), if known.
        item_metadata: Shapes and dtypes of the saved arrays, as a tree of
            ``jax.ShapeDtypeStruct`` (usable as a restore target); for named
            items a ``Composite`` of them (None for JSON items, as orbax).
        item_handlers: orbax's handler of each item directory.
        init_timestamp_nsecs: When the save started, if known.
        commit_timestamp_nsecs: When it was committed, if known.
    """

    step: int
    custom_metadata: dict = field(default_factory=dict)
    metrics: dict | None = None
    stats: dict = field(default_factory=dict)
    created: float | None = None
    item_metadata: Any = None
    item_handlers: dict = field(default_factory=dict)
    init_timestamp_nsecs: int | None = None
    commit_timestamp_nsecs: int | None = None


@dataclass(frozen=True)
class RootMetadata:
    """Manager-level metadata: the ``metadata=`` given to the first manager of a directory."""

    custom_metadata: dict = field(default_factory=dict)


def read_step_metadata(step: int, step_dir: str, *, with_items: bool = True) -> StepMetadata:
    """A step's metadata (``with_items=False`` skips the array descriptions)."""
    orbax_meta = fmt.read_step_metadata(step_dir)
    try:
        manifest = read_manifest(layout.jax_manifest_path(step_dir))
    except (FileNotFoundError, CorruptCheckpointError):
        manifest = None
    commit_ns = orbax_meta.get("commit_timestamp_nsecs")
    created = manifest.created if manifest else (commit_ns / 1e9 if commit_ns else None)
    if manifest is not None:
        custom = manifest.extra.get("custom_metadata") or {}
        metrics = manifest.extra.get("metrics")
    else:
        custom = orbax_meta.get("custom_metadata") or {}
        metrics = orbax_meta.get("metrics") or None
    handlers = orbax_meta.get("item_handlers") or {}
    if not isinstance(handlers, dict):
        handlers = {}
    if metrics is None and fmt.METRICS_ITEM in handlers:  # orbax keeps them in an item
        try:
            metrics = fmt.read_json_item(os.path.join(step_dir, fmt.METRICS_ITEM))
        except CorruptCheckpointError:
            metrics = None
    return StepMetadata(
        step=step,
        custom_metadata=custom,
        metrics=metrics,
        stats=manifest.stats if manifest else {},
        created=created,
        item_metadata=describe_items(step_dir, handlers) if with_items else None,
        item_handlers=handlers,
        init_timestamp_nsecs=orbax_meta.get("init_timestamp_nsecs"),
        commit_timestamp_nsecs=commit_ns,
    )


def item_names(step_dir: str, handlers: dict | None = None) -> list[str]:
    """The item directories of a step (the metrics item excluded).

    Named by ``handlers`` (read from ``_CHECKPOINT_METADATA``) when given:
    each must be a plain directory name of the step.

    Raises:
        CorruptCheckpointError: a handler's item name that is not one.
    """
    if handlers:
        names = [str(n) for n in handlers]
        source = os.path.join(step_dir, fmt.STEP_METADATA)
        for n in names:
            contained.check_name(n, checkpoint=step_dir, source=source)
            if "/" in n:
                raise CorruptCheckpointError(
                    f"checkpoint {step_dir!r} is corrupt: {source!r} names the item {n!r}, "
                    "which is not a directory name of the step", checkpoint=step_dir,
                    file=source)
    else:
        names = [n for n in sorted(os.listdir(step_dir))
                 if os.path.isdir(os.path.join(step_dir, n)) and not n.startswith(".")]
    return [n for n in names if n != fmt.METRICS_ITEM]


def is_json_item(step_dir: str, name: str, handlers: dict | None = None) -> bool:
    if handlers and name in handlers:
        return "Json" in str(handlers[name])
    return not os.path.exists(os.path.join(step_dir, name, fmt.TREE_METADATA))


def describe_tree(item_dir: str) -> Any:
    """A tree of ``jax.ShapeDtypeStruct`` (and empty values) like the saved pytree."""
    pairs = []
    entries = fmt.read_tree_metadata(item_dir)
    arrays = _tsarrays.ItemArrays(item_dir, entries, checkpoint=item_dir)  # [ocdbt] any layout
    for e in entries:
        if e.skipped:
            pairs.append((e.path, _tree.empty_value(e.value_type)))
            continue
        array = arrays(e.path.param)
        pairs.append((e.path, jax.ShapeDtypeStruct(array.shape, np.dtype(array.dtype))))
    return _tree.build_tree(pairs)


def describe_items(step_dir: str, handlers: dict) -> Any:
    """``item_metadata``: one tree for the default item, else a Composite by name."""
    names = item_names(step_dir, handlers)
    if names == [fmt.ITEM]:
        return describe_tree(os.path.join(step_dir, fmt.ITEM))
    out = {}
    for name in names + ([fmt.METRICS_ITEM] if fmt.METRICS_ITEM in handlers else []):
        if not os.path.isdir(os.path.join(step_dir, name)):
            continue
        typestr = handlers.get(name)
        own = typestr is None or _handlers.recorded_kind(typestr) != "handler"
        # Items of other handlers: orbax's manager describes them by their
        # handler's metadata; without the handler object here, as None.
        out[name] = (describe_tree(os.path.join(step_dir, name))
                     if own and not is_json_item(step_dir, name, handlers) else None)
    return _args.composite(out)


def read_root_metadata(directory: str) -> RootMetadata | None:
    """The manager-level metadata, or None if none was written."""
    path = os.path.join(directory, fmt.ROOT_METADATA)
    try:
        body = json.loads(contained.read_file(path, checkpoint=directory))
    except (OSError, ValueError):  # (a FIFO, a directory there: CorruptCheckpointError)
        return None
    custom = body.get("custom_metadata") if isinstance(body, dict) else None
    return RootMetadata(custom_metadata=dict(custom or {}))


def write_root_metadata(directory: str, custom: dict, *, fsync: bool) -> None:
    """Writes the manager-level metadata once (an existing file is kept, as orbax)."""
    path = os.path.join(directory, fmt.ROOT_METADATA)
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = json.dumps({"internal_metadata": {}, "custom_metadata": custom})
    commit_lib.write_text_atomic(path, text, fsync=fsync)

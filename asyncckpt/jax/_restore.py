"""Verified restore of a step directory into a target pytree, any sharding.

Every file's size is checked against the manifest first. Then the chunk
files this process needs are read in parallel, each checksummed as it is
read (one pass over the bytes, not one to verify and one to load), and the
other files of the restored arrays are checked too: all of them by a single
process; in a multi-process run each process checks its share and the
verdicts are shared (``verified``), so every process reaches the same one.
Only then are the arrays placed on the target's sharding with
``jax.make_array_from_callback``: each device asks for its own region, which
may span several saved chunks or a part of one, so a checkpoint written on
one mesh restores onto any other (another device count, another process
count). Items stored as OCDBT (asyncckpt's or orbax's), compressed or as
zarr v3 are read through TensorStore (``_tsarrays.ItemArrays``); their files
are checked as a whole, since one data file holds many arrays.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from asyncckpt import layout
from asyncckpt._engine.manifest import has_owner_marker, load_manifest, verify_files
from asyncckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from asyncckpt.jax import _args, _handlers, _leaves, _metadata, _tree, _tsarrays
from asyncckpt.jax import _format as fmt
from asyncckpt.jax._chunks import ChunkReader
from asyncckpt.jax._options import StepNames

logger = logging.getLogger(__name__)


# Set by a multi-process manager around its restores (``shared_verdicts``).
# A saved array as the restore reads it: plain zarr files, or through TensorStore.
Array = fmt.ZarrArray | _tsarrays.TsArray

_VERDICTS: contextvars.ContextVar[Any] = contextvars.ContextVar("asyncckpt_verdicts",
                                                                default=None)


@contextlib.contextmanager
def shared_verdicts(verdicts: Any) -> Iterator[None]:
    """Restores inside share their integrity verdicts through ``verdicts``.

    ``verdicts`` is a ``_verdicts.RestoreVerdicts`` (None: one process).
    """
    token = _VERDICTS.set(verdicts)
    try:
        yield
    finally:
        _VERDICTS.reset(token)


def verified(store: ChunkReader, paths: list[str], item: str, params: set[str] | None,
             step_dir: str, read_by_all: Callable[[], list[str]] | None = None) -> None:
    """Reads and checks this process's chunks, then the other files of the restored arrays.

    ``params`` None: every file of the item (an item read through TensorStore).

    One process checks every file. Several processes each check what they
    read plus their share of the files nobody reads (partitioned by process
    index; ``read_by_all`` gives the chunk files every process reads, the
    same list everywhere), and then agree: a damaged file found by any of
    them fails the restore on all.
    """
    verdicts = _VERDICTS.get()
    if store.reads_values:  # OCDBT: every file of the item, each whole (shared data files)
        wanted = store.wanted(item, None)
        mine = None if verdicts is None else set(
            wanted[verdicts.process_index::verdicts.process_count])
        error = None
        try:
            store.prefetch_values(paths, mine=mine)
            store.check_names(wanted if mine is None else mine)
        except CorruptCheckpointError as e:
            if verdicts is None:
                raise
            error = e
        if verdicts is not None:
            verdicts.agree(f"{os.path.basename(step_dir)}/{item}", error)
        return
    if verdicts is None:
        store.prefetch(paths, rest_of=(item, params))
        store.check_the_rest(item, params)  # what prefetch did not (a remote step's files)
        return
    error = None
    try:
        store.prefetch(paths)
        store.check_the_rest(
            item, params, share=(verdicts.process_index, verdicts.process_count),
            read_elsewhere=store.names(read_by_all() if read_by_all is not None else []))
    except CorruptCheckpointError as e:
        error = e
    verdicts.agree(f"{os.path.basename(step_dir)}/{item}", error)


def restore_tree(
    step_dir: str,
    target: Any = None,
    *,
    checksums: bool = True,
    item: str = fmt.ITEM,
    partial: bool = False,
    restore_args: Any = None,
    remote: Any = None,
    by_target: bool = True,
    transforms: Any = None,
    transforms_default_to_original: bool = True,
) -> Any:
    """Verifies and reads the pytree of one item of a step directory.

    Only the bytes of the arrays asked for are read: leaves of the target
    that are ``PLACEHOLDER`` (``...``) or None, and with ``partial`` saved
    leaves the target leaves out, are neither read nor checked beyond their
    size. Each leaf comes back as orbax restores it (``_leaves``).

    Args:
        step_dir: The checkpoint's directory.
        target: A pytree like the saved one (None: the saved structure, as
            nested dicts and lists).
        checksums: Check checksums against the manifest (sizes are always checked).
        item: The item directory (``default`` for an unnamed item).
        partial: ``target`` may hold a subset of the saved leaves.
        restore_args: orbax ``RestoreArgs``/``ArrayRestoreArgs`` tree, matched
            to the saved leaves by key path: each leaf's type, dtype, sharding.
        remote: ``step_dir`` is a remote step's cache (``LazyStep``): its
            metadata files are there and every file's size was checked
            against the store's listing; chunk files are fetched as read.
        by_target: The target's leaves say what each leaf is restored as
            (orbax's ``StandardRestore``); False: only its structure counts,
            leaves come back as saved (a PyTree handler's item).
        transforms: orbax's ``transforms`` (``PyTreeRestore``), applied by
            orbax's ``transform_utils`` to the leaves read.
        transforms_default_to_original: orbax's flag of the same name.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or corrupt (named),
            or the manifest is damaged; nothing is placed on devices then.
        ValueError: ``target``'s structure or a leaf's shape does not match.
        UnsupportedLeafError: a target leaf of a type that cannot be restored
            (also a ValueError, as orbax raises).
        TopologyMismatchError: a saved sharding kept (no target sharding)
            cannot be rebuilt on this run's devices.
    """
    manifest = load_manifest(layout.jax_manifest_path(step_dir), checkpoint=step_dir,
                             owned=has_owner_marker(step_dir))  # asyncckpt's: must have one
    if manifest is not None and remote is None:
        verify_files(step_dir, manifest.files, checksums=False, checkpoint=step_dir)
    elif manifest is None:
        logger.info("%s has no asyncckpt manifest (written by orbax?); restoring unverified",
                    step_dir)
    item_dir = os.path.join(step_dir, item)
    entries = fmt.read_tree_metadata(item_dir)
    store = ChunkReader(step_dir, manifest, checksums=checksums, remote=remote)
    # Every file an OCDBT B-tree names: inside the step, and listed in its manifest.
    listing = store.listing  # not the store: it holds the index (no reference cycle)
    opener = _tsarrays.ItemArrays(item_dir, entries, checkpoint=step_dir, source=store,
                                  check=lambda name, source: listing.listed(
                                      fmt.in_item(item, name), source=source))
    if opener.through_tensorstore and remote is not None:
        # TensorStore reads the item's files itself: all of them are fetched first.
        remote.fetch_names([n for n in remote.records if n.startswith(fmt.in_item(item, ""))])
    elif opener.index is not None:
        store.use_values(item, opener.index)  # [ocdbt] chunks are byte ranges of data files
    facts = _leaves.SavedFacts(item_dir)
    args = {} if restore_args is None else _leaves.args_by_path(restore_args)
    if transforms is not None:
        reads = _leaves.transformed_reads(entries, target, args, transforms,
                                          transforms_default_to_original)
        wants = [_leaves.resolve(e, leaf, arg, by_target=False, facts=facts)
                 for e, leaf, arg in reads]
        values = _read_all(step_dir, item, store, opener, [e for e, _, _ in reads], wants)
        original = _tree.build_tree((e.path, v) for (e, _, _), v in zip(reads, values,
                                                                        strict=True))
        from orbax.checkpoint import transform_utils

        return transform_utils.apply_transformations(original, transforms, target,
                                                     transforms_default_to_original)
    if target is None:
        matched, leaves, treedef = entries, [_leaves.NO_TARGET] * len(entries), None
    else:
        leaves, treedef = _tree.flatten(target)
        matched = _match(step_dir, entries, target, partial=partial)
    wants = [_leaves.resolve(e, leaf, args.get(e.path.names), by_target=by_target, facts=facts)
             for e, leaf in zip(matched, leaves, strict=True)]
    values = _read_all(step_dir, item, store, opener, matched, wants)
    if treedef is None:
        return _tree.build_tree((e.path, v) for e, v in zip(matched, values, strict=True))
    return jax.tree_util.tree_unflatten(treedef, values)


def _read_all(step_dir: str, item: str, store: ChunkReader, opener: _tsarrays.ItemArrays,
              entries: list[fmt.TreeEntry], wants: list[_leaves.Want]) -> list[Any]:
    """The values of ``entries`` as ``wants`` say: every shape checked and every file
    needed verified before any byte is placed on a device."""
    selected = [(e, w) for e, w in zip(entries, wants, strict=True) if w.how != _leaves.SKIP]
    arrays = {e.path.param: opener(e.path.param) for e, _ in selected}
    for e, w in selected:  # check every leaf before reading any bytes
        _leaves.check_shape(e, w, arrays[e.path.param].shape, step_dir)
    item_dir = os.path.join(step_dir, item)
    for e, _ in selected:  # and its metadata against the files, before sizing anything from it
        array = arrays[e.path.param]
        if isinstance(array, fmt.ZarrArray):
            store.check_layout(array)
        elif opener.index is None:  # TensorStore reads the array's files: listed ones only
            store.check_tree(os.path.join(item_dir, e.path.param))
    whole = opener.through_tensorstore or opener.index is not None  # files shared by arrays
    verified(store, [path for e, w in selected
                     for path in _chunks_needed(arrays[e.path.param], w.sharding)],
             item, None if whole else {e.path.param for e, _ in selected},
             step_dir, lambda: [path for e, w in selected
                                for path in _chunks_read_by_any(arrays[e.path.param], w.sharding)])
    return [_leaves.read(e, arrays.get(e.path.param), w) for e, w in zip(entries, wants,
                                                                          strict=True)]


def _match(step_dir: str, entries: list[fmt.TreeEntry], target: Any, *,
           partial: bool = False) -> list[fmt.TreeEntry]:
    """The checkpoint entry of each target leaf, or a clear error.

    An empty subtree of the target that the checkpoint does not record (an
    empty NamedTuple such as optax's ``EmptyState()``, which earlier asyncckpt
    versions left out of ``_METADATA``) matches as an empty entry: there is
    nothing to read for it.
    """
    paths = _tree.leaf_paths(target)
    by_param = {e.path.param: e for e in entries}
    for p, leaf in zip(paths, _tree.flatten(target)[0], strict=True):
        if p.param not in by_param and _tree.is_empty_leaf(leaf):
            by_param[p.param] = fmt.TreeEntry(p, _tree.empty_type_name(leaf) or "None")
    missing = [p.display for p in paths if p.param not in by_param]
    wanted = {p.param for p in paths}
    extra = [] if partial else [e.path.display for e in entries if e.path.param not in wanted]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"not in the checkpoint: {', '.join(missing[:10])}")
        if extra:
            parts.append(f"in the checkpoint but not in the target: {', '.join(extra[:10])} "
                         "(restore a subset with PyTreeRestore(..., partial_restore=True) or "
                         "PLACEHOLDER leaves)")
        # orbax's words first (code and tests match on them), then what differs, by key path.
        raise ValueError(
            "User-provided restore item and on-disk value metadata tree structures do not "
            f"match (checkpoint {step_dir!r}): " + "; ".join(parts)
        )
    return [by_param[p.param] for p in paths]


def _chunks_needed(array: Array, sharding: Any) -> list[str]:
    """The chunk files this process reads for one leaf (``sharding`` None: all of it)."""
    if sharding is not None:
        regions = sharding.addressable_devices_indices_map(array.shape).values()
        return [p for index in {_leaves.region_key(i, array.shape): i for i in regions}.values()
                for p in array.chunk_paths(index)]
    return array.chunk_paths(None)


def _chunks_read_by_any(array: Array, sharding: Any) -> list[str]:
    """The chunk files any process of this run reads for one leaf (``_chunks_needed`` of each).

    Every process computes the same list from the sharding (its devices'
    regions, whichever process holds them), so which files are read, and so
    checked, is known without a word between the processes.
    """
    if sharding is not None:
        regions = sharding.devices_indices_map(array.shape).values()
        return [p for index in {_leaves.region_key(i, array.shape): i for i in regions}.values()
                for p in array.chunk_paths(index)]
    return array.chunk_paths(None)  # every process reads all of it


def restore_newest(steps: list[int], root: str, attempt: Callable[[int], Any]) -> Any:
    """``attempt(step)`` for the newest of ``steps`` whose files verify.

    A step that fails its check is skipped with a warning naming it and the
    file at fault. Every file is checked before anything is placed on a
    device, and the processes of a multi-process restore share their
    verdicts, so all skip alike.

    Raises:
        CheckpointNotFoundError: ``steps`` is empty.
        CorruptCheckpointError: none verifies (the newest failure's file named).
    """
    if not steps:
        raise CheckpointNotFoundError(f"no checkpoints in {root!r}")
    failures = []
    for candidate in reversed(steps):
        try:
            return attempt(candidate)
        except CorruptCheckpointError as e:
            logger.warning("skipping checkpoint step %d in %s: %s", candidate, root, e)
            failures.append(e)
    raise CorruptCheckpointError(
        f"none of the {len(steps)} checkpoint(s) in {root!r} verifies; "
        f"newest failure: {failures[0]}",
        checkpoint=root,
        file=failures[0].file,
    )


def restore_listed(root: str, steps: list[int], step: int | None,
                   requests: list[_args.RestoreItem] | None, named: bool, *, names: StepNames,
                   checksums: bool, open_remote: Callable[[int], Any] | None,
                   tried: list[int] | None = None,
                   handlers: Mapping[str, Any] | None = None) -> Any:
    """Restores ``step`` of the ``steps`` listed in ``root`` (None: the newest that verifies).

    ``open_remote(step)`` gives a step only a remote tier holds (a ``LazyStep``,
    read from as the restore reads), or None where the local copy is read.
    ``tried``, if given, gets each step read, in order (the last one restored).
    ``handlers``: the handlers of items saved by their own handlers, by name
    (an item restored without args is restored by its handler).

    Raises:
        CheckpointNotFoundError: ``step`` is not listed, or nothing is.
        CorruptCheckpointError: see ``restore_newest`` and ``restore_step``.
    """
    def one(s: int) -> Any:
        if tried is not None:
            tried.append(s)
        remote = None if open_remote is None else open_remote(s)
        where = os.path.join(root, names.name(s)) if remote is None else remote.path
        return restore_step(where, requests, named, checksums=checksums, remote=remote,
                            handlers=handlers)

    if step is None:
        return restore_newest(steps, root, one)
    if step not in steps:
        shown = ", ".join(map(str, steps[-20:])) or "none"
        raise CheckpointNotFoundError(
            f"no checkpoint for step {step} in {root!r} (steps there: {shown})")
    return one(step)


def restore_step(step_dir: str, requests: list[_args.RestoreItem] | None, named: bool, *,
                 checksums: bool, remote: Any = None,
                 handlers: Mapping[str, Any] | None = None) -> Any:
    """Restores the items of a step: one unnamed item, or a ``Composite`` of named ones.

    ``requests`` None restores every item on disk (the metrics item too, as orbax).
    ``remote``: ``step_dir`` is a remote step opened file by file
    (``asyncckpt.storage.lazy.LazyStep``); only the files read are fetched.
    ``handlers``: see ``restore_listed``.
    """
    if remote is None:
        _check_made(step_dir)
    recorded = fmt.read_step_metadata(step_dir).get("item_handlers") or {}
    recorded = recorded if isinstance(recorded, dict) else {}
    on_disk = _metadata.item_names(step_dir, recorded)
    default_mode = on_disk == [fmt.ITEM]
    if requests is None:
        if default_mode and not named:
            kind = "auto" if fmt.ITEM in recorded else "pytree"  # (a handler's item: auto)
            return _restore_item(step_dir, _args.RestoreItem(fmt.ITEM, kind),
                                 checksums=checksums, remote=remote, recorded=recorded,
                                 handlers=handlers)
        everything = on_disk + ([fmt.METRICS_ITEM] if os.path.isdir(
            os.path.join(step_dir, fmt.METRICS_ITEM)) else [])
        requests = [_args.RestoreItem(n, "auto") for n in everything]
        named = True
    if not named and not default_mode:
        raise ValueError(f"{step_dir!r} holds named items {on_disk}: restore with "
                         "args=ocp.args.Composite(name=...)")
    out = {r.name: _restore_item(step_dir, r, checksums=checksums, remote=remote,
                                 recorded=recorded, handlers=handlers)
           for r in requests}
    return _args.composite(out) if named else out[fmt.ITEM]


def _check_made(step_dir: str) -> None:
    """Refuses a step directory that holds no checkpoint: empty, or left half made.

    One with asyncckpt's manifest (or owner marker) is judged by the
    manifest; another library's holds at least one item directory.

    Raises:
        CorruptCheckpointError: naming the step directory.
    """
    if has_owner_marker(step_dir) or os.path.lexists(layout.jax_manifest_path(step_dir)):
        return
    try:
        names = os.listdir(step_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"no checkpoint at {step_dir!r}") from None
    except OSError as e:
        raise CorruptCheckpointError(f"checkpoint {step_dir!r} cannot be listed: {e}",
                                     checkpoint=step_dir, file=step_dir) from e
    if not any(os.path.isdir(os.path.join(step_dir, n)) for n in names if not n.startswith(".")):
        raise CorruptCheckpointError(
            f"checkpoint {step_dir!r} is empty or half made: no manifest and no item "
            f"directory (it holds {sorted(names)[:10]})", checkpoint=step_dir, file=step_dir)


def _restore_item(step_dir: str, request: _args.RestoreItem, *, checksums: bool,
                  remote: Any = None, recorded: Mapping[str, Any] | None = None,
                  handlers: Mapping[str, Any] | None = None) -> Any:
    item_dir = os.path.join(step_dir, request.name)
    if not os.path.isdir(item_dir):
        raise CheckpointNotFoundError(
            f"checkpoint {step_dir!r} has no item {request.name!r} (items there: "
            f"{_metadata.item_names(step_dir)})")
    kind = request.kind
    if kind == "auto":
        typestr = (recorded or {}).get(request.name)
        handler = (handlers or {}).get(request.name)
        if handler is None and typestr is not None and _handlers.recorded_kind(typestr) == (
                "handler"):
            handler = _handlers.handler_for_typestr(request.name, typestr)
        if handler is not None:  # saved by its own handler: restored by it, as orbax
            return _handlers.restore_item(
                step_dir, request.name, handler,
                _handlers.default_restore_args(request.name, handler),
                checksums=checksums, remote=remote)
        if typestr is not None:  # as the step's metadata records the item
            kind = _handlers.recorded_kind(typestr)
        else:
            kind = "json" if _metadata.is_json_item(step_dir, request.name) else "pytree"
    if kind == "handler":
        return _handlers.restore_item(step_dir, request.name, request.handler, request.target,
                                      checksums=checksums, remote=remote)
    if kind == "json":
        return fmt.read_json_item(item_dir)
    return restore_tree(step_dir, request.target, checksums=checksums, item=request.name,
                        partial=request.partial, restore_args=request.restore_args,
                        remote=remote, by_target=request.by_target,
                        transforms=request.transforms,
                        transforms_default_to_original=request.transforms_default_to_original)

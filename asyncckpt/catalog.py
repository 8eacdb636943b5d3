"""Find, describe and verify the checkpoints in a directory, for either framework.

Three kinds: ``tensorflow`` (a prefix's files), ``jax`` (an orbax step
directory) and ``arrays`` (a step directory of ``asyncckpt.jobrunner.store.ArrayStore``,
written by the Keras callbacks and the job runner: ``arrays.bin`` +
``index.json``).

Framework-neutral: listing and verification read only names and manifests,
so ``asyncckpt list`` and ``asyncckpt verify`` work without TensorFlow or JAX
installed. Only describing a TensorFlow checkpoint's variables imports
TensorFlow.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from asyncckpt import layout
from asyncckpt._engine import contained
from asyncckpt._engine.commit import is_temp_name
from asyncckpt._engine.manifest import Manifest, read_manifest, verify_files
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint found in a directory.

    Attributes:
        name: Display name: the TensorFlow prefix basename or the step.
        path: TensorFlow prefix, or the JAX step directory.
        framework: ``"tensorflow"``, ``"jax"`` or ``"arrays"``.
        step: Step number, when the name carries one.
        manifest_path: Where its manifest is (the file may be missing).
    """

    name: str
    path: str
    framework: str
    step: int | None
    manifest_path: str

    @property
    def is_directory(self) -> bool:
        """A step directory (``jax``, ``arrays``), not a TensorFlow prefix's files."""
        return self.framework != "tensorflow"

    @property
    def root(self) -> str:
        """Directory the manifest's file names are relative to."""
        return os.path.dirname(self.path) if self.framework == "tensorflow" else self.path

    def manifest(self) -> Manifest | None:
        """The manifest, or None if the checkpoint has none (written by a peer)."""
        try:
            return read_manifest(self.manifest_path)
        except FileNotFoundError:
            return None


def list_checkpoints(directory: str) -> list[CheckpointInfo]:
    """Committed checkpoints in ``directory``, ordered by step then name.

    Temporaries of saves in flight (or interrupted) are never listed.

    Raises:
        CheckpointNotFoundError: ``directory`` does not exist.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no such directory: {directory!r}") from None
    found = []
    for name in names:
        if is_temp_name(name) or name.startswith("."):
            continue
        path = os.path.join(directory, name)
        if name.endswith(layout.TF_INDEX_SUFFIX) and os.path.isfile(path):
            prefix = path[: -len(layout.TF_INDEX_SUFFIX)]
            found.append(
                CheckpointInfo(
                    name=os.path.basename(prefix),
                    path=prefix,
                    framework="tensorflow",
                    step=layout.tf_step_of(prefix),
                    manifest_path=layout.tf_manifest_path(prefix),
                )
            )
        elif os.path.isdir(path) and (
            name.isdigit() or os.path.isfile(layout.jax_manifest_path(path))
        ):
            # Step directories: plain numbers, or orbax's prefixed / fixed-length
            # names (``ckpt_000007``) when asyncckpt's manifest is inside.
            digits = re.search(r"(\d+)$", name)
            found.append(
                CheckpointInfo(
                    name=name,
                    path=path,
                    framework=ARRAYS if _is_array_store(path) else "jax",
                    step=int(digits.group(1)) if digits else None,
                    manifest_path=layout.jax_manifest_path(path),
                )
            )
    found.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    return found


# ``asyncckpt.jobrunner.store``'s file names and manifest framework (not imported
# here: listing stays free of the job runner's imports).
ARRAYS = "arrays"
_ARRAYS_FILES = ("arrays.bin", "index.json")


def _is_array_store(step_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(step_dir, n)) for n in _ARRAYS_FILES)


def checkpoint_at(path: str) -> CheckpointInfo | None:
    """The checkpoint ``path`` names itself, or None when it is not one.

    A TensorFlow prefix (``path.index`` exists), or a directory with an
    asyncckpt manifest: a manager's step directory, or the path a JAX
    checkpointer (``asyncckpt.jax.StandardCheckpointer``) saved to.
    """
    if os.path.isfile(path + layout.TF_INDEX_SUFFIX):
        return CheckpointInfo(name=os.path.basename(path), path=path, framework="tensorflow",
                              step=layout.tf_step_of(path),
                              manifest_path=layout.tf_manifest_path(path))
    manifest_path = layout.jax_manifest_path(path)
    if os.path.isdir(path) and os.path.isfile(manifest_path):
        name = os.path.basename(os.path.normpath(path))
        digits = re.search(r"(\d+)$", name)
        return CheckpointInfo(name=name, path=path,
                              framework=ARRAYS if _is_array_store(path) else "jax",
                              step=int(digits.group(1)) if digits else None,
                              manifest_path=manifest_path)
    return None


def select(path: str, which: str | None) -> list[CheckpointInfo]:
    """The checkpoints of a directory, or the one named by ``which`` (a step or a name).

    ``path`` may also name one checkpoint itself (``checkpoint_at``): then
    that one is selected, and ``which``, if given, must name it.

    Raises:
        CheckpointNotFoundError: nothing matches.
    """
    one = checkpoint_at(path)
    found = [one] if one is not None else list_checkpoints(path)
    if which is None:
        return found
    chosen = [c for c in found if c.name == which or (which.isdigit() and c.step == int(which))]
    if not chosen:
        names = ", ".join(c.name for c in found) or "none"
        raise CheckpointNotFoundError(
            f"no checkpoint {which!r} in {path!r} (checkpoints there: {names})"
        )
    return chosen


def verify(info: CheckpointInfo, *, checksums: bool = True) -> Manifest:
    """Checks every file of a checkpoint against its manifest.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or corrupt, or
            the checkpoint has no (readable) manifest to check against.
    """
    manifest = info.manifest()
    if manifest is None:
        raise CorruptCheckpointError(
            f"checkpoint {info.path!r} has no asyncckpt manifest "
            f"({info.manifest_path!r}); it cannot be verified",
            checkpoint=info.path,
            file=info.manifest_path,
        )
    verify_files(info.root, manifest.files, checksums=checksums, checkpoint=info.path)
    return manifest


# One field of a ``checkpoint`` state file (protobuf text format, as TensorFlow writes it).
_STATE_FIELD = re.compile(
    r"""\s*([A-Za-z_]\w*)\s*:\s*(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)'|([-+.\w]+))\s*""")
_STATE_PATHS = ("model_checkpoint_path", "all_model_checkpoint_paths")
_STATE_NUMBERS = ("all_model_checkpoint_timestamps", "last_preserved_timestamp")


def state_file_paths(directory: str) -> list[str] | None:
    """The checkpoints a TensorFlow ``checkpoint`` state file names, the latest first.

    Read without TensorFlow. None when there is no state file.

    Raises:
        CorruptCheckpointError: the state file is damaged (not text, not a
            state file, no latest checkpoint), or is a directory, a FIFO...
    """
    path = os.path.join(directory, layout.TF_STATE_FILE)
    try:
        data = contained.read_file(path, checkpoint=directory)
    except FileNotFoundError:
        return None

    def damaged(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"the state file {path!r} is damaged: {what}",
                                      checkpoint=directory, file=path)

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise damaged(f"not UTF-8 text ({e})") from None
    latest, listed = None, []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _STATE_FIELD.fullmatch(line)
        quoted = None if m is None else (m.group(2) if m.group(2) is not None else m.group(3))
        if m is None or (m.group(1) in _STATE_PATHS) != (quoted is not None) or (
                m.group(1) not in _STATE_PATHS + _STATE_NUMBERS):
            raise damaged(f"line {number} is not a field of a state file: {line[:80]!r}")
        if quoted is None:
            continue
        try:
            value = codecs.escape_decode(quoted.encode("utf-8"))[0].decode("utf-8")
        except (ValueError, UnicodeDecodeError) as e:
            raise damaged(f"line {number}: {e}") from None
        if m.group(1) == _STATE_PATHS[0]:
            latest = value
        else:
            listed.append(value)
    if not latest:
        raise damaged("it names no latest checkpoint (model_checkpoint_path)")
    return [latest] + [p for p in listed if p != latest]


def state_file_problems(directory: str) -> list[CorruptCheckpointError]:
    """What is wrong with the checkpoints a TensorFlow state file in ``directory`` names.

    Each checkpoint it names must be in ``directory`` (a name leading
    elsewhere is reported, not followed) with its ``.index`` a file there; a
    damaged state file is one problem. Empty when there is no state file.
    """
    try:
        paths = state_file_paths(directory)
    except CorruptCheckpointError as e:
        return [e]
    state = os.path.join(directory, layout.TF_STATE_FILE)
    problems = []
    for path in paths or ():
        full = contained.inside(directory, path)
        if full is None:
            problems.append(CorruptCheckpointError(
                f"the state file {state!r} names {path!r}, which is not in {directory!r} "
                "(not followed)", checkpoint=directory, file=state))
            continue
        index = full + layout.TF_INDEX_SUFFIX
        try:
            contained.regular_size(index, checkpoint=full)
        except FileNotFoundError:
            problems.append(CorruptCheckpointError(
                f"the state file {state!r} names checkpoint {path!r}, whose index {index!r} "
                "is missing", checkpoint=full, file=index))
        except (CorruptCheckpointError, OSError) as e:
            problems.append(CorruptCheckpointError(
                f"the state file {state!r} names checkpoint {path!r}: {e}",
                checkpoint=full, file=index))
    return problems


@dataclass(frozen=True)
class ArrayInfo:
    """One saved array: name, shape, dtype and bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def describe_arrays(info: CheckpointInfo) -> list[ArrayInfo]:
    """The arrays (JAX leaves, ArrayStore names) or variables (TensorFlow keys) it holds."""
    if info.framework == ARRAYS:
        return _describe_array_store(info.path)
    if info.framework == "jax":
        return _describe_zarr_tree(info.path, info.manifest())
    return _describe_tf(info.path, info.manifest())


def _describe_array_store(step_dir: str) -> list[ArrayInfo]:
    path = os.path.join(step_dir, _ARRAYS_FILES[1])
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)["arrays"]
    except (OSError, ValueError, KeyError) as e:
        raise CorruptCheckpointError(f"index {path!r} is unreadable: {e}",
                                     checkpoint=step_dir, file=path) from e
    return [ArrayInfo(name, tuple(int(d) for d in e["shape"]), str(e["dtype"]), int(e["nbytes"]))
            for name, e in sorted(table.items())]


# Each array's metadata, as zarr v2 and zarr v3 (orbax's ``use_zarr3``) name it.
_ZARR_METADATA = (".zarray", "zarr.json")


def _zarr_metadata(item_dir: str, checkpoint: str,
                   listed: set[str] | None) -> list[tuple[str, dict]]:
    """``(leaf, .zarray or zarr.json contents)`` of each array of a zarr item, OCDBT or not.

    An OCDBT item (``manifest.ocdbt``) keeps these entries in its database,
    read through TensorStore (imported only then); the files its B-tree
    names must stay in the checkpoint and, where there is a manifest
    (``listed``: its names relative to ``item_dir``), be listed in it.
    """
    if os.path.isfile(os.path.join(item_dir, "manifest.ocdbt")):
        from asyncckpt._ocdbtindex import OcdbtIndex

        def check(name: str, source: str) -> None:
            contained.check_name(name, checkpoint=checkpoint, source=source)
            if listed is not None and name not in listed:
                path = os.path.join(item_dir, *name.split("/"))
                raise CorruptCheckpointError(
                    f"checkpoint {checkpoint!r} is corrupt: file {path!r} is not listed in "
                    "the manifest: it is not read", checkpoint=checkpoint, file=path)

        index = OcdbtIndex(item_dir, checkpoint=checkpoint, check=check)
        out = []
        for key in sorted(index):
            leaf, _, name = key.partition("/")
            if name not in _ZARR_METADATA:
                continue
            value = index.get(key)
            if not isinstance(value, bytes):  # in a data file (checked above): read its range
                file, offset, length = value
                path = os.path.join(item_dir, *file.split("/"))
                fd = contained.open_regular(path, checkpoint=checkpoint)
                try:
                    value = os.pread(fd, max(0, min(length, os.fstat(fd).st_size - offset)),
                                     offset)
                finally:
                    os.close(fd)
            out.append((leaf, json.loads(value)))
        return out
    out = []
    for leaf in sorted(os.listdir(item_dir)):
        for name in _ZARR_METADATA:
            path = os.path.join(item_dir, leaf, name)
            if os.path.isfile(path):
                out.append((leaf, json.loads(contained.read_file(path, checkpoint=checkpoint))))
                break
    return out


def _is_zarr_item(directory: str) -> bool:
    """An item's own directory: an OCDBT database, or leaf directories holding zarr metadata."""
    if os.path.isfile(os.path.join(directory, "manifest.ocdbt")):
        return True
    return any(os.path.isfile(os.path.join(directory, leaf, name))
               for leaf in os.listdir(directory) for name in _ZARR_METADATA)


def _describe_zarr_tree(step_dir: str, manifest: Manifest | None) -> list[ArrayInfo]:
    """The arrays of a manager's step (one item per subdirectory) or of a checkpointer's path.

    A checkpointer writes its pytree at the path itself (orbax's item at the
    root), so the path is then the one item and leaves keep their own names.
    """
    if _is_zarr_item(step_dir):
        items = [("", step_dir)]
    else:
        items = [(item, os.path.join(step_dir, item)) for item in sorted(os.listdir(step_dir))
                 if os.path.isdir(os.path.join(step_dir, item))]
    arrays = []
    names = None if manifest is None else {r.name for r in manifest.files}
    for item, item_dir in items:
        listed = None if names is None else {
            n[len(item) + 1:] if item else n for n in names if not item or n.startswith(item + "/")}
        for leaf, meta in _zarr_metadata(item_dir, step_dir, listed):
            shape = tuple(int(d) for d in meta["shape"])
            dtype = str(meta["data_type"] if "data_type" in meta else meta["dtype"])
            itemsize = _itemsize(dtype)
            name = leaf if item in ("", "default") else f"{item}/{leaf}"
            arrays.append(ArrayInfo(name, shape, dtype, math.prod(shape) * itemsize))
    return arrays


def _itemsize(zarr_dtype: str) -> int:
    try:
        return np.dtype(zarr_dtype).itemsize
    except TypeError:  # extension types NumPy alone does not know
        return {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int4": 1}.get(zarr_dtype, 0)


def _describe_tf(prefix: str, manifest: Manifest | None) -> list[ArrayInfo]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up chatter out
    try:
        import tensorflow as tf
    except ImportError as e:
        raise ImportError(
            "describing a TensorFlow checkpoint needs TensorFlow: pip install 'asyncckpt[tf]'"
        ) from e
    from asyncckpt.tf import _bundle

    # TensorFlow's reader trusts the index (a negative dimension aborts the process).
    _bundle.check_for_reader(prefix, data_sizes=None if manifest is None else {
        r.name: r.size for r in manifest.files})
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    out = []
    for key in sorted(shapes):
        shape = tuple(int(d) for d in shapes[key])
        dtype = dtypes[key]
        size = dtype.size if dtype != tf.string else 0
        out.append(ArrayInfo(key, shape, dtype.name, math.prod(shape) * size))
    return out

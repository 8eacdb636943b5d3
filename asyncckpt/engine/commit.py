"""Commit stage: make a fully written checkpoint visible in one atomic step.

Everything is first written under a temporary name that no reader mistakes for
a checkpoint (``.asyncckpt-tmp-*``), flushed, and then published by rename:

* a directory checkpoint (JAX/orbax layout) is published by renaming the
  temporary directory to its final name, one ``rename(2)``;
* a TensorFlow checkpoint is a set of files sharing a prefix; TensorFlow sees a
  checkpoint only when ``<prefix>.index`` exists, so the data files and the
  manifest are moved first and the index last: that last rename is the commit.

A process killed at any moment leaves either the old state or the new
checkpoint, plus at most a temporary directory that ``cleanup_stale_temps``
removes on the next start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Sequence

from asyncckpt.engine.files import fsync_path

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".asyncckpt-tmp-"


def is_temp_name(name: str) -> bool:
    """Whether a directory entry is an asyncckpt temporary."""
    return name.startswith(TEMP_PREFIX)


def make_temp_dir(parent: str, name: str, *, token: str | None = None) -> str:
    """Creates (or reuses, with a shared ``token``) a temporary directory.

    Args:
        parent: Directory the checkpoint will be published in.
        name: Final name of the checkpoint (used only to make the temporary
            name readable).
        token: A name shared by all processes writing the same checkpoint; a
            random one is used when None.
    """
    token = token or uuid.uuid4().hex[:12]
    path = os.path.join(parent, f"{TEMP_PREFIX}{name}-{token}")
    os.makedirs(path, exist_ok=True)
    return path


def remove_tree(path: str) -> None:
    """Removes a file or directory tree; missing paths are fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def publish_dir(tmp_dir: str, final_dir: str, *, fsync: bool) -> None:
    """Renames a fully written temporary directory to its final name.

    Raises:
        FileExistsError: ``final_dir`` already exists; checkpoints are never
            overwritten in place.
    """
    if os.path.lexists(final_dir):
        raise FileExistsError(f"checkpoint {final_dir!r} already exists")
    os.rename(tmp_dir, final_dir)
    if fsync:
        fsync_path(os.path.dirname(os.path.abspath(final_dir)))


def publish_files(
    tmp_dir: str,
    dest_dir: str,
    names: Sequence[str],
    *,
    fsync: bool,
) -> None:
    """Moves files from ``tmp_dir`` into ``dest_dir``; the last name commits.

    If the commit file already exists in ``dest_dir`` (a checkpoint written
    again under the same prefix), it is removed first, so a reader sees either
    no checkpoint or the complete new one, never a mix of old and new files.

    Args:
        tmp_dir: Directory holding the written files.
        dest_dir: Directory to publish into.
        names: File names in publish order; the last one is the commit marker.
        fsync: Whether to fsync ``dest_dir`` around the commit.
    """
    if not names:
        raise ValueError("nothing to publish")
    marker = os.path.join(dest_dir, names[-1])
    if os.path.lexists(marker):
        os.unlink(marker)
        if fsync:
            fsync_path(dest_dir)
    for name in names[:-1]:
        os.replace(os.path.join(tmp_dir, name), os.path.join(dest_dir, name))
    if fsync:
        # Data files must be durable under their final names before the marker.
        fsync_path(dest_dir)
    os.replace(os.path.join(tmp_dir, names[-1]), marker)
    if fsync:
        fsync_path(dest_dir)
    remove_tree(tmp_dir)


def write_text_atomic(path: str, text: str, *, fsync: bool) -> None:
    """Replaces a small text file atomically (write, fsync, rename)."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f"{TEMP_PREFIX}{os.path.basename(path)}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_path(parent)


def cleanup_stale_temps(directory: str) -> list[str]:
    """Removes temporaries left in ``directory`` by an interrupted run.

    Only call this while holding the directory's writer lock (or before any
    writer of this run started): it cannot tell a live writer's temporary from
    a dead one's.

    Returns:
        The paths removed.
    """
    removed = []
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in entries:
        if is_temp_name(name):
            path = os.path.join(directory, name)
            remove_tree(path)
            removed.append(path)
    if removed:
        logger.warning(
            "Removed %d temporary file(s) left by an interrupted save in %s: %s",
            len(removed),
            directory,
            ", ".join(os.path.basename(p) for p in removed),
        )
    return removed


def ensure_writable_dir(directory: str) -> None:
    """Creates ``directory`` if needed and proves a file can be created in it.

    This runs on the caller's thread so that a bad path fails the ``save()``
    call itself with a clear error, instead of failing later in the background.

    Raises:
        PermissionError / NotADirectoryError / OSError: with the path named.
    """
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f"{TEMP_PREFIX}probe-{uuid.uuid4().hex[:8]}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as e:
        if e.errno is None:
            raise OSError(f"cannot write checkpoints into {directory!r}: {e}") from e
        # OSError(errno, text) picks the matching subclass (PermissionError, ...).
        raise OSError(e.errno, f"cannot write checkpoints into {directory!r}: {e.strerror}") from e

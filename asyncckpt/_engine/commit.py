"""Commit stage: make a fully written checkpoint visible in one atomic step.

Everything is first written under a temporary name that no reader mistakes for
a checkpoint (``.asyncckpt-tmp-*``), flushed, and then published by rename:

* a directory checkpoint (JAX/orbax layout) is published by renaming the
  temporary directory to its final name, one ``rename(2)``;
* a TensorFlow checkpoint is a set of files sharing a prefix; TensorFlow sees a
  checkpoint only when ``<prefix>.index`` exists, so the data files and the
  manifest are moved first and the index last: that last rename is the commit.

A directory checkpoint can instead be written in place and committed by a
marker file created last (``make_dir_in_place`` / ``commit_in_place``), for
file systems whose directory rename is not atomic (orbax's commit-file mode):
readers then list a directory only once its marker exists.

A process killed at any moment leaves either the old state or the new
checkpoint, plus at most a temporary directory that ``cleanup_stale_temps``
removes on the next start (re-saving an existing TensorFlow prefix keeps the
old files in a backup until the new index is in place; see
``publish_files``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Sequence

from asyncckpt._engine.files import fsync_path

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".asyncckpt-tmp-"

# Temporaries this process is using now. Several managers of one process may
# share a directory (the directory lock is per process), so a cleanup by one
# of them must not remove another's save in flight.
_live: set[str] = set()
_live_lock = threading.Lock()


def _claim(path: str) -> str:
    with _live_lock:
        _live.add(os.path.abspath(path))
    return path


def _settle(path: str) -> None:
    with _live_lock:
        _live.discard(os.path.abspath(path))


def claim_temp(path: str) -> str:
    """This process uses the temporary at ``path`` now (a cleanup leaves it alone)."""
    return _claim(path)


def forget_temp(path: str) -> None:
    """This process no longer uses the temporary at ``path`` (another one
    published or removes it), so a cleanup may treat it as any other."""
    _settle(path)


def is_live(path: str) -> bool:
    """Whether this process is writing the temporary (or in-place checkpoint) at ``path``."""
    with _live_lock:
        return os.path.abspath(path) in _live


_guards: dict[str, threading.RLock] = {}


def directory_guard(directory: str) -> threading.RLock:
    """The process-wide lock under which checkpoints are published in ``directory``.

    Managers of one directory in one process share its ``DirectoryLock``; they
    hold this (re-entrant) lock around anything that must not interleave with
    another's publish, such as removing files that have no commit marker yet.
    ``publish_files``, ``publish_dir`` and ``cleanup_stale_temps`` take it.
    """
    key = os.path.realpath(directory)
    with _live_lock:
        guard = _guards.get(key)
        if guard is None:
            guard = _guards[key] = threading.RLock()
        return guard


def is_temp_name(name: str) -> bool:
    """Whether a directory entry is an asyncckpt temporary."""
    return name.startswith(TEMP_PREFIX)


def make_dirs(path: str, *, mode: int | None = None, exist_ok: bool = True) -> None:
    """``os.makedirs``; a directory it creates gets exactly ``mode`` (not masked by the umask).

    orbax's ``FileOptions.path_permission_mode`` asks for that mode; None
    leaves the umask's default. An existing directory is left as it is.
    """
    if mode is None:
        os.makedirs(path, exist_ok=exist_ok)
        return
    missing = []
    head = os.path.abspath(path)
    while not os.path.isdir(head):
        missing.append(head)
        head = os.path.dirname(head)
    os.makedirs(path, exist_ok=exist_ok)
    for d in missing:
        os.chmod(d, mode)


def make_temp_dir(parent: str, name: str, *, token: str | None = None,
                  mode: int | None = None) -> str:
    """Creates (or reuses, with a shared ``token``) a temporary directory.

    Args:
        parent: Directory the checkpoint will be published in.
        name: Final name of the checkpoint (used only to make the temporary
            name readable).
        token: A name shared by all processes writing the same checkpoint; a
            random one is used when None.
        mode: Permission bits of the directory (``make_dirs``).
    """
    token = token or uuid.uuid4().hex[:12]
    path = _claim(os.path.join(parent, f"{TEMP_PREFIX}{name}-{token}"))
    make_dirs(path, mode=mode)
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
    _settle(path)


def publish_dir(tmp_dir: str, final_dir: str, *, fsync: bool, replace: bool = False) -> None:
    """Renames a fully written temporary directory to its final name.

    With ``replace`` an existing ``final_dir`` (a checkpoint saved over with
    orbax's ``force=True``) is renamed aside first and removed only once the
    new one is in place, so the old checkpoint stays readable until the new
    one is durable. A process killed between the two renames leaves both as
    temporaries and nothing at ``final_dir``.

    Raises:
        FileExistsError: ``final_dir`` already exists and ``replace`` is
            false; checkpoints are never overwritten in place.
    """
    parent = os.path.dirname(os.path.abspath(final_dir))
    aside = None
    with directory_guard(parent):
        if os.path.lexists(final_dir):
            if not replace:
                raise FileExistsError(f"checkpoint {final_dir!r} already exists")
            aside = _claim(os.path.join(
                parent, f"{TEMP_PREFIX}replaced-{os.path.basename(final_dir)}-"
                        f"{uuid.uuid4().hex[:8]}"))
            os.rename(final_dir, aside)
        try:
            os.rename(tmp_dir, final_dir)
        except BaseException:
            if aside is not None:
                os.rename(aside, final_dir)  # the old checkpoint back where it was
                _settle(aside)
            raise
    _settle(tmp_dir)
    if fsync:
        fsync_path(parent)
    if aside is not None:
        remove_tree(aside)


def move_aside(path: str, target: str) -> bool:
    """Renames ``path`` to ``target`` (out of a listing: a deleted step); False if it is gone."""
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return False
    return True


def make_dir_in_place(final_dir: str, *, replace_stale: bool, mode: int | None = None) -> str:
    """Creates a directory checkpoint at its final name, to be committed by a marker.

    Args:
        final_dir: The checkpoint's directory.
        replace_stale: Remove what is there first (an uncommitted directory a
            killed save left: the caller has checked it holds no marker). False
            when several processes write into it: it is then only created.
        mode: Permission bits of the directory (``make_dirs``).
    """
    with directory_guard(os.path.dirname(os.path.abspath(final_dir))):
        if replace_stale and os.path.lexists(final_dir):
            logger.warning("removing %s: a save of it was interrupted before its commit",
                           final_dir)
            remove_tree(final_dir)
        make_dirs(final_dir, mode=mode, exist_ok=not replace_stale)
        return _claim(final_dir)


def commit_in_place(directory: str, marker: str, text: str, *, fsync: bool) -> None:
    """Commits a directory written in place: creates ``marker`` in it, last.

    The marker is created exclusively (``O_EXCL``: a directory is committed
    once), after the directory's entries are durable, and is itself made
    durable before this returns.

    Raises:
        FileExistsError: the directory was committed already.
    """
    if fsync:
        fsync_path(directory)  # every entry durable before the marker
    path = os.path.join(directory, marker)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, text.encode())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if fsync:
        fsync_path(directory)
    _settle(directory)


def publish_files(
    tmp_dir: str,
    dest_dir: str,
    names: Sequence[str],
    *,
    fsync: bool,
    replaces: Sequence[str] = (),
) -> None:
    """Moves files from ``tmp_dir`` into ``dest_dir``; the last name commits.

    When a checkpoint is written again at the same place (a TensorFlow prefix
    saved twice), ``replaces`` names the old checkpoint's files. The old
    checkpoint is never removed before the new one is published: its files
    are first hard-linked into a backup (``.asyncckpt-tmp-prev-*``), the new
    files replace them one by one, marker last, and the backup and the old
    files the new checkpoint did not overwrite are removed only after that
    commit. If the publish fails, the old checkpoint is put back at once; if
    the process is killed in between, ``cleanup_stale_temps`` (run by the
    managers before their first save) puts it back, or, when the new marker
    was already in place, finishes removing the old files.

    Args:
        tmp_dir: Directory holding the written files.
        dest_dir: Directory to publish into.
        names: File names in publish order; the last one is the commit marker.
        fsync: Whether to fsync ``dest_dir`` around the commit.
        replaces: Names (in ``dest_dir``) of an older checkpoint's files that
            this one supersedes; missing ones are ignored.
    """
    if not names:
        raise ValueError("nothing to publish")
    with directory_guard(dest_dir):
        _publish_files(tmp_dir, dest_dir, names, fsync=fsync, replaces=replaces)


def _publish_files(
    tmp_dir: str, dest_dir: str, names: Sequence[str], *, fsync: bool, replaces: Sequence[str]
) -> None:
    old = [n for n in replaces if os.path.lexists(os.path.join(dest_dir, n))]
    backup = _make_backup(dest_dir, old, names, fsync=fsync) if old else None
    try:
        for name in names[:-1]:
            os.replace(os.path.join(tmp_dir, name), os.path.join(dest_dir, name))
        if fsync:
            # Data files must be durable under their final names before the marker.
            fsync_path(dest_dir)
        os.replace(os.path.join(tmp_dir, names[-1]), os.path.join(dest_dir, names[-1]))
        if fsync:
            fsync_path(dest_dir)
    except BaseException:
        if backup is not None:
            _roll_back(backup, dest_dir)
        raise
    remove_tree(tmp_dir)
    if backup is not None:
        _finish_replacement(backup, dest_dir, fsync=fsync)


_BACKUP_PREFIX = TEMP_PREFIX + "prev-"
_BACKUP_RECORD = "asyncckpt-replacing.json"


def _make_backup(dest_dir: str, old: Sequence[str], new: Sequence[str], *, fsync: bool) -> str:
    """Hard-links (or copies) an old checkpoint's files into a backup directory."""
    backup = _claim(os.path.join(dest_dir, f"{_BACKUP_PREFIX}{new[-1]}-{uuid.uuid4().hex[:12]}"))
    os.makedirs(backup)
    for name in old:
        src, dst = os.path.join(dest_dir, name), os.path.join(backup, name)
        try:
            os.link(src, dst)
        except OSError:  # no hard links on this filesystem
            shutil.copy2(src, dst)
    record = {"old": list(old), "new": list(new), "marker": new[-1]}
    with open(os.path.join(backup, _BACKUP_RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    if fsync:
        fsync_path(backup)
        fsync_path(dest_dir)
    return backup


def _read_backup(backup: str) -> dict | None:
    try:
        with open(os.path.join(backup, _BACKUP_RECORD), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # killed while making the backup: nothing was replaced yet


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.samefile(a, b):
            return True
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def _roll_back(backup: str, dest_dir: str) -> None:
    """Puts the old checkpoint back (marker last) and removes the backup."""
    record = _read_backup(backup)
    if record is not None:
        old, marker = record["old"], record["marker"]
        for name in record["new"]:
            if name not in old:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dest_dir, name))
        # Linked back, not moved: a kill during this leaves the backup whole.
        for name in sorted(old, key=lambda n: n == marker):
            _link_over(os.path.join(backup, name), os.path.join(dest_dir, name))
    remove_tree(backup)


def _link_over(src: str, dst: str) -> None:
    """Makes ``dst`` a copy of ``src`` in one atomic replace; ``src`` stays."""
    with contextlib.suppress(OSError):
        if os.path.samefile(src, dst):
            return  # never replaced (and rename() between two links of a file is a no-op)
    tmp = _claim(
        os.path.join(os.path.dirname(dst), f"{TEMP_PREFIX}restore-{uuid.uuid4().hex[:12]}")
    )
    try:
        try:
            os.link(src, tmp)
        except FileNotFoundError:
            return
        except OSError:
            shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    finally:
        _settle(tmp)


def _finish_replacement(backup: str, dest_dir: str, *, fsync: bool) -> None:
    """After the new marker is in place: old files not overwritten go, then the backup."""
    record = _read_backup(backup)
    if record is not None:
        for name in record["old"]:
            if name not in record["new"]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dest_dir, name))
        if fsync:
            fsync_path(dest_dir)
    remove_tree(backup)


def _recover_backup(backup: str, dest_dir: str) -> None:
    """Completes a replacement a killed process left half done."""
    record = _read_backup(backup)
    if record is None:
        remove_tree(backup)
        return
    marker = record["marker"]
    current, previous = os.path.join(dest_dir, marker), os.path.join(backup, marker)
    if marker in record["old"] and (not os.path.lexists(current) or _same_file(current, previous)):
        logger.warning("putting back %s: an interrupted save had begun to replace it", marker)
        _roll_back(backup, dest_dir)
    else:
        _finish_replacement(backup, dest_dir, fsync=True)


def write_text_atomic(path: str, text: str, *, fsync: bool, mode: int | None = None) -> None:
    """Replaces a small text file atomically (write, fsync, rename).

    ``mode``: the file's permission bits (less execute bits); None: the umask's.
    """
    parent = os.path.dirname(os.path.abspath(path))
    tmp = _claim(
        os.path.join(parent, f"{TEMP_PREFIX}{os.path.basename(path)}-{uuid.uuid4().hex[:8]}")
    )
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode & 0o666)
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        _settle(tmp)
    if fsync:
        fsync_path(parent)


def cleanup_stale_temps(directory: str, *,
                        stale: Callable[[str], bool] | None = None) -> list[str]:
    """Removes temporaries left in ``directory`` by an interrupted run.

    Only call this while holding the directory's writer lock (or before any
    writer of this run started): it cannot tell another process's live
    temporary from a dead one's. Where several processes write one directory
    (``CheckpointLock``), ``stale(name)`` says which temporaries are dead
    (their checkpoint's lock is free): only those are touched. Temporaries
    this process is using (another manager of the same directory in this
    process) are left alone.

    Returns:
        The paths removed.
    """
    with directory_guard(directory):
        return _cleanup_stale_temps(directory, stale or (lambda _name: True))


def _cleanup_stale_temps(directory: str, stale: Callable[[str], bool]) -> list[str]:
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return removed
    # First put back (or finish replacing) checkpoints a killed re-save left.
    for name in entries:
        if (name.startswith(_BACKUP_PREFIX) and not is_live(os.path.join(directory, name))
                and stale(name)):
            _recover_backup(os.path.join(directory, name), directory)
    for name in entries:
        path = os.path.join(directory, name)
        if (is_temp_name(name) and not name.startswith(_BACKUP_PREFIX) and not is_live(path)
                and stale(name)):
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


def temp_target(name: str) -> str | None:
    """The name a temporary was made for (``.asyncckpt-tmp-ckpt-3.index-<token>`` ->
    ``ckpt-3.index``; a backup ``...-prev-ckpt-3.index-<token>`` likewise), or None."""
    if not is_temp_name(name):
        return None
    rest = name[len(TEMP_PREFIX):]
    if name.startswith(_BACKUP_PREFIX):
        rest = name[len(_BACKUP_PREFIX):]
    target, dash, _token = rest.rpartition("-")
    return target if dash and target else None


def ensure_writable_dir(directory: str) -> None:
    """Creates ``directory`` if needed and proves a file can be created in it.

    This runs on the caller's thread so that a bad path fails the ``save()``
    call itself with a clear error, instead of failing later in the background.

    Raises:
        PermissionError / NotADirectoryError / OSError: with the path named.
    """
    try:
        os.makedirs(directory, exist_ok=True)
        probe = _claim(os.path.join(directory, f"{TEMP_PREFIX}probe-{uuid.uuid4().hex[:8]}"))
        try:
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        finally:
            _settle(probe)
    except OSError as e:
        if e.errno is None:
            raise OSError(f"cannot write checkpoints into {directory!r}: {e}") from e
        # OSError(errno, text) picks the matching subclass (PermissionError, ...).
        raise OSError(e.errno, f"cannot write checkpoints into {directory!r}: {e.strerror}") from e

"""Where a transaction publishes: the ways a written checkpoint becomes visible.

A ``Destination`` makes the directory a save's files are written into
(``open``) and turns those files into the checkpoint in one atomic step
(``publish``), or removes them (``discard``). It is asyncckpt's counterpart
of orbax's ``TemporaryPath``; ``Transaction`` (``_engine/transaction.py``)
is its only caller.

* ``RenamedDirectory``: a temporary directory renamed to the step's name
  (one ``rename(2)``); orbax's default.
* ``MarkedDirectory``: the step's own directory, written in place and
  committed by a marker file created last (orbax's ``CommitFileTemporaryPath``,
  for file systems whose directory rename is not atomic).
* ``PrefixFiles``: files sharing a prefix (a TensorFlow checkpoint, a Keras
  file beside its manifest), moved from a temporary directory with the
  marker file (TensorFlow's ``.index``) last; an older checkpoint under the
  same names stays (backed up) until the new marker is in place.
* ``Uploaded``: any of the above in a local scratch directory, then handed
  to an object store (``s3://``, ``gs://``), whose own create-only commit
  marker makes it visible there; the save fails if the upload does.

The file-system primitives these use (temporaries, renames, backups) are
in ``_engine/commit.py``.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence

from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.lock import CheckpointLock


class Destination(abc.ABC):
    """How one checkpoint is published (see the module docstring).

    Attributes:
        path: The checkpoint's final path (a directory, or a prefix), for
            messages.
    """

    path: str

    @abc.abstractmethod
    def open(self) -> str:
        """Creates the directory the checkpoint's files are written into; returns it."""

    @abc.abstractmethod
    def publish(self, workdir: str, names: Sequence[str]) -> None:
        """Makes the files of ``workdir`` the checkpoint, atomically.

        ``names`` are ``workdir``'s top-level entries, the manifest among
        them; every file in them is durable already. Returning means
        published: the save is committed.
        """

    def complete(self) -> None:
        """Finishes the commit after ``publish`` (an upload); default: nothing.

        If it raises, the save fails, and what ``publish`` made stays.
        """
        return None

    def discard(self, workdir: str) -> None:
        """Removes what ``open`` (and a failed ``publish``) left; never raises."""
        commit_lib.remove_tree(workdir)

    def release(self, workdir: str) -> None:
        """This process stops using ``workdir``, which another process publishes or removes."""
        commit_lib.forget_temp(workdir)


class RenamedDirectory(Destination):
    """A temporary directory, renamed to the checkpoint's name.

    Args:
        path: The checkpoint's directory.
        token: Names the temporary; the same on every process writing the
            checkpoint (a random one when None).
        replace: Publish over an existing checkpoint (orbax's ``force=True``):
            the old one is renamed aside first and removed once the new one
            is in place.
        fsync: Whether to fsync the parent around the rename.
        mode: Permission bits of the directories made (orbax's
            ``FileOptions.path_permission_mode``); None: the umask's default.
    """

    def __init__(self, path: str, *, token: str | None = None, replace: bool = False,
                 fsync: bool, mode: int | None = None):
        self.path = path
        self._token = token
        self._replace = replace
        self._fsync = fsync
        self._mode = mode

    def open(self) -> str:
        parent, name = os.path.split(os.path.abspath(self.path))
        return commit_lib.make_temp_dir(parent, name, token=self._token, mode=self._mode)

    def publish(self, workdir: str, names: Sequence[str]) -> None:
        commit_lib.publish_dir(workdir, self.path, fsync=self._fsync, replace=self._replace)


class MarkedDirectory(Destination):
    """The checkpoint's own directory, committed by creating ``marker`` in it last.

    Args:
        path: The checkpoint's directory.
        marker: The commit marker's file name (orbax's ``commit_success.txt``).
        replace_stale: Remove an uncommitted directory of that name first (a
            killed save's); False where several processes write into it.
        fsync: Whether to fsync the directory before and after the marker.
        mode: Permission bits of the directories made; None: the umask's.
    """

    def __init__(self, path: str, marker: str, *, replace_stale: bool, fsync: bool,
                 mode: int | None = None):
        self.path = path
        self.marker = marker
        self._replace_stale = replace_stale
        self._fsync = fsync
        self._mode = mode

    def open(self) -> str:
        return commit_lib.make_dir_in_place(self.path, replace_stale=self._replace_stale,
                                            mode=self._mode)

    def publish(self, workdir: str, names: Sequence[str]) -> None:
        commit_lib.commit_in_place(workdir, self.marker,
                                   f"committed by asyncckpt: {self.path}", fsync=self._fsync)


class PrefixFiles(Destination):
    """Files of one checkpoint in a shared directory, the marker file published last.

    Args:
        directory: Where the files are published.
        marker: The file whose presence makes the checkpoint
            (``<prefix>.index`` for TensorFlow); moved last.
        replaces: Names of an older checkpoint's files at the same place
            (called at the publish): kept in a backup until the new marker
            is in place (``commit.publish_files``).
        fsync: Whether to fsync the directory around the commit.
        mode: Permission bits of the temporary directory; None: the umask's.
        lock: The checkpoint's lock (several processes write the directory:
            ``CheckpointLock``), held from ``open`` until published or
            discarded; waits up to ``lock_wait_s`` for another process
            writing the same checkpoint.
    """

    def __init__(self, directory: str, marker: str, *,
                 replaces: Callable[[], Sequence[str]] = tuple, fsync: bool,
                 mode: int | None = None, lock: CheckpointLock | None = None,
                 lock_wait_s: float = 0.0):
        self.directory = directory
        self.marker = marker
        self.path = os.path.join(directory, marker)
        self._replaces = replaces
        self._fsync = fsync
        self._mode = mode
        self._lock = lock
        self._lock_wait_s = lock_wait_s

    def open(self) -> str:
        if self._lock is not None:
            self._lock.acquire(self._lock_wait_s)
        try:
            return commit_lib.make_temp_dir(self.directory, self.marker, mode=self._mode)
        except BaseException:
            self._unlock()
            raise

    def publish(self, workdir: str, names: Sequence[str]) -> None:
        if self.marker not in names:
            raise FileNotFoundError(f"{self.marker!r} was not written into {workdir!r}")
        order = [n for n in names if n != self.marker] + [self.marker]
        commit_lib.publish_files(workdir, self.directory, order, fsync=self._fsync,
                                 replaces=self._replaces())
        self._unlock()

    def discard(self, workdir: str) -> None:
        super().discard(workdir)
        self._unlock()

    def release(self, workdir: str) -> None:
        super().release(workdir)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()


class Uploaded(Destination):
    """A local destination, then an object store: the checkpoint is committed once uploaded.

    A URL directory's checkpoints are written into a local scratch directory
    (``local``); once published there, ``upload`` (the storage layer's
    protocol: data, manifest, then its create-only commit marker) copies
    them into the bucket. The save is durable only then, so an upload
    failure fails it.
    """

    def __init__(self, local: Destination, upload: Callable[[], None]):
        self.local = local
        self.path = local.path
        self._upload = upload

    def open(self) -> str:
        return self.local.open()

    def publish(self, workdir: str, names: Sequence[str]) -> None:
        self.local.publish(workdir, names)

    def complete(self) -> None:
        self.local.complete()
        self._upload()

    def discard(self, workdir: str) -> None:
        self.local.discard(workdir)

    def release(self, workdir: str) -> None:
        self.local.release(workdir)

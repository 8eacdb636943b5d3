"""One writing process per checkpoint directory, or per checkpoint.

Two processes saving into one directory would delete each other's checkpoints
through retention and race on the state files. A manager takes this lock
before its first save (``DirectoryLock``). Where the framework lets several
processes write one directory (TensorFlow's managers), only the same
checkpoint conflicts: ``CheckpointLock`` guards one checkpoint name, held
while it is written (or deleted). Within one process the lock is shared: managers of one
directory (a restart modelled in the same process, or a dropped manager and
its replacement) each hold it, counted per real path, and the ``flock`` is
taken once per process and dropped when the last holder releases it (or is
garbage-collected). The lock is an ``flock`` on ``.asyncckpt.lock`` (the
kernel drops it when the holder dies, so a crashed run never blocks the next
one); the file also names the holder's pid and host for the error message.
On filesystems without ``flock`` a pid-liveness check on the same host stands
in for it.

The last holder removes the file before it unlocks, so a directory no
process writes holds only its checkpoints (as orbax's and TensorFlow's
managers leave it). A taker therefore checks, once it has the ``flock``, that
the file it locked is still the one at the path (not one removed meanwhile)
and otherwise tries again with the new one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass

from asyncckpt.errors import DirectoryLockedError

logger = logging.getLogger(__name__)

LOCK_NAME = ".asyncckpt.lock"
# One lock file per checkpoint name (``CheckpointLock``), in this subdirectory.
LOCKS_DIR = ".asyncckpt-locks"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4096)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    """A lock holder as its errors name it: pid, host, since when."""
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since {when}"


@dataclass(eq=False)
class _Shared:
    """The process's hold on one directory: the locked descriptor and its holders."""

    fd: int
    holders: int
    path: str


_registry: dict[str, _Shared] = {}
_registry_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A fork() child does not hold its parent's directories.

    Closing the inherited descriptors leaves the parent's ``flock`` in place
    (it belongs to the open file, which the parent still has open).
    """
    global _registry_lock
    _registry_lock = threading.Lock()
    for shared in _registry.values():
        with contextlib.suppress(OSError):
            os.close(shared.fd)
    _registry.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _drop_holder(key: str, shared: _Shared) -> None:
    with _registry_lock:
        if _registry.get(key) is not shared:
            return  # forked child, or already gone
        shared.holders -= 1
        if shared.holders > 0:
            return
        del _registry[key]
    with contextlib.suppress(OSError):
        # Removed while still locked: a taker that opened it before checks that it is
        # still the file at the path once it has the lock (``_lock_file``).
        if os.path.samestat(os.fstat(shared.fd), os.stat(shared.path)):
            os.unlink(shared.path)
    os.close(shared.fd)  # closing the last descriptor releases the flock


class DirectoryLock:
    """Writer lock on a checkpoint directory: exclusive between processes,
    shared (reference-counted) between the holders of one process.

    A holder that is garbage-collected without ``release()`` gives its share
    back (``weakref.finalize``), so a dropped manager never keeps another
    process out for the rest of this one's life.

    Args:
        directory: The checkpoint directory (created if missing).
    """

    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._key = os.path.realpath(self.directory)
        self._release: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        return self._release is not None and self._release.alive

    def acquire(self) -> None:
        """Takes the lock, or raises if another live process holds it.

        Raises:
            DirectoryLockedError: naming the holder's pid and host.
        """
        if self.held:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        key = self._key
        with _registry_lock:
            shared = _registry.get(key)
            if shared is not None:
                shared.holders += 1
            else:
                shared = _Shared(self._lock_file(), 1, self.path)
                _registry[key] = shared
        self._release = weakref.finalize(self, _drop_holder, key, shared)

    def _lock_file(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                previous = self._lock(fd)
                if self._still_at_path(fd):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the holder removed it as it unlocked: lock the file there now
        try:
            if previous.get("pid") and (
                previous.get("pid") != os.getpid()
                or previous.get("host") != socket.gethostname()
            ):
                logger.warning(
                    "Taking over the checkpoint lock of %s left by pid %s on host %s, "
                    "which no longer holds it",
                    self.directory,
                    previous.get("pid"),
                    previous.get("host"),
                )
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _still_at_path(self, fd: int) -> bool:
        """Whether the locked ``fd`` is the file at ``self.path`` (not one removed)."""
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def _lock(self, fd: int) -> dict:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._refuse(_read_holder(fd))
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # No flock here: trust the pid recorded in the file, on this host.
            holder = _read_holder(fd)
            if (
                holder.get("host") == socket.gethostname()
                and holder.get("pid") not in (None, os.getpid())
                and _pid_alive(int(holder["pid"]))
            ):
                self._refuse(holder)
            return holder
        return _read_holder(fd)

    def _refuse(self, holder: dict) -> None:
        raise DirectoryLockedError(
            f"checkpoint directory {self.directory!r} is in use by another writer "
            f"({_describe(holder)}). "
            "Only one process may save into a directory; stop the other run, or give this "
            "one its own directory."
        )

    def try_acquire(self) -> bool:
        """Takes the lock if no other live process holds it; False (nothing raised) if one does."""
        try:
            self.acquire()
        except DirectoryLockedError:
            return False
        return True

    def release(self) -> None:
        """Gives this holder's share back; the last one in the process removes the
        lock file and unlocks."""
        if self._release is not None:
            self._release()
            self._release = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CheckpointLock(DirectoryLock):
    """Writer lock on one checkpoint of a directory (``<dir>/.asyncckpt-locks/<name>``).

    Exclusive between processes, shared by the holders of one process, as
    ``DirectoryLock`` (and, as its, removed by its last holder): taken while
    a checkpoint of that name is written or deleted, so processes writing
    other checkpoints of the directory go on.

    Args:
        directory: The checkpoint directory.
        name: The checkpoint's name (a TensorFlow prefix's basename).
    """

    def __init__(self, directory: str, name: str):
        super().__init__(directory)
        self.name = name
        self.path = os.path.join(self.directory, LOCKS_DIR, name)
        self._key = os.path.join(os.path.realpath(self.directory), LOCKS_DIR, name)

    def acquire(self, wait_s: float = 0.0) -> None:
        """Takes the lock, waiting up to ``wait_s`` seconds for another process's save.

        Raises:
            DirectoryLockedError: another live process still holds it.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                super().acquire()
                return
            except DirectoryLockedError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.05)

    def _refuse(self, holder: dict) -> None:
        raise DirectoryLockedError(
            f"checkpoint {self.name!r} in {self.directory!r} is being written by another "
            f"process ({_describe(holder)}); save it under another name "
            "(checkpoint_number=...), or let that process finish first")

"""One writer per checkpoint directory.

Two processes saving into one directory would delete each other's checkpoints
through retention and race on the state files. A manager takes this lock
before its first save. The lock is an ``flock`` on ``.asyncckpt.lock`` (the
kernel drops it when the holder dies, so a crashed run never blocks the next
one); the file also names the holder's pid and host for the error message.
On filesystems without ``flock`` a pid-liveness check on the same host stands
in for it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time

from asyncckpt.errors import DirectoryLockedError

logger = logging.getLogger(__name__)

LOCK_NAME = ".asyncckpt.lock"


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


class DirectoryLock:
    """Exclusive writer lock on a checkpoint directory.

    Args:
        directory: The checkpoint directory (created if missing).
    """

    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock, or raises if a live process holds it.

        Raises:
            DirectoryLockedError: naming the holder's pid and host.
        """
        if self._fd is not None:
            return
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            previous = self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        if previous.get("pid") and (
            previous.get("pid") != os.getpid() or previous.get("host") != socket.gethostname()
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
        self._fd = fd

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
        since = holder.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
        raise DirectoryLockedError(
            f"checkpoint directory {self.directory!r} is in use by another writer "
            f"(pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since {when}). "
            "Only one process may save into a directory; stop the other run, or give this "
            "one its own directory."
        )

    def release(self) -> None:
        """Drops the lock (the file stays, empty, to keep its inode stable)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

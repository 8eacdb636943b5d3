"""Starts disk writeback of files while TensorFlow is still writing them.

TensorFlow's bundle writer (``SaveV2``) writes the whole data file before it
returns, and only then can asyncckpt fsync it: at 1 GiB the write took
1.5-1.7 s and the fsync another 1.1-1.5 s, one after the other, so the disk
sat idle while TensorFlow serialized. ``EarlyWriteback`` watches the
save's private temporary directory from a helper thread while ``SaveV2``
runs and asks the kernel to start writing back whatever is dirty in the
files there (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start, do not wait),
so the later fsync finds most pages already on disk. It changes nothing about
durability: the commit still fsyncs every file. Where ``sync_file_range`` is
missing (not Linux), it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
import threading

from asyncckpt.engine.slots import lower_thread_priority

logger = logging.getLogger(__name__)

_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h
_INTERVAL_S = 0.05  # how often dirty pages are handed to the disk


def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()


class EarlyWriteback:
    """Context manager: while open, starts writeback of the files in ``directory``.

    Args:
        directory: A directory only this save writes into.
        nice: Niceness added to the helper thread (the writer's).
    """

    def __init__(self, directory: str, *, nice: int = 0):
        self._dir = directory
        self._nice = nice
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EarlyWriteback:
        if _SFR is not None:
            self._thread = threading.Thread(
                target=self._run, name="asyncckpt-writeback", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        fds: dict[str, int] = {}
        try:
            # A periodic flush, not a synchronisation: the commit's fsync is what waits.
            while not self._done.wait(_INTERVAL_S):
                self._flush(fds)
        except Exception as e:  # only an optimisation: the commit's fsync still runs
            logger.debug("early writeback stopped: %r", e)
        finally:
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _flush(self, fds: dict[str, int]) -> None:
        with os.scandir(self._dir) as entries:
            for entry in entries:
                if entry.name not in fds and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):  # renamed or gone meanwhile
                        fds[entry.name] = os.open(entry.path, os.O_RDONLY)
        for fd in fds.values():
            _SFR(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

"""Saves in flight in this process, by checkpoint prefix.

``restore()``/``read()`` of a prefix whose save is still being written waits
for that save, whichever ``asyncckpt.tf.Checkpoint`` made it, instead of
failing or reading an older checkpoint at the same prefix. Entries go away as
each save finishes; nothing here refers to a checkpoint or a manager.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent import futures

from asyncckpt._engine.writer import SaveHandle
from asyncckpt.storage.url import is_url

_LOCK = threading.Lock()
_SAVES: dict[str, list[futures.Future]] = {}  # each save's ``committed``
_IN_CALLBACK = threading.local()


def _key(prefix: str) -> str:
    return prefix if is_url(prefix) else os.path.abspath(prefix)


def register(prefix: str, handle: SaveHandle) -> None:
    """Records ``handle`` as the save writing ``prefix`` until it finishes."""
    key = _key(prefix)
    with _LOCK:
        _SAVES.setdefault(key, []).append(handle.committed)
    # The future, not the handle: a callback naming the handle that holds the
    # future would be a reference cycle.
    handle.committed.add_done_callback(functools.partial(_finished, key))


def _finished(key: str, committed: futures.Future) -> None:
    with _LOCK:
        pending = _SAVES.get(key)
        if pending is not None:
            pending[:] = [f for f in pending if f is not committed]
            if not pending:
                del _SAVES[key]


def in_flight(prefix: str) -> bool:
    """Whether a save of ``prefix`` is still being written."""
    with _LOCK:
        return _key(prefix) in _SAVES


def wait_for(prefix: str, timeout: float | None = None) -> None:
    """Waits until no save of ``prefix`` is in flight (however it ended).

    Not from a commit callback on the writer thread, which would wait for
    itself: there it returns at once.
    """
    if getattr(_IN_CALLBACK, "active", False):
        return
    with _LOCK:
        pending = list(_SAVES.get(_key(prefix), ()))
    if pending:
        futures.wait(pending, timeout=timeout)


class callback_scope:
    """Marks the current thread as running commit callbacks."""

    def __enter__(self) -> None:
        self._previous = getattr(_IN_CALLBACK, "active", False)
        _IN_CALLBACK.active = True

    def __exit__(self, *exc) -> None:
        _IN_CALLBACK.active = self._previous

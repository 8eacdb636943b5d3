"""Removal of deleted checkpoints' files on a background thread.

Retention takes a checkpoint out of the listing with one rename (to a
temporary name no reader lists); removing its files costs one ``unlink``
per file and must not hold up the writer thread, whose next job is the next
save. ``BackgroundRemover`` removes such renamed trees in order on a daemon
thread of its own, at a low CPU priority. A tree still pending when the
process dies is an ordinary stale temporary: the next run's cleanup removes
it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from asyncckpt._engine import commit as commit_lib
from asyncckpt._threads import lower_thread_priority

logger = logging.getLogger(__name__)

_NICE = 15  # below the writer's default niceness (10): removals wait for everything else


class BackgroundRemover:
    """Removes renamed-away trees on a daemon thread, oldest first.

    Args:
        name: Names the thread (``asyncckpt-remove-<name>``).
    """

    def __init__(self, name: str):
        self._name = name
        self._todo: deque[str] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, path: str) -> None:
        """Removes ``path`` (a temporary name this process claimed) in the background."""
        with self._cv:
            self._todo.append(path)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                 name=f"asyncckpt-remove-{self._name}")
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        lower_thread_priority(_NICE)
        while True:
            with self._cv:
                if not self._todo:
                    self._thread = None
                    self._cv.notify_all()
                    return
                path = self._todo.popleft()
                self._busy = True
            try:
                self.remove(path)
            except OSError as e:  # a stale temporary: the next run's cleanup removes it
                logger.warning("could not remove %s: %s", path, e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def remove(self, path: str) -> None:
        """Removes one tree (on the remover's thread): every removal is this call."""
        commit_lib.remove_tree(path)

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._todo) + self._busy

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every submitted tree is removed; False if ``timeout`` ran out."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._todo and not self._busy, timeout)

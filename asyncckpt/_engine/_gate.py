"""How background work gives way to the training thread: niceness and the save gate.

Two mechanisms, both for the engine's background threads (the writer, its
fsync helper, spare-slot builds):

* they run at a raised niceness (``asyncckpt._threads.lower_thread_priority``),
  so at equal demand for a core the training threads win;
* ``SaveGate``: while a save is staging (its copy into a slot runs on the
  training thread and the copy threads), background work stops between
  pieces (a write chunk, a file, a spare's 8 MiB piece) and resumes when the
  copy is done. Niceness alone does not keep the writer off the memory bus,
  nor its Python off the GIL, on a machine with few cores; a copy that
  shares them with a write runs slower, and the training thread waits for
  the copy (issue 13: back-to-back saves at memcpy speed).

The gate is closed only for the copy itself: a save waiting for a free slot
(which the writer must release) keeps it open, and every wait is bounded
(see ``SaveGate.wait``), so a staging that takes long (a device-to-host
transfer, a stage that blocks) delays the writer by at most that bound.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

# Longest a background piece waits for one closing of the gate: a 64 MiB
# copy takes ~6 ms on the project's VM, a 1 GiB one ~0.15 s.
DEFAULT_MAX_WAIT_S = 0.25


class SaveGate:
    """Closed while any save is staging; background work waits on it between pieces.

    ``close``/``open`` (or ``with gate:``) are counted, so several saving threads may stage at
    once: the gate opens when the last of them is done. Each stretch of time
    during which the gate stays closed is one *closing*; ``wait`` returns when
    the closing it found ends, or once that closing has lasted ``max_wait_s``
    (from then on until the gate opens, every ``wait`` returns at once: a
    staging that never ends cannot stop the writer for longer than that).

    Args:
        max_wait_s: The bound on one closing's hold on background work.
        enabled: False makes ``close`` and ``wait`` do nothing
            (``AsyncOptions.yield_to_saves=False``).

    Attributes:
        pauses: How many ``wait`` calls found the gate closed and waited.
        paused_s: Seconds spent in those waits, in all.
    """

    def __init__(self, *, max_wait_s: float = DEFAULT_MAX_WAIT_S, enabled: bool = True):
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
        self.max_wait_s = max_wait_s
        self.enabled = enabled
        self.pauses = 0
        self.paused_s = 0.0
        self._cond = threading.Condition(threading.Lock())
        self._depth = 0  # saves staging now
        self._closing = 0  # bumped each time the gate closes from open
        self._since = 0.0  # when the current closing began (monotonic)
        self._waiting = 0  # background threads inside wait() now

    @property
    def is_closed(self) -> bool:
        """Whether a save is staging now."""
        return self._depth > 0

    @property
    def waiting(self) -> int:
        """Background threads paused in ``wait`` now."""
        with self._cond:
            return self._waiting

    def close(self) -> None:
        """A save starts staging: background work pauses at its next piece."""
        if not self.enabled:
            return
        with self._cond:
            if self._depth == 0:
                self._closing += 1
                self._since = time.monotonic()
            self._depth += 1

    def open(self) -> None:
        """That save is staged; paused background work resumes once no save stages."""
        if not self.enabled:
            return
        with self._cond:
            if self._depth <= 0:
                raise RuntimeError("SaveGate opened more often than closed")
            self._depth -= 1
            if self._depth == 0:
                self._cond.notify_all()

    def __enter__(self) -> SaveGate:
        self.close()
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()

    def wait(self) -> None:
        """Called by background work between pieces: returns at once unless a save stages.

        Waits until the closing it found ends (or, if it has lasted
        ``max_wait_s``, not at all). Never raises.
        """
        if self._depth == 0:  # unlocked read: the common case costs one attribute load
            return
        with self._cond:
            if self._depth == 0:
                return
            closing = self._closing
            deadline = self._since + self.max_wait_s
            start = time.monotonic()
            if start >= deadline:
                return
            self._waiting += 1
            try:
                while self._depth > 0 and self._closing == closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            finally:
                self._waiting -= 1
                self.pauses += 1
                self.paused_s += time.monotonic() - start

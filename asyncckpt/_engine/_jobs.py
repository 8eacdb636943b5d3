"""The contract between the engine and a framework adapter: ``SaveJob``.

Split from ``writer`` (which re-exports both names): staging returns a job,
the writer thread runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.slots import Slot


class SaveJob(Protocol):
    """The format-specific part of one save, produced by staging.

    Call order, all on the background thread: ``write`` (files into a
    temporary location, from the slot's buffers), then ``commit`` (make the
    files durable and publish them; returning means published), or ``abort``
    after a failure in either. Then, if the job has it, ``after_commit(stats)``
    (state files, retention, callbacks): publishing is the line, so an error
    raised there is logged and counted (``AsyncEngine.post_commit_errors``,
    ``SaveStats.post_commit_error``) and never fails the save.
    """

    label: str
    step: int | None
    nbytes: int

    def write(self) -> None:
        """Writes the staged bytes; the slot is released when this returns."""

    def commit(self, stats: SaveStats) -> None:
        """Makes the checkpoint durable and visible (``commit_s`` is 0 here)."""

    def abort(self) -> None:
        """Removes whatever ``write``/``commit`` left behind; must not raise."""

    # Optional: ``start_background()``, called on the saving thread once the
    # job is queued, as the save call's last work: starts background work on
    # the slot that ``write`` will wait for (a deferred copy), so that it does
    # not compete for the cores with the rest of the call. ``write`` must not
    # depend on it having been called.
    # Optional: ``set_pause(pause)``, called on the writer thread before
    # ``write``: ``pause()`` (the engine's ``SaveGate.wait``) is for the job
    # to call between pieces of its writing; it returns at once unless a save
    # is copying, and waits a bounded time then (AsyncOptions.yield_to_saves).
    # Optional: ``discard()``, called on the saving thread when staging
    # returned the job but the save then failed before it was queued; it must
    # stop any background work the job does on the slot (a deferred copy)
    # before returning, since the slot is given back next. Must not raise.


StageFn = Callable[[Slot], SaveJob]

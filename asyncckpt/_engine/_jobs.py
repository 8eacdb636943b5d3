"""The contract between the engine and a front end: ``SaveJob``.

Staging returns a job; the writer thread (``_engine/writer.py``) runs it. A
front end's job is its format writer: it writes the staged bytes through its
``Transaction`` (``_engine/transaction.py``), which commits them. The
optional steps are methods that do nothing here, so the engine calls each of
them on every job.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.slots import Slot
from asyncckpt._engine.transaction import Transaction


class SaveJob:
    """The format-specific part of one save, produced by staging.

    Call order:

    * on the saving thread, once the job is queued: ``start_background()``;
      or, if the save fails between staging and queueing, ``discard()``;
    * on the writer thread: ``set_pause(pause)``, ``write()`` (the staged
      bytes into files; the slot is released when it returns), then
      ``commit(stats)`` (durable and published: returning means committed),
      or ``abort()`` after a failure in either; after a commit,
      ``after_commit(stats)``: publishing is the line, so an error raised
      there is logged and counted (``AsyncEngine.post_commit_errors``,
      ``SaveStats.post_commit_error``) and never fails the save.

    Subclasses implement ``write``; ``commit`` and ``abort`` run the
    transaction's and are overridden only where a save commits in several
    processes (``jax/_job.py``).

    Attributes:
        label: The checkpoint's name, for logs and stats.
        step: The training step, when known.
        nbytes: Bytes staged (stats).
        transaction: The save's commit; None for a job that publishes nothing.
        pause: The engine's gate (``set_pause``): a writer calls it between
            pieces; it returns at once unless a save is copying.
    """

    def __init__(self, *, label: str, step: int | None, nbytes: int,
                 transaction: Transaction | None = None):
        self.label = label
        self.step = step
        self.nbytes = nbytes
        self.transaction = transaction
        self.pause: Callable[[], None] | None = None

    def start_background(self) -> None:
        """Starts background work on the slot that ``write`` waits for (a deferred copy).

        Called on the saving thread as the save call's last work, so that it
        does not compete for the cores with the rest of the call. ``write``
        must not depend on it having been called. Default: nothing.
        """

    def discard(self) -> None:
        """The save failed before it was queued: stop background work on the slot.

        Called on the saving thread; the slot is given back next, so any
        work on it must have stopped when this returns. Must not raise.
        Default: nothing.
        """

    def set_pause(self, pause: Callable[[], None]) -> None:
        """Receives the engine's gate before ``write`` (``AsyncOptions.yield_to_saves``)."""
        self.pause = pause
        if self.transaction is not None:
            self.transaction.set_pause(pause)

    def write(self) -> None:
        """Writes the staged bytes; the slot is released when this returns."""
        raise NotImplementedError

    def manifest_extra(self) -> dict:
        """Front-end data recorded in the manifest's ``extra``. Default: none."""
        return {}

    def commit(self, stats: SaveStats) -> None:
        """Makes the checkpoint durable and visible (``stats.commit_s`` is 0 here)."""
        assert self.transaction is not None, f"{type(self).__name__} has no transaction"
        self.transaction.commit(stats, self.manifest_extra())

    def after_commit(self, stats: SaveStats) -> None:
        """Work after the publish (state files, retention, callbacks). Default: nothing."""

    def abort(self) -> None:
        """Removes whatever ``write``/``commit`` left behind; must not raise."""
        self.discard()
        if self.transaction is not None:
            self.transaction.abort()


StageFn = Callable[[Slot], SaveJob]

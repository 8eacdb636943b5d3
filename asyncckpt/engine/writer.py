"""Write stage: the background writer and the per-save handles.

``AsyncEngine.save`` runs on the caller's thread only for as long as it takes
to copy the state into a free staging slot; a single background thread then
writes, commits and releases each save in order. Framework adapters supply the
format-specific parts as a ``SaveJob``; the engine owns threading, ordering,
timings, error propagation and the flush at interpreter exit.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Protocol

from asyncckpt._closing import ClosingContext
from asyncckpt.engine.metrics import SaveStats, WriteTimeEstimator
from asyncckpt.engine.slots import Slot, StagingPool
from asyncckpt.errors import EngineClosedError
from asyncckpt.options import AsyncOptions

logger = logging.getLogger(__name__)


class SaveJob(Protocol):
    """The format-specific part of one save, produced by staging.

    Call order, all on the background thread: ``write`` (files into a
    temporary location, from the slot's buffers), then ``commit`` (make the
    files durable and visible, update any index or retention), or ``abort``
    after a failure in either.
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


StageFn = Callable[[Slot], SaveJob]


def lower_thread_priority(nice: int) -> None:
    """Raises the calling thread's niceness by ``nice`` (Linux only; best effort).

    On Linux each thread has its own niceness and threads it starts inherit
    it, so the writer's helpers (the fsync thread) run at the same priority.
    Lowering one's own priority needs no privilege; where it is refused or
    the platform has no per-thread priority, the writer runs unchanged.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError as e:
        logger.debug("could not lower the writer thread's priority: %s", e)


class SaveHandle:
    """The result of one asynchronous save.

    Attributes:
        label: Checkpoint name (a path or a step).
        step: Training step, when known.
        staged: Done once the state has been copied to host memory; from then
            on the training state may be mutated. (``save()`` returns only
            after this, so it is always done by the time a caller sees it.)
        committed: Resolves to the save's ``SaveStats`` once the checkpoint is
            durable and visible, or to the error that stopped it.
    """

    def __init__(self, label: str, step: int | None):
        self.label = label
        self.step = step
        self.staged: Future[None] = Future()
        self.committed: Future[SaveStats] = Future()

    def result(self, timeout: float | None = None) -> SaveStats:
        """Waits until the checkpoint is durable and returns its stats."""
        return self.committed.result(timeout)

    def done(self) -> bool:
        return self.committed.done()

    def __repr__(self) -> str:
        state = "committed" if self.done() else "in flight"
        return f"SaveHandle({self.label!r}, {state})"


@dataclass
class _Work:
    job: SaveJob
    slot: Slot
    handle: SaveHandle
    t0: float
    started_at: float
    blocking_s: float
    slot_wait_s: float


_ENGINES: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()
_EXIT_HOOK_LOCK = threading.Lock()
_exit_hook_installed = False


def _flush_at_exit() -> None:
    """Waits (bounded) for in-flight saves when the main thread ends."""
    for engine in list(_ENGINES):
        engine._flush_for_exit()


def _install_exit_hook() -> None:
    global _exit_hook_installed
    with _EXIT_HOOK_LOCK:
        if _exit_hook_installed:
            return
        # threading's exit hooks run when the main thread finishes, before
        # interpreter teardown and before `atexit`, while TensorFlow and JAX
        # are still fully usable by the writer thread.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_flush_at_exit)
        else:  # pragma: no cover - every CPython >= 3.9 has it
            import atexit

            atexit.register(_flush_at_exit)
        _exit_hook_installed = True


class AsyncEngine(ClosingContext):
    """Stages saves into host slots and writes them on a background thread.

    Errors from the background are re-raised on the next ``save()``, on
    ``sync()`` and on ``close()``. At interpreter exit, in-flight saves are
    given ``options.exit_timeout_s`` seconds to become durable.

    Args:
        options: Staging and durability options.
        name: Name used in log lines and the writer thread's name.
    """

    def __init__(self, *, options: AsyncOptions | None = None, name: str = "asyncckpt"):
        self.options = options or AsyncOptions()
        self.name = name
        self._pool = StagingPool(self.options.num_slots)
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._inflight = 0
        self._errors: list[BaseException] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self._estimator = WriteTimeEstimator()
        self._busy_since: float | None = None
        self._history: deque[SaveStats] = deque(maxlen=256)
        _ENGINES.add(self)
        _install_exit_hook()

    # -- properties -------------------------------------------------------

    @property
    def pending(self) -> int:
        """Saves staged but not yet committed (or failed)."""
        with self._cond:
            return self._inflight

    @property
    def history(self) -> tuple[SaveStats, ...]:
        """Stats of the most recent committed saves, oldest first."""
        with self._cond:
            return tuple(self._history)

    @property
    def last_stats(self) -> SaveStats | None:
        with self._cond:
            return self._history[-1] if self._history else None

    @property
    def estimator(self) -> WriteTimeEstimator:
        """Running estimate of background write time, for the preemption handler."""
        return self._estimator

    @property
    def estimated_write_seconds(self) -> float | None:
        """Smoothed background seconds (write + commit) of recent saves."""
        return self._estimator.seconds

    @property
    def busy_for(self) -> float | None:
        """Seconds the writer has spent on the save it is writing now; None when idle.

        With ``pending`` and ``estimator`` it tells how long the saves in
        flight still need (the preemption handler's grace margin).
        """
        with self._cond:
            since = self._busy_since
        return None if since is None else time.perf_counter() - since

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging slots."""
        return self._pool.nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    # -- saving ------------------------------------------------------------

    def save(
        self,
        stage: StageFn,
        *,
        label: str,
        step: int | None = None,
        slot_timeout: float | None = None,
    ) -> SaveHandle:
        """Copies the state into a free slot and queues it for writing.

        Args:
            stage: Called on this thread with a free ``Slot``; copies the state
                into the slot's buffers and returns the ``SaveJob`` that writes
                them.
            label: Checkpoint name for logs and stats.
            step: Training step, when known.
            slot_timeout: Longest wait for a free slot; None waits as long as
                the write in progress takes.

        Returns:
            A handle whose ``committed`` future resolves when the checkpoint is
            durable.

        Raises:
            Exception: A failure of an earlier background save, re-raised here.
        """
        self._check_open()
        self.raise_pending_error()
        t0 = time.perf_counter()
        started_at = time.time()
        slot, slot_wait_s = self._pool.acquire(timeout=slot_timeout)
        try:
            job = stage(slot)
            slot.trim()
        except BaseException:
            self._pool.release(slot)
            raise
        blocking_s = time.perf_counter() - t0
        handle = SaveHandle(label, step)
        handle.staged.set_result(None)
        with self._cond:
            self._inflight += 1
        self._ensure_thread()
        self._queue.put(_Work(job, slot, handle, t0, started_at, blocking_s, slot_wait_s))
        logger.debug(
            "[%s] staged %s: %.1f MiB in %.2f ms (%.2f ms waiting for a slot)",
            self.name,
            label,
            job.nbytes / 2**20,
            blocking_s * 1e3,
            slot_wait_s * 1e3,
        )
        return handle

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"{self.name}: cannot save after close()")

    def _ensure_thread(self) -> None:
        if self._thread is None:
            # Daemon, so a forgotten close() never hangs interpreter exit; the
            # exit hook gives in-flight saves a bounded time to finish instead.
            self._thread = threading.Thread(
                target=self._run, name=f"{self.name}-writer", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        lower_thread_priority(self.options.writer_nice)
        while (work := self._queue.get()) is not None:
            self._process(work)

    def _process(self, w: _Work) -> None:
        job = w.job
        released = False
        try:
            t1 = time.perf_counter()
            with self._cond:
                self._busy_since = t1
            job.write()
            write_s = time.perf_counter() - t1
            self._pool.release(w.slot)
            released = True
            stats = SaveStats(
                label=job.label,
                step=job.step,
                nbytes=job.nbytes,
                blocking_s=w.blocking_s,
                slot_wait_s=w.slot_wait_s,
                write_s=write_s,
                commit_s=0.0,
                durable_s=time.perf_counter() - w.t0,
                started_at=w.started_at,
            )
            t2 = time.perf_counter()
            job.commit(stats)
            now = time.perf_counter()
            stats = replace(stats, commit_s=now - t2, durable_s=now - w.t0)
            self._estimator.update(stats.background_s, stats.nbytes)
            with self._cond:
                self._history.append(stats)
            logger.info(
                "[%s] %s durable: %.1f MiB, blocked %.1f ms, wrote %.0f ms, committed %.0f ms "
                "(%.0f MiB/s)",
                self.name,
                job.label,
                stats.nbytes / 2**20,
                stats.blocking_s * 1e3,
                stats.write_s * 1e3,
                stats.commit_s * 1e3,
                stats.throughput_bytes_per_s / 2**20,
            )
            w.handle.committed.set_result(stats)
        except BaseException as e:
            logger.error("[%s] background save of %s failed: %r", self.name, job.label, e)
            try:
                job.abort()
            except BaseException:
                logger.exception("[%s] cleaning up after the failed save of %s",
                                 self.name, job.label)
            if not released:
                self._pool.release(w.slot)
            e.add_note(f"asyncckpt: raised by the background save of {job.label!r}")
            with self._cond:
                self._errors.append(e)
            w.handle.committed.set_exception(e)
        finally:
            with self._cond:
                self._busy_since = None
                self._inflight -= 1
                self._cond.notify_all()

    # -- waiting and errors -------------------------------------------------

    def raise_pending_error(self) -> None:
        """Re-raises the first background failure not yet reported, if any."""
        with self._cond:
            if not self._errors:
                return
            first, later = self._errors[0], self._errors[1:]
            self._errors.clear()
        if later:
            first.add_note(
                f"asyncckpt: {len(later)} later background save(s) failed too: "
                + "; ".join(repr(e) for e in later)
            )
        raise first

    def _wait_idle(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout)

    def sync(self, timeout: float | None = None) -> None:
        """Waits until every staged save is durable.

        Raises:
            TimeoutError: Saves are still in flight after ``timeout`` seconds.
            Exception: A background failure not yet reported.
        """
        if not self._wait_idle(timeout):
            raise TimeoutError(
                f"{self.name}: {self.pending} save(s) still in flight after {timeout} s"
            )
        self.raise_pending_error()

    def close(self, timeout: float | None = None) -> None:
        """Flushes in-flight saves, stops the writer and frees host buffers.

        Raises:
            TimeoutError: Saves did not finish within ``timeout`` seconds (the
                engine stays open so the caller can retry).
            Exception: A background failure not yet reported.
        """
        if self._closed:
            return
        if not self._wait_idle(timeout):
            raise TimeoutError(
                f"{self.name}: {self.pending} save(s) still in flight after {timeout} s"
            )
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._pool.close()
        _ENGINES.discard(self)
        self.raise_pending_error()

    def _flush_for_exit(self) -> None:
        n = self.pending
        if self._closed or n == 0:
            return
        timeout = self.options.exit_timeout_s
        logger.warning(
            "[%s] interpreter exiting: waiting up to %.0f s for %d in-flight checkpoint save(s) "
            "to become durable",
            self.name,
            timeout,
            n,
        )
        start = time.perf_counter()
        if self._wait_idle(timeout):
            logger.warning(
                "[%s] in-flight checkpoint save(s) durable after %.2f s; exiting",
                self.name,
                time.perf_counter() - start,
            )
        else:
            logger.error(
                "[%s] gave up after %.0f s with %d save(s) still in flight; they are not "
                "committed and will not be listed as checkpoints",
                self.name,
                timeout,
                self.pending,
            )

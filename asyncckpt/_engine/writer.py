"""Write stage: the background writer and the per-save handles.

``AsyncEngine.save`` runs on the caller's thread only for as long as it takes
to copy the state into a free staging slot; a single background thread then
writes, commits and releases each save in order. Framework adapters supply the
format-specific parts as a ``SaveJob`` (``_engine/_jobs.py``); the engine owns
threading, ordering, timings and error delivery. While a save copies, the
writer and spare builds pause between pieces (``engine/_gate.py``). The flush
at exit and ``fork()`` are handled in ``engine/_process.py``.

Errors contract (see ``AsyncEngine``): a background failure is raised to every
thread waiting in ``wait_until_finished()``/``close()`` when it happens, and to every later
call on any thread until it has been raised on the engine's *owner* thread,
the thread that last called ``save()``.

Lifecycle: while idle the writer thread holds only the queue, never the
engine, so an engine (and its staging memory) that its owner drops is freed;
saves already queued hold the engine until they are durable, then a
``weakref.finalize`` posts the stop sentinel and the thread exits.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace

from asyncckpt import _deprecation
from asyncckpt._closing import ClosingContext
from asyncckpt._engine import _process
from asyncckpt._engine._gate import SaveGate
from asyncckpt._engine._jobs import SaveJob, StageFn
from asyncckpt._engine.budget import staging_budget
from asyncckpt._engine.metrics import (
    AFTER_COMMIT,
    COPY,
    QUEUE,
    SLOT_WAIT,
    Phases,
    SaveStats,
    WriteTimeEstimator,
)
from asyncckpt._engine.slots import Slot, StagingPool
from asyncckpt._threads import lower_thread_priority
from asyncckpt.errors import EngineClosedError
from asyncckpt.options import AsyncOptions

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "SaveHandle"]


class SaveHandle:
    """The result of one asynchronous save.

    Attributes:
        label: Checkpoint name (a path or a step).
        step: Training step, when known.
        staged: Done once the state has been snapshotted (copied to host
            memory, or, for TensorFlow's background copy, read as immutable
            tensors); from then on the training state may be mutated. (``save()`` returns only
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



@dataclass(eq=False)
class _Work:
    engine: AsyncEngine  # keeps a dropped engine alive until this save is durable
    job: SaveJob
    slot: Slot
    handle: SaveHandle
    t0: float
    started_at: float
    blocking_s: float
    slot_wait_s: float


def _writer_loop(work_queue: queue.SimpleQueue, nice: int) -> None:
    """The writer thread: holds the queue, and an engine only while it has work."""
    lower_thread_priority(nice)
    while True:
        work = work_queue.get()
        if work is None:
            return
        engine = work.engine
        # After the first save, here rather than on the saving thread (starting
        # a thread waits for it to run): one spare slot, see AsyncOptions.early_spare.
        engine._pool.start_early_spare()
        error = engine._process(work)
        if error is not None:
            # The traceback's frames (finished now) would keep the job, its
            # slot and its owner alive for as long as the error is stored.
            _clear_frames(error)
        del work, engine, error


def _clear_frames(error: BaseException) -> None:
    """Drops the local variables of an error's frames (and of its causes')."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


class AsyncEngine(ClosingContext):
    """Stages saves into host slots and writes them on a background thread.

    Errors: a background failure is raised by every ``wait_until_finished()``/``close()``
    waiting when it happens, and by every later ``save()``, ``wait_until_finished()``,
    ``close()`` or ``raise_pending_error()`` on any thread, until it has been
    raised on the *owner* thread: the thread that last called ``save()`` (the
    training loop; before any save, the thread that made the engine). Once
    the owner has seen it, it is cleared and the engine keeps working. A
    ``save()`` raises every failure that had happened when it was called or
    while it waited for a free slot; a failure that happens after that (while
    it copies, or later) is raced and reported by the next call.

    At interpreter exit, in-flight saves are given ``options.exit_timeout_s``
    seconds to become durable. An engine dropped without ``close()`` still
    completes its queued saves; then its thread exits and its memory is freed.

    Args:
        options: Staging and durability options.
        name: Name used in log lines and the writer thread's name.
    """

    def __init__(self, *, options: AsyncOptions | None = None, name: str = "asyncckpt"):
        self.options = options or AsyncOptions()
        self.name = name
        # Closed while a save copies into its slot; the writer and spare builds
        # pause on it between pieces (AsyncOptions.yield_to_saves).
        self._gate = SaveGate(max_wait_s=self.options.yield_max_wait_s,
                              enabled=self.options.yield_to_saves)
        self._pool = StagingPool(
            self.options.num_slots,
            max_slots=self.options.slot_cap,
            prepare_nice=self.options.writer_nice,
            early_spare=self.options.early_spare,
            pause=self._gate.wait if self._gate.enabled else None,
            budget=functools.partial(staging_budget, self.options.host_memory_limit,
                                     self.options.host_memory_fraction),
        )
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._inflight = 0  # queued for the writer, not yet committed or failed
        self._staging = 0  # save() calls between their open check and their enqueue
        self._closed = False
        self._forked = False
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None
        # Errors: (sequence number, error), oldest first. The owner thread
        # has seen every error numbered below _owner_seen; _waiters holds the
        # error count at the start of each wait_until_finished()/close() still waiting.
        self._errors: list[tuple[int, BaseException]] = []
        self._error_count = 0
        self._owner_seen = 0
        self._owner = threading.get_ident()
        self._waiters: list[int] = []
        self._post_commit_errors = 0
        self._estimator = WriteTimeEstimator()
        self._busy_since: float | None = None
        self._history: deque[SaveStats] = deque(maxlen=256)
        _process.register(self)

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
    def estimated_write_s(self) -> float | None:
        """Smoothed background seconds (write + commit) of recent saves."""
        return self._estimator.seconds

    estimated_write_seconds = _deprecation.renamed_property(
        "estimated_write_s", "estimated_write_seconds", "AsyncEngine")

    @property
    def writer_thread_id(self) -> int | None:
        """The writer thread's native id (None before the first save), e.g. to set its priority."""
        thread = self._thread
        return None if thread is None else thread.native_id

    @property
    def busy_for(self) -> float | None:
        """Seconds the writer has spent on the save it is writing now; None when idle.

        With ``pending`` and ``estimator`` it tells how long the saves in
        flight still need (the preemption handler's grace margin).
        """
        with self._cond:
            since = self._busy_since
        return None if since is None else time.perf_counter() - since

    def prepare_staging(self, layout: Mapping[str, int]) -> None:
        """Builds staging buffers of ``layout`` (key to byte size) in the background.

        What the first save of that layout would otherwise allocate and
        fault in on the saving thread; see ``StagingPool.prepare``.

        Raises:
            EngineClosedError: The engine is closed (or inherited through fork()).
        """
        self._check_open()
        self._pool.prepare(layout, background=True)

    def make_room_for_restore(self) -> int:
        """Frees idle staging memory a restore of the staged state would push over the budget.

        A restore allocates about one state for the values it reads; with
        staging slots held beside it, that could exceed
        ``AsyncOptions.host_memory_limit``. Idle slots give their buffers up
        (the next save allocates them again); slots being written keep theirs.
        The front ends call it before they restore. Returns the bytes freed.
        """
        return self._pool.make_room(self._pool.layout_nbytes)

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging slots."""
        return self._pool.nbytes

    @property
    def post_commit_errors(self) -> int:
        """Errors raised after a checkpoint was published (state file, retention,
        callbacks): logged and counted here, never a failed save."""
        with self._cond:
            return self._post_commit_errors

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
        raise_pending: bool = True,
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
            raise_pending: Raise earlier failures before staging (the default).
                False stages regardless and leaves them to the caller's next
                ``raise_pending_error()`` (a multi-process save, which every
                process must take part in).

        Returns:
            A handle whose ``committed`` future resolves when the checkpoint is
            durable.

        Raises:
            EngineClosedError: after ``close()``, or in a ``fork()`` child.
            Exception: A background failure that happened before this call
                or while it waited for a slot (nothing is saved then).
        """
        with self._cond:
            self._check_open()
            self._owner = threading.get_ident()
            self._staging += 1
        try:
            # _deliver only when there is something to raise: with no failure
            # stored it changes nothing (it is a lock and a scan on a save's clock).
            if raise_pending and self._errors:
                self._deliver(None)
            t0 = time.perf_counter()
            started_at = time.time()
            slot, slot_wait_s = self._pool.acquire(timeout=slot_timeout)
            job = None
            try:
                # Background work pauses while this save copies; not while it
                # waited for a slot above, which the writer had to free.
                with self._gate:
                    # With every slot busy, this call waited for the writer: a save
                    # that failed meanwhile has happened before this one starts.
                    if raise_pending and self._errors:
                        self._deliver(None)
                    job = stage(slot)
                    slot.trim()
                    # The first save (or a new layout) teaches the pool the state's
                    # buffers; the other slots are then built in the background.
                    self._pool.learn(slot)
            except BaseException:
                if job is not None:
                    job.discard()  # no background work on the slot once it is free
                self._pool.release(slot)
                raise
            blocking_s = time.perf_counter() - t0
            handle = SaveHandle(label, step)
            handle.staged.set_result(None)
            work = _Work(self, job, slot, handle, t0, started_at, blocking_s, slot_wait_s)
            with self._cond:
                # Under the lock that close() takes to post its sentinel, so the
                # sentinel can never overtake this save, and only one writer starts.
                self._inflight += 1
                self._ensure_thread()
                self._queue.put(work)
            del work
            job.start_background()
        finally:
            with self._cond:
                self._staging -= 1
                self._cond.notify_all()
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
        if self._forked:
            raise EngineClosedError(
                f"{self.name}: this engine was inherited through fork(); its saves belong "
                "to the parent process. Create a new one in the child."
            )
        if self._closed:
            raise EngineClosedError(f"{self.name}: cannot save after close()")

    def _ensure_thread(self) -> None:
        """Starts the writer; called with ``_cond`` held."""
        if self._thread is not None:
            return
        # Daemon, so a forgotten close() never hangs interpreter exit; the
        # exit watcher gives in-flight saves a bounded time to finish instead.
        # The thread gets the queue, not the engine (see _writer_loop).
        self._thread = threading.Thread(
            target=_writer_loop,
            args=(self._queue, self.options.writer_nice),
            name=f"{self.name}-writer",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._queue.put, None)
        self._finalizer.atexit = False
        _process.ensure_exit_watcher()

    def _process(self, w: _Work) -> BaseException | None:
        """Writes, commits and settles one save; returns its error, if any."""
        job = w.job
        released = False
        error: BaseException | None = None
        try:
            t1 = time.perf_counter()
            with self._cond:
                self._busy_since = t1
            if self._gate.enabled:  # else: written as before, without pauses
                job.set_pause(self._gate.wait)
            self._gate.wait()  # a save copying now: its Python needs the GIL too
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
            self._gate.wait()
            t2 = time.perf_counter()
            job.commit(stats)
        except BaseException as e:
            error = e
            self._fail(w, e, released=released)
        else:
            # Published: from here on nothing can turn this save into a failure.
            now = time.perf_counter()
            stats = replace(stats, commit_s=now - t2, durable_s=now - w.t0)
            stats = self._after_commit(job, stats)
            stats = replace(stats, phases=self._phases(w, t1, now))
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
        finally:
            with self._cond:
                self._busy_since = None
                self._inflight -= 1
                self._cond.notify_all()
        return error

    @staticmethod
    def _phases(w: _Work, t1: float, committed: float) -> dict:
        """The save's phases (``SaveStats.phases``): its transaction's, and the engine's own."""
        txn = w.job.transaction
        phases = Phases()
        if w.slot_wait_s:
            phases.add(SLOT_WAIT, w.slot_wait_s)
        phases.add(COPY, w.blocking_s - w.slot_wait_s)
        phases.add(QUEUE, max(0.0, t1 - w.t0 - w.blocking_s))
        if txn is not None:
            phases.merge(txn.phases)
        phases.add(AFTER_COMMIT, time.perf_counter() - committed)
        return phases.to_dict()

    def _after_commit(self, job: SaveJob, stats: SaveStats) -> SaveStats:
        try:
            job.after_commit(stats)
        except Exception as e:
            with self._cond:
                self._post_commit_errors += 1
            logger.error(
                "[%s] %s is committed, but the work after the commit failed (it is retried "
                "by the next save where the front end supports it): %r",
                self.name, job.label, e, exc_info=e,
            )
            _clear_frames(e)
            return replace(stats, post_commit_error=repr(e))
        return stats

    def _fail(self, w: _Work, e: BaseException, *, released: bool) -> None:
        job = w.job
        logger.error("[%s] background save of %s failed: %r", self.name, job.label, e)
        try:
            job.abort()
        except BaseException:
            logger.exception("[%s] cleaning up after the failed save of %s",
                             self.name, job.label)
        e.add_note(f"asyncckpt: raised by the background save of {job.label!r}")
        # Recorded before the slot is released, so a save() waiting for the
        # slot sees this failure.
        with self._cond:
            self._errors.append((self._error_count, e))
            self._error_count += 1
            self._cond.notify_all()
        if not released:
            self._pool.release(w.slot)
        w.handle.committed.set_exception(e)

    # -- waiting and errors -------------------------------------------------

    def _deliver(self, since: int | None) -> None:
        """Raises the failures this call must see (see the class docstring).

        Args:
            since: Error count when a waiting call started (it sees every
                failure from then on), or None for a call that does not wait.
        """
        with self._cond:
            if since is not None:
                self._waiters.remove(since)
            start = self._owner_seen if since is None else min(self._owner_seen, since)
            due = [e for n, e in self._errors if n >= start]
            if threading.get_ident() == self._owner:
                self._owner_seen = self._error_count
            keep_from = min([self._owner_seen, *self._waiters])
            self._errors = [(n, e) for n, e in self._errors if n >= keep_from]
        if not due:
            return
        first, later = due[0], due[1:]
        if later:
            note = (f"asyncckpt: {len(later)} later background save(s) failed too: "
                    + "; ".join(repr(e) for e in later))
            if note not in getattr(first, "__notes__", ()):
                first.add_note(note)
        raise first

    def raise_pending_error(self) -> None:
        """Re-raises the first background failure not yet seen by the owner, if any."""
        self._deliver(None)

    @property
    def has_stored_error(self) -> bool:
        """Whether a background failure is kept for delivery (read without the lock).

        A cheap test before ``raise_pending_error`` on a hot path, as ``save()``
        makes it itself; False means there is nothing to raise.
        """
        return bool(self._errors)

    def _start_wait(self) -> int:
        with self._cond:
            since = self._error_count
            self._waiters.append(since)
            return since

    def _wait_idle(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout)

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Waits until every staged save is durable.

        Raises:
            TimeoutError: Saves are still in flight after ``timeout`` seconds.
            Exception: A background failure (see the errors contract above).
        """
        since = self._start_wait()
        if not self._wait_idle(timeout):
            self._deliver(since)
            raise TimeoutError(
                f"{self.name}: {self.pending} save(s) still in flight after {timeout} s"
            )
        self._deliver(since)

    sync = _deprecation.renamed_method("wait_until_finished", "sync", "AsyncEngine")

    def close(self, timeout: float | None = None) -> None:
        """Flushes in-flight saves, stops the writer and frees host buffers.

        Safe to call from several threads and more than once; a ``save()``
        racing it either is written before the writer stops or raises
        ``EngineClosedError``.

        Raises:
            TimeoutError: Saves did not finish within ``timeout`` seconds (the
                engine stays open so the caller can retry).
            Exception: A background failure (see the errors contract above).
        """
        since = self._start_wait()
        with self._cond:
            first = not self._closed
            if first and not self._cond.wait_for(
                lambda: self._inflight == 0 and self._staging == 0, timeout=timeout
            ):
                pending = self._inflight
                self._waiters.remove(since)
                raise TimeoutError(
                    f"{self.name}: {pending} save(s) still in flight after {timeout} s"
                )
            self._closed = True
            thread, self._thread = self._thread, None
            if first and thread is not None:
                self._queue.put(None)
        if first:
            if thread is not None and thread is not threading.current_thread():
                thread.join()
            if self._finalizer is not None:
                self._finalizer.detach()
            self._pool.close()
            _process.unregister(self)
        self._deliver(since)

    # -- process lifecycle (called by engine/_process.py) ---------------------------

    def flush_at_exit(self) -> None:
        """The interpreter is exiting: waits (bounded by ``exit_timeout_s``) for saves in flight."""
        n = self.pending
        if self.closed or self._forked or n == 0:
            return
        timeout = self.options.exit_timeout_s
        logger.warning(
            "[%s] interpreter exiting: waiting up to %.0f s for %d in-flight checkpoint save(s) "
            "to become durable", self.name, timeout, n,
        )
        start = time.perf_counter()
        if self._wait_idle(timeout):
            logger.warning("[%s] in-flight checkpoint save(s) durable after %.2f s; exiting",
                           self.name, time.perf_counter() - start)
        else:
            logger.error(
                "[%s] gave up after %.0f s with %d save(s) still in flight; they are not "
                "committed and will not be listed as checkpoints",
                self.name, timeout, self.pending,
            )

    def mark_forked(self) -> None:
        """In a fork() child: this engine's saves and thread belong to the parent."""
        # The parent's writer may have held the lock at the fork: replace it.
        self._cond = threading.Condition()
        self._forked = True
        self._closed = True
        self._inflight = 0
        self._staging = 0
        self._thread = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._queue = queue.SimpleQueue()  # the parent's queued saves are not ours


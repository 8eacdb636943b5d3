"""``JobRunner``: init, then epochs, each checkpointed asynchronously; resume and upload.

The shape is Caffe2's epoch job runner: ``init`` once, then ``epoch(n)`` for
n = 1, 2, ... until it asks to stop or ``num_epochs`` is reached; checkpoint
*n* holds the state after epoch *n* (0: after ``init``). It is framework
neutral: the caller gives a function returning the state as ``{name:
array-like}`` (TensorFlow variables, JAX arrays, NumPy arrays) and one that
loads a ``{name: np.ndarray}`` back. Checkpoints go through an
``ArrayStore`` (host snapshot, background write, one atomic commit each).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncckpt._engine import retention
from asyncckpt._engine.metrics import SaveStats
from asyncckpt.errors import AsyncCkptError
from asyncckpt.jobrunner.store import ArrayStore, Restored, dropped_by_retention
from asyncckpt.options import AsyncOptions

logger = logging.getLogger(__name__)


class UploadError(AsyncCkptError):
    """The upload hook failed on every attempt for an epoch."""


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """How a ``JobRunner`` runs.

    Attributes:
        num_epochs: Last epoch to run (epochs are numbered from 1).
        resume_from_epoch: Resume from this epoch's checkpoint (it must
            exist); None resumes from the newest one that verifies, or starts
            fresh when there is none.
        save_initial: Save checkpoint 0 right after ``init`` on a fresh start.
        load_include: On resume, load only arrays whose names match one of
            these globs (None: all). Only their bytes are read.
        load_exclude: On resume, do not load arrays matching these globs.
        max_to_keep: Checkpoints kept (None keeps all); a checkpoint is never
            deleted before its upload finished.
        stats_path: File to append one JSON line per save, restore and upload.
        upload_attempts: Tries of the upload hook per epoch before it fails.
        upload_backoff_s: Wait before the first retry; doubles on each retry.
        async_options: The engine's staging slots, fsync and checksums.
    """

    num_epochs: int
    resume_from_epoch: int | None = None
    save_initial: bool = False
    load_include: tuple[str, ...] | None = None
    load_exclude: tuple[str, ...] = ()
    max_to_keep: int | None = None
    stats_path: str | None = None
    upload_attempts: int = 3
    upload_backoff_s: float = 1.0
    async_options: AsyncOptions | None = None

    def __post_init__(self) -> None:
        if self.num_epochs < 0:
            raise ValueError(f"num_epochs must be >= 0, got {self.num_epochs}")
        if self.upload_attempts < 1:
            raise ValueError(f"upload_attempts must be >= 1, got {self.upload_attempts}")
        retention.check_max_to_keep(self.max_to_keep, allow_zero=False)


@dataclass(frozen=True)
class EpochStats:
    """What checkpointing one epoch cost.

    Attributes:
        epoch: The epoch (0: after ``init``).
        epoch_s: Seconds the epoch function ran.
        blocking_s: Seconds training waited for the save (the host copy).
        durable_s: Seconds from the save call until the checkpoint was committed.
        nbytes: Bytes saved.
        mb_per_s: Background write throughput (MB = 10**6 bytes).
    """

    epoch: int
    epoch_s: float
    blocking_s: float
    durable_s: float
    nbytes: int
    mb_per_s: float


class JobRunner:
    """Runs ``init`` and then epochs, checkpointing after each.

    Example (any framework; here JAX)::

        params = None
        def init():
            nonlocal params
            params = make_params()
        def state():
            return {"w": params["w"], "b": params["b"]}
        def load(arrays):
            nonlocal params
            params = {k: jnp.asarray(v) for k, v in arrays.items()}
        def epoch(n):
            nonlocal params
            params = train_one_epoch(params, n)

        runner = JobRunner("/ckpt", init=init, epoch=epoch, state=state, load=load,
                           options=JobOptions(num_epochs=10, stats_path="/ckpt/stats.jsonl"))
        last = runner.run()

    Args:
        directory: Checkpoint directory (an ``ArrayStore``).
        init: Builds the state; always runs first, also before a resume
            (whose ``load`` then overwrites it).
        epoch: Runs epoch ``n``; returning True stops after this epoch.
        state: Returns the state to save as ``{name: array-like}``.
        load: Loads ``{name: np.ndarray}`` (the selected parts on resume).
        upload: Called in the background as ``upload(epoch, checkpoint_dir)``
            after each checkpoint is committed; retried, and its final
            failure is raised at the next epoch boundary and by ``run``.
        options: See ``JobOptions``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        init: Callable[[], None],
        epoch: Callable[[int], bool | None],
        state: Callable[[], Mapping[str, Any]],
        load: Callable[[dict[str, np.ndarray]], None],
        upload: Callable[[int, str], None] | None = None,
        options: JobOptions,
    ):
        self.options = options
        self._init, self._epoch, self._state, self._load = init, epoch, state, load
        self._upload = upload
        self.store = ArrayStore(
            directory,
            max_to_keep=None,  # retention is applied here, after uploads
            options=options.async_options,
            name="asyncckpt.jobrunner",
            on_commit=self._on_commit,
        )
        self._lock = threading.Lock()
        self._epoch_s: dict[int, float] = {}
        self._uploading: set[int] = set()
        self._upload_errors: list[BaseException] = []
        self._uploads: list[Future] = []
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-upload") if upload else None
        )
        self.stats: list[EpochStats] = []
        self.restored: Restored | None = None

    # -- running ------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job to the end; returns the last epoch run (or resumed at).

        Raises:
            CheckpointNotFoundError: ``resume_from_epoch`` has no checkpoint.
            UploadError: an upload failed on every attempt.
        """
        opts = self.options
        try:
            self._init()
            start = self._maybe_resume()
            if start == 1 and self.restored is None and opts.save_initial:
                self._save(0, 0.0)
            last = start - 1
            for n in range(start, opts.num_epochs + 1):
                t0 = time.perf_counter()
                stop = self._epoch(n)
                self._save(n, time.perf_counter() - t0)
                last = n
                if stop:
                    logger.info("epoch %d asked to stop", n)
                    break
            self.store.wait_until_finished()
            self._wait_uploads()
            return last
        finally:
            self.close()

    def _maybe_resume(self) -> int:
        opts = self.options
        if opts.resume_from_epoch is None and self.store.latest_step() is None:
            return 1
        r = self.store.restore(
            opts.resume_from_epoch, include=opts.load_include, exclude=opts.load_exclude
        )
        self._load(r.arrays)
        self.restored = r
        newer = [s for s in self.store.all_steps() if s > r.step]
        if newer:
            # Resuming from an older epoch starts a new timeline: the newer
            # checkpoints would otherwise be taken for its future.
            logger.warning("resuming from epoch %d: deleting the newer checkpoints %s",
                           r.step, newer)
            for s in newer:
                self.store.delete(s)
        self._record({
            "event": "restore", "epoch": r.step, "restore_s": r.restore_s,
            "bytes": r.bytes_read, "arrays": len(r.arrays),
            "mb_per_s": r.bytes_read / r.restore_s / 1e6 if r.restore_s > 0 else None,
        })
        logger.info("resumed from epoch %d (%d arrays, %.1f MB in %.3f s)",
                    r.step, len(r.arrays), r.bytes_read / 1e6, r.restore_s)
        return r.step + 1

    def _save(self, n: int, epoch_s: float) -> None:
        self._raise_upload_error()
        with self._lock:
            self._epoch_s[n] = epoch_s
        self.store.save(n, self._state(), {"epoch": n})

    def _on_commit(self, n: int, stats: SaveStats) -> None:
        """Writer thread: record the stats, start the upload, apply retention."""
        with self._lock:
            epoch_s = self._epoch_s.pop(n, 0.0)
        es = EpochStats(
            epoch=n,
            epoch_s=epoch_s,
            blocking_s=stats.blocking_s,
            durable_s=stats.durable_s,
            nbytes=stats.nbytes,
            mb_per_s=stats.throughput_bytes_per_s / 1e6,
        )
        self.stats.append(es)
        self._record({"event": "save", **es.__dict__, "write_s": stats.write_s,
                      "commit_s": stats.commit_s})
        if self._pool is not None:
            with self._lock:
                self._uploading.add(n)
            self._uploads.append(self._pool.submit(self._upload_with_retries, n))
        else:
            self._retain()

    def _upload_with_retries(self, n: int) -> None:
        opts = self.options
        path = self.store.step_dir(n)
        wait = opts.upload_backoff_s
        t0 = time.perf_counter()
        error: BaseException | None = None
        attempt = 0
        try:
            for attempt in range(1, opts.upload_attempts + 1):
                try:
                    assert self._upload is not None
                    self._upload(n, path)
                    error = None
                    break
                except Exception as e:
                    error = e
                    logger.warning("upload of epoch %d failed (attempt %d of %d): %r",
                                   n, attempt, opts.upload_attempts, e)
                    if attempt < opts.upload_attempts:
                        time.sleep(wait)  # back-off between retries, not synchronisation
                        wait *= 2
            self._record({"event": "upload", "epoch": n, "attempts": attempt,
                          "ok": error is None, "upload_s": time.perf_counter() - t0,
                          "error": None if error is None else repr(error)})
            if error is not None:
                failure = UploadError(
                    f"upload of epoch {n} ({path}) failed after {attempt} attempt(s): {error!r}"
                )
                failure.__cause__ = error
                with self._lock:
                    self._upload_errors.append(failure)
        finally:
            with self._lock:
                self._uploading.discard(n)
            self._retain()

    def _retain(self) -> None:
        """Deletes what retention drops, but checkpoints still being uploaded."""
        with self._lock:
            busy = set(self._uploading)
        for s in dropped_by_retention(self.store.all_steps(), self.options.max_to_keep):
            if s not in busy:
                self.store.delete(s)

    def _raise_upload_error(self) -> None:
        with self._lock:
            if not self._upload_errors:
                return
            first = self._upload_errors[0]
            self._upload_errors.clear()
        raise first

    def _wait_uploads(self) -> None:
        for f in list(self._uploads):
            f.result()
        self._raise_upload_error()

    def close(self) -> None:
        """Flushes saves and uploads in flight and releases the directory."""
        try:
            self.store.close()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    # -- reading and reporting -------------------------------------------------------------

    def load_parts(
        self,
        epoch: int | None = None,
        *,
        include: tuple[str, ...] | None = None,
        exclude: tuple[str, ...] = (),
    ) -> Restored:
        """Reads only the selected arrays of a checkpoint (e.g. weights for evaluation)."""
        return self.store.restore(epoch, include=include, exclude=exclude)

    def _record(self, row: dict) -> None:
        path = self.options.stats_path
        if path is None:
            return
        line = json.dumps({"time": time.time(), **row}) + "\n"
        with self._lock, open(path, "a", encoding="utf-8") as f:
            f.write(line)

    def table(self) -> str:
        """A short text table of the per-epoch stats."""
        rows = ["epoch  epoch_s  blocking_ms  durable_ms        MB     MB/s"]
        for s in sorted(self.stats, key=lambda s: s.epoch):
            rows.append(f"{s.epoch:5d} {s.epoch_s:8.3f} {s.blocking_s * 1e3:12.2f} "
                        f"{s.durable_s * 1e3:11.1f} {s.nbytes / 1e6:9.2f} {s.mb_per_s:8.1f}")
        if self.restored is not None:
            r = self.restored
            rows.append(f"restored epoch {r.step}: {r.bytes_read / 1e6:.2f} MB in "
                        f"{r.restore_s * 1e3:.1f} ms")
        return "\n".join(rows)

"""``asyncckpt.jax.CheckpointManager``: orbax-style step checkpoints, saved asynchronously."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncckpt import catalog, layout
from asyncckpt._closing import ClosingContext
from asyncckpt.engine import commit as commit_lib
from asyncckpt.engine import retention
from asyncckpt.engine.lock import DirectoryLock
from asyncckpt.engine.manifest import read_manifest
from asyncckpt.engine.metrics import SaveStats
from asyncckpt.engine.writer import AsyncEngine, SaveHandle
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, EngineClosedError
from asyncckpt.jax import _format as fmt
from asyncckpt.jax._distributed import Coordinator
from asyncckpt.jax._job import JaxSaveJob
from asyncckpt.jax._restore import restore_tree
from asyncckpt.jax._snapshot import Snapshotter
from asyncckpt.options import AsyncOptions, RestoreOptions
from asyncckpt.storage.tier import RemoteOptions, TieredDirectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMetadata:
    """What a checkpoint records besides its arrays.

    Attributes:
        step: The step.
        custom_metadata: The ``custom_metadata`` given to ``save`` ({} if none).
        metrics: The ``metrics`` given to ``save``, or None.
        stats: The save's timings (``SaveStats.to_dict``), if asyncckpt wrote it.
        created: When it was committed (``time.time()``), if known.
    """

    step: int
    custom_metadata: dict = field(default_factory=dict)
    metrics: dict | None = None
    stats: dict = field(default_factory=dict)
    created: float | None = None


def _json_checked(value: Any, what: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serializable: {e}") from e


class CheckpointManager(ClosingContext):
    """Numbered asynchronous checkpoints of a pytree, in a layout orbax restores.

    ``save(step, state)`` returns once the state is copied to host memory; a
    background thread writes ``<directory>/<step>/`` in orbax's zarr layout,
    checksums and fsyncs it, and publishes it with one rename, so a listed
    step is always complete. Two saves can be in flight at once (one per
    staging slot). Checkpoints restore with this manager (verified against
    their manifest, onto any sharding) or with
    ``orbax.checkpoint.CheckpointManager(directory).restore(step,
    args=orbax.checkpoint.args.StandardRestore(target))``.

    With several JAX processes, every process calls ``save`` with the same
    step; each writes only its own shards and process 0 commits once all are
    done (see ``docs/jax.md``).

    Example::

        with asyncckpt.jax.CheckpointManager("/ckpts", max_to_keep=3) as mgr:
            for step in range(steps):
                state = train_step(state)
                mgr.save(step, state)          # blocks only for the host copy
            restored = mgr.restore(target=abstract_state)

    Args:
        directory: Where step directories are written.
        max_to_keep: Checkpoints to keep (None keeps all). With ``best_fn``,
            the best ones by metric; the newest is never deleted.
        save_interval_steps: ``should_save`` is true on multiples of this.
        keep_period: Steps divisible by this are kept forever.
        best_fn: Maps the ``metrics`` of a save to the number ranked by
            ``best_mode``.
        best_mode: ``"max"`` or ``"min"``.
        keep_checkpoints_without_metrics: With ``best_fn``, keep checkpoints
            saved without metrics instead of deleting them.
        async_options: Staging slots, fsync, checksums.
        restore_options: Verification on restore.
        coordination_timeout_s: Multi-process: longest wait for another
            process during a save.
        remote: A persistent second tier (``s3://`` / ``gs://`` URL or a
            path) for a local ``directory``: saves commit locally and every
            ``remote_options.every_n_steps`` are uploaded in the background.
        remote_options: Schedule, retention and retries of the remote tier
            (default: every step, ``max_to_keep`` as above).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        keep_period: int | None = None,
        best_fn: Callable[[dict], float] | None = None,
        best_mode: Literal["max", "min"] = "max",
        keep_checkpoints_without_metrics: bool = True,
        async_options: AsyncOptions | None = None,
        restore_options: RestoreOptions | None = None,
        coordination_timeout_s: float = 1800.0,
        remote: str | None = None,
        remote_options: RemoteOptions | None = None,
    ):
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be a positive int, got "
                             f"{save_interval_steps!r}")
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        # [storage] URL check; a URL directory stages in a local scratch directory.
        self._tiers = TieredDirectory(
            directory, remote=remote,
            remote_options=remote_options or RemoteOptions(max_to_keep=max_to_keep))
        self._directory = self._tiers.local_dir
        self._policy = retention.RetentionPolicy(
            max_to_keep=max_to_keep,
            keep_period=keep_period,
            best_mode=best_mode if best_fn is not None else None,
            keep_checkpoints_without_metrics=keep_checkpoints_without_metrics,
        )
        self._save_interval = save_interval_steps
        self._best_fn = best_fn
        self._options = async_options or AsyncOptions()
        self._restore_options = restore_options or RestoreOptions()
        self._coord = Coordinator.for_this_run(timeout_s=coordination_timeout_s)
        if self._coord is not None and self._tiers.remote is not None:  # [storage]
            self._tiers.close()
            raise NotImplementedError(
                f"multi-process saves to a remote tier ({self._tiers.remote.url}) are not "
                f"supported yet: each process would stage its shards in its own local scratch "
                f"directory, which process 0 cannot commit. Use a directory every process "
                f"shares (see docs/storage.md)")
        self._primary = self._coord is None or self._coord.primary
        name = "asyncckpt.jax" if self._coord is None else (
            f"asyncckpt.jax[p{self._coord.process_index}]"  # log lines name the process
        )
        self._engine = AsyncEngine(options=self._options, name=name)
        self._snapshotter = Snapshotter(primary=self._primary)
        self._dir_lock = DirectoryLock(self._directory)
        self._token: str | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        self._last_requested: int | None = None
        self._last_save: SaveHandle | None = None
        self._managed: dict[int, retention.Candidate] = {}
        self._recover()

    # -- state recovered from the directory ---------------------------------

    def _recover(self) -> None:
        for step in self.all_steps():
            self._managed[step] = self._candidate_from_disk(step)
        if self._managed:
            self._last_requested = max(self._managed)

    def _candidate_from_disk(self, step: int) -> retention.Candidate:
        meta = self._read_metadata(step)
        try:
            metric = self._metric(meta.metrics)
        except Exception as e:  # metrics of an older run that best_fn does not expect
            logger.warning("best_fn failed on the metrics of step %d (%r): ranking it as a "
                           "checkpoint without metrics", step, e)
            metric = None
        return retention.Candidate(
            key=str(step),
            step=step,
            timestamp=meta.created if meta.created is not None else 0.0,
            metric=metric,
        )

    def _metric(self, metrics: dict | None) -> float | None:
        if self._best_fn is None or not metrics:
            return None
        return float(self._best_fn(metrics))

    # -- properties -----------------------------------------------------------

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def engine(self) -> AsyncEngine:
        """The background engine: stats, history, ``estimated_write_seconds``."""
        return self._engine

    @property
    def last_save(self) -> SaveHandle | None:
        """Handle of the most recent save (``committed`` resolves when durable)."""
        return self._last_save

    # -- listing ----------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps in the directory, oldest first.

        Saves in flight are not listed until durable; temporaries of
        interrupted saves (asyncckpt's or orbax's) never are.
        """
        try:
            found = catalog.list_checkpoints(self._directory)
        except CheckpointNotFoundError:
            found = []
        steps = {c.step for c in found if c.framework == "jax" and c.step is not None}
        steps.update(int(n) for n in self._tiers.remote_names() if n.isdigit())  # [storage]
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save: a new step on the interval."""
        with self._lock:
            last = self._last_requested
        if last is not None and step <= last:
            return False
        return step % self._save_interval == 0

    def step_dir(self, step: int) -> str:
        """The directory of a step's checkpoint."""
        return os.path.join(self._directory, str(int(step)))

    def metadata(self, step: int | None = None) -> StepMetadata:
        """Custom metadata, metrics and save stats of a step (default: the newest).

        Raises:
            CheckpointNotFoundError: no such step.
        """
        return self._read_metadata(self._existing_step(step))

    def _read_metadata(self, step: int) -> StepMetadata:
        step_dir = self.step_dir(step)
        orbax_meta = fmt.read_step_metadata(step_dir)
        try:
            manifest = read_manifest(layout.jax_manifest_path(step_dir))
        except (FileNotFoundError, CorruptCheckpointError):
            manifest = None
        commit_ns = orbax_meta.get("commit_timestamp_nsecs")
        created = manifest.created if manifest else (commit_ns / 1e9 if commit_ns else None)
        if manifest is not None:
            custom = manifest.extra.get("custom_metadata") or {}
            metrics = manifest.extra.get("metrics")
        else:
            custom = orbax_meta.get("custom_metadata") or {}
            metrics = orbax_meta.get("metrics") or None
        return StepMetadata(
            step=step,
            custom_metadata=custom,
            metrics=metrics,
            stats=manifest.stats if manifest else {},
            created=created,
        )

    def _existing_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"no checkpoints in {self._directory!r}")
            return steps[-1]
        if int(step) not in steps:
            shown = ", ".join(map(str, steps[-20:])) or "none"
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {self._directory!r} (steps there: {shown})"
            )
        return int(step)

    # -- saving ---------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict | None = None,
        force: bool = False,
        custom_metadata: dict | None = None,
    ) -> bool:
        """Snapshots ``state`` and writes it as step ``step`` in the background.

        Returns after every value is copied to host memory, so ``state`` may
        be updated, donated or deleted at once.

        Args:
            step: The step number (the checkpoint's directory name).
            state: A pytree of ``jax.Array``s, NumPy arrays and scalars.
            metrics: JSON-serializable metrics, ranked by ``best_fn``.
            force: Save even if ``should_save(step)`` is false.
            custom_metadata: JSON-serializable data stored with the checkpoint
                (read back with ``metadata(step)``).

        Returns:
            Whether a save was started.

        Raises:
            ValueError: ``step`` is already saved or being saved.
            UnsupportedObjectError: a leaf cannot be saved (named in the message).
            Exception: a failure of an earlier background save.
        """
        if self._engine.closed:
            raise EngineClosedError(f"{self._directory}: cannot save after close()")
        self._engine.raise_pending_error()
        self._tiers.raise_pending_error()  # [storage] a failed upload surfaces here
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not force and not self.should_save(step):
            return False
        with self._lock:
            if step in self._in_flight or step in self._managed or os.path.lexists(
                self.step_dir(step)
            ):
                raise ValueError(
                    f"step {step} is already saved (or being saved) in {self._directory!r}"
                )
        metrics = _json_checked(metrics, "metrics")
        custom_metadata = _json_checked(custom_metadata, "custom_metadata")
        self._metric(metrics)  # a failing best_fn fails here, not in the background
        token = self._join()
        seq = self._seq
        save_key = self._coord.save_key(seq, step) if self._coord is not None else None

        def stage(slot):
            staged = self._snapshotter.stage(state, slot)
            return JaxSaveJob(
                directory=self._directory,
                step=step,
                staged=staged,
                options=self._options,
                temp_token=f"{token}-{seq}",
                coordinator=self._coord,
                save_key=save_key,
                metrics=metrics,
                custom_metadata=custom_metadata,
                on_committed=self._on_committed,
                # [storage] upload as part of the commit (URL dir: before durable)
                on_published=None if self._tiers.remote is None else self._tiers.after_step,
            )

        with self._lock:
            self._in_flight.add(step)
        try:
            handle = self._engine.save(stage, label=str(step), step=step)
        except BaseException as e:
            with self._lock:
                self._in_flight.discard(step)
            if self._coord is not None and save_key is not None:
                self._report_staging_failure(save_key, e)
            raise
        handle.committed.add_done_callback(lambda _f: self._settle(step))
        self._seq += 1
        with self._lock:
            self._last_requested = max(step, self._last_requested or step)
        self._last_save = handle
        return True

    def _join(self) -> str:
        """Before the first save: lock, clean up, agree on a token with the others."""
        if self._token is not None:
            return self._token

        def prepare() -> str:
            commit_lib.ensure_writable_dir(self._directory)
            self._dir_lock.acquire()
            # Holding the lock, nobody else writes here: temporaries are stale.
            commit_lib.cleanup_stale_temps(self._directory)
            return uuid.uuid4().hex[:12]

        if self._coord is None:
            self._token = prepare()
        else:
            self._token = self._coord.join(prepare)
        return self._token

    def _report_staging_failure(self, save_key: str, error: BaseException) -> None:
        """Multi-process: fail this save on the other processes too, instead of a timeout."""
        assert self._coord is not None
        try:
            if self._primary:
                self._coord.announce(save_key, error=error)
            else:
                self._coord.report_done(save_key, None, error=error)
        except Exception:
            logger.exception("could not tell the other processes that staging failed")
        self._seq += 1  # the others used this save's keys too

    def _settle(self, step: int) -> None:
        with self._lock:
            self._in_flight.discard(step)

    def _on_committed(self, step: int, stats: SaveStats, extra: dict) -> None:
        """Writer thread: record a durable step; the primary applies retention."""
        del stats
        if not self._primary:
            return
        with self._lock:
            self._managed[step] = retention.Candidate(
                key=str(step), step=step, timestamp=time.time(),
                metric=self._metric(extra.get("metrics")),
            )
            ordered = [self._managed[s] for s in sorted(self._managed)]
            decision = retention.apply(ordered, self._policy)
            for c in decision.delete + decision.preserve:
                self._managed.pop(int(c.key), None)
        for c in decision.delete:
            self._delete_step(int(c.key))

    def _delete_step(self, step: int) -> None:
        # Rename first, so a half-deleted directory is never listed as a step.
        path = self.step_dir(step)
        doomed = os.path.join(self._directory, f"{commit_lib.TEMP_PREFIX}deleted-{step}-"
                              f"{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        commit_lib.remove_tree(doomed)
        logger.debug("retention deleted step %d", step)

    # -- waiting --------------------------------------------------------------------

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Waits until every save is durable (and, multi-process, committed).

        Raises:
            Exception: a background failure not yet reported.
        """
        self._engine.sync(timeout)
        self._tiers.wait(timeout)  # [storage]

    def close(self, timeout: float | None = None) -> None:
        """Flushes saves in flight, frees the staging memory, releases the directory."""
        try:
            self._engine.close(timeout)
        finally:
            self._dir_lock.release()
            self._tiers.close(timeout)  # [storage]

    # -- restoring ------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None) -> Any:
        """Restores a step (default: the newest that verifies) into ``target``'s shape.

        Waits for saves in flight first. The files are checked against the
        manifest (sizes, and CRC32s unless ``RestoreOptions`` turns them off).
        Without ``step``, a checkpoint that fails the check is skipped with a
        warning naming it and the file at fault, and the next newer is tried.

        Args:
            step: The step to restore, or None for the newest valid one.
            target: A pytree like the saved one; each leaf says what to
                restore: ``jax.ShapeDtypeStruct`` with a sharding (any mesh or
                device count), ``jax.Array`` (onto its sharding), NumPy arrays,
                NumPy or Python scalars. None returns nested dicts/lists with
                arrays on the default device.

        Raises:
            CheckpointNotFoundError: no such step, or no checkpoint at all.
            CorruptCheckpointError: the step's files do not match the manifest
                (the file is named), or, for ``step=None``, none does.
            ValueError: ``target`` does not match the saved tree.
        """
        self.wait_until_finished()
        checksums = self._restore_options.verify_checksums
        if step is not None:
            chosen = self._existing_step(step)
            self._tiers.ensure_local(str(chosen), checksums=checksums)  # [storage]
            return restore_tree(self.step_dir(chosen), target, checksums=checksums)
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints in {self._directory!r}")
        failures = []
        for candidate in reversed(steps):
            try:
                self._tiers.ensure_local(str(candidate), checksums=checksums)  # [storage]
                return restore_tree(self.step_dir(candidate), target, checksums=checksums)
            except CorruptCheckpointError as e:
                # Every file is checked before anything is placed on a device,
                # and every process checks every file: all processes skip alike.
                logger.warning("skipping checkpoint step %d in %s: %s",
                               candidate, self._directory, e)
                failures.append(e)
        raise CorruptCheckpointError(
            f"none of the {len(steps)} checkpoint(s) in {self._directory!r} verifies; "
            f"newest failure: {failures[0]}",
            checkpoint=self._directory,
            file=failures[0].file,
        )

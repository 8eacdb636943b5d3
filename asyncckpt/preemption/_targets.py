"""What the handler saves through: a TensorFlow or a JAX checkpoint manager.

A target restores the newest checkpoint with the handler's bookkeeping
(``total_run_calls`` and the timing estimates), saves with it, and makes saves
durable. Each target imports its framework only when it is constructed, and
is chosen by the type of object the user passed, so the preemption package
itself imports neither framework.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.writer import AsyncEngine
from asyncckpt.preemption._estimates import decode_estimates, encode_estimates
from asyncckpt.storage.url import is_url

logger = logging.getLogger(__name__)

# Name of the handler's bookkeeping inside TF checkpoints and JAX metadata.
TRACKER_NAME = "_asyncckpt_preemption"
METADATA_KEY = "asyncckpt_preemption"
# Times of final saves, beside the checkpoints: a final save's own time is
# known only once it is durable, too late to go into it.
TIMINGS_FILE = ".asyncckpt-preemption-timings.json"


class Target:
    """The handler's view of a checkpoint manager."""

    framework: str = ""
    needs_state: bool = False

    @property
    def engine(self) -> AsyncEngine:
        raise NotImplementedError

    def restore_bookkeeping(self) -> tuple[int, dict]:
        """``(total_run_calls, estimates)`` of the newest checkpoint, or ``(0, {})``."""
        raise NotImplementedError

    def track(self, runs: int, estimates: dict | None) -> None:
        """Keeps the bookkeeping that every save will carry up to date."""

    def save(self, runs: int, estimates: dict, state: Any, args: tuple,
             kwargs: dict) -> str | None:
        """Saves with the bookkeeping; returns the checkpoint's path or name (None: unknown)."""
        raise NotImplementedError

    def adopted(self, stats: Any) -> tuple[int | None, str | None]:
        """``(total_run_calls, checkpoint)`` of a committed save (``SaveStats``).

        For a save in flight adopted as the final checkpoint: the run count
        it holds, read back from it (None if it cannot be read).
        """
        return stats.step, stats.label

    def prepare(self, state: Any) -> None:
        """Builds the staging memory of the saves to come in the background (``prepare()``)."""

    def wait_until_finished(self) -> None:
        """Waits until every save is durable (uploads to a remote tier included)."""
        raise NotImplementedError

    def wait_until_committed_locally(self) -> None:
        """Waits until every save is committed locally (not for background uploads)."""
        self.engine.wait_until_finished()

    @property
    def manager(self) -> Any:
        """The checkpoint manager saves go through (None: no manager, so no remote tier)."""
        return None

    def after_final_save(self) -> None:
        """Cleanup once the final checkpoint is durable on every worker."""

    def watch_again(self) -> None:
        """Ready to save again: ``exit_fn`` returned after ``after_final_save``."""

    def close(self) -> None:
        """Closes what the handler created."""

    @property
    def directory(self) -> str:
        raise NotImplementedError

    def read_timings(self) -> dict:
        """What ``write_timings`` stored beside the checkpoints; ``{}`` if nothing (valid).

        Not kept for an ``s3://`` / ``gs://`` directory (``{}``): the next
        run measures its final saves afresh.
        """
        if is_url(self.directory):
            return {}
        path = os.path.join(self.directory, TIMINGS_FILE)
        try:
            with open(path) as f:
                value = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("ignoring %s: %s", path, e)
            return {}
        return value if isinstance(value, dict) else {}

    def write_timings(self, timings: dict) -> None:
        """Stores ``timings`` beside the checkpoints (atomic replace; errors logged)."""
        if is_url(self.directory):
            return
        path = os.path.join(self.directory, TIMINGS_FILE)
        try:
            commit_lib.write_text_atomic(path, json.dumps(timings), fsync=True)
        except OSError as e:
            logger.warning("could not store the final save's time in %s: %s", path, e)


def make_target(obj: Any, *, checkpoint_dir: str | None, worker_id: int,
                num_workers: int) -> Target:
    """The target for a TF or JAX checkpoint (manager) object.

    An object with a ``make_preemption_target(worker_id=, num_workers=)``
    method (``asyncckpt.keras.BackupAndRestore``) provides its own target.
    """
    provide = getattr(obj, "make_preemption_target", None)
    if callable(provide):
        return provide(worker_id=worker_id, num_workers=num_workers)
    module = type(obj).__module__
    if module.startswith("asyncckpt.jax"):
        return JaxTarget(obj)
    if module.startswith(("asyncckpt.tf", "tensorflow", "keras")):
        return TFTarget(obj, checkpoint_dir=checkpoint_dir, worker_id=worker_id,
                        num_workers=num_workers)
    raise TypeError(
        "checkpoint_or_manager must be an asyncckpt.tf.CheckpointManager, an "
        "asyncckpt.tf.Checkpoint or tf.train.Checkpoint (with checkpoint_dir), or an "
        f"asyncckpt.jax.CheckpointManager; got {type(obj).__module__}.{type(obj).__name__}"
    )


class TFTarget(Target):
    """An ``asyncckpt.tf.CheckpointManager``, or one the handler makes.

    The bookkeeping lives in two variables the handler attaches to the
    ``tf.train.Checkpoint`` (``_asyncckpt_preemption``), so *every* save of
    that checkpoint carries the current run count, the handler's or the
    user's own periodic ones. Under multi-worker training with a checkpoint
    (not a manager) the chief writes into ``checkpoint_dir`` and the other
    workers into ``checkpoint_dir/workertemp_<i>`` (their saves take part in
    any collective reads, their files are not needed), and everyone restores
    from ``checkpoint_dir``.
    """

    framework = "tensorflow"

    def __init__(self, obj: Any, *, checkpoint_dir: str | None, worker_id: int,
                 num_workers: int):
        import asyncckpt.tf as at
        from asyncckpt.tf._compat import tf

        self._tf = tf
        self._owned: list = []
        self._temp_dir: str | None = None
        self._worker_dir: str | None = None  # a non-chief's directory for a checkpoint given
        self._worker_ckpt: Any = None
        if isinstance(obj, at.CheckpointManager):
            self._read = self._write = obj
        elif isinstance(obj, (at.Checkpoint, tf.train.Checkpoint)):
            if not checkpoint_dir:
                raise ValueError("checkpoint_dir is required when a checkpoint (not a manager) "
                                 "is given")
            ckpt = obj if isinstance(obj, at.Checkpoint) else at.Checkpoint.wrap(obj)
            if ckpt is not obj:
                self._owned.append(ckpt)
            self._read = at.CheckpointManager(ckpt, checkpoint_dir, max_to_keep=1)
            self._write = self._read
            if worker_id != 0:
                self._worker_dir = os.path.join(os.fspath(checkpoint_dir),
                                                f"workertemp_{worker_id}")
                self._worker_ckpt = ckpt
                self._write_to_worker_dir(ckpt)
            self._owned.insert(0, self._read)
        elif isinstance(obj, tf.train.CheckpointManager):
            # Its saves are synchronous and unmeasured: the grace margin and the
            # asynchronous final save need asyncckpt's engine.
            raise TypeError(
                "a tf.train.CheckpointManager saves synchronously; give the handler "
                "asyncckpt.tf.CheckpointManager(checkpoint, directory, max_to_keep=...) "
                "(the same arguments), or the tf.train.Checkpoint with checkpoint_dir")
        else:
            raise TypeError(f"not a TensorFlow checkpoint or manager: {type(obj).__name__}")
        tf_ckpt = self._read.checkpoint
        if isinstance(tf_ckpt, at.Checkpoint):
            tf_ckpt = tf_ckpt.checkpoint
        tracker = getattr(tf_ckpt, TRACKER_NAME, None)
        if tracker is None:
            with tf.init_scope():
                tracker = tf.Module(name="asyncckpt_preemption")
                tracker.total_run_calls = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                      name="total_run_calls")
                # Not named "estimates": checkpoints of earlier versions hold a
                # vector of another shape under that name, which restoring
                # into this one would refuse; under a new name it is skipped.
                tracker.grace_samples = tf.Variable(
                    encode_estimates(None), dtype=tf.float64, trainable=False,
                    name="grace_samples")
            setattr(tf_ckpt, TRACKER_NAME, tracker)
        self._tracker = tracker
        self._tracked_runs: int | None = None

    @property
    def engine(self) -> AsyncEngine:
        return self._write.engine

    @property
    def manager(self) -> Any:
        return self._write

    @property
    def directory(self) -> str:
        return os.fspath(self._read.directory)

    def restore_bookkeeping(self) -> tuple[int, dict]:
        path = self._read.restore_or_initialize()
        if path is None:
            return 0, {}
        runs = int(self._tracker.total_run_calls.numpy())
        estimates = decode_estimates(self._tracker.grace_samples.numpy())
        self._tracked_runs = runs
        logger.info("restored %s: total_run_calls %d", path, runs)
        return runs, estimates

    def track(self, runs: int, estimates: dict | None) -> None:
        if runs != self._tracked_runs:
            self._tracker.total_run_calls.assign(runs)
            self._tracked_runs = runs
        if estimates is not None:
            self._tracker.grace_samples.assign(encode_estimates(estimates))

    def save(self, runs: int, estimates: dict, state: Any, args: tuple,
             kwargs: dict) -> str | None:
        """Saves through the manager, numbered as it numbers saves: ``ckpt-<save_counter>``.

        As TensorFlow's handler names its checkpoints; ``args``/``kwargs``
        (from ``save_checkpoint_if_preempted``) go to ``save`` unchanged.
        Without them, ``checkpoint_interval`` does not skip a preemption save.
        """
        del state
        self.track(runs, estimates)
        if not args and not kwargs:
            kwargs = {"check_interval": False}
        path = self._write.save(*args, **kwargs)
        logger.info("preemption checkpoint %s staged at run %d", path, runs)
        return path

    def adopted(self, stats: Any) -> tuple[int | None, str | None]:
        path = os.path.join(os.fspath(self._write.directory), os.path.basename(stats.label))
        key = f"{TRACKER_NAME}/total_run_calls/.ATTRIBUTES/VARIABLE_VALUE"
        try:
            runs = int(self._tf.train.load_variable(path, key))
        except Exception as e:  # not readable by TensorFlow here (a URL), or no tracker
            logger.info("could not read the run count of %s: %s", path, e)
            runs = None
        return runs, path

    def prepare(self, state: Any) -> None:
        del state
        self._write.prepare()

    def wait_until_finished(self) -> None:
        self._write.wait_until_finished()

    def _write_to_worker_dir(self, ckpt: Any) -> None:
        """A non-chief's manager of its temporary copy (made again after ``watch_again``)."""
        import asyncckpt.tf as at

        self._temp_dir = self._worker_dir
        self._write = at.CheckpointManager(ckpt, self._temp_dir, max_to_keep=1)
        self._owned.insert(0, self._write)

    def after_final_save(self) -> None:
        if self._temp_dir is not None:
            self._write.close()
            self._owned.remove(self._write)
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
            self._write = self._read

    def watch_again(self) -> None:
        if self._worker_dir is not None and self._temp_dir is None:
            self._write_to_worker_dir(self._worker_ckpt)

    def close(self) -> None:
        for obj in self._owned:
            obj.close()
        self._owned = []
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


class JaxTarget(Target):
    """An ``asyncckpt.jax.CheckpointManager``; saves the pytree given to the handler.

    The bookkeeping is stored as custom metadata of each step the handler
    saves (``checkpoint_metadata()`` gives it for the user's own saves). A step
    saved without it restores ``total_run_calls`` as the step number.
    """

    framework = "jax"
    needs_state = True

    def __init__(self, manager: Any):
        self._mgr = manager
        self._restored_step: int | None = None

    @property
    def engine(self) -> AsyncEngine:
        return self._mgr.engine

    @property
    def manager(self) -> Any:
        return self._mgr

    @property
    def directory(self) -> str:
        return os.fspath(self._mgr.directory)

    def _bookkeeping(self, step: int) -> tuple[int, dict]:
        meta = self._mgr.metadata(step).custom_metadata or {}
        mine = meta.get(METADATA_KEY) or {}
        return int(mine.get("total_run_calls", step)), dict(mine.get("estimates") or {})

    def restore_bookkeeping(self) -> tuple[int, dict]:
        step = self._mgr.latest_step()
        return (0, {}) if step is None else self._bookkeeping(step)

    def restore(self, target: Any) -> tuple[Any, int, dict] | None:
        """Restores the newest valid step into ``target``'s shape, or None if none."""
        from asyncckpt.errors import CorruptCheckpointError

        for step in reversed(self._mgr.all_steps()):
            try:
                state = self._mgr.restore(step, target)
            except CorruptCheckpointError as e:
                logger.warning("skipping step %d: %s", step, e)
                continue
            runs, estimates = self._bookkeeping(step)
            logger.info("restored step %d: total_run_calls %d", step, runs)
            return state, runs, estimates
        return None

    @staticmethod
    def metadata(runs: int, estimates: dict) -> dict:
        return {METADATA_KEY: {"total_run_calls": runs, "estimates": estimates}}

    def save(self, runs: int, estimates: dict, state: Any, args: tuple,
             kwargs: dict) -> str | None:
        if state is None:
            raise TypeError(
                "with a JAX checkpoint manager the handler needs the training state: pass it "
                "as the first argument after train_fn to run(), or to "
                "save_checkpoint_if_preempted(state)"
            )
        step = int(kwargs.pop("step", runs)) if kwargs else runs
        if args or kwargs:
            raise TypeError(f"unexpected save arguments for a JAX manager: {args} {kwargs}")
        custom = self.metadata(runs, estimates)
        try:
            self._mgr.save(step, state, force=True, custom_metadata=custom)
        except ValueError as e:
            if "already saved" not in str(e):
                raise
            logger.info("step %d is already saved; the preemption save reuses it", step)
            return self._mgr.step_dir(step)
        logger.info("preemption checkpoint step %d staged", step)
        return self._mgr.step_dir(step)

    def adopted(self, stats: Any) -> tuple[int | None, str | None]:
        if stats.step is None:
            return None, None
        return self._bookkeeping(stats.step)[0], self._mgr.step_dir(stats.step)

    def prepare(self, state: Any) -> None:
        if state is not None:
            self._mgr.prepare(state)

    def wait_until_finished(self) -> None:
        self._mgr.wait_until_finished()

"""``PreemptionCheckpointHandler``: save the last step in time, then exit.

Ties the pieces together: watchers deliver notices to a queue (safe from a
signal handler); a dispatcher thread turns them into the cluster-wide claim;
at every step boundary the training thread asks ``StepAgreement`` what to do
and, at the agreed step, saves through the checkpoint manager, waits until
the checkpoint is durable on every worker and calls ``exit_fn``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asyncckpt._closing import ClosingContext
from asyncckpt._coordination import (
    Coordinator,
    InProcessCoordinator,
    TFCoordinator,
    auto_coordinator,
)
from asyncckpt.errors import CoordinationTimeoutError
from asyncckpt.preemption._remote import (
    RemoteTierView,
    raise_priority,
    restore_priority,
    tiers_of,
)
from asyncckpt.preemption._targets import JaxTarget, Target, make_target
from asyncckpt.preemption.agreement import AgreementOptions, Decision, StepAgreement
from asyncckpt.preemption.config import (
    ResolvedTermination,
    TerminationConfig,
    resolve_termination_config,
)
from asyncckpt.preemption.grace import GraceClock, GraceOptions
from asyncckpt.preemption.watchers import (
    Notice,
    PollingWatcher,
    SigtermWatcher,
    maintenance_watcher,
    spot_watcher,
)
from asyncckpt.storage.base import StorageError

logger = logging.getLogger(__name__)

_handler_ids = itertools.count()
_ESTIMATE_REFRESH_S = 1.0


@dataclass(frozen=True, kw_only=True)
class PreemptionSave:
    """A save the handler made because of a notice.

    Attributes:
        run: ``total_run_calls`` stored in the checkpoint.
        final: The save before exit (else the save made at the notice).
        started_at: ``time.time()`` when the save began (state copy).
        durable_at: ``time.time()`` once durable on this worker (final only).
        notice_time: When the cluster's first notice was received.
        deadline: The deadline the save was made for.
        margin_s: The margin when the save began (None: unknown).
        adopted: No new save was made: the save in flight at the final
            boundary became the final checkpoint (``run`` is the run count
            it holds), as a new one could not be durable in time.
        checkpoint: The checkpoint saved (TensorFlow: its path prefix,
            numbered by the manager's save counter, ``ckpt-1``, ``ckpt-2``
            ... as TensorFlow's handler names them; JAX: the step's
            directory); None when ``save_fn`` saved, and for a Keras backup.
        tier: Final saves: the tier the checkpoint reached, ``"remote"``
            (committed to the manager's remote tier or URL directory) or
            ``"local"`` (the local directory only).
        location: Final saves: the URL or local path of that tier.
        remote_error: Final saves of a manager with a remote tier that ended
            ``"local"``: why the remote tier was not reached.
    """

    run: int
    final: bool
    started_at: float
    durable_at: float | None
    notice_time: float | None
    deadline: float | None
    margin_s: float | None
    adopted: bool = False
    checkpoint: str | None = None
    tier: str | None = None
    location: str | None = None
    remote_error: str | None = None


def _framework_of(obj: Any) -> str:
    module = type(obj).__module__
    return "jax" if module.startswith("asyncckpt.jax") else "tensorflow"


def _jax_sync_point() -> Callable[[int], bool] | None:
    """JAX's ``reached_preemption_sync_point`` when its preemption service runs."""
    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import distributed

        if distributed.global_state.preemption_sync_manager is None:
            return None
        from jax.experimental import multihost_utils
    except Exception:
        return None
    return multihost_utils.reached_preemption_sync_point


def _is_cluster_resolver(obj: Any) -> bool:
    """A ``tf.distribute.cluster_resolver.ClusterResolver`` (by its interface)."""
    return callable(getattr(obj, "cluster_spec", None)) and hasattr(obj, "task_type")


def _split_arguments(first: Any, second: Any, keyword: Any) -> tuple[Any, Any]:
    """``(cluster_resolver, checkpoint_or_manager)`` from either spelling of the call.

    TensorFlow's ``(cluster_resolver, checkpoint_or_checkpoint_manager, ...)``
    and asyncckpt's ``(checkpoint_or_manager, ...)`` differ in their first
    argument; a checkpoint given second (or by keyword) makes the first one
    the resolver, else the first one is the checkpoint.
    """
    given = [x for x in (second, keyword) if x is not None]
    if len(given) > 1:
        raise TypeError("the checkpoint is given twice: pass checkpoint_or_checkpoint_manager "
                        "(TensorFlow's name) or checkpoint_or_manager, not both")
    if given:
        resolver, checkpoint = first, given[0]
        if resolver is not None and not _is_cluster_resolver(resolver):
            if isinstance(checkpoint, (str, os.PathLike)):
                raise TypeError(
                    "the second positional argument is the checkpoint (TensorFlow's order: "
                    "cluster_resolver, checkpoint_or_checkpoint_manager, checkpoint_dir); "
                    "write PreemptionCheckpointHandler(checkpoint, checkpoint_dir=...) or "
                    "PreemptionCheckpointHandler(cluster_resolver, checkpoint, checkpoint_dir)")
            raise TypeError("cluster_resolver must be a tf.distribute.cluster_resolver."
                            f"ClusterResolver or None, got {type(resolver)!r}")
        return resolver, checkpoint
    if first is None or _is_cluster_resolver(first):
        raise TypeError("PreemptionCheckpointHandler needs a checkpoint or checkpoint manager "
                        "(checkpoint_or_checkpoint_manager)")
    return None, first


class PreemptionCheckpointHandler(ClosingContext):
    """Saves a checkpoint at an agreed step when termination is near, then exits.

    TensorFlow (its own call, ``tf.distribute.experimental``'s, works unchanged)::

        handler = PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
        while handler.total_run_calls < num_steps:     # restored from the checkpoint
            handler.run(train_step, iterator)

    or, without a cluster resolver, ``PreemptionCheckpointHandler(manager)``.

    JAX (the state is a pytree, passed explicitly; ``train_fn`` takes it as its
    first argument and the handler saves *that* state, the one before the step)::

        handler = PreemptionCheckpointHandler(jax_manager)
        restored = handler.restore(abstract_state)
        state = init_state() if restored is None else restored
        while handler.total_run_calls < num_steps:
            state, metrics = handler.run(train_step, state, batch)

    Every worker must create its handlers in the same order and call ``run``
    (or ``save_checkpoint_if_preempted``) once per step, *before* the step:
    a checkpoint saved there holds ``total_run_calls`` steps, and a job
    resumed from it runs the next one.

    Args:
        cluster_resolver: TensorFlow's first argument, the strategy's
            ``cluster_resolver`` (None for local training): its cluster spec,
            task type and task id say which worker this is and which is the
            chief; with several workers they agree through the coordination
            service ``MultiWorkerMirroredStrategy`` runs. In asyncckpt's
            shorter call the first argument is the checkpoint or manager
            instead (then the worker comes from ``TF_CONFIG`` or
            ``jax.distributed``).
        checkpoint_or_checkpoint_manager: ``asyncckpt.tf.CheckpointManager``,
            an ``asyncckpt.tf.Checkpoint`` or ``tf.train.Checkpoint`` (then
            ``checkpoint_dir`` is required and the handler keeps one
            checkpoint there; the chief writes it, the other workers write
            into ``checkpoint_dir/workertemp_<i>``, removed after their final
            save), or ``asyncckpt.jax.CheckpointManager``.
        checkpoint_dir: Directory for a checkpoint given without a manager.
        termination_config: Watchers, grace period, exit and save functions
            (asyncckpt's ``TerminationConfig`` or TensorFlow's); unset fields
            come from the platform preset.
        checkpoint_or_manager: asyncckpt's keyword for
            ``checkpoint_or_checkpoint_manager``.
        coordinator: How workers agree; default: from ``cluster_resolver``
            when given, else TensorFlow's coordination service under
            ``MultiWorkerMirroredStrategy``, the ``jax.distributed`` key-value
            store, else in-process.
        grace_options: Tuning of the grace-period margin.
        agreement_options: Timeouts of the protocol.
    """

    def __init__(
        self,
        cluster_resolver: Any = None,
        checkpoint_or_checkpoint_manager: Any = None,
        checkpoint_dir: str | os.PathLike | None = None,
        termination_config: TerminationConfig | None = None,
        *,
        checkpoint_or_manager: Any = None,
        coordinator: Coordinator | None = None,
        grace_options: GraceOptions | None = None,
        agreement_options: AgreementOptions | None = None,
    ):
        resolver, checkpoint_or_manager = _split_arguments(
            cluster_resolver, checkpoint_or_checkpoint_manager, checkpoint_or_manager)
        framework = _framework_of(checkpoint_or_manager)
        if coordinator is None and resolver is not None:
            if framework == "jax":
                raise TypeError("a cluster resolver describes a TensorFlow cluster; JAX "
                                "processes agree through jax.distributed: pass the manager alone")
            coordinator = TFCoordinator.from_cluster_resolver(resolver) or InProcessCoordinator()
        self._coordinator = coordinator or auto_coordinator(framework)
        self._target: Target = make_target(
            checkpoint_or_manager,
            checkpoint_dir=checkpoint_dir,
            worker_id=self._coordinator.worker_id,
            num_workers=self._coordinator.num_workers,
        )
        self._config: ResolvedTermination = resolve_termination_config(
            termination_config, framework=framework
        )
        self._clock = GraceClock(self._target.engine, grace_options,
                                 num_workers=self._coordinator.num_workers)
        runs, estimates = self._target.restore_bookkeeping()
        self._clock.seed(estimates)
        timings = self._target.read_timings()
        self._clock.seed_finals(timings.get("final_s"), cold=timings.get("cold_s"))
        tiers = tiers_of(self._target.manager)
        self._remote = None if tiers is None else RemoteTierView(tiers)
        if self._remote is not None:
            self._remote.seed(timings.get("upload_s"))
            self._clock.remote = self._remote
        self._namespace = f"asyncckpt/preemption/{next(_handler_ids)}"
        self._agreement_options = agreement_options
        self._rearms = 0  # times exit_fn returned and the handler watched again
        self._agreement = self._new_agreement(runs)
        # One worker without save_fn: a save in flight may become the final one.
        self._clock.adoptable = (self._coordinator.num_workers == 1
                                 and self._config.save_fn is None)
        self._clock.deadline_fn = self._agreement.deadline
        self._notices: queue.SimpleQueue[Notice | None] = queue.SimpleQueue()
        # Held while a notice is being handled, so the training thread can
        # wait for one the dispatcher has taken but not finished.
        self._notice_lock = threading.Lock()
        self._watchers: list = []
        self._dispatcher: threading.Thread | None = None
        self._jax_noticed = False
        self._last_boundary: float | None = None
        self._prepared = self._config.save_fn is not None  # a save_fn saves its own way
        self._last_estimates_at = 0.0
        self._last_stats = None
        self._finished = False
        self._closed = False
        self._watching = False  # notices lead to saves (False while exit_fn runs, and after)
        self.saves: list[PreemptionSave] = []
        self._start()
        logger.info("[worker %d] preemption handler ready at run %d (%s)",
                    self._coordinator.worker_id, runs, self._coordinator.kind)

    # -- watching -------------------------------------------------------------

    def _new_agreement(self, runs: int) -> StepAgreement:
        """The step agreement of one notice: the first, or the next after ``exit_fn`` returned.

        Each has a namespace of its own (its keys are claimed once), the
        same on every worker: they all start the next one at the same step,
        after the same final save.
        """
        namespace = self._namespace
        if self._rearms:
            namespace = f"{namespace}/after-exit/{self._rearms}"
        return StepAgreement(
            self._coordinator,
            namespace=namespace,
            runs=runs,
            margin_fn=self._clock.margin,
            full_margin_fn=self._clock.full_margin,
            queued_fn=self._clock.queued,
            unknown_write_fraction=self._clock.options.unknown_write_fraction,
            save_at_notice_ratio=self._clock.options.save_at_notice_ratio,
            options=self._agreement_options,
        )

    def _start(self, *, again: bool = False) -> None:
        """Starts the agreement, the notice dispatcher and the watchers.

        ``again``: after an ``exit_fn`` that returned. The SIGTERM watcher
        was kept installed; the other watchers start anew and report a
        notice only once their source has changed back and forth (a
        maintenance event still pending, or a ``termination_watcher_fn``
        still returning True, is the notice already handled).
        """
        self._agreement.start()
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="asyncckpt-notices", daemon=True
        )
        self._dispatcher.start()
        sink = self._notices.put  # SimpleQueue.put is safe in a signal handler
        started = []
        if again:
            pass  # the SIGTERM watcher stayed (see _finish)
        elif _jax_sync_point() is None:
            started.append(SigtermWatcher(sink))
        else:
            logger.info("jax.distributed preemption service active: SIGTERM is read from "
                        "JAX's sync point at each step")
        if self._config.preset.watch_metadata:
            started += [maintenance_watcher(sink, armed=not again),
                        spot_watcher(sink, armed=not again)]
        if self._config.termination_watcher_fn is not None:
            started.append(PollingWatcher(
                sink, self._config.termination_watcher_fn,
                interval_s=self._config.poll_interval_s, armed=not again))
        self._watchers += started
        self._watching = True
        for watcher in started:
            watcher.start()

    def _dispatch(self) -> None:
        while (notice := self._notices.get()) is not None:
            with self._notice_lock:
                self._handle_notice(notice)

    def _handle_notice(self, notice: Notice) -> None:
        try:
            grace = self._config.grace_for(notice.source)
            if self._remote is not None and self._clock.plan is None:
                plan = self._clock.choose_tier(notice.wall_time + grace - time.time())
                upload = self._clock.upload_seconds()
                logger.warning(
                    "[worker %d] final save planned for the %s tier (%s): %s",
                    self._coordinator.worker_id, plan,
                    self._remote.url if plan == "remote" else self._remote.local_dir,
                    "every save is uploaded" if self._remote.every_save else
                    "no upload measured yet" if upload is None else
                    f"upload bound {upload:.2f} s, grace period {grace:.1f} s")
            self._agreement.notice(notice, grace)
        except Exception:
            logger.exception("could not handle the termination notice %s", notice)

    def _drain_notices(self) -> None:
        """Training thread, at a boundary: handles every notice received so far.

        A SIGTERM caught during the last step is in the queue (or being handled
        by the dispatcher): handling it here, before deciding, makes the save
        happen at this boundary instead of one step later when the dispatcher
        thread is slow to run (a loaded machine).
        """
        with self._notice_lock:
            while True:
                try:
                    notice = self._notices.get_nowait()
                except queue.Empty:
                    return
                if notice is None:  # the stop request: leave it to the dispatcher
                    self._notices.put(None)
                    return
                self._handle_notice(notice)

    def _stop_watching(self, *, keep_sigterm: bool = False) -> None:
        """Stops the watchers, the dispatcher and the agreement.

        ``keep_sigterm``: the SIGTERM watcher stays installed (its notices
        wait in the queue), so that a SIGTERM while ``exit_fn`` runs does
        not kill a process whose ``exit_fn`` returns.
        """
        self._watching = False
        jax_owns_sigterm = _jax_sync_point() is not None
        kept = []
        for watcher in self._watchers:
            if isinstance(watcher, SigtermWatcher):
                if keep_sigterm:
                    kept.append(watcher)
                    continue
                # Restoring the old handler would replace JAX's C++ notifier.
                watcher.stop(restore=not jax_owns_sigterm)
            else:
                watcher.stop()
        self._watchers = kept
        if self._dispatcher is not None:
            self._notices.put(None)
            if self._dispatcher is not threading.current_thread():
                self._dispatcher.join(10)
            self._dispatcher = None
        self._agreement.stop()

    # -- properties -------------------------------------------------------------

    @property
    def total_run_calls(self) -> int:
        """Calls of ``run`` (or ``save_checkpoint_if_preempted``) so far, across restarts."""
        return self._agreement.runs

    @property
    def preempted(self) -> bool:
        """A final checkpoint is saved and ``exit_fn`` was called (and returned).

        Stays True once set; the handler watches again after an ``exit_fn``
        that returns, and a later notice saves again (``saves``).
        """
        return self._finished

    @property
    def noticed(self) -> bool:
        """A termination notice is known (training may still run in its grace period)."""
        return self._agreement.noticed

    @property
    def config(self) -> ResolvedTermination:
        """The termination config after platform defaults were applied."""
        return self._config

    @property
    def coordinator(self) -> Coordinator:
        return self._coordinator

    @property
    def final_tier(self) -> str | None:
        """The tier the final checkpoint reached, ``"remote"`` or ``"local"`` (None before).

        ``saves[-1].location`` says where, ``saves[-1].remote_error`` why a
        remote tier was not reached.
        """
        finals = [s for s in self.saves if s.final]
        return finals[-1].tier if finals else None

    @property
    def grace_clock(self) -> GraceClock:
        """Margin and estimates (write time, step time) of this handler."""
        return self._clock

    # -- training-loop API --------------------------------------------------------

    def run(self, train_fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Runs one step, saving and exiting first if the agreed step is reached.

        With a JAX manager, ``args[0]`` is the training state: it is what gets
        saved at this boundary.

        Returns:
            What ``train_fn`` returns.

        Raises:
            PeerFailedError: Another worker's ``train_fn`` failed.
        """
        state = args[0] if self._target.needs_state and args else None
        self._boundary(state, (), {})
        try:
            result = train_fn(*args, **kwargs)
        except (SystemExit, GeneratorExit):
            raise
        except BaseException as e:
            self._agreement.report_error(e)
            raise
        self._step_done()
        return result

    def save_checkpoint_if_preempted(self, *args, **kwargs) -> None:
        """Called before each step (or chunk of steps): saves/exits if agreed, then counts it.

        For loops that do not hand the step to ``run`` (several steps per
        call, a step that is not a function). As TensorFlow's: the
        checkpoint saved here holds the state as it is now, before the step
        that follows, with ``total_run_calls`` as it is now; the call is then
        counted. A job resumed from it runs that step next, none is skipped
        or repeated. Arguments go to the manager's ``save`` (TensorFlow, e.g.
        ``checkpoint_number=``) or are the state to save (JAX:
        ``save_checkpoint_if_preempted(state)``).
        """
        if self._target.needs_state:
            state, args = (args[0] if args else None), args[1:]
        else:
            state = None
        self._boundary(state, args, kwargs)
        self._step_done()

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """Reports an error raised inside to every worker, then re-raises it.

        TensorFlow's spelling for the loop around ``run`` (needed there with
        ``TPUStrategy``): the other workers stop at their next step boundary
        with ``PeerFailedError`` (or, blocked in a collective, with the
        error TensorFlow's coordination service aborts it with), instead of
        waiting for this one. ``run`` does the same for errors of the step
        itself. Saving and exiting at a notice need no scope.
        """
        try:
            yield
        except (SystemExit, GeneratorExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            self._agreement.report_error(e)
            raise

    def checkpoint_metadata(self) -> dict:
        """Custom metadata for the user's own JAX saves, so they carry the run count."""
        return JaxTarget.metadata(self.total_run_calls, self._clock.estimates())

    def restore(self, target: Any = None) -> Any:
        """JAX: restores the newest valid step into ``target``'s shape (None if none).

        Also sets ``total_run_calls`` from that step. Call it before training.
        """
        if not isinstance(self._target, JaxTarget):
            raise TypeError("restore() is for JAX managers; TensorFlow checkpoints are "
                            "restored when the handler is created")
        restored = self._target.restore(target)
        if restored is None:
            return None
        state, runs, estimates = restored
        self._agreement.reset_runs(runs)
        self._clock.seed(estimates)
        return state

    # -- internals ---------------------------------------------------------------

    def _step_done(self) -> None:
        self._agreement.step_done()
        now = time.monotonic()
        estimates = None
        last = self._target.engine.last_stats
        if now - self._last_estimates_at >= _ESTIMATE_REFRESH_S or last is not self._last_stats:
            # Every second, and after every save: the next save carries its time.
            estimates = self._clock.estimates()
            self._last_estimates_at = now
            self._last_stats = last
        self._target.track(self._agreement.runs, estimates)

    def _boundary(self, state: Any, args: tuple, kwargs: dict) -> None:
        now = time.monotonic()
        if self._last_boundary is not None:
            self._clock.steps.update(now - self._last_boundary)
        if not self._watching or self._closed:
            self._last_boundary = now
            return
        if not self._prepared:
            self._prepare(state)
        self._drain_notices()
        self._poll_jax(self._agreement.runs)
        decision = self._agreement.at_boundary()
        if decision is not Decision.CONTINUE:
            self._save(state, args, kwargs, final=decision is Decision.SAVE_AND_EXIT)
        self._last_boundary = time.monotonic()

    def _prepare(self, state: Any) -> None:
        """First boundary: the staging memory of the saves to come, built in the background.

        A save at a notice, or the final one, then does not allocate it in
        the grace period (the first save of a process otherwise faults in
        ``num_slots`` states' worth: seconds per GiB on a VM).
        """
        self._prepared = True
        try:
            self._target.prepare(state)
        except Exception as e:  # the saves themselves will say what is wrong
            logger.info("[worker %d] staging memory not prepared (%s: %s); the first save "
                        "allocates it", self._coordinator.worker_id, type(e).__name__, e)

    def _poll_jax(self, runs: int) -> None:
        sync_point = _jax_sync_point()
        if sync_point is None or self._jax_noticed:
            return
        if sync_point(runs):
            self._jax_noticed = True
            notice = Notice("sigterm", time.time(), "JAX preemption sync point")
            self._agreement.notice(notice, self._config.grace_for("sigterm"))

    def _save(self, state: Any, args: tuple, kwargs: dict, *, final: bool) -> None:
        runs = self._agreement.runs
        notice = self._agreement.cluster_notice or {}
        margin = self._agreement.margin()
        started = time.time()
        estimates = self._clock.estimates()
        boosted = []
        if final:  # training waits now: the writer (and uploader) need not yield to it
            boosted = raise_priority([self._target.engine.writer_thread_id,
                                      None if self._remote is None
                                      else self._remote.uploader_thread_id])
        adopted = final and self._clock.adopt_in_flight()
        upload_error = checkpoint = None
        if adopted:
            pass  # the save in flight becomes the final checkpoint
        elif self._config.save_fn is not None:
            self._target.track(runs, estimates)
            save_args = ((state,) if self._target.needs_state else ()) + tuple(args)
            self._config.save_fn(*save_args, **kwargs)
        else:
            checkpoint, upload_error = self._save_despite_upload_failure(
                runs, estimates, state, args, kwargs)
        durable = tier = location = remote_error = None
        if final:
            try:
                tier, location, remote_error, durable = self._make_durable()
            finally:
                restore_priority(boosted)
        if final and not adopted and self._config.save_fn is None:
            self._record_final()
        if adopted:
            last = self._target.engine.last_stats
            if last is not None:
                adopted_runs, checkpoint = self._target.adopted(last)
                runs = adopted_runs if adopted_runs is not None else runs
            logger.warning("[worker %d] no time for a new save: the save in flight (%s, run "
                           "%d) is the final checkpoint", self._coordinator.worker_id,
                           checkpoint, runs)
        record = PreemptionSave(
            run=runs, final=final, started_at=started, durable_at=durable,
            notice_time=notice.get("time"), deadline=self._agreement.deadline(),
            margin_s=margin, adopted=adopted, checkpoint=checkpoint, tier=tier,
            location=location, remote_error=remote_error or upload_error,
        )
        self.saves.append(record)
        if not final:
            logger.warning("[worker %d] checkpoint at run %d saved at the notice; training "
                           "on in the grace period", self._coordinator.worker_id, runs)
            return
        self._finish(record)

    def _make_durable(self) -> tuple[str, str, str | None, float]:
        """Final save: waits until it is durable on the tier planned.

        With a remote tier beside the local directory the checkpoint is
        committed locally first; when the final save is planned for the
        remote tier it is then uploaded (unless the manager's schedule has
        it on its way already) and waited for no longer than the deadline
        allows. If the upload fails or does not finish in time the
        checkpoint stays committed locally, which is reported.

        Returns:
            ``(tier, location, why the remote tier was not reached, when
            the checkpoint became durable on that tier)``.
        """
        remote = self._remote
        if remote is None:
            self._target.wait_until_finished()
            return "local", self._target.directory, None, time.time()
        if remote.every_save:  # a URL directory: committed remotely, or the save fails
            self._target.wait_until_finished()
            return "remote", remote.url, None, time.time()
        self._target.wait_until_committed_locally()
        local_at = time.time()
        last = self._target.engine.last_stats
        name = os.path.basename(last.label) if last is not None else ""
        local = remote.local_location(name)
        if self._clock.plan != "remote":
            return "local", local, "the grace period is too short for the upload", local_at
        deadline = self._agreement.deadline()
        left = (deadline - time.time() - self._clock.slack_s) if deadline is not None else 3600.0
        why = remote.upload_final(name, left)
        if why is None:
            return "remote", f"{remote.url.rstrip('/')}/{name}", None, time.time()
        return "local", local, why, local_at

    def _save_despite_upload_failure(self, runs: int, estimates: dict, state: Any,
                                     args: tuple, kwargs: dict) -> tuple[str | None, str | None]:
        """Saves; an earlier background upload's failure does not cost this checkpoint.

        With two tiers, ``save()`` re-raises a failed background upload (once).
        In the grace period that must not stop the checkpoint: the local tier is
        intact, so the save goes ahead there and the failure is logged and
        reported with the save. A URL directory has no local tier: it raises.

        Returns:
            ``(the checkpoint saved, the upload failure as text or None)``.
        """
        try:
            return self._target.save(runs, estimates, state, args, dict(kwargs)), None
        except StorageError as e:
            if self._remote is None or self._remote.every_save:
                raise
            logger.warning("[worker %d] an earlier upload to %s failed (%s); saving run %d "
                           "on the local tier", self._coordinator.worker_id, self._remote.url,
                           e, runs)
            checkpoint = self._target.save(runs, estimates, state, args, dict(kwargs))
            return checkpoint, f"an earlier upload to {self._remote.url} failed: {e}"

    def _record_final(self) -> None:
        """Keeps the final save's cost for the next run's margin (worker 0 writes it)."""
        last = self._target.engine.last_stats
        if last is None:
            return
        self._clock.record_final(last)
        if self._coordinator.worker_id == 0:
            timings = {"final_s": self._clock.final_samples(),
                       "cold_s": self._clock.cold_samples()}
            if self._remote is not None:
                timings["upload_s"] = self._remote.samples()
            self._target.write_timings(timings)

    def _finish(self, record: PreemptionSave) -> None:
        me = self._coordinator.worker_id
        try:
            self._agreement.barrier("saved",
                                    timeout_s=self._agreement.options.barrier_timeout_s)
        except CoordinationTimeoutError as e:
            logger.error("[worker %d] not every worker confirmed its final save: %s", me, e)
        self._stop_watching(keep_sigterm=True)
        self._target.after_final_save()
        self._finished = True
        if record.deadline is None:
            left = "no deadline"
        elif record.deadline > record.durable_at:
            left = f"{record.deadline - record.durable_at:.2f} s before the deadline"
        else:
            left = f"{record.durable_at - record.deadline:.2f} s after the deadline"
        if record.tier == "local" and record.remote_error is not None:
            logger.warning("[worker %d] final checkpoint at run %d committed locally only, at "
                           "%s (%s); the remote tier was not reached: %s; exiting",
                           me, record.run, record.location, left, record.remote_error)
        else:
            logger.warning("[worker %d] final checkpoint at run %d durable on the %s tier, "
                           "%s (%s); exiting", me, record.run, record.tier, record.location,
                           left)
        try:
            self._config.exit_fn()
        except BaseException:
            self._stop_watching()  # on its way out: the SIGTERM handler before ours is back
            raise
        self._watch_again()

    def _watch_again(self) -> None:
        """After an ``exit_fn`` that returned: a new notice saves (and calls it) again.

        As TensorFlow's handler, whose SIGTERM handler stays installed
        (orbit's ``keep_running_after_save``): a SIGTERM does not end a run
        that goes on. Beyond TensorFlow's, which ignores later notices, the
        next one starts a new agreement (a namespace of its own, at the
        current run count) and so a new save at an agreed step. Notices
        received while the final save was made and ``exit_fn`` ran belong
        to the termination just handled and are dropped.
        """
        if self._closed:
            return
        dropped = 0
        while True:
            try:
                notice = self._notices.get_nowait()
            except queue.Empty:
                break
            dropped += notice is not None
        self._rearms += 1
        self._agreement = self._new_agreement(self._agreement.runs)
        self._clock.deadline_fn = self._agreement.deadline
        self._clock.plan = None  # the next notice plans its own tier
        self._jax_noticed = False
        self._target.watch_again()
        self._start(again=True)
        logger.warning("[worker %d] exit_fn returned: training goes on at run %d and the "
                       "handler watches for termination again%s", self._coordinator.worker_id,
                       self._agreement.runs,
                       f" ({dropped} notice(s) received meanwhile dropped)" if dropped else "")

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Stops the watchers and closes what the handler created; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_watching()
        self._target.close()

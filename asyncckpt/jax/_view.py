"""The in-process view of one checkpoint directory, shared by every manager on it.

orbax's manager lists a step as soon as ``save()`` returns and drops the
steps its retention will delete at that moment; the files follow in the
background. ``DirectoryView`` keeps that view for asyncckpt: the steps on
disk, plus the saves in flight, minus the steps retention has condemned
(deleted once the save that condemned them is durable). Every manager of
one directory in a process shares one view (by real path, weakly held), so
a restart modelled as ``del mgr; mgr = CheckpointManager(same dir)``, or two
live managers, agree on the listing and share the directory lock instead of
refusing each other. Other processes are still kept out by the lock.

For a URL directory the view is of the manager's local scratch directory, and
the steps committed in the bucket are passed in (``remote``): retention sees
them too, and deletes them there through the manager's deleter.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine import retention
from asyncckpt._engine._removals import BackgroundRemover
from asyncckpt._engine.lock import DirectoryLock
from asyncckpt.jax import _metadata, _policies
from asyncckpt.jax._options import ManagerConfig, StepNames

logger = logging.getLogger(__name__)

# In the name of orbax's temporary step directories (``3.orbax-checkpoint-tmp-<time>``).
ORBAX_TEMP = ".orbax-checkpoint-tmp"


@dataclass(frozen=True)
class StepRecord:
    """What retention knows of a step: when it was saved and its metrics."""

    timestamp: float
    metrics: Any = None


class DirectoryView:
    """Steps of one directory as this process sees them, and its writer lock.

    Args:
        directory: The directory's real path.
        names: How step directories are named.
        commit_marker: Steps are committed by this file in their directory
            (orbax's commit-file mode): a step directory without it is not
            listed. None: every step directory is committed (by its rename).
        legacy_ok: With ``commit_marker``, list step directories without it
            too (orbax's ``allow_legacy_atomic_rename``).
    """

    def __init__(self, directory: str, names: StepNames, commit_marker: str | None = None,
                 legacy_ok: bool = False):
        self.directory = directory
        self.names = names
        self.commit_marker = None if legacy_ok else commit_marker
        self.commit_mode = (commit_marker, legacy_ok)
        self.lock = threading.RLock()
        self.settled = threading.Condition(self.lock)  # notified as each save is settled
        self.in_flight: dict[int, Any] = {}  # step -> SaveHandle (None while staging)
        self.unsettled: set[int] = set()  # saves whose settle (deletions included) is pending
        self.doomed: dict[int, int | None] = {}  # step -> the step whose commit deletes it
        self.records: dict[int, StepRecord] = {}
        # (mtime_ns, steps, steps whose name is taken by an entry that is not an
        # uncommitted step directory, uncommitted step directories (commit-file mode))
        self._listing: tuple[int, frozenset[int], frozenset[int], frozenset[int]] | None = None
        self.preserved: set[int] = set()
        self.last_preserved_ts = 0.0
        self.prepared = False
        # (config, its RetentionPolicy): managers sharing the view may differ.
        self._policy: tuple[ManagerConfig, retention.RetentionPolicy] | None = None
        # URL directory: reads the record of a step only the bucket holds.
        self.remote_record: Callable[[int], StepRecord] | None = None
        self.users = 0  # open managers; the lock is released when the last closes
        self.dir_lock = DirectoryLock(directory)
        # Deleted steps' files, removed off the writer thread (``delete_step_dir``).
        self.removals = BackgroundRemover(os.path.basename(directory.rstrip(os.sep)) or "dir")
        # Released once no manager and no save in flight refers to this view.
        weakref.finalize(self, self.dir_lock.release)

    # -- listing ------------------------------------------------------------------

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, self.names.name(step))

    def _read_record(self, step: int) -> StepRecord:
        """A saved step's record (creation time, metrics), from its metadata file."""
        if self.remote_record is not None and not os.path.isdir(self.step_dir(step)):
            return self.remote_record(step)
        meta = _metadata.read_step_metadata(step, self.step_dir(step), with_items=False)
        return StepRecord(meta.created or 0.0, meta.metrics)

    def disk_steps(self) -> frozenset[int]:
        """The committed step directories on disk.

        Cached while the directory's mtime stays the same and this process
        changed nothing (``invalidate``): a ``save()`` then costs one ``stat``,
        not a listing. The mtime catches other processes' changes; in
        commit-file mode a commit does not change it (the marker is written
        inside the step), so uncommitted step directories are looked at again.
        """
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except FileNotFoundError:
            self._listing = None
            return frozenset()
        cached = self._listing
        if cached is not None and cached[0] == mtime and not (
                cached[3] and any(self._committed(s) for s in cached[3])):
            return cached[1]
        steps, taken, pending = set(), set(), set()
        marker = self.commit_marker
        try:
            # scandir: the entry's type comes with the listing (no stat per step,
            # which cost a save 0.4 ms with 90 steps kept, every time it ran).
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    step = self.names.parse(entry.name)
                    if step is None:
                        continue
                    if not entry.is_dir():  # follows a symlink, as os.path.isdir did
                        taken.add(step)  # a name stands for one step, and a step has one name
                    elif marker is None or os.path.exists(os.path.join(entry.path, marker)):
                        steps.add(step)
                        taken.add(step)
                    else:
                        pending.add(step)  # written in place, not committed: not a step
        except FileNotFoundError:
            self._listing = None
            return frozenset()
        found = frozenset(steps)
        self._listing = (mtime, found, frozenset(taken), frozenset(pending))
        return found

    def _committed(self, step: int) -> bool:
        return os.path.exists(os.path.join(self.step_dir(step), self.commit_marker or ""))

    def _name_taken(self, step: int, on_disk: frozenset[int]) -> bool:
        """Whether ``step``'s name exists in the directory (as anything).

        Read from the listing when ``on_disk`` is still it (this save read its
        mtime a moment ago: no ``lstat`` on the save's clock), else from disk.
        """
        listing = self._listing
        if listing is not None and listing[1] is on_disk:
            return step in listing[2]
        path = self.step_dir(step)
        if self.commit_marker is not None and os.path.isdir(path) and not self._committed(step):
            return False  # an interrupted in-place write: the save replaces it
        return os.path.lexists(path)

    def reserve(self, step: int, metrics: Any, exists: Callable[[], type[Exception]],
                on_disk: frozenset[int] | None = None) -> None:
        """Lists ``step`` as being saved from now on.

        ``on_disk``: ``disk_steps()`` as just read by the caller (not read again).
        ``exists`` makes the error type only when it is raised (orbax's, whose
        import took 0.2 s of the first save when it was made for every save).

        Raises:
            exists(): the step is saved or being saved already.
        """
        with self.lock:
            if on_disk is None:
                on_disk = self.disk_steps()
            if step in self.in_flight or step in on_disk or self._name_taken(step, on_disk):
                raise exists()(
                    f"step {step} is already saved (or being saved) in {self.directory!r}")
            self.in_flight[step] = None  # reserved: listed from now on
            self.unsettled.add(step)
            self.records[step] = StepRecord(time.time(), metrics)

    def invalidate(self) -> None:
        """This process changed the directory: list it again next time."""
        self._listing = None

    def refresh(self) -> None:
        """This process changed the directory: list it now (on a background thread).

        The next ``save()`` then finds the listing cached: it only ``stat``s.
        """
        self._listing = None
        self.disk_steps()

    def steps(self, on_disk: frozenset[int] | None = None, *,
              remote: frozenset[int] = frozenset()) -> list[int]:
        """Durable and in-flight steps, minus those retention has condemned.

        ``on_disk``: ``disk_steps()`` as just read by the caller (not read again).
        ``remote``: a URL directory's steps committed in the bucket.
        """
        if on_disk is None:
            on_disk = self.disk_steps()
        with self.lock:
            for s, cause in list(self.doomed.items()):
                if (cause is None and s not in on_disk and s not in remote
                        and s not in self.in_flight):
                    del self.doomed[s]  # deleted (here, or by the primary process)
            return sorted((on_disk | remote | set(self.in_flight)) - set(self.doomed))

    # -- the writer lock and stale temporaries, once per process ----------------------

    def prepare(self, *, orbax_temps: bool = False) -> None:
        """Before this process's first save here: take the lock, clear stale temporaries.

        ``orbax_temps`` (orbax's ``cleanup_tmp_directories``): also remove
        orbax's temporaries and, in commit-file mode, step directories that
        were never committed.
        """
        with self.lock:
            if self.prepared:
                return
            commit_lib.ensure_writable_dir(self.directory)
            self.dir_lock.acquire()
            # Holding the lock, nobody else writes here: temporaries are stale.
            commit_lib.cleanup_stale_temps(self.directory)
            if orbax_temps:
                self._cleanup_orbax_temps()
            self.prepared = True
            self.invalidate()

    def _cleanup_orbax_temps(self) -> None:
        removed = []
        with commit_lib.directory_guard(self.directory):
            self.invalidate()
            self.disk_steps()
            pending = self._listing[3] if self._listing is not None else frozenset()
            for name in os.listdir(self.directory):
                path = os.path.join(self.directory, name)
                step = self.names.parse(name)
                if (ORBAX_TEMP in name or step in pending) and not commit_lib.is_live(path):
                    commit_lib.remove_tree(path)
                    removed.append(name)
        if removed:
            logger.warning("cleanup_tmp_directories: removed %d uncommitted checkpoint(s) in %s: "
                           "%s", len(removed), self.directory, ", ".join(sorted(removed)))

    # -- retention ------------------------------------------------------------------

    def record(self, step: int) -> StepRecord:
        """``step``'s record: kept since its save, else read once from its metadata."""
        with self.lock:
            rec = self.records.get(step)
        if rec is None:
            rec = self._read_record(step)
            with self.lock:
                self.records.setdefault(step, rec)
        return rec

    def condemn(self, new_step: int, config: ManagerConfig,
                on_disk: frozenset[int] | None = None, *,
                remote: frozenset[int] = frozenset()) -> list[int]:
        """Applies retention as if ``new_step`` were saved; returns the steps condemned.

        They are hidden at once and deleted when ``new_step`` is durable.
        ``on_disk``: ``disk_steps()`` as just read by the caller (not read again).
        ``remote``: a URL directory's steps committed in the bucket (retention
        decides what the bucket keeps).
        """
        if config.preservation_policy is not None:
            return self._condemn_by_policy(new_step, config, on_disk, remote)
        if config.max_to_keep is None:
            return []
        with self.lock:
            listed = [s for s in self.steps(on_disk, remote=remote) if s not in self.preserved]
            candidates = []
            for s in listed:
                rec = self.record(s)
                candidates.append(retention.Candidate(str(s), s, rec.timestamp,
                                                      config.metric(rec.metrics)))
            decision = retention.apply(candidates, self._policy_for(config),
                                       last_preserved_timestamp=self.last_preserved_ts)
            self.last_preserved_ts = decision.last_preserved_timestamp
            self.preserved.update(c.step for c in decision.preserve)
            delete = [c.step for c in decision.delete]
            for s in delete:
                self.doomed[s] = new_step
            return delete

    def _condemn_by_policy(self, new_step: int, config: ManagerConfig,
                           on_disk: frozenset[int] | None,
                           remote: frozenset[int]) -> list[int]:
        """orbax's ``preservation_policy`` decides: steps it does not preserve are condemned.

        It sees every listed step, the new one included, as orbax's manager
        shows them to it; its answer is followed as given, so a policy that
        does not preserve the newest step has it deleted once it is durable.
        """
        with self.lock:
            listed = self.steps(on_disk, remote=remote)
            infos = _policies.StepInfos(listed, self._timestamp_and_metrics)
            keep = _policies.preserved(config.preservation_policy, infos[:])
            delete = [s for s, k in zip(listed, keep, strict=True) if not k]
            for s in delete:
                self.doomed[s] = new_step
            return delete

    def _timestamp_and_metrics(self, step: int) -> tuple[float, Any]:
        rec = self.record(step)
        return rec.timestamp, rec.metrics

    def policy_infos(self, steps: list[int]) -> _policies.StepInfos:
        """The listed ``steps`` as orbax's ``CheckpointInfo`` records (built when read)."""
        return _policies.StepInfos(steps, self._timestamp_and_metrics)

    def _policy_for(self, config: ManagerConfig) -> retention.RetentionPolicy:
        """``config``'s retention policy, built once per config (not on every save)."""
        cached = self._policy
        if cached is not None and cached[0] is config:
            return cached[1]
        policy = retention.RetentionPolicy(
            max_to_keep=config.max_to_keep,
            keep_every_n_hours=(None if config.keep_time_interval_s is None
                                else config.keep_time_interval_s / 3600.0),
            keep_period=config.keep_period,
            best_mode=config.best_mode if config.best_fn is not None else None,
            keep_checkpoints_without_metrics=config.keep_checkpoints_without_metrics,
        )
        self._policy = (config, policy)
        return policy

    def settle(self, step: int, *, committed: bool, deleter: Callable[[int], None] | None) -> None:
        """A save ended: drop it from the in-flight set; on success delete what it condemned.

        ``deleter`` is None on processes that do not delete (not the primary):
        there the condemned steps stay hidden until the primary has deleted
        them. A failed deletion is logged and retried at the next commit.
        Runs on the writer thread, which also lists the directory afresh, so
        the next ``save()`` finds the listing cached.
        """
        try:
            self._settle(step, committed=committed, deleter=deleter)
        finally:
            self.refresh()
            with self.settled:
                self.unsettled.discard(step)
                self.settled.notify_all()

    def wait_settled(self, steps: set[int] | None) -> None:
        """Waits until the saves of these steps (None: all) are settled, deletions included."""
        with self.settled:
            self.settled.wait_for(
                lambda: not (self.unsettled if steps is None else self.unsettled & steps))

    def _settle(self, step: int, *, committed: bool,
                deleter: Callable[[int], None] | None) -> None:
        self.invalidate()  # published (or a failed save's leftovers removed)
        with self.lock:
            self.in_flight.pop(step, None)
            if not committed:
                for s, cause in list(self.doomed.items()):
                    if cause == step:
                        del self.doomed[s]
                self.records.pop(step, None)
                return
            for s, cause in self.doomed.items():
                if cause == step:
                    self.doomed[s] = None  # due now, or at its own commit if in flight
            due = [s for s, cause in self.doomed.items()
                   if cause is None and s not in self.in_flight]
        if deleter is None:
            return  # the primary process deletes; they stay hidden until gone from disk
        for s in sorted(due):
            try:
                deleter(s)
            except Exception as e:  # the save is durable; a stale step must not fail it
                logger.warning("could not delete old checkpoint step %d in %s (retrying at the "
                               "next save): %s", s, self.directory, e)
                with self.lock:
                    self.doomed[s] = None
                continue
            self.invalidate()
            with self.lock:
                self.doomed.pop(s, None)
                self.records.pop(s, None)

    def forget(self, step: int) -> None:
        self.invalidate()
        with self.lock:
            self.records.pop(step, None)
            self.preserved.discard(step)
            self.doomed.pop(step, None)


def delete_step_dir(view: DirectoryView, step: int, todelete_subdir: str | None) -> None:
    """Removes a step: renamed out of the listing first, so a half-deleted step is never seen.

    The rename is all this does on the calling thread (the writer's, for
    retention); the files are removed by the view's ``removals`` thread.
    With ``todelete_subdir`` the step is only moved there (orbax's soft delete).

    Raises:
        OSError: the rename failed.
    """
    path = view.step_dir(step)
    if todelete_subdir is not None:
        trash = os.path.join(view.directory, todelete_subdir)
        os.makedirs(trash, exist_ok=True)
        target = os.path.join(trash, view.names.name(step))
        if os.path.lexists(target):
            commit_lib.remove_tree(target)
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return
        logger.debug("moved step %d to %s", step, trash)
        return
    doomed = commit_lib.claim_temp(os.path.join(
        view.directory, f"{commit_lib.TEMP_PREFIX}deleted-{step}-{uuid.uuid4().hex[:8]}"))
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        commit_lib.forget_temp(doomed)
        return
    view.removals.submit(doomed)
    logger.debug("deleted step %d in %s (files removed in the background)", step, view.directory)


_VIEWS: weakref.WeakValueDictionary[str, DirectoryView] = weakref.WeakValueDictionary()
_VIEWS_LOCK = threading.Lock()


def view_for(directory: str, names: StepNames, commit_marker: str | None = None,
             legacy_ok: bool = False) -> DirectoryView:
    """The view of ``directory`` shared by this process's managers (made on first use).

    Raises:
        ValueError: another live manager of this process names the steps of
            this directory differently, or commits them differently.
    """
    key = os.path.realpath(directory)
    with _VIEWS_LOCK:
        view = _VIEWS.get(key)
        if view is None:
            view = DirectoryView(directory, names, commit_marker, legacy_ok)
            _VIEWS[key] = view
        elif view.names != names:
            raise ValueError(
                f"another CheckpointManager of this process uses {directory!r} with other step "
                f"names ({view.names.name(1)!r} for step 1, this one {names.name(1)!r})"
            )
        elif view.commit_mode != (commit_marker, legacy_ok):
            raise ValueError(
                f"another CheckpointManager of this process uses {directory!r} with another "
                "temporary_path_class / atomicity_options (steps committed by "
                f"{view.commit_mode[0] or 'rename'}, this one by {commit_marker or 'rename'})")
        return view

"""orbax's step directories in one directory, on the engine's ``StepDirectory``.

orbax's manager lists a step as soon as ``save()`` returns and drops the
steps its retention will delete at that moment; the files follow in the
background. The bookkeeping of that is the engine's ``StepDirectory``
(``_engine/steps.py``), shared with the other managers; this module adds
what is orbax's: step directories named by ``StepNames``, committed by a
rename or by a marker file (``commit_success.txt``), found by a directory
scan (cached by the directory's mtime, so a ``save()`` costs one ``stat``),
their records (time, metrics) read from their metadata, orbax's retention
rules and policy objects, orbax's temporaries.

Every manager of one directory in a process shares one ``StepView`` (by
real path), so a restart modelled as ``del mgr; mgr = CheckpointManager(same
dir)``, or two live managers, agree on the listing and share the directory
lock instead of refusing each other. For a URL directory the view is of the
manager's local scratch directory; the steps committed in the bucket are
passed in (``remote``), and retention sees them too.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine import retention
from asyncckpt._engine.steps import (
    Reservation,
    StepDirectory,
    StepRecord,
    remove_dir,
    shared,
)
from asyncckpt.jax import _metadata, _policies
from asyncckpt.jax._options import ManagerConfig, StepNames

logger = logging.getLogger(__name__)

# In the name of orbax's temporary step directories (``3.orbax-checkpoint-tmp-<time>``).
ORBAX_TEMP = ".orbax-checkpoint-tmp"


class StepView:
    """orbax's steps of one directory as this process sees them (see the module docstring).

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
        me = weakref.ref(self)  # the step directory keeps no reference back: no cycle to
        # wait for, so a dropped manager's directory lock goes with its last save
        self.steps = StepDirectory(directory, order=names.parse,
                                   load_record=lambda name: me()._read_record(name))
        # (mtime_ns, steps, steps whose name is taken by an entry that is not an
        # uncommitted step directory, uncommitted step directories (commit-file mode))
        self._listing: tuple[int, frozenset[int], frozenset[int], frozenset[int]] | None = None
        # Bumped by every ``invalidate``: a listing taken across one is not kept (below).
        self._generation = 0
        self._synced: frozenset[int] | None = None  # the committed steps last given to ``steps``
        # URL directory: reads the record of a step only the bucket holds.
        self.remote_record: Callable[[int], StepRecord] | None = None
        # (config, its RetentionPolicy): managers sharing the view may differ.
        self._policy: tuple[ManagerConfig, retention.RetentionPolicy] | None = None

    # -- names and records -----------------------------------------------------------

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, self.names.name(step))

    def _read_record(self, name: str) -> StepRecord:
        """A saved step's record (creation time, metrics), from its metadata file."""
        step = self.names.parse(name)
        assert step is not None
        if self.remote_record is not None and not os.path.isdir(self.step_dir(step)):
            return self.remote_record(step)
        meta = _metadata.read_step_metadata(step, self.step_dir(step), with_items=False)
        return StepRecord(save_time(meta), meta.metrics)

    def record(self, step: int) -> StepRecord:
        return self.steps.record(self.names.name(step))

    # -- listing ------------------------------------------------------------------------

    def disk_steps(self) -> frozenset[int]:
        """The committed step directories on disk.

        Cached while the directory's mtime stays the same and this process
        changed nothing (``invalidate``): a ``save()`` then costs one ``stat``,
        not a listing. The mtime catches other processes' changes; in
        commit-file mode a commit does not change it (the marker is written
        inside the step), so uncommitted step directories are looked at again.
        """
        generation = self._generation
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
        # Kept only if this process changed nothing meanwhile. A listing taken
        # while the writer thread deleted a step, stored after the writer's own
        # fresh one, would outlive the deletion: the directory's mtime moves in
        # clock ticks (ext4: a few ms), so it may not tell the two apart.
        if generation == self._generation:
            self._listing = (mtime, found, frozenset(taken), frozenset(pending))
        return found

    def _committed(self, step: int) -> bool:
        return os.path.exists(os.path.join(self.step_dir(step), self.commit_marker or ""))

    def invalidate(self) -> None:
        """This process changed the directory: list it again next time."""
        self._generation += 1
        self._listing = None

    def refresh(self) -> None:
        """This process changed the directory: list it now (on a background thread).

        The next ``save()`` then finds the listing cached: it only ``stat``s.
        """
        self.invalidate()
        self.disk_steps()

    def listed(self, on_disk: frozenset[int] | None = None, *,
               remote: frozenset[int] = frozenset()) -> list[int]:
        """Committed and in-flight steps, minus those retention has condemned.

        ``on_disk``: ``disk_steps()`` as just read by the caller (not read again).
        ``remote``: a URL directory's steps committed in the bucket.
        """
        if on_disk is None:
            on_disk = self.disk_steps()
        committed = on_disk | remote if remote else on_disk
        if committed is not self._synced:  # the scan changed: the engine's listing follows
            self.steps.sync(self.names.name(s) for s in committed)
            self._synced = committed
        parse = self.names.parse
        return [parse(n) for n in self.steps.listed()]  # type: ignore[misc]

    # -- saves ---------------------------------------------------------------------------

    def reserve(self, step: int, metrics: Any, exists: Callable[[], type[Exception]],
                on_disk: frozenset[int] | None = None) -> Reservation:
        """Lists ``step`` as being saved from now on.

        ``on_disk``: ``disk_steps()`` as just read by the caller (not read again).
        ``exists`` makes the error type only when it is raised (orbax's, whose
        import took 0.2 s of the first save when it was made for every save).

        Raises:
            exists(): the step is saved or being saved already.
        """
        with self.steps.lock:
            if on_disk is None:
                on_disk = self.disk_steps()
            name = self.names.name(step)
            if step in on_disk or self.steps.in_flight(name) or self._name_taken(step, on_disk):
                raise exists()(
                    f"step {step} is already saved (or being saved) in {self.directory!r}")
            # The save's time as orbax's manager takes it (datetime.datetime.now at the call).
            return self.steps.reserve(name, StepRecord(_policies.now(), metrics))

    def _name_taken(self, step: int, on_disk: frozenset[int]) -> bool:
        """Whether ``step``'s name exists in the directory (as anything but an
        interrupted in-place write, which the save replaces).

        Read from the listing when ``on_disk`` is still it (this save read its
        mtime a moment ago: no ``lstat`` on the save's clock), else from disk.
        """
        listing = self._listing
        if listing is not None and listing[1] is on_disk:
            return step in listing[2]
        path = self.step_dir(step)
        if self.commit_marker is not None and os.path.isdir(path) and not self._committed(step):
            return False
        return os.path.lexists(path)

    def condemn(self, res: Reservation, config: ManagerConfig, *,
                remote: frozenset[int] = frozenset()) -> list[int]:
        """Applies retention as if ``res``'s step were saved; returns the steps condemned.

        They are hidden at once and deleted when the step is durable.
        ``remote``: a URL directory's steps committed in the bucket (retention
        decides what the bucket keeps).
        """
        if config.preservation_policy is None and config.max_to_keep is None:
            return []
        self.listed(remote=remote)
        decide = (self._by_policy(config) if config.preservation_policy is not None
                  else self._by_rules(config))
        parse = self.names.parse
        return [parse(n) for n in self.steps.retain(res, decide)]  # type: ignore[misc]

    def _by_rules(self, config: ManagerConfig) -> Callable:
        """orbax's retention options: ``max_to_keep`` (by recency or ``best_fn``) and
        ``keep_period`` by the engine's rules; ``keep_time_interval`` by orbax's own
        ``EveryNSeconds``, as orbax's manager composes them (a step any of them keeps
        stays).

        orbax's interval rule looks at every listed step, whatever keeps it: the
        oldest is kept, then each one at least the interval after the last one it
        kept. So it is asked over the whole listing (the new step included), not
        only over the steps the other rules leave.
        """
        policy = self._policy_for(config)
        parse = self.names.parse
        interval = config.keep_time_interval_s
        every = None if interval is None else _policies.every_n_seconds(int(interval))

        def decide(listed: list[tuple[str, StepRecord]], last: float) -> retention.Decision:
            candidates = [retention.Candidate(n, parse(n), rec.timestamp,
                                              config.metric(rec.metrics)) for n, rec in listed]
            decision = retention.apply(candidates, policy, last_preserved_timestamp=last)
            if every is None or not decision.delete:
                return decision
            steps = [parse(n) for n in self.steps.listed()]
            flags = _policies.preserved(every, self.policy_infos(steps)[:])  # type: ignore[arg-type]
            on_interval = {s for s, keep in zip(steps, flags, strict=True) if keep}
            dropped = [c for c in decision.delete if c.step not in on_interval]
            if len(dropped) == len(decision.delete):
                return decision
            kept = {id(c) for c in decision.keep} | {
                id(c) for c in decision.delete if c.step in on_interval}
            return retention.Decision(
                keep=[c for c in candidates if id(c) in kept], delete=dropped,
                preserve=decision.preserve,
                last_preserved_timestamp=decision.last_preserved_timestamp)

        return decide

    def _by_policy(self, config: ManagerConfig) -> Callable:
        """orbax's ``preservation_policy`` decides: steps it does not preserve are condemned.

        It sees every listed step, the new one included, as orbax's manager
        shows them to it; its answer is followed as given, so a policy that
        does not preserve the newest step has it deleted once it is durable.
        """
        parse = self.names.parse

        def decide(listed: list[tuple[str, StepRecord]], last: float) -> retention.Decision:
            steps = [parse(n) for n, _ in listed]
            keep = _policies.preserved(config.preservation_policy,
                                       self.policy_infos(steps)[:])  # type: ignore[arg-type]
            candidates = [retention.Candidate(n, s, rec.timestamp)
                          for (n, rec), s in zip(listed, steps, strict=True)]
            return retention.Decision(
                keep=[c for c, k in zip(candidates, keep, strict=True) if k],
                delete=[c for c, k in zip(candidates, keep, strict=True) if not k],
                preserve=[], last_preserved_timestamp=last)

        return decide

    def policy_infos(self, steps: list[int]) -> _policies.StepInfos:
        """The listed ``steps`` as orbax's ``CheckpointInfo`` records (built when read)."""
        return _policies.StepInfos(steps, self._timestamp_and_metrics)

    def _timestamp_and_metrics(self, step: int) -> tuple[float, Any]:
        rec = self.record(step)
        return rec.timestamp, rec.metrics

    def _policy_for(self, config: ManagerConfig) -> retention.RetentionPolicy:
        """``config``'s retention policy, built once per config (not on every save)."""
        cached = self._policy
        if cached is not None and cached[0] is config:
            return cached[1]
        policy = retention.RetentionPolicy(  # keep_time_interval: orbax's (``_by_rules``)
            max_to_keep=config.max_to_keep,
            keep_period=config.keep_period,
            best_mode=config.best_mode if config.best_fn is not None else None,
            keep_checkpoints_without_metrics=config.keep_checkpoints_without_metrics,
        )
        self._policy = (config, policy)
        return policy

    def settle(self, res: Reservation, *, committed: bool,
               deleter: Callable[[int], None] | None) -> None:
        """A save ended: on success its condemned steps are deleted (by ``deleter``; None
        on processes that do not delete), on failure they are listed again.

        Runs on the writer thread, which also lists the directory afresh, so
        the next ``save()`` finds the listing cached.
        """
        try:
            self.invalidate()  # published (or a failed save's leftovers removed)
            if not committed:
                self.steps.failed(res)
                return
            delete = None if deleter is None else (
                lambda name: deleter(self.names.parse(name)))  # type: ignore[arg-type]
            self.steps.committed(res, delete=delete, on_change=lambda _: self.invalidate())
        finally:
            self.refresh()

    def delete(self, step: int, deleter: Callable[[int], None] | None) -> None:
        """Deletes ``step`` now (``deleter`` None: hidden until the primary has deleted it)."""
        self.invalidate()
        delete = None if deleter is None else (lambda _: deleter(step))
        self.steps.delete(self.names.name(step), delete)

    # -- the writer lock and stale temporaries, once per process ----------------------

    def prepare(self, *, orbax_temps: bool = False) -> None:
        """Before this process's first save here: take the lock, clear stale temporaries.

        ``orbax_temps`` (orbax's ``cleanup_tmp_directories``): also remove
        orbax's temporaries and, in commit-file mode, step directories that
        were never committed.
        """
        self.steps.prepare(self._cleanup_orbax_temps if orbax_temps else None)
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


def save_time(meta: _metadata.StepMetadata) -> float:
    """A saved step's time for retention: when its ``save()`` was called, as the step
    recorded it (``init_timestamp_nsecs``: the manager's clock then, so a restarted
    manager sees the times the running one saw), else when it was committed."""
    if meta.init_timestamp_nsecs:
        return meta.init_timestamp_nsecs / 1e9
    return meta.created or 0.0


def delete_step_dir(view: StepView, step: int, todelete_subdir: str | None) -> None:
    """Removes a step: renamed out of the listing first, so a half-deleted step is never seen.

    The rename is all this does on the calling thread (the writer's, for
    retention); the files are removed by the step directory's ``removals``
    thread. With ``todelete_subdir`` the step is only moved there (orbax's
    soft delete).

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
        if commit_lib.move_aside(path, target):
            logger.debug("moved step %d to %s", step, trash)
        return
    remove_dir(view.steps, path)
    logger.debug("deleted step %d in %s (files removed in the background)", step, view.directory)


def view_for(directory: str, names: StepNames, commit_marker: str | None = None,
             legacy_ok: bool = False) -> StepView:
    """The view of ``directory`` shared by this process's managers (made on first use).

    Raises:
        ValueError: another live manager of this process names the steps of
            this directory differently, or commits them differently.
    """
    view, _ = shared("jax", directory,
                     lambda: StepView(directory, names, commit_marker, legacy_ok))
    if view.names != names:
        raise ValueError(
            f"another CheckpointManager of this process uses {directory!r} with other step "
            f"names ({view.names.name(1)!r} for step 1, this one {names.name(1)!r})"
        )
    if view.commit_mode != (commit_marker, legacy_ok):
        raise ValueError(
            f"another CheckpointManager of this process uses {directory!r} with another "
            "temporary_path_class / atomicity_options (steps committed by "
            f"{view.commit_mode[0] or 'rename'}, this one by {commit_marker or 'rename'})")
    return view

"""Retention stage: one checkpoint directory as this process sees it, for every manager.

``StepDirectory`` is the one bookkeeping under asyncckpt's managers (the
TensorFlow manager, the JAX manager, the job runner's store). It lists,
reserves, commits, fails, settles and deletes checkpoints, holds the
directory lock, and applies retention:

* **listing**: the committed checkpoints (as the front end finds them: a
  directory scan, ``sync``, or TensorFlow's state file, ``add``), plus the
  saves in flight, minus what retention condemned; each with its record
  (save time, metrics);
* **reserve**: a save's checkpoint is listed from its ``save()`` call, as
  TensorFlow's and orbax's managers list it;
* **retain**: retention is applied at that call (as both do). What it
  condemns is hidden at once and deleted only once the save that condemned
  it is durable; if that save fails, it is listed again;
* **committed** / **failed**: on the writer thread, once a save is durable
  (its deletions run then, and are retried at the next commit when they
  fail) or has failed; both settle the save (``wait_settled``);
* the **lock**: by default one writing process per directory
  (``DirectoryLock``), taken once per process for all of its managers of the
  directory (``prepare`` / ``leave``); where the framework lets several
  processes write one directory (TensorFlow's managers: ``per_checkpoint``),
  only the same checkpoint conflicts: a save holds its checkpoint's
  ``CheckpointLock`` from its call until it is settled, a deletion takes it
  too (and waits for a later commit while another process writes that
  checkpoint), and only temporaries whose checkpoint no one writes are
  stale. The stale temporaries are removed before the first save
  (``prepare``);
* saves of managers that were dropped without ``close()`` (a restart
  modelled in one process) are tracked, so a manager that takes over waits
  for them (``wait_orphans``).

The names are the front end's: a step directory's name, or a TensorFlow
checkpoint prefix's basename. Deleting a checkpoint's files is the front
end's too (``delete``), and so are the steps after a commit that only it
knows (TensorFlow's state file: ``on_change``). Managers of one directory in
one process share one object (``shared``), so their listings agree.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine import retention
from asyncckpt._engine._removals import BackgroundRemover
from asyncckpt._engine.lock import CheckpointLock, DirectoryLock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """What retention knows of a checkpoint: when it was saved, and its metrics."""

    timestamp: float
    metrics: Any = None


@dataclass(eq=False)
class Reservation:
    """One save of a checkpoint, from its ``save()`` call until it is settled.

    Attributes:
        name: The checkpoint's name.
        seq: Order of the save calls.
        record: Its record (save time, metrics).
        replaced: The record the name had before (a checkpoint saved again).
        condemned: What this save's retention took out of the listing
            (deleted once it is durable, listed again if it fails).
        committed: Set once the checkpoint is durable.
        future: Resolves when the save is durable or has failed (``attach``).
        lock: Its checkpoint's lock (``per_checkpoint``), released when settled.
    """

    name: str
    seq: int
    record: StepRecord
    replaced: StepRecord | None = None
    condemned: list[str] = field(default_factory=list)
    committed: bool = False
    settled: bool = False
    future: futures.Future | None = None
    lock: CheckpointLock | None = None


# With ``per_checkpoint``: a temporary made for no checkpoint (a state file's being
# replaced) is taken for a dead process's after this long.
_UNNAMED_TEMP_STALE_S = 3600.0

Decide = Callable[[list[tuple[str, StepRecord]], float], retention.Decision]
"""Retention: the listed checkpoints (oldest first) and the last preserved time -> decision."""


class StepDirectory:
    """The checkpoints of one directory as this process sees them (see the module docstring).

    Args:
        directory: The directory.
        order: Sort key of a name in the listing (a step number); None:
            by save time, oldest first (TensorFlow's manager).
        list_preserved: Whether checkpoints retention preserves forever stay
            listed (orbax: yes; TensorFlow's manager stops managing them).
        load_record: Reads the record of a committed checkpoint found on
            disk (its metadata); None: found checkpoints get the time they
            were found.
        per_checkpoint: Several processes may write the directory: each
            checkpoint is locked while it is written or deleted, not the
            directory (see the module docstring).
        checkpoint_of: With ``per_checkpoint``: the lock a temporary's writer
            holds, from the name the temporary was made for
            (``commit.temp_target``), or None (stale once an hour old).
    """

    def __init__(self, directory: str, *, order: Callable[[str], Any] | None = None,
                 list_preserved: bool = True,
                 load_record: Callable[[str], StepRecord] | None = None,
                 per_checkpoint: bool = False,
                 checkpoint_of: Callable[[str], str | None] | None = None):
        self.directory = directory
        self._order = order
        self._list_preserved = list_preserved
        self._load_record = load_record
        self.per_checkpoint = per_checkpoint
        self._checkpoint_of = checkpoint_of or (lambda _target: None)
        self.lock = threading.RLock()
        self._settled = threading.Condition(self.lock)
        self._io_lock = threading.Lock()  # one commit's file work at a time
        self._names: dict[str, None] = {}  # listed or condemned, in the order they came
        self._records: dict[str, StepRecord] = {}  # read or given; kept when a name goes
        self._committed: set[str] = set()
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._unsettled: collections.Counter[str] = collections.Counter()
        self._open: list[Reservation] = []  # not yet settled, in call order
        self._condemned: dict[str, Reservation | None] = {}  # None: due (its save is durable)
        self._preserved: set[str] = set()
        self.last_preserved = 0.0
        self._seq = 0
        self._latest: str | None = None
        self._latest_durable: tuple[int, str] | None = None  # (seq, name)
        self.retention_failures = 0
        self._tracked: dict[futures.Future, weakref.ref] = {}
        self.dir_lock = DirectoryLock(directory)
        self._users: weakref.WeakSet = weakref.WeakSet()
        self._prepared = False
        self.removals = BackgroundRemover(os.path.basename(directory.rstrip(os.sep)) or "dir")
        # Released once no manager and no save in flight refers to this object.
        weakref.finalize(self, self.dir_lock.release)

    # -- the listing -------------------------------------------------------------

    def add(self, name: str, record: StepRecord, *, newest: bool = False) -> None:
        """Lists a committed checkpoint the front end found (TensorFlow's state file);
        ``newest``: it is also the latest (one a killed process committed last)."""
        with self.lock:
            self._names.pop(name, None)
            self._names[name] = None
            self._records[name] = record
            self._committed.add(name)
            if newest:
                self.found_latest(name)

    def found_latest(self, name: str) -> None:
        """The front end's record names ``name`` the latest checkpoint, listed or not
        (TensorFlow's state file can name one its retention no longer manages)."""
        with self.lock:
            self._latest = name
            self._latest_durable = (0, name)
            self._committed.add(name)

    def drop(self, name: str) -> None:
        """Stops listing ``name`` without deleting it (no longer managed, as TensorFlow's
        manager drops checkpoints its clock rules no longer manage)."""
        with self.lock:
            if not self._in_flight[name]:
                self._unlist(name)

    def sync(self, committed: Iterable[str]) -> None:
        """The committed checkpoints on disk now (a directory scan): lists the new ones and
        forgets those gone (deleted by another process, or by this one's primary)."""
        found = set(committed)
        with self.lock:
            for name in found - self._names.keys():
                self._names[name] = None
            for name in list(self._names):
                if name not in found and not self._in_flight[name]:
                    self._unlist(name)
            self._committed = found

    def listed(self) -> list[str]:
        """The listed checkpoints: committed or in flight, not condemned, oldest first."""
        with self.lock:
            names = [n for n in self._names if n not in self._condemned and (
                self._list_preserved or n not in self._preserved)]
            if self._order is not None:
                return sorted(names, key=self._order)
            return sorted(names, key=lambda n: self.record(n).timestamp)

    def record(self, name: str) -> StepRecord:
        """A listed checkpoint's record (read from its metadata the first time it is asked)."""
        with self.lock:
            rec = self._records.get(name)
        if rec is None:
            rec = (self._load_record(name) if self._load_record is not None
                   else StepRecord(time.time()))
            with self.lock:
                self._records.setdefault(name, rec)
        return rec

    def reload(self) -> None:
        """Forgets the records read from disk (metrics, times), to read them again."""
        with self.lock:
            for name in list(self._records):
                if not self._in_flight[name]:
                    del self._records[name]

    def is_committed(self, name: str) -> bool:
        with self.lock:
            return name in self._committed

    def in_flight(self, name: str | None = None) -> bool:
        """Whether a save of ``name`` (None: of any checkpoint) is not yet settled."""
        with self.lock:
            if name is None:
                return any(self._unsettled.values())
            return self._unsettled[name] > 0

    def condemned(self) -> list[str]:
        """Checkpoints retention took out of the listing, not yet deleted, oldest first."""
        with self.lock:
            return [n for n in self._names if n in self._condemned]

    @property
    def latest(self) -> str | None:
        """The checkpoint saved (or found) last, listed."""
        with self.lock:
            return self._latest

    @property
    def latest_durable(self) -> str | None:
        """The checkpoint of the latest save call that is durable."""
        with self.lock:
            return None if self._latest_durable is None else self._latest_durable[1]

    # -- saves: reserve, retain, committed / failed --------------------------------

    def reserve(self, name: str, record: StepRecord, *, lock_wait_s: float = 0.0
                ) -> Reservation:
        """Lists ``name`` as being saved from now on (its ``save()`` call).

        A name saved again (TensorFlow's prefix) replaces its record, and a
        deletion retention had decided for it is called off. With
        ``per_checkpoint``, the checkpoint's lock is taken first (waiting up
        to ``lock_wait_s`` for another process writing the same checkpoint).

        Raises:
            DirectoryLockedError: another process still writes that checkpoint.
        """
        lock = None
        if self.per_checkpoint:
            lock = CheckpointLock(self.directory, name)
            lock.acquire(lock_wait_s)  # not under ``self.lock``: this may wait
        with self.lock:
            self._seq += 1
            replaced = self._records.get(name) if self._names.pop(name, 0) is None else None
            res = Reservation(name, self._seq, record, replaced=replaced, lock=lock)
            self._condemned.pop(name, None)
            self._names[name] = None
            self._records[name] = record
            self._in_flight[name] += 1
            self._unsettled[name] += 1
            self._open.append(res)
            self._latest = name
            return res

    def attach(self, res: Reservation, future: futures.Future) -> None:
        """The save's ``committed`` future: waits for the save go through it (``futures``)."""
        with self.lock:
            res.future = future

    def futures(self, names: Iterable[str] | None = None) -> list[futures.Future]:
        """The futures of the saves of ``names`` (None: all) not yet settled."""
        wanted = None if names is None else set(names)
        with self.lock:
            return [r.future for r in self._open if r.future is not None
                    and (wanted is None or r.name in wanted)]

    def retain(self, res: Reservation, decide: Decide) -> list[str]:
        """Applies retention as if ``res``'s save were durable; returns what it condemns.

        ``decide`` sees the listed checkpoints not preserved (the new one
        among them) and the last preserved time. What it preserves is kept
        forever; what it deletes is hidden at once and deleted once ``res``
        is durable.
        """
        with self.lock:
            listed = [n for n in self.listed() if n not in self._preserved]
            decision = decide([(n, self.record(n)) for n in listed], self.last_preserved)
            self.last_preserved = decision.last_preserved_timestamp
            self._preserved.update(c.key for c in decision.preserve)
            self.condemn(res, [c.key for c in decision.delete])
            return list(res.condemned)

    def condemn(self, res: Reservation, names: Iterable[str]) -> None:
        """Takes ``names`` out of the listing; deleted once ``res`` is durable, listed again
        if it fails (a backup taken again replaces its first copy)."""
        with self.lock:
            for name in names:
                if name in self._names and name not in self._condemned:
                    self._condemned[name] = res
                    res.condemned.append(name)

    def committed(self, res: Reservation, *, delete: Callable[[str], None] | None,
                  on_change: Callable[[frozenset[str]], None] | None = None) -> None:
        """``res``'s checkpoint is durable (the writer thread): deletes what its save condemned.

        ``delete`` removes a checkpoint's files; None where this process does
        not delete (a multi-process save's non-primary): condemned
        checkpoints then stay hidden until they are gone from disk
        (``sync``). ``on_change(deleting)`` runs before the deletions (and
        again, with nothing to delete, after deletions that failed): the
        front end's own record of the directory, which stops naming what is
        being deleted before its files go (TensorFlow's state file).
        Deletions that fail are logged, counted (``retention_failures``) and
        retried at the next commit; nothing here fails the save, which is
        durable already.
        """
        try:
            with self._io_lock:
                self._commit(res, delete, on_change)
        finally:
            self._settle(res)

    def _commit(self, res: Reservation, delete: Callable[[str], None] | None,
                on_change: Callable[[frozenset[str]], None] | None) -> None:
        with self.lock:
            res.committed = True
            self._committed.add(res.name)
            self._in_flight[res.name] -= 1
            if self._latest_durable is None or res.seq > self._latest_durable[0]:
                self._latest_durable = (res.seq, res.name)
            for name, cause in self._condemned.items():
                if cause is res:
                    self._condemned[name] = None  # due now, or at its own commit if in flight
            due = [n for n, cause in self._condemned.items()
                   if cause is None and not self._in_flight[n] and n in self._names]
        if delete is None:
            due = []  # another process deletes: hidden until gone from disk (``sync``)
        if on_change is not None:
            self._run_change(on_change, frozenset(due))
        failed = []
        for name in due:
            with self.lock:
                if self._in_flight[name] or self._condemned.get(name, res) is not None:
                    continue  # saved again meanwhile: not ours to delete
            lock = CheckpointLock(self.directory, name) if self.per_checkpoint else None
            if lock is not None and not lock.try_acquire():
                logger.info("not deleting %s in %s yet: another process writes it (retried "
                            "at the next commit)", name, self.directory)
                continue
            try:
                delete(name)
            except Exception as e:  # the save is durable; an old checkpoint must not fail it
                if lock is not None:
                    lock.release()
                failed.append(name)
                logger.warning("could not delete old checkpoint %s in %s (retrying at the next "
                               "save): %r", name, self.directory, e)
                continue
            except BaseException:
                if lock is not None:
                    lock.release()
                raise
            if lock is not None:
                lock.release()  # (its file goes with its last holder)
            with self.lock:
                self._forget(name)
        if failed:
            with self.lock:
                self.retention_failures += len(failed)
            if on_change is not None:
                self._run_change(on_change, frozenset())

    def _run_change(self, on_change: Callable[[frozenset[str]], None],
                    deleting: frozenset[str]) -> None:
        try:
            on_change(deleting)
        except Exception as e:
            with self.lock:
                self.retention_failures += 1
            logger.error("could not record the checkpoints of %s (will retry at the next "
                         "save): %r", self.directory, e)

    def failed(self, res: Reservation) -> None:
        """``res``'s save failed: it is no longer listed, and what it condemned is again."""
        with self.lock:
            if res.committed or res.settled:
                return
            self._in_flight[res.name] -= 1
            if res.name not in self._committed:
                if not self._in_flight[res.name]:
                    self._names.pop(res.name, None)
                    self._records.pop(res.name, None)
            elif res.replaced is not None:
                self._records[res.name] = res.replaced
            for name in res.condemned:
                if self._condemned.get(name) is res:
                    del self._condemned[name]
            if self._latest == res.name and res.name not in self._committed:
                self._latest = self.latest_durable
        self._settle(res)

    def _settle(self, res: Reservation) -> None:
        with self._settled:
            if not res.settled:
                res.settled = True
                res.future = None  # (its callbacks refer to the reservation: no cycle left)
                if res.lock is not None:
                    res.lock.release()
                self._unsettled[res.name] -= 1
                self._open.remove(res)
            self._settled.notify_all()

    def wait_settled(self, names: Iterable[str] | None = None,
                     timeout: float | None = None) -> bool:
        """Waits until the saves of ``names`` (None: all) are settled, deletions included."""
        wanted = None if names is None else set(names)
        with self._settled:
            return self._settled.wait_for(
                lambda: not any(c > 0 for n, c in self._unsettled.items()
                                if wanted is None or n in wanted), timeout=timeout)

    # -- deleting ----------------------------------------------------------------------

    def delete(self, name: str, delete: Callable[[str], None] | None) -> None:
        """Deletes a committed checkpoint now (a manager's ``delete``) with ``delete``.

        None where this process does not delete: the checkpoint is hidden
        until the deleting process has removed it.
        """
        if delete is None:
            with self.lock:
                self._condemned[name] = None
            return
        delete(name)
        with self.lock:
            self._forget(name)

    def _unlist(self, name: str) -> None:
        """``name`` is gone from disk: no longer listed (its record is kept)."""
        self._names.pop(name, None)
        self._committed.discard(name)
        self._condemned.pop(name, None)
        self._preserved.discard(name)

    def _forget(self, name: str) -> None:
        """This process deleted ``name``."""
        self._unlist(name)
        self._records.pop(name, None)

    # -- saves of dropped managers ---------------------------------------------------------

    def track(self, committed: futures.Future, owner: object) -> None:
        """Counts a save of this directory by ``owner`` until ``committed`` resolves."""
        with self.lock:
            self._tracked[committed] = weakref.ref(owner)
        committed.add_done_callback(self._untrack)

    def _untrack(self, committed: futures.Future) -> None:
        with self.lock:
            self._tracked.pop(committed, None)

    def wait_orphans(self, timeout: float | None) -> bool:
        """Waits for saves of managers of this directory that were dropped without ``close()``.

        Their retention and records decide what the directory holds, so a
        manager that took over waits for them too. Returns False if some
        were still in flight after ``timeout`` seconds.
        """
        with self.lock:
            orphans = [f for f, owner in self._tracked.items() if owner() is None]
        _, not_done = futures.wait(orphans, timeout=timeout)
        return not not_done

    # -- the directory lock ---------------------------------------------------------------

    def join(self, user: object) -> None:
        """``user`` (a manager) uses this directory until it ``leave``s.

        The lock is taken by ``prepare``, at its first save: a manager that
        only reads never takes it.
        """
        with self.lock:
            self._users.add(user)

    def prepare(self, cleanup: Callable[[], None] | None = None) -> None:
        """Before this process's first save here: the lock held, stale temporaries removed.

        ``cleanup``: the front end's own removal of what interrupted saves
        left (orbax's temporaries, files without their commit marker).
        Holding the lock, nobody else writes here: temporaries are stale.
        """
        with self.lock:
            if self._prepared:
                return
            commit_lib.ensure_writable_dir(self.directory)
            if self.per_checkpoint:
                commit_lib.cleanup_stale_temps(self.directory, stale=self._stale_temp)
            else:
                if not self.dir_lock.held:
                    self.dir_lock.acquire()
                commit_lib.cleanup_stale_temps(self.directory)
            if cleanup is not None:
                cleanup()
            self._prepared = True

    def _stale_temp(self, name: str) -> bool:
        """``per_checkpoint``: a temporary is stale when no process writes its checkpoint
        (its lock is free), or, made for no checkpoint, once it is an hour old."""
        target = commit_lib.temp_target(name)
        checkpoint = None if target is None else self._checkpoint_of(target)
        if checkpoint is None:
            try:
                age = time.time() - os.lstat(os.path.join(self.directory, name)).st_mtime
            except FileNotFoundError:
                return False
            return age > _UNNAMED_TEMP_STALE_S
        return self.is_free(checkpoint)

    def is_free(self, name: str) -> bool:
        """Whether no other process writes checkpoint ``name`` (``per_checkpoint``)."""
        if not self.per_checkpoint:
            return True
        lock = CheckpointLock(self.directory, name)
        if not lock.try_acquire():
            return False
        lock.release()
        return True

    @property
    def prepared(self) -> bool:
        return self._prepared

    def leave(self, user: object) -> None:
        """``user`` is closed: the last one releases the lock (once nothing is in flight)."""
        with self.lock:
            self._users.discard(user)
            if not self._users and not any(self._in_flight.values()):
                if not self.per_checkpoint:
                    self.dir_lock.release()
                self._prepared = False


def remove_dir(steps: StepDirectory, path: str) -> None:
    """Deletes a checkpoint's directory: renamed out of the listing first (one rename, on
    the calling thread), so a half-deleted checkpoint is never seen; its files are then
    removed by ``steps``' background remover."""
    doomed = commit_lib.claim_temp(os.path.join(
        os.path.dirname(path),
        f"{commit_lib.TEMP_PREFIX}deleted-{os.path.basename(path)}-{uuid.uuid4().hex[:8]}"))
    if not commit_lib.move_aside(path, doomed):
        commit_lib.forget_temp(doomed)
        return
    steps.removals.submit(doomed)


_S = TypeVar("_S")
_SHARED: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def shared(kind: str, directory: str, make: Callable[[], _S]) -> tuple[_S, bool]:
    """The object of ``kind`` this process keeps for ``directory`` (by real path), made
    on first use; returns it and whether it was made now. Held weakly: it lives as long
    as a manager or a save in flight refers to it."""
    key = (kind, os.path.realpath(os.path.abspath(directory)))
    with _SHARED_LOCK:
        found = _SHARED.get(key)
        if found is not None:
            return found, False
        made = make()
        _SHARED[key] = made
        return made, True

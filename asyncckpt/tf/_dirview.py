"""The in-process view of one checkpoint directory, shared by its managers.

``tf.train.CheckpointManager`` updates ``latest_checkpoint``, ``checkpoints``
and its retention decisions when ``save()`` is called; asyncckpt must do the
same while the files are still being written, and must only let the on-disk
``checkpoint`` state file and the deletions follow once a checkpoint is
durable. This module keeps both:

* the *view*: what TensorFlow's manager would hold in memory, updated at the
  ``save()`` call (training thread);
* the *durable* record: which of those checkpoints are committed, what the
  state file may name, and which deletions wait for which save (writer
  threads).

One view per real directory path per process (held weakly in a registry), so
two managers of a directory agree on listings and commit one at a time; the
directory lock is taken once per view and released by the last manager's
``close()``, or when the view is garbage-collected.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

from asyncckpt import layout
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine import retention
from asyncckpt._engine.lock import DirectoryLock
from asyncckpt._engine.manifest import read_manifest
from asyncckpt._engine.metrics import SaveStats
from asyncckpt.tf import _compat, _statefile
from asyncckpt.tf._job import delete_checkpoint, manifest_path

# In the manifest's ``extra`` of every checkpoint a manager saves.
MANAGED_KEY = "managed"

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SaveTicket:
    """One manager save between its call and its end.

    Attributes:
        name: Checkpoint file prefix relative to the directory.
        seq: Order of the save call.
        removed: Entries the save's retention sweep took out of the view,
            ``(name, timestamp)``, deleted only after this save is durable.
        replaced: The timestamp ``name`` had in the view before (a re-save).
        committed: Set once the checkpoint is durable.
    """

    name: str
    seq: int
    removed: list[tuple[str, float]] = field(default_factory=list)
    replaced: float | None = None
    committed: bool = False


@dataclass(eq=False)
class _PendingDelete:
    name: str
    timestamp: float
    ticket: SaveTicket
    failures: int = 0


class DirectoryView:
    """Shared in-process state of one checkpoint directory (see module docstring)."""

    def __init__(self, abs_dir: str, fsync: bool):
        self.abs_dir = abs_dir
        self.fsync = fsync
        self.lock = threading.RLock()  # the in-memory view; never held for file work
        self.io_lock = threading.Lock()  # one commit (state file, deletions) at a time
        self.maybe_delete: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.latest: str | None = None
        self.last_preserved = 0.0
        self.durable: set[str] = set()
        self.latest_durable: str | None = None
        self._latest_durable_seq = -1
        self.inflight: collections.Counter[str] = collections.Counter()
        self.pending_deletes: list[_PendingDelete] = []
        self._saves: dict[futures.Future, weakref.ref] = {}  # in flight -> its manager
        self.retention_failures = 0
        # A URL directory's scratch view: deletes a checkpoint in the bucket,
        # and uploads the state file there.
        self._remote_delete: Callable[[str], None] | None = None
        self._upload_state: Callable[[str], None] | None = None
        self._seq = 0
        self.dir_lock = DirectoryLock(abs_dir)
        self.lock_users: weakref.WeakSet = weakref.WeakSet()
        weakref.finalize(self, self.dir_lock.release)
        self._load()

    # -- reading the directory ---------------------------------------------------

    def _load(self) -> None:
        now = time.time()
        state = _statefile.read_state(self.abs_dir)  # a damaged one rebuilt from disk
        if state is None:
            self.last_preserved = now - 1.0
            self._adopt_unrecorded([], now)
            return
        latest = state.model_checkpoint_path or None
        self.latest = self.latest_durable = self.rel(latest) if latest else None
        self.last_preserved = state.last_preserved_timestamp
        paths = list(state.all_model_checkpoint_paths)
        stamps = list(state.all_model_checkpoint_timestamps)
        entries = []
        for path, stamp in zip(paths, stamps or [None] * len(paths), strict=False):
            if not os.path.exists(path + ".index"):
                logger.warning("%s is listed in %s/checkpoint but its files are gone; "
                               "no longer managing it", path, self.abs_dir)
                continue
            entries.append((self.rel(path), stamp))
        self._rebuild(entries, now)
        self.durable.update(name for name, _ in entries)
        if self.latest:
            self.durable.add(self.latest)
        self._adopt_unrecorded([name for name, _ in entries], now)

    def _adopt_unrecorded(self, known: list[str], now: float) -> None:
        """Takes in manager checkpoints committed after the state file was last written.

        The state file is written after a checkpoint is committed (publish is
        the line), so a process killed in between leaves a durable checkpoint,
        already reported as saved, that the state file does not name. It is
        adopted as the newest, as its manager would have recorded it. Only
        checkpoints a manager wrote (their manifest says so) and committed after
        the state file's last write qualify: older files not named there are
        retention's, on their way out.
        """
        state_path = os.path.join(self.abs_dir, "checkpoint")
        try:
            state_mtime = os.stat(state_path).st_mtime_ns
        except FileNotFoundError:
            state_mtime = -1
        found = []
        for name in _managed_checkpoints(self.abs_dir):
            if name in known or name == self.latest:
                continue
            mtime = os.stat(os.path.join(self.abs_dir, name + ".index")).st_mtime_ns
            if mtime > state_mtime:
                found.append((mtime, name))
        for mtime, name in sorted(found):
            logger.warning("%s was committed but the state file does not name it (a process "
                           "stopped in between): managing it as the newest checkpoint",
                           os.path.join(self.abs_dir, name))
            self.maybe_delete[name] = min(mtime / 1e9, now)
            self.durable.add(name)
            self.latest = self.latest_durable = name

    def _rebuild(self, entries: list[tuple[str, float | None]], now: float) -> None:
        # tf.train.CheckpointManager's rules for a recovered state.
        if now < self.last_preserved:
            logger.warning(
                "time.time() returned a value %f seconds behind the last preserved "
                "checkpoint timestamp.", self.last_preserved - now,
            )
            self.last_preserved = now
        self.maybe_delete.clear()
        for name, stamp in entries:
            stamp = min(self.last_preserved if stamp is None else stamp, now)
            if stamp > self.last_preserved:
                self.maybe_delete[name] = stamp

    def adopt_remote(self, entries: list[tuple[str, float]], *,
                     state: tuple[list[tuple[str, float | None]], float] | None,
                     delete: Callable[[str], None], upload_state: Callable[[str], None]) -> None:
        """Manages checkpoints committed in the URL directory this scratch view stands for.

        A URL directory's manager writes through a fresh local scratch
        directory, so its view starts empty. What it manages is what
        TensorFlow's manager would take from its state file: ``state``, the
        state file the managers keep in the bucket (``(managed, last
        preserved timestamp)``), read as ``_load`` reads a local one, with
        the committed checkpoints (``entries``, ``(name, commit time)``,
        oldest first) standing for the files; a checkpoint committed after
        its last upload (numbered above every one it names) is adopted as
        the newest. Without a state file every committed checkpoint is
        managed. Managed checkpoints are subject to retention, as every later
        save: what it drops is deleted in the scratch directory and, by
        ``delete(name)``, in the bucket; each state file written from now on
        is also passed to ``upload_state``.
        """
        with self.lock:
            self._remote_delete = delete
            self._upload_state = upload_state
            now = time.time()
            committed = dict(entries)
            if state is None:
                adopted = [(n, min(t, now)) for n, t in entries]
            else:
                listed, self.last_preserved = state
                self._rebuild([(n, t) for n, t in listed if n in committed], now)
                adopted = list(self.maybe_delete.items())
                newest = max((layout.tf_step_of(n) or -1 for n, _ in listed), default=-1)
                adopted += [(n, min(t, now)) for n, t in entries
                            if (layout.tf_step_of(n) or -1) > newest]
            self.maybe_delete.clear()
            for name, stamp in adopted:
                if name in self.inflight:
                    continue
                self.maybe_delete[name] = stamp
                self.durable.add(name)
                self.latest = self.latest_durable = name

    def attach(self) -> None:
        """A new manager joins: apply TensorFlow's clock check to the shared view."""
        with self.lock:
            now = time.time()
            if now < self.last_preserved:
                self._rebuild(list(self.maybe_delete.items()), now)

    def rel(self, path: str) -> str:
        return os.path.relpath(os.path.abspath(path), self.abs_dir)

    # -- the training thread: save() -------------------------------------------

    def record_save(self, name: str, policy: retention.RetentionPolicy) -> SaveTicket:
        """Updates the view as ``tf.train.CheckpointManager.save`` would, at the call."""
        with self.lock:
            self._seq += 1
            ticket = SaveTicket(name, self._seq)
            ticket.replaced = self.maybe_delete.pop(name, None)
            # Saving a name again supersedes an earlier decision to delete it.
            self.pending_deletes = [p for p in self.pending_deletes if p.name != name]
            self.maybe_delete[name] = time.time()
            self.latest = name
            self.inflight[name] += 1
            decision = retention.apply(
                [retention.Candidate(n, None, t) for n, t in self.maybe_delete.items()],
                policy,
                last_preserved_timestamp=self.last_preserved,
            )
            for c in decision.preserve:
                del self.maybe_delete[c.key]
            for c in decision.delete:
                del self.maybe_delete[c.key]
                ticket.removed.append((c.key, c.timestamp))
                self.pending_deletes.append(_PendingDelete(c.key, c.timestamp, ticket))
            self.last_preserved = decision.last_preserved_timestamp
            return ticket

    def save_failed(self, ticket: SaveTicket) -> None:
        """Undoes a save that never became durable: its sweep is given back."""
        with self.lock:
            if ticket.committed:
                return  # durable; only a write callback failed afterwards
            self.inflight[ticket.name] -= 1
            if self.inflight[ticket.name] <= 0:
                del self.inflight[ticket.name]
            if ticket.name not in self.durable:
                self.maybe_delete.pop(ticket.name, None)
            elif ticket.replaced is not None and ticket.name in self.maybe_delete:
                self.maybe_delete[ticket.name] = ticket.replaced
            self.pending_deletes = [p for p in self.pending_deletes if p.ticket is not ticket]
            restored = dict(self.maybe_delete)
            restored.update(ticket.removed)
            self.maybe_delete = collections.OrderedDict(
                sorted(restored.items(), key=lambda item: item[1])
            )
            if self.latest == ticket.name and ticket.name not in self.durable:
                self.latest = self.latest_durable

    # -- the writer thread: commit --------------------------------------------

    def committed(self, ticket: SaveTicket, path: str, stats: SaveStats) -> None:
        """A manager save is durable: write the state file, then apply its deletions.

        Commits of one directory run one at a time (``io_lock``); the file
        work runs outside the view's lock, so a ``save()`` call on the
        training thread never waits for it. Failures here (the state file,
        deleting old checkpoints) do not fail the save, which is durable
        already: they are logged, counted in ``retention_failures``, and
        retried at the next commit; a checkpoint that could not be deleted
        stays named in the state file.
        """
        del path, stats
        with self.io_lock:
            with self.lock:
                ticket.committed = True
                self.durable.add(ticket.name)
                self.inflight[ticket.name] -= 1
                if self.inflight[ticket.name] <= 0:
                    del self.inflight[ticket.name]
                if ticket.seq > self._latest_durable_seq:
                    self._latest_durable_seq = ticket.seq
                    self.latest_durable = ticket.name
                due = [
                    p for p in self.pending_deletes
                    if p.ticket.committed and p.name not in self.inflight
                ]
                # The state file stops naming a checkpoint before its files go.
                text = self._state_text([p for p in self.pending_deletes if p not in due])
            self._write_state_file(text)
            failed = []
            for p in due:
                with self.lock:
                    if p.name in self.inflight:  # saved again meanwhile: not ours to delete
                        continue
                try:
                    delete_checkpoint(os.path.join(self.abs_dir, p.name))
                    if self._remote_delete is not None:
                        self._remote_delete(p.name)  # in the background
                    logger.debug("retention deleted %s", p.name)
                except OSError as e:
                    p.failures += 1
                    failed.append(p)
                    logger.error("could not delete old checkpoint %s (will retry at the next "
                                 "save): %r", p.name, e)
            with self.lock:
                self.retention_failures += len(failed)
                for p in due:
                    if p not in failed:
                        self.durable.discard(p.name)
                self.pending_deletes = [
                    p for p in self.pending_deletes if p not in due or p in failed
                ]
                text = self._state_text(self.pending_deletes) if failed else None
            if text is not None:
                self._write_state_file(text)

    def _state_text(self, extra: list[_PendingDelete]) -> str:
        # Names only durable checkpoints; checkpoints waiting to be deleted
        # (``extra``) stay listed, oldest first, so no file is ever forgotten.
        entries = [(p.name, p.timestamp) for p in extra if p.name in self.durable]
        listed = {name for name, _ in entries}
        entries += [
            (n, t) for n, t in self.maybe_delete.items() if n in self.durable and n not in listed
        ]
        # The newest durable checkpoint goes last, where TensorFlow expects the
        # latest one (a name saved again may sit later in the view while its
        # new files are still being written).
        latest = [e for e in entries if e[0] == self.latest_durable]
        if not latest and self.latest_durable:
            # Known but unmanaged (a clock set back): listed, never to be deleted.
            latest = [(self.latest_durable, self.last_preserved)]
        entries = [e for e in entries if e[0] != self.latest_durable] + latest
        return _compat.checkpoint_state_text(
            self.abs_dir,
            self.latest_durable or "",
            [n for n, _ in entries],
            [t for _, t in entries],
            self.last_preserved,
        )

    def _write_state_file(self, text: str) -> None:
        try:
            commit_lib.write_text_atomic(
                os.path.join(self.abs_dir, "checkpoint"), text, fsync=self.fsync
            )
            if self._upload_state is not None:
                self._upload_state(text)  # a URL directory: beside the checkpoints
        except Exception as e:
            with self.lock:
                self.retention_failures += 1
            logger.error("could not update %s/checkpoint (will retry at the next save): %r",
                         self.abs_dir, e)

    def track(self, committed: futures.Future, owner: object) -> None:
        """Counts a save of this directory by ``owner`` until ``committed`` ends."""
        with self.lock:
            self._saves[committed] = weakref.ref(owner)
        committed.add_done_callback(self._untrack)

    def _untrack(self, committed: futures.Future) -> None:
        with self.lock:
            self._saves.pop(committed, None)

    def wait_orphans(self, timeout: float | None) -> bool:
        """Waits for the saves of managers of this directory that were dropped.

        A manager dropped for a restart (no ``close()``, as TensorFlow's tests
        model one) keeps writing; its saves' retention and state-file writes
        decide what the directory holds, so ``sync()`` of a manager that took
        over waits for them too. Saves of managers still alive are theirs to
        wait for; errors of a dropped manager's saves are logged by the engine
        and not raised here.

        Returns:
            False if such saves were still in flight after ``timeout`` seconds.
        """
        with self.lock:
            orphans = [f for f, owner in self._saves.items() if owner() is None]
        _, not_done = futures.wait(orphans, timeout=timeout)
        return not not_done

    # -- listings -------------------------------------------------------------------

    def names(self) -> list[str]:
        with self.lock:
            return list(self.maybe_delete)

    def entries(self) -> list[tuple[str, float]]:
        """The managed checkpoints and their timestamps, oldest first."""
        with self.lock:
            return list(self.maybe_delete.items())

    def newest_first(self) -> list[str]:
        with self.lock:
            names = list(reversed(self.maybe_delete))
            for name in (self.latest, self.latest_durable):
                if name and name not in names:
                    names.append(name)
            return names

    # -- the directory lock -------------------------------------------------------

    def take(self, user: object) -> bool:
        """Takes the directory lock for ``user``; True the first time in this process."""
        with self.lock:
            first = not self.dir_lock.held
            if first:
                self.dir_lock.acquire()
            self.lock_users.add(user)
            return first

    def leave(self, user: object) -> None:
        """``user`` is closed: the last one releases the directory lock."""
        with self.lock:
            self.lock_users.discard(user)
            if not self.lock_users and not self.inflight:
                self.dir_lock.release()


_VIEWS: weakref.WeakValueDictionary[str, DirectoryView] = weakref.WeakValueDictionary()
_VIEWS_LOCK = threading.Lock()


def _managed_checkpoints(directory: str) -> list[str]:
    """Names of the committed checkpoints in ``directory`` that a manager wrote."""
    names = []
    try:
        entries = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return names  # created at the first save
    for entry in entries:
        if not entry.endswith(".index"):
            continue
        prefix = os.path.join(directory, entry[: -len(".index")])
        try:
            manifest = read_manifest(manifest_path(prefix))  # (a FIFO there: no wait)
        except (OSError, ValueError):
            continue  # not ours, or not whole: never adopted
        if manifest.extra.get(MANAGED_KEY):
            names.append(entry[: -len(".index")])
    return names


def view_for(directory: str, *, fsync: bool) -> DirectoryView:
    """The process's view of ``directory``, read from disk if nobody holds one."""
    key = os.path.realpath(os.path.abspath(directory))
    with _VIEWS_LOCK:
        view = _VIEWS.get(key)
        if view is None:
            view = DirectoryView(os.path.abspath(directory), fsync)
            _VIEWS[key] = view
            return view
    view.attach()
    return view

"""TensorFlow's managed checkpoints and state file, on the engine's ``StepDirectory``.

``tf.train.CheckpointManager`` updates ``latest_checkpoint``, ``checkpoints``
and its retention decisions when ``save()`` is called; asyncckpt does the
same while the files are still being written, and lets the on-disk
``checkpoint`` state file and the deletions follow only once a checkpoint is
durable. The bookkeeping of that is the engine's ``StepDirectory``
(``_engine/steps.py``), shared with the other managers; this module adds
what is TensorFlow's:

* the listing is the manager's managed list (``all_model_checkpoint_paths``
  with their timestamps), read from the state file when the directory is
  first opened (with TensorFlow's clock rules, and the checkpoints a killed
  process committed after its last state file adopted), ordered by save
  time; checkpoints that ``keep_checkpoint_every_n_hours`` preserves are no
  longer managed, as in TensorFlow;
* at each commit the state file is rewritten (atomically) to name the
  durable checkpoints, the newest last, before the files retention drops
  are deleted (index first).

One view per real directory path per process, so managers of a directory
agree on listings and commit one at a time.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from asyncckpt import layout
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine import retention
from asyncckpt._engine.lock import CheckpointLock
from asyncckpt._engine.manifest import read_manifest
from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.steps import Reservation, StepDirectory, StepRecord, shared
from asyncckpt.tf import _compat, _statefile
from asyncckpt.tf._job import LOCK_WAIT_S, delete_checkpoint, manifest_path

logger = logging.getLogger(__name__)


class ManagedCheckpoints:
    """The TensorFlow managers' checkpoints of one directory (see the module docstring)."""

    def __init__(self, abs_dir: str, fsync: bool):
        self.abs_dir = abs_dir
        self.fsync = fsync
        # Several processes may write one directory, as with TensorFlow's manager:
        # each checkpoint is locked while written or deleted, not the directory.
        self.steps = StepDirectory(abs_dir, list_preserved=False, per_checkpoint=True,
                                   checkpoint_of=_prefix_of_marker)
        # A URL directory's scratch view: deletes a checkpoint in the bucket,
        # and uploads the state file there.
        self._remote_delete: Callable[[str], None] | None = None
        self._upload_state: Callable[[str], None] | None = None
        self._load()

    # -- reading the directory ---------------------------------------------------

    def _load(self) -> None:
        now = time.time()
        state = _statefile.read_state(self.abs_dir)  # a damaged one rebuilt from disk
        if state is None:
            self.steps.last_preserved = now - 1.0
            self._adopt_unrecorded([], now)
            return
        latest = state.model_checkpoint_path or None
        self.steps.last_preserved = state.last_preserved_timestamp
        paths = list(state.all_model_checkpoint_paths)
        stamps = list(state.all_model_checkpoint_timestamps)
        entries = []
        for path, stamp in zip(paths, stamps or [None] * len(paths), strict=False):
            if not os.path.exists(path + ".index"):
                logger.warning("%s is listed in %s/checkpoint but its files are gone; "
                               "no longer managing it", path, self.abs_dir)
                continue
            entries.append((self.rel(path), stamp))
        if latest:
            self.steps.found_latest(self.rel(latest))
        self._rebuild(entries, now)
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
        state_path = os.path.join(self.abs_dir, layout.TF_STATE_FILE)
        try:
            state_mtime = os.stat(state_path).st_mtime_ns
        except FileNotFoundError:
            state_mtime = -1
        found = []
        latest = self.steps.latest
        for name in _managed_checkpoints(self.abs_dir):
            if name in known or name == latest:
                continue
            mtime = os.stat(os.path.join(self.abs_dir, name + ".index")).st_mtime_ns
            if mtime > state_mtime:
                found.append((mtime, name))
        for mtime, name in sorted(found):
            logger.warning("%s was committed but the state file does not name it (a process "
                           "stopped in between): managing it as the newest checkpoint",
                           os.path.join(self.abs_dir, name))
            self.steps.add(name, StepRecord(min(mtime / 1e9, now)), newest=True)

    def _rebuild(self, entries: list[tuple[str, float | None]], now: float) -> None:
        """``tf.train.CheckpointManager``'s rules for a recovered list: what it manages."""
        steps = self.steps
        if now < steps.last_preserved:
            logger.warning(
                "time.time() returned a value %f seconds behind the last preserved "
                "checkpoint timestamp.", steps.last_preserved - now,
            )
            steps.last_preserved = now
        for name, stamp in entries:
            stamp = min(steps.last_preserved if stamp is None else stamp, now)
            if stamp > steps.last_preserved:
                steps.add(name, StepRecord(stamp))
            else:
                steps.drop(name)  # preserved: kept, never managed again

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
        steps = self.steps
        with steps.lock:
            self._remote_delete = delete
            self._upload_state = upload_state
            now = time.time()
            committed = dict(entries)
            for name in steps.listed():
                steps.drop(name)
            if state is None:
                adopted = [(n, min(t, now)) for n, t in entries]
            else:
                listed, steps.last_preserved = state
                self._rebuild([(n, t) for n, t in listed if n in committed], now)
                adopted = [(n, steps.record(n).timestamp) for n in steps.listed()]
                for name, _ in adopted:
                    steps.drop(name)
                newest = max((layout.tf_step_of(n) or -1 for n, _ in listed), default=-1)
                adopted += [(n, min(t, now)) for n, t in entries
                            if (layout.tf_step_of(n) or -1) > newest]
            for name, stamp in adopted:
                if not steps.in_flight(name):
                    steps.add(name, StepRecord(stamp), newest=True)

    def attach(self) -> None:
        """A new manager joins: TensorFlow's clock check on the shared view."""
        steps = self.steps
        with steps.lock:
            now = time.time()
            if now < steps.last_preserved:
                self._rebuild([(n, steps.record(n).timestamp) for n in steps.listed()], now)

    def rel(self, path: str) -> str:
        return os.path.relpath(os.path.abspath(path), self.abs_dir)

    # -- the training thread: save() -------------------------------------------

    def record_save(self, name: str, policy: retention.RetentionPolicy) -> Reservation:
        """Updates the view as ``tf.train.CheckpointManager.save`` would, at the call.

        Raises:
            DirectoryLockedError: another process has been writing a
                checkpoint of the same name for ``LOCK_WAIT_S``.
        """
        res = self.steps.reserve(name, StepRecord(time.time()), lock_wait_s=LOCK_WAIT_S)

        def decide(listed: list[tuple[str, StepRecord]], last: float) -> retention.Decision:
            return retention.apply([retention.Candidate(n, None, rec.timestamp)
                                    for n, rec in listed], policy,
                                   last_preserved_timestamp=last)

        self.steps.retain(res, decide)
        return res

    # -- the writer thread: commit --------------------------------------------

    def committed(self, res: Reservation, path: str, stats: SaveStats) -> None:
        """A manager save is durable: the state file is written, then its deletions done.

        Commits of one directory run one at a time; the file work runs
        outside the listing's lock, so a ``save()`` on the training thread
        never waits for it. Failures here (the state file, deleting old
        checkpoints) do not fail the save, which is durable already: they are
        logged, counted in ``retention_failures``, and retried at the next
        commit; a checkpoint that could not be deleted stays named in the
        state file.
        """
        del path, stats
        self.steps.committed(res, delete=self.delete, on_change=self.write_state_file)

    def delete(self, name: str) -> None:
        """Deletes the checkpoint ``name`` (retention), index first."""
        delete_checkpoint(os.path.join(self.abs_dir, name))
        if self._remote_delete is not None:
            self._remote_delete(name)  # in the background
        logger.debug("retention deleted %s", name)

    def _state_text(self, deleting: frozenset[str]) -> str:
        """The state file: the durable checkpoints, those retention dropped but not
        yet deleted first (no file is ever forgotten), the newest durable one last."""
        steps = self.steps
        with steps.lock:
            latest = steps.latest_durable
            names = [n for n in steps.condemned() if n not in deleting]
            names += [n for n in steps.listed() if n not in names]
            entries = [(n, steps.record(n).timestamp) for n in names
                       if steps.is_committed(n) and n != latest]
            if latest:
                # Known but not managed (a clock set back): listed, never deleted.
                stamp = (steps.record(latest).timestamp
                         if latest in names else steps.last_preserved)
                entries.append((latest, stamp))
            last_preserved = steps.last_preserved
        return _compat.checkpoint_state_text(
            self.abs_dir, latest or "", [n for n, _ in entries], [t for _, t in entries],
            last_preserved)

    def write_state_file(self, deleting: frozenset[str]) -> None:
        """Rewrites the state file (atomically) to name the durable checkpoints."""
        text = self._state_text(deleting)
        # Other processes' managers may write it too (last writer wins, as in
        # TensorFlow); the lock keeps their cleanup off its temporary.
        lock = CheckpointLock(self.abs_dir, layout.TF_STATE_FILE)
        lock.acquire(LOCK_WAIT_S)
        try:
            commit_lib.write_text_atomic(
                os.path.join(self.abs_dir, layout.TF_STATE_FILE), text, fsync=self.fsync)
        finally:
            lock.release()
        if self._upload_state is not None:
            self._upload_state(text)  # a URL directory: beside the checkpoints

    # -- listings -------------------------------------------------------------------

    def entries(self) -> list[tuple[str, float]]:
        """The managed checkpoints and their timestamps, oldest first."""
        steps = self.steps
        with steps.lock:
            return [(n, steps.record(n).timestamp) for n in steps.listed()]

    def newest_first(self) -> list[str]:
        steps = self.steps
        with steps.lock:
            names = list(reversed(steps.listed()))
            for name in (steps.latest, steps.latest_durable):
                if name and name not in names:
                    names.append(name)
            return names


def _prefix_of_marker(target: str) -> str:
    """The lock a temporary's writer holds, from the name it was made for: a checkpoint's
    (its marker, ``ckpt-3.index``: ``ckpt-3``), or the file's own (the state file's
    ``checkpoint``, written under ``STATE_LOCK``)."""
    if target.endswith(layout.TF_INDEX_SUFFIX):
        return target[: -len(layout.TF_INDEX_SUFFIX)]
    return target


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
        if manifest.extra.get(_statefile.MANAGED_KEY):
            names.append(entry[: -len(".index")])
    return names


def view_for(directory: str, *, fsync: bool,
             view_class: type[ManagedCheckpoints] = ManagedCheckpoints) -> ManagedCheckpoints:
    """The process's view of ``directory``, read from disk if nobody holds one.

    ``view_class`` makes it when none is held (a subclass wraps its deletions
    or state file writes).
    """
    path = os.path.abspath(directory)
    view, made = shared("tf", path, lambda: view_class(path, fsync))
    if not made:
        view.attach()
    return view

"""Multi-process commit and restore verdicts through the JAX distributed key-value store.

Every process writes its own shards into one shared temporary directory; the
checkpoint may be published only after all of them are done. The processes
agree through the coordination service's key-value store (the same service
``jax.distributed.initialize`` starts), never through collectives: the waits
below run on each process's background writer thread, where a collective
could deadlock against the training step's own collectives.

**Names.** A manager's keys live under ``asyncckpt/d<hash>.<n>/``: ``hash``
is derived from the directory as the program names it (a URL without its
trailing slash, a path normalized), ``n`` counts the managers this process
made for that directory. Managers are therefore matched across processes by
their directory, whatever order the program creates them in.

**Sequence numbers.** Each save has keys ``s<seq>-<step>/``. Every save that
a process *attempts* uses one number: every ``save()`` that gets past the
argument checks and the save schedule (``should_save``, the same answer on
every process), including one that then raises before anything is staged.
A process that fails before staging still answers for that number, so no
process waits for it; and in a multi-process run ``save()`` stages first and
raises the failures of earlier saves after (see the manager), because a
process that skipped a save on its own would fail it on every other one.

What can happen on one process only, and how each keeps the numbers aligned:

* an earlier save's failure, which reaches each process at its own time:
  raised after this save is staged, never instead of it;
* a staging error (a leaf only this process holds, memory), the step found
  to exist (listings can differ for a moment after a failed save), the
  directory lock or cleanup (process 0): the number is used, and the failure
  is reported under it (``Saves.attempt``), so the others' save fails at once;
* a write, fsync or commit error: reported under the save's keys, and one
  verdict is raised everywhere.

What must be the same on every process (the caller's part): the steps given
to ``save()``, in the same order, and ``should_save``'s answer (the save
schedule, the preemption point agreed by JAX, and "not after the latest
step", which holds for increasing steps).

**One save.** Nothing per file goes through the store: each process's file
records go into its manifest part, next to its files (``_parts``).

1. each non-primary process, once its files are durable, writes its part
   and sets ``done/<process>`` to ``ok:<files>:<crc32 of the part>`` (or
   to its error, at most ``_MAX_TEXT`` characters);
2. the primary waits for every ``done/<i>``, reads the parts in parallel
   and checks each against its digest (a part it cannot find means the
   directory is not shared between the processes: the save fails here,
   naming it), merges OCDBT databases, writes the manifest, publishes the
   directory by rename, applies retention, then sets ``commit``: ``ok``,
   or the verdict naming every process's failure;
3. every process raises the same ``DistributedSaveError`` for a failed
   save (on the process at fault, with its own error as the cause); the
   non-primary processes wait for ``commit`` before their save counts as
   finished, so ``wait_until_finished()`` returns everywhere only once the
   checkpoint is visible.

**Deleting keys.** Each process's writer thread handles its saves in order,
so once every process's writer has answered save *k* (``done/<i>``), each has
finished reading the keys of every earlier save. The primary then deletes
them (not *k*'s own, nor a later save's verdict it announced meanwhile). An
answer a process gives on raising before staging comes from its training
thread and proves nothing, so it deletes nothing. The
keys of the newest save and the manager's ``ready`` stay; the number of keys
does not grow with the number of saves.

**First save of a manager.** The primary takes the directory lock, removes
stale temporaries and then publishes a run token (``ready``) that names the
temporary directories; the other processes wait for it, so no process writes
into a directory that the cleanup could still remove.

So per save each process sets one key and reads one (process 0 reads one
per process and sets one), whatever the number of arrays and files.

**Restore.** Each process computes, from the target's shardings, which
chunk files every process reads (and so checks); the files nobody reads are
split among the processes by index. ``RestoreVerdicts`` (keys
``r<n>/<round>/<process>``) then shares their integrity verdicts: each
process publishes its own, process 0 publishes the combined one
(``r<n>/<round>/all``) once it has every process's, the others read that
one: corruption found by any process fails the checkpoint on every process,
and all fall back to the same older step. Two keys per process and round,
nothing that grows with the number of files or quadratically with the
number of processes. Process 0 deletes a round's keys at the next round.
A process whose restore fails for any other reason (a storage error, a
target that does not match) publishes ``r<n>/abort`` before raising; the
others, waiting for its answer, raise ``PeerFailedError`` at once instead of
waiting out the coordination timeout.

The key-value store is reached through ``asyncckpt._coordination`` (the same
wrapper, and the same errors, as the preemption handler's).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

from asyncckpt._coordination import Coordinator, JaxCoordinator
from asyncckpt.errors import CoordinationError, CoordinationTimeoutError
from asyncckpt.jax._verdicts import ABORT, LastRound, RestoreVerdicts, wait_for
from asyncckpt.storage.url import is_url

__all__ = ["CommitCoordinator", "DistributedSaveError", "Saves", "manager_key"]

logger = logging.getLogger(__name__)

_ERROR = "error:"
_OK = "ok"
_DONE = "ok:"  # a process's part is written: ok:<files>:<crc32 of the part>
_MAX_TEXT = 2000  # longest failure text a process sends (a fixed-size message)
ABSENT = "did not take part"  # a process's failure raised before staging its part
# Managers made per (process, directory key): the n in "d<hash>.<n>".
_generations: collections.Counter[tuple[int, str]] = collections.Counter()
_generations_lock = threading.Lock()


class DistributedSaveError(CoordinationError):
    """A multi-process save failed; every process raises this same error for it.

    Attributes:
        step: The save's step.
        failures: Process index -> its failure, as text.
    """

    def __init__(self, step: int, failures: dict[int, str]):
        self.step = step
        self.failures = dict(sorted(failures.items()))
        parts = "; ".join(f"process {i}: {text}" for i, text in self.failures.items())
        super().__init__(f"multi-process save of step {step} failed: {parts}")

    def __reduce__(self):
        return type(self), (self.step, self.failures)


def describe(error: BaseException) -> str:
    """A failure as one line for the other processes (at most ``_MAX_TEXT`` characters)."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT - 3] + "..."


def manager_key(directory: str | os.PathLike) -> str:
    """The stable name of a directory across processes: a URL, or the normalized path."""
    text = os.fspath(directory)
    if is_url(text):
        return text.rstrip("/")
    return os.path.normpath(os.path.expanduser(text))


def process_layout() -> tuple[int, int]:
    """``(process_index, process_count)`` of this JAX run."""
    import jax

    return jax.process_index(), jax.process_count()


def _seq_of(save_key: str) -> int:
    """The sequence number in a key made by ``save_key``."""
    return int(save_key.rsplit("/s", 1)[1].split("-", 1)[0])


class CommitCoordinator:
    """The multi-process protocol of one manager's saves, over the key-value store.

    Args:
        store: The run's key-value store (``JaxCoordinator``; any
            ``asyncckpt._coordination.Coordinator`` works, e.g. in tests).
        timeout_s: Longest wait for another process at any step.
        directory: The manager's directory, as the program names it; keys are
            derived from it (see the module docstring).
    """

    def __init__(self, store: Coordinator, *, timeout_s: float,
                 directory: str | os.PathLike = ""):
        self._store = store
        self.process_index = store.worker_id
        self.process_count = store.num_workers
        self.timeout_s = timeout_s
        key = manager_key(directory) if os.fspath(directory) else ""
        with _generations_lock:
            generation = _generations[(self.process_index, key)]
            _generations[(self.process_index, key)] += 1
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.prefix = f"asyncckpt/d{digest}.{generation}"
        self._token: str | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._reap: list[str] = []  # primary: save keys to delete once all have moved on
        self._restores = 0
        self._last_round = LastRound()  # primary: the newest verdict's keys

    @classmethod
    def for_this_run(cls, *, timeout_s: float,
                     directory: str | os.PathLike = "") -> CommitCoordinator | None:
        """A coordinator when several processes run, else None.

        Raises:
            CoordinationError: several processes but no ``jax.distributed``
                client (a ``RuntimeError``).
        """
        store = JaxCoordinator.for_processes()
        return None if store is None else cls(store, timeout_s=timeout_s, directory=directory)

    @property
    def primary(self) -> bool:
        return self.process_index == 0

    # -- helpers --------------------------------------------------------------

    def _get(self, key: str, deadline: float, what: str) -> str:
        return wait_for(self._store, key, deadline, process_index=self.process_index,
                        timeout_s=self.timeout_s, what=what)

    def _set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    # -- first save of a manager ------------------------------------------------

    def join(self, prepare: Callable[[], str]) -> str:
        """Agrees on a run token after the primary has prepared the directory.

        Every process calls this before its first save (later calls return
        the token). The primary runs ``prepare`` (take the lock, clean up)
        and shares the token it returns; the others wait.

        Raises:
            Exception: on the primary, whatever ``prepare`` raised; elsewhere
                a ``CoordinationError`` carrying the primary's error.
        """
        if self._token is not None:
            return self._token
        key = f"{self.prefix}/ready"
        if self.primary:
            try:
                token = prepare()
            except BaseException as e:
                self._set(key, f"{_ERROR}{e!r}")
                raise
            self._set(key, token)
        else:
            token = self._get(key, time.monotonic() + self.timeout_s,
                              "the primary's first save")
            if token.startswith(_ERROR):
                raise CoordinationError(
                    f"process 0 could not start saving: {token[len(_ERROR):]}"
                )
        self._token = token
        return token

    def save_key(self, seq: int, step: int) -> str:
        return f"{self.prefix}/s{seq}-{step}"

    def next_save(self, step: int) -> tuple[int, str]:
        """Consumes this save's sequence number: ``(seq, save_key)``.

        Called once by every save a process attempts (see the module
        docstring), so the processes' numbers stay aligned.
        """
        with self._lock:
            seq = self._seq
            self._seq += 1
        return seq, self.save_key(seq, step)

    def fail_before_staging(self, save_key: str, step: int, error: BaseException) -> None:
        """This process raises before staging its part: the others' save fails, no timeout."""
        text = f"{ABSENT} (raised before staging): {describe(error)}"
        try:
            if self.primary:
                self._announce_failures(save_key, {0: text})
                with self._lock:
                    self._reap.append(save_key)
            else:
                self._set(f"{save_key}/done/{self.process_index}", f"{_ERROR}{text}")
        except Exception:
            logger.exception("could not tell the other processes that step %d failed", step)

    # -- one save --------------------------------------------------------------

    def report_done(self, save_key: str, digest: str | None,
                    error: BaseException | None = None) -> None:
        """Non-primary: its files and its manifest part are durable (or its part failed).

        ``digest``: the part's (``_parts.encode``), a few bytes whatever the
        number of files.
        """
        value = f"{_ERROR}{describe(error)}" if error is not None else f"{_DONE}{digest}"
        self._set(f"{save_key}/done/{self.process_index}", value)

    def collect(self, save_key: str) -> tuple[dict[int, str], dict[int, str]]:
        """Primary: waits for every other process's answer.

        Returns:
            ``(digests, failures)``: each process's part digest, and
            ``{process: failure}`` (a process that did not answer in time
            included).
        """
        deadline = time.monotonic() + self.timeout_s
        digests: dict[int, str] = {}
        failures: dict[int, str] = {}
        silent = False
        for i in range(1, self.process_count):
            try:
                value = self._get(f"{save_key}/done/{i}", deadline, f"process {i}'s files")
            except CoordinationTimeoutError as e:
                failures[i] = describe(e)
                silent = True
                continue
            if value.startswith(_ERROR):
                failures[i] = value[len(_ERROR):]
            elif value.startswith(_DONE):
                digests[i] = value[len(_DONE):]
            else:
                failures[i] = f"an answer process 0 does not understand: {value[:100]!r}"
        # An answer from a process's writer thread means that process has finished
        # every earlier save; one it gave on raising before staging (from its
        # training thread) does not.
        if not silent and not any(f.startswith(ABSENT) for f in failures.values()):
            self._reap_earlier(_seq_of(save_key))
        return digests, failures

    def _reap_earlier(self, seq: int) -> None:
        """Every process's writer answered save ``seq``: no one reads the earlier ones' keys."""
        with self._lock:
            reap = [k for k in self._reap if _seq_of(k) < seq]
            self._reap = [k for k in self._reap if _seq_of(k) >= seq]
        for key in reap:
            try:
                self._store.delete(key)
            except Exception as e:  # only the store's size suffers
                logger.warning("could not delete the coordination keys %s: %s", key, e)

    def _announce_failures(self, save_key: str, failures: dict[int, str]) -> None:
        self._set(f"{save_key}/commit",
                  _ERROR + json.dumps({str(i): t for i, t in sorted(failures.items())}))

    def announce(self, save_key: str, error: BaseException | None = None,
                 failures: dict[int, str] | None = None) -> dict[int, str]:
        """Primary: the checkpoint is published, or the verdict of its failure.

        Args:
            save_key: The save.
            error: The primary's own failure, if any.
            failures: Other processes' failures (from ``collect``).

        Returns:
            The failures announced (empty: committed).
        """
        failures = dict(failures or {})
        if error is not None:
            failures[0] = (error.failures.get(0, describe(error))
                           if isinstance(error, DistributedSaveError) else describe(error))
        failures = {i: t if len(t) <= _MAX_TEXT else t[:_MAX_TEXT - 3] + "..."
                    for i, t in failures.items()}
        if failures:
            self._announce_failures(save_key, failures)
        else:
            self._set(f"{save_key}/commit", _OK)
        with self._lock:
            self._reap.append(save_key)
        return failures

    def verdict(self, save_key: str, step: int) -> DistributedSaveError | None:
        """Non-primary: waits for the primary's verdict; None when it committed.

        Raises:
            CoordinationTimeoutError: the primary did not answer in time.
        """
        value = self._get(f"{save_key}/commit", time.monotonic() + self.timeout_s,
                          f"process 0's commit of step {step}")
        if value == _OK:
            return None
        text = value[len(_ERROR):]
        try:
            failures = {int(i): t for i, t in json.loads(text).items()}
        except (ValueError, AttributeError):
            failures = {0: text}
        return DistributedSaveError(step, failures)

    def wait_committed(self, save_key: str, step: int) -> None:
        """Non-primary: waits until the primary has published the checkpoint.

        Raises:
            DistributedSaveError: the save failed (the agreed verdict).
            CoordinationTimeoutError: the primary did not answer in time.
        """
        error = self.verdict(save_key, step)
        if error is not None:
            raise error

    def agree_failure(self, save_key: str, step: int, error: BaseException) -> BaseException:
        """This process's part of a save failed: the error every process raises for it.

        Non-primary: reports the failure, then waits for the primary's
        verdict. Primary: collects the others' answers and announces the
        verdict. Falls back to ``error`` itself if the verdict cannot be had.
        """
        try:
            if self.primary:
                _, failures = self.collect(save_key)
                return DistributedSaveError(
                    step, self.announce(save_key, error=error, failures=failures))
            self.report_done(save_key, None, error=error)
            return self.verdict(save_key, step) or error
        except Exception as e:
            logger.warning("could not agree on the failure of step %d with the other "
                           "processes: %s", step, e)
            return error

    # -- restore ------------------------------------------------------------------

    def restore_verdicts(self) -> RestoreVerdicts:
        """A fresh exchange for one ``restore()`` (every process calls restore alike)."""
        with self._lock:
            n = self._restores
            self._restores += 1
        if self.primary and n >= 2:
            # An abort key two restores back can no longer be waited on: every
            # process has since published a round of the restore after it.
            self._store.delete(f"{self.prefix}/r{n - 2}/{ABORT}")
        return RestoreVerdicts(self._store, f"{self.prefix}/r{n}",
                               process_index=self.process_index,
                               process_count=self.process_count, timeout_s=self.timeout_s,
                               last_round=self._last_round)


class Saves:
    """A manager's run token and save numbers, for one process or several.

    Args:
        coordinator: The multi-process protocol, or None for one process.
        prepare: Takes the directory's lock and cleans it up (the primary,
            before the first save).
    """

    def __init__(self, coordinator: CommitCoordinator | None, prepare: Callable[[], None]):
        self.coord = coordinator
        self._prepare = prepare
        self._token: str | None = None
        self._seq = 0

    def token(self) -> str:
        """The run token naming this manager's temporaries (agreed by every process)."""
        if self._token is None:
            def prepare() -> str:
                self._prepare()
                return uuid.uuid4().hex[:12]

            self._token = prepare() if self.coord is None else self.coord.join(prepare)
        return self._token

    def next_seq(self) -> int:
        """One process: the next save's number (``attempt`` without its context)."""
        self._seq += 1
        return self._seq - 1

    @contextlib.contextmanager
    def attempt(self, step: int) -> Iterator[tuple[int, str | None]]:
        """One attempted save: ``(seq, save_key)`` (the key None for one process).

        Multi-process: an error raised inside (before the save is staged)
        fails this save on the other processes at once, instead of a timeout.
        """
        if self.coord is None:
            yield self.next_seq(), None
            return
        seq, key = self.coord.next_save(step)
        try:
            yield seq, key
        except BaseException as e:
            self.coord.fail_before_staging(key, step, e)
            raise


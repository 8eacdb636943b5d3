"""Multi-process commit through the JAX distributed key-value store.

Every process writes its own shards into one shared temporary directory; the
checkpoint may be published only after all of them are done. The processes
agree through the coordination service's key-value store (the same service
``jax.distributed.initialize`` starts), never through collectives: the waits
below run on each process's background writer thread, where a collective
could deadlock against the training step's own collectives.

Protocol for one save (keys under ``asyncckpt/m<manager>/s<seq>-<step>/``):

1. each non-primary process, once its files are durable, sets
   ``done/<process>`` to its file records (or to an error);
2. the primary waits for every ``done/<i>``, writes the manifest with all
   records, publishes the directory by rename, applies retention, then sets
   ``commit`` to ``ok`` (or to the error that stopped it);
3. non-primary processes wait for ``commit`` before their save counts as
   finished, so ``wait_until_finished()`` returns on every process only once
   the checkpoint is visible.

Before its first save, a manager's primary takes the directory lock, removes
stale temporaries and then publishes a run token (``ready``) that names the
temporary directories; the other processes wait for it, so no process writes
into a directory that the cleanup could still remove.

The key-value store is reached through ``asyncckpt._coordination`` (the same
wrapper, and the same errors, as the preemption handler's).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence

from asyncckpt._coordination import (
    CoordinationError,
    CoordinationTimeoutError,
    JaxCoordinator,
)
from asyncckpt._coordination import Coordinator as KeyValueStore
from asyncckpt.engine.files import FileRecord

__all__ = ["CommitCoordinator", "CoordinationError", "CoordinationTimeoutError", "Coordinator"]

logger = logging.getLogger(__name__)

_ERROR = "error:"
_manager_ids = itertools.count()
_manager_ids_lock = threading.Lock()


def process_layout() -> tuple[int, int]:
    """``(process_index, process_count)`` of this JAX run."""
    import jax

    return jax.process_index(), jax.process_count()


class CommitCoordinator:
    """The multi-process commit protocol of one manager's saves, over the key-value store.

    Args:
        store: The run's key-value store (``JaxCoordinator``; any
            ``asyncckpt._coordination.Coordinator`` works, e.g. in tests).
        timeout_s: Longest wait for another process at any step.
    """

    def __init__(self, store: KeyValueStore, *, timeout_s: float):
        self._store = store
        self.process_index = store.worker_id
        self.process_count = store.num_workers
        self.timeout_s = timeout_s
        self._prefix: str | None = None

    @classmethod
    def for_this_run(cls, *, timeout_s: float) -> CommitCoordinator | None:
        """A coordinator when several processes run, else None.

        Raises:
            CoordinationError: several processes but no ``jax.distributed``
                client (a ``RuntimeError``).
        """
        store = JaxCoordinator.for_processes()
        return None if store is None else cls(store, timeout_s=timeout_s)

    @property
    def primary(self) -> bool:
        return self.process_index == 0

    # -- helpers --------------------------------------------------------------

    def _get(self, key: str, deadline: float, what: str) -> str:
        value = self._store.get(key, max(0.001, deadline - time.monotonic()))
        if value is None:
            raise CoordinationTimeoutError(
                f"[process {self.process_index}] no answer for {what} within "
                f"{self.timeout_s:.0f} s (key {key!r})"
            )
        return value

    def _set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    # -- first save of a manager ------------------------------------------------

    def join(self, prepare: Callable[[], str]) -> str:
        """Agrees on a run token after the primary has prepared the directory.

        Every process calls this once, before its first save, in the same
        order for the same managers. The primary runs ``prepare`` (take the
        lock, clean up) and shares the token it returns; the others wait.

        Raises:
            Exception: on the primary, whatever ``prepare`` raised; elsewhere
                a ``CoordinationError`` carrying the primary's error.
        """
        with _manager_ids_lock:
            self._prefix = f"asyncckpt/m{next(_manager_ids)}"
        key = f"{self._prefix}/ready"
        if self.primary:
            try:
                token = prepare()
            except BaseException as e:
                self._set(key, f"{_ERROR}{e!r}")
                raise
            self._set(key, token)
            return token
        value = self._get(key, time.monotonic() + self.timeout_s, "the primary's first save")
        if value.startswith(_ERROR):
            raise CoordinationError(
                f"process 0 could not start saving: {value[len(_ERROR):]}"
            )
        return value

    def save_key(self, seq: int, step: int) -> str:
        assert self._prefix is not None, "join() first"
        return f"{self._prefix}/s{seq}-{step}"

    # -- one save --------------------------------------------------------------

    def report_done(self, save_key: str, records: Sequence[FileRecord] | None,
                    error: BaseException | None = None) -> None:
        """Non-primary: its files are durable (or its part failed)."""
        value = (
            f"{_ERROR}{error!r}"
            if error is not None
            else json.dumps([[r.name, r.size, r.crc32] for r in records or ()])
        )
        self._set(f"{save_key}/done/{self.process_index}", value)

    def gather(self, save_key: str, *, raise_errors: bool = True) -> list[FileRecord]:
        """Primary: waits for every other process's files and returns their records.

        Raises:
            CoordinationError: a process reported an error or did not answer.
        """
        deadline = time.monotonic() + self.timeout_s
        records: list[FileRecord] = []
        errors = []
        for i in range(1, self.process_count):
            value = self._get(f"{save_key}/done/{i}", deadline, f"process {i}'s files")
            if value.startswith(_ERROR):
                errors.append(f"process {i}: {value[len(_ERROR):]}")
                continue
            records.extend(FileRecord(n, int(s), c) for n, s, c in json.loads(value))
        if errors and raise_errors:
            raise CoordinationError("other processes failed this save: " + "; ".join(errors))
        return records

    def announce(self, save_key: str, error: BaseException | None = None) -> None:
        """Primary: the checkpoint is published (or will never be)."""
        self._set(f"{save_key}/commit", "ok" if error is None else f"{_ERROR}{error!r}")

    def wait_committed(self, save_key: str, step: int) -> None:
        """Non-primary: waits until the primary has published the checkpoint.

        Raises:
            CoordinationError: the primary failed the commit or did not answer.
        """
        value = self._get(
            f"{save_key}/commit", time.monotonic() + self.timeout_s,
            f"process 0's commit of step {step}",
        )
        if value != "ok":
            raise CoordinationError(
                f"process 0 did not commit step {step}: {value[len(_ERROR):]}"
            )


# The JAX manager's name for the commit protocol.
Coordinator = CommitCoordinator

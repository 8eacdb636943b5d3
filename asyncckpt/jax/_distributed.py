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
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncckpt.engine.files import FileRecord
from asyncckpt.errors import AsyncCkptError

logger = logging.getLogger(__name__)

_ERROR = "error:"
_manager_ids = itertools.count()
_manager_ids_lock = threading.Lock()


class CoordinationError(AsyncCkptError, RuntimeError):
    """Another process failed its part of a save, or did not answer in time."""


def _client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


def process_layout() -> tuple[int, int]:
    """``(process_index, process_count)`` of this JAX run."""
    import jax

    return jax.process_index(), jax.process_count()


class Coordinator:
    """Key-value store coordination for one manager's saves.

    Args:
        client: The JAX distributed runtime client.
        process_index: This process.
        process_count: All processes of the run.
        timeout_s: Longest wait for another process at any step.
    """

    def __init__(self, client: Any, *, process_index: int, process_count: int, timeout_s: float):
        self._client = client
        self.process_index = process_index
        self.process_count = process_count
        self.timeout_s = timeout_s
        self._prefix: str | None = None

    @classmethod
    def for_this_run(cls, *, timeout_s: float) -> Coordinator | None:
        """A coordinator when several processes run, else None.

        Raises:
            RuntimeError: several processes but no ``jax.distributed`` client.
        """
        index, count = process_layout()
        if count == 1:
            return None
        client = _client()
        if client is None:
            raise RuntimeError(
                f"JAX runs {count} processes but jax.distributed is not initialized; "
                "asyncckpt coordinates multi-process saves through its key-value store: "
                "call jax.distributed.initialize() first"
            )
        return cls(client, process_index=index, process_count=count, timeout_s=timeout_s)

    @property
    def primary(self) -> bool:
        return self.process_index == 0

    # -- helpers --------------------------------------------------------------

    def _get(self, key: str, deadline: float, what: str) -> str:
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            return self._client.blocking_key_value_get(key, remaining_ms)
        except Exception as e:  # the runtime raises its own error type on timeout
            raise CoordinationError(
                f"[process {self.process_index}] no answer for {what} within "
                f"{self.timeout_s:.0f} s (key {key!r}): {e}"
            ) from e

    def _set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

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

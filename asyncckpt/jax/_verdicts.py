"""Restore verdicts shared between the processes of a multi-process JAX restore.

Part of the protocol described in ``asyncckpt.jax._distributed``: the
processes of one restore share their integrity verdicts, so all accept or
skip a checkpoint together. Each process publishes its own verdict; process
0 gathers them and publishes the combined one, which the others read: two
keys per process and round, whatever the number of files, and linear in the
number of processes. (Which files each process reads, and so checks, every
process computes itself from the target's shardings: nothing about files
goes through the store.) A process whose restore fails for another reason
publishes ``abort``; the others stop waiting for it and raise
``PeerFailedError``.
"""

from __future__ import annotations

import json
import logging
import time

from asyncckpt._coordination import CoordinationTimeoutError, PeerFailedError
from asyncckpt._coordination import Coordinator as KeyValueStore
from asyncckpt.errors import CorruptCheckpointError

logger = logging.getLogger(__name__)

OK = "ok"
ABORT = "abort"
ALL = "all"  # process 0's combined verdict of a round
# How often a process waiting for another's restore answer looks for its abort.
_ABORT_POLL_S = 0.2


class LastRound:
    """Process 0's keys of the newest combined verdict, one per manager's coordinator.

    Every process has published a round before process 0 combines it, so
    none reads an earlier round any more: its keys are deleted then, and the
    store holds one round per manager, however many restores ran.
    """

    def __init__(self) -> None:
        self._keys: list[str] = []

    def replace(self, store: KeyValueStore, key: str) -> None:
        """Deletes the previous round's keys; ``key`` is the newest round."""
        for earlier in self._keys:
            store.delete(earlier)
        self._keys = [key]


class RestoreVerdicts:
    """Shares each process's integrity verdict, for one restore.

    ``agree`` publishes this process's verdict of a checkpoint item and
    returns once the combined verdict is known, so all accept or reject a
    checkpoint together (and all fall back to the same older step).

    Args:
        store: The run's key-value store.
        prefix: This restore's keys.
        process_index: This process.
        process_count: Processes taking part.
        timeout_s: Longest wait for another process.
        last_round: The manager's record of the newest round (process 0 deletes
            older rounds' keys through it).
    """

    def __init__(self, store: KeyValueStore, prefix: str, *, process_index: int,
                 process_count: int, timeout_s: float, last_round: LastRound):
        self._store = store
        self._prefix = prefix
        self._rounds = 0
        self._last_round = last_round
        self.process_index = process_index
        self.process_count = process_count
        self.timeout_s = timeout_s

    def combine(self, what: str, mine: str) -> str:
        """Publishes ``mine``; returns the first value other than ``OK`` of any process.

        Process 0 waits for every process's value and publishes the result
        (``OK``, or ``<process>:<value>``); the others wait for that one.

        Raises:
            CoordinationTimeoutError: a process did not answer in time.
            PeerFailedError: a process gave up this restore (``abort``).
        """
        key = f"{self._prefix}/{self._rounds}"
        self._rounds += 1
        deadline = time.monotonic() + self.timeout_s
        if self.process_index != 0:
            self._store.set(f"{key}/{self.process_index}", mine)
            return self._wait(f"{key}/{ALL}", deadline, f"process 0's {what}")
        combined = OK if mine == OK else f"0:{mine}"
        for i in range(1, self.process_count):
            value = self._wait(f"{key}/{i}", deadline, f"process {i}'s {what}")
            if combined == OK and value != OK:
                combined = f"{i}:{value}"
        self._store.set(f"{key}/{ALL}", combined)
        # Every process has published this round, so none reads an earlier one.
        self._last_round.replace(self._store, key)
        return combined

    def _wait(self, key: str, deadline: float, what: str) -> str:
        store = self._store
        while True:
            value = store.get(key, max(0.001, min(_ABORT_POLL_S, deadline - time.monotonic())))
            if value is not None:
                return value
            aborted = store.try_get(f"{self._prefix}/{ABORT}")
            if aborted is not None:
                info = json.loads(aborted)
                raise PeerFailedError(int(info["process"]),
                                      f"restore failed there: {info['error']}")
            if time.monotonic() >= deadline:
                raise CoordinationTimeoutError(
                    f"[process {self.process_index}] no answer for {what} within "
                    f"{self.timeout_s:.0f} s (key {key!r})"
                )

    def abort(self, error: BaseException) -> None:
        """Tells the other processes that this restore failed here, so none waits for it.

        Best effort: the caller raises ``error`` whatever happens here.
        """
        text = json.dumps({"process": self.process_index,
                           "error": f"{type(error).__name__}: {error}"})
        try:
            self._store.claim(f"{self._prefix}/{ABORT}", text)
        except Exception:  # the store itself may be what failed
            logger.debug("could not publish the restore's abort", exc_info=True)

    def agree(self, name: str, error: CorruptCheckpointError | None) -> None:
        """Publishes this process's verdict of ``name`` and raises if any process failed it.

        Raises:
            CorruptCheckpointError: some process found a file damaged (the
                first such process's error, the file named), on every process.
            CoordinationTimeoutError: a process did not answer in time.
        """
        mine = OK if error is None else json.dumps(
            {"message": str(error)[:2000], "file": error.file, "checkpoint": error.checkpoint})
        combined = self.combine(f"verdict of {name}", mine)
        if combined == OK:
            return
        if error is not None:
            raise error
        process, _, text = combined.partition(":")
        info = json.loads(text)
        raise CorruptCheckpointError(
            f"{info['message']} (found by process {process})",
            checkpoint=info.get("checkpoint"), file=info.get("file"),
        )

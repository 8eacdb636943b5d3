"""Restore verdicts shared between the processes of a multi-process JAX restore.

Part of the protocol described in ``asyncckpt.jax._distributed``: the
processes of one restore share their integrity verdicts, so all accept or
skip a checkpoint together. Each process publishes its own verdict; process
0 gathers them and publishes the combined one, which the others read: two
keys per process and round, whatever the number of files, and linear in the
number of processes. Waits are single blocking reads, never polls, so the
traffic does not grow with how long a process waits. (Which files each
process reads, and so checks, every
process computes itself from the target's shardings: nothing about files
goes through the store.) A process whose restore fails for another reason
publishes an abort on the key that is waited for next in its place (its own
value of the round, or, for process 0, the round's combined value); process
0 passes a peer's abort on as the combined value, so every process stops
waiting and raises ``PeerFailedError``.
"""

from __future__ import annotations

import json
import logging
import time

from asyncckpt._coordination import Coordinator
from asyncckpt.errors import CoordinationTimeoutError, CorruptCheckpointError, PeerFailedError

logger = logging.getLogger(__name__)

OK = "ok"
ABORT = "abort:"  # prefix of a value that says a process gave the restore up (JSON follows)
ALL = "all"  # process 0's combined verdict of a round


def _peer_failed(text: str) -> PeerFailedError:
    """The error a published abort stands for."""
    info = json.loads(text[len(ABORT):])
    return PeerFailedError(int(info["process"]), f"restore failed there: {info['error']}")


def wait_for(store: Coordinator, key: str, deadline: float, *, process_index: int,
             timeout_s: float, what: str) -> str:
    """The value of ``key``, in one blocking read that ends at ``deadline`` (monotonic).

    Raises:
        CoordinationTimeoutError: No value by the deadline; the message names
            this process, ``what`` was awaited, the protocol's timeout and the key.
    """
    value = store.get(key, max(0.001, deadline - time.monotonic()))
    if value is None:
        raise CoordinationTimeoutError(
            f"[process {process_index}] no answer for {what} within {timeout_s:.0f} s "
            f"(key {key!r})"
        )
    return value


class LastRound:
    """Process 0's keys of the newest combined verdict, one per manager's coordinator.

    Every process has published a round before process 0 combines it, so
    none reads an earlier round any more: its keys are deleted then, and the
    store holds one round per manager, however many restores ran.
    """

    def __init__(self) -> None:
        self._keys: list[str] = []

    def replace(self, store: Coordinator, key: str) -> None:
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

    def __init__(self, store: Coordinator, prefix: str, *, process_index: int,
                 process_count: int, timeout_s: float, last_round: LastRound):
        self._store = store
        self._prefix = prefix
        self._rounds = 0  # rounds entered
        self._published = 0  # rounds this process has published its value (or combined) of
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
            self._published = self._rounds
            value = self._wait(f"{key}/{ALL}", deadline, f"process 0's {what}")
            if value.startswith(ABORT):
                raise _peer_failed(value)
            return value
        combined = OK if mine == OK else f"0:{mine}"
        for i in range(1, self.process_count):
            value = self._wait(f"{key}/{i}", deadline, f"process {i}'s {what}")
            if value.startswith(ABORT):
                # Passed on as this round's combined value: the others wait for it.
                self._store.claim(f"{key}/{ALL}", value)
                self._published = self._rounds
                self._last_round.replace(self._store, key)  # deleted by a later round
                raise _peer_failed(value)
            if combined == OK and value != OK:
                combined = f"{i}:{value}"
        self._store.set(f"{key}/{ALL}", combined)
        self._published = self._rounds
        # Every process has published this round, so none reads an earlier one.
        self._last_round.replace(self._store, key)
        return combined

    def _wait(self, key: str, deadline: float, what: str) -> str:
        """The value of ``key`` (maybe an abort), in one blocking read."""
        return wait_for(self._store, key, deadline, process_index=self.process_index,
                        timeout_s=self.timeout_s, what=what)

    def abort(self, error: BaseException) -> None:
        """Tells the other processes that this restore failed here, so none waits for it.

        Written where this process would publish next: its own value of the
        round it has not published yet (process 0: that round's combined
        value), which is the key the others wait on or will wait on.
        Best effort: the caller raises ``error`` whatever happens here.
        """
        text = ABORT + json.dumps({"process": self.process_index,
                                   "error": f"{type(error).__name__}: {error}"})
        key = f"{self._prefix}/{self._published}"
        who = ALL if self.process_index == 0 else str(self.process_index)
        try:
            self._store.claim(f"{key}/{who}", text)
            if self.process_index == 0:
                self._last_round.replace(self._store, key)  # deleted by a later round
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

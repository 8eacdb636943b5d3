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
from typing import TYPE_CHECKING

from asyncckpt._coordination import CoordinationTimeoutError, PeerFailedError
from asyncckpt.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from asyncckpt.jax._distributed import CommitCoordinator

logger = logging.getLogger(__name__)

OK = "ok"
ABORT = "abort"
ALL = "all"  # process 0's combined verdict of a round
# How often a process waiting for another's restore answer looks for its abort.
_ABORT_POLL_S = 0.2


class RestoreVerdicts:
    """Shares each process's integrity verdict, for one restore.

    ``agree`` publishes this process's verdict of a checkpoint item and
    returns once the combined verdict is known, so all accept or reject a
    checkpoint together (and all fall back to the same older step).

    Args:
        coordinator: The manager's coordinator.
        prefix: This restore's keys.
    """

    def __init__(self, coordinator: CommitCoordinator, prefix: str):
        self._coord = coordinator
        self._prefix = prefix
        self._rounds = 0
        self.process_index = coordinator.process_index
        self.process_count = coordinator.process_count

    def combine(self, what: str, mine: str) -> str:
        """Publishes ``mine``; returns the first value other than ``OK`` of any process.

        Process 0 waits for every process's value and publishes the result
        (``OK``, or ``<process>:<value>``); the others wait for that one.

        Raises:
            CoordinationTimeoutError: a process did not answer in time.
            PeerFailedError: a process gave up this restore (``abort``).
        """
        c = self._coord
        key = f"{self._prefix}/{self._rounds}"
        self._rounds += 1
        deadline = time.monotonic() + c.timeout_s
        if not c.primary:
            c._set(f"{key}/{c.process_index}", mine)
            return self._wait(f"{key}/{ALL}", deadline, f"process 0's {what}")
        combined = OK if mine == OK else f"0:{mine}"
        for i in range(1, c.process_count):
            value = self._wait(f"{key}/{i}", deadline, f"process {i}'s {what}")
            if combined == OK and value != OK:
                combined = f"{i}:{value}"
        c._set(f"{key}/{ALL}", combined)
        # Every process has published this round, so none reads an earlier one.
        for earlier in c._restore_keys:
            c._store.delete(earlier)
        c._restore_keys = [key]
        return combined

    def _wait(self, key: str, deadline: float, what: str) -> str:
        c = self._coord
        while True:
            value = c._store.get(key, max(0.001, min(_ABORT_POLL_S, deadline - time.monotonic())))
            if value is not None:
                return value
            aborted = c._store.try_get(f"{self._prefix}/{ABORT}")
            if aborted is not None:
                info = json.loads(aborted)
                raise PeerFailedError(int(info["process"]),
                                      f"restore failed there: {info['error']}")
            if time.monotonic() >= deadline:
                raise CoordinationTimeoutError(
                    f"[process {c.process_index}] no answer for {what} within "
                    f"{c.timeout_s:.0f} s (key {key!r})"
                )

    def abort(self, error: BaseException) -> None:
        """Tells the other processes that this restore failed here, so none waits for it.

        Best effort: the caller raises ``error`` whatever happens here.
        """
        c = self._coord
        text = json.dumps({"process": c.process_index,
                           "error": f"{type(error).__name__}: {error}"})
        try:
            c._store.claim(f"{self._prefix}/{ABORT}", text)
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

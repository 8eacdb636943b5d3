"""The handler's view of a manager's remote tier: upload times, and the final upload.

A manager with a remote tier (``remote=`` beside a local directory) commits
every save locally and uploads some of them in the background; a manager
whose directory is an ``s3://`` / ``gs://`` URL uploads every save as part of
its commit. For the final save of a grace period the handler needs the
measured upload times (they count in the margin when the final save is to
reach the remote tier), what the uploader is busy with (the final upload
queues behind it), and a way to upload the final checkpoint and wait for it
no longer than the time left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import sys
import threading
from collections import deque
from typing import Any

from asyncckpt.storage import protocol, tier
from asyncckpt.storage.tier import TieredDirectory

logger = logging.getLogger(__name__)

# Uploads kept (in memory and beside the checkpoints).
UPLOAD_WINDOW = 16


def tiers_of(manager: Any) -> TieredDirectory | None:
    """The ``TieredDirectory`` of an asyncckpt TF or JAX manager with a remote tier, else None."""
    tiers = tier.tiers_of(manager)
    return tiers if tiers is not None and tiers.remote is not None else None


class RemoteTierView:
    """Upload times and the final upload of one manager's remote tier.

    Args:
        tiers: The manager's tiers (with a remote one).
    """

    def __init__(self, tiers: TieredDirectory):
        self._tiers = tiers
        self._seeded: deque[tuple[float, float]] = deque(maxlen=UPLOAD_WINDOW)

    @property
    def url(self) -> str:
        return self._tiers.remote.url

    @property
    def local_dir(self) -> str:
        return self._tiers.local_dir

    @property
    def every_save(self) -> bool:
        """A URL directory: every save is committed remotely before it counts as durable."""
        return self._tiers.remote_only

    def seed(self, samples) -> None:
        """Starts from the upload times of earlier runs (``samples()``'s format)."""
        for item in samples or ():
            try:
                t, b = (float(x) for x in item)
            except (TypeError, ValueError):
                continue
            if t >= 0 and b >= 0:
                self._seeded.append((t, b))

    def samples(self) -> list[list[float]]:
        """``[[seconds, bytes], ...]`` of recent uploads (retention included), oldest first."""
        mine = [(float(e.get("total_seconds", e["seconds"])), float(e["nbytes"]))
                for e in list(self._tiers.remote.stats)]
        return [[t, b] for t, b in [*self._seeded, *mine][-UPLOAD_WINDOW:]]

    @property
    def uploader_thread_id(self) -> int | None:
        return self._tiers.remote.uploader_thread_id

    def running_for(self) -> float | None:
        """Seconds the upload in progress has run (None: none in progress)."""
        running, _ = self._tiers.remote.in_flight()
        return None if running is None else running[1]

    def upload_final(self, name: str, timeout: float) -> str | None:
        """Uploads the locally committed checkpoint ``name`` unless it is on its way; waits.

        Returns:
            None once the checkpoint is committed remotely, else why not
            (an error, or not within ``timeout`` seconds; the upload then
            goes on in the background). A failed upload also stays pending
            in the manager, whose next call (or ``close``) raises it.
        """
        remote = self._tiers.remote
        running, waiting = remote.in_flight()
        timeout = max(0.0, timeout)
        try:
            if name in (waiting, running[0] if running else None):
                # Handed over by the manager's schedule already. A failure
                # stays pending: the manager's next call raises it too.
                remote.wait_until_finished(timeout, raise_errors=False)
                if not any(e["name"] == name for e in list(remote.stats)):
                    return (f"upload to {self.url} failed (the manager's next call raises "
                            "the error)")
            else:
                info = protocol.local_info(self._tiers.local_dir, name)
                future = remote.submit(info, force=True, raise_errors=False)
                if future is not None:
                    future.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            return f"not committed to {self.url} within the {timeout:.2f} s left"
        except Exception as e:
            return f"upload to {self.url} failed: {type(e).__name__}: {e}"
        return None

    def local_location(self, name: str) -> str:
        return os.path.join(self._tiers.local_dir, name)


def raise_priority(thread_ids) -> list[tuple[int, int]]:
    """Gives background threads the calling thread's priority (Linux; best effort).

    The writer and the uploader run niced, so that they take no CPU from
    training; during the final save training waits, and on a loaded machine
    a niced writer is what makes the final save late (a 0.25 s write took
    2-4 s at a load average of 22 on 2 cores). Lowering a niceness needs
    ``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` that allows it): where it is
    refused the threads keep theirs.

    Returns:
        ``(thread id, previous niceness)`` of each thread changed, for
        ``restore_priority``.
    """
    if not sys.platform.startswith("linux"):
        return []
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    changed = []
    for tid in thread_ids:
        if tid is None:
            continue
        try:
            old = os.getpriority(os.PRIO_PROCESS, tid)
            if old > mine:
                os.setpriority(os.PRIO_PROCESS, tid, mine)
                changed.append((tid, old))
        except OSError as e:  # refused (no CAP_SYS_NICE), or the thread is gone
            logger.info("could not raise a background thread's priority for the final save: %s",
                        e)
    return changed


def restore_priority(changed: list[tuple[int, int]]) -> None:
    """Gives the threads ``raise_priority`` changed their niceness back (always allowed)."""
    for tid, old in changed:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, old)

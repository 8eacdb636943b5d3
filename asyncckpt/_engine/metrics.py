"""Per-save timings and the running estimate of how long a write takes.

Timings are data, not only log lines: the preemption handler sizes its
grace-period margin from ``WriteTimeEstimator``, the benchmarks and the
manifest read ``SaveStats``.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class SaveStats:
    """What one save cost.

    Attributes:
        label: Human-readable name of the checkpoint (a path or a step).
        step: Training step, when the front end knows it.
        nbytes: Bytes of state staged and written.
        blocking_s: Seconds the caller was blocked in ``save()``: waiting for a
            free slot plus copying the state to host memory.
        slot_wait_s: Part of ``blocking_s`` spent waiting for a free slot.
        write_s: Background seconds spent writing the files.
        commit_s: Background seconds spent making them durable and visible
            (checksums, fsync, manifest, rename).
        durable_s: Seconds from the ``save()`` call until the checkpoint was
            committed, queueing behind earlier saves included.
        started_at: Wall-clock time (``time.time()``) of the ``save()`` call.
        post_commit_error: ``repr`` of an error raised after the checkpoint
            was published (state file, retention, callbacks), which does not
            make the save fail; None when there was none.
    """

    label: str
    step: int | None
    nbytes: int
    blocking_s: float
    slot_wait_s: float
    write_s: float
    commit_s: float
    durable_s: float
    started_at: float
    post_commit_error: str | None = None

    @property
    def background_s(self) -> float:
        """Seconds the background writer spent on this save."""
        return self.write_s + self.commit_s

    @property
    def throughput_bytes_per_s(self) -> float:
        """Durable write throughput of the background writer."""
        return self.nbytes / self.background_s if self.background_s > 0 else float("inf")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["throughput_bytes_per_s"] = self.throughput_bytes_per_s
        return d


class WriteTimeEstimator:
    """Running estimate of the background time of the next save.

    Keeps an exponentially weighted mean of the seconds per byte and of a fixed
    per-save overhead, so the estimate follows the state when it grows (an
    optimizer that builds its slots) and a slower disk. ``peak`` keeps the
    worst recent ratio, for callers that need a safe upper bound.
    """

    def __init__(self, *, alpha: float = 0.3):
        self._alpha = alpha
        self._lock = threading.Lock()
        self._seconds: float | None = None
        self._nbytes: int = 0
        self._peak_seconds: float | None = None

    def update(self, seconds: float, nbytes: int) -> None:
        """Adds one measured background time."""
        with self._lock:
            if self._seconds is None:
                self._seconds = seconds
            else:
                self._seconds += self._alpha * (seconds - self._seconds)
            self._nbytes = nbytes
            # The peak decays slowly so one stall on a shared disk is not
            # remembered forever.
            if self._peak_seconds is None or seconds > self._peak_seconds:
                self._peak_seconds = seconds
            else:
                self._peak_seconds = max(seconds, self._peak_seconds * 0.9)

    def seed(self, seconds: float, nbytes: int = 0) -> None:
        """Starts from an estimate measured earlier (e.g. before a restart)."""
        with self._lock:
            if self._seconds is None:
                self._seconds = seconds
                self._peak_seconds = seconds
                self._nbytes = nbytes

    @property
    def seconds(self) -> float | None:
        """Smoothed background seconds per save, or None before any save."""
        with self._lock:
            return self._seconds

    @property
    def peak_seconds(self) -> float | None:
        """Slowly decaying maximum of recent background times."""
        with self._lock:
            return self._peak_seconds

    def estimate(self, nbytes: int | None = None) -> float | None:
        """Estimated background seconds for a save of ``nbytes`` bytes."""
        with self._lock:
            if self._seconds is None:
                return None
            if nbytes is None or not self._nbytes:
                return self._seconds
            return self._seconds * max(nbytes / self._nbytes, 1.0)

"""Per-save timings and the running estimate of how long a write takes.

Timings are data, not only log lines: the preemption handler sizes its
grace-period margin from ``WriteTimeEstimator``, the benchmarks and the
manifest read ``SaveStats``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any


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
        phases: Where the save's time went (``Phases.to_dict``): seconds,
            counts and bytes per phase; None where the front end records none.
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
    phases: dict[str, Any] | None = None

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
        if d["phases"] is None:
            del d["phases"]
        d["throughput_bytes_per_s"] = self.throughput_bytes_per_s
        return d


# Phases of a save, in the order they happen on its way to durable (``Phases``).
SLOT_WAIT = "slot wait"  # save() waiting for a free staging slot (before its copy)
COPY = "copy to host"  # the blocking copy into the slot (and a deferred background copy)
QUEUE = "queue"  # staged, waiting for the writer (an earlier save being written)
CHECKSUM = "checksum"  # CRC of bytes as they are written
READ_BACK = "checksum (read back)"  # CRC of files others wrote, read back from the page cache
OCDBT = "ocdbt commit"  # OCDBT B-tree nodes and manifests (encoded, or TensorStore's merge)
FSYNC = "fsync"  # fsync calls (files and directories), on helper threads: count and seconds
FSYNC_WAIT = "fsync wait"  # the writer waiting for those fsyncs (``Transaction.seal``)
MANIFEST = "manifest"  # asyncckpt's manifest of the checkpoint's files
PUBLISH = "publish"  # the atomic step (rename, marker, index) and its directory fsync
AFTER_COMMIT = "after commit"  # retention, state files, callbacks, after the publish
WRITE = "write:"  # prefix: writing files of one kind (``write:ocdbt data``...), checksums apart
# Checksums computed on helper threads while the writer writes (TensorFlow's bundle).
CHECKSUM_BESIDE = "checksum (beside the write)"
# Phases spent on helper threads, overlapping the writer's: their seconds are
# not on the way to durable (what the writer waited for is ``FSYNC_WAIT``).
OVERLAPPED = frozenset({FSYNC, CHECKSUM_BESIDE})


class Phases:
    """Where one save's time goes, recorded as data for ``SaveStats.phases``.

    A phase accumulates seconds, a count and bytes. Timers are two
    ``time.perf_counter()`` calls per timed piece (a file, a fsync, a 1 MiB
    write), summed in a dict: nothing measurable beside a save's I/O, so
    every save records them, and the benchmarks read them
    (``asyncckpt bench``'s durable-time breakdown). One thread adds at a
    time: helper threads (fsyncs, a bundle's writers) keep their own sums
    and add them once they are joined.
    """

    __slots__ = ("counts", "nbytes", "seconds")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}

    def add(self, phase: str, seconds: float, count: int = 1, nbytes: int = 0) -> None:
        """Adds ``seconds`` (and ``count`` events of ``nbytes`` in all) to ``phase``."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.counts[phase] = self.counts.get(phase, 0) + count
        if nbytes:
            self.nbytes[phase] = self.nbytes.get(phase, 0) + nbytes

    @contextmanager
    def timed(self, phase: str, nbytes: int = 0) -> Iterator[None]:
        """Times the block as one event of ``phase``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0, 1, nbytes)

    def merge(self, other: Phases) -> None:
        """Adds every phase of ``other`` (a helper thread's sums)."""
        for phase, seconds in other.seconds.items():
            self.add(phase, seconds, other.counts.get(phase, 0), other.nbytes.get(phase, 0))

    def to_dict(self) -> dict[str, Any]:
        """``{"seconds": {...}, "counts": {...}, "bytes": {...}}`` by phase."""
        return {"seconds": dict(self.seconds), "counts": dict(self.counts),
                "bytes": dict(self.nbytes)}


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

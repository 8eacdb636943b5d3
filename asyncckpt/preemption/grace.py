"""When to start the final save of a grace period: the margin, from measurements.

With a grace period ``G`` after a notice at ``t0``, training goes on and the
final save must *start* early enough to be durable before ``t0 + G``. The
handler checks at every step boundary and starts the final round at the first
boundary ``t`` with ``t + margin >= t0 + G``, where::

    margin = safety * (W + B + Q + k * S) + slack

* ``W``: background write time of one save (write + commit + fsync), the
  engine's slowly decaying peak (``WriteTimeEstimator.peak_seconds``), so one
  slow save on a shared disk is remembered;
* ``B``: blocking time of a save (host copy), the peak of recent saves;
* ``Q``: what the saves still in flight need (the engine writes in order, so
  the final save waits for them): ``W`` for each queued save, and for the one
  being written ``W`` minus the time it has run (at least ``W / 4``: a write
  already past its estimate is slow, not nearly done);
* ``S``: step time, a decaying peak of the time between step boundaries;
* ``k = 3`` steps: the check runs once per step (the deadline can be crossed
  just after one), and the agreed step is at most one step after the boundary
  where the round starts, on the slowest worker one more;
* ``safety = 1.5`` absorbs variance of the write (a disk shared with other
  jobs), ``slack = 0.5 s`` the fixed costs (coordination round trips, the
  barrier, process exit).

TensorFlow's handler uses ``G - 6 * mean step time``: it ignores the write,
so a final save that takes longer than six steps misses the deadline, and it
starts from zero after a restart. Here every estimate is stored in the
checkpoint and seeds the next run. If ``G <= margin`` the save starts at once.
A save is also made at the notice itself when ``G >= 4 * margin`` (a guard for
long grace periods; in a short one it would only delay the final save).
Without any measured write (a first run that never saved), the final round
starts once ``unknown_write_fraction`` of the grace period has passed, or as
soon as the save made at the notice has been measured.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from asyncckpt.engine.writer import AsyncEngine

ESTIMATE_KEYS = ("step_s", "step_peak_s", "write_s", "write_peak_s", "blocking_s", "nbytes")


@dataclass(frozen=True, kw_only=True)
class GraceOptions:
    """Tuning of the margin (see the module docstring for the formula).

    Attributes:
        safety_factor: Multiplies the measured part of the margin.
        step_allowance: Steps between the check and the start of the save.
        slack_s: Fixed seconds added for coordination and exit.
        unknown_write_fraction: Share of the grace period to train for when no
            write time has ever been measured.
        save_at_notice_ratio: Save at the notice as well only if the grace
            period is at least this many margins long (0: always, ``inf``:
            never). That save guards a long grace period against a notice
            that overstates the time left; in a short one it would only
            delay the final save, which waits for it.
        peak_decay: Per-step decay of the step-time peak.
    """

    safety_factor: float = 1.5
    step_allowance: float = 3.0
    slack_s: float = 0.5
    unknown_write_fraction: float = 0.5
    save_at_notice_ratio: float = 4.0
    peak_decay: float = 0.99

    def __post_init__(self) -> None:
        if self.safety_factor < 1:
            raise ValueError(f"safety_factor must be >= 1, got {self.safety_factor!r}")
        if self.step_allowance < 0 or self.slack_s < 0:
            raise ValueError("step_allowance and slack_s must be >= 0")
        if not 0 <= self.unknown_write_fraction <= 1:
            raise ValueError("unknown_write_fraction must be within [0, 1]")
        if self.save_at_notice_ratio < 0:
            raise ValueError("save_at_notice_ratio must be >= 0")


def margin_seconds(
    *,
    write_s: float,
    blocking_s: float,
    queued_s: float,
    step_s: float,
    options: GraceOptions,
) -> float:
    """``safety * (write + blocking + queued + k * step) + slack``."""
    measured = write_s + blocking_s + queued_s + options.step_allowance * step_s
    return options.safety_factor * measured + options.slack_s


def tf_final_save_start(notice_time: float, grace_period: float, mean_step_s: float) -> float:
    """When TensorFlow's handler starts its final save: ``notice + G - 6 * step``.

    (``buffer_factor 3 * estimated_run_time * 2`` in its source.) For
    comparison in benchmarks only.
    """
    return notice_time + grace_period - 6.0 * mean_step_s


class StepTimeEstimator:
    """Running mean and decaying peak of the seconds between step boundaries."""

    def __init__(self, *, alpha: float = 0.1, peak_decay: float = 0.99):
        self._alpha = alpha
        self._decay = peak_decay
        self._lock = threading.Lock()
        self._mean: float | None = None
        self._peak: float | None = None
        self.count = 0

    def update(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            if self._mean is None:
                self._mean = seconds
            else:
                self._mean += self._alpha * (seconds - self._mean)
            self._peak = seconds if self._peak is None else max(seconds, self._peak * self._decay)

    def seed(self, mean: float | None, peak: float | None) -> None:
        """Starts from estimates of an earlier run (no-op once measured here)."""
        with self._lock:
            if self._mean is None and mean is not None:
                self._mean = mean
                self._peak = max(peak or mean, mean)

    @property
    def mean(self) -> float | None:
        with self._lock:
            return self._mean

    @property
    def peak(self) -> float | None:
        with self._lock:
            return self._peak


def _finite(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None


class GraceClock:
    """The margin of one handler, from its engine's and its own measurements.

    Args:
        engine: The checkpoint's engine (write and blocking times, saves in
            flight).
        options: Margin tuning.
    """

    def __init__(self, engine: AsyncEngine, options: GraceOptions | None = None):
        self.engine = engine
        self.options = options or GraceOptions()
        self.steps = StepTimeEstimator(peak_decay=self.options.peak_decay)
        self._seeded_blocking: float | None = None

    def write_seconds(self) -> float | None:
        est = self.engine.estimator
        values = [v for v in (est.peak_seconds, est.estimate()) if v is not None]
        return max(values) if values else None

    def blocking_seconds(self) -> float:
        recent = [s.blocking_s for s in self.engine.history[-8:]]
        if recent:
            return max(recent)
        return self._seeded_blocking or 0.0

    def queued_seconds(self, write: float) -> float:
        """Seconds the saves in flight still need before a new one can start."""
        pending = self.engine.pending
        if pending == 0:
            return 0.0
        busy = self.engine.busy_for
        if busy is None:  # staged, the writer has not picked it up yet
            return pending * write
        return (pending - 1) * write + max(write - busy, write / 4)

    def margin(self) -> float | None:
        """Seconds before the deadline the final round must start; None if unknown."""
        write = self.write_seconds()
        if write is None:
            return None
        return margin_seconds(
            write_s=write,
            blocking_s=self.blocking_seconds(),
            queued_s=self.queued_seconds(write),
            step_s=self.steps.peak or 0.0,
            options=self.options,
        )

    def estimates(self) -> dict[str, float | None]:
        """What is stored in each checkpoint to seed the next run."""
        est = self.engine.estimator
        last = self.engine.last_stats
        return {
            "step_s": self.steps.mean,
            "step_peak_s": self.steps.peak,
            "write_s": est.seconds,
            "write_peak_s": est.peak_seconds,
            "blocking_s": self.blocking_seconds() if (last or self._seeded_blocking) else None,
            "nbytes": float(last.nbytes) if last is not None else None,
        }

    def seed(self, estimates: dict) -> None:
        """Starts from the estimates stored in a restored checkpoint."""
        values = {k: _finite(estimates.get(k)) for k in ESTIMATE_KEYS}
        self.steps.seed(values["step_s"], values["step_peak_s"])
        write = values["write_peak_s"] or values["write_s"]
        if write:
            self.engine.estimator.seed(write, int(values["nbytes"] or 0))
        if values["blocking_s"] is not None:
            self._seeded_blocking = values["blocking_s"]

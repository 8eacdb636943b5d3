"""When to start the final save of a grace period: a margin from measured distributions.

With a grace period ``G`` after a notice at ``t0``, training goes on and the
final save must *start* early enough to be durable before ``D = t0 + G``. At
every step boundary ``t`` the handler starts the final round if
``t + margin >= D``, where::

    margin = T_hi + Q + a * S_hi + slack  (+ U_hi when the final save is to be uploaded)

* ``T_hi`` bounds the final save (copy to host, write, commit, fsync). Two
  populations are measured per storage tier (``GraceOptions.tier_fn``), each
  scaled to the state's current size: the last ``WRITE_WINDOW`` saves made
  while training ran, and the last ``FINAL_WINDOW`` final saves of earlier
  preemptions, made while training waited (kept beside the checkpoints).
  Saves made while training runs compete with it for CPU and the GIL (the
  writer runs at a lower priority), the final save does not; so once
  ``min_samples`` finals exist they bound it, in log space (``log_bound``):
  ``exp(mean(log finals) + max(t * s, k * min_spread) * sqrt(1 + 1/n))``
  and at least their maximum, with ``s`` the standard deviation of the logs
  pooled over both populations (each around its own mean; stalls beyond 5
  robust sigmas left out) and ``t`` the Student quantile with the tail of
  ``spread_k`` normal sigmas for its degrees of freedom (``_stats``); with
  fewer than 4 of them, ``cold_factor`` times the slowest save. Before that, the bound of the saves
  made while training (``bound``: their maximum, or ``median + k sigma``,
  whichever is larger).
* The engine's first save is cold when it costs more than ``cold_factor``
  times the bound of the warm saves (imports, tracing, first allocations):
  it is kept out of the window (it would hold the bound up for
  ``WRITE_WINDOW`` saves and across restarts) and apart, and bounds a final
  save that would be the engine's first.
* Older saves of either window slower than the newer ones by 4 standard
  errors (``stale_prefix``: a machine loaded while processes started) are left out.
* ``Q``: what the saves in flight still need (the engine writes in order, so
  the final save waits for them), bounded like saves made while training:
  the bound per queued save and, for the one being written, the bound minus
  the time it has run, at least a quarter of it; 0 once they are durable
  (re-evaluated at every boundary). With one worker, left out while a new
  save queued behind them would be too late but one alone would not: the
  save in flight can still be adopted as the final one at the same cost
  later, so training goes on until it is durable (``margin_parts``).
* ``S``: step time (``bound`` over the last ``STEP_WINDOW``, the first
  interval left out: compiling, tracing); ``a`` steps: one because the check
  runs once per step (the deadline can be crossed just after one), one more
  with several workers (the agreed step is the largest current step + 1).
* ``slack``: coordination round trips and waking the waiter.
* ``U_hi``: with a remote tier beside the local one and the final save
  planned for it (``choose_tier`` at the notice: when the margin with the
  upload fits in the time left), the bound of the measured uploads, plus
  what is left of an upload in progress.

The risk accepted: a final save slower than ``T_hi`` (at least ``stall_s``
above the center) plus what the step and slack terms leave over: for
log-normal save times whose spread the saves made while training share,
1 in 740 (3 sigma, one-sided; ``t`` and ``sqrt(1 + 1/n)`` pay for few samples).
Not covered: a final save slower than its population by more (a stall longer
than ``stall_s``), finals spread wider than the saves made while training,
and a machine that became slower since (``docs/preemption.md``).

The samples are stored in every checkpoint (and the final, cold and upload
times in a file beside them) and seed the next run, so a restarted job
starts from its measured distribution, not from zero. With several workers,
each publishes its margin at the notice and the final round starts at the
boundary where the *largest* margin of any worker crosses the deadline (see
``agreement``).

(TensorFlow's handler starts at ``G - 6 * mean step``, ignoring the write.)
If ``G <= margin`` the save starts at once.
A save is also made at the notice itself when ``G >= 4 * margin`` (a guard for
long grace periods; in a short one it would only delay the final save).
Without any measured write (a first run that never saved), the final round
starts once ``unknown_write_fraction`` of the grace period has passed, or as
soon as the save made at the notice has been measured.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.writer import AsyncEngine
from asyncckpt.preemption._estimates import (
    COLD_WINDOW,
    FINAL_WINDOW,
    STEP_WINDOW,
    WRITE_WINDOW,
    finite,
    finite_list,
)
from asyncckpt.preemption._stats import bound, log_bound, stale_prefix
from asyncckpt.storage.url import is_url


def local_tier(stats: SaveStats) -> str:
    """Default ``tier_fn``: the URL scheme of the checkpoint (``s3``, ``gs``), else ``local``."""
    label = stats.label or ""
    return label.split(":", 1)[0] if is_url(label) else "local"


@dataclass(frozen=True, kw_only=True)
class GraceOptions:
    """Tuning of the margin (see the module docstring for the rule).

    Attributes:
        window: Recent saves the bound is taken over (at most
            ``WRITE_WINDOW``, what checkpoints store).
        spread_k: Standard deviations above the center the bounds reach (for
            the final save: a normal tail of this many sigmas, widened for
            few samples).
        min_spread: Least standard deviation assumed, as a share of
            the median.
        min_samples: Below this many samples the bound is the maximum times
            ``cold_factor`` (the spread is not known yet); as many final
            saves are needed before they bound the final save.
        cold_factor: See ``min_samples``; also, an engine's first save is
            cold when it costs more than this times the warm saves' bound.
        slack_s: Fixed seconds for coordination round trips and wake-ups
            (None: 0.01 s for one worker, 0.05 s for several).
        stall_s: Least seconds the final save's bound reaches above the center
            of its population: an fsync stalled behind another writer (+0.07-0.22 s
            here, on saves that varied by 1-4%) is rare and additive.
        unknown_write_fraction: Share of the grace period to train for when no
            write time has ever been measured.
        save_at_notice_ratio: Save at the notice as well only if the grace
            period is at least this many margins long (0: always, ``inf``:
            never). That save guards a long grace period against a notice
            that overstates the time left; in a short one it would only
            delay the final save, which waits for it.
        tier_fn: Names the storage tier of a save from its stats; write times
            are bounded per tier and the final save is assumed to go to the
            tier of the latest save.
    """

    window: int = WRITE_WINDOW
    spread_k: float = 3.0
    min_spread: float = 0.05
    min_samples: int = 4
    cold_factor: float = 1.5
    slack_s: float | None = None
    stall_s: float = 0.25
    unknown_write_fraction: float = 0.5
    save_at_notice_ratio: float = 4.0
    tier_fn: Callable[[SaveStats], str] = field(default=local_tier, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.window <= WRITE_WINDOW:
            raise ValueError(f"window must be within [1, {WRITE_WINDOW}], got {self.window!r}")
        if min(self.spread_k, self.slack_s or 0.0, self.min_spread, self.stall_s) < 0:
            raise ValueError("spread_k, min_spread, slack_s and stall_s must be >= 0")
        if self.min_samples < 1 or self.cold_factor < 1:
            raise ValueError("min_samples and cold_factor must be >= 1")
        if not 0 <= self.unknown_write_fraction <= 1:
            raise ValueError("unknown_write_fraction must be within [0, 1]")
        if self.save_at_notice_ratio < 0:
            raise ValueError("save_at_notice_ratio must be >= 0")


def tf_final_save_start(notice_time: float, grace_period: float, mean_step_s: float) -> float:
    """When TensorFlow's handler starts its final save: ``notice + G - 6 * step``.

    (``buffer_factor 3 * estimated_run_time * 2`` in its source.) For
    comparison in benchmarks only.
    """
    return notice_time + grace_period - 6.0 * mean_step_s


class StepTimes:
    """The last ``STEP_WINDOW`` seconds between step boundaries.

    The first interval measured is left out: the first step of a process
    compiles or traces (JAX's jit: 0.5 s for a 50 ms step here) and would
    hold the bound up for ``STEP_WINDOW`` steps.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: deque[float] = deque(maxlen=STEP_WINDOW)
        self._seeded = False
        self.count = 0
        self.first: float | None = None

    def update(self, seconds: float) -> None:
        with self._lock:
            if self.first is None:
                self.first = seconds
                return
            if self._seeded:  # the first measured step replaces the earlier run's
                self._samples.clear()
                self._seeded = False
            self.count += 1
            self._samples.append(seconds)

    def seed(self, samples: Iterable[float]) -> None:
        """Starts from an earlier run's samples (no-op once measured here)."""
        with self._lock:
            if not self._samples:
                self._samples.extend(samples)
                self._seeded = bool(self._samples)

    @property
    def samples(self) -> list[float]:
        with self._lock:
            return list(self._samples)

    @property
    def mean(self) -> float | None:
        samples = self.samples
        return statistics.fmean(samples) if samples else None


class GraceClock:
    """The margin of one handler, from its engine's and its own measurements.

    Args:
        engine: The checkpoint's engine (write and blocking times, saves in
            flight).
        options: Margin tuning.
        num_workers: Workers taking part (one more step of allowance if > 1).
    """

    def __init__(self, engine: AsyncEngine, options: GraceOptions | None = None, *,
                 num_workers: int = 1):
        self.engine = engine
        self.options = options or GraceOptions()
        self.steps = StepTimes()
        self.step_allowance = 1.0 if num_workers <= 1 else 2.0
        self._seeded: dict[str, list[float]] = {}
        self._finals: deque[tuple[float, float]] = deque(maxlen=FINAL_WINDOW)
        self._cold: deque[tuple[float, float]] = deque(maxlen=COLD_WINDOW)
        self._cold_seen: SaveStats | None = None  # the engine's first save, if cold
        self._warm_first: SaveStats | None = None  # ... if it was not
        # The manager's remote tier (``_remote.RemoteTierView``), set by the
        # handler; and the tier the final save is planned for at the notice.
        self.remote = None
        self.plan: str | None = None
        # Set by the handler: whether a save in flight may become the final
        # checkpoint (one worker, no ``save_fn``: see ``margin_parts``), and
        # the deadline once a notice is known.
        self.adoptable = False
        self.deadline_fn: Callable[[], float | None] | None = None
        self._lock = threading.Lock()  # the watcher thread reads the margin too
        self._stale_cache: dict[tuple[float, ...], int] = {}

    # -- samples ----------------------------------------------------------------

    def _is_cold(self, first: SaveStats, warm: Sequence[float]) -> bool:
        """Whether the engine's first save was cold: ``cold_factor`` times the others' bound.

        The first save of a process pays for imports, tracing and first
        allocations (TensorFlow here: 0.97 s against 0.3 s for the next ones);
        the first save of a new engine in a warm process does not. So it is
        judged by what it cost, against the warm samples, with room for an
        ordinary slow save (which stays in the window).
        """
        hi = self._bound(warm)
        return hi is not None and self.save_cost(first) > hi * self.options.cold_factor

    def _save_samples(self) -> tuple[list[float], list[float]]:
        """``(seconds, bytes)`` of recent warm saves of the tier the next save goes to.

        The engine's own saves come after the seeded ones (from the restored
        checkpoint) and push them out of the window. The engine's first save
        is left out if it was cold (``_is_cold``); it is kept apart and stored
        beside the final saves. Older saves of a level that has since dropped
        are left out (``_stale``).
        """
        history = self.engine.history
        seconds = list(self._seeded.get("save_s", []))
        sizes = list(self._seeded.get("save_bytes", []))
        if history:
            tier = self.options.tier_fn(history[-1])
            mine = [s for s in history if self.options.tier_fn(s) == tier]
            first = history[0]
            if mine and mine[0] is first and first is not self._warm_first:
                rest = seconds + [self.save_cost(s) for s in mine[1:]]
                warm = rest[-self.options.window:]
                if first is self._cold_seen:
                    mine = mine[1:]
                elif len(warm) < self.options.min_samples:
                    pass  # too few warm saves to judge it yet: counted, judged later
                elif self._is_cold(first, warm):
                    self._cold_seen = first
                    with self._lock:
                        self._cold.append((self.save_cost(first), float(first.nbytes)))
                    mine = mine[1:]
                else:
                    self._warm_first = first
            seconds += [self.save_cost(s) for s in mine]
            sizes += [float(s.nbytes) for s in mine]
        n = self.options.window
        seconds, sizes = seconds[-n:], sizes[-n:]
        cut = self._stale(seconds)
        return seconds[cut:], sizes[cut:]

    def _stale(self, seconds: list[float]) -> int:
        """``stale_prefix`` of a window (oldest first), cached: it changes once per save."""
        key = tuple(seconds)
        cached = self._stale_cache.get(key)
        if cached is None:
            if len(self._stale_cache) > 8:
                self._stale_cache.clear()
            cached = self._stale_cache[key] = stale_prefix(
                seconds, min_newer=self.options.min_samples, floor=self.options.min_spread)
        return cached

    def is_cold(self, stats: SaveStats) -> bool:
        """Whether ``stats`` is the engine's first save and was cold (see ``_is_cold``)."""
        self._save_samples()
        return stats is self._cold_seen

    def _bound(self, samples: Sequence[float]) -> float | None:
        o = self.options
        return bound(samples, k=o.spread_k, min_samples=o.min_samples,
                     cold_factor=o.cold_factor, min_spread=o.min_spread)

    def _scaled(self, pairs, nbytes: float) -> list[float]:
        return [t * max(1.0, nbytes / b) if b > 0 and nbytes > 0 else t for t, b in pairs]

    def _bounds(self) -> tuple[float | None, float | None]:
        """``(final, during)``: bounds of the final save and of a save made while training.

        See the module docstring. ``final`` is what the final save is
        expected to need at most; ``during`` bounds a save made while
        training runs (what a save in flight at the notice may still need).
        """
        o = self.options
        seconds, sizes = self._save_samples()
        last = self.engine.last_stats
        nbytes = float(last.nbytes) if last is not None else (sizes[-1] if sizes else 0.0)
        during = self._scaled(zip(seconds, sizes, strict=True), nbytes)
        with self._lock:
            finals = list(self._finals)
            cold = self._scaled(list(self._cold), nbytes)
        finals = self._scaled(finals[self._stale([t for t, _ in finals]):], nbytes)
        during_hi = self._bound(during)
        if len(finals) >= o.min_samples:
            # At most cold_factor times the slowest save of either kind.
            final_hi = log_bound(finals, k=o.spread_k, min_spread=o.min_spread,
                                 spread_from=during,
                                 cap=o.cold_factor * max(finals + during))
            center = math.exp(statistics.fmean(math.log(t) for t in finals if t > 0))
        elif during_hi is not None:
            final_hi = max([during_hi, *finals])
            center = statistics.median(during)
        else:
            final_hi = self._bound(finals)
            center = statistics.median(finals) if finals else 0.0
        if final_hi is not None:
            final_hi = max(final_hi, center + o.stall_s)
        if final_hi is not None and cold and not self.engine.history:
            # The final save would be the engine's first: it may pay the cold
            # cost (imports, tracing, first allocations) of earlier runs.
            final_hi = max([final_hi, *cold])
        return final_hi, (during_hi if during_hi is not None else final_hi)

    def save_seconds(self) -> float | None:
        """Upper bound of the final save's time to durable; None if never measured."""
        return self._bounds()[0]

    @staticmethod
    def save_cost(stats: SaveStats) -> float:
        """What a save cost from its start to durable, queueing aside."""
        return stats.blocking_s - stats.slot_wait_s + stats.background_s

    def record_final(self, stats: SaveStats) -> None:
        """Adds the measured cost of a final save (made while training waited).

        A cold final save (the process's first) is kept apart: see ``is_cold``.
        """
        if self.is_cold(stats):
            return
        with self._lock:
            self._finals.append((self.save_cost(stats), float(stats.nbytes)))

    def final_samples(self) -> list[list[float]]:
        """``[[seconds, bytes], ...]`` of recent final saves, oldest first."""
        with self._lock:
            return [[t, b] for t, b in self._finals]

    def cold_samples(self) -> list[list[float]]:
        """``[[seconds, bytes], ...]`` of cold first saves of recent runs, oldest first."""
        self._save_samples()
        with self._lock:
            return [[t, b] for t, b in self._cold]

    def seed_finals(self, samples, *, cold=None) -> None:
        """Starts from the final (and cold) saves of earlier runs (``final_samples()``'s format)."""
        for window, items in ((self._finals, samples), (self._cold, cold)):
            for item in items or ():
                try:
                    t, b = (finite(x) for x in item)
                except (TypeError, ValueError):
                    continue
                if t is not None:
                    with self._lock:
                        window.append((t, b or 0.0))

    def step_seconds(self) -> float:
        return self._bound(self.steps.samples) or 0.0

    def queued_seconds(self, write: float) -> float:
        """Seconds the saves in flight still need before a new one can start."""
        pending = self.engine.pending
        if pending == 0:
            return 0.0
        busy = self.engine.busy_for
        if busy is None:  # staged, the writer has not picked it up yet
            return pending * write
        return (pending - 1) * write + max(write - busy, write / 4)

    def upload_seconds(self) -> float | None:
        """Upper bound of an upload of the final checkpoint to the remote tier, queue included.

        None without a remote tier that uploads in the background, or without
        a measured upload. Bounded like a save (``bound``), scaled to the
        state's current size; an upload in progress is ahead of the final
        one, by what is left of its bound (at least a quarter of it).
        """
        if self.remote is None or self.remote.every_save:
            return None
        samples = self.remote.samples()
        last = self.engine.last_stats
        nbytes = float(last.nbytes) if last is not None else 0.0
        hi = self._bound(self._scaled(samples, nbytes))
        if hi is None:
            return None
        running = self.remote.running_for()
        return hi if running is None else hi + max(hi - running, hi / 4)

    def choose_tier(self, left: float) -> str:
        """At the notice: the tier the final save is planned for, with ``left`` seconds left.

        ``remote`` when the margin with the upload fits in the time left,
        else ``local`` (no upload measured yet counts as not fitting). A URL
        directory uploads every save: always ``remote``. Kept for later calls.
        """
        if self.plan is None:
            if self.remote is None:
                self.plan = "local"
            elif self.remote.every_save:
                self.plan = "remote"
            else:
                self.plan = "remote"  # margin_parts counts the upload while planned
                parts = self.margin_parts()
                if parts is None or self.upload_seconds() is None or parts[0] >= left:
                    self.plan = "local"
        return self.plan

    def margin_parts(self, *, full: bool = False) -> tuple[float, float] | None:
        """``(margin, queued)``: the margin and its part for saves in flight; None if unknown.

        With a remote tier planned for (``choose_tier``; before the notice:
        whenever one exists), the upload's bound is part of both.

        Deferred adoption (unless ``full``): when a save in flight could
        become the final checkpoint (``adoptable``) and a new save queued
        behind it would no longer be durable in time, but one that did not
        queue still would, the saves in flight are left out (``queued`` 0).
        Adopting the save in flight now or a few steps later makes it durable
        at the same moment, so training goes on meanwhile: if that save is
        durable before the margin without it is crossed, a new final save
        is made at the usual boundary (the steps trained count); if not, the
        final round adopts it (``adopt_in_flight`` checks with ``full``).
        Before, the final round started at once there, adopting the save in
        flight with no training, whenever the bound of a save made while
        training (slowed by a loaded machine) exceeded the time left.
        """
        save, during = self._bounds()
        if save is None:
            return None
        queued = self.queued_seconds(during)
        if self.plan != "local":
            upload = self.upload_seconds()
            if upload is not None:
                queued += upload
        rest = self.step_allowance * self.step_seconds() + self.slack_s
        if not full and queued > 0 and self._defer(save, queued, rest):
            return save + rest, 0.0
        return save + queued + rest, queued

    def adopt_in_flight(self) -> bool:
        """At the final boundary: wait for the save in flight instead of making a new one?

        The engine writes in order, so a new save would first wait for the
        one in flight; when both do not fit in the time left (a periodic save
        started just before a short notice), the one in flight is the newest
        checkpoint that can be durable in time. Only if ``adoptable`` (one
        worker: several would have to agree on it; no ``save_fn``).
        """
        if not self.adoptable or self.deadline_fn is None or self.engine.pending == 0:
            return False
        deadline = self.deadline_fn()
        parts = self.margin_parts(full=True)
        if deadline is None or parts is None:
            return False
        at_boundary = parts[0] - self.step_allowance * self.step_seconds()
        return time.time() + at_boundary > deadline

    def _defer(self, save: float, queued: float, rest: float) -> bool:
        """Whether to leave the saves in flight out of the margin (see ``margin_parts``)."""
        if not self.adoptable or self.remote is not None or self.deadline_fn is None:
            return False
        deadline = self.deadline_fn()
        if deadline is None:
            return False
        left = deadline - time.time()
        # A queued save no longer fits (the handler would adopt), a new one alone does.
        return save + queued + self.slack_s > left and save + rest < left

    @property
    def slack_s(self) -> float:
        """Fixed seconds for the protocol: ``slack_s``, or its default per worker count."""
        if self.options.slack_s is not None:
            return self.options.slack_s
        return 0.01 if self.step_allowance == 1.0 else 0.05

    def margin(self) -> float | None:
        """Seconds before the deadline the final round must start; None if unknown."""
        parts = self.margin_parts()
        return None if parts is None else parts[0]

    def full_margin(self) -> float | None:
        """``margin()`` with every save in flight counted (never deferred)."""
        parts = self.margin_parts(full=True)
        return None if parts is None else parts[0]

    def queued(self) -> float:
        """The part of ``margin()`` that the saves in flight account for."""
        parts = self.margin_parts()
        return 0.0 if parts is None else parts[1]

    # -- persistence -----------------------------------------------------------

    def estimates(self) -> dict:
        """What is stored in each checkpoint to seed the next run (JSON-able lists)."""
        seconds, sizes = self._save_samples()
        return {"save_s": seconds, "save_bytes": sizes, "step_s": self.steps.samples}

    def seed(self, estimates: dict) -> None:
        """Starts from the estimates stored in a restored checkpoint."""
        if not estimates:
            return
        seconds = finite_list(estimates.get("save_s"))
        sizes = finite_list(estimates.get("save_bytes"))
        if len(sizes) != len(seconds):
            sizes = [0.0] * len(seconds)
        self._seeded = {"save_s": seconds[-WRITE_WINDOW:], "save_bytes": sizes[-WRITE_WINDOW:]}
        if seconds:
            self.engine.estimator.seed(seconds[-1], int(sizes[-1]) if sizes else 0)
        self.steps.seed(finite_list(estimates.get("step_s"))[-STEP_WINDOW:])

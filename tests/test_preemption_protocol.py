"""The step-agreement protocol and the grace margin, with threads as workers.

Each worker is a thread with its own ``StepAgreement`` over a shared
in-process store; a ``threading.Barrier`` inside each step plays the
collective that keeps real workers in lockstep (and that would deadlock a
protocol which blocked one worker's training thread on another's).
"""

from __future__ import annotations

import functools
import statistics
import subprocess
import sys
import threading
import time

import pytest

from asyncckpt._coordination import InProcessCoordinator
from asyncckpt._engine._jobs import SaveJob
from asyncckpt._engine.writer import AsyncEngine
from asyncckpt.errors import PeerFailedError
from asyncckpt.preemption import _estimates as estimates_lib
from asyncckpt.preemption import _stats as stats_lib
from asyncckpt.preemption import grace as grace_lib
from asyncckpt.preemption.agreement import AgreementOptions, Decision, StepAgreement
from asyncckpt.preemption.watchers import Notice
from tests.helpers import subprocess_env

OPTIONS = AgreementOptions(poll_s=0.05, timeout_s=60)


class Cluster:
    """``n`` workers, each a thread running steps through its ``StepAgreement``.

    Args:
        n: Workers.
        lockstep: Run a barrier in every step, like a collective.
        start_runs: Per-worker starting step counts.
        margin: What ``margin_fn`` answers (one value, or one per worker).
        park: Per-worker events: the worker's step ``park_at`` waits for it
            (a worker stuck in a long step).
    """

    def __init__(self, n: int, *, lockstep: bool = True, start_runs=None, margin=0.0,
                 step_s: float = 0.005, max_steps: int = 100000):
        self.coordinators = InProcessCoordinator.group(n)
        self.margin = margin
        self.agreements = [
            StepAgreement(c, namespace="t", runs=(start_runs or [0] * n)[i],
                          margin_fn=lambda i=i: self._margin(i), options=OPTIONS)
            for i, c in enumerate(self.coordinators)
        ]
        self.park: dict[int, tuple[int, threading.Event]] = {}
        self.collective = threading.Barrier(n) if lockstep else None
        self.step_s = step_s
        self.max_steps = max_steps
        self.saves: list[list[tuple[int, bool]]] = [[] for _ in range(n)]
        self.errors: list[BaseException | None] = [None] * n
        self.progress = [0] * n
        self.progress_changed = threading.Condition()
        self.fail_at: dict[int, int] = {}
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True)
                        for i in range(n)]

    def _margin(self, i: int) -> float | None:
        return self.margin[i] if isinstance(self.margin, list) else self.margin

    def _work(self, i: int) -> None:
        agreement = self.agreements[i]
        try:
            for _ in range(self.max_steps):
                decision = agreement.at_boundary()
                if decision is not Decision.CONTINUE:
                    self.saves[i].append((agreement.runs, decision is Decision.SAVE_AND_EXIT))
                    if decision is Decision.SAVE_AND_EXIT:
                        return
                if self.fail_at.get(i) == agreement.runs:
                    err = RuntimeError(f"step {agreement.runs} failed on worker {i}")
                    agreement.report_error(err)
                    raise err
                if self.collective is not None:
                    self.collective.wait(timeout=60)
                if i in self.park and self.park[i][0] == agreement.runs:
                    assert self.park[i][1].wait(60), "never released"
                time.sleep(self.step_s)
                agreement.step_done()
                with self.progress_changed:
                    self.progress[i] = agreement.runs
                    self.progress_changed.notify_all()
        except threading.BrokenBarrierError:
            self.errors[i] = threading.BrokenBarrierError()
        except BaseException as e:
            self.errors[i] = e
            if self.collective is not None:
                self.collective.abort()  # what the framework does to a failed collective

    def __enter__(self) -> Cluster:
        for a in self.agreements:
            a.start()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for t in self.threads:
            t.join(60)
        for a in self.agreements:
            a.stop()
        assert not any(t.is_alive() for t in self.threads), "a worker hung"

    def wait_progress(self, runs: int) -> None:
        with self.progress_changed:
            ok = self.progress_changed.wait_for(lambda: min(self.progress) >= runs, timeout=60)
        assert ok, f"workers stuck at {self.progress}"


def notice(grace: float = 0.0, source: str = "sigterm") -> tuple[Notice, float]:
    return Notice(source, time.time()), grace


def test_a_notice_on_one_worker_makes_all_save_at_the_same_step():
    with Cluster(3) as cluster:
        cluster.wait_progress(20)
        cluster.agreements[1].notice(*notice())
    finals = [s[-1] for s in cluster.saves]
    assert len({run for run, _ in finals}) == 1, cluster.saves
    assert all(final for _, final in finals)
    assert all(len(s) == 1 for s in cluster.saves)  # no grace: one save only
    assert not any(cluster.errors)


def test_workers_far_apart_agree_on_the_largest_step_plus_one():
    # No collective: the workers drift apart; the agreed step is still one step.
    # The threads run at the speed the scheduler gives each, so how far worker 1
    # got is read, not assumed from worker 0's progress.
    with Cluster(3, lockstep=False, start_runs=[0, 50, 10]) as cluster:
        cluster.wait_progress(15)
        ahead = max(a.runs for a in cluster.agreements)
        cluster.agreements[0].notice(*notice())
    runs = {s[-1][0] for s in cluster.saves}
    assert len(runs) == 1
    (run,) = runs
    assert ahead > 50 and run >= ahead  # at or after the most advanced worker's next boundary


def test_first_notice_wins_and_a_later_one_does_not_reopen_the_protocol():
    with Cluster(2, margin=0.0) as cluster:
        cluster.wait_progress(10)
        first = Notice("gce-maintenance", time.time())
        cluster.agreements[0].notice(first, 3600.0)
        cluster.agreements[1].notice(Notice("user", time.time()), 3600.0)
        notice0 = cluster.coordinators[0].try_get("t/notice")
        cluster.wait_progress(cluster.progress[0] + 5)
        # Both saved once at the notice, then trained on in the grace period.
        assert [len(s) for s in cluster.saves] == [1, 1]
        assert cluster.saves[0] == cluster.saves[1]
        # A SIGTERM (no grace) on worker 1 ends the grace period for everyone.
        cluster.agreements[1].notice(Notice("sigterm", time.time()), 0.0)
    assert '"worker": 0' in notice0 and '"gce-maintenance"' in notice0
    assert cluster.saves[0] == cluster.saves[1]
    assert [final for _, final in cluster.saves[0]] == [False, True]


def test_long_grace_period_saves_at_once_trains_until_the_margin_then_saves_again():
    grace, margin = 2.5, 0.5  # at least 4 margins: a save at the notice too
    with Cluster(2, margin=margin) as cluster:
        cluster.wait_progress(5)
        n, g = notice(grace, "user")
        cluster.agreements[1].notice(n, g)
    assert cluster.saves[0] == cluster.saves[1]
    (first, _), (final, is_final) = cluster.saves[0]
    assert is_final and final > first
    deadline = cluster.agreements[0].deadline()
    assert deadline == pytest.approx(n.wall_time + grace)


def test_short_grace_period_trains_until_the_margin_and_saves_once():
    grace, margin = 1.2, 0.5  # under 4 margins: a save at the notice would only delay
    with Cluster(2, margin=margin) as cluster:
        cluster.wait_progress(5)
        at_notice = min(cluster.progress)
        n, g = notice(grace, "user")
        cluster.agreements[0].notice(n, g)
        cluster.threads[0].join(60)
        ended = time.time()
    assert cluster.saves[0] == cluster.saves[1]
    ((run, final),) = cluster.saves[0]
    assert final and run > at_notice + 5  # trained in the grace period
    assert ended >= n.wall_time + grace - margin


def test_grace_shorter_than_the_margin_saves_at_once():
    with Cluster(2, margin=5.0) as cluster:
        cluster.wait_progress(5)
        cluster.agreements[0].notice(*notice(2.0, "user"))
    assert all(len(s) == 1 and s[0][1] for s in cluster.saves)


def test_unknown_write_time_trains_for_part_of_the_grace_period():
    with Cluster(1, margin=None) as cluster:
        cluster.wait_progress(5)
        n, g = notice(1.0, "user")
        cluster.agreements[0].notice(n, g)
        cluster.threads[0].join(60)
        ended = time.time()
    (first, f0), (final, f1) = cluster.saves[0]
    assert not f0 and f1 and final > first
    assert ended >= n.wall_time + 0.5  # trained for half the grace period


def test_an_error_on_one_worker_stops_the_others():
    with Cluster(3) as cluster:
        cluster.fail_at[2] = 12
    assert isinstance(cluster.errors[2], RuntimeError)
    for i in (0, 1):
        # Released from the collective by the failure, then told at the boundary.
        err = cluster.errors[i]
        assert isinstance(err, (PeerFailedError, threading.BrokenBarrierError)), err


def test_peer_error_is_raised_at_the_next_boundary_without_collectives():
    with Cluster(2, lockstep=False) as cluster:
        cluster.fail_at[1] = 5
    assert isinstance(cluster.errors[0], PeerFailedError)
    assert cluster.errors[0].worker == 1 and "step 5 failed" in cluster.errors[0].error


# -- the margin ------------------------------------------------------------------


def test_slowest_workers_margin_decides_even_when_it_checks_late():
    # Worker 1 needs 2.5 s for its final save (a slow disk), worker 0 almost
    # nothing. Worker 1 is stuck in a long step when its margin crosses the
    # deadline, so only worker 0 checks: it must use worker 1's published margin.
    grace = 3.2
    with Cluster(2, lockstep=False, margin=[0.01, 2.5]) as cluster:
        release = threading.Event()
        cluster.wait_progress(5)
        cluster.park[1] = (cluster.progress[1] + 2, release)
        n, g = notice(grace, "user")
        cluster.agreements[0].notice(n, g)
        go = cluster.coordinators[0].get("t/round/1/go", 60)  # waits on the store
        opened = time.time()
        release.set()
        assert go is not None, "no final round"
    assert '"by": 0' in go
    # Opened when the slow worker's margin, not the fast one's, crossed the deadline.
    assert opened < n.wall_time + grace - 1.0
    assert cluster.saves[0][-1] == cluster.saves[1][-1] and cluster.saves[0][-1][1]


def test_bound_is_the_max_or_a_robust_spread_and_cold_without_samples():
    b = functools.partial(stats_lib.bound, k=3.0, min_samples=4, cold_factor=1.5)
    assert b([]) is None
    assert b([1.0, 2.0]) == pytest.approx(3.0)  # too few samples: max * cold factor
    assert b([1.0] * 8) == pytest.approx(1.0)  # no spread: the max
    # ... unless a least spread is assumed: 3 sigma of 5% of the median
    assert b([1.0] * 8, min_spread=0.05) == pytest.approx(1.15)
    samples = [1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 1.05]
    mad = statistics.median(abs(x - 1.0) for x in samples)
    assert b(samples) == pytest.approx(1.0 + 3 * 1.4826 * mad)
    assert b([1.0] * 7 + [5.0]) == pytest.approx(5.0)  # one stall: the max holds it
    assert grace_lib.tf_final_save_start(100.0, 10.0, 0.5) == pytest.approx(107.0)


def test_estimates_round_trip_through_the_fixed_layout():
    estimates = {"save_s": [0.5, 0.6], "save_bytes": [10.0, 20.0], "step_s": [0.1] * 40}
    values = estimates_lib.encode_estimates(estimates)
    assert len(values) == estimates_lib.ESTIMATES_LENGTH
    decoded = estimates_lib.decode_estimates(values)
    assert decoded["save_s"] == [0.5, 0.6] and decoded["step_s"] == [0.1] * 32
    assert estimates_lib.decode_estimates([1.0] * 6) == {}  # another layout: ignored


class _SlowJob(SaveJob):
    """A save job whose write takes ``seconds`` (a slow disk); it publishes nothing."""

    def __init__(self, seconds: float, nbytes: int = 1000, label: str = "job"):
        super().__init__(label=label, step=None, nbytes=nbytes)
        self.seconds = seconds
        self.started = threading.Event()

    def write(self):
        self.started.set()
        time.sleep(self.seconds)  # the slow disk at work

    def commit(self, stats):
        pass


def _save(engine, seconds, nbytes=1000, label="job", wait=True):
    handle = engine.save(lambda slot: _SlowJob(seconds, nbytes, label), label=label)
    if wait:
        handle.result()
    return handle


# The statistics alone: the stall allowance (``stall_s``, 0.25 s, far above
# these millisecond saves) has its own test in test_preemption_grace_stats.py.
NO_STALL = grace_lib.GraceOptions(stall_s=0.0)


def test_grace_clock_bounds_measured_writes_and_persists_the_samples():
    opts = NO_STALL
    with AsyncEngine(name="t") as engine:
        clock = grace_lib.GraceClock(engine, opts)
        assert clock.margin() is None  # nothing measured
        for seconds in (0.03, 0.05, 0.04, 0.06, 0.03):
            _save(engine, seconds)
        clock.steps.update(0.5)  # the first step (compiling, tracing): left out
        for _ in range(10):
            clock.steps.update(0.01)
        saves = [s.blocking_s - s.slot_wait_s + s.background_s for s in engine.history]
        save_hi = stats_lib.bound(saves, k=3.0, min_samples=4, cold_factor=1.5,
                                  min_spread=0.05)
        assert clock.save_seconds() == pytest.approx(save_hi)
        assert save_hi >= max(saves) >= 0.06
        margin = clock.margin()
        assert margin == pytest.approx(save_hi + 0.01 * 1.15 + clock.slack_s, rel=1e-6)
        assert clock.slack_s == 0.01  # one worker: no coordination round trips
        estimates = clock.estimates()
        assert estimates["save_s"] == pytest.approx(saves)
        assert estimates["step_s"] == pytest.approx([0.01] * 10)
        # A save in flight delays the final one: it is part of the margin, by
        # what is left of its write.
        handle = _save(engine, 0.3, wait=False)
        deadline = time.monotonic() + 30
        while engine.busy_for is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        in_flight, queued = clock.margin_parts()
        assert queued > 0 and in_flight == pytest.approx(margin + queued, rel=1e-6)
        handle.result()
        estimates = clock.estimates()
    # A restarted job starts from the stored samples (through the TF layout).
    restored = estimates_lib.decode_estimates(estimates_lib.encode_estimates(estimates))
    with AsyncEngine(name="t2") as engine2:
        restarted = grace_lib.GraceClock(engine2, opts)
        restarted.seed(restored)
        assert restarted.save_seconds() == pytest.approx(clock.save_seconds())
        assert restarted.step_seconds() == pytest.approx(0.01 * 1.15)  # 3 sigma of 5%
        restarted.steps.update(0.5)  # the first step here: left out, the seeds stay
        assert restarted.step_seconds() == pytest.approx(0.01 * 1.15)
        restarted.steps.update(0.02)  # measured here: the earlier run's steps are dropped
        assert restarted.step_seconds() == pytest.approx(0.02 * 1.5)


def test_final_saves_bound_the_final_save_with_the_spread_of_all_saves():
    with AsyncEngine(name="t") as engine:
        clock = grace_lib.GraceClock(engine, NO_STALL)
        for seconds in (0.05, 0.06, 0.05, 0.07, 0.05):
            _save(engine, seconds)  # saves during training, slowed by it
        during_training = clock.save_seconds()
        costs = [clock.save_cost(st) for st in engine.history]
        assert during_training == pytest.approx(stats_lib.bound(
            costs, k=3.0, min_samples=4, cold_factor=1.5, min_spread=0.05))
        clock.seed_finals([[0.01, 1000.0]] * 3)  # too few finals: not used
        assert clock.save_seconds() == pytest.approx(during_training)
        clock.seed_finals([[0.012, 1000.0]])  # four: they bound the final save
        finals = [0.01, 0.01, 0.01, 0.012]
        expected = stats_lib.log_bound(finals, k=3.0, min_spread=0.05, spread_from=costs)
        assert clock.save_seconds() == pytest.approx(expected)
        assert 0.012 <= expected < during_training
        clock.seed_finals([[1.0, 1000.0]] * 8)  # slower finals: a slower final save
        assert clock.save_seconds() >= 1.0
        clock.record_final(engine.last_stats)
        assert clock.final_samples()[-1][0] == pytest.approx(
            grace_lib.GraceClock.save_cost(engine.last_stats))


def test_log_bound_widens_for_few_samples_and_covers_the_measured_tail():
    import math

    assert stats_lib.t_quantile(3.0, 1e6) == pytest.approx(3.0, rel=1e-3)
    qs = [stats_lib.t_quantile(3.0, df) for df in (4, 7, 15, 30)]
    assert qs == sorted(qs, reverse=True) and qs[-1] > 3.0
    assert qs[1] == pytest.approx(4.785, rel=0.1)  # Student t_7 at 1 - 0.00135
    # Final saves with a log-normal spread of sigma 0.15 (the benchmark's
    # heavy noise), at the normal quantiles of 8 samples: the bound reaches
    # a save 1.4 times their median (a 2.2 sigma event) and more.
    z = [-1.42, -0.85, -0.47, -0.15, 0.15, 0.47, 0.85, 1.42]
    finals = [3.0 * math.exp(0.15 * v) for v in z]
    hi = stats_lib.log_bound(finals, k=3.0, min_spread=0.05)
    assert hi >= 1.4 * statistics.median(finals)
    # The spread of other saves pooled in: more degrees of freedom, a
    # tighter t; a wider spread there, a wider bound.
    narrow = [3.0 * math.exp(0.15 * v) for v in z * 2]
    pooled = stats_lib.log_bound(finals, k=3.0, spread_from=narrow)
    assert 1.4 * statistics.median(finals) <= pooled < hi
    wide = [3.0 * math.exp(0.5 * v) for v in z * 2]
    assert stats_lib.log_bound(finals, k=3.0, spread_from=wide) > pooled
    # A few saves slowed ten times by a loaded machine widen it, not explode it.
    stalled = narrow[:-3] + [30.0] * 3
    assert stats_lib.log_bound(finals, k=3.0, spread_from=stalled) < 2 * pooled
    assert stats_lib.log_bound([2.0] * 4, k=3.0) == pytest.approx(2.0)  # no spread: the max
    assert stats_lib.log_bound([2.0] * 4, k=3.0, min_spread=0.05) > 2.0


def test_a_cold_first_save_is_kept_apart_and_bounds_a_first_final_save():
    with AsyncEngine(name="t") as engine:
        clock = grace_lib.GraceClock(engine)
        clock.seed({"save_s": [0.02] * 6, "save_bytes": [1000.0] * 6})
        _save(engine, 1.0)  # the first save of a fresh process: imports, tracing
        for _ in range(3):
            _save(engine, 0.02)
        first = engine.history[0]
        assert clock.is_cold(first)
        assert clock.save_seconds() < 1.0  # not in the window of warm saves
        assert all(s < 1.0 for s in clock.estimates()["save_s"])  # nor stored as one
        assert clock.cold_samples() == [[pytest.approx(clock.save_cost(first)), 1000.0]]
        clock.record_final(first)
        assert clock.final_samples() == []  # a cold save is no final save's sample
        stored = clock.cold_samples()
    assert stored[0][0] >= 1.0
    with AsyncEngine(name="t2") as engine2:
        restarted = grace_lib.GraceClock(engine2)
        # Warm saves of 0.5 s: a first save is cold above 1.5 x their bound.
        restarted.seed({"save_s": [0.5] * 6, "save_bytes": [1000.0] * 6})
        restarted.seed_finals([], cold=[[2.0, 1000.0]])
        # No save yet in this run: the final save would be the first, cold one.
        assert restarted.save_seconds() >= 2.0
        _save(engine2, 0.02)  # a warm first save (the process was warm)
        assert not restarted.is_cold(engine2.history[0])
        assert restarted.save_seconds() < 2.0


def test_write_bound_scales_with_state_bytes_and_is_per_tier():
    def expected(engine, tier_prefix):
        mine = [st for st in engine.history if st.label.startswith(tier_prefix)]
        now = engine.last_stats.nbytes
        costs = [grace_lib.GraceClock.save_cost(st) * max(1.0, now / st.nbytes) for st in mine]
        return stats_lib.bound(costs, k=3.0, min_samples=4, cold_factor=1.5, min_spread=0.05)

    with AsyncEngine(name="t") as engine:
        clock = grace_lib.GraceClock(engine, NO_STALL)
        for _ in range(4):
            _save(engine, 0.02, nbytes=1000)
        _save(engine, 0.02, nbytes=4000)  # the state grew four times
        grown = clock.save_seconds()
        assert grown == pytest.approx(expected(engine, "job"))
        assert grown >= 4 * min(clock.save_cost(st) for st in engine.history)
        # Saves to another tier are bounded by that tier's samples only.
        for _ in range(4):
            _save(engine, 0.08, nbytes=4000, label="s3://bucket/ckpt")
        assert clock.save_seconds() == pytest.approx(expected(engine, "s3://"))
        _save(engine, 0.02, nbytes=4000)  # back on the local disk
        assert clock.save_seconds() == pytest.approx(expected(engine, "job"))


def test_importing_and_detecting_imports_no_framework():
    code = ("import os, sys, asyncckpt.preemption as p; "
            "os.environ['GCE_METADATA_HOST'] = '127.0.0.1:9'; "
            "print(p.detect_platform(refresh=True).value, "
            "'tensorflow' in sys.modules, 'jax' in sys.modules)")
    env = {k: v for k, v in subprocess_env().items() if k != "ASYNCCKPT_PLATFORM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout
    assert out.split() == ["other", "False", "False"]

"""The grace margin's statistics (deterministic) and the deferred adoption of a save in flight.

The statistics are pure functions: checked on fixed samples and on seeded
simulations. The deferral is checked on a real ``AsyncEngine`` with a slow
save job in flight and a real ``StepAgreement`` over the in-process store.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time

import pytest

from asyncckpt._coordination import InProcessCoordinator
from asyncckpt._engine._jobs import SaveJob
from asyncckpt._engine.writer import AsyncEngine
from asyncckpt.preemption import _stats
from asyncckpt.preemption import agreement as agreement_lib
from asyncckpt.preemption import grace as grace_lib
from asyncckpt.preemption.agreement import AgreementOptions, Decision, StepAgreement
from asyncckpt.preemption.watchers import Notice

# The normal quantiles of 16 samples: a sample of sigma 1 without sampling noise.
Z16 = [-1.87, -1.32, -1.0, -0.76, -0.56, -0.39, -0.24, -0.08,
       0.08, 0.24, 0.39, 0.56, 0.76, 1.0, 1.32, 1.87]


def test_pooled_spread_is_the_pooled_standard_deviation_with_its_exact_degrees_of_freedom():
    sigma, df = _stats.pooled_spread([[0.2 * z for z in Z16]])
    # Nothing left out of a normal sample: the textbook standard deviation.
    assert df == 15 and sigma == pytest.approx(statistics.stdev([0.2 * z for z in Z16]))
    assert sigma == pytest.approx(0.2, rel=0.05)
    # Groups at different levels pool, each around its own mean.
    shifted, df2 = _stats.pooled_spread([[0.2 * z for z in Z16], [5 + 0.2 * z for z in Z16]])
    assert df2 == 30 and shifted == pytest.approx(sigma)
    # Unequal groups: sum of squares over the sum of n - 1.
    a, b = [0.0, 0.2, 0.4], [1.0, 1.6]
    pooled, df3 = _stats.pooled_spread([a, b])
    assert df3 == 3
    assert pooled == pytest.approx(math.sqrt((0.08 + 0.18) / 3))
    # Groups of one sample add nothing; nothing to compare: no spread.
    assert _stats.pooled_spread([[1.0], [2.0]]) == (0.0, 0)


def test_pooled_spread_leaves_stalls_out_with_their_degrees_of_freedom():
    clean = [0.2 * z for z in Z16[:-3]]
    sigma, df = _stats.pooled_spread([clean])
    # Three stalls of ten times the level (log 2.3) in 16: left out, the
    # spread is that of the other 13; a standard deviation would triple.
    stalled = clean + [2.3] * 3
    robust, df_robust = _stats.pooled_spread([stalled])
    assert df_robust == df == 12 and robust == pytest.approx(sigma)
    assert statistics.stdev(stalled) > 3 * robust
    # A stall is judged against the robust spread, at least ``floor``: saves
    # that never varied and one 20% slower (log 0.18) keep it below 5 x 5%.
    flat = [0.0] * 8 + [0.18]
    assert _stats.pooled_spread([flat], floor=0.05)[1] == 8
    jump = [*flat[:-1], 0.3]  # 35% slower: a stall
    assert _stats.pooled_spread([jump], floor=0.05)[1] == 7
    assert _stats.pooled_spread([jump])[1] == 8  # Qn 0 and no floor: nothing to judge by
    # Five sigmas, not fewer: the tail of a normal sample is kept.
    tail = [0.2 * z for z in Z16] + [0.2 * 3.5]
    assert _stats.pooled_spread([tail])[1] == 16


def test_the_least_spread_is_assumed_not_estimated_so_few_samples_do_not_widen_it():
    # Saves that never varied: the floor counts k = 3 times, not t times.
    hi = _stats.log_bound([1.0] * 4, k=3.0, min_spread=0.05, spread_from=[1.0] * 9)
    assert hi == pytest.approx(math.exp(3 * 0.05 * math.sqrt(1 + 1 / 4)))
    assert hi < 1.2  # the rule before: 1.43 (t = 6.4 for 4 degrees of freedom)
    # A measured spread is widened by t for few samples (and less for more).
    finals = [math.exp(0.15 * z) for z in Z16[::4]]
    few = _stats.log_bound(finals, k=3.0, spread_from=[math.exp(0.15 * z) for z in Z16[::2]])
    many = _stats.log_bound(finals, k=3.0, spread_from=[math.exp(0.15 * z) for z in Z16])
    assert many < few
    assert many > math.exp(3 * 0.15)  # never below the known-sigma bound
    assert _stats.log_bound(finals, k=3.0, cap=1.2) == pytest.approx(1.2)  # the cap
    assert _stats.log_bound([2.0, 3.0], k=3.0, cap=1.0) == 3.0  # never below the slowest


def test_log_bound_is_the_student_prediction_bound_and_the_cap_below_four_degrees_of_freedom():
    finals = [math.exp(0.15 * z) for z in Z16[::2]]  # 8
    during = [1.2 * math.exp(0.15 * z) for z in Z16]  # 16, at another level
    logs = [math.log(x) for x in finals]
    s, df = _stats.pooled_spread([logs, [math.log(x) for x in during]])
    assert df == 22
    expected = math.exp(statistics.fmean(logs)
                        + _stats.t_quantile(3.0, 22) * s * math.sqrt(1 + 1 / 8))
    assert _stats.log_bound(finals, k=3.0, min_spread=0.05, spread_from=during,
                            cap=10.0) == pytest.approx(expected)
    # 4 finals and nothing else: 3 degrees of freedom, too few for t: the cap.
    four = finals[::2]
    assert _stats.log_bound(four, k=3.0, min_spread=0.05, cap=10.0) == 10.0
    # One more sample of either group and the spread counts (t for 4).
    four_df = _stats.log_bound(four, k=3.0, min_spread=0.05, spread_from=during[:2], cap=10.0)
    s4, df4 = _stats.pooled_spread([[math.log(x) for x in four], [math.log(x) for x in during[:2]]])
    assert df4 == 4 and four_df == pytest.approx(math.exp(
        statistics.fmean(math.log(x) for x in four)
        + _stats.t_quantile(3.0, 4) * s4 * math.sqrt(1 + 1 / 4)))


def _simulate(n_final, n_during, draws, seed):
    """Misses and median width of ``log_bound`` for log-normal saves (sigma 0.15)."""
    rng = random.Random(seed)
    misses, widths = 0, []
    for _ in range(draws):
        finals = [math.exp(rng.gauss(0.0, 0.15)) for _ in range(n_final)]
        during = [math.exp(rng.gauss(0.1, 0.15)) for _ in range(n_during)]
        hi = _stats.log_bound(finals, k=3.0, min_spread=0.05, spread_from=during)
        widths.append(hi)
        misses += math.exp(rng.gauss(0.0, 0.15)) > hi
    return misses / draws, statistics.median(widths)


def test_log_bound_misses_about_its_nominal_tail_in_simulation():
    # 4 final saves and 16 saves made while training, log-normal with the
    # benchmark's heavy noise (sigma 0.15); the next final save is drawn
    # from the same law. Nominal: 3 normal sigmas, 0.135% (simulated with
    # 100 000 draws: 0.13%).
    missed, width = _simulate(4, 16, 6000, 20261123)
    assert missed <= 0.005
    # ... and it is not bought with a silly width: 1.77 times the median
    # (the Qn spread before: 1.92; known sigma: 1.65).
    assert width < 1.85
    # 8 finals: 1.70 (Qn: 1.80).
    missed, width = _simulate(8, 16, 3000, 20261124)
    assert missed <= 0.005 and width < 1.76


# Saves made while training, recorded by the deadline benchmark (JAX, 2 s
# grace, 0.25 s write, no added noise): 8 made while the chunk's other
# processes started (imports, compilation), then 6 on the quiet machine.
WARMUP = [0.3494, 0.4488, 0.3963, 0.4491, 0.525, 0.4649, 0.4006, 0.4483]
QUIET = [0.2754, 0.2663, 0.2684, 0.2578, 0.2584, 0.2573]


def test_a_level_that_dropped_is_left_out_a_stall_or_a_rise_is_not():
    assert _stats.stale_prefix(WARMUP + QUIET, min_newer=4, floor=0.05) == 8
    # Too few newer samples to call it a level yet.
    assert _stats.stale_prefix(WARMUP + QUIET[:3], min_newer=4, floor=0.05) == 0
    # No shift: a normal sample in a scrambled order.
    scrambled = [math.exp(0.15 * z) for z in Z16[1::2] + Z16[::2]]
    assert _stats.stale_prefix(scrambled, min_newer=4, floor=0.05) == 0
    # One stall among the older saves is not a level (medians).
    stalled = [0.26, 2.6, 0.27, 0.26, *QUIET]
    assert _stats.stale_prefix(stalled, min_newer=4, floor=0.05) == 0
    # A machine that became slower keeps its older, faster saves.
    assert _stats.stale_prefix(QUIET + WARMUP, min_newer=4, floor=0.05) == 0


def test_the_clock_bounds_with_the_current_level_and_stores_only_it():
    with AsyncEngine(name="t") as engine:
        clock = grace_lib.GraceClock(engine, grace_lib.GraceOptions(stall_s=0.0))
        clock.seed({"save_s": WARMUP + QUIET, "save_bytes": [1000.0] * 14})
        assert clock.estimates()["save_s"] == QUIET  # what the next checkpoint carries
        finals = [0.27, 0.26, 0.265, 0.262]
        clock.seed_finals([[0.45, 1000.0]] * 4 + [[t, 1000.0] for t in finals])
        assert clock.save_seconds() == pytest.approx(_stats.log_bound(
            finals, k=3.0, min_spread=0.05, spread_from=QUIET, cap=1.5 * max(finals + QUIET)))
        assert clock.save_seconds() < 0.33
        # Without the cut: the warm-up saves held the bound up (0.47 s).
        held = _stats.log_bound([0.45] * 4 + finals, k=3.0, min_spread=0.05,
                                spread_from=WARMUP + QUIET, cap=1.5 * 0.525)
        assert held > 0.45


def test_the_final_bound_reaches_a_stall_above_the_center_of_its_population():
    """Final saves that varied by 1-2%: the 3-sigma floor reaches 16% above them, a stall of
    the fsync behind another writer 0.07-0.22 s; the bound reaches ``stall_s`` above."""
    finals = [0.2606, 0.2573, 0.2576, 0.2555]  # recorded: the next one took 0.359 s
    during = [0.2636, 0.2596, 0.2635, 0.2634, 0.2565, 0.262, 0.2604, 0.268]
    with AsyncEngine(name="t") as engine:
        statistical = grace_lib.GraceClock(engine, grace_lib.GraceOptions(stall_s=0.0))
        clock = grace_lib.GraceClock(engine)
        for c in (statistical, clock):
            c.seed({"save_s": during, "save_bytes": [1000.0] * 8})
        assert statistical.save_seconds() < 0.31  # the recorded final save missed it
        # With fewer than 4 finals: the center is the median of the other saves.
        assert clock.save_seconds() == pytest.approx(statistics.median(during) + 0.25)
        for c in (statistical, clock):
            c.seed_finals([[t, 1000.0] for t in finals])
        center = math.exp(statistics.fmean(math.log(t) for t in finals))
        assert clock.save_seconds() == pytest.approx(center + 0.25) and center + 0.25 > 0.359
    # Where the statistics reach farther (a noisy disk), the allowance adds nothing.
    noisy = [0.2 * math.exp(0.3 * z) for z in Z16]
    with AsyncEngine(name="t2") as engine:
        statistical = grace_lib.GraceClock(engine, grace_lib.GraceOptions(stall_s=0.0))
        clock = grace_lib.GraceClock(engine)
        for c in (statistical, clock):
            c.seed({"save_s": noisy, "save_bytes": [1000.0] * 16})
            c.seed_finals([[t, 1000.0] for t in noisy[::2]])
        assert statistical.save_seconds() > 0.2 + 0.25
        assert clock.save_seconds() == pytest.approx(statistical.save_seconds())


class _SlowJob(SaveJob):
    """A save job whose write takes ``seconds`` (a slow disk); it publishes nothing."""

    def __init__(self, seconds: float, nbytes: int = 1000):
        super().__init__(label="job", step=None, nbytes=nbytes)
        self.seconds = seconds
        self.release = threading.Event()

    def write(self):
        self.release.wait(self.seconds)  # the slow disk at work

    def commit(self, stats):
        pass


class _WallClockAt:
    """A ``time`` module whose wall clock stands at one instant (monotonic time runs)."""

    monotonic = staticmethod(time.monotonic)

    def __init__(self, at: float):
        self.at = at

    def time(self) -> float:
        return self.at


def test_a_save_in_flight_that_only_an_adoption_could_follow_does_not_stop_training():
    """One worker, a save in flight whose bound leaves no room for a new save behind it.

    The margin leaves it out while a new save alone would still fit (adopting
    it later costs nothing), so the notice does not end training at once and
    no save is made at the notice; once it is durable the margin is the one
    of a new save alone. At the boundary where even that is crossed with the
    save still in flight, the final round adopts it.
    """
    with AsyncEngine(name="t") as engine:
        clock = grace_lib.GraceClock(engine)
        # Saves made while training took 1 s (a loaded machine), final saves 0.2 s.
        clock.seed({"save_s": [1.0] * 8, "save_bytes": [1000.0] * 8})
        clock.seed_finals([[0.2, 1000.0]] * 8)
        agreement = StepAgreement(InProcessCoordinator(), namespace="d", runs=0,
                                  margin_fn=clock.margin, full_margin_fn=clock.full_margin,
                                  queued_fn=clock.queued,
                                  options=AgreementOptions(poll_s=0.01, timeout_s=30))
        clock.adoptable, clock.deadline_fn = True, agreement.deadline
        job = _SlowJob(60.0)
        handle = engine.save(lambda slot: job, label="job")
        deadline = time.monotonic() + 30
        while engine.busy_for is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        full, queued = clock.margin_parts(full=True)
        assert queued > 0.9  # the save in flight: about its 1.15 s bound left
        agreement.start()
        try:
            # The agreement's wall clock holds still from the notice to the boundary:
            # the verdicts are about the margins (0.46 s fits in the 1 s grace, 1.61 s
            # does not), not about how fast a loaded machine gets to the boundary.
            now = time.time()
            with pytest.MonkeyPatch.context() as held:
                held.setattr(agreement_lib, "time", _WallClockAt(now))
                agreement.notice(Notice("sigterm", now, "test"), 1.0)  # 1 s: < full
                margin, left_out = clock.margin_parts()
                assert left_out == 0.0 and margin == pytest.approx(full - queued, abs=0.05)
                assert clock.adopt_in_flight()  # a new save now would be late ...
                assert agreement.at_boundary() is Decision.CONTINUE  # ... but training goes on
            # Not adoptable (several workers, save_fn): the whole margin counts.
            clock.adoptable = False
            assert clock.margin() == pytest.approx(clock.full_margin(), abs=0.05)
            clock.adoptable = True
            job.release.set()  # the save in flight is durable: nothing queued any more
            handle.result()
            assert clock.queued() == 0.0 and not clock.adopt_in_flight()
            # Without the deferral, the notice would have been the final round.
            while agreement.at_boundary() is Decision.CONTINUE:
                agreement.step_done()
                time.sleep(0.01)
                assert time.time() < agreement.deadline() + 5
            assert time.time() + clock.margin() >= agreement.deadline()
        finally:
            job.release.set()
            agreement.stop()

"""The statistics of the grace margin: upper bounds of the next save or step time.

Pure functions over lists of seconds, with no engine and no clock, so they
can be checked deterministically (``tests/test_preemption_grace_stats.py``).
``grace.GraceClock`` applies them to what it measured; ``docs/preemption.md``
("The grace margin") gives the rule and the risk it accepts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Consistency constant of the Qn scale estimator (Rousseeuw and Croux, 1993):
# the first quartile of |x_i - x_j| of normal samples is 0.4500 sigma, so
# sigma = 2.2219 * that quartile.
QN_CONSTANT = 2.2219
# Samples farther than this many robust (Qn) sigmas from their group's median
# are stalls, left out of the spread: a normal sample gets there once in
# 1.7 million, a save slowed ten times by a loaded machine (log 2.3) at any
# spread below 0.46. Fewer sigmas would trim the normal tail whenever Qn
# happened to come out low, and the bound would miss more often than its
# nominal tail (simulated with 8 and 16 samples, 400 000 draws: 0.20% missed
# at 3 sigmas, 0.13% at 5 against the nominal 0.135%).
CLIP_SIGMAS = 5.0
# Least degrees of freedom ``t_quantile`` is asked for (its expansion holds
# from about there: 6.4 at k = 3, the exact value being 6.6).
MIN_DF = 4.0


def bound(samples: Sequence[float], *, k: float, min_samples: int,
          cold_factor: float, min_spread: float = 0.0) -> float | None:
    """A robust upper bound of the next sample (saves made while training, steps).

    ``max(max(x), median + k * sigma)`` with ``sigma = max(1.4826 * MAD,
    min_spread * median)``, or ``max(x) * cold_factor`` with fewer than
    ``min_samples`` samples; None without any.
    """
    if not samples:
        return None
    top = max(samples)
    if len(samples) < min_samples:
        return top * cold_factor
    med = statistics.median(samples)
    sigma = max(1.4826 * statistics.median(abs(x - med) for x in samples), min_spread * med)
    return max(top, med + k * sigma)


def t_quantile(k: float, df: float) -> float:
    """Student's t quantile with the upper tail of a normal's ``k`` sigmas (``df`` >= 1).

    Cornish-Fisher expansion to the third order (within ~10% of the exact
    value for df >= 4 at k = 3, exact as df grows); used so that a bound
    from few samples widens by what estimating their spread costs.
    """
    z, v = k, max(1.0, df)
    return (z + (z ** 3 + z) / (4 * v)
            + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))


def _qn(groups: Sequence[Sequence[float]]) -> float:
    """The Qn spread of several groups pooled (no center needed), without its small-sample factor.

    The first quartile of the absolute differences of every pair *within* a
    group, times ``QN_CONSTANT``: a quarter of the pairs may be outliers.
    Groups of one sample add nothing; 0.0 if no group has two.
    """
    diffs = sorted(abs(a - b) for g in groups for i, a in enumerate(g) for b in g[i + 1:])
    if not diffs:
        return 0.0
    pos = 0.25 * (len(diffs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(diffs) - 1)
    return QN_CONSTANT * (diffs[lo] + (diffs[hi] - diffs[lo]) * (pos - lo))


def pooled_spread(groups: Sequence[Sequence[float]], *,
                  clip: float = CLIP_SIGMAS, floor: float = 0.0) -> tuple[float, int]:
    """``(sigma, degrees of freedom)``: the pooled standard deviation of groups, stalls left out.

    Each group is centered on its own mean (groups at different levels pool:
    saves made while training and final saves), and the squared deviations
    are pooled: ``sigma^2 = sum (x - mean_g)^2 / sum (n_g - 1)``, the
    estimate whose degrees of freedom are exactly ``sum (n_g - 1)``, so a
    Student ``t`` makes the bound exact for normal samples. Robust: a sample
    farther than ``clip`` robust sigmas (``_qn``, at least ``floor``) from
    its group's median is a stall (a save slowed ten times by a loaded
    machine), not a spread to extrapolate, and is left out with its degree
    of freedom. The previous estimator, Qn itself, was as robust but worth
    only about 70% of the degrees of freedom (its efficiency at these sample
    sizes), so the same samples needed a larger ``t``. Groups with fewer than
    two samples kept add nothing; ``(0.0, 0)`` without any.
    """
    scale = max(_qn(groups), floor)
    squares, df = 0.0, 0
    for g in groups:
        kept = list(g)
        if scale > 0 and len(kept) >= 2:
            med = statistics.median(kept)
            kept = [x for x in kept if abs(x - med) <= clip * scale]
        if len(kept) < 2:
            continue
        mean = statistics.fmean(kept)
        squares += sum((x - mean) ** 2 for x in kept)
        df += len(kept) - 1
    return (math.sqrt(squares / df) if df else 0.0), df


def log_bound(samples: Sequence[float], *, k: float, min_spread: float = 0.0,
              spread_from: Sequence[float] = (), cap: float | None = None) -> float:
    """An upper prediction bound of the next sample, in log space.

    ``max(max(x), exp(mean + max(t * s, k * min_spread) * sqrt(1 + 1/n)))``
    over the logs of the ``n`` samples ``x``: ``s`` is the standard
    deviation of the logs pooled with those of ``spread_from``, stalls left
    out (``pooled_spread``), and ``t`` the Student quantile with the tail of
    ``k`` normal sigmas for its degrees of freedom (at least ``MIN_DF``).
    For normal logs with a spread shared by both groups this is the exact
    prediction bound: the next sample exceeds it with the probability of a
    normal ``k``-sigma tail (``t`` pays for estimating the spread,
    ``sqrt(1 + 1/n)`` for estimating the mean). Log space because save times
    are positive and skewed (multiplicative noise); stalls left out because
    saves slowed by a loaded machine (a few 10 times the median) are not a
    spread to extrapolate (a plain standard deviation made bounds of 15-20 s
    from samples of 0.3-5 s). ``min_spread`` is an assumed least spread,
    not an estimate: it is taken ``k`` times, not ``t`` times (with ``t`` =
    6.4 for few samples, a 5% floor made a bound 1.43 times a save that
    never varied by more than 1%). The slowest sample is kept as a floor; at
    most ``cap``, and ``cap`` itself with fewer than ``MIN_DF`` degrees of
    freedom.
    """
    logs = [math.log(x) for x in samples if x > 0]
    if not logs:
        return max(samples)
    other = [math.log(x) for x in spread_from if x > 0]
    s, df = pooled_spread([logs, other], floor=min_spread)
    if df < MIN_DF and cap is not None:
        # Too few to estimate a spread (the expansion of t diverges there,
        # and a t for MIN_DF would miss three times its tail): the cap.
        return max(max(samples), cap)
    t = t_quantile(k, max(MIN_DF, df)) if df else k
    n = len(logs)
    reach = max(t * s, k * min_spread) * math.sqrt(1 + 1 / n)
    hi = math.exp(statistics.fmean(logs) + reach)
    if cap is not None:
        hi = min(hi, cap)
    return max(max(samples), hi)


# A level shift must stand this many standard errors above the noise before
# the older samples are left out (``stale_prefix``). Simulated on normal
# windows without a shift (8 finals, 16 other saves, sigma 0.15): 0.25% of
# the windows of other saves and 0.5% of those of finals lose older
# samples, and the final bound missed 0.18% of 20 000 draws, 0.17% without
# the cut (the simulation's noise: +-0.03%).
SHIFT_SIGMAS = 4.0
# Least number of older samples a shift is judged on: their median then
# ignores one stall (a single slow save is not a level).
MIN_OLDER = 3


def stale_prefix(samples: Sequence[float], *, min_newer: int, floor: float = 0.0,
                 z: float = SHIFT_SIGMAS) -> int:
    """How many of the oldest samples belong to a slower level that has since dropped.

    Over the logs of ``samples`` (oldest first), every split into an older
    part of at least ``MIN_OLDER`` and a newer part of at least
    ``min_newer`` samples is scored by the difference of their medians over
    its standard error (``1.2533 * s * sqrt(1/n_old + 1/n_new)``, ``s`` the
    spread of both parts pooled, ``pooled_spread``, at least ``floor``).
    Returns the size of the older part of the best split if the older part
    is slower by more than ``z`` standard errors, else 0. That is a machine
    that was loaded and is no longer (a job's processes starting together,
    each compiling: saves 1.5-2 times slower for the first minute): the
    older saves are not the population the next one is drawn from, and held
    the spread and the bound up for a whole window. Medians, so one stall
    is not a level; only a drop, so a machine that became slower keeps its
    older, faster saves (the bound then follows the slowest, as before).
    """
    logs = [math.log(x) for x in samples if x > 0]
    n, best, cut = len(logs), z, 0
    for j in range(MIN_OLDER, n - min_newer + 1):
        older, newer = logs[:j], logs[j:]
        s, _ = pooled_spread([older, newer], floor=floor)
        se = 1.2533 * max(s, floor) * math.sqrt(1 / j + 1 / (n - j))
        if se <= 0:
            continue
        score = (statistics.median(older) - statistics.median(newer)) / se
        if score > best:
            best, cut = score, j
    return cut

"""The deadline benchmark, recording the terms of each trial's margin at its final round.

Usage: python benchmarks/archive/bench_preemption_terms.py [python -m benchmarks --preemption
options]

Runs the deadline benchmark (``benchmarks/suite/preemption.py``; ``bench_preemption_deadline.py``
when these runs were made) unchanged (same options, same output),
with an observer on ``GraceClock.margin_parts`` and on the final save's
``log_bound``: each trial's record (``--json``) gains ``margin_terms``, the
terms of the last margin computed before the final save started: ``margin``,
``queued`` (Q), ``S_hi``, ``slack``, ``T_hi`` (the final save's bound, stall
allowance included) and ``T_stat`` (its statistical part), the finals and the saves made
while training it was computed from (``finals``, ``during``, after the cuts
of ``stale_prefix``), their pooled ``spread`` of logs, its degrees of
freedom ``df``, ``t``, the ``reach`` in logs, the finals' ``final_center``
and the ``cap``. The observer calls the originals and only keeps their
arguments and results (a few list copies per step boundary), so the trials
run as in the benchmark itself. ``docs/preemption.md`` decomposes the
margins of the v5 grids with it.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests


def main() -> None:
    from asyncckpt.preemption import _stats, grace
    from benchmarks.suite import preemption as bench

    last: dict = {}
    log_bound, margin_parts = _stats.log_bound, grace.GraceClock.margin_parts

    def observed_log_bound(samples, *, k, min_spread=0.0, spread_from=(), cap=None):
        out = log_bound(samples, k=k, min_spread=min_spread, spread_from=spread_from, cap=cap)
        last["lb"] = (list(samples), list(spread_from), cap, out, k, min_spread)
        return out

    def observed_margin_parts(self, *, full=False):
        out = margin_parts(self, full=full)
        if out is not None and not full:
            last["mp"] = (out[0], out[1], self.step_seconds(), self.slack_s)
        return out

    def terms() -> dict:
        d: dict = {}
        if "mp" in last:
            d.update(zip(("margin", "queued", "S_hi", "slack"), last["mp"], strict=True))
        if "lb" in last:
            finals, during, cap, out, k, floor = last["lb"]
            lf = [math.log(x) for x in finals if x > 0]
            ld = [math.log(x) for x in during if x > 0]
            s, df = _stats.pooled_spread([lf, ld], floor=floor)
            t = _stats.t_quantile(k, max(_stats.MIN_DF, df)) if df else k
            d.update(T_stat=out, finals=[round(x, 4) for x in finals],
                     during=[round(x, 4) for x in during], cap=cap, spread=s, df=df, t=t,
                     reach=max(t * s, k * floor) * math.sqrt(1 + 1 / len(lf)),
                     final_center=math.exp(statistics.fmean(lf)))
        if "margin" in d:  # one worker: margin = T_hi + Q + S_hi + slack
            d["T_hi"] = d["margin"] - d["queued"] - d["S_hi"] - d["slack"]
        return d

    run_trial = bench.run_trial

    def observed_run_trial(framework, grace_s, step_s, write_s, directory, rng, *,
                           periodic=True):
        last.clear()
        r = run_trial(framework, grace_s, step_s, write_s, directory, rng, periodic=periodic)
        if grace_s > 0:
            r["margin_terms"] = terms()
        return r

    grace.log_bound = observed_log_bound  # patched where GraceClock calls it
    grace.GraceClock.margin_parts = observed_margin_parts
    bench.run_trial = observed_run_trial
    bench.main()


if __name__ == "__main__":
    main()

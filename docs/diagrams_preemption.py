"""Draws docs/img/preemption.png. Run: python docs/diagrams_preemption.py"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from diagrams import HERE, finish

STEP, COPY, WRITE = 1.0, 0.15, 2.4
TRAIN, PARK, SAVE, BG, KV = "#9ecae1", "#fdd0a2", "#e6550d", "#31a354", "#756bb1"


def timeline() -> None:
    """Two workers: notice, round 0 (save at once), grace period, final round, exit."""
    fig, ax = plt.subplots(figsize=(14, 4.6))
    lanes = {"worker 0: training": 5, "worker 0: writer": 4, "worker 1: training": 2.5,
             "worker 1: writer": 1.5, "key-value store": 0.2}
    notice, grace = 2.35, 21.0  # at least 4 margins: round 0 saves at once too
    deadline = notice + grace
    # The rule with nothing queued: the bound of recent saves' copy + write
    # (here 15% above this one), two steps (two workers), 0.05 s of slack.
    save_hi = 1.15 * (COPY + WRITE)
    margin = save_hi + 2 * STEP + 0.05
    final_round = deadline - margin
    t0, t1 = 3, None  # round 0 target: the step after the notice
    # Steps: both workers in lockstep (a collective per step).
    for lane in ("worker 0: training", "worker 1: training"):
        y = lanes[lane]
        t, k = 0.0, 0
        while t < deadline + 1:
            if k == t0 or (t1 is not None and k == t1):
                ax.broken_barh([(t, COPY)], (y - 0.3, 0.6), color=SAVE)
                w = lanes[lane.replace("training", "writer")]
                ax.broken_barh([(t + COPY, WRITE)], (w - 0.25, 0.5), color=BG)
                ax.text(t + COPY + WRITE / 2, w, "write + commit", ha="center", va="center",
                        fontsize=7, color="white")
                if t1 is not None and k == t1:
                    end = t + COPY + WRITE
                    ax.broken_barh([(end, 0.25)], (y - 0.3, 0.6), color=KV)
                    ax.text(end + 0.3, y, "durable on all\n(barrier) -> exit_fn",
                            va="center", fontsize=7)
                    break
                t += COPY
            ax.broken_barh([(t, STEP)], (y - 0.3, 0.6), color=TRAIN, edgecolor="white")
            ax.text(t + STEP / 2, y, str(k + 1), ha="center", va="center", fontsize=7)
            t += STEP
            k += 1
            if t1 is None and t >= final_round:
                t1 = k + 1  # the final round opens at this boundary; target = next step
    # Key-value traffic.
    y = lanes["key-value store"]
    for x, label, ha in [(notice + 0.05, "notice (claim) ", "right"),
                         (notice + 0.25, " round 0: go, at/0, at/1", "left"),
                         (final_round + 0.05, " round 1: go, at/0, at/1", "left")]:
        ax.broken_barh([(x, 0.15)], (y - 0.2, 0.4), color=KV)
        ax.text(x + (0.15 if ha == "left" else 0), y, label, ha=ha, va="center", fontsize=7)
    for x, label, style in [(notice, "SIGTERM / maintenance notice\non worker 1", "-"),
                            (final_round, "now + margin >= deadline", "--"),
                            (deadline, "deadline = notice + grace", "-")]:
        ax.axvline(x, color="black", linestyle=style, linewidth=0.9)
        ax.text(x, 6.05, label, ha="center", va="bottom", fontsize=8)
    ax.annotate("", xy=(final_round, 5.75), xytext=(deadline, 5.75),
                arrowprops={"arrowstyle": "<->", "linewidth": 0.8})
    ax.text((final_round + deadline) / 2, 5.8,
            "margin = T_hi + Q + 2 S_hi + slack", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(-0.4, 6.9)
    ax.set_xlim(0, deadline + 1.8)
    finish(fig, ax, lanes, "time (numbers: steps; orange: state copy at the agreed step; "
           "green: background write)", "preemption.png")


if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "img"), exist_ok=True)
    timeline()

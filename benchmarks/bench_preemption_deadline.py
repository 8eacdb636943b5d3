"""Preemption deadline: hit rate and grace period used for training, asyncckpt vs TF's formula.

Usage: python benchmarks/bench_preemption_deadline.py [--trials 3] [--grace 2,5]
           [--step 0.01,0.05] [--write 0.25,1.0] [--json results.json]

For every cell of the grid (grace period, step time, write time) and every
trial, a TensorFlow training loop runs under ``PreemptionCheckpointHandler``
with a deliberately slow disk (the real save job, with ``write`` delayed by
the cell's write time), saves periodically, and receives a real SIGTERM at a
random moment. The handler's notice carries the cell's grace period; the run
ends once the final checkpoint is durable. Reported per cell:

* asyncckpt: the deadline hit rate (final checkpoint durable before
  notice + grace) and the share of the grace period spent training (from
  the notice to the start of the final save, minus the blocking time of the
  save made at the notice);
* TensorFlow's formula, computed on the same runs: its final save starts at
  ``notice + grace - 6 * mean step time`` and, being synchronous, is durable
  after the measured blocking + write + commit time of that run's final save;
  its save at the notice is synchronous too, so it costs training time.

Everything runs in one process; trials of all cells are interleaved so the
machine's noise hits every cell alike.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Off GCE for sure: the metadata host refuses connections at once.
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def run_trial(grace: float, step_s: float, write_s: float, work: str, rng: random.Random,
              slow_job: list[float]) -> dict:
    """One training run with a notice; returns what the report needs."""
    import numpy as np
    import tensorflow as tf

    import asyncckpt.tf as at
    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig
    from asyncckpt.preemption.grace import tf_final_save_start

    slow_job[0] = write_s
    v = tf.Variable(np.zeros(1 << 16, np.float32))
    step = tf.Variable(0, dtype=tf.int64)
    directory = tempfile.mkdtemp(dir=work)
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v, step=step), directory, max_to_keep=2)
    config = TerminationConfig(grace_period=grace, exit_fn=lambda: None, platform="other")
    handler = PreemptionCheckpointHandler(mgr, termination_config=config)
    step_times: list[float] = []

    def train():
        t = time.perf_counter()
        v.assign_add(tf.ones(1 << 16))
        step.assign_add(1)
        time.sleep(step_s)
        step_times.append(time.perf_counter() - t)

    # The first periodic save is durable after write_s; the notice comes later.
    notice_after = write_s + rng.uniform(0.5, 1.5)
    timer = threading.Timer(notice_after, os.kill, (os.getpid(), signal.SIGTERM))
    last_periodic = -1e9
    with handler:
        timer.start()
        while not handler.preempted:
            now = time.monotonic()
            if not handler.noticed and now - last_periodic >= max(2 * write_s, 0.5):
                mgr.save(checkpoint_number=handler.total_run_calls)
                last_periodic = now
            handler.run(train)
    timer.join()
    stats = {s.step: s for s in mgr.engine.history}
    mgr.close()
    shutil.rmtree(directory, ignore_errors=True)

    first, final = handler.saves[0], handler.saves[-1]
    notice, deadline = final.notice_time, final.deadline
    final_stats = stats[final.run]
    first_stats = stats.get(first.run)
    # asyncckpt, measured.
    ours_train = (final.started_at - notice) - (
        first_stats.blocking_s if first_stats is not None and not first.final else 0.0)
    # TensorFlow's formula on the same run: same steps, same disk.
    mean_step = statistics.fmean(step_times)  # TF's estimate: the mean run() time
    tf_start = tf_final_save_start(notice, grace, mean_step)
    sync_save = final_stats.blocking_s + final_stats.write_s + final_stats.commit_s
    tf_durable = tf_start + sync_save
    tf_insurance = (first_stats.blocking_s + first_stats.write_s + first_stats.commit_s
                    if first_stats is not None and not first.final else sync_save)
    tf_train = max(0.0, tf_start - notice - tf_insurance)
    return {
        "grace": grace, "step_s": step_s, "write_s": write_s,
        "measured_write_s": final_stats.write_s + final_stats.commit_s,
        "mean_step_s": mean_step,
        "margin_s": final.margin_s,
        "ours_hit": final.durable_at <= deadline,
        "ours_slack_s": deadline - final.durable_at,
        "ours_share": max(0.0, ours_train) / grace,
        "tf_hit": tf_durable <= deadline,
        "tf_slack_s": deadline - tf_durable,
        "tf_share": tf_train / grace,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--grace", default="2,5", help="grace periods, seconds")
    parser.add_argument("--step", default="0.01,0.05", help="step times, seconds")
    parser.add_argument("--write", default="0.25,1.0", help="write times, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write all trials to this file")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    from asyncckpt.tf import checkpoint as checkpoint_module
    from asyncckpt.tf._job import TFSaveJob

    slow_job = [0.0]

    class SlowDiskJob(TFSaveJob):
        """The real TensorFlow save job on a disk that takes ``slow_job[0]`` s more."""

        def write(self) -> None:
            time.sleep(slow_job[0])
            super().write()

    checkpoint_module.TFSaveJob = SlowDiskJob

    cells = list(itertools.product(_floats(args.grace), _floats(args.step), _floats(args.write)))
    rng = random.Random(args.seed)
    work = args.dir or tempfile.mkdtemp(prefix="asyncckpt-bench-preemption-")
    trials: list[dict] = []
    try:
        for t in range(args.trials):
            order = cells[t % len(cells):] + cells[: t % len(cells)]  # rotate the order
            for grace, step_s, write_s in order:
                trials.append(run_trial(grace, step_s, write_s, work, rng, slow_job))
                r = trials[-1]
                print(f"trial {t} grace={grace:g}s step={step_s * 1e3:g}ms write={write_s:g}s: "
                      f"asyncckpt {'hit ' if r['ours_hit'] else 'MISS'} "
                      f"(slack {r['ours_slack_s']:+.2f}s, trained {r['ours_share']:.0%}), "
                      f"TF formula {'hit ' if r['tf_hit'] else 'MISS'} "
                      f"(slack {r['tf_slack_s']:+.2f}s, trained {r['tf_share']:.0%})",
                      flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print("| grace | step | write (steps) | asyncckpt hit | asyncckpt trained | "
          "TF formula hit | TF formula trained |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for grace, step_s, write_s in cells:
        rs = [r for r in trials if (r["grace"], r["step_s"], r["write_s"]) ==
              (grace, step_s, write_s)]
        n = len(rs)
        print(f"| {grace:g} s | {step_s * 1e3:g} ms | {write_s:g} s ({write_s / step_s:.0f}) | "
              f"{sum(r['ours_hit'] for r in rs)}/{n} | "
              f"{statistics.fmean(r['ours_share'] for r in rs):.0%} | "
              f"{sum(r['tf_hit'] for r in rs)}/{n} | "
              f"{statistics.fmean(r['tf_share'] for r in rs):.0%} |")
    total = len(trials)
    print(f"\nall cells: asyncckpt {sum(r['ours_hit'] for r in trials)}/{total} in time, "
          f"TF formula {sum(r['tf_hit'] for r in trials)}/{total}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(trials, f, indent=1)


if __name__ == "__main__":
    main()

"""Preemption deadline: in time, and how much of the usable grace period is spent training.

Usage: python -m benchmarks --preemption [--framework tf|jax]
           [--trials 5] [--grace 2,5,10,30] [--step 0.01,0.05] [--write 0.25,1,3]
           [--noise none,heavy+disk] [--sigma 0.15] [--warmup 8] [--warmup-preemptions 4]
           [--seed 0] [--json results.json]

For every cell of the grid (grace period, step time, write time, noise) and
every trial, a training loop (TensorFlow or JAX) runs under
``PreemptionCheckpointHandler`` with a deliberately slow disk (the real save
job, with ``write`` delayed by the cell's write time), saves periodically,
and receives a real SIGTERM at a random moment. The handler's notice carries
the cell's grace period; the run ends once the final checkpoint is durable.
Cells with ``write >= grace`` are skipped.

Each cell keeps its own checkpoint directory: trial ``k`` restarts from the
checkpoint trial ``k - 1`` left (as a preempted job restarts), so the timing
samples the handler stores carry over. Before its first trial a cell runs
``--warmup`` periodic saves with no notice and then ``--warmup-preemptions``
untimed preemptions without a grace period: a job that has been training for
a while and was preempted a few times before (the handler keeps the times of
its final saves, made while training waits, apart from those of saves made
while training runs).

Noise (``--noise``, one grid dimension; kinds joined by ``+``):

* ``heavy``: each write's delay is multiplied by a log-normal factor
  (``exp(sigma * N(0, 1))``, ``--sigma``): a heavy right tail, the final
  write can be slower than any seen before;
* ``disk``: a competing writer on the same disk (8 MiB written and fsynced,
  then a pause of 100-500 ms, for the whole trial) slows the real I/O and takes
  CPU from the loop and the writer.

Reported per cell (asyncckpt, and TensorFlow's formula on the same runs):

* in time: final checkpoint durable before notice + grace, out of trials;
* trained / usable: training time after the notice (to the start of the
  final save, less the blocking time of a save made at the notice) as a
  share of the *usable* grace period = grace - (the final save's measured
  time from its start to durable, queueing behind a save in flight included)
  - one mean step;
* smallest slack: deadline - durable time of the final checkpoint.

TensorFlow's formula: its final save starts at ``notice + grace - 6 * mean
step`` and, being synchronous, is durable after the measured blocking + write
+ commit time of that run's final save; its save at the notice is synchronous
too, so it costs training time.

Trials of all cells are interleaved so the machine's noise hits every cell
alike. Everything runs in one process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Off GCE for sure: the metadata host refuses connections at once.
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")

STATE_FLOATS = 1 << 16


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


class SlowDisk:
    """The delay every save's write gets in this process: the cell's write time, with noise."""

    def __init__(self, seed: int):
        self.write_s = 0.0
        self.sigma = 0.0
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def delay(self) -> float:
        with self.lock:
            factor = math.exp(self.sigma * self.rng.gauss(0.0, 1.0)) if self.sigma else 1.0
        return self.write_s * factor


class CompetingWriter(threading.Thread):
    """Another job writing to the same disk: 8 MiB and an fsync, then a pause."""

    def __init__(self, directory: str, seed: int):
        super().__init__(name="competing-writer", daemon=True)
        self.path = os.path.join(directory, "competitor.bin")
        self.stop = threading.Event()
        self.rng = random.Random(seed)
        self.buf = os.urandom(8 << 20)

    def run(self) -> None:
        while not self.stop.is_set():
            with open(self.path, "wb") as f:
                f.write(self.buf)
                f.flush()
                os.fsync(f.fileno())
            self.stop.wait(self.rng.uniform(0.1, 0.5))
        os.unlink(self.path)

    def close(self) -> None:
        self.stop.set()
        self.join()


def install_slow_disk(framework: str, disk: SlowDisk) -> None:
    """Replaces the framework's real save job by one that writes ``disk.delay()`` s slower.

    Set as the front end's save job class (``_job_class``), for every
    checkpoint or manager of this process.
    """
    if framework == "tf":
        from asyncckpt.tf import Checkpoint as front_end
        from asyncckpt.tf._job import TFSaveJob as Job
    else:
        from asyncckpt.jax import CheckpointManager as front_end
        from asyncckpt.jax._job import JaxSaveJob as Job

    class SlowDiskJob(Job):
        def write(self) -> None:
            time.sleep(disk.delay())
            super().write()

    front_end._job_class = SlowDiskJob


class TFLoop:
    """A TensorFlow training loop with a ``PreemptionCheckpointHandler``."""

    def __init__(self, directory: str, step_s: float, config):
        import numpy as np
        import tensorflow as tf

        import asyncckpt.tf as at
        from asyncckpt.preemption import PreemptionCheckpointHandler

        self.tf, self.step_s = tf, step_s
        self.v = tf.Variable(np.zeros(STATE_FLOATS, np.float32))
        self.step = tf.Variable(0, dtype=tf.int64)
        self.mgr = at.CheckpointManager(tf.train.Checkpoint(v=self.v, step=self.step),
                                        directory, max_to_keep=2)
        self.handler = PreemptionCheckpointHandler(self.mgr, termination_config=config)

    def train(self) -> None:
        def fn():
            self.v.assign_add(self.tf.ones(STATE_FLOATS))
            self.step.assign_add(1)
            time.sleep(self.step_s)

        self.handler.run(fn)

    def periodic_save(self) -> bool:
        self.mgr.save(checkpoint_number=self.handler.total_run_calls)
        return True

    def close(self) -> None:
        self.handler.close()
        self.mgr.close()


class JaxLoop:
    """A JAX training loop with a ``PreemptionCheckpointHandler`` (state passed explicitly)."""

    def __init__(self, directory: str, step_s: float, config):
        import jax
        import jax.numpy as jnp

        import asyncckpt.jax as aj
        from asyncckpt.preemption import PreemptionCheckpointHandler

        self.step_s = step_s
        self.mgr = aj.CheckpointManager(directory, max_to_keep=2)
        self.handler = PreemptionCheckpointHandler(self.mgr, termination_config=config)
        init = {"v": jnp.zeros(STATE_FLOATS, jnp.float32), "step": jnp.zeros((), jnp.int32)}
        restored = self.handler.restore(init)
        self.state = init if restored is None else restored
        self._step = jax.jit(lambda s: {"v": s["v"] + 1.0, "step": s["step"] + 1})

    def train(self) -> None:
        def fn(state):
            new = self._step(state)
            new["v"].block_until_ready()
            time.sleep(self.step_s)
            return new

        self.state = self.handler.run(fn, self.state)

    def periodic_save(self) -> bool:
        try:
            self.mgr.save(self.handler.total_run_calls, self.state, force=True,
                          custom_metadata=self.handler.checkpoint_metadata())
        except ValueError as e:  # this step is saved already (a restart, or no step since)
            if "already saved" not in str(e):
                raise
            return False
        return True

    def close(self) -> None:
        self.handler.close()
        self.mgr.close()


def _loop(framework: str, directory: str, step_s: float, grace: float):
    from asyncckpt.preemption import TerminationConfig

    config = TerminationConfig(grace_period=grace, exit_fn=lambda: None, platform="other")
    cls = TFLoop if framework == "tf" else JaxLoop
    return cls(directory, step_s, config)


def warm_up(framework: str, directory: str, step_s: float, grace: float, saves: int) -> None:
    """A job that trained for a while: ``saves`` periodic saves, no notice."""
    loop = _loop(framework, directory, step_s, grace)
    engine = loop.handler.grace_clock.engine
    try:
        done = len(engine.history)
        while len(engine.history) < done + saves:
            if engine.pending == 0:
                loop.periodic_save()
            loop.train()
        engine.wait_until_finished()
        loop.periodic_save()  # carries the samples of all the saves above
        engine.wait_until_finished()
    finally:
        loop.close()


def run_trial(framework: str, grace: float, step_s: float, write_s: float, directory: str,
              rng: random.Random, *, periodic: bool = True) -> dict:
    """One training run with a notice; returns what the report needs."""
    from asyncckpt.preemption.grace import tf_final_save_start

    loop = _loop(framework, directory, step_s, grace)
    handler = loop.handler
    engine = handler.grace_clock.engine
    step_times: list[float] = []
    # A periodic save is durable after write_s; the notice comes at a random moment.
    notice_after = write_s + rng.uniform(0.5, 1.5)
    timer = threading.Timer(notice_after, os.kill, (os.getpid(), signal.SIGTERM))
    last_periodic = -1e9
    try:
        timer.start()
        while not handler.preempted:
            now = time.monotonic()
            if (periodic and not handler.noticed and now - last_periodic >= max(2 * write_s, 0.5)
                    and loop.periodic_save()):  # JAX: not the restored step again
                last_periodic = now
            t = time.perf_counter()
            loop.train()
            step_times.append(time.perf_counter() - t)
        timer.join()
        # By name: TensorFlow's preemption saves are numbered by the save counter.
        stats = {os.path.basename(s.label): s for s in engine.history}
    finally:
        loop.close()

    first, final = handler.saves[0], handler.saves[-1]
    notice, deadline = final.notice_time, final.deadline
    # None: the final save found its step saved already (reused, durable before).
    final_stats = stats.get(os.path.basename(final.checkpoint or ""))
    first_stats = stats.get(os.path.basename(first.checkpoint or "")) if not first.final else None
    mean_step = statistics.fmean(step_times)
    final_s = final.durable_at - final.started_at
    usable = grace - final_s - mean_step
    ours_train = 0.0 if final.adopted or final_stats is None else max(
        0.0, (final.started_at - notice)
        - (first_stats.blocking_s if first_stats is not None else 0.0))
    # TensorFlow's formula on the same run: same steps, same disk.
    tf_start = tf_final_save_start(notice, grace, mean_step)
    sync_save = (final_stats.blocking_s + final_stats.write_s + final_stats.commit_s
                 if final_stats is not None else 0.0)
    tf_durable = tf_start + sync_save
    tf_insurance = (first_stats.blocking_s + first_stats.write_s + first_stats.commit_s
                    if first_stats is not None else sync_save)
    tf_train = max(0.0, tf_start - notice - tf_insurance)
    return {
        "framework": framework, "grace": grace, "step_s": step_s, "write_s": write_s,
        "final_save_s": final_s,
        "measured_write_s": (final_stats.write_s + final_stats.commit_s
                             if final_stats is not None else 0.0),
        "reused_saved_step": final_stats is None,
        "mean_step_s": mean_step,
        "usable_s": usable,
        "margin_s": final.margin_s,
        "saved_at_notice": first_stats is not None,
        "adopted_in_flight": final.adopted,
        "ours_hit": final.durable_at <= deadline,
        "ours_slack_s": deadline - final.durable_at,
        "ours_train_s": ours_train,
        "ours_share": ours_train / usable if usable > 0 else float("nan"),
        "tf_hit": tf_durable <= deadline,
        "tf_slack_s": deadline - tf_durable,
        "tf_share": tf_train / usable if usable > 0 else float("nan"),
    }


def _pct(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    return f"{statistics.fmean(values):.0%} (min {min(values):.0%})"


def report(trials: list[dict], cells: list[tuple]) -> None:
    print()
    print("| grace | step | write | noise | in time | usable grace | trained / usable "
          "(mean, min) | smallest slack | TF formula in time | TF formula trained / usable |")
    print("| ---: | ---: | ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: |")
    must_in_time = must_share = True
    for grace, step_s, write_s, noise in cells:
        rs = [r for r in trials if (r["grace"], r["step_s"], r["write_s"], r["noise"]) ==
              (grace, step_s, write_s, noise)]
        if not rs:
            continue
        n = len(rs)
        usable = statistics.fmean(r["usable_s"] for r in rs)
        hits = sum(r["ours_hit"] for r in rs)
        wide = usable >= 4 * write_s
        share_min = min((r["ours_share"] for r in rs if not math.isnan(r["ours_share"])),
                        default=float("nan"))
        must_in_time &= hits == n
        if wide:
            must_share &= share_min >= 0.9
        print(f"| {grace:g} s | {step_s * 1e3:g} ms | {write_s:g} s | {noise} | {hits}/{n} | "
              f"{usable:.2f} s ({usable / write_s:.1f} W){'' if wide else ' *'} | "
              f"{_pct([r['ours_share'] for r in rs])} | "
              f"{min(r['ours_slack_s'] for r in rs):+.2f} s | "
              f"{sum(r['tf_hit'] for r in rs)}/{n} | {_pct([r['tf_share'] for r in rs])} |")
    total = len(trials)
    print("\n* usable grace under 4 write times (no 90% target there)")
    print(f"all cells: asyncckpt {sum(r['ours_hit'] for r in trials)}/{total} in time, "
          f"TF formula {sum(r['tf_hit'] for r in trials)}/{total}; "
          f"every trial in time: {'yes' if must_in_time else 'NO'}; "
          f">= 90% of usable grace in every trial of every cell with >= 4 writes: "
          f"{'yes' if must_share else 'NO'}")


def report_files(paths: list[str]) -> None:
    """The table of the trials in ``paths`` (``--json`` files, complete or not)."""
    trials: list[dict] = []
    for path in paths:
        with open(path) as f:
            trials += json.load(f)
    for framework in sorted({r["framework"] for r in trials}):
        mine = [r for r in trials if r["framework"] == framework]
        cells = sorted({(r["grace"], r["step_s"], r["write_s"], r["noise"]) for r in mine},
                       key=lambda c: (c[0], c[1], c[2], c[3] != "none", c[3]))
        print(f"\n{framework}: {len(mine)} trials from {', '.join(paths)}")
        report(mine, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks --preemption",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("tf", "jax"), default="tf")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--grace", default="2,5,10,30", help="grace periods, seconds")
    parser.add_argument("--step", default="0.01,0.05", help="step times, seconds")
    parser.add_argument("--write", default="0.25,1,3", help="write times, seconds")
    parser.add_argument("--noise", default="none,heavy+disk",
                        help="noise conditions: none, heavy, disk, heavy+disk (comma-separated)")
    parser.add_argument("--sigma", type=float, default=0.15,
                        help="log-normal sigma of the write-time factor with 'heavy' noise")
    parser.add_argument("--warmup", type=int, default=8, help="periodic saves before trial 0")
    parser.add_argument("--warmup-preemptions", type=int, default=4,
                        help="untimed preemptions (no grace period) before trial 0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write all trials to this file")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON",
                        help="only print the table of trials saved with --json (partial runs "
                             "included: the file is rewritten after every trial)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.report:
        report_files(args.report)
        return 0
    noises = [n.strip() for n in args.noise.split(",") if n.strip()]
    for n in noises:
        if not set(n.split("+")) <= {"none", "heavy", "disk"}:
            parser.error(f"unknown noise {n!r}")

    disk = SlowDisk(args.seed + 1)
    install_slow_disk(args.framework, disk)
    cells = [c for c in itertools.product(_floats(args.grace), _floats(args.step),
                                          _floats(args.write), noises) if c[2] < c[0]]
    rng = random.Random(args.seed)
    print(f"seed {args.seed}; {len(cells)} cells x {args.trials} trials ({args.framework})",
          flush=True)
    work = args.dir or tempfile.mkdtemp(prefix="asyncckpt-bench-preemption-")
    trials: list[dict] = []
    warm: set[tuple] = set()
    try:
        for t in range(args.trials):
            order = cells[t % len(cells):] + cells[: t % len(cells)]  # rotate the order
            for cell in order:
                grace, step_s, write_s, noise = cell
                directory = os.path.join(work, "cell-" + "-".join(map(str, cell)))
                os.makedirs(directory, exist_ok=True)
                disk.write_s = write_s
                disk.sigma = args.sigma if "heavy" in noise else 0.0
                competitor = None
                if "disk" in noise:
                    competitor = CompetingWriter(work, rng.randrange(1 << 30))
                    competitor.start()
                try:
                    if cell not in warm:  # a job that trained, and was preempted before
                        warm_up(args.framework, directory, step_s, grace, args.warmup)
                        for _ in range(args.warmup_preemptions):
                            run_trial(args.framework, 0.0, step_s, write_s, directory, rng,
                                      periodic=False)
                        warm.add(cell)
                    r = run_trial(args.framework, grace, step_s, write_s, directory, rng)
                finally:
                    if competitor is not None:
                        competitor.close()
                r["noise"], r["trial"] = noise, t
                trials.append(r)
                print(f"trial {t} grace={grace:g}s step={step_s * 1e3:g}ms write={write_s:g}s "
                      f"noise={noise}: asyncckpt {'hit ' if r['ours_hit'] else 'MISS'} "
                      f"(slack {r['ours_slack_s']:+.2f}s, trained {r['ours_share']:.0%} of "
                      f"usable {r['usable_s']:.2f}s, margin {r['margin_s'] or 0:.2f}s), "
                      f"TF formula {'hit ' if r['tf_hit'] else 'MISS'} "
                      f"(slack {r['tf_slack_s']:+.2f}s, trained {r['tf_share']:.0%})",
                      flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(trials, f, indent=1)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report(trials, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())

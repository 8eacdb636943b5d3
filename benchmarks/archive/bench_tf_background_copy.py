"""TensorFlow saves with the host copy in the background vs on the training thread.

Usage: python benchmarks/archive/bench_tf_background_copy.py [--sizes 16,64] [--reps 15]
       [--train-mib 16,64] [--rounds 5] [--json out.json]

Two measurements, each paired in one process (cases interleaved in rotating
order, so the machine's noise hits them alike):

1. Blocking per save: asyncckpt with ``background_copy`` (the save only reads
   the variables) vs asyncckpt copying on the training thread vs TensorFlow's
   built-in async checkpoint vs a memcpy of the state's bytes.
2. Training cost: one save call plus the step right after it, against a
   step alone; and the training-loop overhead: a step that computes a gradient for every variable
   and applies it with TensorFlow's Adam kernel (``ResourceApplyAdam``:
   in-place updates of every variable and both slots, right after each save:
   the worst case for copy-on-write; Keras 3 optimizers cannot be saved by
   TensorFlow's built-in async checkpoint), saving every K steps; baseline runs
   without saves are interleaved. Copy-on-write costs land in the step, so
   this shows what moving the copy off the save call costs training overall.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

COLS = 64


def _variables(tf, nbytes: int, tensors: int, seed: int) -> dict:
    rows = max(1, nbytes // tensors // 4 // COLS)
    rng = np.random.default_rng(seed)
    return {f"w{i}": tf.Variable(rng.standard_normal((rows, COLS), dtype=np.float32))
            for i in range(tensors)}


class _Cases:
    """The checkpoint engines compared, saving the same objects."""

    def __init__(self, objects: dict, work: str):
        import tensorflow as tf

        import asyncckpt.tf as at
        from asyncckpt import AsyncOptions

        self.work = work
        self.copy = at.Checkpoint(async_options=AsyncOptions(background_copy=False), **objects)
        self.background = at.Checkpoint(async_options=AsyncOptions(background_copy=True),
                                        **objects)
        self.builtin = tf.train.Checkpoint(**objects)
        self.builtin_opts = tf.train.CheckpointOptions(enable_async=True)
        self.n = 0
        self.save = {
            "asyncckpt copy": lambda: self._ours(self.copy, "copy"),
            "asyncckpt background": lambda: self._ours(self.background, "background"),
            "tf built-in async": self._builtin,
        }

    def _path(self, name: str) -> str:
        self.n += 1
        return os.path.join(self.work, name, f"ckpt-{self.n % 3}")

    def _ours(self, ckpt, name: str) -> None:
        ckpt.write(self._path(name))

    def _builtin(self) -> None:
        self.builtin.write(self._path("builtin"), options=self.builtin_opts)

    def settle(self) -> None:
        self.copy.sync()
        self.background.sync()
        self.builtin.sync()

    def close(self) -> None:
        self.settle()
        self.copy.close()
        self.background.close()


def blocking(mib: int, reps: int, work: str) -> dict:
    import tensorflow as tf

    nbytes = mib << 20
    variables = _variables(tf, nbytes, 4, 0)
    total = sum(int(np.prod(v.shape)) * 4 for v in variables.values())
    src = np.random.default_rng(1).random(total // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    cases = _Cases(variables, os.path.join(work, f"block{mib}"))
    fns = {"memcpy": lambda: np.copyto(dst, src), **cases.save}
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps + 2):  # two warm-up repetitions (allocation, tracing)
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            cases.settle()
            t0 = time.perf_counter()
            fns[name]()
            dt = time.perf_counter() - t0
            if rep >= 2:
                times[name].append(dt)
    cases.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"mib": total / 2**20, "median_ms": {k: v * 1e3 for k, v in med.items()},
            "p95_ms": {k: sorted(v)[math.ceil(0.95 * len(v)) - 1] * 1e3
                       for k, v in times.items()}}


def training(mib: int, rounds: int, saves: int, work: str, step_reps: int = 21) -> dict:
    """Training-loop overhead with an optimizer updating every variable each step."""
    import tensorflow as tf

    weights = list(_variables(tf, (mib << 20) // 3, 4, 2).values())  # + two Adam slots
    slots = [(tf.Variable(tf.zeros_like(w)), tf.Variable(tf.zeros_like(w))) for w in weights]
    q, _ = np.linalg.qr(np.random.default_rng(3).standard_normal((COLS, COLS)))
    mix = tf.constant(q.astype(np.float32))

    @tf.function
    def step_fn():
        for w, (m, v) in zip(weights, slots, strict=True):
            grad = tf.matmul(w, mix) - w
            tf.raw_ops.ResourceApplyAdam(  # TensorFlow's Adam kernel: in-place updates
                var=w.handle, m=m.handle, v=v.handle, beta1_power=0.9, beta2_power=0.999,
                lr=1e-4, beta1=0.9, beta2=0.999, epsilon=1e-7, grad=grad)

    objects = {f"w{i}": w for i, w in enumerate(weights)}
    objects.update({f"m{i}": m for i, (m, _) in enumerate(slots)})
    objects.update({f"v{i}": v for i, (_, v) in enumerate(slots)})
    cases = _Cases(objects, os.path.join(work, "train"))
    kv = weights

    def loop(save, steps: int, every: int) -> float:
        cases.settle()
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            step_fn()
            if save is not None and i % every == 0 and i < steps:
                save()
        _ = kv[0].numpy()[0, 0]  # every step has run
        elapsed = time.perf_counter() - t0
        cases.settle()
        return elapsed

    loop(None, 3, 1)
    step_s = loop(None, 10, 1) / 10
    write_s = 0.0
    for save in cases.save.values():
        for _ in range(2):
            t0 = time.perf_counter()
            save()
            cases.settle()
            write_s = max(write_s, time.perf_counter() - t0)
    every = max(2, math.ceil(write_s / step_s) + 1)
    steps = every * (saves + 1)
    # The cost of one save to training, directly: the save call plus the step
    # right after it (which pays any copy-on-write), against the step alone.
    names = list(cases.save)
    step_after: dict[str, list[float]] = {k: [] for k in ["step alone", *names]}
    for rep in range(step_reps + 2):
        k = rep % len(step_after)
        order = list(step_after)
        for name in order[k:] + order[:k]:
            cases.settle()
            step_fn()
            _ = kv[0].numpy()[0, 0]
            t0 = time.perf_counter()
            if name != "step alone":
                cases.save[name]()
            step_fn()
            _ = kv[0].numpy()[0, 0]
            if rep >= 2:
                step_after[name].append(time.perf_counter() - t0)
    alone = statistics.median(step_after["step alone"])
    save_cost_ms = {k: (statistics.median(step_after[k]) - alone) * 1e3 for k in names}
    base: list[float] = []
    runs: dict[str, list[float]] = {k: [] for k in cases.save}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            base.append(loop(None, steps, every))
            runs[name].append(loop(cases.save[name], steps, every))
    base.append(loop(None, steps, every))
    cases.close()
    base_s = statistics.median(base)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "state_mib": 3 * sum(int(np.prod(v.shape)) * 4 for v in kv) / 2**20,
        "step_ms": step_s * 1e3, "every": every, "steps": steps, "rounds": rounds,
        "baseline_s": base_s,
        "step_alone_ms": alone * 1e3,
        "save_plus_next_step_minus_step_ms": save_cost_ms,
        "total_s": med,
        "overhead_pct": {k: 100 * (v - base_s) / base_s for k, v in med.items()},
        # Per round, background over copy: the pairing cancels slow phases of the machine.
        "background_over_copy_per_round": [
            b / c for b, c in zip(runs["asyncckpt background"], runs["asyncckpt copy"],
                                  strict=True)],
        "all_s": {"baseline": base, **runs},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,64")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--train-mib", default="64", help="state sizes of the training loop")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="asyncckpt-bgcopy-")
    out: dict = {"load_before": os.getloadavg(), "blocking": [], "training": []}
    try:
        for mib in (int(s) for s in args.sizes.split(",") if s):
            r = blocking(mib, args.reps, work)
            out["blocking"].append(r)
            m = r["median_ms"]
            print(f"== blocking, {r['mib']:.0f} MiB in 4 tensors, {args.reps} reps ==")
            for k, v in m.items():
                print(f"  {k:<22} {v:7.2f} ms  (p95 {r['p95_ms'][k]:.2f})")
            for ours in ("asyncckpt background", "asyncckpt copy"):
                print(f"  {ours} / memcpy: {m[ours] / m['memcpy']:.2f}x   "
                      f"/ tf built-in async: {m[ours] / m['tf built-in async']:.2f}x")
            print(f"  background / copy: {m['asyncckpt background'] / m['asyncckpt copy']:.2f}x",
                  flush=True)
        for mib in ([] if args.skip_training else
                    [int(s) for s in args.train_mib.split(",") if s]):
            t = training(mib, args.rounds, args.saves, work, args.reps)
            out["training"].append(t)
            print(f"== training loop (ResourceApplyAdam), {t['state_mib']:.0f} MiB state, step "
                  f"{t['step_ms']:.1f} ms, save every {t['every']} steps, {t['steps']} steps, "
                  f"{t['rounds']} rounds ==")
            print(f"  one save's cost to training (save call + the next step - a step alone "
                  f"of {t['step_alone_ms']:.1f} ms, {args.reps} reps):")
            cost = t["save_plus_next_step_minus_step_ms"]
            for k, v in cost.items():
                print(f"    {k:<22} {v:6.2f} ms")
            print(f"  loop: baseline {t['baseline_s']:.3f} s")
            for k, v in t["total_s"].items():
                print(f"  {k:<22} {v:.3f} s  overhead {t['overhead_pct'][k]:+.1f}%")
            tot = t["total_s"]
            per_round = t["background_over_copy_per_round"]
            print(f"  background / copy total: "
                  f"{tot['asyncckpt background'] / tot['asyncckpt copy']:.3f}x (medians); "
                  f"per round {statistics.median(per_round):.3f}x "
                  f"(min {min(per_round):.3f}, max {max(per_round):.3f})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    print(f"load: before {out['load_before']}, after {out['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""TensorFlow training-loop overhead of saving: O_DIRECT against the page cache, and two floors.

A training loop (the ``asyncckpt bench`` one: a matmul and an in-place
update of every variable per step) saves every K steps, K chosen so that K
steps outlast the slowest save. Cases, interleaved in one process with a
baseline run (no saves) before each, rotating order, medians over rounds:

* ``floor: raw write, one file``: the state's bytes written and fsynced on
  a background thread at the writer's priority, always into the same file
  (the ``asyncckpt bench`` floor): its page cache is reused from save to save;
* ``floor: raw write, new file``: the same into a new file per save, as a
  checkpoint is: the page cache it fills is fresh memory each time;
* ``asyncckpt tf (O_DIRECT)``: ``Checkpoint.write`` with the data file's
  aligned ranges written ``O_DIRECT`` (the default from ``datafile.DIRECT_MIN`` on);
* ``asyncckpt tf (page cache)``: the same with every range written through
  the page cache.

Old checkpoints are kept on disk during a run, as ``asyncckpt bench`` does.
Reports each case's overhead over the baseline and its cost per save. Usage::

    python benchmarks/archive/bench_tf_train_overhead.py --sizes 16,64,256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from benchmarks.suite import engines as eng
from benchmarks.suite.runner import train_loop


class _NewFileFloor(eng.BackgroundRawWrite):
    """The raw-write floor, into a new file per save."""

    def __init__(self, state, workdir: str):
        super().__init__(state, workdir)
        self._base = self._floors.path
        self._count = 0

    def save(self) -> None:
        self.wait()
        self._count += 1
        self._floors.path = f"{self._base}.{self._count}"
        super().save()


def measure(mib: int, rounds: int, saves: int, work: str) -> dict:
    from asyncckpt._engine import datafile

    nbytes = mib << 20
    state = eng.TFState(nbytes, eng.tensors_for(nbytes))
    engines = {
        "floor: raw write, one file": eng.BackgroundRawWrite(state, os.path.join(work, "f1")),
        "floor: raw write, new file": _NewFileFloor(state, os.path.join(work, "fn")),
        "asyncckpt tf (O_DIRECT)": eng.AsyncckptTF(state, os.path.join(work, "direct")),
        "asyncckpt tf (page cache)": eng.AsyncckptTF(state, os.path.join(work, "cached")),
    }
    direct_min = datafile.DIRECT_MIN

    def configure(name: str) -> None:
        datafile.DIRECT_MIN = 0 if name.endswith("(O_DIRECT)") else direct_min
        datafile._DIRECT_WRITES = not name.endswith("(page cache)")

    try:
        train_loop(state, None, 3, 1)  # warm-up
        step_s = train_loop(state, None, 10, 1) / 10
        slowest = 0.0
        for name, e in engines.items():
            configure(name)
            for _ in range(2):
                t0 = time.perf_counter()
                e.save()
                e.wait()
                slowest = max(slowest, time.perf_counter() - t0)
        every = max(2, math.ceil(slowest / step_s) + 1)
        steps = every * (saves + 1)
        base: list[float] = []
        runs: dict[str, list[float]] = {n: [] for n in engines}
        order = list(engines)
        for r in range(rounds):
            k = r % len(order)
            for name in order[k:] + order[:k]:
                base.append(train_loop(state, None, steps, every))
                configure(name)
                runs[name].append(train_loop(state, engines[name], steps, every))
        base.append(train_loop(state, None, steps, every))
    finally:
        datafile.DIRECT_MIN = direct_min
        datafile._DIRECT_WRITES = True
        for e in engines.values():
            e.close()
    base_s = statistics.median(base)
    out = {"step_s": step_s, "every": every, "steps": steps, "saves": saves,
           "baseline_s": base_s, "cases": {}}
    print(f"{mib} MiB: step {step_s * 1e3:.1f} ms, a save every {every} steps, "
          f"{saves} saves per run, load {os.getloadavg()[0]:.2f}")
    for name, ts in runs.items():
        t = statistics.median(ts)
        per_save = (t - base_s) / saves
        out["cases"][name] = {"total_s": t, "overhead_pct": 100 * (t - base_s) / base_s,
                              "per_save_s": per_save}
        print(f"  {name:28s} overhead {100 * (t - base_s) / base_s:+6.1f}%  "
              f"{per_save * 1e3:7.1f} ms per save")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="16,64,256", help="MiB, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--saves", type=int, default=3, help="saves per training run")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench_tf_train_overhead.", dir=args.dir)
    results = {"load_before": os.getloadavg(), "sizes": {}}
    try:
        for mib in (int(s) for s in args.sizes.split(",")):
            results["sizes"][mib] = measure(mib, args.rounds, args.saves,
                                            os.path.join(work, str(mib)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

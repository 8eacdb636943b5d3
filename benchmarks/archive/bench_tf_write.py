"""TensorFlow durable save throughput: asyncckpt's own bundle writer against SaveV2.

For each state size, interleaved in one process so noise hits every case
alike, repetition after repetition (order rotated):

* ``raw write+fsync``: the bytes of the state written from one buffer and
  fsynced (the physical floor);
* ``asyncckpt tf``: ``Checkpoint.write`` + ``sync`` (call to durable) with
  the bundle written by ``asyncckpt.tf._bundlewrite``;
* ``asyncckpt tf (page cache)``: the same with every range written through
  the page cache (no ``O_DIRECT``), its writeback started early;
* ``asyncckpt tf (O_DIRECT)``: the same with every aligned range written
  ``O_DIRECT``, whatever the file's size;
* ``asyncckpt tf (no early writeback)``: through the page cache, without
  ``sync_file_range`` (the kernel starts writeback on its own, or the fsync
  does);
* ``asyncckpt tf (SaveV2)``: the same with the bundle written by
  TensorFlow's ``SaveV2`` (the path before issue 13.2; still the fallback).

Reports the medians and each engine's durable throughput / raw write+fsync
(the floor's time over the engine's). Usage::

    python benchmarks/archive/bench_tf_write.py --sizes 256,1024 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from benchmarks.suite import engines as eng


def measure(mib: int, reps: int, work: str, gap: float = 0.0) -> dict:
    """One size: every case ``reps`` times (after two warm-up rounds), interleaved.

    With ``gap`` > 0 each case starts after ``os.sync()`` and ``gap`` seconds
    of idle disk; without it a case may inherit the previous case's
    writeback, or find a virtual disk's write burst spent by it.
    """
    from asyncckpt._engine import datafile
    from asyncckpt.tf import _bundlewrite

    own_writer = _bundlewrite.write_bundle
    nbytes = mib << 20
    tensors = eng.tensors_for(nbytes)
    state = eng.TFState(nbytes, tensors)
    floors = eng.Floors(nbytes, tensors, os.path.join(work, "floors"))
    engines = {
        "asyncckpt tf": eng.AsyncckptTF(state, os.path.join(work, "own")),
        "asyncckpt tf (page cache)": eng.AsyncckptTF(state, os.path.join(work, "cached")),
        "asyncckpt tf (O_DIRECT)": eng.AsyncckptTF(state, os.path.join(work, "direct")),
        "asyncckpt tf (no early writeback)": eng.AsyncckptTF(state, os.path.join(work, "nowb")),
        "asyncckpt tf (SaveV2)": eng.AsyncckptTF(state, os.path.join(work, "savev2")),
    }
    own_writeback = datafile._sync_file_range
    direct_min = datafile.DIRECT_MIN
    parts: dict[str, list[tuple]] = {n: [] for n in engines}

    def run(name: str) -> float:
        e = engines[name]
        if name.endswith("(SaveV2)"):
            _bundlewrite.write_bundle = lambda prefix, state, **kw: None  # the SaveV2 fallback
        if name.endswith("(no early writeback)"):
            datafile._sync_file_range = lambda: None
            datafile._DIRECT_WRITES = False
        if name.endswith("(page cache)"):
            datafile._DIRECT_WRITES = False
        if name.endswith("(O_DIRECT)"):
            datafile.DIRECT_MIN = 0
        try:
            t0 = time.perf_counter()
            e.save()
            e.wait()
            dt = time.perf_counter() - t0
            st = e.ckpt.engine.last_stats
            parts[name].append((st.blocking_s, st.write_s, st.commit_s))
            return dt
        finally:
            _bundlewrite.write_bundle = own_writer
            datafile._sync_file_range = own_writeback
            datafile._DIRECT_WRITES = True
            datafile.DIRECT_MIN = direct_min
            eng.clear_dir(e.workdir)  # untimed: old checkpoints off the disk

    def raw() -> float:
        t0 = time.perf_counter()
        floors.raw_write()
        return time.perf_counter() - t0

    cases = {"raw write+fsync": raw, **{n: (lambda n=n: run(n)) for n in engines}}
    times: dict[str, list[float]] = {n: [] for n in cases}
    order = list(cases)
    for rep in range(reps + 2):  # repetitions 0-1 warm up (both staging slots)
        k = rep % len(order)
        for name in order[k:] + order[:k]:
            if gap > 0:
                os.sync()
                time.sleep(gap)
            dt = cases[name]()
            if rep > 1:
                times[name].append(dt)
    for e in engines.values():
        e.close()
    med = {n: statistics.median(t) for n, t in times.items()}
    floor = med["raw write+fsync"]
    out = {"times_s": times, "median_s": med, "durable_throughput_vs_raw_write": {},
           "blocking_write_commit_s": {}}
    print(f"{mib} MiB: " + ", ".join(f"{n} {med[n] * 1e3:.0f} ms" for n in cases))
    for n in engines:
        b, w, c = (statistics.median(x[i] for x in parts[n][2:]) for i in range(3))
        out["durable_throughput_vs_raw_write"][n] = floor / med[n]
        out["blocking_write_commit_s"][n] = parts[n][2:]
        print(f"  {n}: durable throughput / raw write+fsync = {floor / med[n]:.2f}x "
              f"(median blocking {b * 1e3:.0f} ms, write {w * 1e3:.0f} ms, "
              f"commit {c * 1e3:.0f} ms)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="256,1024", help="MiB, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    p.add_argument("--gap", type=float, default=0.0,
                   help="seconds of idle disk (after os.sync) before each case")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="bench_tf_write.", dir=args.dir)
    results = {"load_before": os.getloadavg(), "gap_s": args.gap, "sizes": {}}
    try:
        for mib in (int(s) for s in args.sizes.split(",")):
            results["sizes"][mib] = measure(mib, args.reps, work, args.gap)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""Durable time of one save with and without ``yield_to_saves``, against raw write+fsync.

A yielding writer writes in 1 MiB pieces (64 MiB without it) and checks the
gate between them; this checks that costs no throughput. For each framework
and size, in one process: a fresh checkpointer per setting, one warm-up
save, then ``--reps`` rounds of (save with the gate off, save with it on,
raw write+fsync of the same bytes), each save timed from the call until it
is durable. Reports the medians and their ratios to the raw write.

    python benchmarks/archive/bench_yield_throughput.py --sizes 256,1024 --reps 3
    python benchmarks/archive/bench_yield_throughput.py --steady 60 --frameworks jax --sizes 16,64

``--steady N`` instead times N steady saves per setting (each after a
training step and after the previous write finished, so the gate is closed
and opened with nothing to pause): what the gate costs a save by itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from benchmarks.archive.bench_slots import _bench_state, _checkpointer


def _on_and_off(fw: str, state, workdir: str, *, warm_saves: int) -> dict:
    """A checkpointer with ``yield_to_saves`` off and one with it on, each warmed up."""
    from asyncckpt import AsyncOptions

    ckpts = {}
    for on in (False, True):
        d = os.path.join(workdir, f"yield-{on}")
        os.makedirs(d)
        ckpts[on] = _checkpointer(fw, state, d, AsyncOptions(yield_to_saves=on))
        for i in range(warm_saves):
            ckpts[on][0](i)
            ckpts[on][1]()
    return ckpts


def run(fw: str, mib: int, reps: int) -> None:
    from benchmarks.suite import engines as eng

    nbytes, tensors, state = _bench_state(fw, mib)
    times: dict[bool, list[float]] = {False: [], True: []}
    raw: list[float] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("ASYNCCKPT_BENCH_DIR")) as workdir:
        floors = eng.Floors(nbytes, 1, os.path.join(workdir, "floors"))
        ckpts = _on_and_off(fw, state, workdir, warm_saves=1)  # warm-up: allocation, tracing
        for i in range(1, reps + 1):
            for on in (False, True):
                save, sync = ckpts[on][0], ckpts[on][1]
                t0 = time.perf_counter()
                save(i)
                sync()
                times[on].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            floors.raw_write()
            raw.append(time.perf_counter() - t0)
        for on in (False, True):
            ckpts[on][3]()
    r = statistics.median(raw)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{fw} {mib} MiB in {tensors} arrays, {reps} reps: raw write+fsync {r * 1e3:.0f} ms; "
          f"durable yield off {off * 1e3:.0f} ms ({r / off:.2f}x raw thr), "
          f"on {on * 1e3:.0f} ms ({r / on:.2f}x raw thr); on/off time {on / off:.2f}", flush=True)


def steady(fw: str, mib: int, n: int) -> None:
    """Steady saves, off and on alternately (order swapped every save), against a memcpy."""
    from benchmarks.suite import engines as eng

    nbytes, tensors, state = _bench_state(fw, mib)
    times: dict[bool, list[float]] = {False: [], True: []}
    memcpy: list[float] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("ASYNCCKPT_BENCH_DIR")) as workdir:
        floors = eng.Floors(nbytes, 1, os.path.join(workdir, "floors"))
        ckpts = _on_and_off(fw, state, workdir, warm_saves=3)
        for i in range(3, n + 3):
            for on in ((False, True) if i % 2 else (True, False)):
                save, sync = ckpts[on][0], ckpts[on][1]
                state.step()
                getattr(state, "block", lambda: None)()
                sync()
                t0 = time.perf_counter()
                save(i)
                times[on].append(time.perf_counter() - t0)
                sync()
                t0 = time.perf_counter()
                floors.memcpy()
                memcpy.append(time.perf_counter() - t0)
        for on in (False, True):
            ckpts[on][3]()
    m = statistics.median(memcpy)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{fw} {mib} MiB in {tensors} arrays, {n} steady saves each: memcpy {m * 1e3:.2f} ms; "
          f"yield off {off / m:.2f}x, on {on / m:.2f}x; min/min off "
          f"{min(times[False]) / min(memcpy):.2f}x, on {min(times[True]) / min(memcpy):.2f}x",
          flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default="jax,tf")
    p.add_argument("--sizes", default="256,1024", help="MiB, comma separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steady", type=int, default=0, metavar="N",
                   help="instead: N steady saves per setting (the gate's own cost)")
    args = p.parse_args()
    for fw in args.frameworks.split(","):
        for mib in (int(x) for x in args.sizes.split(",")):
            if args.steady:
                steady(fw, mib, args.steady)
            else:
                run(fw, mib, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

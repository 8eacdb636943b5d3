"""Durable throughput of the JAX manager's two layouts, OCDBT and zarr files, per state.

Usage: python benchmarks/archive/bench_jax_layouts.py [--states 4x4M,4x16M,500x64K] [--reps 21]
       [--dir DIR]

The measured rule behind the default layout (issue 37): for each state
(``asyncckpt bench --states`` syntax: arrays x size of one, sharded over 8
CPU devices), in one process, each repetition runs a raw write + fsync of
the state's bytes and then a save to durable (``save`` then
``wait_until_finished``, retention included) of each layout, in alternating
order. Prints each layout's median ratio raw / durable (above 1: faster than
the raw write) and its quartiles.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", default="4x4M,4x16M,500x64K")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    import asyncckpt.jax as aj
    from benchmarks.suite import cli
    from benchmarks.suite import engines as eng

    class Layout(eng.AsyncckptJAX):
        def __init__(self, state, workdir: str, ocdbt: bool):
            eng.Engine.__init__(self, state, workdir)
            self.manager = aj.CheckpointManager(
                workdir, max_to_keep=eng.KEEP, format_options=aj.FormatOptions(use_ocdbt=ocdbt))

    root = tempfile.mkdtemp(prefix="bench_jax_layouts.", dir=args.dir)
    try:
        for nbytes, count in cli.parse_states(args.states):
            state = eng.JAXState(nbytes, count)
            floors = eng.Floors(state.nbytes, 1, os.path.join(root, "floor"))
            engines = {"ocdbt": Layout(state, os.path.join(root, f"{nbytes}-ocdbt"), True),
                       "zarr files": Layout(state, os.path.join(root, f"{nbytes}-zarr"), False)}
            ratios: dict[str, list[float]] = {m: [] for m in engines}
            raws = []
            for rep in range(args.reps + 2):  # two warm-ups
                names = list(engines)
                for name in names[rep % 2:] + names[:rep % 2]:
                    for e in engines.values():
                        e.wait()
                    t0 = time.perf_counter()
                    floors.raw_write()
                    raw = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    engines[name].save()
                    engines[name].wait()
                    if rep >= 2:
                        ratios[name].append(raw / (time.perf_counter() - t0))
                        raws.append(raw)
                    state.step()
                    state.block()
            cells = []
            for name, xs in ratios.items():
                q = sorted(xs)
                cells.append(f"{name} {statistics.median(q):.2f}x "
                             f"(q1 {q[len(q) // 4]:.2f}, q3 {q[3 * len(q) // 4]:.2f})")
            print(f"{nbytes / 2**20:.0f} MiB in {count} arrays: raw write+fsync "
                  f"{statistics.median(raws) * 1e3:.1f} ms; " + ", ".join(cells), flush=True)
            for e in engines.values():
                e.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

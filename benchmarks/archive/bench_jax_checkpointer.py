"""Blocking time of a checkpointer's save: asyncckpt's StandardCheckpointer, its manager, orbax's.

Usage: python benchmarks/archive/bench_jax_checkpointer.py [--mib 64] [--tensors 4] [--reps 15]

One pytree of ``jax.Array``s (``asyncckpt bench``'s JAX state, sharded over
every device), three savers made once and reused, and in every repetition
each case once, in rotating order, after the previous save's write has
finished and its files are removed (untimed):

- ``asyncckpt StandardCheckpointer``: ``save(path, state)`` to a new path;
- ``asyncckpt CheckpointManager``: ``save(step, state)``;
- ``orbax StandardCheckpointer``: orbax's own ``save(path, state)``.

Reported: median and min of each case, the ratio of medians, and the median
of the per-repetition (paired) ratios.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()

    import jax
    import orbax.checkpoint as ocp

    import asyncckpt.jax as aj
    from benchmarks.suite import engines as eng

    state = eng.JAXState(args.mib << 20, args.tensors)
    work = tempfile.mkdtemp(prefix="jaxckptr-")
    ours = aj.StandardCheckpointer()
    mgr = aj.CheckpointManager(os.path.join(work, "mgr"), max_to_keep=1)
    theirs = ocp.StandardCheckpointer()
    counter = [0]

    def fresh(prefix: str) -> str:
        counter[0] += 1
        return os.path.join(work, f"{prefix}-{counter[0]}")

    cases = {
        "asyncckpt StandardCheckpointer": lambda: ours.save(fresh("ours"), state.tree),
        "asyncckpt CheckpointManager": lambda: mgr.save(counter[0], state.tree, force=True),
        "orbax StandardCheckpointer": lambda: theirs.save(fresh("orbax"), state.tree),
    }

    def settle() -> None:  # untimed: every write done, the checkpointers' files gone
        ours.wait_until_finished()
        mgr.wait_until_finished()
        theirs.wait_until_finished()
        for name in os.listdir(work):
            if name != "mgr":
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)

    print(f"jax {jax.__version__}, orbax {ocp.__version__ if hasattr(ocp, '__version__') else '?'}"
          f", {len(jax.devices())} devices, load {os.getloadavg()}")
    names = list(cases)
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(args.reps + 2):  # two warm-up repetitions
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            settle()
            counter[0] += 1
            t0 = time.perf_counter()
            cases[name]()
            dt = time.perf_counter() - t0
            if rep >= 2:
                times[name].append(dt)
    settle()
    ours.close()
    mgr.close()
    theirs.close()
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{state.nbytes / 2**20:.1f} MiB in {args.tensors} tensors, {args.reps} reps, "
          f"load {os.getloadavg()[0]:.2f}")
    for k in names:
        print(f"  {k:32s} {med[k] * 1e3:8.3f} ms  (min {min(times[k]) * 1e3:.3f})")
    base = names[0]
    for other in names[1:]:
        paired = [a / b for a, b in zip(times[base], times[other], strict=True)]
        print(f"  ratio StandardCheckpointer / {other:30s} {med[base] / med[other]:.3f}x "
              f"(median of paired ratios {statistics.median(paired):.3f}x)")


if __name__ == "__main__":
    main()

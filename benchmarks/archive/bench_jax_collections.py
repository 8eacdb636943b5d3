"""Full garbage collections set off by JAX saves of many small shards, and what they cost.

Usage, from a checkout's root (``PYTHONPATH`` picks the code):

    PYTHONPATH=<checkout> python benchmarks/archive/bench_jax_collections.py [SAVES]

Saves the suite's 500 x 64 KiB state (float32, sharded over 8 CPU devices:
4,000 shards) with the JAX manager (``benchmarks.suite.engines``, as
``python -m benchmarks`` does), one save at a time: each after the last is
durable, its old steps pruned and the disk synced. Prints the median and p95
of blocking and durable time and the number of full (oldest generation)
collections over the saves, with the time those took inside ``save()``.
Written for issue 37 (2026-12-08): views of every shard taken before the
staging copy kept thousands of collector-tracked objects alive through it
(``benchmarks/results/cpu-jax-collections-ab-*.txt``).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.suite import engines as eng

WARM_UP = 2


def main(saves: int) -> None:
    state = eng.JAXState(500 * 64 * 1024, 500)
    engine = eng.AsyncckptJAX(state, tempfile.mkdtemp())
    started: dict[int, float] = {}
    full: list[tuple[float, float]] = []

    def on_collection(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            full.append((started[0], time.perf_counter()))

    gc.callbacks.append(on_collection)
    blocking, durable, in_blocking = [], [], []
    try:
        for i in range(saves + WARM_UP):
            engine.wait()
            engine.prune()
            os.sync()
            t0 = time.perf_counter()
            engine.save()
            t1 = time.perf_counter()
            engine.wait()
            t2 = time.perf_counter()
            if i >= WARM_UP:
                blocking.append(t1 - t0)
                durable.append(t2 - t0)
                in_blocking += [b - a for a, b in full if a >= t0 and b <= t1]
    finally:
        gc.callbacks.remove(on_collection)
        engine.close()

    def ms(values: list[float], q: float) -> str:
        return f"{sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e3:.1f}"

    print(f"{saves} saves of 500 x 64 KiB over 8 devices (4,000 shards)")
    for name, values in (("blocking", blocking), ("durable", durable)):
        print(f"{name} median {statistics.median(values) * 1e3:.1f} ms, p95 {ms(values, 0.95)} ms")
    print(f"full collections: {len(full)} in the whole run, {len(in_blocking)} inside save() "
          f"({sum(in_blocking) * 1e3:.0f} ms in all)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)

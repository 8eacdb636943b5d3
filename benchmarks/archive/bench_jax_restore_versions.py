"""Cold JAX restores of one checkpoint: which version's code reads which version's files.

Usage, from a checkout's root, once per version (``PYTHONPATH`` picks the code):

    PYTHONPATH=<checkout> python benchmarks/archive/bench_jax_restore_versions.py save DIR
    PYTHONPATH=<checkout> python benchmarks/archive/bench_jax_restore_versions.py run DIR 15

``save``: a 64 MiB state in 4 float32 arrays, sharded over 8 CPU devices,
saved by the JAX manager as step 1 of ``DIR``. ``run``: that many cold
restores onto a sharded target (every file evicted from the page cache
before each), printing the median and the minimum. Written for issue 36's
restore check (2026-12-07, the code of 0ce3841 and of main crossed over each
other's files: ``benchmarks/results/cpu-jax-restore-versions-2026-12-07.txt``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np

import asyncckpt.jax as aj


def evict(directory: str) -> None:
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def main(argv: list[str]) -> None:
    mode, directory = argv[0], argv[1]
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    state = {f"a{i}": jax.device_put(
        np.random.default_rng(i).standard_normal(4 << 20, dtype=np.float32), sharding)
        for i in range(4)}
    if mode == "save":
        with aj.CheckpointManager(directory) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()
        return
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    times = []
    with aj.CheckpointManager(directory) as mgr:
        for _ in range(int(argv[2])):
            evict(directory)
            t0 = time.perf_counter()
            jax.block_until_ready(mgr.restore(1, target))
            times.append(time.perf_counter() - t0)
    print(f"{os.path.basename(directory)} median ms {1e3 * statistics.median(times):.1f} "
          f"min {1e3 * min(times):.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""JAX restore by checksum algorithm: CRC32C vs zlib's CRC32 vs none, against a raw read.

Saves one JAX state twice with asyncckpt: once as it now does (CRC32C per
file, where the hardware CRC32C is installed) and once as it did before,
and as it still does where no native CRC32C is found (zlib's CRC32; the
availability check is switched off for that save only). Then restores, all
from files evicted from the page cache, interleaved in one process so load
changes hit every case alike (order rotated per repetition):

* raw read: one ``readinto`` of a file of the same size (the floor);
* crc32c: the CRC32C checkpoint, checksums checked (the default);
* crc32: the zlib checkpoint, checksums checked (old checkpoints);
* unchecked: the CRC32C checkpoint with ``checksums=False``.

Prints medians and each case's median ratio to the raw read.

Usage: python benchmarks/archive/bench_jax_checksums.py [--mib 256] [--reps 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

import asyncckpt.jax as aj
from asyncckpt import RestoreOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from asyncckpt._engine import fastcrc
from asyncckpt._engine.manifest import read_manifest
from benchmarks.suite import engines as eng
from benchmarks.suite.restore import checkpoint_files, evict


def _save(directory: str, tree, *, zlib_crc: bool) -> None:
    real = fastcrc.available
    if zlib_crc:
        fastcrc.available = lambda: False  # saved as where no native CRC32C is installed
    try:
        with aj.CheckpointManager(directory) as mgr:
            mgr.save(1, tree, force=True)
    finally:
        fastcrc.available = real
    algorithms = {f.algorithm for f in read_manifest(
        os.path.join(directory, "1", "asyncckpt.manifest.json")).files}
    print(f"{os.path.basename(directory)}: manifest records {sorted(algorithms)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir in cwd)")
    args = p.parse_args()
    nbytes = args.mib << 20
    with tempfile.TemporaryDirectory(prefix="bench-crc-", dir=args.dir or os.getcwd()) as work:
        state = eng.JAXState(nbytes, eng.tensors_for(nbytes))
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state.tree)
        dirs = {"crc32c": os.path.join(work, "crc32c"), "crc32": os.path.join(work, "crc32")}
        _save(dirs["crc32c"], state.tree, zlib_crc=False)
        _save(dirs["crc32"], state.tree, zlib_crc=True)
        del state
        floors = eng.Floors(nbytes, 1, os.path.join(work, "floors"))
        floors.raw_write()
        del floors.src, floors.parts
        managers = {
            "crc32c": aj.CheckpointManager(dirs["crc32c"]),
            "crc32": aj.CheckpointManager(dirs["crc32"]),
            "unchecked": aj.CheckpointManager(
                dirs["crc32c"], restore_options=RestoreOptions(checksums=False)),
        }
        cases = {"raw read": (os.path.join(work, "floors"), floors.raw_read)}
        for name, mgr in managers.items():
            where = dirs["crc32" if name == "crc32" else "crc32c"]
            cases[name] = (where, lambda m=mgr: jax.block_until_ready(m.restore(1, target=target)))
        names = list(cases)
        times: dict[str, list[float]] = {n: [] for n in names}
        seen: list[float] = []
        for n in names:  # one untimed cold run each (first-use costs)
            evict(checkpoint_files(cases[n][0]), seen)
            cases[n][1]()
        for rep in range(args.reps):
            k = rep % len(names)
            for n in names[k:] + names[:k]:
                evict(checkpoint_files(cases[n][0]), seen)
                t0 = time.perf_counter()
                cases[n][1]()
                times[n].append(time.perf_counter() - t0)
        for mgr in managers.values():
            mgr.close()
    raw = statistics.median(times["raw read"])
    print(f"JAX restore, {args.mib} MiB, cold, {args.reps} reps, max resident after evict "
          f"{max(seen) if seen else 'n/a'}")
    print(f"{'case':<12} {'median ms':>10} {'min':>7} {'max':>7} {'/raw read':>10}")
    for n in names:
        t = times[n]
        print(f"{n:<12} {statistics.median(t) * 1e3:>10.0f} {min(t) * 1e3:>7.0f} "
              f"{max(t) * 1e3:>7.0f} {statistics.median(t) / raw:>9.2f}x")
    ratio = statistics.median(times["crc32c"]) / statistics.median(times["crc32"])
    print(f"crc32c / crc32 (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""Cold reads of many small files (JAX chunk files) by ``engine.reads``, against a raw read.

Writes ``--files`` files splitting ``--mib`` MiB (512 files of 2 MiB at
1 GiB are the ``asyncckpt bench --restore`` JAX state's chunk files), then
reads them from a cold page cache, interleaved in rotating order with one
``readinto`` of a single file of the same size (the floor): each file into
its own fresh huge-page buffer, CRC32C per piece, as the JAX restore does,
with 8, 16 and 32 reads in flight; once without the page-cache probe
(every file opened ``O_DIRECT`` as if known cold: what the probe costs);
once into one region for all files; once without checksums.

Usage: python benchmarks/archive/bench_restore_files.py [--mib 1024] [--files 512] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from asyncckpt._engine import fastcrc, reads
from benchmarks.suite import engines as eng


class _KnownCold(reads.FileRead):
    def open(self, *, direct=None):
        return super().open(direct=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--files", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    nbytes = args.mib << 20
    size = nbytes // args.files
    with tempfile.TemporaryDirectory(prefix="bench-files-", dir=args.dir or os.getcwd()) as work:
        data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        paths = []
        for i in range(args.files):
            path = os.path.join(work, f"d{i // 64}", f"c{i}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data[i * size:(i + 1) * size])
                os.fsync(f.fileno())
            paths.append(path)
        del data
        floors = eng.Floors(nbytes, 1, os.path.join(work, "floors"))
        floors.raw_write()
        del floors.src, floors.parts

        def per_file(streams=None, cls=reads.FileRead, checksum=True):
            reads.read_all([cls(p, size, [(0, reads.aligned_empty(size))], checksum=checksum,
                                algorithm=fastcrc.CRC32C) for p in paths], streams=streams)

        def region():
            big = reads.aligned_empty(nbytes + reads.HUGE)
            off = -big.ctypes.data % reads.HUGE
            reads.read_all([reads.FileRead(p, size, [(0, big[off + i * size:off + (i + 1) * size])],
                                           checksum=True, algorithm=fastcrc.CRC32C)
                            for i, p in enumerate(paths)])

        cases = {"raw read (one file)": floors.raw_read,
                 "per file, 16 streams": per_file,
                 "per file, 8 streams": lambda: per_file(8),
                 "per file, 32 streams": lambda: per_file(32),
                 "per file, no probe": lambda: per_file(cls=_KnownCold),
                 "one region": region,
                 "per file, no checksum": lambda: per_file(checksum=False)}
        names = list(cases)
        every = [*paths, floors.path]
        for n in names:  # untimed first round
            eng.evict_from_page_cache(every)
            cases[n]()
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            k = rep % len(names)
            for n in names[k:] + names[:k]:
                eng.evict_from_page_cache(every)
                t0 = time.perf_counter()
                cases[n]()
                times[n].append(time.perf_counter() - t0)
    raw = statistics.median(times[names[0]])
    print(f"{args.mib} MiB in {args.files} files, {args.reps} reps, "
          f"load {os.getloadavg()[0]:.2f}")
    for n in names:
        med = statistics.median(times[n])
        print(f"{n:24} {med * 1e3:6.0f} ms {med / raw:5.2f}x  reps "
              + " ".join(f"{t * 1e3:.0f}" for t in times[n]))


if __name__ == "__main__":
    main()

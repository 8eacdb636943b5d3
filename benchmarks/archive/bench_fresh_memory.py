"""What fresh destination memory costs a restore on this machine, against a raw read.

A restore must hand the framework memory it did not hold before (the
variables keep theirs until every checksum has passed), while the raw-read
floor reads into one buffer it reuses. On a VM that reports freed memory
back to its host (virtio-balloon free page reporting, which reports free
blocks of 2 MiB and more about 2 s after they are freed), memory the guest
allocates again must also be faulted in by the host. This script measures,
in one process, cases interleaved per repetition:

* ``raw read``: one ``readinto`` of a cold ``--mib`` MiB file into a reused buffer;
* ``fault, freed 0 s ago``: touching every page of a fresh anonymous mapping
  of the same size right after an equal one was touched and unmapped (the
  guest hands the same, still backed, memory back);
* ``fault, freed 3 s ago``: the same after 3 s (by then the freed memory
  was reported to the host);

each for huge pages (``MADV_HUGEPAGE``, as restores use) and 4 KiB pages.

Usage: python benchmarks/archive/bench_fresh_memory.py [--mib 1024] [--reps 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from benchmarks.suite import engines as eng


def _touch(nbytes: int, huge: bool) -> float:
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        memory.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(memory, np.uint8)
    t0 = time.perf_counter()
    array[::mmap.PAGESIZE] = 1
    spent = time.perf_counter() - t0
    del array
    memory.close()
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    nbytes = args.mib << 20
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fresh-", dir=args.dir or os.getcwd()) as work:
        floors = eng.Floors(nbytes, 1, work)
        floors.raw_write()
        floors.keep_read_buffer_only()
        for _ in range(args.reps):
            eng.evict_from_page_cache([floors.path])
            t0 = time.perf_counter()
            floors.raw_read()
            times.setdefault("raw read", []).append(time.perf_counter() - t0)
            for huge in (True, False):
                pages = "huge pages" if huge else "4 KiB pages"
                for delay in (0, 3):
                    _touch(nbytes, huge)  # memory to free
                    time.sleep(delay)
                    times.setdefault(f"fault, freed {delay} s ago, {pages}", []).append(
                        _touch(nbytes, huge))
    raw = statistics.median(times["raw read"])
    print(f"{args.mib} MiB, {args.reps} reps, load {os.getloadavg()[0]:.2f}")
    for name, xs in times.items():
        print(f"{name:38} {statistics.median(xs) * 1e3:6.0f} ms {statistics.median(xs) / raw:5.2f}x"
              "  reps " + " ".join(f"{x * 1e3:.0f}" for x in xs))


if __name__ == "__main__":
    main()

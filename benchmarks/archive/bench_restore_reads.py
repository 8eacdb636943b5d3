"""Where a cold restore's time goes: read schedules and destination memory, paired.

One file of ``--mib`` MiB (the state's bytes) is read from a cold page cache
in several ways, interleaved in rotating order in one process, so load
changes hit every case alike:

* ``raw``: one ``readinto`` of the whole file into one reused buffer (the
  floor ``asyncckpt bench --restore`` divides by);
* ``raw fresh``: the same into ``np.empty`` memory allocated for it;
* ``fault only``: no read: fresh huge-page memory of the same size touched
  (what faulting destination memory in costs on its own);
* ``ours reused``: ``engine.reads.read_all`` (``O_DIRECT``, CRC32C per
  piece) into destinations allocated once and reused (the read schedule
  alone, without fresh memory);
* ``ours fresh``: the same into fresh destinations per call, as a restore
  does today (``reads.aligned_empty``);
* ``ours fresh nocrc``: the same without checksums.

Destinations are ``--tensors`` equal parts of the file, as the TensorFlow
restore's tensors (``--tensors`` 512 and ``--mib`` 1024: 2 MiB files'
worth, as the JAX chunk files). Prints medians and per-repetition ratios
to ``raw``.

Usage: python benchmarks/archive/bench_restore_reads.py [--mib 1024] [--tensors 64] [--reps 5]
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


def _fault(nbytes: int) -> None:
    buf = reads.aligned_empty(nbytes)
    step = 4096
    buf[::step] = 1  # one write per page


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default="")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    nbytes = args.mib << 20
    part = nbytes // args.tensors
    with tempfile.TemporaryDirectory(prefix="bench-reads-", dir=args.dir or os.getcwd()) as work:
        floors = eng.Floors(nbytes, 1, work)
        floors.raw_write()
        del floors.src, floors.parts
        path = floors.path
        reused = [reads.aligned_empty(part, file_offset=k * part) for k in range(args.tensors)]
        for b in reused:
            b[:] = 0

        def ours(dests, checksum=True):
            fr = reads.FileRead(path, nbytes, [(k * part, d) for k, d in enumerate(dests)],
                                checksum=checksum, algorithm=fastcrc.CRC32C, whole_file=False)
            reads.read_all([fr])

        def fresh():
            return [reads.aligned_empty(part, file_offset=k * part)
                    for k in range(args.tensors)]

        def raw_fresh():
            floors.dst = np.empty_like(floors.dst)
            floors.raw_read()

        cases = {
            "raw": floors.raw_read,
            "raw fresh": raw_fresh,
            "fault only": lambda: _fault(nbytes),
            "ours reused": lambda: ours(reused),
            "ours fresh": lambda: ours(fresh()),
            "ours fresh nocrc": lambda: ours(fresh(), checksum=False),
        }
        extra = getattr(reads, "_bench_cases", None)
        if extra:
            cases.update(extra(path, nbytes, part, args.tensors))
        if args.cases:
            keep = ["raw", *args.cases.split(",")]
            cases = {k: v for k, v in cases.items() if k in keep}
        names = list(cases)
        for n in names:  # untimed first round
            eng.evict_from_page_cache([path])
            cases[n]()
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.reps):
            k = rep % len(names)
            for n in names[k:] + names[:k]:
                eng.evict_from_page_cache([path])
                t0 = time.perf_counter()
                cases[n]()
                times[n].append(time.perf_counter() - t0)
        raw = times["raw"]
        print(f"{args.mib} MiB in {args.tensors} parts, {args.reps} reps, "
              f"load {os.getloadavg()[0]:.2f}")
        for n in names:
            per = [t / r for t, r in zip(times[n], raw, strict=True)]
            print(f"{n:24} {statistics.median(times[n]) * 1e3:7.0f} ms "
                  f"{statistics.median(times[n]) / statistics.median(raw):6.2f}x "
                  f"(per rep {min(per):.2f}-{max(per):.2f}x) "
                  + " ".join(f"{t * 1e3:.0f}" for t in times[n]))


if __name__ == "__main__":
    main()

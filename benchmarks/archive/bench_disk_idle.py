"""A 16 MiB data file and a raw write + fsync, each back to back or after the disk idled.

Usage, from a checkout's root:

    python benchmarks/archive/bench_disk_idle.py [REPS]

Writes 16 MiB (4 staged buffers of 4 MiB) as a file made durable, two ways:
asyncckpt's data-file writer (``datafile.write``: two threads, ``O_DIRECT``)
then an fsync, and a raw ``write`` of the same bytes then an fsync (the
suite's floor). Each way is timed in two conditions, interleaved: right
after the previous write (back to back), and after 0.3 s in which the disk
did nothing. The previous file is deleted and ``sync()`` called before
each, as the suite's ``settle`` does. Written for issue 37 (2026-12-08):
asyncckpt's JAX data file of 16 MiB took 12-13 ms in a bench of its engine
alone and 15-16 ms in the full ``--quick`` bench, for the same bytes.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from asyncckpt._engine import datafile
from asyncckpt._engine._pages import packed_empty

SIZE = 16 << 20
IDLE_S = 0.3


def main(reps: int) -> None:
    directory = tempfile.mkdtemp(dir=os.getcwd())
    bufs = packed_empty([SIZE // 4] * 4)
    for i, b in enumerate(bufs):
        b[:] = i + 1
    parts = [(i, b) for i, b in enumerate(bufs)]

    def ours(path: str) -> None:
        datafile.write(path, parts, [False] * len(parts))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def raw(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for b in bufs:
            os.write(fd, b)
        os.fsync(fd)
        os.close(fd)

    times: dict[str, list[float]] = {}
    try:
        for _ in range(reps):
            for idle in (0.0, IDLE_S):
                for name, fn in (("data file", ours), ("raw write+fsync", raw)):
                    path = os.path.join(directory, name.replace(" ", "_"))
                    if os.path.exists(path):
                        os.unlink(path)
                    os.sync()
                    time.sleep(idle)
                    t0 = time.perf_counter()
                    fn(path)
                    times.setdefault(f"{name}, {'idle' if idle else 'back to back'}",
                                     []).append(time.perf_counter() - t0)
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    for case, values in times.items():
        print(f"{case:34s} median {statistics.median(values) * 1e3:5.1f} ms  "
              f"min {min(values) * 1e3:5.1f} ms")


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 15))

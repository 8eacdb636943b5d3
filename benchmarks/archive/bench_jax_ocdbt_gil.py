"""How long the JAX writers keep the GIL from a training thread: OCDBT vs zarr files.

A Python thread ticks beside each writer (as a training loop's dispatch
would) and counts the time it could not run: gaps over 2 ms between ticks.
Cases, each on the same ``--values`` staged buffers of ``--mib`` MiB in all:

* ``zarr files``: ``DurableWriter.write`` of each buffer, then ``finish``
  (the zarr-file layout: ``os.write`` of the staged buffers);
* ``OCDBT``: ``DatabaseWriter.put`` of each buffer, ``flush``, then the
  files recorded (checksummed) and ``finish`` (the default layout);
* ``KvStore.write(bytes)``: each buffer copied to ``bytes`` and given to
  TensorStore's ``KvStore.write`` in one transaction (the OCDBT writer's way
  before large values went uncopied), for comparison.

On a machine with more cores than threads here, the stall is the GIL alone;
on two cores it includes competition for the CPU. Run:

    python benchmarks/archive/bench_jax_ocdbt_gil.py --mib 1024 --values 64 --reps 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout


class Ticker:
    """A thread that wants the GIL all the time; ``take`` reports what it lost since the last."""

    def __init__(self) -> None:
        self._gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            for _ in range(100):
                pass
            now = time.perf_counter()
            self._gaps.append(now - last)
            last = now

    def take(self) -> tuple[float, float]:
        gaps, self._gaps = self._gaps, []
        return sum(g for g in gaps if g > 0.002), max(gaps, default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--values", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    import tensorstore as ts

    from asyncckpt._engine.files import DurableWriter
    from asyncckpt.jax import _ocdbt

    size = (args.mib << 20) // args.values
    bufs = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8)
            for i in range(args.values)]
    ticker = Ticker()
    print(f"{args.mib} MiB in {args.values} values; ticker stalls: total (largest gap) in ms")

    def report(case: str, seconds: float) -> None:
        lost, largest = ticker.take()
        print(f"{case:34s} {1e3 * seconds:8.0f} ms   "
              f"stalled {1e3 * lost:7.1f} ({1e3 * largest:5.1f})")

    for _ in range(args.reps):
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            files = DurableWriter(root, fsync=True, checksums=True)
            ticker.take()
            t0 = time.perf_counter()
            for i, buf in enumerate(bufs):
                files.write(f"files/{i}", (buf,))
            files.finish()
            report("zarr files: write, finish", time.perf_counter() - t0)
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            files = DurableWriter(root, fsync=True, checksums=True)
            db = _ocdbt.DatabaseWriter(root, "item", 0, files=files,
                                       target=_ocdbt.DEFAULT_TARGET_DATA_FILE_SIZE)
            ticker.take()
            t0 = time.perf_counter()
            for i, buf in enumerate(bufs):
                db.put(f"p/{i}", buf)
            db.flush()
            report("OCDBT: put, flush", time.perf_counter() - t0)
            t0 = time.perf_counter()
            db.finish()
            files.finish()
            report("OCDBT: record (checksums), finish", time.perf_counter() - t0)
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}/"}).result()
            txn = ts.Transaction()
            view = kv.with_transaction(txn)
            ticker.take()
            t0 = time.perf_counter()
            pending = [view.write(f"p/{i}", buf.tobytes()) for i, buf in enumerate(bufs)]
            for future in pending:
                future.result()
            txn.commit_sync()
            report("KvStore.write(bytes), commit", time.perf_counter() - t0)
    ticker.stop()


if __name__ == "__main__":
    main()

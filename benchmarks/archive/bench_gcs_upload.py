"""GCS upload throughput: asyncckpt's store, serial vs parallel composite, vs a raw gcsfs put.

Starts fake-gcs-server on 127.0.0.1 and uploads the same file (a TensorFlow
checkpoint's single data file, random bytes) to it, interleaved, in three ways:

* ``raw``: ``gcsfs.GCSFileSystem.put_file`` itself, its default chunking (one
  resumable upload, chunks one after the other): the client's own put;
* ``serial``: what asyncckpt's ``GCSObjectStore.put_file`` did before
  composite uploads: gcsfs ``put_file`` with ``chunksize=part_size`` (one
  resumable upload, 16 MiB chunks one after the other);
* ``parallel``: ``GCSObjectStore(parallel=N).put_file``, parts uploaded at
  once as temporary objects, composed, deleted.

Every upload is checked by size. Medians of ``--reps`` interleaved rounds (the
order rotating), printed as MiB/s and as ratios within the run.

Usage: python benchmarks/archive/bench_gcs_upload.py [--mib 256] [--reps 5] [--parallel 8]
       [--part-mib 16] [--seed 0] [--server-nice 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from asyncckpt.storage.gcs import GCSObjectStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from tests.servers import FakeGCS

BUCKET = "bench-gcs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-nice", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    print(f"seed {args.seed}", flush=True)
    nbytes = args.mib << 20
    part = args.part_mib << 20
    with tempfile.TemporaryDirectory(prefix="bench-gcs-") as work:
        path = os.path.join(work, "ckpt-1.data-00000-of-00001")
        rng = np.random.default_rng(args.seed)
        with open(path, "wb") as f:
            f.write(rng.integers(0, 255, nbytes, dtype=np.uint8).tobytes())
        with FakeGCS(os.path.join(work, "server"), nice=args.server_nice) as server:
            server.make_bucket(BUCKET)
            os.environ.update(server.env())
            from gcsfs.core import GCSFileSystem

            fs = GCSFileSystem(token="anon", skip_instance_cache=True, use_listings_cache=False)
            parallel = GCSObjectStore(BUCKET, "parallel", part_size=part,
                                      parallel=args.parallel)

            def run_raw() -> None:
                key = f"{BUCKET}/raw/{uuid.uuid4().hex}"
                fs.put_file(path, key)
                assert fs.info(key)["size"] == nbytes

            def run_store(store: GCSObjectStore):
                def run() -> None:
                    key = uuid.uuid4().hex
                    store.put_file(key, path)
                    assert store.list(key)[0].size == nbytes
                return run

            def run_serial() -> None:  # the store's put_file before this change, verbatim
                key = f"{BUCKET}/serial/{uuid.uuid4().hex}"
                fs.put_file(path, key, chunksize=part)
                assert fs.info(key)["size"] == nbytes

            cases = {"raw": run_raw, "serial": run_serial,
                     "parallel": run_store(parallel)}
            for fn in cases.values():  # untimed warm-up: connections, first allocation
                fn()
            times: dict[str, list[float]] = {k: [] for k in cases}
            names = list(cases)
            for rep in range(args.reps):
                order = names[rep % 3:] + names[:rep % 3]
                for name in order:
                    t = time.perf_counter()
                    cases[name]()
                    times[name].append(time.perf_counter() - t)
                print(f"rep {rep}: " + ", ".join(
                    f"{n} {args.mib / times[n][-1]:.0f} MiB/s" for n in names), flush=True)
            parallel.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "mib": args.mib, "reps": args.reps, "parallel": args.parallel,
        "part_mib": args.part_mib, "seed": args.seed,
        "MiBps": {k: args.mib / v for k, v in med.items()},
        "serial_over_raw": med["raw"] / med["serial"],
        "parallel_over_raw": med["raw"] / med["parallel"],
        "parallel_over_serial": med["serial"] / med["parallel"],
        "times_s": times,
    }
    mbps = result["MiBps"]
    print(f"raw gcsfs put {mbps['raw']:.0f} MiB/s, asyncckpt serial {mbps['serial']:.0f} MiB/s, "
          f"parallel {mbps['parallel']:.0f} MiB/s")
    print(f"serial / raw {result['serial_over_raw']:.2f}x, parallel / raw "
          f"{result['parallel_over_raw']:.2f}x, parallel / serial "
          f"{result['parallel_over_serial']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

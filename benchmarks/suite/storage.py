"""``python -m benchmarks --storage s3|gcs``: the remote tier against a local object store.

Starts SeaweedFS (S3) or fake-gcs-server (GCS) on 127.0.0.1 and measures:

* **upload**: committing a checkpoint with the storage protocol (parallel
  data objects, manifest, verification listing, create-only marker) against
  a raw put of the same files with the same client library called directly
  (obstore's ``put`` of the file for S3, gcsfs's ``put_file`` for GCS, each
  with its own defaults), the same file parallelism and the same server.
  Target: >= 0.8x the raw throughput.
* **blocking**: ``save()`` blocking time of the JAX manager with and without
  a remote tier (interleaved runs, each save's upload overlapping the next
  saves, medians). Target: ~1.0x.
* **restore**: restoring the newest step from the remote tier (download,
  CRC32 check, read) against restoring it from the local tier.

Results go to ``<out>/storage.json`` and are printed as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from asyncckpt import catalog
from asyncckpt.storage import RetryPolicy
from asyncckpt.storage import protocol as proto
from asyncckpt.storage.stores import open_store
from asyncckpt.storage.tier import RemoteOptions
from asyncckpt.storage.url import parse_location
from tests.servers import FakeGCS, SeaweedS3

BUCKET = "asyncckpt-bench"
CONCURRENCY = 4


def _make_checkpoint(directory: str, step: int, nbytes: int, nfiles: int
                     ) -> catalog.CheckpointInfo:
    """A JAX checkpoint of ``nfiles`` random arrays, each in one data file (zarr layout)."""
    import asyncckpt.jax as aj

    rng = np.random.default_rng(step)
    per = nbytes // nfiles
    state = {f"a{i}": rng.integers(0, 255, per, dtype=np.uint8) for i in range(nfiles)}
    with aj.CheckpointManager(directory,
                              format_options=aj.FormatOptions(use_ocdbt=False)) as mgr:
        mgr.save(step, state)
    return next(c for c in catalog.list_checkpoints(directory) if c.step == step)


def _state(nbytes: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n = nbytes // 4 // 8
    return {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(8)}


def _raw_client_put(url: str):
    """``put(key, path)`` with the client library itself, not asyncckpt's store."""
    loc = parse_location(url)
    if loc.scheme == "s3":
        import obstore
        from obstore.store import S3Store

        http = os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true")
        store = S3Store(loc.bucket, prefix=loc.prefix,
                        client_options={"allow_http": True} if http else None)
        return lambda key, path: obstore.put(store, key, pathlib.Path(path))
    from gcsfs.core import GCSFileSystem

    fs = GCSFileSystem(token="anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None,
                       skip_instance_cache=True)
    return lambda key, path: fs.put_file(path, f"{loc.bucket}/{loc.prefix}/{key}")


def measure_upload(url: str, workdir: str, nbytes: int, reps: int, progress) -> dict:
    info = _make_checkpoint(workdir, 1, nbytes, nfiles=8)
    files = [(os.path.join(info.root, *r.name.split("/")), r.name)
             for r in catalog.verify(info, checksums=False).files]
    def raw_put(prefix: str) -> float:
        put = _raw_client_put(f"{url}/{prefix}")
        t = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(lambda f: put(f[1], f[0]), files))
        return time.perf_counter() - t

    def protocol_put(prefix: str) -> float:
        store = open_store(f"{url}/{prefix}")
        t = time.perf_counter()
        proto.upload_checkpoint(store, info, retry=RetryPolicy(), concurrency=CONCURRENCY)
        return time.perf_counter() - t

    raw_put("warmup")  # untimed: connections, server-side volume allocation
    raw, ours = [], []
    for rep in range(reps):  # interleaved, the order alternating
        if rep % 2 == 0:
            raw.append(raw_put(f"raw-{rep}"))
            ours.append(protocol_put(f"proto-{rep}"))
        else:
            ours.append(protocol_put(f"proto-{rep}"))
            raw.append(raw_put(f"raw-{rep}"))
        progress(f"  upload rep {rep}: raw {raw[-1]:.2f} s, protocol {ours[-1]:.2f} s")
    mib = nbytes / 2**20
    return {
        "mib": mib,
        "raw_put_MiBps": mib / statistics.median(raw),
        "protocol_MiBps": mib / statistics.median(ours),
        "throughput_ratio": statistics.median(raw) / statistics.median(ours),
    }


def measure_blocking(url: str, workdir: str, nbytes: int, reps: int, saves: int,
                     progress) -> dict:
    import asyncckpt.jax as aj

    states = [_state(nbytes, s) for s in range(2)]
    times: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            local = os.path.join(workdir, f"blk-{mode}-{rep}")
            kwargs = {}
            if mode == "on":
                kwargs = {"remote": f"{url}/blk-{rep}",
                          "remote_options": RemoteOptions(max_to_keep=2)}
            with aj.CheckpointManager(local, max_to_keep=2, **kwargs) as mgr:
                mgr.save(0, states[0])  # untimed: first-use slot allocation
                mgr.engine.wait_until_finished()
                for i in range(1, saves + 1):
                    t = time.perf_counter()
                    mgr.save(i, states[i % 2])
                    times[mode].append(time.perf_counter() - t)
                    mgr.engine.wait_until_finished()  # locally durable; uploads keep running behind
            progress(f"  blocking rep {rep} {mode}: median "
                     f"{statistics.median(times[mode][-saves:]) * 1e3:.1f} ms")
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"blocking_off_ms": off * 1e3, "blocking_on_ms": on * 1e3, "blocking_ratio": on / off}


def measure_restore(url: str, workdir: str, nbytes: int, reps: int, progress) -> dict:
    import asyncckpt.jax as aj

    state = _state(nbytes, 7)
    local = os.path.join(workdir, "rst-local")
    remote = f"{url}/rst"
    with aj.CheckpointManager(local, remote=remote) as mgr:
        mgr.save(1, state)
    target = {k: np.zeros_like(v) for k, v in state.items()}
    t_local, t_remote = [], []
    for rep in range(reps):
        with aj.CheckpointManager(local) as mgr:
            t = time.perf_counter()
            mgr.restore(1, target=target)
            t_local.append(time.perf_counter() - t)
        with aj.CheckpointManager(remote) as mgr:  # fresh scratch: everything is downloaded
            t = time.perf_counter()
            got = mgr.restore(target=target)
            t_remote.append(time.perf_counter() - t)
        assert np.array_equal(got["w0"], state["w0"])
        progress(f"  restore rep {rep}: local {t_local[-1]:.2f} s, remote {t_remote[-1]:.2f} s")
    lo, re_ = statistics.median(t_local), statistics.median(t_remote)
    return {"restore_local_s": lo, "restore_remote_s": re_, "restore_remote_over_local": re_ / lo,
            "restore_remote_MiBps": nbytes / 2**20 / re_}


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m benchmarks --storage KIND``."""
    kind = args.storage
    mib = int((args.sizes or ("64" if args.quick else "256")).split(",")[0])
    reps = args.reps or (3 if args.quick else 5)
    out = args.out or os.path.join("bench-results", time.strftime("%Y%m%d-%H%M%S") + "-storage")
    os.makedirs(out, exist_ok=True)

    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-storage-") as work:
        # Niced: the server stands in for a remote service; on a small machine it would
        # otherwise take the cores the training (and the blocking copy) runs on.
        server = (SeaweedS3 if kind == "s3" else FakeGCS)(os.path.join(work, "server"), nice=19)
        with server:
            server.make_bucket(BUCKET)
            os.environ.update(server.env())
            scheme = "s3" if kind == "s3" else "gs"
            url = f"{scheme}://{BUCKET}/{uuid.uuid4().hex[:8]}"
            nbytes = mib << 20
            progress(f"storage bench: {kind} server at {server.endpoint}, {mib} MiB, {reps} reps")
            results = {"server": kind, "mib": mib, "reps": reps}
            results["upload"] = measure_upload(url, os.path.join(work, "up"), nbytes, reps,
                                               progress)
            results["blocking"] = measure_blocking(url, os.path.join(work, "blk"), nbytes, reps,
                                                   3, progress)
            results["restore"] = measure_restore(url, os.path.join(work, "rst"), nbytes, reps,
                                                 progress)
    path = os.path.join(out, "storage.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    u, b, r = results["upload"], results["blocking"], results["restore"]
    print(f"upload: protocol {u['protocol_MiBps']:.0f} MiB/s vs raw put {u['raw_put_MiBps']:.0f} "
          f"MiB/s -> {u['throughput_ratio']:.2f}x (target >= 0.8x)")
    print(f"blocking: remote tier on {b['blocking_on_ms']:.1f} ms vs off "
          f"{b['blocking_off_ms']:.1f} ms -> {b['blocking_ratio']:.2f}x (target ~1.0x)")
    print(f"restore: remote {r['restore_remote_s']:.2f} s ({r['restore_remote_MiBps']:.0f} MiB/s)"
          f" vs local {r['restore_local_s']:.2f} s -> {r['restore_remote_over_local']:.2f}x")
    print(f"wrote {path}")
    return 0

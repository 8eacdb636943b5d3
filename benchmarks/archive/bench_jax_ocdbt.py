"""Durable time and blocking of a JAX save: OCDBT writer vs the zarr-file writer vs orbax's OCDBT.

Usage: python benchmarks/archive/bench_jax_ocdbt.py [--mib 64,256] [--leaves 100,500] [--reps 5]
       [--devices 8]

Per state size and leaf count (a pytree of float32 arrays sharded over
``--devices`` CPU devices, as ``asyncckpt bench`` builds it), every
repetition runs each case once, in rotating order, with a training step
(donating) before each save:

- ``asyncckpt zarr files``: ``CheckpointManager`` with
  ``FormatOptions(use_ocdbt=False)``: one uncompressed zarr chunk file per shard;
- ``asyncckpt ocdbt``: ``FormatOptions(use_ocdbt=True)``: each process's OCDBT
  database written through TensorStore, merged, committed by rename;
- ``orbax ocdbt``: ``orbax.checkpoint.CheckpointManager`` with its defaults
  (``StandardSave``: OCDBT, zstd-compressed zarr chunks), async.

Timed per save: **blocking** (the ``save`` call) and **durable** (from the
call until the checkpoint is committed: asyncckpt's ``last_save.committed``,
orbax's ``wait_until_finished``). Also reported: the files of one step, and
a **cold restore** of each case's last step onto the same shardings (its
files evicted from the page cache first; ``--restores`` rounds, the cases
interleaved; asyncckpt's checked, orbax's not). Medians over the
repetitions, and the durable-time ratio of the OCDBT writer to the
zarr-file writer (the default-format rule: within 1.1x).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests


def _files(step_dir: str) -> int:
    return sum(len(files) for _, _, files in os.walk(step_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="64,256")
    parser.add_argument("--leaves", default="100,500")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--restores", type=int, default=5, help="cold restore rounds (0: none)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS",
                          f"--xla_force_host_platform_device_count={args.devices}")

    import jax
    import orbax.checkpoint as ocp

    import asyncckpt.jax as aj
    from benchmarks.suite import engines as eng

    print(f"jax {jax.__version__}, orbax {ocp.__version__}, {jax.device_count()} devices, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    root = tempfile.mkdtemp(prefix="ocdbt-bench-", dir=args.dir)
    try:
        for mib in (int(m) for m in args.mib.split(",")):
            for leaves in (int(n) for n in args.leaves.split(",")):
                _run(mib, leaves, args.reps, args.restores, root, jax, ocp, aj, eng)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _evict(directory: str) -> None:
    for dirpath, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _run(mib: int, leaves: int, reps: int, restores: int, root: str, jax, ocp, aj,
         eng) -> None:
    state = eng.JAXState(mib << 20, leaves)
    dirs = {name: os.path.join(root, f"{mib}-{leaves}-{i}")
            for i, name in enumerate(("asyncckpt zarr files", "asyncckpt ocdbt", "orbax ocdbt"))}
    managers = {
        "asyncckpt zarr files": aj.CheckpointManager(
            dirs["asyncckpt zarr files"], max_to_keep=2,
            format_options=aj.FormatOptions(use_ocdbt=False)),
        "asyncckpt ocdbt": aj.CheckpointManager(
            dirs["asyncckpt ocdbt"], max_to_keep=2,
            format_options=aj.FormatOptions(use_ocdbt=True)),
        "orbax ocdbt": ocp.CheckpointManager(
            dirs["orbax ocdbt"], options=ocp.CheckpointManagerOptions(max_to_keep=2)),
    }
    names = list(managers)
    blocking: dict[str, list[float]] = {n: [] for n in names}
    durable: dict[str, list[float]] = {n: [] for n in names}
    files: dict[str, int] = {}
    step = 0
    for rep in range(reps + 1):  # one warm-up repetition (plans, slots, compilation)
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            mgr = managers[name]
            state.step()
            state.block()
            step += 1
            t0 = time.perf_counter()
            if name.startswith("orbax"):
                mgr.save(step, args=ocp.args.StandardSave(state.tree))
                t1 = time.perf_counter()
                mgr.wait_until_finished()
            else:
                mgr.save(step, state.tree)
                t1 = time.perf_counter()
                mgr.last_save.committed.result()
            t2 = time.perf_counter()
            if rep:
                blocking[name].append(t1 - t0)
                durable[name].append(t2 - t0)
            files[name] = _files(os.path.join(dirs[name], str(step)))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          state.tree)
    restore: dict[str, list[float]] = {n: [] for n in names}
    last = {n: max(int(d) for d in os.listdir(dirs[n]) if d.isdigit()) for n in names}
    for rep in range(restores):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            mgr = managers[name]
            _evict(os.path.join(dirs[name], str(last[name])))
            t0 = time.perf_counter()
            if name.startswith("orbax"):
                got = mgr.restore(last[name], args=ocp.args.StandardRestore(target))
            else:
                got = mgr.restore(last[name], target=target)
            jax.block_until_ready(got)
            restore[name].append(time.perf_counter() - t0)
            del got
    for mgr in managers.values():
        mgr.close()
    med_b = {n: statistics.median(v) for n, v in blocking.items()}
    med_d = {n: statistics.median(v) for n, v in durable.items()}
    print(f"\n{mib} MiB in {leaves} leaves ({state.nbytes / 2**20:.1f} MiB, "
          f"{jax.device_count()} devices), {reps} reps, load {os.getloadavg()[0]:.2f}")
    med_r = {n: statistics.median(v) if v else float("nan") for n, v in restore.items()}
    print(f"  {'case':24s} {'blocking ms':>12s} {'durable ms':>12s} {'files/step':>11s} "
          f"{'restore ms':>11s}")
    for n in names:
        print(f"  {n:24s} {med_b[n] * 1e3:12.1f} {med_d[n] * 1e3:12.1f} {files[n]:11d} "
              f"{med_r[n] * 1e3:11.1f}"
              f"   (durable min {min(durable[n]) * 1e3:.1f}, max {max(durable[n]) * 1e3:.1f})")
    if restores:
        paired = [a / b for a, b in zip(restore["asyncckpt ocdbt"],
                                        restore["asyncckpt zarr files"], strict=True)]
        ratio = med_r["asyncckpt ocdbt"] / med_r["asyncckpt zarr files"]
        print(f"  cold restore ocdbt / zarr files: {ratio:.2f}x"
              f" (median of paired ratios {statistics.median(paired):.2f}x)")
    paired = [a / b for a, b in zip(durable["asyncckpt ocdbt"], durable["asyncckpt zarr files"],
                                    strict=True)]
    ratio = med_d["asyncckpt ocdbt"] / med_d["asyncckpt zarr files"]
    print(f"  durable ocdbt / zarr files: {ratio:.2f}x (median of paired ratios "
          f"{statistics.median(paired):.2f}x); ocdbt / orbax ocdbt: "
          f"{med_d['asyncckpt ocdbt'] / med_d['orbax ocdbt']:.2f}x")
    print(f"  blocking ocdbt / orbax ocdbt: "
          f"{med_b['asyncckpt ocdbt'] / med_b['orbax ocdbt']:.2f}x", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

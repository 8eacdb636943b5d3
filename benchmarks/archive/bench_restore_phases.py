"""Per-phase time of asyncckpt's cold restores, paired with the raw read.

Builds the ``asyncckpt bench --restore`` states (TensorFlow variables, a
sharded JAX pytree) of ``--mib`` MiB, saves each with asyncckpt, and
restores them from a cold page cache, interleaved with a raw read of the
same number of bytes, in rotating order. Internal steps are wrapped with
timers (this script only; the library is unchanged), so each restore's wall
time splits into: reading and checking the files (``read_all``, including
the destination memory's page faults), the rest of the prefetch (index,
prediction, allocation), and what follows it (TensorFlow's own restore and
assignment; JAX placement). Prints medians in ms and ratios to the raw read.

Usage: python benchmarks/archive/bench_restore_phases.py [--mib 1024] [--reps 5]
       [--frameworks tf,jax]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from asyncckpt._engine import reads
from benchmarks.suite import engines as eng
from benchmarks.suite.restore import checkpoint_files

_spent: collections.Counter = collections.Counter()
_VMSTAT = ("compact_stall", "thp_fault_alloc", "thp_fault_fallback", "compact_fail")


def _vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        pairs = (line.split() for line in f)
        return {k: int(v) for k, v in pairs if k in _VMSTAT}


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _spent[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def _tf_case(nbytes: int, work: str):
    import asyncckpt.tf as at
    from asyncckpt.tf import _bundleread
    from asyncckpt.tf import _restore as tr

    state = eng.TFState(nbytes, eng.tensors_for(nbytes))
    with at.Checkpoint(**state.variables) as saver:
        path = saver.save(os.path.join(work, "tf", "ckpt"))
    ours = at.Checkpoint(**state.variables)
    _timed(tr, "prefetch", "tf prefetch")
    _timed(_bundleread, "open_bundle", "tf open_bundle")
    _timed(_bundleread, "predict", "tf predict")
    _timed(tr, "_read_whole", "tf read_whole")
    _timed(tr, "_to_tensor", "tf to_tensor")
    _timed(tr, "_restore_v2", "tf RestoreV2 hook")
    _timed(tr, "prepared", "tf prepared")
    _timed(tr.Serving, "__exit__", "tf serving exit")
    _timed(tr.Serving, "keep", "tf keep")
    import tensorflow as tf
    _timed(tf.train.Checkpoint, "read", "tf Checkpoint.read")
    _timed(tr, "verify_files", "tf verify rest")
    def run():
        t0 = time.perf_counter()
        status = ours.restore(path)
        _spent["tf restore()"] += time.perf_counter() - t0
        status.assert_consumed()

    return os.path.join(work, "tf"), run


def _jax_case(nbytes: int, work: str):
    import jax

    import asyncckpt.jax as aj
    from asyncckpt.jax import _restore as jr
    from asyncckpt.jax._chunks import ChunkReader

    state = eng.JAXState(nbytes, eng.tensors_for(nbytes))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          state.tree)
    with aj.CheckpointManager(os.path.join(work, "jax")) as saver:
        saver.save(1, state.tree, force=True)
    del state
    ours = aj.CheckpointManager(os.path.join(work, "jax"))
    _timed(jr, "restore_tree", "jax restore_tree")
    _timed(jr, "verify_files", "jax verify_files")
    _timed(jr.fmt, "read_tree_metadata", "jax tree metadata")
    _timed(ChunkReader, "prefetch", "jax prefetch")
    _timed(ChunkReader, "_plan", "jax plan+alloc")
    _timed(ChunkReader, "check_the_rest", "jax check_the_rest")
    _timed(jr, "_read_leaf", "jax place")
    return os.path.join(work, "jax"), lambda: jax.block_until_ready(ours.restore(1, target=target))


def _mincore(run) -> None:
    saved, reads._syscall = reads._syscall, False
    try:
        run()
    finally:
        reads._syscall = saved


def main() -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--frameworks", default="tf,jax")
    p.add_argument("--dir", default=None)
    p.add_argument("--mincore", action="store_true",
                   help="also each restore with mincore as the page-cache probe (A/B)")
    args = p.parse_args()
    nbytes = args.mib << 20
    _timed(reads, "read_all", "read_all")
    with tempfile.TemporaryDirectory(prefix="bench-phases-", dir=args.dir or os.getcwd()) as work:
        cases = {}
        if "tf" in args.frameworks:
            cases["tf"] = _tf_case(nbytes, work)
        if "jax" in args.frameworks:
            cases["jax"] = _jax_case(nbytes, work)
        if args.mincore:  # the same restores with the old residency probe (before cachestat)
            for n in list(cases):
                cases[n + " mincore"] = (cases[n][0], functools.partial(_mincore, cases[n][1]))
        floors = eng.Floors(nbytes, 1, os.path.join(work, "floors"))
        floors.raw_write()
        floors.keep_read_buffer_only()
        cases["raw"] = (os.path.join(work, "floors"), floors.raw_read)
        names = list(cases)
        for n in names:
            eng.evict_from_page_cache(checkpoint_files(cases[n][0]))
            cases[n][1]()
        wall: dict[str, list[float]] = {n: [] for n in names}
        phases: dict[str, list[collections.Counter]] = {n: [] for n in names}
        for rep in range(args.reps):
            k = rep % len(names)
            for n in names[k:] + names[:k]:
                eng.evict_from_page_cache(checkpoint_files(cases[n][0]))
                _spent.clear()
                v0 = _vmstat()
                t0 = time.perf_counter()
                cases[n][1]()
                wall[n].append(time.perf_counter() - t0)
                v1 = _vmstat()
                for key in _VMSTAT:
                    _spent["vm " + key] += (v1[key] - v0[key]) / 1e3
                phases[n].append(collections.Counter(_spent))
        raw = statistics.median(wall["raw"])
        print(f"{args.mib} MiB, {args.reps} reps, load {os.getloadavg()[0]:.2f}")
        for n in names:
            w = wall[n]
            med = statistics.median(w)
            print(f"{n:6} wall {med * 1e3:6.0f} ms {med / raw:5.2f}x  reps "
                  + " ".join(f"{t * 1e3:.0f}" for t in w))
            labels = sorted({lab for c in phases[n] for lab in c})
            for lab in labels:
                xs = [c[lab] for c in phases[n]]
                print(f"    {lab:22} {statistics.median(xs) * 1e3:6.0f} ms  "
                      + " ".join(f"{x * 1e3:.0f}" for x in xs))


if __name__ == "__main__":
    main()

"""Blocking time of one TensorFlow save: asyncckpt vs TensorFlow vs the memcpy floor.

Usage: python benchmarks/bench_tf_blocking.py [--mib 256] [--tensors 16] [--reps 7]

All cases run in one process, interleaved (each repetition runs every case
once, in rotating order), so the machine's noise hits them alike. Reported:
medians, and the ratios the foundation issue asks for.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()

    import tensorflow as tf

    import asyncckpt.tf as at

    n = (args.mib << 20) // 4 // args.tensors
    variables = {f"v{i}": tf.Variable(tf.random.normal([n])) for i in range(args.tensors)}
    total = n * 4 * args.tensors
    src = np.random.default_rng(0).random(total // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    parts_src = [np.ascontiguousarray(src[i * n : (i + 1) * n]) for i in range(args.tensors)]
    parts_dst = [np.zeros(n, np.float32) for _ in range(args.tensors)]

    work = args.dir or tempfile.mkdtemp(prefix="asyncckpt-bench-")
    ours = at.Checkpoint(**variables)
    tf_sync = tf.train.Checkpoint(**variables)
    tf_async = tf.train.Checkpoint(**variables)
    async_opts = tf.train.CheckpointOptions(enable_async=True)

    def memcpy_single():
        np.copyto(dst, src)

    def memcpy_per_tensor():
        for d, s in zip(parts_dst, parts_src, strict=True):
            np.copyto(d, s)

    def asyncckpt_save():
        ours.write(os.path.join(work, "ours", "ckpt"))

    def tf_sync_write():
        tf_sync.write(os.path.join(work, "tf_sync", "ckpt"))

    def tf_builtin_async():
        tf_async.write(os.path.join(work, "tf_async", "ckpt"), options=async_opts)

    def settle():
        ours.sync()
        tf_async.sync()

    cases = {
        "memcpy (one buffer)": memcpy_single,
        "memcpy (per tensor)": memcpy_per_tensor,
        "asyncckpt.tf save": asyncckpt_save,
        "tf built-in async": tf_builtin_async,
        "tf sync write": tf_sync_write,
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for rep in range(args.reps + 1):  # the first repetition warms up and is dropped
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            settle()
            t0 = time.perf_counter()
            cases[name]()
            dt = time.perf_counter() - t0
            if rep:
                times[name].append(dt)
        settle()
    ours.close()
    shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"state: {total / 2**20:.0f} MiB in {args.tensors} tensors; {args.reps} interleaved reps")
    print(f"{'case':<22} {'median ms':>10} {'min ms':>8}")
    for k in names:
        print(f"{k:<22} {med[k] * 1e3:>10.1f} {min(times[k]) * 1e3:>8.1f}")
    ours_s = med["asyncckpt.tf save"]
    print("ratios (median):")
    print(f"  asyncckpt / memcpy one buffer : {ours_s / med['memcpy (one buffer)']:.2f}x")
    print(f"  asyncckpt / memcpy per tensor : {ours_s / med['memcpy (per tensor)']:.2f}x")
    print(f"  asyncckpt / tf built-in async : {ours_s / med['tf built-in async']:.2f}x")
    print(f"  asyncckpt / tf sync write     : {ours_s / med['tf sync write']:.3f}x")


if __name__ == "__main__":
    main()

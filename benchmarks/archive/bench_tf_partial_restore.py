"""Model-only TensorFlow restore from a model + Adam checkpoint, cold page cache.

The fine-tuning case: a Keras 3 model and its Adam state (two slots per
variable: 2/3 of the bytes) saved together, then only the model restored
(``tf.train.Checkpoint(model=model).restore(path).expect_partial()``). In one
process, cases interleaved in rotating order, every file evicted from the
page cache before each timed call (and checked with ``mincore``):

* ``raw read (model bytes)``: one ``readinto`` of as many bytes as the
  model's variables hold (the physical floor);
* ``asyncckpt (every tensor, before)``: ``asyncckpt.tf.Checkpoint.restore``
  with the restore's prediction switched off, which reads and checks every
  tensor of the checkpoint as the restore did before issue 13.1;
* ``asyncckpt (restored tensors only)``: the same restore as it is now;
* ``tf.train.Checkpoint.restore``: TensorFlow's own restore of its own save
  of the same model and optimizer.

Reports median times, ratios to the raw read and to TensorFlow, and the
bytes each case read from the device (``/proc/self/io`` ``read_bytes``).
Usage::

    python benchmarks/archive/bench_tf_partial_restore.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks, tests

from benchmarks.suite import engines as eng
from benchmarks.suite.restore import resident_fraction


def _device_reads() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _files(directory: str) -> list[str]:
    return [os.path.join(r, n) for r, _, names in os.walk(directory) for n in names]


def _build(keras, widths: list[int]):
    layers = [keras.Input((widths[0],))] + [keras.layers.Dense(w) for w in widths[1:]]
    return keras.Sequential(layers)


def measure(reps: int, work: str, widths: list[int]) -> dict:
    """Every case ``reps`` times after one untimed round (see the module docstring)."""
    import keras
    import tensorflow as tf

    import asyncckpt.tf as at
    from asyncckpt.tf import _bundleread

    model = _build(keras, widths)
    opt = keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    for v in model.trainable_variables + opt.variables:
        v.assign(rng.standard_normal(v.shape).astype(np.float32))
    model_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    ours_dir, tf_dir, raw_dir = (os.path.join(work, n) for n in ("ours", "tf", "raw"))
    with at.Checkpoint(model=model, optimizer=opt) as saver:
        ours_path = saver.save(os.path.join(ours_dir, "ckpt"))
    tf_path = tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(tf_dir, "ckpt"))
    total_bytes = sum(os.path.getsize(p) for p in _files(ours_dir))
    floors = eng.Floors(model_bytes, 1, raw_dir)
    floors.raw_write()
    del floors.src, floors.parts

    target = _build(keras, widths)
    real_predict = _bundleread.predict

    def ours_before() -> None:
        _bundleread.predict = lambda root, bundle: None  # every tensor, as before
        try:
            at.Checkpoint(model=target).restore(ours_path).expect_partial()
        finally:
            _bundleread.predict = real_predict

    cases = {
        "raw read (model bytes)": (raw_dir, floors.raw_read),
        "asyncckpt (every tensor, before)": (ours_dir, ours_before),
        "asyncckpt (restored tensors only)": (
            ours_dir, lambda: at.Checkpoint(model=target).restore(ours_path).expect_partial()),
        "tf.train.Checkpoint.restore": (
            tf_dir, lambda: tf.train.Checkpoint(model=target).restore(tf_path).expect_partial()),
    }
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    device: dict[str, list[int]] = {n: [] for n in names}
    resident: list[float] = []
    for rep in range(reps + 1):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            directory, run = cases[name]
            eng.evict_from_page_cache(_files(directory))
            resident.append(resident_fraction(_files(directory)) or 0.0)
            before = _device_reads()
            t0 = time.perf_counter()
            run()
            elapsed = time.perf_counter() - t0
            if rep:  # the first round is untimed (first-use costs of this process)
                times[name].append(elapsed)
                device[name].append(_device_reads() - before)
    for got, want in zip(target.trainable_variables, model.trainable_variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    med = {n: statistics.median(times[n]) for n in names}
    raw, peer = med["raw read (model bytes)"], med["tf.train.Checkpoint.restore"]
    return {
        "reps": reps, "model_bytes": model_bytes, "checkpoint_bytes": total_bytes,
        "max_resident_fraction_after_evict": max(resident),
        "cases": {n: {"median_s": med[n], "min_s": min(times[n]), "max_s": max(times[n]),
                      "vs_raw_read": med[n] / raw, "vs_tf": med[n] / peer,
                      "per_rep_vs_raw_read": [t / r for t, r in zip(
                          times[n], times["raw read (model bytes)"], strict=True)],
                      "device_read_mib": statistics.median(device[n]) / 2**20}
                  for n in names},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--widths", default="2048,4096,2048,2560",
                        help="input width, then each Dense layer's (default: ~84 MiB of "
                             "model, ~252 MiB with Adam's state)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("ASYNCCKPT_BENCH_DIR")) as work:
        result = measure(args.reps, work, [int(w) for w in args.widths.split(",")])
    print(f"checkpoint {result['checkpoint_bytes'] / 2**20:.0f} MiB, model "
          f"{result['model_bytes'] / 2**20:.0f} MiB, {result['reps']} reps, max resident "
          f"after evict {result['max_resident_fraction_after_evict']:.3f}")
    print(f"{'case':36} {'median s':>9} {'vs raw':>7} {'vs tf':>6} {'read MiB':>9}")
    for name, c in result["cases"].items():
        print(f"{name:36} {c['median_s']:9.3f} {c['vs_raw_read']:6.2f}x {c['vs_tf']:5.2f}x "
              f"{c['device_read_mib']:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

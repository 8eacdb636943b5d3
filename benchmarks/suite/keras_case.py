"""The Keras row of ``python -m benchmarks``: blocking time per backup inside ``fit``.

A dense model of about ``nbytes`` of weights, compiled with Adam (so a backup
holds about three times that), trains with one backup before every batch.
Cases, interleaved in one process: ``asyncckpt.keras.BackupAndRestore``
(time of the backup taken at the batch boundary, with the writer idle as in
the other blocking rows), Keras's own ``keras.callbacks.BackupAndRestore``
(time of its ``on_train_batch_end``, which writes the files), and a host
memcpy of the same bytes. On TensorFlow also asyncckpt with its variables read
one by one (eager reads, as before the batched read), to show what the one
batched read saves. The Keras backend is the process's; ``measure_all`` runs
the other one in a child process.

Run alone: ``python -m benchmarks.suite.keras_case --mib 64 --backend jax``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.suite import child_env


def measure(nbytes: int, *, reps: int, workdir: str) -> dict:
    """Blocking per backup of both callbacks and the memcpy floor, for this process's backend."""
    import keras
    import numpy as np

    # _state is private, deliberately (tests/test_module_boundaries.py lists it): the floor
    # copies the arrays a backup copies, mid-epoch on JAX the trainer's, not the variables'.
    import asyncckpt.keras as ak
    from asyncckpt.keras import _state

    width = 1024
    layers = max(1, round(nbytes / (width * width * 4)))
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(layers)]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    x = np.random.default_rng(0).standard_normal((8 * (reps + 2), width), dtype=np.float32)
    steps = reps + 2  # the first two are warm-up (allocation, tracing)

    model.optimizer.build(model.trainable_variables)
    arrays = [np.asarray(v.value) for v in model.trainable_variables]
    arrays += [np.asarray(v.value) for v in model.optimizer.variables]
    state_bytes = sum(a.nbytes for a in arrays)
    src = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    dst = np.empty_like(src)
    dst[:] = src
    floor: list[float] = []  # copy of the live weights, array by array, into host buffers
    flat: list[float] = []  # one contiguous memcpy of as many bytes
    dsts: dict[str, np.ndarray] = {}

    floor_eager: list[float] = []  # the same floor, measured before the one-by-one backups

    def memcpy(model, floor=floor) -> None:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        flat.append(time.perf_counter() - t0)
        sources, _ = _state.snapshot_sources(model)
        views = {k: np.asarray(v) for k, v in sources.items()}
        for k, v in views.items():
            if k not in dsts:
                dsts[k] = np.empty_like(v)
                dsts[k][...] = v
        t0 = time.perf_counter()
        for k, v in views.items():
            np.copyto(dsts[k], v)
        floor.append(time.perf_counter() - t0)

    class Timed(ak.BackupAndRestore):
        times: list[float] = []

        def _save(self, epoch, batch, **kw):
            memcpy(self._model)  # the floors, measured right before each backup
            t0 = time.perf_counter()
            super()._save(epoch, batch, **kw)
            self.times.append(time.perf_counter() - t0)

    class OneByOne:
        """Reads the variables one eager op each (the batched read's baseline)."""

        def read(self, variables):
            return [v.value() for v in variables]

    class TimedEager(Timed):
        times: list[float] = []

        def _save(self, epoch, batch, **kw):
            self._reader = OneByOne()
            memcpy(self._model, floor_eager)
            t0 = time.perf_counter()
            ak.BackupAndRestore._save(self, epoch, batch, **kw)
            self.times.append(time.perf_counter() - t0)

    class Idle(keras.callbacks.Callback):
        """Waits for the writer after each batch, so each backup meets an idle writer."""

        def __init__(self, backup):
            super().__init__()
            self.backup = backup

        def on_train_batch_end(self, batch, logs=None):
            self.backup.store.wait_until_finished()

    class TimedKeras(keras.callbacks.BackupAndRestore):
        times: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            t0 = time.perf_counter()
            super().on_train_batch_end(batch, logs)
            self.times.append(time.perf_counter() - t0)

    ours = Timed(os.path.join(workdir, "asyncckpt"), save_freq=1)
    theirs = TimedKeras(os.path.join(workdir, "keras"), save_freq=1)
    tf_backend = keras.backend.backend() == "tensorflow"
    eager = TimedEager(os.path.join(workdir, "asyncckpt-eager"), save_freq=1)
    for _ in range(2):  # two fits each, interleaved
        model.fit(x, x, batch_size=8, epochs=1, steps_per_epoch=steps, shuffle=False,
                  callbacks=[ours, Idle(ours)], verbose=0)
        model.fit(x, x, batch_size=8, epochs=1, steps_per_epoch=steps, shuffle=False,
                  callbacks=[theirs], verbose=0)
        if tf_backend:
            model.fit(x, x, batch_size=8, epochs=1, steps_per_epoch=steps, shuffle=False,
                      callbacks=[eager, Idle(eager)], verbose=0)
    # asyncckpt backs up at the end of every batch of each fit (the last batch's at
    # the epoch's end, right after it); the first of each fit is a warm-up. Keras's
    # saves after each batch.
    n = steps
    keep = [i for i in range(len(Timed.times)) if i % n != 0]
    ours_t = [Timed.times[i] for i in keep]
    floor_t = [floor[i] for i in keep]
    flat_s = statistics.median(flat[i] for i in keep)
    theirs_t = [t for i, t in enumerate(TimedKeras.times) if i % steps >= 2]
    memcpy_s = statistics.median(floor_t)
    a, k = statistics.median(ours_t), statistics.median(theirs_t)
    extra = {}
    if tf_backend:
        eager_t = [TimedEager.times[i] for i in keep]
        eager_floor = [floor_eager[i] for i in keep]
        extra = {"asyncckpt_one_by_one_blocking_s": statistics.median(eager_t),
                 "asyncckpt_one_by_one_vs_memcpy": statistics.median(eager_t)
                 / statistics.median(eager_floor),
                 "asyncckpt_one_by_one_vs_memcpy_paired_median": statistics.median(
                     t / f for t, f in zip(eager_t, eager_floor, strict=True)),
                 "asyncckpt_one_by_one_vs_memcpy_min": min(eager_t) / min(eager_floor)}
    return {
        "backend": keras.backend.backend(),
        "state_bytes": state_bytes,
        "memcpy_s": memcpy_s,
        "contiguous_memcpy_s": flat_s,
        "asyncckpt_blocking_s": a,
        "keras_blocking_s": k,
        "asyncckpt_vs_memcpy": a / memcpy_s,
        "asyncckpt_vs_memcpy_paired_median": statistics.median(
            t / f for t, f in zip(ours_t, floor_t, strict=True)),
        # Fastest against fastest: the least disturbed by other jobs on a busy machine.
        "asyncckpt_vs_memcpy_min": min(ours_t) / min(floor_t),
        "keras_vs_memcpy": k / memcpy_s,
        "asyncckpt_vs_contiguous_memcpy": a / flat_s,
        "samples": len(ours_t),
        **extra,
    }


def measure_all(nbytes: int, *, reps: int, backends: list[str]) -> list[dict]:
    """Runs ``measure`` once per backend, each in a child process (Keras's backend is global)."""
    out = []
    for backend in backends:
        env = child_env(KERAS_BACKEND=backend)
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.suite.keras_case", "--mib", str(nbytes >> 20),
             "--reps", str(reps), "--json"],
            env=env, capture_output=True, text=True, timeout=1800,
        )
        if proc.returncode != 0:
            out.append({"backend": backend, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def text(rows: list[dict]) -> str:
    lines = ["Keras BackupAndRestore inside fit(), blocking per backup (medians); floor: a "
             "host memcpy of the same live weights and optimizer variables:"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['backend']}: failed: {r['error']}")
            continue
        lines.append(
            f"  {r['backend']:<10} {r['state_bytes'] / 2**20:5.0f} MiB  memcpy "
            f"{r['memcpy_s'] * 1e3:6.2f} ms  asyncckpt {r['asyncckpt_blocking_s'] * 1e3:6.2f} ms"
            f" ({r['asyncckpt_vs_memcpy']:.2f}x;"
            f" paired {r['asyncckpt_vs_memcpy_paired_median']:.2f}x;"
            f" min/min {r['asyncckpt_vs_memcpy_min']:.2f}x;"
            f" vs one contiguous memcpy {r['asyncckpt_vs_contiguous_memcpy']:.2f}x)"
            f"  keras {r['keras_blocking_s'] * 1e3:7.1f} ms ({r['keras_vs_memcpy']:.1f}x)"
        )
        if "asyncckpt_one_by_one_blocking_s" in r:
            lines.append(
                f"  {'':<10} asyncckpt reading variables one by one: "
                f"{r['asyncckpt_one_by_one_blocking_s'] * 1e3:6.2f} ms "
                f"({r['asyncckpt_one_by_one_vs_memcpy']:.2f}x;"
                f" paired {r['asyncckpt_one_by_one_vs_memcpy_paired_median']:.2f}x;"
                f" min/min {r['asyncckpt_one_by_one_vs_memcpy_min']:.2f}x)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, default=64, help="model weights in MiB")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--backend", default=None, help="run in a child with this KERAS_BACKEND")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    if args.backend:
        rows = measure_all(args.mib << 20, reps=args.reps, backends=[args.backend])
    else:
        with tempfile.TemporaryDirectory(prefix="keras-bench-") as work:
            rows = [measure(args.mib << 20, reps=args.reps, workdir=work)]
    print(json.dumps(rows[0]) if args.json else text(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

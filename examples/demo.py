"""The README's main job: train with asynchronous checkpoints, then restore and check.

Run with ``python -m asyncckpt.demo`` (or ``make demo``). For each framework it
trains a small model on synthetic data, saves every few steps, prints for each
save how long training was blocked next to how long the background write took
and the speed-up over a synchronous save of the same state, then restores into
fresh objects and checks that every value matches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class MemcpyFloor:
    """A memcpy of the state's bytes between two warm buffers, timed at every step.

    The floor a save's blocking is compared with: copying the state once in
    host memory is the least a snapshot can cost. Timed in the same loop as
    the saves (before each step's save call), so both meet the same load and
    the same background writes.
    """

    def __init__(self, nbytes: int):
        import numpy as np

        self._src = np.ones(nbytes, np.uint8)
        self._dst = np.empty_like(self._src)
        self._copy = np.copyto
        self._copy(self._dst, self._src)  # both buffers warm
        self.times: list[float] = []

    def measure(self) -> None:
        t0 = time.perf_counter()
        self._copy(self._dst, self._src)
        self.times.append(time.perf_counter() - t0)

    def median(self) -> float:
        return _median(self.times)


def print_saves(handles: list, floor: MemcpyFloor, sync_s: float) -> None:
    """One line per save: blocking, background time, speed-up, blocking over a memcpy."""
    memcpy = floor.median()
    print(f"{'step':>5} {'blocked ms':>11} {'background ms':>14} {'speed-up vs sync':>17} "
          f"{'x memcpy':>9}")
    for step, handle in handles:
        s = handle.result()
        print(f"{step:>5} {s.blocking_s * 1e3:>11.1f} {s.background_s * 1e3:>14.0f} "
              f"{sync_s / s.blocking_s:>16.1f}x {s.blocking_s / memcpy:>8.2f}x")
    later = [h.result().blocking_s for _, h in handles[1:]]
    if later:
        print(f"memcpy of the state: {memcpy * 1e3:.1f} ms (median); saves after the first "
              f"blocked at most {max(later) / memcpy:.2f}x that")


def run_tf_demo(workdir: str, *, steps: int = 40, every: int = 5, width: int = 1024) -> bool:
    """Keras model + Adam, custom training loop, asyncckpt.tf.CheckpointManager."""
    import keras
    import numpy as np
    import tensorflow as tf

    import asyncckpt.tf as at

    print("\n== TensorFlow: Keras MLP, Adam, asyncckpt.tf.CheckpointManager ==")
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(256, width)).astype("float32"))
    y = tf.constant(rng.normal(size=(256, 10)).astype("float32"))

    def make():
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(3)]
            + [keras.layers.Dense(10)]
        )
        opt = keras.optimizers.Adam(1e-3)
        opt.build(model.trainable_variables)
        return model, opt

    model, opt = make()

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables, strict=True))
        return loss

    train_step()  # trace once, outside the timings
    state_mib = sum(v.numpy().nbytes for v in model.weights + opt.variables) / 2**20

    # The baseline: one synchronous save of the same state with plain TensorFlow.
    sync_ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    t0 = time.perf_counter()
    sync_ckpt.write(os.path.join(workdir, "sync-baseline", "ckpt"))
    sync_s = time.perf_counter() - t0
    print(f"state: {state_mib:.0f} MiB; "
          f"synchronous tf.train.Checkpoint.write: {sync_s * 1e3:.0f} ms")

    directory = os.path.join(workdir, "tf")
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    floor = MemcpyFloor(int(state_mib * 2**20))
    with at.CheckpointManager(ckpt, directory, max_to_keep=3) as manager:
        manager.prepare()  # staging memory built in the background, not at the first save
        handles = []
        for step in range(1, steps + 1):
            train_step()
            floor.measure()
            if step % every == 0:
                manager.save(checkpoint_number=step)
                handles.append((step, manager.last_save))
        manager.sync()
        print_saves(handles, floor, sync_s)
        blocked = _median([h.result().blocking_s for _, h in handles])
        latest = manager.latest_checkpoint
        print(f"median: training blocked {blocked * 1e3:.1f} ms per save instead of "
              f"{sync_s * 1e3:.0f} ms ({sync_s / blocked:.1f}x less); latest: {latest}")

    expected = [v.numpy() for v in model.weights + opt.variables]
    fresh_model, fresh_opt = make()
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh_opt).restore(latest).assert_consumed()
    got = [v.numpy() for v in fresh_model.weights + fresh_opt.variables]
    ok = len(expected) == len(got) and all(
        np.array_equal(a, b) for a, b in zip(expected, got, strict=True)
    )
    print(f"restored {len(got)} variables with plain tf.train.Checkpoint: "
          f"{'all values match' if ok else 'MISMATCH'}")
    return ok


def _run_jax(workdir: str) -> bool | None:
    try:
        from asyncckpt.jax.demo import run_jax_demo
    except ImportError as e:
        print(f"\n(JAX part skipped: {e})")
        return None
    print("\n== JAX: MLP in plain JAX, asyncckpt.jax.CheckpointManager ==")
    result = run_jax_demo(os.path.join(workdir, "jax"))
    return True if result is None else bool(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="demo-checkpoints",
                        help="where to write checkpoints (emptied first)")
    parser.add_argument("--framework", choices=["all", "tf", "jax"], default="all")
    args = parser.parse_args(argv)
    workdir = os.path.abspath(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    print(f"asyncckpt demo: checkpoints go to {workdir}")
    results = []
    if args.framework in ("all", "jax"):
        # JAX first: it must see its device-count flag before anything starts XLA.
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        results.append(_run_jax(workdir))
    if args.framework in ("all", "tf"):
        results.append(run_tf_demo(workdir))
    failed = [r for r in results if r is False]
    print("\ndemo " + ("FAILED" if failed else "finished: every restore matched"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

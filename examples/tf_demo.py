"""The TensorFlow half of the demo: a Keras MLP and Adam, asyncckpt.tf.CheckpointManager.

A custom training loop saves every few steps; for each save it prints how long
training was blocked next to the background write time and a synchronous
``tf.train.Checkpoint.write`` of the same state, then restores into fresh
objects with plain ``tf.train.Checkpoint`` and checks every value.
"""

from __future__ import annotations

import os
import time

from examples.demo_report import MemcpyFloor, median, print_saves


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
        blocked = median([h.result().blocking_s for _, h in handles])
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

"""Exact mid-epoch resume of ``fit`` on a shuffled ``tf.data.Dataset`` (TensorFlow backend).

A child trains on ``from_tensor_slices(...).shuffle(seed).batch().prefetch()``
(reshuffled every epoch) with ``BackupAndRestore(save_freq=4)``: backups fall
mid-epoch and on epoch boundaries (8 batches per epoch). The parent SIGKILLs
it after random batches (seed printed; ``ASYNCCKPT_KILL_SEED`` replays it) and
restarts it until it finishes (the child parks at that batch once a backup of
that run is durable, so every restart resumes from a newer one, and the kill
lands there however the machine's load paces the two processes); the final
weights must be bit-identical to an uninterrupted run's (made after the
resumed one, in the same process), which only holds if every resumed epoch
continues the saved iterator (its position, its buffers and the dataset's
reshuffle seeds).
"""

from __future__ import annotations

import json
import os
import random
import signal

from tests.helpers import start_python, subprocess_env, write_script

WORKER = r'''
import hashlib, json, os, sys, threading
import numpy as np
import keras
import tensorflow as tf
import asyncckpt.keras as ak


KILL_AT = int(os.environ.get("KILL_AT", "0"))  # this run's batch to park at, 0: none
durable = threading.Event()  # a backup of this run is durable


class Backup(ak.BackupAndRestore):
    def _make_store(self):
        store = super()._make_store()
        real_save = store.save

        def save(*args, **kwargs):  # each backup: durable.set() once it is durable
            handle = real_save(*args, **kwargs)
            handle.committed.add_done_callback(
                lambda f: f.exception() is None and durable.set())
            return handle

        store.save = save
        return store


def train(backup_dir):
    keras.utils.set_random_seed(9)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(96, 10)).astype("float32")
    y = (x[:, :3].sum(1, keepdims=True) + 0.1 * rng.normal(size=(96, 1))).astype("float32")
    data = (tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(96, seed=3).batch(12).prefetch(2))  # 8 batches, reshuffled each epoch
    model = keras.Sequential([
        keras.layers.Dense(16, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse")
    backup = Backup(backup_dir, save_freq=4)

    class Park(keras.callbacks.Callback):
        """Holds training at the kill point, once a backup of this run is durable.

        The parent's SIGKILL then lands there however far the child would
        otherwise have run ahead of the parent's reading (a loaded machine).
        It parks as a batch begins: by the 5th, every run has issued a backup
        (save_freq=4; one due at an epoch's end is taken as the next epoch's
        first batch begins, by the callback listed before this one).
        """
        def __init__(self):
            super().__init__()
            self.done = 0  # batches this run has trained

        def on_train_batch_end(self, batch, logs=None):
            self.done += 1

        def on_train_batch_begin(self, batch, logs=None):
            if KILL_AT and self.done >= max(KILL_AT, 4):
                assert durable.wait(120), "no backup became durable"
                print("PARK", flush=True)
                sys.stdin.readline()  # until the parent's SIGKILL

    model.fit(data, epochs=3, callbacks=[backup, Park()], verbose=0, shuffle=False)
    digest = hashlib.sha256(b"".join(
        np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()
    return digest, backup.restored_position, int(np.asarray(model.optimizer.iterations.value))


weights, restored, iterations = train(sys.argv[1])
print("RESTORED", json.dumps(restored), flush=True)
reference, _, ref_iterations = train(sys.argv[1] + "-reference")
with open(sys.argv[2], "w") as f:
    json.dump({"weights": weights, "iterations": iterations, "reference": reference,
               "ref_iterations": ref_iterations}, f)
'''


def test_sigkill_at_random_batches_resumes_a_shuffled_tf_data_fit_bit_identical(tmp_path):
    script = write_script(tmp_path, "worker.py", WORKER)
    env = subprocess_env(KERAS_BACKEND="tensorflow")
    seed = int(os.environ.get("ASYNCCKPT_KILL_SEED", random.randrange(1 << 30)))
    kills = int(os.environ.get("ASYNCCKPT_KILLS_PER_TRIAL", "1"))
    rng = random.Random(seed)
    plan = [rng.randrange(3, 12) for _ in range(kills)]
    print(f"ASYNCCKPT_KILL_SEED={seed}: kill after {plan} batches of each run")
    backup_dir, out = tmp_path / "backup", tmp_path / "out.json"
    restored = []
    for kill_at in [*plan, None]:
        run_env = dict(env, KILL_AT=str(kill_at or 0))
        proc = start_python(script, str(backup_dir), str(out), env=run_env,
                            stdin=kill_at is not None)
        for line in proc.stdout:
            if line.startswith("RESTORED"):
                restored.append(json.loads(line.split(None, 1)[1]))
            if line.startswith("PARK"):
                proc.send_signal(signal.SIGKILL)
                break
        rc = proc.wait(timeout=240)
        err = proc.stderr.read()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        assert rc == (0 if kill_at is None else -signal.SIGKILL), err[-3000:]
    got = json.loads(out.read_text())
    assert got["iterations"] == got["ref_iterations"] == 24
    # The last run resumed from a backup its predecessor made.
    assert restored and restored[-1] is not None
    assert got["weights"] == got["reference"], "resumed weights differ from the uninterrupted run"

"""``PreemptionCheckpointHandler`` driving ``asyncckpt.keras.BackupAndRestore``.

A real ``fit()`` in a child process gets a real SIGTERM while it waits at the
end of a chosen batch (the batch is picked from a printed, settable seed);
the handler must back up at the next batch boundary (not at the earlier
periodic backup), exit with the platform's code, and the restarted ``fit()``
must end bit-identical to an uninterrupted run (run after it, in its process).
In-process: with a grace period the handler backs up at the notice and
training goes on.
"""

from __future__ import annotations

import json
import os
import random
import signal

import numpy as np
import pytest

from asyncckpt.jobrunner.store import ArrayStore
from tests.helpers import LineWatcher, run_python, start_python, subprocess_env, write_script

WORKER = r'''
import hashlib, json, os, sys
import numpy as np
import keras
import asyncckpt.keras as ak
from asyncckpt.preemption import TerminationConfig


def train(backup_dir, pause_at):
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 10)).astype("float32")
    y = (x[:, :2].sum(1, keepdims=True) + 0.1 * rng.normal(size=(96, 1))).astype("float32")
    model = keras.Sequential([
        keras.layers.Dense(16, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse")
    data = ak.ResumableDataset(x, y, batch_size=12, shuffle_seed=3)  # 8 batches per epoch
    options = ak.BackupOptions(preemption=ak.PreemptionOptions(
        termination_config=TerminationConfig(platform="other")))  # no grace period, exit 42
    backup = ak.BackupAndRestore(backup_dir, save_freq=5, data=data, options=options)

    class Report(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print("B", backup._global, flush=True)
            if backup._global == pause_at:
                backup.store.wait_until_finished()  # no periodic backup in flight
                sys.stdin.readline()  # the parent sends SIGTERM, then a line

    model.fit(data, epochs=3, callbacks=[backup, Report()], verbose=0, shuffle=False)
    digest = hashlib.sha256(b"".join(
        np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()
    return digest, backup.restored_position, int(np.asarray(model.optimizer.iterations.value))


backup_dir, out_path = sys.argv[1], sys.argv[2]
weights, restored, iterations = train(backup_dir, int(os.environ.get("PAUSE_AT", "-1")))
# The uninterrupted run, after the resumed one in the same process (saves a process start).
reference, _, ref_iterations = train(backup_dir + "-reference", -1)
with open(out_path, "w") as f:
    json.dump({"weights": weights, "restored": restored, "iterations": iterations,
               "reference": reference, "ref_iterations": ref_iterations}, f)
print("DONE", flush=True)
'''


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_sigterm_in_a_real_fit_backs_up_at_the_next_batch_and_resumes_exactly(tmp_path, backend):
    seed = int(os.environ.get("ASYNCCKPT_KILL_SEED", random.randrange(1 << 30)))
    print(f"ASYNCCKPT_KILL_SEED={seed} backend={backend}")
    pause_at = random.Random(seed).choice([b for b in range(1, 24) if b % 5])  # not periodic
    script = write_script(tmp_path, "worker.py", WORKER)
    env = subprocess_env(KERAS_BACKEND=backend)
    backup_dir, out = tmp_path / "backup", tmp_path / "out.json"

    proc = start_python(script, str(backup_dir), str(out), stdin=True,
                        env=subprocess_env(KERAS_BACKEND=backend, PAUSE_AT=str(pause_at)))
    lines = LineWatcher(proc.stdout)
    lines.wait_for(lambda line: line.split() == ["B", str(pause_at)])
    proc.send_signal(signal.SIGTERM)  # the child is parked at the end of batch `pause_at`
    proc.stdin.write("go\n")
    proc.stdin.close()
    assert proc.wait(timeout=120) == 42, proc.stderr.read()[-3000:]
    proc.stderr.close()
    # The handler backed up at the very next boundary: no batch ran after the notice.
    assert f"B {pause_at + 1}" not in lines.text.splitlines()
    store = ArrayStore(backup_dir)
    saved = store.restore()
    assert saved.step == pause_at and saved.metadata["global_batches"] == pause_at
    assert (saved.metadata["epoch"], saved.metadata["batch"]) == divmod(pause_at, 8)
    assert saved.metadata["preemption"]["total_run_calls"] == pause_at
    if pause_at >= 2:  # the handler's step samples (its first interval is left out)
        assert saved.metadata["preemption"]["estimates"]["step_s"]
    # Only the final backup remains (max_to_keep=1); the periodic one before it is gone.
    assert store.all_steps() == [pause_at]

    again = run_python(script, str(backup_dir), str(out), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["restored"] == list(divmod(pause_at, 8))
    assert got["iterations"] == got["ref_iterations"] == 24
    assert got["weights"] == got["reference"], "resumed weights differ from the uninterrupted run"


def test_grace_period_backs_up_at_the_notice_and_training_goes_on(tmp_path):
    keras = pytest.importorskip("keras")
    ak = pytest.importorskip("asyncckpt.keras")
    from asyncckpt.preemption import TerminationConfig

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = x.sum(1, keepdims=True).astype("float32")
    data = ak.ResumableDataset(x, y, batch_size=8, shuffle_seed=2)  # 8 batches per epoch
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    exits = []
    options = ak.BackupOptions(preemption=ak.PreemptionOptions(termination_config=(
        TerminationConfig(platform="other", grace_period=3600.0, exit_fn=lambda: exits.append(1))
    )))
    backup = ak.BackupAndRestore(tmp_path / "b", save_freq=False, double_checkpoint=True,
                                 delete_checkpoint=False, data=data, options=options)

    class Term(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if backup._global == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=[backup, Term()])
    handler = backup.preemption_handler
    assert handler.noticed and not handler.preempted and not exits
    # One save at the notice (not final: an hour of grace is left), at the next boundary.
    assert [(s.run, s.final) for s in handler.saves] == [(5, False)]
    assert signal.getsignal(signal.SIGTERM) is previous
    # The notice's backup is kept beside the one taken when fit ended.
    store = ArrayStore(tmp_path / "b")
    assert store.all_steps() == [5, 16]
    notice = store.restore(5).metadata
    assert (notice["epoch"], notice["batch"]) == (0, 5)
    assert int(np.asarray(model.optimizer.iterations.value)) == 16

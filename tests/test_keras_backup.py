"""BackupAndRestore under SIGKILL, on both Keras backends, in real processes.

A worker trains a small model with Dropout and BatchNormalization on shuffled
data (``ResumableDataset``), with ``EarlyStopping(restore_best_weights=True)``
and ``asyncckpt.keras.ModelCheckpoint(save_best_only=True)`` beside the
backup. The parent kills it with SIGKILL when it reports reaching a random
batch, restarts it until it finishes, and compares the final weights with an
uninterrupted run: they must be bit-identical, and so must the callbacks'
state. Every restore must load exactly the state that was saved for its
position (the worker prints a hash of the state it saves and of what it
restores). Seeds are printed; set ``ASYNCCKPT_KILL_SEED`` to replay a run and
``ASYNCCKPT_KILL_TRIALS`` for more trials.
"""

from __future__ import annotations

import json
import os
import random
import signal

import pytest

from tests.helpers import run_python, start_python, subprocess_env, write_script

WORKER = r'''
import hashlib, json, os, sys
import numpy as np
import keras
import asyncckpt.keras as ak
from asyncckpt._engine.destinations import RenamedDirectory
from asyncckpt.jobrunner.store import ArrayStore, _ArraysJob
from asyncckpt.keras import _state

backup_dir, out_path = sys.argv[1], sys.argv[2]
crash = os.environ.get("CRASH_AT")  # "<phase>:<n>": die in the n-th save's <phase>

keras.utils.set_random_seed(7)
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 12)).astype("float32")
y = (x[:, :3].sum(1, keepdims=True) + 0.1 * rng.normal(size=(128, 1))).astype("float32")
model = keras.Sequential([
    keras.layers.Dense(32, activation="relu"),
    keras.layers.BatchNormalization(),
    keras.layers.Dropout(0.25),
    keras.layers.Dense(1),
])
model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse", metrics=["mae"])
data = ak.ResumableDataset(x, y, batch_size=16, shuffle_seed=11)


def state_hash(model):
    arrays, _ = _state.snapshot_sources(model)
    h = hashlib.sha256()
    for k in sorted(arrays):
        if not k.startswith("metrics/"):
            h.update(k.encode())
            h.update(np.ascontiguousarray(np.asarray(arrays[k])).tobytes())
    return h.hexdigest()[:16]


def die(phase):
    if crash and crash == f"{phase}:{FaultyJob.count}":
        # One write, on a line of its own: the training thread may be
        # half-way through printing its own line when this thread dies.
        sys.stdout.write(f"\nCRASH {phase}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), 9)


class FaultyJob(_ArraysJob):
    count = 0

    def write(self):
        FaultyJob.count += 1
        die("before_write")
        super().write()
        die("after_write")

    def _write_index(self, index):
        die("after_data")
        super()._write_index(index)


class DyingRename(RenamedDirectory):
    """The real publish, with a kill just before it (the manifest written) and after it."""

    def publish(self, workdir, names):
        die("after_manifest")
        super().publish(workdir, names)
        die("after_publish")


class FaultyStore(ArrayStore):
    job_class = FaultyJob

    def transaction(self, step):
        txn = super().transaction(step)
        txn.destination = DyingRename(txn.destination.path, fsync=self.options.fsync)
        return txn


class Backup(ak.BackupAndRestore):
    def _make_store(self):
        return FaultyStore(self.backup_dir, max_to_keep=1, name="test-backup")

    def _save(self, epoch, batch, **kw):
        if self._last_saved != self._global:
            # One write per line, so the writer thread's CRASH line never splits it.
            sys.stdout.write(f"S {self._global} {epoch} {batch} {state_hash(self._model)}\n")
            sys.stdout.flush()
        super()._save(epoch, batch, **kw)

    def _apply_restored(self, **kw):
        super()._apply_restored(**kw)
        m = self._restored.metadata
        print("R", m["global_batches"], m["epoch"], m["batch"], state_hash(self._model), flush=True)


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        sys.stdout.write("B\n")
        sys.stdout.flush()


backup = Backup(backup_dir, save_freq=3, data=data)
early = keras.callbacks.EarlyStopping(monitor="loss", patience=50, min_delta=0.02,
                                      restore_best_weights=True)
best = ak.ModelCheckpoint(os.path.join(backup_dir + "-files", "best.weights.h5"),
                          save_weights_only=True, monitor="loss", save_best_only=True)
model.fit(data, epochs=3, callbacks=[backup, early, best, Report()], verbose=0, shuffle=False)
weights = model.get_weights()
digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
with open(out_path, "w") as f:
    json.dump({
        "weights": digest,
        "iterations": int(np.asarray(model.optimizer.iterations.value)),
        "early": [early.wait, float(early.best), early.best_epoch, early.stopped_epoch],
        "best": float(best.best),
        "backup_left": os.path.exists(backup_dir),
    }, f)
print("DONE", flush=True)
'''

BACKENDS = ["jax", "tensorflow"]


def _env(backend: str, **extra: str) -> dict[str, str]:
    return subprocess_env(KERAS_BACKEND=backend, **extra)


def _parse(lines: list[str], saved: dict[int, str], restored: list[tuple[int, str]]) -> None:
    for line in lines:
        parts = line.split()
        if parts and parts[0] == "S":
            saved[int(parts[1])] = parts[4]
        elif parts and parts[0] == "R":
            restored.append((int(parts[1]), parts[4]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final state of an uninterrupted run, per backend (computed once)."""
    cache: dict[str, dict] = {}

    def get(backend: str) -> dict:
        if backend not in cache:
            d = tmp_path_factory.mktemp(f"ref-{backend}")
            script = write_script(d, "worker.py", WORKER)
            out = d / "ref.json"
            proc = run_python(script, str(d / "backup"), str(out), env=_env(backend))
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[backend] = json.loads(out.read_text())
        return cache[backend]

    return get


def _run_killed(script, backup_dir, out, backend, kill_at: int | None, env_extra=None):
    """Runs the worker once; SIGKILLs it after ``kill_at`` batches. Returns (rc, lines)."""
    proc = start_python(script, str(backup_dir), str(out), env=_env(backend, **(env_extra or {})))
    lines, batches = [], 0
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("B"):
            batches += 1
            if kill_at is not None and batches >= kill_at:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=240)
    err = proc.stderr.read() if proc.stderr else ""
    proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker failed ({proc.returncode}):\n{err[-3000:]}")
    return proc.returncode, lines


def _check_final(out, ref: dict) -> None:
    got = json.loads(out.read_text())
    assert got["weights"] == ref["weights"], "final weights differ from the uninterrupted run"
    assert got["iterations"] == ref["iterations"]
    assert got["early"] == ref["early"], "EarlyStopping state was not carried over"
    assert got["best"] == ref["best"], "ModelCheckpoint.best was not carried over"
    assert not got["backup_left"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_at_random_batches_resumes_bit_identical(tmp_path, backend, reference):
    script = write_script(tmp_path, "worker.py", WORKER)
    ref = reference(backend)
    assert ref["iterations"] == 24
    seed = int(os.environ.get("ASYNCCKPT_KILL_SEED", random.randrange(1 << 30)))
    trials = int(os.environ.get("ASYNCCKPT_KILL_TRIALS", "1"))
    kills_per_trial = int(os.environ.get("ASYNCCKPT_KILLS_PER_TRIAL", "1"))
    print(f"ASYNCCKPT_KILL_SEED={seed} backend={backend}")
    rng = random.Random(seed)
    for trial in range(trials):
        backup_dir = tmp_path / f"t{trial}-backup"
        out = tmp_path / f"t{trial}.json"
        saved: dict[int, str] = {}
        restored: list[tuple[int, str]] = []
        kills = [rng.randrange(1, 23) for _ in range(kills_per_trial)]
        print(f"trial {trial}: kill after {kills} batches of each run")
        for kill_at in [*kills, None]:
            rc, lines = _run_killed(script, backup_dir, out, backend, kill_at)
            _parse(lines, saved, restored)
            if rc == 0:
                break
        _check_final(out, ref)
        for global_batches, digest in restored:
            assert saved[global_batches] == digest, f"backup {global_batches} restored other state"


def test_kill_between_writes_never_pairs_weights_with_another_position(tmp_path, reference):
    """Dies inside each stage of a backup's write/commit; every restart is consistent."""
    backend = "jax"
    script = write_script(tmp_path, "worker.py", WORKER)
    ref = reference(backend)
    backup_dir, out = tmp_path / "backup", tmp_path / "out.json"
    saved: dict[int, str] = {}
    restored: list[tuple[int, str]] = []
    phases = ["after_data", "after_write", "after_manifest", "after_publish"]
    for phase in phases:
        rc, lines = _run_killed(script, backup_dir, out, backend, None,
                                {"CRASH_AT": f"{phase}:2"})
        assert rc == -signal.SIGKILL and f"CRASH {phase}" in lines, (phase, lines[-5:])
        _parse(lines, saved, restored)
        # Nothing half-written is ever listed as a backup.
        steps = sorted(int(n) for n in os.listdir(backup_dir) if n.isdigit())
        for s in steps:
            assert {"arrays.bin", "index.json", "asyncckpt.manifest.json"} <= set(
                os.listdir(backup_dir / str(s)))
    rc, lines = _run_killed(script, backup_dir, out, backend, None)
    assert rc == 0
    _parse(lines, saved, restored)
    assert len(restored) == len(phases)
    for global_batches, digest in restored:
        assert saved[global_batches] == digest
    _check_final(out, ref)

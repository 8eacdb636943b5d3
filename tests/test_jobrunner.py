"""JobRunner and ArrayStore: resume, partial loads, stats, uploads (real files, real threads)."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from asyncckpt._engine import fastcrc
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from asyncckpt.jobrunner import JobOptions, JobRunner, UploadError
from asyncckpt.jobrunner.store import ArrayStore


class Job:
    """A deterministic 'training' job on NumPy state: epoch n adds n to every weight."""

    def __init__(self, stop_at: int | None = None):
        self.state: dict[str, np.ndarray] = {}
        self.epochs_run: list[int] = []
        self.init_calls = 0
        self.loaded: list[str] = []
        self.stop_at = stop_at

    def init(self):
        self.init_calls += 1
        self.state = {
            "model/dense/kernel": np.zeros((64, 32), np.float32),
            "model/dense/bias": np.zeros((32,), np.float32),
            "optimizer/momentum": np.zeros((64, 32), np.float32),
            "optimizer/step": np.zeros((), np.int64),
        }

    def epoch(self, n):
        self.epochs_run.append(n)
        for k, v in self.state.items():
            self.state[k] = v + n
        return self.stop_at is not None and n >= self.stop_at

    def get(self):
        return dict(self.state)

    def load(self, arrays):
        self.loaded = sorted(arrays)
        for k, v in arrays.items():
            self.state[k] = v.copy()

    def runner(self, directory, upload=None, **opts):
        return JobRunner(directory, init=self.init, epoch=self.epoch, state=self.get,
                         load=self.load, upload=upload, options=JobOptions(**opts))


def _expected_after(epochs: int) -> float:
    return float(sum(range(1, epochs + 1)))


def test_runs_init_then_epochs_and_saves_epoch_zero(ckpt_dir):
    job = Job()
    last = job.runner(ckpt_dir, num_epochs=3, save_initial=True).run()
    assert last == 3 and job.epochs_run == [1, 2, 3] and job.init_calls == 1
    store = ArrayStore(ckpt_dir)
    assert store.all_steps() == [0, 1, 2, 3]
    zero = store.restore(0)
    assert float(zero.arrays["model/dense/kernel"].max()) == 0.0
    assert zero.metadata == {"epoch": 0}


def test_resumes_from_newest_and_from_a_given_epoch(ckpt_dir):
    Job(stop_at=2).runner(ckpt_dir, num_epochs=5).run()  # stops after epoch 2

    job = Job()
    assert job.runner(ckpt_dir, num_epochs=4).run() == 4
    assert job.epochs_run == [3, 4]  # newest was 2
    assert float(job.state["model/dense/bias"][0]) == _expected_after(4)

    job = Job()
    runner = job.runner(ckpt_dir, num_epochs=3, resume_from_epoch=1)
    assert runner.run() == 3
    assert job.epochs_run == [2, 3]
    assert runner.restored is not None and runner.restored.step == 1
    assert float(job.state["model/dense/kernel"][0, 0]) == _expected_after(3)
    # The old timeline's epoch 4 is gone; 2 and 3 were rewritten from epoch 1.
    assert ArrayStore(ckpt_dir).all_steps() == [1, 2, 3]

    with pytest.raises(CheckpointNotFoundError):
        Job().runner(ckpt_dir, num_epochs=3, resume_from_epoch=9).run()


@pytest.mark.parametrize("algorithm", ["crc32c", "crc32"])
def test_resume_skips_a_corrupt_newest_checkpoint(ckpt_dir, monkeypatch, algorithm):
    """Caught under either checksum (zlib's CRC32: saved as without a native CRC32C)."""
    if algorithm == "crc32c" and not fastcrc.available():
        pytest.skip("no native CRC32C (google_crc32c's libcrc32c) installed")
    if algorithm == "crc32":
        monkeypatch.setattr(fastcrc, "available", lambda: False)
    Job().runner(ckpt_dir, num_epochs=3).run()
    monkeypatch.undo()
    entries = ArrayStore(ckpt_dir).read_index(3)["arrays"].values()
    assert all(algorithm in e for e in entries)
    data = ckpt_dir / "3" / "arrays.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    job = Job()
    job.runner(ckpt_dir, num_epochs=3).run()
    assert job.epochs_run == [3]  # resumed from 2, the newest that verifies


def test_partial_load_reads_only_selected_bytes(ckpt_dir):
    job = Job()
    job.runner(ckpt_dir, num_epochs=2).run()
    store = ArrayStore(ckpt_dir)
    index = store.read_index(2)["arrays"]
    # Damage the optimizer's bytes on disk: a load that skips them must not notice.
    entry = index["optimizer/momentum"]
    data = ckpt_dir / "2" / "arrays.bin"
    raw = bytearray(data.read_bytes())
    raw[entry["offset"] + 10] ^= 0xFF
    data.write_bytes(bytes(raw))

    fresh = Job()
    runner = fresh.runner(ckpt_dir, num_epochs=2, load_include=("model/*",),
                          load_exclude=("*/bias",))
    runner.run()
    assert fresh.loaded == ["model/dense/kernel"]
    assert runner.restored.bytes_read == index["model/dense/kernel"]["nbytes"] == 64 * 32 * 4
    assert float(fresh.state["model/dense/kernel"][0, 0]) == _expected_after(2)
    assert float(fresh.state["model/dense/bias"][0]) == 0.0  # not loaded: init's value

    parts = runner.load_parts(2, include=("optimizer/step",))
    assert list(parts.arrays) == ["optimizer/step"] and parts.bytes_read == 8
    with pytest.raises(CorruptCheckpointError, match="optimizer/momentum"):
        store.restore(2)


def test_stats_file_and_table(ckpt_dir, tmp_path):
    stats_path = tmp_path / "stats.jsonl"
    job = Job()
    runner = job.runner(ckpt_dir, num_epochs=3, save_initial=True, stats_path=str(stats_path))
    runner.run()
    rows = [json.loads(line) for line in stats_path.read_text().splitlines()]
    saves = sorted((r for r in rows if r["event"] == "save"), key=lambda r: r["epoch"])
    assert [r["epoch"] for r in saves] == [0, 1, 2, 3]
    state_bytes = sum(v.nbytes for v in job.state.values())
    for r in saves:
        assert r["nbytes"] == state_bytes
        assert 0 < r["blocking_s"] <= r["durable_s"]
        assert r["mb_per_s"] > 0
    table = runner.table()
    assert table.splitlines()[0].split()[:3] == ["epoch", "epoch_s", "blocking_ms"]
    assert len(table.splitlines()) == 5

    resumed = Job().runner(ckpt_dir, num_epochs=4, stats_path=str(stats_path))
    resumed.run()
    rows = [json.loads(line) for line in stats_path.read_text().splitlines()]
    restore = [r for r in rows if r["event"] == "restore"]
    assert len(restore) == 1 and restore[0]["epoch"] == 3
    assert restore[0]["bytes"] == state_bytes and restore[0]["restore_s"] > 0
    assert "restored epoch 3" in resumed.table()


class FlakyUpload:
    """Fails the first ``failures`` calls per epoch, then copies the checkpoint."""

    def __init__(self, target, failures: int):
        self.target = target
        self.failures = failures
        self.calls: dict[int, int] = {}
        self.lock = threading.Lock()

    def __call__(self, epoch, path):
        with self.lock:
            self.calls[epoch] = self.calls.get(epoch, 0) + 1
            n = self.calls[epoch]
        if n <= self.failures:
            raise ConnectionError(f"remote refused epoch {epoch} (try {n})")
        assert os.path.isfile(os.path.join(path, "arrays.bin"))  # committed, not deleted
        os.makedirs(self.target, exist_ok=True)
        with open(os.path.join(self.target, f"{epoch}.done"), "w") as f:
            f.write(path)


def test_upload_retries_then_succeeds(ckpt_dir, tmp_path):
    upload = FlakyUpload(tmp_path / "remote", failures=2)
    stats_path = tmp_path / "stats.jsonl"
    Job().runner(ckpt_dir, upload=upload, num_epochs=3, max_to_keep=1,
                 upload_attempts=3, upload_backoff_s=0.0, stats_path=str(stats_path)).run()
    assert upload.calls == {1: 3, 2: 3, 3: 3}
    assert sorted(os.listdir(tmp_path / "remote")) == ["1.done", "2.done", "3.done"]
    assert ArrayStore(ckpt_dir).all_steps() == [3]  # retention ran after the uploads
    rows = [json.loads(line) for line in stats_path.read_text().splitlines()]
    ups = [r for r in rows if r["event"] == "upload"]
    assert [(r["epoch"], r["attempts"], r["ok"]) for r in ups] == [(1, 3, True), (2, 3, True),
                                                                    (3, 3, True)]


def test_upload_failure_surfaces(ckpt_dir, tmp_path):
    upload = FlakyUpload(tmp_path / "remote", failures=10)
    job = Job()
    runner = job.runner(ckpt_dir, upload=upload, num_epochs=4, upload_attempts=2,
                        upload_backoff_s=0.0)
    with pytest.raises(UploadError, match="upload of epoch 1") as info:
        runner.run()
    assert isinstance(info.value.__cause__, ConnectionError)
    assert upload.calls[1] == 2
    # The checkpoints themselves are committed; only the upload failed.
    assert 1 in ArrayStore(ckpt_dir).all_steps()


def test_jax_example(ckpt_dir):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    params = {}

    def init():
        params.clear()
        k1, _ = jax.random.split(jax.random.key(0))
        params.update(w=jax.random.normal(k1, (16, 4)), b=jnp.zeros(4))

    def epoch(n):
        x = jax.random.normal(jax.random.key(n), (32, 16))
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        params.update(jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))

    def state():
        return dict(params)

    def load(arrays):
        params.update({k: jnp.asarray(v) for k, v in arrays.items()})

    opts = {"num_epochs": 4}
    JobRunner(ckpt_dir / "full", init=init, epoch=epoch, state=state, load=load,
              options=JobOptions(**opts)).run()
    full = {k: np.asarray(v) for k, v in params.items()}
    JobRunner(ckpt_dir / "part", init=init, epoch=epoch, state=state, load=load,
              options=JobOptions(num_epochs=2)).run()
    JobRunner(ckpt_dir / "part", init=init, epoch=epoch, state=state, load=load,
              options=JobOptions(**opts)).run()
    for k in full:
        np.testing.assert_array_equal(np.asarray(params[k]), full[k])


def test_tensorflow_example(ckpt_dir):
    tf = pytest.importorskip("tensorflow")
    holder = {}

    def init():
        tf.random.set_seed(0)
        holder["w"] = tf.Variable(tf.random.normal((8, 2)), name="w")

    def epoch(n):
        holder["w"].assign_add(tf.fill((8, 2), float(n)))

    runner = JobRunner(ckpt_dir, init=init, epoch=epoch,
                       state=lambda: {"w": holder["w"]},
                       load=lambda arrays: holder["w"].assign(arrays["w"]),
                       options=JobOptions(num_epochs=2))
    runner.run()
    expected = holder["w"].numpy()
    resumed = JobRunner(ckpt_dir, init=init, epoch=epoch,
                        state=lambda: {"w": holder["w"]},
                        load=lambda arrays: holder["w"].assign(arrays["w"]),
                        options=JobOptions(num_epochs=3))
    resumed.run()
    np.testing.assert_array_equal(holder["w"].numpy(), expected + 3.0)


def test_store_round_trips_dtypes_and_shapes(ckpt_dir):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    arrays = {
        "bf16": np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16),
        "scalar": np.array(7, np.int64),
        "bool": np.array([True, False, True]),
        "empty": np.zeros((0, 5), np.float16),
        "strided": np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2],
    }
    with ArrayStore(ckpt_dir, max_to_keep=1) as store:
        store.save(1, arrays, {"note": "x"})
        store.save(2, arrays)
    store = ArrayStore(ckpt_dir)
    assert store.all_steps() == [2]  # retention kept the newest
    got = store.restore()
    assert got.step == 2 and got.metadata == {}
    for k, v in arrays.items():
        assert got.arrays[k].dtype == v.dtype and got.arrays[k].shape == v.shape
        np.testing.assert_array_equal(got.arrays[k], v)
    with pytest.raises(ValueError, match="already exists"):
        ArrayStore(ckpt_dir).save(2, arrays)

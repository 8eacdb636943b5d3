"""Durability of the TensorFlow path: crashes, I/O errors, corruption, locking, the CLI."""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt import (  # noqa: E402
    CorruptCheckpointError,
    DirectoryLockedError,
    catalog,
)
from asyncckpt.engine import files as files_lib  # noqa: E402
from asyncckpt.tf import _job  # noqa: E402
from tests.helpers import start_python, subprocess_env, write_script  # noqa: E402

N = 1 << 20  # floats per variable: 4 MiB, so kills land inside writes too

SAVER = """
import sys, time
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at

directory, start = sys.argv[1], int(sys.argv[2])
a = tf.Variable(np.zeros({n}, np.float32))
b = tf.Variable(np.zeros({n}, np.float32))
step = tf.Variable(0, dtype=tf.int64)
mgr = at.CheckpointManager(tf.train.Checkpoint(a=a, b=b, step=step), directory, max_to_keep=3)
base = np.arange({n}, dtype=np.float32)
print("ready", flush=True)
s = start
while True:
    a.assign(base + s)
    b.assign(base * 2 - s)
    step.assign(s)
    mgr.save(checkpoint_number=s)
    s += 1
"""


def _expected(s: int) -> tuple[np.ndarray, np.ndarray]:
    base = np.arange(N, dtype=np.float32)
    return base + s, base * 2 - s


def _restore_and_check(path: str) -> int:
    a = tf.Variable(np.zeros(N, np.float32))
    b = tf.Variable(np.zeros(N, np.float32))
    step = tf.Variable(-1, dtype=tf.int64)
    tf.train.Checkpoint(a=a, b=b, step=step).restore(path).assert_consumed()
    s = int(step.numpy())
    ea, eb = _expected(s)
    np.testing.assert_array_equal(a.numpy(), ea)
    np.testing.assert_array_equal(b.numpy(), eb)
    return s


def test_sigkill_at_random_moments_never_leaves_a_partial_checkpoint(tmp_path):
    trials = int(os.environ.get("ASYNCCKPT_TF_CRASH_TRIALS", "8"))
    seed = int(os.environ.get("ASYNCCKPT_CRASH_SEED", str(time.time_ns() % 100000)))
    rng = random.Random(seed)
    print(f"crash test seed={seed} trials={trials}")
    script = write_script(tmp_path, "saver.py", SAVER.format(n=N))
    directory = tmp_path / "ckpts"
    start = 0
    newest_seen = -1
    for trial in range(trials):
        delay = rng.uniform(0.05, 1.5)
        proc = start_python(script, str(directory), str(start))
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        context = f"seed={seed} trial={trial} delay={delay:.3f}s"
        temps = [n for n in os.listdir(directory) if n.startswith(".asyncckpt-tmp-")]
        print(f"{context}: killed with {len(temps)} save(s) in flight")
        listed = catalog.list_checkpoints(str(directory))
        for info in listed:  # everything listed is complete
            catalog.verify(info)
        latest = tf.train.latest_checkpoint(str(directory))
        if latest is None:
            assert not listed, context
            continue
        assert os.path.basename(latest) in {c.name for c in listed}, context
        s = _restore_and_check(latest)
        assert s >= newest_seen, context
        newest_seen = s
        start = s + 1  # the next run resumes after the newest durable step
    assert newest_seen >= 0, f"no checkpoint survived any trial (seed={seed})"
    # A normal run afterwards takes over the dead writer's lock and leftovers.
    a, b = tf.Variable(_expected(start)[0]), tf.Variable(_expected(start)[1])
    step = tf.Variable(start, dtype=tf.int64)
    with at.CheckpointManager(
        tf.train.Checkpoint(a=a, b=b, step=step), str(directory), max_to_keep=3
    ) as mgr:
        path = mgr.save(checkpoint_number=start)
    assert _restore_and_check(path) == start
    leftovers = [n for n in os.listdir(directory) if n.startswith(".asyncckpt-tmp-")]
    assert not leftovers
    for name in os.listdir(directory):
        if ".data-" in name or name.endswith(".asyncckpt-manifest.json"):
            prefix = name.split(".", 1)[0]
            assert os.path.exists(directory / f"{prefix}.index"), f"orphan {name}"


class _FailingDurableWriter(files_lib.DurableWriter):
    """The real writer, except that reading back the data file hits an I/O error."""

    def add_existing(self, name):
        if ".data-" in name:
            raise OSError(errno.EIO, "Input/output error", name)
        return super().add_existing(name)


def test_io_error_during_commit_keeps_earlier_checkpoints(ckpt_dir, monkeypatch):
    v = tf.Variable(np.arange(10, dtype=np.float32))
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=1)
    good = mgr.save()
    mgr.sync()
    monkeypatch.setattr(_job, "DurableWriter", _FailingDurableWriter)
    v.assign(tf.zeros(10))
    mgr.save()
    with pytest.raises(OSError) as err:
        mgr.sync()
    assert err.value.errno == errno.EIO
    monkeypatch.undo()
    assert mgr.checkpoints == [good]
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == good
    assert sorted(os.listdir(ckpt_dir)) == sorted(
        ["checkpoint", ".asyncckpt.lock", ".asyncckpt-owned.json", "ckpt-1.index",
         "ckpt-1.data-00000-of-00001", "ckpt-1.asyncckpt-manifest.json"]
    )
    fresh = tf.Variable(tf.zeros(10))
    at.Checkpoint(v=fresh).restore(good)
    np.testing.assert_array_equal(fresh.numpy(), np.arange(10, dtype=np.float32))
    mgr.close()


def _three_checkpoints(ckpt_dir):
    v = tf.Variable(np.zeros(1000, np.float32))
    with at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=5) as mgr:
        paths = []
        for i in range(3):
            v.assign(np.full(1000, float(i + 1), np.float32))
            paths.append(mgr.save())
    return paths


def _flip_byte(path: str, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_is_detected_named_and_skipped(ckpt_dir, caplog, damage):
    paths = _three_checkpoints(ckpt_dir)
    data = paths[-1] + ".data-00000-of-00001"
    if damage == "flip":
        _flip_byte(data)
    else:
        os.truncate(data, os.path.getsize(data) - 7)

    with pytest.raises(CorruptCheckpointError) as err:
        at.Checkpoint(v=tf.Variable(np.zeros(1000, np.float32))).restore(paths[-1])
    assert err.value.file == os.path.abspath(data) or err.value.file == data
    assert "ckpt-3.data-00000-of-00001" in str(err.value)

    v = tf.Variable(np.zeros(1000, np.float32))
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=5)
    with caplog.at_level(logging.WARNING):
        assert mgr.restore_or_initialize() == paths[1]
    assert "ckpt-3" in caplog.text and "ckpt-3.data-00000-of-00001" in caplog.text
    np.testing.assert_array_equal(v.numpy(), np.full(1000, 2.0, np.float32))
    mgr.close()

    cli = [sys.executable, "-m", "asyncckpt", "verify", str(ckpt_dir)]
    out = subprocess.run(cli, capture_output=True, text=True, env=subprocess_env())
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  ckpt-3" in out.stdout and "OK    ckpt-2" in out.stdout
    one = subprocess.run([*cli, "2"], capture_output=True, text=True, env=subprocess_env())
    assert one.returncode == 0, one.stdout


def test_damaged_manifest_is_detected(ckpt_dir):
    paths = _three_checkpoints(ckpt_dir)
    manifest = paths[-1] + ".asyncckpt-manifest.json"
    with open(manifest) as f:
        text = f.read().replace('"step": 3', '"step": 4')
    with open(manifest, "w") as f:
        f.write(text)
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        at.verify_checkpoint(paths[-1])


def test_cli_list_inspect_verify_on_good_checkpoints(ckpt_dir):
    _three_checkpoints(ckpt_dir)
    env = subprocess_env()

    def run(*args):
        return subprocess.run([sys.executable, "-m", "asyncckpt", *args], capture_output=True,
                              text=True, env=env, timeout=120)

    listed = run("list", str(ckpt_dir))
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == [
        "ckpt-1", "ckpt-2", "ckpt-3"]
    verified = run("verify", str(ckpt_dir))
    assert verified.returncode == 0 and "3/3 checkpoint(s) verified" in verified.stdout
    inspected = run("inspect", str(ckpt_dir), "2")
    assert inspected.returncode == 0, inspected.stderr
    assert "v/.ATTRIBUTES/VARIABLE_VALUE" in inspected.stdout and "[1000]" in inspected.stdout
    assert "4000" in inspected.stdout
    missing = run("verify", str(ckpt_dir), "9")
    assert missing.returncode == 2 and "no checkpoint '9'" in missing.stderr


LOCK_HOLDER = """
import sys, time
import tensorflow as tf
import asyncckpt.tf as at
mgr = at.CheckpointManager(tf.train.Checkpoint(v=tf.Variable([1.0])), sys.argv[1], max_to_keep=2)
mgr.save()
mgr.sync()
print("holding", flush=True)
time.sleep(600)
"""


def test_second_writer_is_refused_and_dead_writers_lock_is_taken_over(ckpt_dir, tmp_path, caplog):
    script = write_script(tmp_path, "holder.py", LOCK_HOLDER)
    proc = start_python(script, str(ckpt_dir))
    try:
        assert proc.stdout.readline().strip() == "holding", proc.stderr.read()
        v = tf.Variable([2.0])
        mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
        with pytest.raises(DirectoryLockedError) as err:
            mgr.save()
        assert f"pid {proc.pid}" in str(err.value) and "host" in str(err.value)
        # Restoring needs no lock.
        assert mgr.restore_or_initialize() == str(ckpt_dir / "ckpt-1")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with caplog.at_level(logging.WARNING):
        path = mgr.save()  # the holder is dead: its lock is taken over
    assert "Taking over" in caplog.text and str(proc.pid) in caplog.text
    mgr.sync()
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == path
    # A second manager in the same process shares the directory (and its view).
    other = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    second = other.save()
    assert mgr.checkpoints == other.checkpoints and mgr.latest_checkpoint == second
    mgr.close()
    other.save()
    other.close()

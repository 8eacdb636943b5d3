"""Durability of the TensorFlow path: crashes, I/O errors, corruption, locking, the CLI."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt import CorruptCheckpointError  # noqa: E402
from asyncckpt._engine import files as files_lib  # noqa: E402
from asyncckpt._engine import transaction as transaction_lib  # noqa: E402
from tests.helpers import (  # noqa: E402
    LineWatcher,
    check_crash_campaign,
    flip_byte,
    run_crash_campaign,
    start_python,
    subprocess_env,
    test_seed,
    write_script,
)
from tests.tfrestore import restore_both  # noqa: E402

CRASH_KILLS = int(os.environ.get("ASYNCCKPT_CRASH_KILLS", "16"))


def test_sigkill_mostly_during_writes_never_loses_or_lists_a_partial_checkpoint(tmp_path):
    """A short run of benchmarks/crash_campaign.py: SIGKILLs and a full disk, TensorFlow."""
    seed = test_seed("TF crash campaign")
    stats = run_crash_campaign("tf", tmp_path, kills=CRASH_KILLS, io_errors=3, seed=seed)
    check_crash_campaign(stats, CRASH_KILLS, 3)


class _FailingDurableWriter(files_lib.DurableWriter):
    """The real writer, except that taking in the data file (its size check or
    read back) hits an I/O error."""

    def add_existing(self, name, **kwargs):
        if ".data-" in name:
            raise OSError(errno.EIO, "Input/output error", name)
        return super().add_existing(name, **kwargs)


def test_io_error_during_commit_keeps_earlier_checkpoints(ckpt_dir, monkeypatch):
    v = tf.Variable(np.arange(10, dtype=np.float32))
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=1)
    good = mgr.save()
    mgr.sync()
    monkeypatch.setattr(transaction_lib, "DurableWriter", _FailingDurableWriter)
    v.assign(tf.zeros(10))
    mgr.save()
    with pytest.raises(OSError) as err:
        mgr.sync()
    assert err.value.errno == errno.EIO
    monkeypatch.undo()
    assert mgr.checkpoints == [good]
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == good
    assert sorted(os.listdir(ckpt_dir)) == sorted(
        ["checkpoint", ".asyncckpt-locks", ".asyncckpt-owned.json", "ckpt-1.index",
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


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_is_detected_named_and_skipped(ckpt_dir, caplog, damage):
    paths = _three_checkpoints(ckpt_dir)
    data = paths[-1] + ".data-00000-of-00001"
    if damage == "flip":
        flip_byte(data)
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
    restore_both(paths[1], lambda: {"v": tf.Variable(np.zeros(1000, np.float32))},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(),
                                                         np.full(1000, 2.0, np.float32)))

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


def _restores(path: str, value: list) -> None:
    """``path`` holds ``v == value``: restored by TensorFlow's reader and by asyncckpt's."""
    restore_both(path, lambda: {"v": tf.Variable(np.zeros(len(value), np.float32))},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), value),
                 verdict="expect_partial")


LOCK_HOLDER = """
import sys, threading
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.tf import _bundlewrite

gate = threading.Event()
real = _bundlewrite.write_bundle


def held_write(*args, **kwargs):  # the real bundle writer, held until the test says so
    print("writing", flush=True)
    gate.wait(120)
    return real(*args, **kwargs)


_bundlewrite.write_bundle = held_write
mgr = at.CheckpointManager(tf.train.Checkpoint(v=tf.Variable([1.0])), sys.argv[1],
                           max_to_keep=2)
mgr.save(checkpoint_number=5)  # ckpt-5: written (held) while the test saves
sys.stdin.readline()
gate.set()
mgr.sync()
print("saved", mgr.checkpoints, flush=True)
mgr.close()
"""


def test_two_processes_write_one_directory_and_only_the_same_checkpoint_waits(
        ckpt_dir, tmp_path, caplog):
    """As TensorFlow's managers (Model Garden's trainer and evaluator both export into
    one directory): other checkpoints go on; a save of the checkpoint another process is
    writing waits for it, then replaces it."""
    script = write_script(tmp_path, "holder.py", LOCK_HOLDER)
    proc = start_python(script, str(ckpt_dir), stdin=True)
    try:
        LineWatcher(proc.stdout).wait_for("writing")
        v = tf.Variable([2.0])
        mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
        first = mgr.save(checkpoint_number=1)  # another checkpoint: no DirectoryLockedError
        mgr.sync()
        same: dict = {}
        waiter = threading.Thread(
            target=lambda: same.setdefault("path", mgr.save(checkpoint_number=5)))
        waiter.start()
        waiter.join(2.0)
        assert waiter.is_alive() and not same  # waits for the other process's ckpt-5
        proc.stdin.write("\n")
        proc.stdin.flush()
        waiter.join(120)
        assert same["path"] == str(ckpt_dir / "ckpt-5")
        mgr.sync()
        assert proc.wait(120) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    assert mgr.checkpoints == [first, same["path"]]
    for path in (same["path"], first):
        _restores(path, [2.0])
    # One lock file per checkpoint kept, and the state file's and the ownership record's.
    assert set(os.listdir(ckpt_dir / ".asyncckpt-locks")) <= {
        "ckpt-1", "ckpt-5", "checkpoint", ".asyncckpt-owned.json"}
    mgr.close()


def test_a_dead_writers_checkpoint_is_taken_over_and_its_temporaries_removed(ckpt_dir,
                                                                             tmp_path):
    script = write_script(tmp_path, "holder.py", LOCK_HOLDER)
    proc = start_python(script, str(ckpt_dir), stdin=True)
    LineWatcher(proc.stdout).wait_for("writing")
    proc.send_signal(signal.SIGKILL)  # killed while it writes ckpt-5
    proc.wait(30)
    assert [n for n in os.listdir(ckpt_dir) if n.startswith(".asyncckpt-tmp")]
    v = tf.Variable([3.0])
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    path = mgr.save(checkpoint_number=5)  # its lock died with it
    mgr.sync()
    assert not [n for n in os.listdir(ckpt_dir) if n.startswith(".asyncckpt-tmp")]
    _restores(path, [3.0])
    # A second manager in the same process shares the directory (and its view).
    other = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    second = other.save()
    assert mgr.checkpoints == other.checkpoints and mgr.latest_checkpoint == second
    mgr.close()
    other.save()
    other.close()

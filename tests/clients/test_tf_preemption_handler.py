"""TensorFlow's own ``tf.distribute.experimental.PreemptionCheckpointHandler`` over asyncckpt.

User code that keeps TensorFlow's handler and only changes its manager (or
checkpoint) to asyncckpt's: real processes, real SIGTERMs. TensorFlow's
handler saves through the manager inside its preemption save context and
exits with its own exit code (42 off Borg/GCE) right after, so that save
must be durable when ``save()`` returns. Every checkpoint is then restored
with asyncckpt's reader and with TensorFlow's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from tests.helpers import LineWatcher, start_python, subprocess_env, write_script  # noqa: E402

TF_EXIT_CODE = 42  # BorgTerminationConfig's exit, TensorFlow's default off GCE
N = 1 << 14


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # TensorFlow's platform detection asks the GCE metadata server at
    # $GCE_METADATA_IP: a closed local port refuses at once (not on GCE).
    env = subprocess_env(GCE_METADATA_IP=f"127.0.0.1:{_closed_port()}")
    env.pop("TF_CONFIG", None)
    return env


class _Child:
    """A training process: waits for its lines; any failure shows what it printed."""

    def __init__(self, script, *args: str):
        self.proc = start_python(script, *args, env=_env())
        self.lines = LineWatcher(self.proc.stdout)

    def wait_for(self, match: str, timeout: float = 180) -> str:
        try:
            return self.lines.wait_for(match, timeout)
        except AssertionError as e:
            _, _, err = self.finish(timeout=0)
            raise AssertionError(f"{e}\nstderr:\n{err[-4000:]}") from None

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        """Waits for the exit (killing it after ``timeout``): exit code, stdout, stderr."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, self.lines.rest(30), self.proc.stderr.read()

    def last_step(self, out: str) -> int:
        return int([x for x in out.splitlines() if x.startswith("step ")][-1].split()[1])


def _restores(path: str, step: int) -> None:
    """Both readers restore the state the handler saved at ``step``."""
    for reader in (at.Checkpoint, tf.train.Checkpoint):
        a, s = tf.Variable(np.zeros(N, np.float32)), tf.Variable(0, dtype=tf.int64)
        reader(a=a, step=s).restore(path).expect_partial()
        assert int(s.numpy()) == step, reader
        np.testing.assert_array_equal(a.numpy(), np.full(N, float(step), np.float32))
    assert at.verify_checkpoint(path)  # asyncckpt wrote it (manifest checked)


# -- one worker: an asyncckpt manager given to TensorFlow's handler ---------------------

SINGLE = f"""
import sys, time
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at

directory, total = sys.argv[1], int(sys.argv[2])
strategy = tf.distribute.MultiWorkerMirroredStrategy()  # no TF_CONFIG: one local worker
with strategy.scope():
    a = tf.Variable(np.zeros({N}, np.float32))
    step = tf.Variable(0, dtype=tf.int64)
manager = at.CheckpointManager(tf.train.Checkpoint(a=a, step=step), directory, max_to_keep=2)
handler = tf.distribute.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, manager)
print("start", handler.total_run_calls, int(step.numpy()), flush=True)


@tf.function
def train_step():
    strategy.run(lambda: a.assign_add(tf.ones({N})))
    step.assign_add(1)


def train():
    train_step()
    time.sleep(0.02)
    print("step", int(step.numpy()), flush=True)


while handler.total_run_calls < total:
    if handler.total_run_calls % 4 == 0:
        manager.save()  # the user's own periodic saves, asynchronous
    handler.run(train)
manager.close()
print("done", handler.total_run_calls, int(step.numpy()), flush=True)
"""


def test_tensorflows_handler_saves_through_an_asyncckpt_manager_on_sigterm(tmp_path):
    script = write_script(tmp_path, "single.py", SINGLE)
    directory = tmp_path / "ckpt"
    child = _Child(script, str(directory), "100000")
    assert child.wait_for("start") == "start 0 0"
    child.wait_for("step 10")
    os.kill(child.proc.pid, signal.SIGTERM)
    rc, out, err = child.finish()
    assert rc == TF_EXIT_CODE, out[-2000:] + err[-4000:]
    step = child.last_step(out)
    latest = tf.train.latest_checkpoint(str(directory))  # the state file names it
    # Numbered by the manager's save counter, as by TensorFlow's manager: the
    # periodic saves at runs 0, 4, ..., then the handler's.
    assert latest == str(directory / f"ckpt-{step // 4 + 2}")
    _restores(latest, step)

    # A new process resumes through TensorFlow's handler, where it stopped.
    rc, out, err = _Child(script, str(directory), str(step + 3)).finish()
    assert rc == 0, out[-2000:] + err[-4000:]
    lines = out.splitlines()
    assert f"start {step} {step}" in lines and f"done {step + 3} {step + 3}" in lines


# -- two workers: asyncckpt checkpoints, managers built by TensorFlow's handler ---------

WORKER = f"""
import json, os, sys, time
index, ports, directory = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
os.environ["TF_CONFIG"] = json.dumps({{
    "cluster": {{"worker": [f"127.0.0.1:{{p}}" for p in ports]}},
    "task": {{"type": "worker", "index": index}}}})
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    a = tf.Variable(np.zeros({N}, np.float32))
    step = tf.Variable(0, dtype=tf.int64)
# The chief's manager writes `directory`; TensorFlow gives the other worker a
# manager of its own in a temporary directory, deleted after its final save.
handler = tf.distribute.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, at.Checkpoint(a=a, step=step), directory)
print("start", handler.total_run_calls, flush=True)


@tf.function
def train_step():
    def fn():
        ctx = tf.distribute.get_replica_context()
        a.assign_add(ctx.all_reduce("SUM", tf.ones({N})) / 2)  # a collective every step
    strategy.run(fn)
    step.assign_add(1)


def train():
    train_step()
    time.sleep(0.05)
    print("step", int(step.numpy()), flush=True)


while True:
    handler.run(train)
"""


def test_tensorflows_handler_with_asyncckpt_checkpoints_on_two_workers(tmp_path):
    script = write_script(tmp_path, "worker.py", WORKER)
    directory = tmp_path / "ckpt"
    ports = f"{_closed_port()},{_closed_port()}"
    children = [_Child(script, str(i), ports, str(directory)) for i in range(2)]
    try:
        for child in children:
            assert child.wait_for("start", 240) == "start 0"
        for child in children:
            child.wait_for("step 6")
        os.kill(children[1].proc.pid, signal.SIGTERM)  # the non-chief worker is preempted
    finally:
        results = [child.finish() for child in children]
    steps = []
    for child, (rc, out, err) in zip(children, results, strict=True):
        assert rc == TF_EXIT_CODE, out[-2000:] + err[-4000:]
        steps.append(child.last_step(out))
    assert steps[0] == steps[1] >= 6, steps  # both saved after the same step
    latest = tf.train.latest_checkpoint(str(directory))
    assert latest == str(directory / "ckpt-1")
    _restores(latest, steps[0])
    assert not (tmp_path / "workertemp_1").exists()  # TensorFlow deleted the worker's copy

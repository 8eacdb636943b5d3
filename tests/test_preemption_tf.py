"""Preemption with TensorFlow, in real processes: SIGTERM, restart, deadline, two workers."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

tf = pytest.importorskip("tensorflow")

from asyncckpt.preemption.config import EXIT_CODE_OTHER  # noqa: E402
from tests.helpers import (  # noqa: E402
    run_python,
    start_python,
    subprocess_env,
    test_seed,
    write_script,
)
from tests.tfrestore import contents  # noqa: E402


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    # Off GCE: the metadata host refuses connections at once.
    env = subprocess_env(GCE_METADATA_HOST=f"127.0.0.1:{_closed_port()}", **extra)
    env.pop("ASYNCCKPT_PLATFORM", None)
    env.pop("TF_CONFIG", None)
    return env


def _wait_line(proc, prefix: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    raise AssertionError(f"no line {prefix!r}: {proc.stderr.read()[-4000:]}")


def _json_line(out: str, prefix: str):
    for line in out.splitlines():
        if line.startswith(prefix + " "):
            return json.loads(line[len(prefix) + 1:])
    raise AssertionError(f"no {prefix!r} line in:\n{out[-3000:]}")


# -- one worker, a real SIGTERM, a restart ----------------------------------------

SINGLE = """
import json, signal, sys, time
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.preemption import PreemptionCheckpointHandler

directory, total, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def previous(signum, frame):  # a handler installed before asyncckpt's
    with open(marker, "a") as f:
        f.write("chained\\n")


signal.signal(signal.SIGTERM, previous)
N = 1 << 16
base = np.arange(N, dtype=np.float32)
a = tf.Variable(base)
step = tf.Variable(0, dtype=tf.int64)
mgr = at.CheckpointManager(tf.train.Checkpoint(a=a, step=step), directory, max_to_keep=2)
handler = PreemptionCheckpointHandler(mgr)
r = handler.total_run_calls
print("start", r, int(step.numpy()), bool(np.array_equal(a.numpy(), base + r)), flush=True)
boundaries = []


def train():
    boundaries.append((time.time(), handler.total_run_calls))
    s = handler.total_run_calls + 1
    a.assign(base + s)
    step.assign(s)
    time.sleep(0.03)
    print("step", s, flush=True)


try:
    with handler:
        while handler.total_run_calls < total:
            handler.run(train)
    print("done", handler.total_run_calls, flush=True)
finally:
    saves = [dict(s.__dict__) for s in handler.saves]
    for s in saves:
        s["run_at_notice"] = max(r for t, r in boundaries if t <= s["notice_time"])
    print("SAVES " + json.dumps(saves), flush=True)
"""


def test_sigterm_saves_at_the_next_step_exits_and_resumes(tmp_path):
    script = write_script(tmp_path, "single.py", SINGLE)
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    proc = start_python(script, str(directory), "100000", str(marker), env=_env())
    try:
        assert _wait_line(proc, "start") == "start 0 0 True"
        _wait_line(proc, "step 10")
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_CODE_OTHER, err[-4000:]
    assert marker.read_text() == "chained\n"  # the earlier handler still ran
    (save,) = _json_line(out, "SAVES")
    assert save["final"] and save["run"] - save["run_at_notice"] <= 1
    run = save["run"]
    assert tf.train.latest_checkpoint(str(directory)).endswith(f"ckpt-{run}")

    restarted = run_python(script, str(directory), str(run + 5), str(marker), env=_env())
    assert restarted.returncode == 0, restarted.stderr[-4000:]
    lines = restarted.stdout.splitlines()
    assert f"start {run} {run} True" in lines  # same step, same state, same run count
    assert f"done {run + 5}" in lines


# -- the deadline, with a slow writer -----------------------------------------------

DEADLINE = """
import json, os, random, signal, sys, threading, time
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.tf import checkpoint as checkpoint_module
from asyncckpt.tf._job import TFSaveJob
from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

root, trials, grace, step_s, write_s = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:6])


class SlowDiskJob(TFSaveJob):
    # The real job, on a disk that takes write_s seconds per checkpoint.
    def write(self):
        time.sleep(write_s)
        super().write()


checkpoint_module.TFSaveJob = SlowDiskJob
rng = random.Random(int(sys.argv[6]))
results = []
for trial in range(trials):
    # The simulated disk is the sleep above; flush what earlier tests left dirty
    # first, so a journal commit behind their writeback does not stall a final
    # fsync (seen once: +0.7 s on a 0.6 s write, in a full run).
    os.sync()
    v = tf.Variable(np.zeros(1 << 14, np.float32))
    step = tf.Variable(0, dtype=tf.int64)
    directory = os.path.join(root, f"trial{trial}")
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v, step=step), directory, max_to_keep=3)
    config = TerminationConfig(grace_period=grace, exit_fn=lambda: None, platform="other")
    handler = PreemptionCheckpointHandler(mgr, termination_config=config)

    boundaries = []

    def train():
        boundaries.append((time.time(), handler.total_run_calls))
        v.assign_add(tf.ones(1 << 14))
        step.assign_add(1)
        time.sleep(step_s)

    timer = threading.Timer(rng.uniform(1.5, 2.5), os.kill, (os.getpid(), signal.SIGTERM))
    with handler:
        timer.start()
        while not handler.preempted:
            if handler.total_run_calls % 60 == 0 and not handler.noticed:
                mgr.save(checkpoint_number=handler.total_run_calls)  # periodic saves
            handler.run(train)
    mgr.close()
    writes = [s.background_s for s in mgr.engine.history]
    notice_time = handler.saves[-1].notice_time
    results.append({"saves": [dict(s.__dict__) for s in handler.saves],
                    "run_at_notice": max(r for t, r in boundaries if t <= notice_time),
                    "write_s": max(writes), "step_s": handler.grace_clock.steps.mean,
                    "directory": directory})
print("RESULTS " + json.dumps(results), flush=True)
"""


def test_final_checkpoint_is_durable_before_the_deadline_with_a_slow_writer(tmp_path):
    grace, step_s, write_s, trials = 4.0, 0.02, 0.6, 3
    seed = test_seed("preemption deadline")
    script = write_script(tmp_path, "deadline.py", DEADLINE)
    proc = run_python(script, str(tmp_path), str(trials), str(grace), str(step_s), str(write_s),
                      str(seed), env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = _json_line(proc.stdout, "RESULTS")
    assert len(results) == trials
    for i, r in enumerate(results):
        context = f"seed={seed} trial={i}: {r}"
        final = r["saves"][-1]
        assert r["write_s"] >= 10 * r["step_s"], context  # the write spans many steps
        assert final["final"], context
        assert final["durable_at"] <= final["deadline"], context  # every trial in time
        assert final["deadline"] == pytest.approx(final["notice_time"] + grace), context
        assert final["run"] > r["run_at_notice"] + 1, context  # trained in the grace period
        prefix = os.path.join(r["directory"], f"ckpt-{final['run']}")
        assert contents(prefix)["step/.ATTRIBUTES/VARIABLE_VALUE"] == final["run"]


# -- two TensorFlow workers (MultiWorkerMirroredStrategy on 127.0.0.1) ---------------

WORKER = """
import json, os, sys, time
index, ports, directory, total, fail_at = (int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3],
                                           int(sys.argv[4]), int(sys.argv[5]))
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
    "task": {"type": "worker", "index": index}})
import numpy as np
import tensorflow as tf
from asyncckpt.preemption import PreemptionCheckpointHandler

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    v = tf.Variable(tf.zeros(4))
    step = tf.Variable(0, dtype=tf.int64)
handler = PreemptionCheckpointHandler(tf.train.Checkpoint(v=v, step=step),
                                      checkpoint_dir=directory)
r = handler.total_run_calls
print("start", r, int(step.numpy()), bool(np.all(v.numpy() == 2 * r)),
      handler.coordinator.kind, flush=True)


@tf.function
def all_reduce_step():
    def fn():
        ctx = tf.distribute.get_replica_context()
        v.assign_add(ctx.all_reduce("SUM", tf.ones(4)))  # a collective every step
    strategy.run(fn)
    step.assign_add(1)


def train():
    if handler.total_run_calls == fail_at:
        raise ValueError(f"bad batch on worker {index}")
    all_reduce_step()
    time.sleep(0.05)
    print("step", handler.total_run_calls + 1, flush=True)


try:
    with handler:
        while handler.total_run_calls < total:
            handler.run(train)
    print("done", handler.total_run_calls, float(v.numpy()[0]), flush=True)
except Exception as e:
    print("ERROR", type(e).__name__, " | ".join(str(e).splitlines())[:3000], flush=True)
    raise
finally:
    print("SAVES " + json.dumps([s.run for s in handler.saves]), flush=True)
"""


def _start_workers(script, directory, total, fail_at=(-1, -1)):
    ports = f"{_closed_port()},{_closed_port()}"
    return [start_python(script, str(i), ports, str(directory), str(total), str(fail_at[i]),
                         env=_env()) for i in range(2)]


def _finish(procs, timeout=180):
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        results.append((p.returncode, out, err))
    return results


@pytest.mark.slow
def test_two_tf_workers_save_at_the_same_step_on_sigterm_to_one_and_resume(tmp_path):
    script = write_script(tmp_path, "worker.py", WORKER)
    directory = tmp_path / "ckpt"
    procs = _start_workers(script, directory, 100000)
    try:
        for p in procs:
            assert _wait_line(p, "start", 180) == "start 0 0 True tensorflow"
        for p in procs:
            _wait_line(p, "step 8")
        os.kill(procs[1].pid, signal.SIGTERM)  # the non-chief worker is preempted
    finally:
        results = _finish(procs)
    saved = []
    for rc, out, err in results:
        assert rc == EXIT_CODE_OTHER, err[-4000:]
        saved.append(_json_line(out, "SAVES"))
    assert saved[0] == saved[1] and len(saved[0]) == 1, saved  # the same step on both
    run = saved[0][0]
    assert run >= 8
    assert tf.train.latest_checkpoint(str(directory)).endswith(f"ckpt-{run}")
    assert not (directory / "workertemp_1").exists()

    results = _finish(_start_workers(script, directory, run + 3))
    for rc, out, err in results:
        assert rc == 0, err[-4000:]
        lines = out.splitlines()
        assert f"start {run} {run} True tensorflow" in lines  # both resume where they saved
        assert f"done {run + 3} {2.0 * (run + 3)}" in lines


@pytest.mark.slow
def test_an_error_in_one_tf_worker_stops_the_other(tmp_path):
    script = write_script(tmp_path, "worker.py", WORKER)
    results = _finish(_start_workers(script, tmp_path / "ckpt", 100000, fail_at=(-1, 6)))
    (rc0, out0, err0), (rc1, out1, err1) = results
    assert rc1 != 0 and "ERROR ValueError bad batch on worker 1" in out1, err1[-3000:]
    # Worker 0 is blocked in the step's all-reduce when worker 1 fails: the
    # coordination service aborts it with worker 1's error.
    assert rc0 != 0, err0[-3000:]
    error_line = next(line for line in out0.splitlines() if line.startswith("ERROR"))
    assert "bad batch on worker 1" in error_line, out0  # aborted, or PeerFailedError


# -- in-process: multi-step loops, save_fn -------------------------------------------


def _in_process_handler(manager, **config):
    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

    config.setdefault("platform", "other")
    config.setdefault("poll_interval_s", 0.01)
    return PreemptionCheckpointHandler(manager, termination_config=TerminationConfig(**config))


def test_save_checkpoint_if_preempted_in_a_multi_step_loop(ckpt_dir):
    import threading

    import asyncckpt.tf as at

    steps_per_call = 5
    v = tf.Variable(0, dtype=tf.int64)
    notice = threading.Event()
    exits = []
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    with _in_process_handler(mgr, termination_watcher_fn=notice.is_set,
                             exit_fn=lambda: exits.append(1)) as handler:
        while not handler.preempted:
            for _ in range(steps_per_call):
                v.assign_add(1)
            handler.save_checkpoint_if_preempted()
            if handler.total_run_calls == 4:
                notice.set()
        (save,) = handler.saves
    mgr.close()
    assert exits == [1] and save.final and save.run >= 4
    assert int(contents(f"{ckpt_dir}/ckpt-{save.run}")["v/.ATTRIBUTES/VARIABLE_VALUE"]) == (
        steps_per_call * save.run)
    # A new handler on the same directory resumes the count with the state.
    v2 = tf.Variable(0, dtype=tf.int64)
    mgr2 = at.CheckpointManager(tf.train.Checkpoint(v=v2), str(ckpt_dir), max_to_keep=2)
    with _in_process_handler(mgr2, exit_fn=lambda: None) as handler2:
        assert handler2.total_run_calls == save.run
        assert int(v2.numpy()) == steps_per_call * save.run
    mgr2.close()


def test_save_fn_replaces_the_managers_save(ckpt_dir):
    import threading

    import asyncckpt.tf as at

    v = tf.Variable(1.0)
    notice = threading.Event()
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), str(ckpt_dir), max_to_keep=2)
    calls = []

    def save_fn():
        calls.append(mgr.save(checkpoint_number=1000 + len(calls)))

    with _in_process_handler(mgr, termination_watcher_fn=notice.is_set, exit_fn=lambda: None,
                             save_fn=save_fn) as handler:
        while not handler.preempted:
            handler.run(v.assign_add, 1.0)
            notice.set()
    mgr.close()
    assert calls == [f"{ckpt_dir}/ckpt-1000"]
    # Durable before exit_fn ran: the state file names it.
    assert tf.train.latest_checkpoint(str(ckpt_dir)) == calls[0]


def test_checkpoint_of_the_earlier_estimates_layout_still_resumes(ckpt_dir):
    """Checkpoints written before the grace samples grew hold a 6-value vector.

    That vector was saved as the handler's ``estimates``; restoring must skip
    it (the margin starts from scratch), not fail on its shape.
    """
    import asyncckpt.tf as at

    v = tf.Variable(7, dtype=tf.int64)
    old = tf.Module(name="asyncckpt_preemption")
    old.total_run_calls = tf.Variable(3, dtype=tf.int64)
    old.estimates = tf.Variable([1.0, 0.5, 0.1, 0.2, 0.3, 0.4], dtype=tf.float64)
    tf.train.Checkpoint(v=v, _asyncckpt_preemption=old).save(f"{ckpt_dir}/ckpt")
    v2 = tf.Variable(0, dtype=tf.int64)
    mgr = at.CheckpointManager(tf.train.Checkpoint(v=v2), str(ckpt_dir), max_to_keep=2)
    with _in_process_handler(mgr, exit_fn=lambda: None) as handler:
        assert handler.total_run_calls == 3
        assert int(v2.numpy()) == 7
    mgr.close()

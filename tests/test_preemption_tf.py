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
    # Named by the manager's save counter, as TensorFlow's handler names it.
    assert save["checkpoint"] == str(directory / "ckpt-1")
    assert tf.train.latest_checkpoint(str(directory)) == save["checkpoint"]

    restarted = run_python(script, str(directory), str(run + 5), str(marker), env=_env())
    assert restarted.returncode == 0, restarted.stderr[-4000:]
    lines = restarted.stdout.splitlines()
    assert f"start {run} {run} True" in lines  # same step, same state, same run count
    assert f"done {run + 5}" in lines


# -- resuming after a save made through each entry point ---------------------------

RESUME = """
import sys, time
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.preemption import PreemptionCheckpointHandler

directory, entry, total, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
applied = tf.Variable(0, dtype=tf.int64)  # counts the steps applied to the state
mgr = at.CheckpointManager(tf.train.Checkpoint(applied=applied), directory, max_to_keep=2)
handler = PreemptionCheckpointHandler(None, mgr)  # TensorFlow's call: no cluster resolver
print("start", handler.total_run_calls, int(applied.numpy()), flush=True)


def step(index):
    applied.assign_add(1)
    with open(log, "a") as f:
        f.write(f"{index}\\n")
    time.sleep(0.02)
    print("step", index, flush=True)


with handler:
    while handler.total_run_calls < total:  # until preempted
        if entry == "run":
            handler.run(lambda: step(handler.total_run_calls))
        else:  # TensorFlow's loop: the call before the step, then the step
            handler.save_checkpoint_if_preempted()
            step(handler.total_run_calls - 1)
print("done", handler.total_run_calls, int(applied.numpy()), flush=True)
"""


def test_resume_after_a_save_through_run_or_save_checkpoint_if_preempted_skips_no_step(
        tmp_path):
    """SIGTERM, exit, restart: each step index is applied exactly once across the runs.

    The job is preempted through ``save_checkpoint_if_preempted`` (called
    before the step, as TensorFlow's contract has it), resumed in a new
    process that is preempted through ``run``. Each checkpoint's run count is
    the number of steps its state holds (read by TensorFlow; the resumed
    process's asyncckpt restore agrees), and the steps applied before it are
    exactly the indices below it: resuming there skips and repeats nothing.
    """
    from tests.helpers import LineWatcher

    script = write_script(tmp_path, "resume.py", RESUME)
    directory, log = tmp_path / "ckpt", tmp_path / "steps.log"
    runs_key = "_asyncckpt_preemption/total_run_calls/.ATTRIBUTES/VARIABLE_VALUE"
    resumed_at = 0
    for number, entry in enumerate(["save_checkpoint_if_preempted", "run"], start=1):
        proc = start_python(script, str(directory), entry, "1000000", str(log), env=_env())
        lines = LineWatcher(proc.stdout)
        try:
            # asyncckpt's restore: the run count and the state agree.
            assert lines.wait_for("start").split() == ["start", str(resumed_at), str(resumed_at)]
            lines.wait_for(f"step {resumed_at + 4}")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == EXIT_CODE_OTHER, proc.stderr.read()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()
        # TensorFlow reads the preemption checkpoint, named by the save counter.
        prefix = tf.train.latest_checkpoint(str(directory))
        assert prefix == str(directory / f"ckpt-{number}"), entry
        runs = int(tf.train.load_variable(prefix, runs_key))
        assert int(tf.train.load_variable(prefix, "applied/.ATTRIBUTES/VARIABLE_VALUE")) == runs
        assert runs > resumed_at + 4, entry
        indices = [int(x) for x in log.read_text().split()]
        assert indices == list(range(runs)), f"{entry}: a step was skipped or repeated"
        resumed_at = runs


# -- the deadline, with a slow writer -----------------------------------------------

DEADLINE = """
import json, os, random, signal, sys, threading, time
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.tf._job import TFSaveJob
from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

root, trials, grace, step_s, write_s = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:6])


class SlowDiskJob(TFSaveJob):
    # The real job, on a disk that takes write_s seconds per checkpoint.
    def write(self):
        time.sleep(write_s)
        super().write()


class SlowDisk(at.Checkpoint):
    _job_class = SlowDiskJob

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
    mgr = at.CheckpointManager(SlowDisk(v=v, step=step), directory, max_to_keep=3)
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
        assert os.path.dirname(final["checkpoint"]) == r["directory"], context
        assert contents(final["checkpoint"])["step/.ATTRIBUTES/VARIABLE_VALUE"] == final["run"]


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
    assert tf.train.latest_checkpoint(str(directory)) == str(directory / "ckpt-1")
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
    """Called before each chunk (TensorFlow's contract): the checkpoint holds the state
    of ``total_run_calls`` chunks, and a new handler resumes with the next chunk."""
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
            handler.save_checkpoint_if_preempted()
            if handler.preempted:
                break
            for _ in range(steps_per_call):
                v.assign_add(1)
            if handler.total_run_calls == 4:
                notice.set()
        (save,) = handler.saves
    mgr.close()
    assert exits == [1] and save.final and save.run >= 4
    # Named by the save counter, as TensorFlow names it; the state of save.run chunks.
    assert save.checkpoint == f"{ckpt_dir}/ckpt-1"
    assert int(contents(save.checkpoint)["v/.ATTRIBUTES/VARIABLE_VALUE"]) == (
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


# -- TensorFlow's spellings ------------------------------------------------------------


def _resolver(cluster: dict, task_type: str = "worker", task_id: int = 0):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id)


def test_handler_and_config_take_tensorflows_signatures(ckpt_dir):
    """``(cluster_resolver, checkpoint_or_checkpoint_manager, checkpoint_dir,
    termination_config)`` by position and by keyword, TensorFlow's own
    ``TerminationConfig``, and asyncckpt's shorter call, all mean the same."""
    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

    v = tf.Variable(3.0)
    ckpt = tf.train.Checkpoint(v=v)
    exits = []

    def exit_fn():
        exits.append(1)

    def watcher():
        return False

    config = TerminationConfig(watcher, exit_fn, 2.5, None, platform="other")
    assert (config.termination_watcher_fn, config.exit_fn, config.grace_period) == (
        watcher, exit_fn, 2.5)
    with pytest.raises(TypeError):
        TerminationConfig(watcher, exit_fn, 2.5, None, "other")  # asyncckpt's fields: keywords
    tf_config = tf.distribute.experimental.TerminationConfig(exit_fn=exit_fn, grace_period=4)
    local = _resolver({})  # local training: an empty cluster, as MirroredStrategy's
    calls = [
        lambda: PreemptionCheckpointHandler(local, ckpt, str(ckpt_dir), config),
        lambda: PreemptionCheckpointHandler(
            cluster_resolver=local, checkpoint_or_checkpoint_manager=ckpt,
            checkpoint_dir=str(ckpt_dir), termination_config=config),
        lambda: PreemptionCheckpointHandler(None, ckpt, str(ckpt_dir), config),
        lambda: PreemptionCheckpointHandler(ckpt, checkpoint_dir=str(ckpt_dir),
                                            termination_config=config),
        lambda: PreemptionCheckpointHandler(checkpoint_or_manager=ckpt,
                                            checkpoint_dir=str(ckpt_dir),
                                            termination_config=config),
    ]
    for make in calls:
        with make() as handler:
            assert handler.coordinator.kind == "in-process"
            assert handler.config.grace_period == 2.5 and handler.config.exit_fn is exit_fn
            assert handler.config.termination_watcher_fn is watcher
            assert float(v.numpy()) == 3.0 and handler.total_run_calls == 0
    with PreemptionCheckpointHandler(local, ckpt, str(ckpt_dir), tf_config) as handler:
        # TensorFlow's config is read field by field (the platform is still detected).
        assert handler.config.grace_period == 4 and handler.config.exit_fn is exit_fn
    assert exits == []

    with pytest.raises(TypeError, match="given twice"):
        PreemptionCheckpointHandler(local, ckpt, checkpoint_or_manager=ckpt)
    with pytest.raises(TypeError, match="needs a checkpoint"):
        PreemptionCheckpointHandler(local)
    with pytest.raises(TypeError, match="checkpoint_dir=") as e:
        PreemptionCheckpointHandler(ckpt, str(ckpt_dir))  # asyncckpt's call, dir by position
    assert "cluster_resolver, checkpoint, checkpoint_dir" in str(e.value)
    with pytest.raises(TypeError, match="termination_config must be"):
        PreemptionCheckpointHandler(local, ckpt, str(ckpt_dir), {"grace_period": 1})
    # TensorFlow's own manager is refused at construction, naming the drop-in.
    with pytest.raises(TypeError, match=r"asyncckpt\.tf\.CheckpointManager\(checkpoint, "):
        PreemptionCheckpointHandler(
            local, tf.train.CheckpointManager(ckpt, str(ckpt_dir / "tf"), max_to_keep=1))


def test_the_cluster_resolver_says_which_worker_and_needs_its_coordination_service(ckpt_dir):
    """The resolver's cluster spec and task are used: several workers need the
    coordination service MultiWorkerMirroredStrategy starts; parameter servers and
    evaluators are refused as TensorFlow's handler refuses them."""
    from asyncckpt.errors import CoordinationError
    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

    ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
    config = TerminationConfig(platform="other")
    workers = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    with pytest.raises(CoordinationError, match="names 3 workers"):
        PreemptionCheckpointHandler(_resolver(workers, "worker", 1), ckpt, str(ckpt_dir), config)
    with pytest.raises(NotImplementedError, match="ParameterServerStrategy"):
        PreemptionCheckpointHandler(_resolver({**workers, "ps": ["127.0.0.1:4"]}), ckpt,
                                    str(ckpt_dir), config)
    with pytest.raises(ValueError, match="evaluator:0 is not a chief or worker"):
        PreemptionCheckpointHandler(_resolver({**workers, "evaluator": ["127.0.0.1:5"]},
                                              "evaluator", 0), ckpt, str(ckpt_dir), config)
    # One worker: nothing to agree with.
    with PreemptionCheckpointHandler(_resolver({"worker": ["127.0.0.1:2"]}), ckpt,
                                     str(ckpt_dir), config) as handler:
        assert handler.coordinator.kind == "in-process"


def test_watch_preemption_scope_reports_an_error_to_the_cluster_and_reraises(ckpt_dir):
    from asyncckpt._coordination import InProcessCoordinator
    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

    class Recording(InProcessCoordinator):
        """The real in-process store; records what the handler reports to the framework."""

        reported: list = []

        def report_error(self, exc):
            self.reported.append(exc)

    coordinator = Recording()
    handler = PreemptionCheckpointHandler(
        None, tf.train.Checkpoint(v=tf.Variable(1.0)), str(ckpt_dir),
        TerminationConfig(platform="other"), coordinator=coordinator)
    error = tf.errors.ResourceExhaustedError(None, None, "Running out of resources")
    with handler, pytest.raises(tf.errors.ResourceExhaustedError), \
            handler.watch_preemption_scope():
        handler.run(lambda: None)
        raise error
    assert coordinator.reported == [error]
    with handler.watch_preemption_scope():  # no error: nothing reported
        pass
    assert coordinator.reported == [error]


def test_an_adopted_save_in_flight_reports_the_run_count_it_holds(ckpt_dir):
    """With no time for a new final save, the save in flight becomes the final
    checkpoint; its run count is read back from it, not taken from its number
    (the manager names it by its save counter)."""
    import asyncckpt.tf as at
    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig
    from asyncckpt.tf._job import TFSaveJob

    class SlowDiskJob(TFSaveJob):  # the real job, on a disk that takes 1.5 s per checkpoint
        def write(self):
            time.sleep(1.5)
            super().write()

    class SlowDisk(at.Checkpoint):
        _job_class = SlowDiskJob

    v = tf.Variable(0.0)
    mgr = at.CheckpointManager(SlowDisk(v=v), str(ckpt_dir), max_to_keep=5)
    exits = []
    config = TerminationConfig(grace_period=0.3, exit_fn=lambda: exits.append(1),
                               platform="other")
    with mgr, PreemptionCheckpointHandler(mgr, termination_config=config) as handler:
        handler.run(v.assign_add, 1.0)
        mgr.save()  # ckpt-1, measured: the margin is known
        mgr.sync()
        for _ in range(3):
            handler.run(v.assign_add, 1.0)
        mgr.save()  # ckpt-2, at run 4, still writing at the notice two steps later
        handler.run(v.assign_add, 1.0)
        handler.run(v.assign_add, 1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        while not handler.preempted:
            handler.run(v.assign_add, 1.0)
    (final,) = handler.saves
    assert final.adopted and exits == [1], final
    assert (final.run, final.checkpoint) == (4, f"{ckpt_dir}/ckpt-2")
    assert tf.train.load_variable(final.checkpoint, "v/.ATTRIBUTES/VARIABLE_VALUE") == 4.0


def test_a_peers_tensorflow_error_is_raised_as_its_own_class_on_every_worker():
    """TensorFlow's handler lets every worker raise the failing worker's error; a
    worker told of it at a step boundary raises a ``PeerFailedError`` that is also an
    instance of that ``tf.errors`` class (``except tf.errors.OpError`` catches it)."""
    import json
    import pickle

    from asyncckpt._coordination import InProcessCoordinator, TFCoordinator
    from asyncckpt.errors import PeerFailedError
    from asyncckpt.preemption.agreement import StepAgreement

    coordinators = InProcessCoordinator.group(2)
    agreement = StepAgreement(coordinators[1], namespace="t", runs=0, margin_fn=lambda: None)
    error = tf.errors.ResourceExhaustedError(None, None, "Running out of resources")
    assert agreement.report_error(error)
    published = json.loads(coordinators[0].try_get("t/error"))
    assert (published["worker"], published["code"]) == (1, tf.errors.RESOURCE_EXHAUSTED)

    peer = TFCoordinator(worker_id=0, num_workers=2).peer_failed(
        published["worker"], published["error"], published["code"])
    assert isinstance(peer, PeerFailedError) and isinstance(peer, tf.errors.ResourceExhaustedError)
    assert peer.error_code == tf.errors.RESOURCE_EXHAUSTED and peer.worker == 1
    assert "Running out of resources" in str(peer) and "worker 1 failed" in peer.message
    again = pickle.loads(pickle.dumps(peer))
    assert type(again) is type(peer) and str(again) == str(peer)
    # Not a TensorFlow error (or an unknown code): a plain PeerFailedError.
    assert type(TFCoordinator(worker_id=0, num_workers=2).peer_failed(1, "x", None)) is (
        PeerFailedError)


def test_a_non_chief_writes_its_copy_again_after_an_exit_fn_that_returned(ckpt_dir):
    """The other workers' temporary copy is removed after the final save, and made
    again by the next one when the handler watches again."""
    from asyncckpt.preemption._targets import make_target

    v = tf.Variable([1.0, 2.0])
    target = make_target(tf.train.Checkpoint(v=v), checkpoint_dir=str(ckpt_dir), worker_id=1,
                         num_workers=2)
    temp = ckpt_dir / "workertemp_1"
    try:
        first = target.save(1, {}, None, (), {})
        target.wait_until_finished()
        assert first == str(temp / "ckpt-1") and os.path.exists(first + ".index")
        target.after_final_save()
        assert not temp.exists()
        target.watch_again()
        v.assign([3.0, 4.0])
        second = target.save(2, {}, None, (), {})
        target.wait_until_finished()
        assert os.path.dirname(second) == str(temp) and os.path.exists(second + ".index")
        assert contents(second)["v/.ATTRIBUTES/VARIABLE_VALUE"].tolist() == [3.0, 4.0]
        got = tf.Variable([0.0, 0.0])
        tf.train.Checkpoint(v=got).restore(second).expect_partial()
        assert got.numpy().tolist() == [3.0, 4.0]
    finally:
        target.close()
    assert not temp.exists()

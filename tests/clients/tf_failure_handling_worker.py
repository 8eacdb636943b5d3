"""One process of TensorFlow's failure-handling test cases, run against asyncckpt's handler.

Started by ``test_tf_failure_handling.py`` (not collected by pytest). It plays
the ``worker_fn`` of TensorFlow's ``failure_handler_test.py`` and
``gce_failure_handler_test.py``, written anew from their scenarios: a module
holding one ``ON_WRITE``/``SUM`` variable, incremented once per step through
``strategy.run``, is trained ``epochs * steps_per_epoch`` steps under
``asyncckpt.preemption.PreemptionCheckpointHandler`` built with TensorFlow's
exact call, ``PreemptionCheckpointHandler(strategy.cluster_resolver,
checkpoint_or_manager, checkpoint_dir, termination_config)``, driven by
``run`` or by ``save_checkpoint_if_preempted`` before each step. A notice
(a real SIGTERM this process sends itself, or a GCE maintenance event on this
process's own metadata server) arrives at the end of a chosen epoch.

Usage: ``python tf_failure_handling_worker.py SPEC.json``, where the spec has
``root`` (a directory per case below it), ``phase`` (``local``: every case
in this process, restarted in it as TensorFlow's local-mode tests do;
``preempt``/``resume``: the two process lifetimes of a multi-worker case),
``worker`` and ``ports`` (multi-worker: this task and the cluster) and
``cases``. Each case prints one ``CASE <json>`` line of facts (exit code,
whether training finished, the variable's value, the checkpoints found on
restart, ...); the test asserts TensorFlow's assertions on them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import traceback

STARTED = time.monotonic()
with open(sys.argv[1]) as spec_file:
    SPEC = json.load(spec_file)
if SPEC["phase"] != "local":
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in SPEC["ports"]]},
        "task": {"type": "worker", "index": SPEC["worker"]},
    })

import tensorflow as tf  # noqa: E402

import asyncckpt.tf as at  # noqa: E402
from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig  # noqa: E402
from tests.metadata_server import FakeMetadataServer, gce_values  # noqa: E402

MAINTENANCE = "instance/maintenance-event"
# Off GCE: nothing listens there, so platform detection says "other" at once.
OFF_GCE = SPEC["off_gce_host"]
# This process's own GCE metadata server: a GPU VM (TensorFlow's tests patch
# their platform detection to GCE_GPU; here detection finds it).
SERVER = FakeMetadataServer(gce_values("a2-highgpu-1g")).__enter__()
_strategies: dict[str, tf.distribute.Strategy] = {}


def strategy_for(option: str) -> tf.distribute.Strategy:
    if option == "MS":
        return tf.distribute.MirroredStrategy()
    if option == "OneDevice":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if option == "MWMS_local":
        return tf.distribute.MultiWorkerMirroredStrategy()
    # One MultiWorkerMirroredStrategy per process: its collectives are
    # configured once, at its creation.
    if option not in _strategies:
        _strategies[option] = tf.distribute.MultiWorkerMirroredStrategy()
    return _strategies[option]


def non_chief_dir(checkpoint_dir: str, task_id: int) -> str:
    """Where TensorFlow's tests put a non-chief worker's manager: a ``workertemp_<id>``
    folder beside the base name of ``checkpoint_dir``."""
    parent, base = os.path.split(checkpoint_dir)
    path = os.path.join(parent, f"workertemp_{task_id}")
    os.makedirs(path, exist_ok=True)
    return os.path.join(path, base)


def make_manager(checkpoint, checkpoint_dir: str, resolver):
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec or resolver.task_id == 0:  # the chief (no chief task: worker 0)
        return at.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=1)
    return at.CheckpointManager(checkpoint, non_chief_dir(checkpoint_dir, resolver.task_id),
                                max_to_keep=1)


def termination_config(case):
    if case["config"] == "tf":  # TensorFlow's own TerminationConfig, passed unchanged
        kwargs = {}
        if case["grace_period"] is not None:
            kwargs["grace_period"] = case["grace_period"]
        if case["save_fn"]:
            kwargs["save_fn"] = lambda: print("Do nothing", flush=True)
        return tf.distribute.experimental.TerminationConfig(**kwargs)
    return TerminationConfig(grace_period=case["grace_period"])


def checkpoint_indices(checkpoint_dir: str) -> list[int]:
    if not os.path.isdir(checkpoint_dir):
        return []
    found = [re.search(r".*ckpt-(\d+).index", name) for name in os.listdir(checkpoint_dir)]
    return sorted(int(m.group(1)) for m in found if m)


def handler_threads() -> list[str]:
    prefixes = ("asyncckpt-agreement", "asyncckpt-notices", "asyncckpt-gce",
                "asyncckpt-user-watcher")
    return [t.name for t in threading.enumerate() if t.name.startswith(prefixes) and t.is_alive()]


def worker_fn(case: dict, checkpoint_dir: str, *, restarted: bool, facts: dict) -> None:
    """One process lifetime of TensorFlow's ``worker_fn`` (training until done or exit)."""
    strategy = strategy_for(case["strategy"])
    gce = case["notice"].startswith("maintenance")
    os.environ["GCE_METADATA_HOST"] = SERVER.host if gce else OFF_GCE
    if gce:  # every worker is noticed at once (frequent_send), or none yet
        noticed = case["notice"] == "maintenance-all" and not restarted
        SERVER.set(MAINTENANCE, "TERMINATE_ON_HOST_MAINTENANCE" if noticed else "NONE")
    resolver = strategy.cluster_resolver
    task_id = resolver.task_id if resolver is not None and resolver.cluster_spec().jobs else 0

    class Model(tf.Module):
        def __init__(self):
            self.v = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_WRITE,
                                 aggregation=tf.VariableAggregation.SUM)

    with strategy.scope():
        model = Model()
        fh_ckpt = tf.train.Checkpoint(model=model)
        if case["input_arg"] == "checkpoint":
            checkpoint_or_manager = fh_ckpt
        else:
            checkpoint_or_manager = make_manager(fh_ckpt, checkpoint_dir, resolver)
        handler = PreemptionCheckpointHandler(resolver, checkpoint_or_manager, checkpoint_dir,
                                              termination_config(case))
    facts["start_run"] = handler.total_run_calls
    fail = case.get("error_worker") == task_id

    @tf.function
    def train_step():
        if fail:
            raise tf.errors.ResourceExhaustedError(None, None, "Running out of resources")
        model.v.assign_add(tf.constant(1.0))

    def distributed_train_step(current_epoch, current_step):
        strategy.run(train_step)
        if not restarted and not handler.preempted:
            time.sleep(case["step_sleep"])

    if restarted:
        facts["indices"] = checkpoint_indices(checkpoint_dir)
    epochs, steps = case["epochs"], case["steps_per_epoch"]
    try:
        for epoch in range(handler.total_run_calls // steps, epochs):
            for step in range(handler.total_run_calls % steps, steps):
                if case["api_wrapping_train"]:
                    handler.run(distributed_train_step, epoch, step)
                else:
                    if case["number_by_run"]:  # gce_failure_handler_test's save arguments
                        handler.save_checkpoint_if_preempted(
                            checkpoint_number=handler.total_run_calls)
                    else:
                        handler.save_checkpoint_if_preempted()
                    distributed_train_step(epoch, step)
            if (not restarted and epoch == case["trigger_epoch"]
                    and task_id == case["trigger_worker"]):
                if case["notice"] == "sigterm":  # as TensorFlow's tests: another thread kills
                    threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()
                elif case["notice"] == "maintenance":
                    SERVER.set(MAINTENANCE, "TERMINATE_ON_HOST_MAINTENANCE")
        facts["finished"] = True
        facts["v"] = float(model.v.numpy())
        facts["expected_v"] = float(strategy.num_replicas_in_sync * epochs * steps)
    finally:
        facts["end_run"] = handler.total_run_calls
        facts["saves"] = [{"run": s.run, "checkpoint": s.checkpoint, "final": s.final,
                           "notice_to_durable_s": (s.durable_at - s.notice_time
                                                   if s.durable_at and s.notice_time else None)}
                          for s in handler.saves]
        handler.close()
        facts["threads_after_close"] = handler_threads()
        if isinstance(checkpoint_or_manager, at.CheckpointManager):
            checkpoint_or_manager.close()


def run_case(case: dict) -> dict:
    # No brackets in the path: TensorFlow's reader globs checkpoint names.
    folder = re.sub(r"[^A-Za-z0-9_.-]+", "_", case["id"])
    checkpoint_dir = os.path.join(SPEC["root"], folder, "fh_ckpt") + case["dir_suffix"]
    facts: dict = {"id": case["id"], "phase": SPEC["phase"], "worker": SPEC["worker"]}
    if SPEC["phase"] == "local":
        lifetimes = [False, True]
    else:  # a case that starts in the second process (error propagation) runs fresh there
        lifetimes = [SPEC["phase"] == "resume" and not case.get("fresh", False)]
    for restarted in lifetimes:
        life = facts.setdefault("restarted" if restarted else "first", {})
        try:
            worker_fn(case, checkpoint_dir, restarted=restarted, facts=life)
        except SystemExit as e:  # the handler's exit_fn, after the checkpoint is durable
            life["exit"] = e.code
        except tf.errors.OpError as e:
            life["op_error"] = [type(e).__name__, str(e)[-2000:]]
        except BaseException as e:
            life["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        life["indices_after"] = checkpoint_indices(checkpoint_dir)
        # TensorFlow restarts a local job in the same process only after an exit.
        if "exit" not in life or not case["restart"]:
            break
    return facts


print(f"READY {time.monotonic() - STARTED:.1f}", flush=True)
for case in SPEC["cases"]:
    began = time.monotonic()
    facts = run_case(case)
    facts["elapsed_s"] = round(time.monotonic() - began, 2)
    print("CASE " + json.dumps(facts), flush=True)
print("DONE", flush=True)
SERVER.__exit__(None, None, None)
# After a worker reported an error to the cluster, TensorFlow's shutdown can
# wait on the failed coordination service: the results are out, end here.
os._exit(0)

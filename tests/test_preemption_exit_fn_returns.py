"""An ``exit_fn`` that returns: the run goes on and the handler keeps watching.

orbit's ``SaveCheckpointIfPreempted(keep_running_after_save=True)`` passes
TensorFlow's ``TerminationConfig(exit_fn=lambda: None)``: the process saves
at a SIGTERM and trains on (in-process recovery). TensorFlow's handler keeps
its SIGTERM handler installed, so a second SIGTERM does not end the run.
asyncckpt's keeps watching too, and saves again at a new agreed step.
Real processes, real SIGTERMs, for a TensorFlow and a JAX manager; every
checkpoint is restored with asyncckpt's reader and the framework's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading

import numpy as np
import pytest

from tests.helpers import LineWatcher, start_python, subprocess_env, write_script


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # Off GCE: the metadata hosts refuse connections at once.
    port = f"127.0.0.1:{_closed_port()}"
    env = subprocess_env(GCE_METADATA_HOST=port, GCE_METADATA_IP=port)
    env.pop("ASYNCCKPT_PLATFORM", None)
    env.pop("TF_CONFIG", None)
    return env


# The loop shared by both scripts: a SIGTERM sent by the exit_fn itself (one
# that arrives while the final save is handled) must neither kill the process
# nor make a save of its own; the test's two SIGTERMs make two saves.
LOOP = """
exits = []


def exit_fn():  # returns, as orbit's keep_running_after_save=True exit_fn does
    exits.append(handler.total_run_calls)
    print("exit_fn", handler.total_run_calls, flush=True)
    if len(exits) == 1:
        os.kill(os.getpid(), signal.SIGTERM)


with handler:
    while handler.total_run_calls < total:
        STEP
print("SAVES " + json.dumps([[s.run, s.final, s.checkpoint] for s in handler.saves]),
      flush=True)
print("EXITS " + json.dumps(exits), flush=True)
print("done", handler.total_run_calls, flush=True)
"""

TF_SCRIPT = """
import json, os, signal, sys, time
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.preemption import PreemptionCheckpointHandler

directory, total = sys.argv[1], int(sys.argv[2])
a = tf.Variable(np.zeros(64, np.float32))
step = tf.Variable(0, dtype=tf.int64)
manager = at.CheckpointManager(tf.train.Checkpoint(a=a, step=step), directory, max_to_keep=5)
handler = PreemptionCheckpointHandler(
    None, manager, termination_config=tf.distribute.experimental.TerminationConfig(
        exit_fn=lambda: exit_fn()))


def train():
    a.assign_add(tf.ones(64))
    step.assign_add(1)
    time.sleep(0.02)
    print("step", int(step.numpy()), flush=True)

""" + LOOP.replace("STEP", "handler.run(train)") + """
manager.close()
"""

JAX_SCRIPT = """
import json, os, signal, sys, time
import jax, jax.numpy as jnp
import asyncckpt.jax as aj
from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

directory, total = sys.argv[1], int(sys.argv[2])
manager = aj.CheckpointManager(directory)
handler = PreemptionCheckpointHandler(
    manager, termination_config=TerminationConfig(exit_fn=lambda: exit_fn()))
state = {"a": jnp.zeros(64, jnp.float32), "step": jnp.zeros((), jnp.int32)}
add = jax.jit(lambda s: {"a": s["a"] + 1, "step": s["step"] + 1})


def train(state):
    state = add(state)
    time.sleep(0.02)
    print("step", int(state["step"]), flush=True)
    return state

""" + LOOP.replace("STEP", "state = handler.run(train, state)") + """
manager.close()
"""


def _run_with_two_sigterms(script, directory) -> tuple[list, list, str]:
    """Starts the run, sends SIGTERM at step 8 and again at step 30; it must end by itself."""
    proc = start_python(script, str(directory), "60", env=_env())
    lines = LineWatcher(proc.stdout)
    errors = []
    reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
    reader.start()
    try:
        lines.wait_for("step 8", 240)
        proc.send_signal(signal.SIGTERM)
        lines.wait_for(lambda line: line.startswith("exit_fn"), 120)
        lines.wait_for("step 30", 120)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(30)
    out = lines.rest(30)
    assert rc == 0, out[-3000:] + "".join(errors)[-4000:]
    text = lines.text
    found = {}
    for line in text.splitlines():
        for key in ("SAVES", "EXITS"):
            if line.startswith(key + " "):
                found[key] = json.loads(line[len(key) + 1:])
    assert "done 60" in text.splitlines(), text[-2000:]
    return found["SAVES"], found["EXITS"], text


def _check_saves(saves, exits) -> tuple[int, int]:
    # One final save per external SIGTERM, at agreed steps in their windows;
    # the SIGTERM sent inside the first exit_fn made none.
    assert [final for _, final, _ in saves] == [True, True], saves
    (run1, _, _), (run2, _, _) = saves
    assert 8 <= run1 < 30 <= run2 < 60, saves
    assert exits == [run1, run2]
    return run1, run2


def test_tf_handler_keeps_watching_after_an_exit_fn_that_returns(tmp_path):
    tf = pytest.importorskip("tensorflow")
    import asyncckpt.tf as at

    directory = tmp_path / "ckpt"
    script = write_script(tmp_path, "tf_run.py", TF_SCRIPT)
    saves, exits, _ = _run_with_two_sigterms(script, directory)
    _check_saves(saves, exits)
    assert [path for _, _, path in saves] == [str(directory / "ckpt-1"),
                                              str(directory / "ckpt-2")]
    assert tf.train.latest_checkpoint(str(directory)) == str(directory / "ckpt-2")
    runs_key = "_asyncckpt_preemption/total_run_calls/.ATTRIBUTES/VARIABLE_VALUE"
    for (run, _, path) in saves:
        assert int(tf.train.load_variable(path, runs_key)) == run
        for reader in (at.Checkpoint, tf.train.Checkpoint):
            a, step = tf.Variable(np.zeros(64, np.float32)), tf.Variable(0, dtype=tf.int64)
            reader(a=a, step=step).restore(path).expect_partial()
            assert int(step.numpy()) == run, reader  # the state before step run + 1
            np.testing.assert_array_equal(a.numpy(), np.full(64, run, np.float32))


def test_jax_handler_keeps_watching_after_an_exit_fn_that_returns(tmp_path):
    pytest.importorskip("jax")
    ocp = pytest.importorskip("orbax.checkpoint")
    import asyncckpt.jax as aj

    directory = tmp_path / "ckpt"
    script = write_script(tmp_path, "jax_run.py", JAX_SCRIPT)
    saves, exits, _ = _run_with_two_sigterms(script, directory)
    run1, run2 = _check_saves(saves, exits)
    assert [os.path.basename(path) for _, _, path in saves] == [str(run1), str(run2)]
    with aj.CheckpointManager(str(directory)) as mgr:
        assert mgr.all_steps() == [run1, run2]
        restored = {run: mgr.restore(run) for run in (run1, run2)}
    with ocp.CheckpointManager(str(directory)) as orbax_mgr:
        by_orbax = {run: orbax_mgr.restore(run, args=ocp.args.StandardRestore())
                    for run in (run1, run2)}
    for run in (run1, run2):
        for got in (restored[run], by_orbax[run]):
            assert int(got["step"]) == run
            np.testing.assert_array_equal(np.asarray(got["a"]), np.full(64, run, np.float32))

"""Preemption with JAX: two real ``jax.distributed`` processes on 127.0.0.1.

Under ``jax.distributed`` JAX's C++ notifier owns SIGTERM; the handler reads
JAX's preemption sync point at each step and runs its own agreement over the
distributed key-value store.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

pytest.importorskip("jax")

from asyncckpt.preemption.config import EXIT_CODE_OTHER
from tests.helpers import start_python, subprocess_env, write_script

PROCESS = """
import json, sys, time
index, port, directory, total, fail_at, collectives = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
    sys.argv[6] == "1")
import jax
import jax.numpy as jnp
import numpy as np
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import asyncckpt.jax as aj
from asyncckpt.preemption import PreemptionCheckpointHandler

mesh = Mesh(np.array(jax.devices()), ("x",))
sharding = NamedSharding(mesh, P("x"))
n = 4 * len(jax.devices())
base = np.arange(n, dtype=np.float32)
manager = aj.CheckpointManager(directory, max_to_keep=2)
handler = PreemptionCheckpointHandler(manager)
abstract = {"w": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding), "step": 0}
restored = handler.restore(abstract)
if restored is None:
    state = {"w": jax.make_array_from_callback((n,), sharding, lambda i: base[i]), "step": 0}
else:
    state = restored
r = handler.total_run_calls
ok = all(np.array_equal(np.asarray(s.data), base[s.index] + r)
         for s in state["w"].addressable_shards)
print("start", r, int(state["step"]), ok, handler.coordinator.kind, flush=True)
add = jax.jit(lambda w: w + 1)
total_sum = jax.jit(jnp.sum)


def train(state):
    if handler.total_run_calls == fail_at:
        raise ValueError(f"bad batch on process {index}")
    w = add(state["w"])
    if collectives:
        total_sum(w).block_until_ready()  # a cross-process reduction every step
    time.sleep(0.05)
    print("step", handler.total_run_calls + 1, flush=True)
    return {"w": w, "step": state["step"] + 1}


try:
    with handler:
        while handler.total_run_calls < total:
            state = handler.run(train, state)
    manager.close()
    print("done", handler.total_run_calls, int(state["step"]), flush=True)
except Exception as e:
    print("ERROR", type(e).__name__, " | ".join(str(e).splitlines())[:3000], flush=True)
    raise
finally:
    print("SAVES " + json.dumps([s.run for s in handler.saves]), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(script, directory, total, *, fail_at=(-1, -1), collectives=True):
    port = str(_free_port())
    env = subprocess_env(GCE_METADATA_HOST=f"127.0.0.1:{_free_port()}",
                         XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env.pop("ASYNCCKPT_PLATFORM", None)
    return [start_python(script, str(i), port, str(directory), str(total), str(fail_at[i]),
                         "1" if collectives else "0", env=env) for i in range(2)]


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


def _saves(out: str) -> list[int]:
    line = next(x for x in out.splitlines() if x.startswith("SAVES "))
    return json.loads(line[6:])


@pytest.mark.slow
def test_two_jax_processes_save_at_the_same_step_on_sigterm_to_one_and_resume(tmp_path):
    script = write_script(tmp_path, "process.py", PROCESS)
    directory = tmp_path / "ckpt"
    procs = _start(script, directory, 100000)
    try:
        for p in procs:
            assert _wait_line(p, "start") == "start 0 0 True jax"
        for p in procs:
            _wait_line(p, "step 8")
        os.kill(procs[1].pid, signal.SIGTERM)  # caught by JAX's notifier in process 1
    finally:
        results = _finish(procs)
    saved = []
    for rc, out, err in results:
        assert rc == EXIT_CODE_OTHER, err[-4000:]
        saved.append(_saves(out))
    assert saved[0] == saved[1] and len(saved[0]) == 1, saved
    run = saved[0][0]
    assert run >= 8 and sorted(os.listdir(directory)).count(str(run)) == 1

    results = _finish(_start(script, directory, run + 3))
    for rc, out, err in results:
        assert rc == 0, err[-4000:]
        lines = out.splitlines()
        assert f"start {run} {run} True jax" in lines  # same step, same shards, same count
        assert f"done {run + 3} {run + 3}" in lines


@pytest.mark.slow
def test_an_error_in_one_jax_process_is_raised_in_the_other(tmp_path):
    script = write_script(tmp_path, "process.py", PROCESS)
    # Without a collective in the step, nothing in JAX stops process 0 when
    # process 1 fails: the handler's error key does, at the next boundary.
    results = _finish(_start(script, tmp_path / "ckpt", 100000, fail_at=(-1, 6),
                             collectives=False))
    (rc0, out0, err0), (rc1, out1, err1) = results
    assert rc1 != 0 and "ERROR ValueError bad batch on process 1" in out1, err1[-3000:]
    assert rc0 != 0, err0[-3000:]
    assert "ERROR PeerFailedError worker 1 failed: ValueError: bad batch on process 1" in out0


def test_multi_step_loop_saves_the_given_state_and_restores_the_run_count(tmp_path):
    import threading

    import jax.numpy as jnp
    import numpy as np

    import asyncckpt.jax as aj
    from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

    notice = threading.Event()
    config = TerminationConfig(platform="other", exit_fn=lambda: None, poll_interval_s=0.01,
                               termination_watcher_fn=notice.is_set)
    directory = tmp_path / "ckpt"
    steps_per_call = 3
    with aj.CheckpointManager(directory) as manager, \
            PreemptionCheckpointHandler(manager, termination_config=config) as handler:
        assert handler.restore({"w": np.zeros(4, np.float32)}) is None
        state = {"w": jnp.zeros(4), "step": 0}
        while not handler.preempted:
            handler.save_checkpoint_if_preempted(state)  # before the chunk, as TensorFlow's
            if handler.preempted:
                break
            for _ in range(steps_per_call):
                state = {"w": state["w"] + 1, "step": state["step"] + 1}
            if handler.total_run_calls == 3:
                notice.set()
        (save,) = handler.saves
        run = save.run
        assert run >= 3 and manager.all_steps() == [run]
        final_cost = handler.grace_clock.save_cost(manager.engine.last_stats)
    # The final save's own time is kept beside the checkpoints (it is known
    # only once durable) and seeds the next run's margin.
    assert (directory / ".asyncckpt-preemption-timings.json").is_file()
    quiet = TerminationConfig(platform="other", exit_fn=lambda: None)
    with aj.CheckpointManager(directory) as manager, \
            PreemptionCheckpointHandler(manager, termination_config=quiet) as handler:
        restored = handler.restore({"w": np.zeros(4, np.float32), "step": 0})
        assert handler.total_run_calls == run
        assert int(restored["step"]) == steps_per_call * run
        np.testing.assert_array_equal(restored["w"], np.full(4, steps_per_call * run))
        meta = handler.checkpoint_metadata()["asyncckpt_preemption"]
        assert meta["total_run_calls"] == run and "save_s" in meta["estimates"]
        assert handler.grace_clock.final_samples()[0][0] == final_cost


def test_a_cluster_resolver_with_a_jax_manager_is_refused(tmp_path):
    """A cluster resolver describes a TensorFlow cluster; JAX processes agree through
    jax.distributed, so TensorFlow's call with a JAX manager is refused at once."""
    import asyncckpt.jax as aj
    from asyncckpt.preemption import PreemptionCheckpointHandler

    class Resolver:  # the interface of tf.distribute.cluster_resolver.ClusterResolver
        task_type, task_id = "worker", 0

        def cluster_spec(self):
            raise AssertionError("not to be asked")

    with aj.CheckpointManager(tmp_path / "ckpt") as manager, \
            pytest.raises(TypeError, match=r"through jax\.distributed"):
        PreemptionCheckpointHandler(Resolver(), manager)

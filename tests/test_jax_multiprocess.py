"""Two real JAX processes (jax.distributed on 127.0.0.1, 4 CPU devices each).

Each process writes only its addressable shards, into its own OCDBT database
(the default layout) in the shared temporary directory; process 0 merges the
databases and commits once both are done, coordinated through the
distributed key-value store. The checkpoint then restores in a two-process
run (onto another mesh), in this single process, and with orbax.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from tests.helpers import run_workers, subprocess_env, write_script  # noqa: E402
from tests.servers import free_port  # noqa: E402

WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pid, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
import asyncckpt.jax as aj
from asyncckpt.jax import _job, _ocdbt

assert jax.device_count() == 8 and jax.local_device_count() == 4
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))


def expected(step):
    return {
        "w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step,
        "bf": (np.arange(32) * step).astype(jnp.bfloat16),
        "rep": np.full((4, 3), step, np.int32),
        "host": np.arange(5, dtype=np.int64) * step,
        "step": step,
    }


def global_array(value, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def state(step):
    e = expected(step)
    return {"w": global_array(e["w"], P("a", "b")), "bf": global_array(e["bf"], P("a")),
            "rep": global_array(e["rep"], P()), "host": e["host"], "step": step}


class FailingDatabase(_ocdbt.DatabaseWriter):
    def put(self, key, data):
        if key.startswith("w/"):
            raise OSError(28, "No space left on device", key)
        return super().put(key, data)


class FaultyJob(_job.JaxSaveJob):
    # The real save job; its OCDBT databases are written by `database` when one is set.
    database = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if FaultyJob.database is not None:
            self.database_class = FaultyJob.database


class Manager(aj.CheckpointManager):
    _job_class = FaultyJob


out = {}
mgr = Manager(directory, max_to_keep=2, coordination_timeout_s=60)
for step in (1, 2, 3):
    mgr.save(step, state(step), custom_metadata={"by": "two processes"})
mgr.wait_until_finished()  # on process 1 too: returns once process 0 has committed
out["steps"] = mgr.all_steps()
out["nbytes"] = [s.nbytes for s in mgr.engine.history]

# A save that fails on process 1 fails on both, and leaves nothing behind.
if pid == 1:
    FaultyJob.database = FailingDatabase
mgr.save(4, state(4))
try:
    mgr.wait_until_finished()
    out["failure"] = None
except Exception as e:
    out["failure"] = f"{type(e).__name__}: {e}"
FaultyJob.database = None
out["steps_after_failure"] = mgr.all_steps()

# Staging that fails on process 1 only fails the save on process 0 too (no timeout).
bad = state(5)
if pid == 1:
    bad["oops"] = "not an array"
import time
t0 = time.monotonic()
try:
    mgr.save(5, bad)
    mgr.wait_until_finished()
    out["staging_failure"] = None
except Exception as e:
    out["staging_failure"] = f"{type(e).__name__}: {e}"
out["staging_failure_s"] = time.monotonic() - t0

# Restore onto another mesh spanning both processes: axes swapped, "w" sharded by rows only.
mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
e = expected(3)
target = {
    "w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh2, P(("x", "y")))),
    "bf": jax.ShapeDtypeStruct((32,), jnp.bfloat16, sharding=NamedSharding(mesh2, P("y"))),
    "rep": jax.ShapeDtypeStruct((4, 3), jnp.int32, sharding=NamedSharding(mesh2, P("x"))),
    "host": np.zeros(5, np.int64), "step": 0,
}
got = mgr.restore(target=target)
ok = got["step"] == 3 and np.array_equal(got["host"], e["host"])
for k in ("w", "bf", "rep"):
    for shard in got[k].addressable_shards:
        ok = ok and np.array_equal(np.asarray(shard.data), e[k][shard.index])
out["restored_ok"] = bool(ok)
out["custom"] = mgr.metadata(3).custom_metadata
mgr.close()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_two_processes_save_and_restore(tmp_path):
    directory = tmp_path / "ckpts"
    script = write_script(tmp_path, "worker.py", WORKER)
    port = str(free_port())
    env = subprocess_env(JAX_PLATFORMS="cpu")
    results = run_workers(script, [[str(i), port, str(directory)] for i in range(2)], env=env)
    p0, p1 = results
    assert p0["steps"] == p1["steps"] == [2, 3]
    assert p0["restored_ok"] and p1["restored_ok"]
    assert p0["custom"] == p1["custom"] == {"by": "two processes"}
    # Each process staged only its own shards: half of the sharded bytes each,
    # the replicated array, host values and metadata once (on the process holding replica 0).
    sharded = 16 * 8 * 4 + 32 * 2
    assert p1["nbytes"][0] < sharded
    assert p0["nbytes"][0] + p1["nbytes"][0] > sharded
    # The failure on process 1 failed step 4 on both processes, and nothing was left.
    assert "No space left on device" in p1["failure"], p1["failure"]
    assert "process 1" in p0["failure"] and "No space left" in p0["failure"], p0["failure"]
    assert p0["steps_after_failure"] == [2, 3]
    assert p1["staging_failure"].startswith("UnsupportedLeafError"), p1["staging_failure"]
    assert p0["staging_failure"].startswith("DistributedSaveError"), p0["staging_failure"]
    assert "UnsupportedLeafError" in p0["staging_failure"]
    assert p0["staging_failure_s"] < 30  # told by process 1, not a timeout (60 s here)
    leftovers = [n for n in os.listdir(directory) if n.startswith(".asyncckpt-tmp-")]
    assert not leftovers

    # The same checkpoint in a one-process run, onto this process's 8 devices.
    mesh = Mesh(np.array(jax.devices()), ("d",))
    target = {
        "w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("d"))),
        "bf": jax.ShapeDtypeStruct((32,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
        "rep": np.zeros((4, 3), np.int32),
        "host": np.zeros(5, np.int64),
        "step": 0,
    }
    with aj.CheckpointManager(directory) as mgr:
        got = mgr.restore(target=target)
        manifest_files = {f["name"] for f in json.loads(
            (directory / "3" / "asyncckpt.manifest.json").read_text())["files"]}
    np.testing.assert_array_equal(
        np.asarray(got["w"]), np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + 3
    )
    np.testing.assert_array_equal(np.asarray(got["bf"]), (np.arange(32) * 3).astype(jnp.bfloat16))
    np.testing.assert_array_equal(got["rep"], np.full((4, 3), 3, np.int32))
    assert got["step"] == 3
    # The manifest lists both processes' databases and the merged one.
    assert {"default/manifest.ocdbt", "default/ocdbt.process_0/manifest.ocdbt",
            "default/ocdbt.process_1/manifest.ocdbt"} <= manifest_files
    assert any(n.startswith("default/ocdbt.process_1/ocdbt_meta/") for n in manifest_files)

    # orbax reads it too.
    ocp = pytest.importorskip("orbax.checkpoint")
    orbax_mgr = ocp.CheckpointManager(str(directory))
    restored = orbax_mgr.restore(3, args=ocp.args.StandardRestore(
        {**target, "rep": jax.ShapeDtypeStruct((4, 3), jnp.int32,
                                               sharding=NamedSharding(mesh, P()))}))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(got["w"]))
    orbax_mgr.close()

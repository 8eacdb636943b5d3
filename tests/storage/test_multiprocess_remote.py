"""Two real JAX processes saving to the SeaweedFS S3 server, with no shared filesystem.

``jax.distributed`` on 127.0.0.1, 4 CPU devices per process. With an
``s3://`` directory each process stages its own shards in its own scratch
directory and uploads them; process 0 checks every object before the marker.
Faults are injected in process 1 by wrapping the real S3 store it opens: an
upload refused, and an upload silently lost. Each must fail the save on both
processes and leave no step listed. The same wrapper holds process 1's first
uploads until ``save()`` has returned: uploads belong to the background commit.
A second manager uses two tiers: a local directory both processes share,
uploaded by process 0 in the background; with the local copy gone, both
processes fetch the step from S3 at once. Saved in the zarr-file layout, whose
chunk files the faults and fetches below are about (OCDBT with several
processes on S3: tests/storage/test_jax_remote_ocdbt.py).
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt.storage.protocol import JAX_MARKER_NAME, list_committed  # noqa: E402
from asyncckpt.storage.stores import open_store  # noqa: E402
from tests.helpers import run_workers, subprocess_env, write_script  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tests.storage.conftest import BUCKET  # noqa: E402

WORKER = r"""
import json, os, shutil, sys, threading
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pid, port, url, shared, url2 = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
import asyncckpt.jax as aj
from asyncckpt._coordination import JaxCoordinator
from asyncckpt.storage import tier as tier_lib
from asyncckpt.storage.lazy import is_chunk

kv = JaxCoordinator.for_processes()
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))


def expected(step):
    return {"w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step,
            "bf": (np.arange(32) * step).astype(jnp.bfloat16),
            "host": np.arange(5, dtype=np.int64) * step, "step": step}


def state(step):
    e = expected(step)
    make = lambda v, spec: jax.make_array_from_callback(
        v.shape, NamedSharding(mesh, spec), lambda idx: v[idx])
    return {"w": make(e["w"], P("a", "b")), "bf": make(e["bf"], P("a")),
            "host": e["host"], "step": step}


def restored_ok(mgr, step):
    # Onto another mesh spanning both processes: every process needs both processes' shards.
    mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    target = {
        "w": jax.ShapeDtypeStruct((16, 8), jnp.float32,
                                  sharding=NamedSharding(mesh2, P(("x", "y")))),
        "bf": jax.ShapeDtypeStruct((32,), jnp.bfloat16, sharding=NamedSharding(mesh2, P("y"))),
        "host": np.zeros(5, np.int64), "step": 0}
    got, e = mgr.restore(step, target=target), expected(step)
    ok = got["step"] == step and np.array_equal(got["host"], e["host"])
    for k in ("w", "bf"):
        for shard in got[k].addressable_shards:
            ok = ok and np.array_equal(np.asarray(shard.data), e[k][shard.index])
    return bool(ok)


class FaultyStore:
    # Wraps the real S3 store of process 1: refuses or silently loses chosen uploads,
    # and holds step 1's uploads until save(1) has returned on the training thread.
    fault = None  # ("refuse" | "lose", key prefix)
    saved_1 = threading.Event()

    def __init__(self, inner):
        self._inner = inner
        self.url = inner.url

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def put_file(self, key, path):
        if key.startswith("1/") and not FaultyStore.saved_1.wait(60):
            raise RuntimeError("an upload held up save() on the training thread")
        if FaultyStore.fault is not None and key.startswith(FaultyStore.fault[1]):
            if FaultyStore.fault[0] == "refuse":
                raise PermissionError(f"injected: access denied to {key}")
            return  # "lose": reported as uploaded, never stored
        return self._inner.put_file(key, path)


if pid == 1:
    real_open = tier_lib.open_store
    tier_lib.open_store = lambda *a, **k: FaultyStore(real_open(*a, **k))

out = {}
PLAIN = aj.FormatOptions(use_ocdbt=False)
mgr = aj.CheckpointManager(url, max_to_keep=2, coordination_timeout_s=60, format_options=PLAIN)
assert str(mgr.directory) == url  # the manager reports its URL ...
scratch = mgr._tiers.local_dir  # ... and stages in its own scratch directory
out["scratch"] = scratch
for step in (1, 2, 3):
    mgr.save(step, state(step), custom_metadata={"by": "two processes"})
    FaultyStore.saved_1.set()  # uploads are part of the background commit
mgr.wait_until_finished()  # on process 1 too: returns once process 0 has committed
out["steps"] = mgr.all_steps()
out["nbytes"] = [s.nbytes for s in mgr.engine.history]
out["scratch_left"] = sorted(n for n in os.listdir(scratch) if n != ".asyncckpt.lock")

# A committed step saved again (force) is refused before any of its objects is overwritten.
mgr.save(3, state(30), force=True)
try:
    mgr.wait_until_finished()
    out["again"] = None
except Exception as e:
    out["again"] = f"{type(e).__name__}: {e}"

for step, fault in ((4, "refuse"), (5, "lose")):
    FaultyStore.fault = (fault, f"{step}/default/w/")
    mgr.save(step, state(step))
    try:
        mgr.wait_until_finished()
        out[fault] = None
    except Exception as e:
        out[fault] = f"{type(e).__name__}: {e}"
    FaultyStore.fault = None
    out[fault + "_steps"] = mgr.all_steps()
out["restored_ok"] = restored_ok(mgr, 3)
# What that restore fetched: the chunks of this process's regions (and its share of the rest).
lazy = mgr._tiers._dir._lazy["3"]
chunks = {n: r.size for n, r in lazy.records.items() if is_chunk(n)}
mine = sorted(n for n in lazy._fetched if n in chunks)
out["fetched"] = [sum(chunks[n] for n in mine), sum(chunks.values()), mine, sorted(chunks)]
out["custom"] = mgr.metadata(2).custom_metadata  # fetched: no scratch directory holds it
mgr.close()

# Two tiers: a shared local directory, uploaded by process 0 in the background.
mgr = aj.CheckpointManager(shared, remote=url2, coordination_timeout_s=60,
                           format_options=PLAIN)
mgr.save(7, state(7))
mgr.wait_until_finished()  # process 0: its upload is committed too
kv.barrier("uploaded", 60)
if pid == 0:
    shutil.rmtree(os.path.join(shared, "7"))  # the local copy is lost
kv.barrier("local-lost", 60)
out["two_tier_steps"] = mgr.all_steps()
out["two_tier_restored_ok"] = restored_ok(mgr, 7)  # both fetch it from S3 at once
mgr.close()
print("RESULT " + json.dumps(out), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_two_processes_save_to_s3_with_separate_scratch_directories(s3_server, tmp_path):
    run = uuid.uuid4().hex[:10]
    url, url2 = f"s3://{BUCKET}/mp-{run}", f"s3://{BUCKET}/mp2-{run}"
    shared = tmp_path / "shared"
    script = write_script(tmp_path, "worker.py", WORKER)
    port = str(free_port())
    results = run_workers(script, [[str(i), port, url, str(shared), url2] for i in range(2)],
                          env=subprocess_env(JAX_PLATFORMS="cpu"))
    p0, p1 = results

    # Separate scratch directories, which keep no step once it is committed: each
    # holds only its own process's files, never to be mistaken for a whole step.
    assert p0["scratch"] != p1["scratch"]
    assert p0["scratch_left"] == p1["scratch_left"] == []
    assert p0["steps"] == p1["steps"] == [2, 3]
    # Each process staged (and uploaded) only its own shards.
    sharded = 16 * 8 * 4 + 32 * 2
    assert p1["nbytes"][0] < sharded < p0["nbytes"][0] + p1["nbytes"][0]

    # Each process fetched the chunks its restore reads, not the whole step; between
    # them, every chunk was fetched (and CRC32-checked) by one of them at least.
    for p in (p0, p1):
        fetched, total, _, _ = p["fetched"]
        print(f"restore of step 3: fetched {fetched} of {total} chunk bytes")
        assert 0 < fetched < 0.75 * total, p["fetched"]
    assert set(p0["fetched"][2]) | set(p1["fetched"][2]) == set(p0["fetched"][3])
    for p in (p0, p1):
        assert "checkpoint 3 is already committed" in p["again"], p["again"]
    # An upload refused on process 1 fails the save on both processes.
    assert "injected: access denied to 4/default/w/" in p1["refuse"], p1["refuse"]
    assert "process 1" in p0["refuse"] and "access denied" in p0["refuse"], p0["refuse"]
    # An upload lost silently on process 1: process 0's check names the objects, everywhere.
    for p in (p0, p1):
        assert "missing" in p["lose"] and "5/default/w/" in p["lose"], p["lose"]
        assert p["refuse_steps"] == p["lose_steps"] == [2, 3]
        assert p["restored_ok"] and p["two_tier_restored_ok"]
        assert p["custom"] == {"by": "two processes"}
        assert p["two_tier_steps"] == [7]

    store = open_store(url)
    assert [c.name for c in list_committed(store)] == ["2", "3"]
    # The manifest lists both processes' chunk files, and each is there with its size.
    manifest = json.loads(store.get("3/asyncckpt.manifest.json"))
    sizes = {o.key: o.size for o in store.list("3/")}
    assert {f"default/w/{i}.{j}" for i in range(4) for j in range(2)} <= {
        f["name"] for f in manifest["files"]}
    assert all(sizes[f"3/{f['name']}"] == f["size"] for f in manifest["files"])
    keys = {o.key for o in store.list()}
    assert not any(k.endswith(JAX_MARKER_NAME) and k[0] in "45" for k in keys)
    assert [c.name for c in list_committed(open_store(url2))] == ["7"]

    # A fresh single process (8 devices here) restores the step exactly from S3.
    mesh = Mesh(np.array(jax.devices()), ("d",))
    target = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32,
                                        sharding=NamedSharding(mesh, P("d"))),
              "bf": np.zeros(32, jnp.bfloat16), "host": np.zeros(5, np.int64), "step": 0}
    with aj.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [2, 3]
        got = mgr.restore(target=target)
    np.testing.assert_array_equal(np.asarray(got["w"]),
                                  np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + 3)
    np.testing.assert_array_equal(got["bf"], (np.arange(32) * 3).astype(jnp.bfloat16))
    np.testing.assert_array_equal(got["host"], np.arange(5) * 3)
    assert got["step"] == 3

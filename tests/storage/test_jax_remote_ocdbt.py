"""OCDBT checkpoints (the default layout) in an object store: one process, and two.

With an ``s3://`` directory each process writes its OCDBT database in its own
scratch directory and uploads it; process 0 fetches the other processes'
B-tree nodes (never their data files), merges, uploads the merged root and
commits. Real SeaweedFS, real ``jax.distributed`` processes on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import uuid

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt.storage.protocol import list_committed  # noqa: E402
from asyncckpt.storage.stores import open_store  # noqa: E402
from tests.helpers import run_workers, subprocess_env, write_script  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tests.storage.conftest import BUCKET  # noqa: E402


def _items(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"params": {"w": jnp.asarray(rng.standard_normal((128, 64), dtype=np.float32))},
            "opt": {"m": jnp.asarray(rng.standard_normal((128, 64), dtype=np.float32)),
                    "count": step}}


def test_one_process_ocdbt_in_s3_restores_and_fetches_only_the_items_read(s3_server):
    url = f"s3://{BUCKET}/ocdbt-{uuid.uuid4().hex[:10]}"
    with aj.CheckpointManager(url, max_to_keep=2) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.Composite(
                **{k: ocp.args.StandardSave(v) for k, v in _items(step).items()}))
        mgr.wait_until_finished()
    store = open_store(url)
    assert [c.name for c in list_committed(store)] == ["1", "2"]
    keys = {o.key for o in store.list("2/")}
    assert {"2/params/manifest.ocdbt", "2/opt/manifest.ocdbt",
            "2/params/ocdbt.process_0/manifest.ocdbt"} <= keys
    with aj.CheckpointManager(url) as mgr:  # a fresh scratch directory: only S3 has them
        remote = mgr._tiers._dir.remote.store
        fetched: list[str] = []
        lock = threading.Lock()

        class Counting(type(remote)):
            def get_file(self, key, path):
                with lock:
                    fetched.append(key)
                return super().get_file(key, path)

        remote.__class__ = Counting
        got = mgr.restore(2, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_items(0)["params"])))
        np.testing.assert_array_equal(np.asarray(got.params["w"]),
                                      np.asarray(_items(2)["params"]["w"]))
        # The item's data files, not the other item's (only its small B-tree nodes,
        # fetched with every step's metadata).
        assert any(k.startswith("2/params/ocdbt.process_0/ocdbt_data/") for k in fetched)
        assert not any(k.startswith("2/opt/") and "/ocdbt_data/" in k for k in fetched), fetched
        got = mgr.restore(args=ocp.args.Composite(
            opt=ocp.args.StandardRestore(_items(0)["opt"])))
        assert got.opt["count"] == 2


WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pid, port, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
import asyncckpt.jax as aj
from asyncckpt.storage import shards as shards_lib

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
downloaded = []
real_download = shards_lib.ShardUploader.download


def download(self, name, directory, records):  # the real one, noting what it fetched
    downloaded.extend(r.name for r in records)
    return real_download(self, name, directory, records)


shards_lib.ShardUploader.download = download


def expected(step):
    return np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + step


def state(step):
    w = jax.make_array_from_callback((64, 64), NamedSharding(mesh, P("a", "b")),
                                     lambda idx: expected(step)[idx])
    return {"w": w, "step": step}


mgr = aj.CheckpointManager(url, max_to_keep=2, coordination_timeout_s=60)
for step in (1, 2):
    mgr.save(step, state(step))
mgr.wait_until_finished()
out = {"steps": mgr.all_steps(), "downloaded": downloaded}
mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
target = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32,
                                    sharding=NamedSharding(mesh2, P("y", "x"))), "step": 0}
got = mgr.restore(target=target)
ok = got["step"] == 2
for shard in got["w"].addressable_shards:
    ok = ok and np.array_equal(np.asarray(shard.data), expected(2)[shard.index])
out["restored_ok"] = bool(ok)
mgr.close()
print("RESULT " + json.dumps(out), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_two_processes_save_ocdbt_to_s3_without_a_shared_directory(s3_server, tmp_path):
    url = f"s3://{BUCKET}/ocdbt-mp-{uuid.uuid4().hex[:10]}"
    script = write_script(tmp_path, "worker.py", WORKER)
    port = str(free_port())
    p0, p1 = run_workers(script, [[str(i), port, url] for i in range(2)],
                         env=subprocess_env(JAX_PLATFORMS="cpu"))
    assert p0["steps"] == p1["steps"] == [1, 2]
    assert p0["restored_ok"] and p1["restored_ok"]
    # Process 0 fetched process 1's manifests and B-tree nodes only, never its data.
    assert p0["downloaded"] and p1["downloaded"] == []
    assert all(n.startswith("default/ocdbt.process_1/") and "/ocdbt_data/" not in n
               for n in p0["downloaded"]), p0["downloaded"]
    store = open_store(url)
    manifest = json.loads(store.get("2/asyncckpt.manifest.json"))
    names = {f["name"] for f in manifest["files"]}
    assert {"default/manifest.ocdbt", "default/ocdbt.process_0/manifest.ocdbt",
            "default/ocdbt.process_1/manifest.ocdbt"} <= names
    sizes = {o.key: o.size for o in store.list("2/")}
    assert all(sizes[f"2/{f['name']}"] == f["size"] for f in manifest["files"])
    # One process, another device count, restores it exactly from S3.
    mesh = Mesh(np.array(jax.devices()), ("d",))
    with aj.CheckpointManager(url) as mgr:
        got = mgr.restore(target={"w": jax.ShapeDtypeStruct(
            (64, 64), jnp.float32, sharding=NamedSharding(mesh, P("d"))), "step": 0})
    np.testing.assert_array_equal(np.asarray(got["w"]),
                                  np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + 2)

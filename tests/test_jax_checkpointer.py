"""asyncckpt.jax.StandardCheckpointer and orbax's other checkpointer spellings.

One pytree to one path through the manager's engine; every restore is done
with asyncckpt's checkpointer and with orbax's own.
"""

from __future__ import annotations

import errno
import json
import os
import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt import CorruptCheckpointError, layout  # noqa: E402
from asyncckpt._engine import files as files_lib  # noqa: E402
from asyncckpt._engine.manifest import OWNER_MARKER  # noqa: E402
from asyncckpt.jax import _job, _ocdbt  # noqa: E402
from tests.helpers import flip_byte  # noqa: E402

ts = pytest.importorskip("tensorstore")
# What asyncckpt adds at the top of a checkpoint, beside orbax's files.
_OURS = {layout.JAX_MANIFEST_NAME, OWNER_MARKER}


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _state():
    mesh = _mesh((4, 2), ("a", "b"))
    return {
        "params": {
            "w": jax.device_put(jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8),
                                NamedSharding(mesh, P("a", "b"))),
            "bf": jax.device_put(jnp.arange(32, dtype=jnp.bfloat16), NamedSharding(mesh, P("a"))),
        },
        "host": np.arange(5, dtype=np.int64),
        "scalar_array": np.array(1.5, np.float32),
        "step": 7,
        "lr": 0.25,
    }


def _values(tree):
    return jax.tree.map(lambda a: np.asarray(a).copy(), tree)


def _abstract(tree, mesh=None, spec=None):
    """The target of a restore: jax.Arrays onto ``mesh`` (or their own sharding)."""
    def one(a):
        if isinstance(a, jax.Array):
            sharding = a.sharding if mesh is None else NamedSharding(mesh, spec or P())
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        return a
    return jax.tree.map(one, tree)


def _assert_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _orbax_restore(path, target):
    with ocp.StandardCheckpointer() as c:
        return c.restore(path, target)


def _keys(path) -> list[str]:
    """The keys of the OCDBT database at ``path`` (its root database: every process's)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    return sorted(k.decode() for k in kv.list().result())


def _is_ocdbt(path) -> bool:
    """Whether the checkpoint at ``path`` is OCDBT (else zarr files), checked both ways."""
    ocdbt = json.loads((path / "_METADATA").read_text())["use_ocdbt"]
    assert (path / "manifest.ocdbt").is_file() is ocdbt
    leaf_dirs = [n for n in os.listdir(path) if (path / n / ".zarray").is_file()]
    assert bool(leaf_dirs) is not ocdbt, leaf_dirs
    return ocdbt


def _gated_checkpointer():
    """A StandardCheckpointer whose background writes wait while the returned event is
    clear (it starts set); ``entered`` is set by each write that reached it."""
    gate, entered = threading.Event(), threading.Event()
    gate.set()

    class GatedJob(_job.JaxSaveJob):  # the real job, its write held
        def write(self):
            entered.set()
            assert gate.wait(60), "the test never opened the gate"
            super().write()

    class Gated(aj.StandardCheckpointer):
        _job_class = GatedJob

    return Gated(), gate, entered


def test_sharded_state_saved_async_restores_resharded_with_asyncckpt_and_orbax(tmp_path):
    state = _state()
    want = _values(state)
    path = tmp_path / "ckpt"
    with aj.StandardCheckpointer() as ckptr:
        assert isinstance(ckptr, ocp.AbstractCheckpointer)
        ckptr.prepare(state)
        ckptr.save(path, state, custom_metadata={"run": "a"})
        # The values are those at the call: the arrays may be donated at once.
        bump = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
        state["params"] = bump(state["params"])
        other = _mesh((8,), ("x",))
        got = ckptr.restore(path, _abstract(want | {"params": state["params"]}, other, P("x")))
        _assert_equal(got, want)
        assert got["params"]["w"].sharding.spec == P("x")
        meta = ckptr.metadata(path)
        assert meta.custom_metadata == {"run": "a"} and meta.step is None
        assert meta.item_metadata["params"]["w"] == jax.ShapeDtypeStruct((16, 8), jnp.float32)
        assert meta.item_handlers == ocp.StandardCheckpointHandler().typestr()
    assert _is_ocdbt(path)  # orbax's default
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporaries left beside it
    target = _abstract(_state(), _mesh((2, 4), ("p", "q")), P("q"))
    by_orbax = _orbax_restore(path, target)
    _assert_equal(by_orbax, want)
    with ocp.StandardCheckpointer() as c:
        assert c.metadata(path).custom_metadata == {"run": "a"}


def test_restores_what_orbax_wrote(tmp_path):
    state = _state()
    want = _values(state)
    with ocp.StandardCheckpointer() as c:  # OCDBT, orbax's default
        c.save(tmp_path / "std", state)
    with ocp.PyTreeCheckpointer(use_ocdbt=False) as c:  # plain zarr, compressed
        c.save(tmp_path / "zarr", state)
    target = _abstract(state, _mesh((8,), ("x",)), P("x"))
    with aj.StandardCheckpointer() as ckptr:
        for name in ("std", "zarr"):
            _assert_equal(ckptr.restore(tmp_path / name, target), want)
            _assert_equal(_orbax_restore(tmp_path / name, target), want)
        meta = ckptr.metadata(tmp_path / "std")
        assert meta.item_metadata["params"]["bf"].shape == (32,)


def _zarray(path, param) -> dict:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    return json.loads(kv.read(f"{param}/.zarray").result().value)


def test_checkpointers_write_ocdbt_unless_told_not_to(tmp_path):
    """orbax's ``use_ocdbt``, however it is given: a keyword, or the handler's setting."""
    state = _state()
    want = _values(state)
    ours, theirs = tmp_path / "ours", tmp_path / "orbax"
    with ocp.StandardCheckpointer() as c:  # orbax's own: OCDBT by default
        c.save(theirs, state)
    with aj.StandardCheckpointer() as c:
        c.save(ours, state)
    # orbax's checkpointer layout at the top of the path, but for the documented
    # differences: B-tree nodes in ocdbt_meta/ (values in ocdbt_data/; orbax mixes
    # both in d/), and no array_metadatas/.
    assert (set(os.listdir(ours)) - _OURS - {"ocdbt_meta"}
            == set(os.listdir(theirs)) - {"d", "array_metadatas"})
    assert {"_METADATA", "_sharding", "manifest.ocdbt", "ocdbt.process_0",
            "commit_success.txt"} <= set(os.listdir(ours))
    assert not (ours / "params.w").exists()  # no directory per array
    # The same arrays, zarr v2 in the database, uncompressed here (orbax: zstd).
    assert ([k for k in _keys(ours) if k.endswith("/.zarray")]
            == [k for k in _keys(theirs) if k.endswith("/.zarray")])
    assert _zarray(ours, "params.w")["compressor"] is None
    # Every file, at every depth, is in the manifest by its name, with its checksum.
    files = {os.path.relpath(os.path.join(d, f), ours).replace(os.sep, "/")
             for d, _, fs in os.walk(ours) for f in fs}
    records = json.loads((ours / layout.JAX_MANIFEST_NAME).read_text())["files"]
    assert {r["name"] for r in records} == files - {layout.JAX_MANIFEST_NAME}
    assert all(r.get("crc32c") or r.get("crc32") for r in records)
    target = _abstract(state, _mesh((8,), ("x",)), P("x"))
    with aj.StandardCheckpointer() as c:
        _assert_equal(c.restore(ours, target), want)
    _assert_equal(_orbax_restore(ours, target), want)

    tree = {"w": jnp.arange(1024.0), "n": np.arange(3, dtype=np.int32)}
    cases = {
        "keyword_false": (lambda: aj.StandardCheckpointer(use_ocdbt=False), False),
        "pytree_default": (aj.PyTreeCheckpointer, True),
        "pytree_false": (lambda: aj.PyTreeCheckpointer(use_ocdbt=False), False),
        "handler_false": (lambda: aj.AsyncCheckpointer(
            ocp.StandardCheckpointHandler(use_ocdbt=False)), False),
        "handler_true": (lambda: aj.Checkpointer(
            ocp.PyTreeCheckpointHandler(use_ocdbt=True)), True),
    }
    for name, (make, ocdbt) in cases.items():
        with make() as c:
            c.save(tmp_path / name, tree)
            _assert_equal(c.restore(tmp_path / name, _abstract(tree)), _values(tree))
        assert _is_ocdbt(tmp_path / name) is ocdbt, name
        _assert_equal(_orbax_restore(tmp_path / name, _abstract(tree)), _values(tree))
    with pytest.raises(TypeError, match="use_ocdbt"):
        aj.PyTreeCheckpointer(use_ocdbt="no")


def test_ocdbt_target_data_file_size_and_save_args_chunks(tmp_path):
    rows = np.random.default_rng(0).random((64, 1024), dtype=np.float32)  # 256 KiB, one shard
    tree = {"rows": jnp.asarray(rows), "v": jnp.arange(4096.0)}
    want = _values(tree)
    target = 64 << 10
    with aj.PyTreeCheckpointer() as c:
        c.save(tmp_path / "split", args=ocp.args.PyTreeSave(
            tree, ocdbt_target_data_file_size=target))
        # Its SaveArgs' chunks (before, the checkpointers dropped them).
        c.save(tmp_path / "chunked", args=ocp.args.PyTreeSave(tree, save_args={
            "rows": ocp.SaveArgs(chunk_byte_size=32 << 10), "v": ocp.SaveArgs()}))
        with pytest.raises(ValueError, match="one pytree"):
            c.save(tmp_path / "x", args=ocp.args.Composite(a=ocp.args.PyTreeSave(tree)))
    split = tmp_path / "split"
    assert _zarray(split, "rows")["chunks"] == [16, 1024]  # 64 KiB pieces of the one shard
    assert [k for k in _keys(split) if k.startswith("rows/") and k[-1].isdigit()] == [
        f"rows/{i}.0" for i in range(4)]
    data = list((split / "ocdbt.process_0" / "ocdbt_data").iterdir())
    assert len(data) > 3 and all(f.stat().st_size <= 2 * target for f in data)
    chunks = _zarray(tmp_path / "chunked", "rows")["chunks"]
    assert chunks != [64, 1024] and np.prod(chunks) * 4 <= 32 << 10
    with aj.StandardCheckpointer() as c:
        for name in ("split", "chunked"):
            _assert_equal(c.restore(tmp_path / name, _abstract(tree)), want)
            _assert_equal(_orbax_restore(tmp_path / name, _abstract(tree)), want)
    # Without OCDBT there are no data files to size: the target has nothing to apply to,
    # as in orbax (MaxText passes one whatever its use_ocdbt).
    with aj.PyTreeCheckpointer(use_ocdbt=False) as c:
        c.save(tmp_path / "y", args=ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=target))
    assert not list((tmp_path / "y").glob("ocdbt*")) and not (tmp_path / "y" / "d").exists()
    _assert_equal(_orbax_restore(tmp_path / "y", _abstract(tree)), want)


def test_existing_destination_raises_and_force_replaces_it_once_the_new_one_is_durable(
    tmp_path
):
    path = tmp_path / "ckpt"
    old = {"w": jnp.zeros(8), "n": 1}
    new = {"w": jnp.ones(8), "n": 2}
    ckptr, gate, entered = _gated_checkpointer()
    with ckptr:
        ckptr.save(path, old)
        with pytest.raises(ValueError, match="already exists"):
            ckptr.save(path, new)  # still in flight, or already there: as orbax, refused
        ckptr.wait_until_finished()
        with pytest.raises(ValueError, match="already exists"):
            ckptr.save(path, new)
        gate.clear()
        entered.clear()
        try:
            ckptr.save(path, new, force=True)  # returns while its write is held
            assert entered.wait(30)
            # The old checkpoint is still there, whole, while the new one is written.
            _assert_equal(_orbax_restore(path, _abstract(old)), _values(old))
            # restore() of the path waits for its save.
            result = {}
            reader = threading.Thread(
                target=lambda: result.setdefault("got", ckptr.restore(path, _abstract(new))))
            reader.start()
            reader.join(0.5)
            assert reader.is_alive()
        finally:
            gate.set()
        reader.join(60)
        _assert_equal(result["got"], _values(new))
    _assert_equal(_orbax_restore(path, _abstract(new)), _values(new))
    assert _is_ocdbt(path)
    assert os.listdir(tmp_path) == ["ckpt"]  # the replaced one is gone, no temporaries


class _DiskFullWriter(files_lib.DurableWriter):
    """The real writer, except that chunk files of the array `w` hit a full disk."""

    def write(self, name, chunks):
        if name.startswith("w/"):
            raise OSError(errno.ENOSPC, "No space left on device", name)
        return super().write(name, chunks)


class _DiskFullDatabase(_ocdbt.DatabaseWriter):
    """The real OCDBT writer, except that values of the array `w` hit a full disk."""

    def put(self, key, data):
        if key.startswith("w/"):
            raise OSError(errno.ENOSPC, "No space left on device", key)
        return super().put(key, data)


@pytest.mark.parametrize("ocdbt", [False, True], ids=["zarr", "ocdbt"])
def test_a_failed_background_write_is_raised_and_leaves_nothing(tmp_path, ocdbt):
    full = threading.Event()

    class DiskFullJob(_job.JaxSaveJob):  # the real job, on a full disk while `full` is set
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            if full.is_set() and ocdbt:
                self.database_class = _DiskFullDatabase
            elif full.is_set():
                self.transaction.writer_class = _DiskFullWriter

    class DiskFull(aj.StandardCheckpointer):
        _job_class = DiskFullJob

    full.set()
    ckptr = DiskFull(use_ocdbt=ocdbt)
    ckptr.save(tmp_path / "ckpt", {"w": jnp.arange(64.0), "n": 1})  # staging succeeds
    with pytest.raises(OSError) as err:
        ckptr.wait_until_finished()
    assert err.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        ckptr.restore(tmp_path / "ckpt")
    full.clear()  # the disk has room again
    ckptr.save(tmp_path / "ckpt", {"w": jnp.arange(64.0), "n": 1})  # the path is free
    ckptr.close()
    assert ckptr.restore(tmp_path / "ckpt")["n"] == 1
    assert _orbax_restore(tmp_path / "ckpt", {"w": jnp.zeros(64), "n": 0})["n"] == 1
    assert _is_ocdbt(tmp_path / "ckpt") is ocdbt


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc")
def test_a_damaged_ocdbt_data_file_fails_the_restore_naming_it(tmp_path):
    big = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)  # 4 MiB
    state = {"w": jnp.asarray(big), "v": jnp.ones(1024)}  # 4 KiB and more: not inline
    path = tmp_path / "ckpt"
    with aj.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
        ckptr.wait_until_finished()
        before = _bytes_read()
        _assert_equal(ckptr.restore(path, _abstract(state)), _values(state))
        # Each data file is read once, checksummed as it is read (not in a second pass).
        assert _bytes_read() - before < big.nbytes * 3 // 2
    _assert_equal(_orbax_restore(path, _abstract(state)), _values(state))
    manifest = json.loads((path / layout.JAX_MANIFEST_NAME).read_text())
    data = sorted((path / "ocdbt.process_0" / "ocdbt_data").iterdir())
    assert data and {f"ocdbt.process_0/ocdbt_data/{f.name}" for f in data} <= {
        f["name"] for f in manifest["files"]}
    flip_byte(data[0])
    with aj.StandardCheckpointer() as ckptr:
        with pytest.raises(CorruptCheckpointError) as err:
            ckptr.restore(path, _abstract(state))
        assert err.value.file == str(data[0]) and str(data[0]) in str(err.value)
        flip_byte(data[0])  # undone: the checkpoint restores again
        _assert_equal(ckptr.restore(path, _abstract(state)), _values(state))


def test_a_damaged_file_fails_the_restore_naming_it(tmp_path):
    state = {"w": jnp.arange(64.0), "v": jnp.ones(4)}
    with aj.StandardCheckpointer(use_ocdbt=False) as ckptr:  # a file per chunk
        ckptr.save(tmp_path / "a", state)
        ckptr.save(tmp_path / "b", state)
    # Array metadata that still parses, but describes other bytes (float32 -> int32).
    zarray = tmp_path / "a" / "w" / ".zarray"
    zarray.write_text(zarray.read_text().replace('"<f4"', '"<i4"'))
    chunk = tmp_path / "b" / "v" / "0"
    chunk.write_bytes(b"\xff" + chunk.read_bytes()[1:])
    with aj.StandardCheckpointer() as ckptr:
        for name, damaged in (("a", zarray), ("b", chunk)):
            with pytest.raises(CorruptCheckpointError) as err:
                ckptr.restore(tmp_path / name, _abstract(state))
            assert str(damaged) in str(err.value)
        # A partial restore reads and checks only what it restores.
        part = ckptr.restore(tmp_path / "b", args=ocp.args.PyTreeRestore(
            {"w": jax.ShapeDtypeStruct((64,), jnp.float32)}, partial_restore=True))
        _assert_equal(part, {"w": np.arange(64.0, dtype=np.float32)})


def test_orbax_checkpointer_spellings(tmp_path):
    tree = {"a": jnp.arange(6.0), "b": {"c": np.arange(3, dtype=np.int32), "d": 4}}
    want = _values(tree)

    with aj.AsyncCheckpointer(ocp.StandardCheckpointHandler(), timeout_secs=60) as c:
        c.save(tmp_path / "std", args=ocp.args.StandardSave(tree))
        got = c.restore(tmp_path / "std", args=ocp.args.StandardRestore(_abstract(tree)))
        _assert_equal(got, want)
        assert type(c.handler).__name__ == "StandardCheckpointHandler"

    # A PyTree handler: partial restores and restore_args, in orbax's forms.
    with aj.AsyncCheckpointer(ocp.PyTreeCheckpointHandler()) as c:
        c.save(tmp_path / "pytree", tree)
        part = c.restore(tmp_path / "pytree", args=ocp.args.PyTreeRestore(
            {"b": {"c": np.zeros(3, np.int32)}}, partial_restore=True))
        _assert_equal(part, {"b": {"c": want["b"]["c"]}})
        by_args = c.restore(tmp_path / "pytree", item=None, restore_args=jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
        _assert_equal(by_args, jax.tree.map(np.asarray, want))

    # The synchronous ones return once the checkpoint is durable and published.
    with aj.PyTreeCheckpointer() as c:
        c.save(tmp_path / "sync", tree)
        assert (tmp_path / "sync" / layout.JAX_MANIFEST_NAME).exists()
        assert c.engine.pending == 0
    with aj.Checkpointer(ocp.StandardCheckpointHandler()) as c:
        c.save(tmp_path / "sync2", item=tree)
        assert (tmp_path / "sync2" / layout.JAX_MANIFEST_NAME).exists()
        _assert_equal(c.restore(tmp_path / "sync2", _abstract(tree)), want)

    for name in ("std", "pytree", "sync", "sync2"):
        _assert_equal(_orbax_restore(tmp_path / name, _abstract(tree)), want)

    # A NumPy scalar leaf: a 0-d array on disk, as orbax writes it; a target leaf here too.
    with aj.StandardCheckpointer() as c:
        c.save(tmp_path / "np", {"s": np.float32(1.5)})
        assert c.restore(tmp_path / "np", {"s": np.float32(0)}) == {"s": np.float32(1.5)}
    _assert_equal(_orbax_restore(tmp_path / "np", {"s": np.zeros((), np.float32)}),
                  {"s": np.array(1.5, np.float32)})
    handlers = {name: json.loads((tmp_path / name / "_CHECKPOINT_METADATA").read_text())[
        "item_handlers"].rsplit(".", 1)[1] for name in ("std", "pytree")}
    assert handlers == {"std": "StandardCheckpointHandler", "pytree": "PyTreeCheckpointHandler"}


def test_orbax_options_honoured_or_refused_at_construction(tmp_path):
    calls = []
    opts = ocp.AsyncOptions(timeout_secs=30, post_finalization_callback=lambda: calls.append(1))
    commit_file = ocp.path.atomicity.CommitFileTemporaryPath
    with aj.StandardCheckpointer(async_options=opts, temporary_path_class=commit_file) as c:
        c.save(tmp_path / "a", {"w": jnp.ones(3)})
        c.wait_until_finished()
        assert calls == [1]  # once the checkpoint is published
    with ocp.StandardCheckpointer(temporary_path_class=commit_file) as c:
        _assert_equal(c.restore(tmp_path / "a", {"w": jnp.zeros(3)}), {"w": np.ones(3, "f4")})

    refused = {
        "use_compression": lambda: aj.PyTreeCheckpointer(use_compression=True),
        "primary_host": lambda: aj.StandardCheckpointer(
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=1)),
        "temporary_path_class": lambda: aj.StandardCheckpointer(
            temporary_path_class=type("MyPath", (commit_file,), {})),
        "barrier_sync_fn": lambda: aj.StandardCheckpointer(
            async_options=ocp.AsyncOptions(barrier_sync_fn=lambda **kw: None)),
    }
    for name, make in refused.items():
        with pytest.raises(ValueError, match=name):
            make()
    with aj.StandardCheckpointer() as c:
        with pytest.raises(ValueError, match="strict=False"):
            c.restore(tmp_path / "a", {"w": jnp.zeros(3)}, strict=False)
        with pytest.raises(ValueError, match="CheckpointManager"):
            c.save("gs://bucket/x", {"w": jnp.ones(3)})
        with pytest.raises(ValueError, match="Composite"):
            c.save(tmp_path / "b", args=ocp.args.Composite(w=ocp.args.StandardSave({})))


WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pid, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
import asyncckpt.jax as aj

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
state = {"w": jax.make_array_from_callback(w.shape, NamedSharding(mesh, P("a", "b")),
                                           lambda idx: w[idx]),
         "host": np.arange(5, dtype=np.int64), "step": 3}
out = {}
for name, ocdbt in (("ckpt", True), ("zarr", False)):  # orbax's default, then zarr files
    path = os.path.join(root, name)
    with aj.StandardCheckpointer(coordination_timeout_s=60, use_ocdbt=ocdbt) as ckptr:
        ckptr.save(path, state)
        try:
            ckptr.save(path, state)  # in flight or published: refused
        except ValueError as e:
            out[f"{name}.exists"] = "already exists" in str(e)
        ckptr.wait_until_finished()  # on process 1 too: returns once process 0 has committed
        out[f"{name}.published"] = os.path.isdir(path)
        mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
        target = {"w": jax.ShapeDtypeStruct(w.shape, jnp.float32,
                                            sharding=NamedSharding(mesh2, P(("x", "y")))),
                  "host": np.zeros(5, np.int64), "step": 0}
        got = ckptr.restore(path, target)
        out[f"{name}.restored"] = bool(got["step"] == 3 and all(
            np.array_equal(np.asarray(s.data), w[s.index]) for s in got["w"].addressable_shards))
        out[f"{name}.nbytes"] = ckptr.last_save.result().nbytes
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_two_processes_save_one_checkpoint_each_its_own_shards(tmp_path):
    from tests.helpers import run_workers, subprocess_env, write_script
    from tests.servers import free_port

    script = write_script(tmp_path, "worker.py", WORKER)
    port = str(free_port())
    root = tmp_path / "shared"
    results = run_workers(script, [[str(i), port, str(root)] for i in range(2)],
                          env=subprocess_env(JAX_PLATFORMS="cpu"))
    for r in results:
        for name in ("ckpt", "zarr"):
            assert all(r[f"{name}.{k}"] for k in ("exists", "published", "restored")), results
    for name in ("ckpt", "zarr"):  # process 1 staged only its half of "w"
        assert results[1][f"{name}.nbytes"] < 16 * 8 * 4
    assert sorted(os.listdir(root)) == ["ckpt", "zarr"]
    names = {name: {f["name"] for f in json.loads(
        (root / name / layout.JAX_MANIFEST_NAME).read_text())["files"]}
        for name in ("ckpt", "zarr")}
    # OCDBT: each process wrote its database; process 0 merged them into the root one.
    assert {"manifest.ocdbt", "ocdbt.process_0/manifest.ocdbt",
            "ocdbt.process_1/manifest.ocdbt"} <= names["ckpt"]
    assert [k for k in _keys(root / "ckpt") if k.startswith("w/")] == ["w/.zarray"] + [
        f"w/{i}.{j}" for i in range(4) for j in range(2)]
    assert {f"w/{i}.{j}" for i in range(4) for j in range(2)} <= names["zarr"]
    assert json.loads((root / "ckpt" / layout.JAX_MANIFEST_NAME).read_text())[
        "extra"]["num_processes"] == 2
    target = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32,
                                        sharding=NamedSharding(_mesh((8,), ("d",)), P("d"))),
              "host": np.zeros(5, np.int64), "step": 0}
    want = {"w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8),
            "host": np.arange(5, dtype=np.int64), "step": 3}
    with aj.StandardCheckpointer() as ckptr:
        for name in ("ckpt", "zarr"):
            _assert_equal(ckptr.restore(root / name, target), want)
            _assert_equal(_orbax_restore(root / name, target), want)

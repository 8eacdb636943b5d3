"""orbax's OCDBT format (the default): asyncckpt writes it; orbax, TensorStore and it read it."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
ts = pytest.importorskip("tensorstore")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt import CorruptCheckpointError  # noqa: E402
from asyncckpt._engine import datafile, fastcrc  # noqa: E402
from asyncckpt.jax import _ocdbt  # noqa: E402
from tests.helpers import flip_byte  # noqa: E402

PLAIN = aj.FormatOptions(use_ocdbt=False)


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _state(step: int = 0) -> dict:
    """Shards of w hold 2 KiB (values of 1 KiB or less sit inline in the B-tree nodes)."""
    mesh = _mesh((4, 2), ("a", "b"))
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + step
    return {
        "params": {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),
                   "bf": jax.device_put(jnp.arange(32, dtype=jnp.bfloat16) * (step + 1),
                                        NamedSharding(mesh, P("a"))),
                   "rep": jax.device_put(np.full((4, 5), step, np.int32),
                                         NamedSharding(mesh, P()))},
        "host": np.arange(6, dtype=np.int64) + step,
        "step": step,
        "empty": {},
    }


def _abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, tree)


def _same(expected, got) -> None:
    assert jax.tree.structure(expected) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _files(step_dir) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), step_dir).replace(os.sep, "/")
            for d, _, fs in os.walk(step_dir) for f in fs}


def _keys(database_dir) -> list[str]:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{database_dir}/"}).result()
    return sorted(k.decode() for k in kv.list().result())


def _zarray(database_dir, param) -> dict:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{database_dir}/"}).result()
    return json.loads(kv.read(f"{param}/.zarray").result().value)


def test_default_layout_is_orbax_ocdbt_and_both_libraries_read_it(ckpt_dir):
    state = _state(1)
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
    step_dir = ckpt_dir / "1"
    files = _files(step_dir)
    item = step_dir / "default"
    # orbax's layout: one database per process, merged into the item's root database.
    assert {"default/manifest.ocdbt", "default/ocdbt.process_0/manifest.ocdbt",
            "default/_METADATA", "default/_sharding"} <= files
    assert not (item / "params.w").exists()  # no file per shard
    data = [f for f in files if "/ocdbt_data/" in f]
    assert len(data) == 1 and len(files) < 15, files
    assert json.loads((item / "_METADATA").read_text())["use_ocdbt"] is True
    # The keys are zarr v2 arrays: one chunk per shard with replica 0, uncompressed.
    keys = _keys(item)
    assert [k for k in keys if k.startswith("params.w/")] == (
        ["params.w/.zarray"] + [f"params.w/{i}.{j}" for i in range(4) for j in range(2)])
    assert [k for k in keys if k.startswith("params.rep/")] == ["params.rep/.zarray",
                                                                "params.rep/0.0"]
    meta = _zarray(item, "params.w")
    assert meta["compressor"] is None and meta["chunks"] == [16, 32]
    # Every file is in the manifest, with its checksum.
    manifest = json.loads((step_dir / "asyncckpt.manifest.json").read_text())
    algorithm = "crc32c" if fastcrc.available() else "crc32"
    by_name = {f["name"]: f for f in manifest["files"]}
    assert set(by_name) == files - {"asyncckpt.manifest.json"}
    assert all(f[algorithm] is not None for f in manifest["files"])

    abstract = _abstract(state)
    # orbax: its manager, and its checkpointer on the item directory.
    with ocp.CheckpointManager(str(ckpt_dir)) as orbax_mgr:
        _same(state, orbax_mgr.restore(1, args=ocp.args.StandardRestore(abstract)))
    with ocp.StandardCheckpointer() as ckptr:
        _same(state, ckptr.restore(item, abstract))
    # asyncckpt: whole, onto another mesh, partial, and without a target.
    mesh = _mesh((2, 2), ("x", "y"))
    moved = dict(abstract, params={
        "w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("y", "x"))),
        "bf": jax.ShapeDtypeStruct((32,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
        "rep": jax.ShapeDtypeStruct((4, 5), jnp.int32, sharding=NamedSharding(mesh, P("x")))})
    with aj.CheckpointManager(ckpt_dir) as mgr:
        _same(state, mgr.restore(1, target=abstract))
        got = mgr.restore(1, target=moved)
        assert got["params"]["w"].sharding == moved["params"]["w"].sharding
        _same(state, got)
        part = mgr.restore(1, args=ocp.args.PyTreeRestore(
            {"params": {"w": moved["params"]["w"]}, "step": 0}, partial_restore=True))
        np.testing.assert_array_equal(np.asarray(part["params"]["w"]),
                                      np.asarray(state["params"]["w"]))
        assert part["step"] == 1 and list(part["params"]) == ["w"]
        bare = mgr.restore(1)
        np.testing.assert_array_equal(np.asarray(bare["params"]["bf"]),
                                      np.asarray(state["params"]["bf"]))
        assert mgr.item_metadata(1)["params"]["w"].shape == (64, 64)


def test_handlers_and_format_options_choose_each_items_layout(ckpt_dir):
    handlers = {"a": ocp.StandardCheckpointHandler(use_ocdbt=False),
                "b": ocp.PyTreeCheckpointHandler(use_ocdbt=True)}
    a, b = {"x": jnp.arange(8.0)}, {"y": np.arange(4, dtype=np.int32)}
    with aj.CheckpointManager(ckpt_dir, item_handlers=handlers) as mgr:
        mgr.save(1, args=ocp.args.Composite(a=ocp.args.StandardSave(a),
                                            b=ocp.args.PyTreeSave(b)))
        got = mgr.restore(1, args=ocp.args.Composite(a=ocp.args.StandardRestore(a),
                                                     b=ocp.args.PyTreeRestore(b)))
    _same(a, got.a)
    _same(b, got.b)
    assert (ckpt_dir / "1" / "a" / "x" / ".zarray").is_file()  # zarr files
    assert (ckpt_dir / "1" / "b" / "manifest.ocdbt").is_file()  # OCDBT
    with ocp.CheckpointManager(str(ckpt_dir), item_handlers=handlers) as orbax_mgr:
        got = orbax_mgr.restore(1, args=ocp.args.Composite(a=ocp.args.StandardRestore(a),
                                                           b=ocp.args.PyTreeRestore(b)))
    _same(a, got.a)
    _same(b, got.b)
    # The two spellings must agree; a target file size without OCDBT sizes nothing.
    with pytest.raises(ValueError, match="use_ocdbt"):
        aj.CheckpointManager(ckpt_dir / "x", item_handlers=handlers,
                             format_options=aj.FormatOptions(use_ocdbt=True))
    with aj.CheckpointManager(ckpt_dir / "y", format_options=PLAIN) as mgr:
        mgr.save(1, args=ocp.args.PyTreeSave(a, ocdbt_target_data_file_size=1 << 20))
    assert not list((ckpt_dir / "y" / "1" / "default").glob("ocdbt*"))
    with pytest.raises(ValueError, match=">= 0"):
        aj.FormatOptions(ocdbt_target_data_file_size=-1)


def test_target_data_file_size_splits_chunks_and_data_files(ckpt_dir):
    """Shards larger than the target become several zarr chunks, written without a copy."""
    rows = np.random.default_rng(0).random((64, 1024), dtype=np.float32)  # 256 KiB, one shard
    wide = np.random.default_rng(1).random((2, 50_000), dtype=np.float32)  # rows of 195 KiB
    sharded = jax.device_put(np.arange(16 * 4096, dtype=np.float32).reshape(16, 4096),
                             NamedSharding(_mesh((2,), ("d",)), P("d")))  # 128 KiB shards
    state = {"rows": jnp.asarray(rows), "wide": wide, "sharded": sharded}
    target = 64 << 10
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, args=ocp.args.PyTreeSave(state, ocdbt_target_data_file_size=target))
    item = ckpt_dir / "1" / "default"
    assert _zarray(item, "rows")["chunks"] == [16, 1024]  # 64 KiB: four pieces of the rows
    assert _zarray(item, "wide")["chunks"] == [1, 12_500]  # 50 KiB: a row is too large
    assert _zarray(item, "sharded")["chunks"] == [4, 4096]
    keys = _keys(item)
    assert [k for k in keys if k.startswith("rows/") and k[-1].isdigit()] == [
        f"rows/{i}.0" for i in range(4)]
    assert len([k for k in keys if k.startswith("wide/") and k[-1].isdigit()]) == 8
    data = list((item / "ocdbt.process_0" / "ocdbt_data").iterdir())
    assert len(data) > 3 and all(f.stat().st_size <= 2 * target for f in data)
    with ocp.CheckpointManager(str(ckpt_dir)) as orbax_mgr:
        _same(state, orbax_mgr.restore(1, args=ocp.args.StandardRestore(_abstract(state))))
    with aj.CheckpointManager(ckpt_dir) as mgr:
        _same(state, mgr.restore(1, target=_abstract(state)))
    # The manager-level option does the same for every save.
    with aj.CheckpointManager(ckpt_dir / "m", format_options=aj.FormatOptions(
            ocdbt_target_data_file_size=target)) as mgr:
        mgr.save(1, {"rows": jnp.asarray(rows)})
    assert _zarray(ckpt_dir / "m" / "1" / "default", "rows")["chunks"] == [16, 1024]


def test_zarr_file_checkpoints_from_before_ocdbt_still_restore_verify_and_fall_back(ckpt_dir):
    """A directory holding both layouts: the older zarr-file steps read as before."""
    with aj.CheckpointManager(ckpt_dir, max_to_keep=3, format_options=PLAIN) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    assert (ckpt_dir / "2" / "default" / "params.w" / "0.0").is_file()
    with aj.CheckpointManager(ckpt_dir, max_to_keep=3) as mgr:
        mgr.save(3, _state(3))
        mgr.save(4, _state(4))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3, 4]  # retention deletes the older layout alike
        assert (ckpt_dir / "4" / "default" / "manifest.ocdbt").is_file()
        for step in (2, 3, 4):
            _same(_state(step), mgr.restore(step, target=_abstract(_state(0))))
        # A damaged OCDBT data file: named, and the newest good (zarr-file) step restored.
        data = next((ckpt_dir / "4" / "default" / "ocdbt.process_0" / "ocdbt_data").iterdir())
        flip_byte(data)
        with pytest.raises(CorruptCheckpointError) as err:
            mgr.restore(4, target=_abstract(_state(0)))
        assert err.value.file == str(data)
        (ckpt_dir / "3" / "default" / "ocdbt.process_0" / "manifest.ocdbt").unlink()
        got = mgr.restore(target=_abstract(_state(0)))
    _same(_state(2), got)


def test_asyncckpt_reads_orbaxs_own_ocdbt_partially_and_resharded(ckpt_dir):
    state = _state(5)
    with ocp.CheckpointManager(str(ckpt_dir), options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False)) as orbax_mgr:
        orbax_mgr.save(5, args=ocp.args.StandardSave(state))  # OCDBT, zstd chunks
    assert (ckpt_dir / "5" / "default" / "manifest.ocdbt").is_file()
    mesh = _mesh((8,), ("d",))
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "d")))
    with aj.CheckpointManager(ckpt_dir) as mgr:
        # A PyTree handler's item gives the structure: the sharding comes from restore_args.
        got = mgr.restore(5, args=ocp.args.PyTreeRestore(
            {"params": {"w": w}}, partial_restore=True,
            restore_args={"params": {"w": ocp.ArrayRestoreArgs(sharding=w.sharding)}}))
        np.testing.assert_array_equal(np.asarray(got["params"]["w"]),
                                      np.asarray(state["params"]["w"]))
        assert got["params"]["w"].sharding == w.sharding
        _same(state, mgr.restore(5, target=_abstract(state)))


def _recording(monkeypatch) -> list[tuple[str, list]]:
    """The engine's real data-file writer, recording each file and the buffers it is given."""
    written: list[tuple[str, list]] = []
    real = datafile.write

    def write(path, parts, needs_crc, **kw):
        written.append((path, [buf for _, buf in parts]))
        return real(path, parts, needs_crc, **kw)

    monkeypatch.setattr(datafile, "write", write)
    return written


def _leaf_entries(item) -> list[dict]:
    """The entries of the item's root B-tree node (one leaf), as TensorStore decodes them."""
    base = ts.KvStore.open(f"file://{item}/").result()
    location = ts.ocdbt.dump(base).result()["versions"][0]["root"]["location"]
    return ts.ocdbt.dump(base, location).result()["entries"]


def test_large_values_go_from_the_staging_buffers_into_one_data_file(ckpt_dir, monkeypatch):
    """Values over 1 KiB: written uncopied, in put order, into one data file that the B-tree
    refers to; values of 1 KiB or less: inline in the leaf. TensorStore and orbax read both."""
    written = _recording(monkeypatch)
    big = np.random.default_rng(0).random((512, 1024), dtype=np.float32)  # 2 MiB
    mesh = _mesh((2,), ("d",))
    state = {"big": jax.device_put(big, NamedSharding(mesh, P("d"))),  # two 1 MiB shards
             "scalar": np.float64(2.5), "small": jnp.arange(100.0),  # 400 bytes: inline
             "bf": jnp.asarray(big, dtype=jnp.bfloat16)}  # 1 MiB, an extension dtype
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
    assert len(written) == 1, written
    path, chunks = written[0]
    name = "default/" + path.split(f"{os.sep}default{os.sep}", 1)[1]  # written in a temporary
    assert name.startswith("default/ocdbt.process_0/ocdbt_data/")
    # Views of the staging buffers, never bytes copied from them.
    assert all(isinstance(c, np.ndarray) and not c.flags.owndata for c in chunks), chunks
    assert sorted(c.nbytes for c in chunks) == [1 << 20] * 3
    item = ckpt_dir / "1" / "default"
    assert (ckpt_dir / "1" / name).stat().st_size == 3 << 20
    entries = {e["key"].decode(): e for e in _leaf_entries(item)}
    assert set(entries) == set(_keys(item))
    inline = {k for k, e in entries.items() if "inline_value" in e}
    assert all(entries[k]["indirect_value"].startswith(
        "value:ocdbt.process_0/:ocdbt_data/") for k in set(entries) - inline)
    assert inline == {k for k in entries if not k.startswith(("big/0", "big/1", "bf/0"))}
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    assert kv.read("big/1.0").result().value == big[256:].tobytes()
    assert kv.read("bf/0.0").result().value == np.asarray(state["bf"]).tobytes()
    assert kv.read("small/0").result().value == np.arange(100, dtype=np.float32).tobytes()
    assert _zarray(item, "big")["chunks"] == [256, 1024]  # the array's own metadata
    assert _zarray(item, "big")["dtype"] == "<f4"
    with aj.CheckpointManager(ckpt_dir) as mgr:
        _same(state, mgr.restore(1, target=_abstract(state)))
    with ocp.CheckpointManager(str(ckpt_dir)) as orbax_mgr:
        _same(state, orbax_mgr.restore(1, args=ocp.args.StandardRestore(_abstract(state))))
    with ocp.StandardCheckpointer() as ckptr:
        _same(state, ckptr.restore(item, _abstract(state)))


def test_a_save_of_one_process_writes_its_root_without_a_merge(ckpt_dir):
    """The item's manifest.ocdbt names process 0's tree through its directory: no node file
    of its own, no TensorStore merge; process 0's database reads alone as well."""
    state = _state(2)
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(2, state)
    item = ckpt_dir / "2" / "default"
    assert not (item / "ocdbt_meta").exists()
    root = ts.ocdbt.dump(ts.KvStore.open(f"file://{item}/").result()).result()
    assert root["versions"][0]["root"]["location"].startswith(
        "btreenode:ocdbt.process_0/:ocdbt_meta/")
    assert _keys(item) == _keys(item / "ocdbt.process_0")
    assert len(list((item / "ocdbt.process_0" / "ocdbt_meta").iterdir())) == 1
    with ocp.CheckpointManager(str(ckpt_dir)) as orbax_mgr:
        _same(state, orbax_mgr.restore(2, args=ocp.args.StandardRestore(_abstract(state))))


@pytest.mark.parametrize("node_bytes", [100_000_000, 6000, 1500])
def test_trees_too_large_for_one_node_get_interior_nodes_that_tensorstore_reads(
        tmp_path, node_bytes):
    """_ocdbtwrite's B-tree: one leaf, then leaves under one interior node, then three
    levels; read through the database's own manifest and through a parent's base path."""
    from asyncckpt.jax import _ocdbtwrite

    rng = np.random.default_rng(0)
    values = {f"p{i:03d}/{j}.0": rng.bytes(int(rng.integers(1, 3000)))
              for i in range(120) for j in range(3)}
    values["p000/.zarray"] = b'{"zarr_format": 2}'
    db = tmp_path / "ocdbt.process_0"
    (db / "ocdbt_meta").mkdir(parents=True)
    (db / "ocdbt_data").mkdir()
    data, refs = bytearray(), []
    for key in sorted(values):
        v = values[key]
        if len(v) <= 1024:
            refs.append((key.encode(), len(v), v, 0, 0))
        else:
            refs.append((key.encode(), len(v), None, 0, len(data)))
            data += v
    (db / "ocdbt_data" / "d").write_bytes(data)
    nodes, root = _ocdbtwrite.encode_tree(refs, [("", "ocdbt_data/d")], ("", "ocdbt_meta/n"),
                                          node_bytes)
    assert root.num_keys == len(values) and root.num_tree_bytes == len(nodes)
    assert root.height == {100_000_000: 0, 6000: 1, 1500: 3}[node_bytes]
    (db / "ocdbt_meta" / "n").write_bytes(nodes)
    config = _ocdbtwrite.Config(os.urandom(16), 1024, node_bytes)
    (db / "manifest.ocdbt").write_bytes(
        _ocdbtwrite.encode_manifest(config, root, ("", "ocdbt_meta/n"), 1))
    (tmp_path / "manifest.ocdbt").write_bytes(
        _ocdbtwrite.encode_manifest(config, root, ("ocdbt.process_0/", "ocdbt_meta/n"), 1))
    for where in (db, tmp_path):
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{where}/"}).result()
        assert sorted(k.decode() for k in kv.list().result()) == sorted(values)
        for key, value in values.items():
            assert kv.read(key).result().value == value, key
    # A root node whose CRC32C does not match its bytes is refused.
    flip_byte(db / "ocdbt_meta" / "n", root.offset + root.length - 1)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/"}).result()
    with pytest.raises(ValueError, match=r"(?i)checksum"):
        for key in values:
            kv.read(key).result()


def test_a_slot_is_reused_only_after_its_values_are_written(ckpt_dir, monkeypatch):
    """The data files are written from the staging slot before it is given back.

    One slot. Step 1's database is finished late (the real ``finish``, held) until
    step 2 has been staged into that slot: had step 1's values still been read from
    the slot then, step 1 would hold step 2's values.
    """
    from asyncckpt import AsyncOptions

    second_staged = threading.Event()
    real_finish = _ocdbt.DatabaseWriter.finish
    held: list[bool] = []

    def late_finish(self, **kw):
        if not held:
            held.append(second_staged.wait(timeout=20))
        real_finish(self, **kw)

    monkeypatch.setattr(_ocdbt.DatabaseWriter, "finish", late_finish)

    def state(step):
        return {"w": jnp.full((512, 1024), step, dtype=jnp.float32)}  # one 2 MiB chunk

    one_slot = AsyncOptions(num_slots=1, max_slots=1)
    with aj.CheckpointManager(ckpt_dir, async_options=one_slot) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))  # returns once step 1's write has given the slot back
        second_staged.set()
        mgr.wait_until_finished()
        assert held == [True]  # step 2 was staged before step 1 was committed
        for step in (1, 2):
            _same(state(step), mgr.restore(step, target=_abstract(state(step))))
    with ocp.CheckpointManager(str(ckpt_dir)) as orbax_mgr:
        for step in (1, 2):
            _same(state(step), orbax_mgr.restore(
                step, args=ocp.args.StandardRestore(_abstract(state(step)))))


def test_many_small_sharded_arrays_staged_side_by_side_restore_exactly(tmp_path):
    # 120 arrays of 8 x 8 KiB shards and a few others: the slots pack the small shards
    # back to back and the data file is written from runs of them (``_pages.packed_empty``,
    # ``datafile._coalesced``). Back-to-back saves take the second slot, built apart.
    sharded = NamedSharding(_mesh((8,), ("x",)), P("x"))
    rng = np.random.default_rng(7)

    def state(step):
        tree = {f"w{i:03d}": jax.device_put(
            rng.standard_normal((256, 64), dtype=np.float32) + step, sharded) for i in range(120)}
        tree["odd"] = jax.device_put(np.arange(8 * 37, dtype=np.int16) - step, sharded)
        tree["big"] = jax.device_put(rng.standard_normal((8, 1 << 17), dtype=np.float32),
                                     sharded)
        tree["host"] = np.arange(5, dtype=np.int64) + step
        return tree

    saved = {}
    with aj.CheckpointManager(tmp_path, max_to_keep=None) as mgr:
        for step in range(4):
            saved[step] = state(step)
            mgr.save(step, saved[step])
        mgr.wait_until_finished()
        for step in range(4):
            got = mgr.restore(step, _abstract(saved[step]))
            for name, value in saved[step].items():
                np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value))
    with ocp.CheckpointManager(tmp_path) as theirs:  # and orbax restores the same values
        got = theirs.restore(3, args=ocp.args.StandardRestore(_abstract(saved[3])))
        for name, value in saved[3].items():
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value))

"""Damaged and hostile JAX checkpoints (OCDBT and zarr files): nothing read outside, or on trust.

Three steps (0, 1, 2; every value of step ``s`` is ``s``) are written by
``asyncckpt.jax.CheckpointManager`` in the layout ``FormatOptions`` picks
(OCDBT, orbax's default, or one zarr chunk file per shard); the newest is
then damaged or crafted, its manifest written again where the test says the
checksums are recomputed (``tests/hostile.py``). Each test checks the exact
outcome: the step restored (by asyncckpt's manager, and by orbax) or the
error and the file it names; and that nothing outside the checkpoint
directory was opened (``Outside``). The job runner's store falls back alike.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import shutil
import struct

import google_crc32c
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import asyncckpt.jax as aj
from asyncckpt import cli
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.jax._ocdbt import kvstore_spec
from asyncckpt.jobrunner.store import ArrayStore
from tests.hostile import Outside, no_hang, replace_with, rewrite_manifest, step_files

MANIFEST = "asyncckpt.manifest.json"
W = (64, 64)  # 16 KiB: in an OCDBT data file, not inline in the B-tree


def tree(step: int) -> dict:
    return {"w": jnp.full(W, float(step), jnp.float32), "b": jnp.arange(3, dtype=jnp.int32) + step}


def assert_tree(got: dict, step: int) -> None:
    np.testing.assert_array_equal(np.asarray(got["w"]), np.full(W, float(step), np.float32))
    np.testing.assert_array_equal(np.asarray(got["b"]), np.arange(3, dtype=np.int32) + step)


def _manager(directory, ocdbt: bool) -> aj.CheckpointManager:
    return aj.CheckpointManager(str(directory),
                                format_options=aj.FormatOptions(use_ocdbt=ocdbt))


@pytest.fixture(params=[True, False], ids=["ocdbt", "zarr"])
def layout(request) -> bool:
    """Whether the steps are OCDBT databases (else zarr chunk files)."""
    return request.param


@pytest.fixture
def jax_dir(tmp_path, layout):
    d = tmp_path / "ckpts"
    with _manager(d, layout) as m:
        for step in range(3):
            m.save(step, args=ocp.args.StandardSave(tree(step)))
        m.wait_until_finished()
    return d


@pytest.fixture
def outside(tmp_path):
    o = Outside(tmp_path / "outside")
    yield o
    o.disarm()


def restore(directory, ocdbt: bool, step: int | None = None):
    """asyncckpt's manager, target-less (the newest that verifies for None)."""
    gc.collect()  # as a new process: no view of the directory kept from the saves
    with no_hang(), _manager(directory, ocdbt) as m:
        return m.restore(step)


def orbax_reads(step_dir) -> dict:
    """orbax's own reader of a step's pytree."""
    with ocp.StandardCheckpointer() as c:
        return c.restore(os.path.join(step_dir, "default"))


def assert_restores(directory, ocdbt: bool, step: int) -> None:
    """The newest step that verifies is ``step``, for asyncckpt and orbax."""
    assert_tree(restore(directory, ocdbt), step)
    assert_tree(orbax_reads(directory / str(step)), step)


def assert_refused(directory, ocdbt: bool, step: int, file) -> CorruptCheckpointError:
    with pytest.raises(CorruptCheckpointError) as e:
        restore(directory, ocdbt, step)
    assert e.value.file == str(file)
    return e.value


def remanifest(step_dir, *, leave_out=(), add=()) -> None:
    """The step's manifest written again, listing every file there (checksums recomputed)."""
    names = [n for n in step_files(step_dir, MANIFEST) if n not in leave_out]
    rewrite_manifest(step_dir / MANIFEST, step_dir, names=names, add=add)


def run_cli(capsys, *argv) -> tuple[int, str]:
    with no_hang():
        rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


# -- 1. containment ----------------------------------------------------------------


def test_a_manifest_entry_outside_is_never_opened(jax_dir, layout, outside, capsys):
    outside.write("evil", b"planted bytes")
    step_dir = jax_dir / "2"
    remanifest(step_dir, add=("../../outside/evil",))
    outside.arm()

    assert_restores(jax_dir, layout, 1)
    err = assert_refused(jax_dir, layout, 2, step_dir / MANIFEST)
    assert "'../../outside/evil'" in str(err)
    rc, out = run_cli(capsys, "verify", jax_dir)
    assert rc == 1 and f"FAIL  2: manifest {str(step_dir / MANIFEST)!r}" in out
    rc, out = run_cli(capsys, "inspect", jax_dir, "2")
    assert rc == 2 and str(step_dir / MANIFEST) in out
    outside.assert_untouched()


def test_a_tree_metadata_key_outside_is_never_opened(jax_dir, layout, outside, capsys):
    # A leaf named "../../outside/evil", its array planted there as zarr files.
    outside.write("evil/.zarray", json.dumps({
        "chunks": [3], "compressor": None, "dimension_separator": ".", "dtype": "<i4",
        "fill_value": None, "filters": None, "order": "C", "shape": [3],
        "zarr_format": 2}).encode())
    outside.write("evil/0", np.array([6, 6, 6], np.int32).tobytes())
    step_dir = jax_dir / "2"
    meta_path = step_dir / "default" / "_METADATA"
    meta = json.loads(meta_path.read_text())
    meta["tree_metadata"]["('../../outside/evil',)"] = {
        "key_metadata": [{"key": "../../outside/evil", "key_type": 2}],
        "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                           "write_shape": [3]}}
    meta_path.write_text(json.dumps(meta))
    remanifest(step_dir)
    outside.arm()

    assert_restores(jax_dir, layout, 1)
    err = assert_refused(jax_dir, layout, 2, meta_path)
    assert "'../../outside/evil'" in str(err) and "not opened" in str(err)
    outside.assert_untouched()


def test_an_item_name_outside_in_the_step_metadata_is_never_opened(jax_dir, layout, outside):
    outside.write("_METADATA", b"{}")
    step_dir = jax_dir / "2"
    meta = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    meta["item_handlers"] = {"../../outside": meta["item_handlers"]["default"]}
    (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    remanifest(step_dir)
    outside.arm()

    assert_restores(jax_dir, layout, 1)
    err = assert_refused(jax_dir, layout, 2, step_dir / "_CHECKPOINT_METADATA")
    assert "'../../outside'" in str(err)
    outside.assert_untouched()


def _rebuild_database(item_dir) -> None:
    """The item's OCDBT database written again as one database with uncompressed B-tree nodes.

    Same keys and values; its nodes can then be edited as bytes (their
    CRC32C recomputed), as whoever crafts a checkpoint would.
    """
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir}/"}).result()
    values = {k: kv.read(k).result().value for k in kv.list().result()}
    del kv
    for name in os.listdir(item_dir):
        if name.startswith("ocdbt") or name == "manifest.ocdbt":
            shutil.rmtree(item_dir / name) if (item_dir / name).is_dir() else os.remove(
                item_dir / name)
    spec = kvstore_spec(str(item_dir), target=0)
    spec["config"]["compression"] = None
    kv = ts.KvStore.open(spec).result()
    txn = ts.Transaction()
    for key, value in values.items():
        kv.with_transaction(txn).write(key, value).result()
    txn.commit_async().result()


def _point_value_at(item_dir, data: str, relative: str) -> None:
    """Edits the B-tree so that its data file ``data``'s path is ``relative`` (same length)."""
    old = f"ocdbt_data/{data}".encode()
    assert len(relative) == len(old)
    patched = 0
    for node in glob.glob(str(item_dir / "ocdbt_meta" / "*")):
        with open(node, "rb") as f:
            body = bytearray(f.read())
        at = body.find(old)
        if at < 0:
            continue
        body[at:at + len(old)] = relative.encode()
        body[-4:] = struct.pack("<I", google_crc32c.value(bytes(body[:-4])))
        with open(node, "wb") as f:
            f.write(body)
        patched += 1
    assert patched == 1


def test_an_ocdbt_data_file_path_outside_is_never_opened(tmp_path, outside, capsys):
    jax_dir = tmp_path / "ckpts"
    with _manager(jax_dir, True) as m:
        for step in range(3):
            m.save(step, args=ocp.args.StandardSave(tree(step)))
    item = jax_dir / "2" / "default"
    _rebuild_database(item)
    name = "e" * 26
    outside.write(name, np.full(W, 99.0, np.float32).tobytes())  # the planted values
    (data,) = os.listdir(item / "ocdbt_data")
    _point_value_at(item, data, f"../../../outside/{name}")  # from the item: tmp_path/outside
    remanifest(jax_dir / "2")
    outside.arm()

    assert_restores(jax_dir, True, 1)
    err = assert_refused(jax_dir, True, 2, item / "ocdbt_meta" / os.listdir(
        item / "ocdbt_meta")[0])
    assert f"/../../../outside/{name}', which leads out" in str(err)
    rc, out = run_cli(capsys, "inspect", jax_dir, "2")
    assert rc == 2 and "../../../outside" in out
    outside.assert_untouched()


def test_a_file_the_manifest_does_not_list_is_an_integrity_error(jax_dir, layout):
    step_dir = jax_dir / "2"
    item = step_dir / "default"
    if layout:  # the B-tree names a data file in the step that the manifest does not list
        _rebuild_database(item)
        (data,) = os.listdir(item / "ocdbt_data")
        unlisted = item / "ocdbt_data" / ("f" * 32)
        shutil.copy(item / "ocdbt_data" / data, unlisted)
        _point_value_at(item, data, f"ocdbt_data/{unlisted.name}")
        remanifest(step_dir, leave_out=(f"default/ocdbt_data/{unlisted.name}",))
    else:  # the array's metadata asks for a second chunk, there on disk but not listed
        zarray = json.loads((item / "w" / ".zarray").read_text())
        zarray["shape"] = [128, 64]
        (item / "w" / ".zarray").write_text(json.dumps(zarray))
        unlisted = item / "w" / "1.0"
        shutil.copy(item / "w" / "0.0", unlisted)
        remanifest(step_dir, leave_out=("default/w/1.0",))

    assert_restores(jax_dir, layout, 1)
    err = assert_refused(jax_dir, layout, 2, unlisted)
    assert "is not listed in the manifest" in str(err)


def test_a_symlinked_file_whose_contents_verify_still_restores(jax_dir, layout, tmp_path):
    item = jax_dir / "2" / "default"
    if layout:
        (data,) = glob.glob(str(item / "ocdbt.process_0" / "ocdbt_data" / "*"))
    else:
        data = str(item / "w" / "0.0")
    kept = tmp_path / "elsewhere" / "data"
    kept.parent.mkdir()
    os.replace(data, kept)
    os.symlink(kept, data)
    assert_restores(jax_dir, layout, 2)


# -- 2. validate before allocating -------------------------------------------------


def _set_zarray(item_dir, ocdbt: bool, **changes) -> str:
    """Changes ``w``'s zarr metadata (a file, or a value of the OCDBT database); its path."""
    if not ocdbt:
        path = item_dir / "w" / ".zarray"
        meta = json.loads(path.read_text())
        meta.update(changes)
        path.write_text(json.dumps(meta))
        return str(path)
    kv = ts.KvStore.open(kvstore_spec(str(item_dir))).result()
    meta = json.loads(kv.read("w/.zarray").result().value)
    meta.update(changes)
    kv.write("w/.zarray", json.dumps(meta).encode()).result()
    return str(item_dir / "w" / ".zarray")


ZARRAY_EDITS = {
    "4 TiB of chunks": ({"shape": [1 << 40, 64]}, ".zarray", "describes 17179869184 chunks"),
    "a 256 MiB chunk": ({"shape": [1 << 20, 64], "chunks": [1 << 20, 64]}, "0.0",
                        "holds 16384 bytes, a chunk of"),
    "negative shape": ({"shape": [-64, 64]}, ".zarray", "shape (-64, 64)"),
}


@pytest.mark.parametrize("edit", list(ZARRAY_EDITS))
def test_array_metadata_larger_than_its_files_is_refused_before_sizing(jax_dir, layout, edit):
    changes, file, words = ZARRAY_EDITS[edit]
    item = jax_dir / "2" / "default"
    _set_zarray(item, layout, **changes)
    remanifest(jax_dir / "2")

    assert_restores(jax_dir, layout, 1)
    err = assert_refused(jax_dir, layout, 2, item / "w" / file)
    assert words in str(err)


# -- 3. structural damage falls back -----------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "fifo"])
@pytest.mark.parametrize("which", [MANIFEST, "default/_METADATA", "data"])
def test_a_directory_or_fifo_where_a_file_should_be_falls_back(jax_dir, layout, capsys,
                                                               which, kind):
    step_dir = jax_dir / "2"
    if which == "data":
        data = glob.glob(str(step_dir / "default/ocdbt.process_0/ocdbt_data/*"))
        which = os.path.relpath(data[0], step_dir) if layout else "default/w/0.0"
    path = step_dir / which
    replace_with(path, kind)

    assert_restores(jax_dir, layout, 1)
    assert_refused(jax_dir, layout, 2, path)
    rc, out = run_cli(capsys, "verify", jax_dir)
    assert rc == 1 and "FAIL  2: " in out and str(path) in out


@pytest.mark.parametrize("made", ["empty", "step metadata only", "empty item"])
def test_an_empty_or_half_made_newer_step_is_skipped(jax_dir, layout, made, capsys):
    newer = jax_dir / "3"
    newer.mkdir()
    if made == "step metadata only":
        shutil.copy(jax_dir / "2" / "_CHECKPOINT_METADATA", newer)
    elif made == "empty item":
        (newer / "default").mkdir()
    assert_restores(jax_dir, layout, 2)
    with pytest.raises(CorruptCheckpointError) as e:
        restore(jax_dir, layout, 3)
    assert e.value.file == str(newer if made != "empty item" else newer / "default/_METADATA")
    rc, out = run_cli(capsys, "verify", jax_dir)
    assert rc == 1 and "FAIL  3: " in out and "3/4 checkpoint(s) verified" in out


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_the_job_runner_store_falls_back_past_a_manifest_replaced(tmp_path, kind):
    store = ArrayStore(tmp_path / "runs", max_to_keep=None)
    with store:
        for step in range(3):
            store.save(step, {"w": np.full((8,), float(step), np.float32)})
        store.wait_until_finished()
    replace_with(tmp_path / "runs" / "2" / MANIFEST, kind)
    reader = ArrayStore(tmp_path / "runs")
    with no_hang(), reader:
        got = reader.restore()
    assert got.step == 1
    np.testing.assert_array_equal(got.arrays["w"], np.full((8,), 1.0, np.float32))


@pytest.mark.parametrize("edit", ["beyond the data file", "huge", "size against shape",
                                  "negative offset", "malformed"])
def test_the_job_runner_store_checks_its_index_before_allocating(tmp_path, edit):
    """An index edited with a manifest that matches it (an attacker's or a tool's rewrite):
    every array's offset and size are checked against the shape, dtype and the data file's
    size before anything is allocated or read; the store falls back to the step before."""
    store = ArrayStore(tmp_path / "runs", max_to_keep=None)
    with store:
        for step in range(2):
            store.save(step, {"w": np.full((8,), float(step), np.float32),
                              "b": np.arange(4, dtype=np.int64) + 2**40})
        store.wait_until_finished()
    step_dir = tmp_path / "runs" / "1"
    index = json.loads((step_dir / "index.json").read_text())
    entry = index["arrays"]["w"]
    if edit == "beyond the data file":
        entry["offset"] = (step_dir / "arrays.bin").stat().st_size - 4
    elif edit == "huge":  # would be a 1 PiB allocation
        entry["shape"], entry["nbytes"] = [2**48], 2**50
    elif edit == "size against shape":
        entry["nbytes"] = 16
    elif edit == "negative offset":
        entry["offset"] = -32
    else:
        entry["shape"] = "eight"
    (step_dir / "index.json").write_text(json.dumps(index))
    rewrite_manifest(step_dir / MANIFEST, step_dir)
    with ArrayStore(tmp_path / "runs") as reader:
        with pytest.raises(CorruptCheckpointError) as err:
            reader.restore(1)
        assert err.value.file == str(step_dir / "index.json") and "'w'" in str(err.value)
        with no_hang():
            got = reader.restore()  # the newest that verifies
        assert got.step == 0
        np.testing.assert_array_equal(got.arrays["b"], np.arange(4, dtype=np.int64) + 2**40)


@pytest.mark.parametrize("read", ["restore", "metadata"])
def test_a_checkpointers_composite_item_named_outside_is_never_opened(tmp_path, outside, read):
    """orbax's composite handler opens the item directories _CHECKPOINT_METADATA names:
    a name leading outside is refused before the handler runs."""
    path = tmp_path / "ckpt"

    def handler():
        return ocp.CompositeCheckpointHandler("state", "meta")

    with aj.Checkpointer(handler()) as c:
        c.save(path, args=ocp.args.Composite(state=ocp.args.StandardSave(tree(1)),
                                             meta=ocp.args.JsonSave({"k": 1})))
    outside.write("metadata", b'{"k": 2}')
    meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    meta["item_handlers"] = {"../outside": meta["item_handlers"]["meta"],
                             "state": meta["item_handlers"]["state"]}
    (path / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    remanifest(path)
    outside.arm()
    with aj.Checkpointer(handler()) as c, pytest.raises(CorruptCheckpointError) as err:
        if read == "restore":
            c.restore(path)
        else:
            c.metadata(path)
    assert err.value.file == str(path / "_CHECKPOINT_METADATA") and "'../outside'" in str(err.value)
    outside.assert_untouched()

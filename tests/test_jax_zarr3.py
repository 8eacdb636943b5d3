"""orbax's ``use_zarr3=True``: zarr v3 arrays, in OCDBT and as files, read by orbax and asyncckpt.

asyncckpt writes each array as zarr v3 with one codec, ``bytes`` (little
endian): a chunk is its raw bytes, written from the staging buffers as for
zarr v2, under zarr v3's chunk keys (``c/<i>/<j>``). orbax reads it through
TensorStore, taking the driver from ``_METADATA``; asyncckpt reads the chunks
itself, each checked against the manifest.
"""

from __future__ import annotations

import json
import os

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
from asyncckpt._engine import fastcrc  # noqa: E402
from asyncckpt._engine import files as files_lib  # noqa: E402
from asyncckpt.jax import _format as fmt  # noqa: E402
from asyncckpt.jax import _ocdbt, _tsarrays  # noqa: E402
from asyncckpt.jax._job import JaxSaveJob  # noqa: E402
from tests.helpers import flip_byte, run_python, write_script  # noqa: E402

ZARR3_FILES = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)
ZARR3_OCDBT = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _state(step: int = 0) -> dict:
    """Sharded over 8 devices (shards of 2 KiB: OCDBT keeps values up to 1 KiB inline)."""
    mesh = _mesh((4, 2), ("a", "b"))
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + step
    return {
        "params": {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),
                   "bf": jax.device_put(jnp.arange(32, dtype=jnp.bfloat16) * (step + 1),
                                        NamedSharding(mesh, P("a"))),
                   "rep": jax.device_put(np.full((4, 5), step, np.int32),
                                         NamedSharding(mesh, P())),
                   "s": jnp.float32(step + 0.5)},
        "host": np.arange(6, dtype=np.int64).reshape(2, 3) + step,
        "flags": np.array([True, False, step % 2 == 0]),
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
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
        assert a.tobytes() == b.tobytes()


def _files(step_dir) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), step_dir).replace(os.sep, "/")
            for d, _, fs in os.walk(step_dir) for f in fs}


def _kv(database_dir):
    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{database_dir}/"}).result()


def _keys(database_dir) -> list[str]:
    return sorted(k.decode() for k in _kv(database_dir).list().result())


def _zarr_json(item, param, *, ocdbt: bool) -> dict:
    if ocdbt:
        return json.loads(_kv(item).read(f"{param}/zarr.json").result().value)
    return json.loads((item / param / "zarr.json").read_text())


def _check_manifest(step_dir) -> None:
    """Every file of the step is in asyncckpt's manifest, with its checksum."""
    manifest = json.loads((step_dir / "asyncckpt.manifest.json").read_text())
    algorithm = "crc32c" if fastcrc.available() else "crc32"
    assert {f["name"] for f in manifest["files"]} == _files(step_dir) - {
        "asyncckpt.manifest.json"}
    assert all(f[algorithm] is not None for f in manifest["files"])


def _reads_raw(item_dir) -> bool:
    """Whether asyncckpt reads the item's chunks itself (not through TensorStore)."""
    entries = fmt.read_tree_metadata(str(item_dir))
    return not _tsarrays.ItemArrays(str(item_dir), entries,
                                    checkpoint=str(item_dir)).through_tensorstore


def _orbax_restores(directory, step, state) -> None:
    """orbax's own manager restores the step: its default reader (the driver taken
    from _METADATA) and a manager whose handler has use_zarr3=True."""
    abstract = _abstract(state)
    with ocp.CheckpointManager(str(directory)) as theirs:
        _same(state, theirs.restore(step, args=ocp.args.StandardRestore(abstract)))
    with ocp.CheckpointManager(str(directory), item_handlers=ZARR3_OCDBT) as theirs:
        _same(state, theirs.restore(step, args=ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))
    with ocp.StandardCheckpointer() as ckptr:
        _same(state, ckptr.restore(directory / str(step) / "default", abstract))


def _asyncckpt_restores(directory, step, state) -> None:
    """asyncckpt restores the step whole, onto another mesh, partially and without a target."""
    abstract = _abstract(state)
    mesh = _mesh((2, 2), ("x", "y"))
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("y", "x")))
    with aj.CheckpointManager(directory) as mgr:
        _same(state, mgr.restore(step, target=abstract))
        moved = mgr.restore(step, target=dict(abstract, params=dict(abstract["params"], w=w)))
        assert moved["params"]["w"].sharding == w.sharding
        _same(state, moved)
        part = mgr.restore(step, args=ocp.args.PyTreeRestore(
            {"params": {"w": w}, "step": 0}, partial_restore=True))
        _same({"params": {"w": state["params"]["w"]}, "step": state["step"]}, part)
        bare = mgr.restore(step)
        _same(state["params"]["bf"], bare["params"]["bf"])
        _same(state["host"], bare["host"])
        meta = mgr.item_metadata(step)
        assert meta["params"]["w"].shape == (64, 64)
        assert meta["params"]["bf"].dtype == jnp.bfloat16


def test_files_layout_is_zarr3_and_both_libraries_restore_it(ckpt_dir):
    state = _state(1)
    with aj.CheckpointManager(ckpt_dir, item_handlers=ZARR3_FILES) as mgr:
        mgr.save(1, args=ocp.args.PyTreeSave(state))
    step_dir = ckpt_dir / "1"
    item = step_dir / "default"
    files = _files(step_dir)
    assert json.loads((item / "_METADATA").read_text())["use_zarr3"] is True
    assert not any(f.endswith(".zarray") for f in files)
    # One chunk file per shard with replica 0, zarr v3's keys: c/<i>/<j>.
    assert sorted(f for f in files if f.startswith("default/params.w/")) == sorted(
        ["default/params.w/zarr.json"]
        + [f"default/params.w/c/{i}/{j}" for i in range(4) for j in range(2)])
    assert {f for f in files if f.startswith("default/params.rep/")} == {
        "default/params.rep/zarr.json", "default/params.rep/c/0/0"}
    assert {f for f in files if f.startswith("default/params.s/")} == {
        "default/params.s/zarr.json", "default/params.s/c"}  # 0-d: the one chunk "c"
    meta = _zarr_json(item, "params.w", ocdbt=False)
    assert meta["zarr_format"] == 3 and meta["data_type"] == "float32"
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [16, 32]
    assert meta["codecs"] == [{"configuration": {"endian": "little"}, "name": "bytes"}]
    assert _zarr_json(item, "flags", ocdbt=False)["codecs"] == [{"name": "bytes"}]
    # A chunk is its shard's raw bytes.
    w = np.asarray(state["params"]["w"])
    assert (item / "params.w" / "c" / "3" / "1").read_bytes() == w[48:, 32:].tobytes()
    _check_manifest(step_dir)
    assert _reads_raw(item)

    _orbax_restores(ckpt_dir, 1, state)
    _asyncckpt_restores(ckpt_dir, 1, state)

    # Each chunk file is checked as it is read: a damaged one is named.
    damaged = item / "params.w" / "c" / "2" / "1"
    flip_byte(damaged, 10)
    with aj.CheckpointManager(ckpt_dir) as mgr, pytest.raises(CorruptCheckpointError) as err:
        mgr.restore(1, target=_abstract(state))
    assert err.value.file == str(damaged)


def _recording_references() -> tuple[type, list[str]]:
    """A manager whose OCDBT databases record each key they write uncopied (by reference)."""
    seen: list[str] = []

    class Recording(_ocdbt.DatabaseWriter):  # the real database writer, recorded
        def _write_by_reference(self, parent, grid, separator, view):
            seen.append(parent + separator.join(map(str, grid)))
            return super()._write_by_reference(parent, grid, separator, view)

    class Job(JaxSaveJob):
        database_class = Recording

    return type("Manager", (aj.CheckpointManager,), {"_job_class": Job}), seen


def test_ocdbt_layout_is_zarr3_with_several_chunks_per_array(ckpt_dir):
    """SaveArgs chunking and a target data file size split arrays into many zarr v3
    chunks, each a key of the database holding its raw bytes."""
    manager, seen = _recording_references()
    rows = np.random.default_rng(0).random((64, 1024), dtype=np.float32)  # 256 KiB
    state = _state(2)
    state["rows"] = jnp.asarray(rows)
    state["chunked"] = jax.device_put(np.arange(16 * 64, dtype=np.int32).reshape(16, 64),
                                      NamedSharding(_mesh((2,), ("d",)), P("d")))
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(), state)
    save_args["chunked"] = ocp.SaveArgs(chunk_byte_size=4 * 64 * 4)  # 4 rows a chunk
    with manager(ckpt_dir, format_options=aj.FormatOptions(use_zarr3=True)) as mgr:
        mgr.save(2, args=ocp.args.PyTreeSave(state, save_args=save_args,
                                             ocdbt_target_data_file_size=64 << 10))
    item = ckpt_dir / "2" / "default"
    assert (item / "manifest.ocdbt").is_file()
    assert json.loads((item / "_METADATA").read_text()) | {"tree_metadata": None} == {
        "tree_metadata": None, "use_ocdbt": True, "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    keys = _keys(item)
    assert not any(k.endswith(".zarray") for k in keys)
    assert [k for k in keys if k.startswith("params.w/")] == (
        [f"params.w/c/{i}/{j}" for i in range(4) for j in range(2)] + ["params.w/zarr.json"])
    # 256 KiB split to fit 64 KiB: four chunks of 16 rows.
    assert _zarr_json(item, "rows", ocdbt=True)["chunk_grid"]["configuration"][
        "chunk_shape"] == [16, 1024]
    assert [k for k in keys if k.startswith("rows/c/")] == [f"rows/c/{i}/0" for i in range(4)]
    # SaveArgs(chunk_byte_size): 4 rows per chunk, each shard of 8 rows in two.
    assert _zarr_json(item, "chunked", ocdbt=True)["chunk_grid"]["configuration"][
        "chunk_shape"] == [4, 64]
    assert [k for k in keys if k.startswith("chunked/c/")] == [
        f"chunked/c/{i}/0" for i in range(4)]
    assert seen == []  # no value of 1 MiB or more
    kv = _kv(item)
    assert kv.read("rows/c/1/0").result().value == rows[16:32].tobytes()
    assert kv.read("chunked/c/3/0").result().value == np.asarray(
        state["chunked"])[12:].tobytes()
    _check_manifest(ckpt_dir / "2")
    assert _reads_raw(item)
    _orbax_restores(ckpt_dir, 2, state)
    _asyncckpt_restores(ckpt_dir, 2, state)


def test_large_zarr3_values_go_to_tensorstore_uncopied_under_their_keys(ckpt_dir):
    manager, seen = _recording_references()
    big = np.random.default_rng(1).random((512, 1024), dtype=np.float32)  # 2 MiB
    state = {"big": jax.device_put(big, NamedSharding(_mesh((2,), ("d",)), P("d"))),
             "bf": jnp.asarray(big[:, :512], dtype=jnp.bfloat16),  # 0.5 MiB: copied
             "vec": jnp.asarray(big.reshape(-1)[: 1 << 18])}  # 1 MiB, one dimension
    with manager(ckpt_dir, item_handlers=ZARR3_OCDBT) as mgr:
        mgr.save(1, state)
    assert sorted(seen) == ["big/c/0/0", "big/c/1/0", "vec/c/0"]
    item = ckpt_dir / "1" / "default"
    assert _kv(item).read("big/c/1/0").result().value == big[256:].tobytes()
    assert _kv(item).read("vec/c/0").result().value == np.asarray(state["vec"]).tobytes()
    with ocp.CheckpointManager(str(ckpt_dir)) as theirs:
        _same(state, theirs.restore(1, args=ocp.args.StandardRestore(_abstract(state))))
    with aj.CheckpointManager(ckpt_dir) as mgr:
        _same(state, mgr.restore(1, target=_abstract(state)))


@pytest.mark.parametrize("use_ocdbt", [False, True])
def test_checkpointers_write_zarr3_and_both_libraries_restore_it(tmp_path, use_ocdbt):
    state = _state(3)
    del state["empty"]  # orbax's checkpointer restore compares trees leaf for leaf
    abstract = _abstract(state)
    made = {
        "pytree": lambda: aj.PyTreeCheckpointer(use_ocdbt=use_ocdbt, use_zarr3=True),
        "handler": lambda: aj.Checkpointer(ocp.PyTreeCheckpointHandler(
            use_ocdbt=use_ocdbt, use_zarr3=True)),
        "async": lambda: aj.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(
            use_ocdbt=use_ocdbt, use_zarr3=True)),
    }
    for name, make in made.items():
        path = tmp_path / name
        with make() as ckptr:
            ckptr.save(path, args=ocp.args.PyTreeSave(state))
            ckptr.wait_until_finished()
            _same(state, ckptr.restore(path, args=ocp.args.PyTreeRestore(abstract)))
        assert json.loads((path / "_METADATA").read_text())["use_zarr3"] is True
        assert (path / "manifest.ocdbt").is_file() is use_ocdbt
        assert (path / "params.w" / "zarr.json").is_file() is not use_ocdbt
        assert not list(path.glob("*/.zarray"))
        assert _reads_raw(path)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        with ocp.PyTreeCheckpointer() as theirs:  # orbax's default reader: zarr v2 handler
            _same(state, theirs.restore(path, item=abstract, restore_args=restore_args))
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)) as theirs:
            _same(state, theirs.restore(path, args=ocp.args.PyTreeRestore(
                abstract, restore_args=restore_args)))
        with aj.StandardCheckpointer() as mine:
            _same(state, mine.restore(path, abstract))


DTYPES_WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import asyncckpt.jax as aj

root = sys.argv[1]
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
rng = np.random.default_rng(7)
big = (2**40 + np.arange(16, dtype=np.int64)).reshape(4, 4)
floats = rng.standard_normal((4, 4))
state = {
    "i64": jax.device_put(big, NamedSharding(mesh, P("a", "b"))),
    "u64": jax.device_put(np.uint64(2**63 + 5) + np.arange(8, dtype=np.uint64),
                          NamedSharding(mesh, P("a"))),
    "f64": jax.device_put(floats, NamedSharding(mesh, P(None, "b"))),
    "bf16": jax.device_put(floats.astype(ml_dtypes.bfloat16), NamedSharding(mesh, P("b"))),
    "f16": jnp.asarray(floats, dtype=jnp.float16),
    "f8": jnp.asarray(floats, dtype=jnp.float8_e4m3fn),
    "c64": jnp.asarray(floats + 1j * floats[::-1], dtype=jnp.complex64),
    "i8": jnp.asarray(np.arange(-8, 8, dtype=np.int8)),
    "u32": jnp.asarray(np.arange(4, dtype=np.uint32) + 2**31),
    "flag": jax.device_put(np.array([True, False, True, True]), NamedSharding(mesh, P("a"))),
    "np_i64": big + 1,
    "np_f64": floats * 3,
    "np_bf16": floats.astype(ml_dtypes.bfloat16),
    "np_scalar": np.float64(1.0 / 3.0),
    "py_int": 2**40 + 3,
    "py_float": 0.1,
}

def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)

def exact(got):
    bad = []
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state),
                            jax.tree_util.tree_leaves(got), strict=True):
        a_np, b_np = np.asarray(a), np.asarray(b)
        if (type(a) in (int, float) and (type(b) is not type(a) or a != b)) or (
                a_np.dtype != b_np.dtype or a_np.tobytes() != b_np.tobytes()):
            bad.append(f"{jax.tree_util.keystr(path)}: {a!r} vs {b!r}")
    return bad

out = {}
for ocdbt in (False, True):
    d = os.path.join(root, f"manager_{ocdbt}")
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=True)
    with aj.CheckpointManager(d, item_handlers=handler) as mgr:
        mgr.save(1, args=ocp.args.PyTreeSave(state))
        mine = mgr.restore(1, args=ocp.args.PyTreeRestore(abstract(state)))
    with ocp.CheckpointManager(d) as theirs:
        orbax = theirs.restore(1, args=ocp.args.StandardRestore(abstract(state)))
    path = os.path.join(root, f"checkpointer_{ocdbt}")
    with aj.PyTreeCheckpointer(use_ocdbt=ocdbt, use_zarr3=True) as c:
        c.save(path, args=ocp.args.PyTreeSave(state))
        mine_c = c.restore(path, args=ocp.args.PyTreeRestore(abstract(state)))
    with ocp.PyTreeCheckpointer() as c:
        orbax_c = c.restore(path, item=abstract(state), restore_args=(
            ocp.checkpoint_utils.construct_restore_args(abstract(state))))
    meta = json.load(open(os.path.join(path, "_METADATA")))
    out[str(ocdbt)] = {"asyncckpt": exact(mine), "orbax": exact(orbax),
                       "asyncckpt_checkpointer": exact(mine_c),
                       "orbax_checkpointer": exact(orbax_c), "use_zarr3": meta["use_zarr3"]}
print("RESULT " + json.dumps(out))
"""


def test_every_dtype_round_trips_byte_exact_with_x64(tmp_path):
    """bfloat16, float8, int64 beyond 2**32, uint64 above 2**63, complex, bool: the same bytes
    back from asyncckpt and from orbax, both layouts (x64 on: in a child process)."""
    script = write_script(tmp_path, "dtypes.py", DTYPES_WORKER)
    proc = run_python(script, str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for layout in ("False", "True"):
        assert result[layout] == {"asyncckpt": [], "orbax": [], "asyncckpt_checkpointer": [],
                                  "orbax_checkpointer": [], "use_zarr3": True}, result


@pytest.mark.parametrize("use_compression", [True, False])
def test_asyncckpt_reads_orbaxs_own_zarr3_partially_and_resharded(ckpt_dir, use_compression):
    """orbax's zarr v3 (its sharding_indexed codec, zstd or not) is read through
    TensorStore, in either layout."""
    state = _state(4)
    mesh = _mesh((8,), ("d",))
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "d")))
    for use_ocdbt in (False, True):
        directory = ckpt_dir / f"ocdbt{use_ocdbt}"
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=True,
                                              use_compression=use_compression)
        with ocp.CheckpointManager(str(directory), item_handlers=handler,
                                   options=ocp.CheckpointManagerOptions(
                                       enable_async_checkpointing=False)) as theirs:
            theirs.save(4, args=ocp.args.PyTreeSave(state))
        item = directory / "4" / "default"
        codecs = _zarr_json(item, "params.w", ocdbt=use_ocdbt)["codecs"]
        assert codecs[0]["name"] == "sharding_indexed"
        assert not _reads_raw(item)  # not asyncckpt's raw layout: TensorStore decodes it
        with aj.CheckpointManager(directory) as mgr:
            # orbax's PyTreeRestore takes the structure from its item; the sharding
            # comes from restore_args.
            got = mgr.restore(4, args=ocp.args.PyTreeRestore(
                {"params": {"w": w}}, partial_restore=True,
                restore_args={"params": {"w": ocp.ArrayRestoreArgs(sharding=w.sharding)}}))
            assert got["params"]["w"].sharding == w.sharding
            _same(state["params"]["w"], got["params"]["w"])
            _same(state, mgr.restore(4, target=_abstract(state)))


def test_zarr3_is_chosen_by_one_spelling_at_a_time(ckpt_dir):
    with pytest.raises(ValueError, match="use_zarr3"):
        aj.CheckpointManager(ckpt_dir, item_handlers={"state": ZARR3_OCDBT},
                             format_options=aj.FormatOptions(use_zarr3=False))
    with pytest.raises(TypeError, match="use_zarr3"):
        aj.FormatOptions(use_zarr3="yes")
    with pytest.raises(TypeError, match="use_zarr3"):
        aj.PyTreeCheckpointer(use_zarr3=1)
    # Agreeing spellings, and items of both versions in one step.
    handlers = {"v3": ZARR3_FILES, "v2": ocp.PyTreeCheckpointHandler(use_ocdbt=False)}
    a, b = {"x": jnp.arange(8.0)}, {"y": np.arange(4, dtype=np.int32)}
    with aj.CheckpointManager(ckpt_dir / "both", item_handlers=handlers) as mgr:
        mgr.save(1, args=ocp.args.Composite(v3=ocp.args.PyTreeSave(a),
                                            v2=ocp.args.PyTreeSave(b)))
        got = mgr.restore(1, args=ocp.args.Composite(v3=ocp.args.PyTreeRestore(a),
                                                     v2=ocp.args.PyTreeRestore(b)))
    _same(a, got.v3)
    _same(b, got.v2)
    step = ckpt_dir / "both" / "1"
    assert (step / "v3" / "x" / "zarr.json").is_file() and (step / "v3" / "x" / "c" / "0").is_file()
    assert (step / "v2" / "y" / ".zarray").is_file() and (step / "v2" / "y" / "0").is_file()
    with ocp.CheckpointManager(str(ckpt_dir / "both"), item_handlers=handlers) as theirs:
        got = theirs.restore(1, args=ocp.args.Composite(v3=ocp.args.PyTreeRestore(a),
                                                        v2=ocp.args.PyTreeRestore(b)))
    _same(a, got.v3)
    _same(b, got.v2)


def test_catalog_describes_zarr3_arrays(ckpt_dir):
    from asyncckpt import catalog

    state = {"w": jnp.ones((4, 6), jnp.bfloat16), "n": np.arange(5, dtype=np.int64)}
    for name, handler in (("files", ZARR3_FILES), ("ocdbt", ZARR3_OCDBT)):
        directory = ckpt_dir / name
        with aj.CheckpointManager(directory, item_handlers=handler) as mgr:
            mgr.save(1, state)
        (found,) = catalog.list_checkpoints(str(directory))
        described = {a.name: (a.shape, a.dtype, a.nbytes) for a in catalog.describe_arrays(found)}
        assert described == {"w": ((4, 6), "bfloat16", 48), "n": ((5,), "int64", 40)}
        catalog.verify(found)


def test_every_directory_above_a_nested_chunk_file_is_made_durable(tmp_path):
    """zarr v3 chunk keys are nested (w/c/0/1): each directory on the way holds the
    entry of the next, so each is fsynced."""
    synced: list[str] = []

    class Recording(files_lib.DurableWriter):  # the real writer, recording its fsyncs
        def sync(self, path):
            synced.append(os.path.relpath(path, tmp_path))
            super().sync(path)

    writer = Recording(str(tmp_path), fsync=True, checksums=True)
    writer.write("default/w/c/0/1", (b"x",))
    writer.write("default/w/zarr.json", (b"{}",))
    writer.finish()
    assert {p for p in synced if not p.endswith(("1", ".json"))} >= {
        ".", "default", "default/w", "default/w/c", "default/w/c/0"}


TWO_PROCESS_WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pid, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
import orbax.checkpoint as ocp
import asyncckpt.jax as aj

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
bf = (np.arange(32) * 3).astype(jnp.bfloat16)


def global_array(value, spec):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda idx: value[idx])


state = {"w": global_array(w, P("a", "b")), "bf": global_array(bf, P("a")), "step": 3}
mesh2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
target = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32,
                                    sharding=NamedSharding(mesh2, P(("x", "y")))),
          "bf": jax.ShapeDtypeStruct((32,), jnp.bfloat16, sharding=NamedSharding(mesh2, P("y"))),
          "step": 0}
out = {}
for ocdbt in (True, False):
    directory = os.path.join(root, f"ocdbt{ocdbt}")
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=True)
    with aj.CheckpointManager(directory, item_handlers=handler, coordination_timeout_s=60) as mgr:
        mgr.save(3, args=ocp.args.PyTreeSave(state))
        mgr.wait_until_finished()
        got = mgr.restore(3, target=target)
    ok = got["step"] == 3
    for k, value in (("w", w), ("bf", bf)):
        for shard in got[k].addressable_shards:
            ok = ok and np.array_equal(np.asarray(shard.data), value[shard.index])
    out[str(ocdbt)] = bool(ok)
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_two_processes_write_one_zarr3_checkpoint_in_either_layout(tmp_path):
    """Each process writes its own shards' zarr v3 chunks (OCDBT: into its own database,
    merged by process 0); both processes, this one, and orbax restore it."""
    from tests.helpers import run_workers, subprocess_env
    from tests.servers import free_port

    script = write_script(tmp_path, "worker.py", TWO_PROCESS_WORKER)
    port = str(free_port())
    results = run_workers(script, [[str(i), port, str(tmp_path)] for i in range(2)],
                          env=subprocess_env(JAX_PLATFORMS="cpu"))
    assert results == [{"True": True, "False": True}] * 2, results
    mesh = _mesh((8,), ("d",))
    expected = {"w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8),
                "bf": (np.arange(32) * 3).astype(jnp.bfloat16), "step": 3}
    target = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("d"))),
              "bf": jax.ShapeDtypeStruct((32,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
              "step": 0}
    for ocdbt in (True, False):
        directory = tmp_path / f"ocdbt{ocdbt}"
        item = directory / "3" / "default"
        manifest = {f["name"] for f in json.loads(
            (directory / "3" / "asyncckpt.manifest.json").read_text())["files"]}
        if ocdbt:
            assert {"default/ocdbt.process_0/manifest.ocdbt",
                    "default/ocdbt.process_1/manifest.ocdbt"} <= manifest
            assert [k for k in _keys(item) if k.startswith("w/")] == (
                [f"w/c/{i}/{j}" for i in range(4) for j in range(2)] + ["w/zarr.json"])
        else:
            assert {f"default/w/c/{i}/{j}" for i in range(4) for j in range(2)} <= manifest
        with aj.CheckpointManager(directory) as mgr:
            _same(expected, mgr.restore(3, target=target))
        with ocp.CheckpointManager(str(directory)) as theirs:
            _same(expected, theirs.restore(3, args=ocp.args.StandardRestore(target)))

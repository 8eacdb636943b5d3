"""asyncckpt.jax: round trips, orbax compatibility, snapshot semantics, resharding, errors."""

from __future__ import annotations

import collections
import json
import logging
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
from asyncckpt import (  # noqa: E402
    CheckpointNotFoundError,
    EngineClosedError,
    UnsupportedObjectError,
)
from asyncckpt.jax import _snapshot  # noqa: E402

logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's INFO/WARNING chatter


def _mesh(shape=(4, 2), names=("a", "b"), devices=None):
    devices = jax.devices()[: int(np.prod(shape))] if devices is None else devices
    return Mesh(np.array(devices).reshape(shape), names)


def _state():
    """Every leaf kind the issue asks for, nested in dicts, lists and tuples."""
    mesh = _mesh()
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": jax.device_put(
                rng.standard_normal((16, 8), dtype=np.float32), NamedSharding(mesh, P("a", "b"))
            ),
            "b": jax.device_put(
                jnp.asarray(rng.standard_normal(8), jnp.bfloat16), NamedSharding(mesh, P("b"))
            ),
            "replicated": jax.device_put(jnp.arange(6, dtype=jnp.int32), NamedSharding(mesh, P())),
        },
        "opt": [
            {"mu": jnp.full((3, 5), 0.5, jnp.float32), "count": jnp.int32(7)},
            (np.arange(10, dtype=np.int64), np.float32(2.5)),
        ],
        "step": 42,
        "lr": 1e-3,
        "flag": True,
        "empty": {},
        "nothing": None,
    }


def _abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x,
        tree,
    )


def _assert_tree_equal(expected, got):
    exp_leaves, exp_def = jax.tree_util.tree_flatten(expected)
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    assert exp_def == got_def, (exp_def, got_def)
    for e, g in zip(exp_leaves, got_leaves, strict=True):
        assert type(e) is type(g) or (isinstance(e, jax.Array) and isinstance(g, jax.Array)), (
            type(e), type(g))
        ea, ga = np.asarray(e), np.asarray(g)
        assert ea.dtype == ga.dtype and ea.shape == ga.shape, (ea.dtype, ga.dtype)
        # Bit-exact: compare the raw bytes (also for bfloat16 and NaNs).
        assert ea.tobytes() == ga.tobytes()
        if isinstance(e, jax.Array):
            assert g.sharding.is_equivalent_to(e.sharding, e.ndim)


def test_round_trip_is_bit_exact_for_every_leaf_kind(ckpt_dir):
    state = _state()
    with aj.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.save(1, state)
        restored = mgr.restore(1, target=_abstract(state))
    _assert_tree_equal(state, restored)
    assert restored["opt"][1][1].dtype == np.float32 and isinstance(restored["step"], int)


def test_orbax_restores_an_asyncckpt_checkpoint(ckpt_dir):
    state = _state()
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(5, state)
    # A target as orbax users write it (orbax cannot restore into np.float32 scalars).
    state["opt"][1] = (state["opt"][1][0], np.asarray(state["opt"][1][1]))
    target = _abstract(state)
    orbax_mgr = ocp.CheckpointManager(str(ckpt_dir))
    assert orbax_mgr.all_steps() == [5]
    restored = orbax_mgr.restore(5, args=ocp.args.StandardRestore(target))
    _assert_tree_equal(state, restored)
    # Without a target orbax rebuilds the shardings from our `_sharding` file.
    bare = orbax_mgr.restore(5)
    assert bare["params"]["w"].sharding.is_equivalent_to(state["params"]["w"].sharding, 2)
    np.testing.assert_array_equal(np.asarray(bare["params"]["w"]), state["params"]["w"])
    orbax_mgr.close()


def test_layout_is_uncompressed_zarr_with_one_chunk_per_shard(ckpt_dir):
    state = _state()
    with aj.CheckpointManager(ckpt_dir, format_options=aj.FormatOptions(use_ocdbt=False)) as mgr:
        mgr.save(0, state)
    w_dir = ckpt_dir / "0" / "default" / "params.w"
    meta = json.loads((w_dir / ".zarray").read_text())
    assert meta["compressor"] is None and meta["chunks"] == [4, 4] and meta["shape"] == [16, 8]
    chunks = sorted(p.name for p in w_dir.iterdir() if not p.name.startswith("."))
    assert chunks == [f"{i}.{j}" for i in range(4) for j in range(2)]
    raw = np.fromfile(w_dir / "1.0", dtype=np.float32).reshape(4, 4)
    np.testing.assert_array_equal(raw, np.asarray(state["params"]["w"])[4:8, 0:4])
    # Replicated data is written once (replica 0), not once per device.
    assert sorted(os.listdir(ckpt_dir / "0" / "default" / "params.replicated")) == [".zarray", "0"]
    bf = json.loads((ckpt_dir / "0" / "default" / "params.b" / ".zarray").read_text())
    assert bf["dtype"] == "bfloat16"


def test_donated_arrays_after_save_do_not_change_the_checkpoint(ckpt_dir):
    mesh = _mesh((8,), ("d",))
    state = {
        f"w{i}": jax.device_put(jnp.full((1024, 64), float(i), jnp.float32),
                                NamedSharding(mesh, P("d")))
        for i in range(4)
    }
    update = jax.jit(lambda t: {k: v * 0.0 - 1.0 for k, v in t.items()}, donate_argnums=0)
    expected = {k: np.asarray(v).copy() for k, v in state.items()}
    pointers = {k: v.addressable_shards[0].data.unsafe_buffer_pointer() for k, v in state.items()}
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
        new = update(state)  # right after save(): the old buffers are reused in place
        jax.block_until_ready(new)
        assert all(state[k].is_deleted() for k in state)
        in_place = sum(
            new[k].addressable_shards[0].data.unsafe_buffer_pointer() == pointers[k] for k in new
        )
        assert in_place > 0, "the donation should reuse buffers (no reference left behind)"
        restored = mgr.restore(1, target=_abstract(new))
    for k, v in expected.items():
        np.testing.assert_array_equal(np.asarray(restored[k]), v)


def test_reshard_on_restore_8_devices_to_a_2_device_mesh(ckpt_dir):
    mesh8 = _mesh((4, 2), ("a", "b"))
    x = jax.device_put(
        np.arange(32 * 12, dtype=np.float32).reshape(32, 12), NamedSharding(mesh8, P("a", "b"))
    )
    y = jax.device_put(np.arange(24, dtype=np.int32), NamedSharding(mesh8, P(("a", "b"))))
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(3, {"x": x, "y": y})
        mesh2 = _mesh((2,), ("m",), devices=jax.devices()[6:8])
        target = {
            "x": jax.ShapeDtypeStruct(x.shape, x.dtype,
                                      sharding=NamedSharding(mesh2, P(None, "m"))),
            "y": jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=NamedSharding(mesh2, P())),
        }
        got = mgr.restore(3, target=target)
        # And onto a single device with a dtype cast, as a jax.Array target.
        single = jax.device_put(jnp.zeros(x.shape, jnp.float64 if jax.config.x64_enabled
                                          else jnp.float32), jax.devices()[1])
        one = mgr.restore(3, target={"x": single, "y": y})
    assert got["x"].sharding == target["x"].sharding and len(got["x"].sharding.device_set) == 2
    np.testing.assert_array_equal(np.asarray(got["x"]), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(got["y"]), np.asarray(y))
    assert one["x"].sharding.device_set == {jax.devices()[1]}
    np.testing.assert_array_equal(np.asarray(one["x"]), np.asarray(x))


def test_restore_without_target_gives_nested_dicts_and_lists(ckpt_dir):
    state = _state()
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(2, state, custom_metadata={"total_run_calls": 17, "note": "hi"})
        bare = mgr.restore()
        meta = mgr.metadata(2)
    assert set(bare) == set(state)
    np.testing.assert_array_equal(np.asarray(bare["params"]["w"]), np.asarray(state["params"]["w"]))
    assert isinstance(bare["params"]["w"], jax.Array)
    assert isinstance(bare["opt"][1], list) and isinstance(bare["opt"][1][0], np.ndarray)
    assert bare["step"] == 42 and bare["flag"] is True and bare["empty"] == {}
    assert bare["nothing"] is None
    assert meta.custom_metadata == {"total_run_calls": 17, "note": "hi"}
    assert meta.stats["nbytes"] > 0 and meta.stats["blocking_s"] >= 0
    # orbax's manager sees the same custom metadata.
    orbax_mgr = ocp.CheckpointManager(str(ckpt_dir))
    assert dict(orbax_mgr.metadata(2).custom_metadata) == {"total_run_calls": 17, "note": "hi"}
    orbax_mgr.close()


def test_asyncckpt_restores_checkpoints_written_by_orbax(tmp_path):
    state = {"a": jnp.arange(12.0).reshape(3, 4), "b": {"c": np.arange(5, dtype=np.int32)}}
    for ocdbt in (False, True):
        d = tmp_path / f"orbax-{ocdbt}"
        with ocp.CheckpointManager(
            str(d),
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
            item_handlers=ocp.StandardCheckpointHandler(use_ocdbt=ocdbt),
        ) as orbax_mgr:
            orbax_mgr.save(4, args=ocp.args.StandardSave(state))
        with aj.CheckpointManager(d) as mgr:
            assert mgr.all_steps() == [4]
            got = mgr.restore(target=_abstract(state))
        _assert_tree_equal(state, got)


def test_staging_reuses_host_buffers_between_saves(ckpt_dir):
    state = {"w": jax.device_put(jnp.ones((64, 64)), NamedSharding(_mesh((8,), ("d",)), P("d")))}
    with aj.CheckpointManager(ckpt_dir) as mgr:
        for step in range(4):
            mgr.save(step, state)
            mgr.wait_until_finished()
        pool = mgr.engine._pool
        # Buffers kept: every slot holds one copy of the state (the ones the
        # saves did not use were prepared in the background), none more.
        assert pool.wait_prepared(60)
        assert mgr.engine.staging_bytes == pool.num_slots * 64 * 64 * 4
        assert all(s.nbytes == 64 * 64 * 4 for s in pool._slots)
        assert sum(s.allocations for s in pool._slots) == 0  # the last save allocated nothing
    assert [s.step for s in mgr.engine.history] == [0, 1, 2, 3]


def test_plans_are_cached_per_tree_shape():
    snap = _snapshot.Snapshotter(primary=True)
    a = {"x": jnp.ones(4), "y": [1, 2.0]}
    plan1, _ = snap.plan(a)
    plan2, _ = snap.plan({"x": jnp.zeros(4), "y": [3, 4.0]})
    plan3, _ = snap.plan({"x": jnp.zeros(5), "y": [3, 4.0]})
    assert plan1 is plan2 and plan3 is not plan1


def test_cached_plans_match_fresh_ones_as_trees_change():
    """No stale plan: every tree, seen before or not, gets the plan built for it.

    The cache keys on the plain tree definition (empty subtrees flattened
    away) and each leaf's type, aval and sharding; trees that differ only in
    empty subtrees, weak types, shapes, dtypes or shardings must not share one.
    """
    mesh = _mesh()
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("a")))
    trees = [
        {"a": x, "b": 1},
        {"a": x, "b": 1, "c": None},  # an empty subtree: one leaf more
        {"a": x, "b": 1, "c": {}},
        {"a": x, "b": 1, "c": [None, ()]},
        {"a": x, "b": 2.0},  # a scalar's type
        {"a": jnp.asarray(x, jnp.bfloat16), "b": 1},  # dtype
        {"a": jnp.ones((8, 2)), "b": 1},  # shape and sharding (one device)
        {"a": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "b"))), "b": 1},
        {"a": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P())), "b": 1},
        {"a": jnp.float32(1), "b": 1},
        {"a": jnp.asarray(1.0), "b": 1},  # the same but weakly typed
        {"a": np.ones((8, 4), np.float32), "b": 1},  # a NumPy leaf in its place
    ]
    snap = _snapshot.Snapshotter(primary=True)
    for _ in range(2):  # the second round runs on cached plans and cached flatten verdicts
        for tree in trees:
            plan, leaves = snap.plan(tree)
            full, _ = jax.tree_util.tree_flatten(tree, is_leaf=lambda v: v is None or (
                type(v) in (dict, list, tuple) and not v))
            assert len(leaves) == len(full)
            assert all(a is b for a, b in zip(leaves, full, strict=True))
            fresh = _snapshot.build_plan(tree, full, primary=True)
            assert plan.leaves == fresh.leaves
            assert plan.metadata_files == fresh.metadata_files
    # A new array of the same aval and sharding (the next training step) reuses the plan.
    assert snap.plan({"a": x + 1, "b": 5})[0] is snap.plan(trees[0])[0]


@pytest.mark.parametrize("path", ["host view", "transfer", "pinned host"])
def test_every_staging_path_stages_each_shard_exactly(path):
    """The three ways a jax.Array chunk is staged, each forced on CPU devices.

    CPU leaves normally take the host-view path; an accelerator's take the
    device-to-host transfer or the pinned-host copy. A Snapshotter whose
    plans say so runs those paths here on real arrays (CPU devices have a
    ``pinned_host`` memory too).
    """
    import dataclasses

    class Forced(_snapshot.Snapshotter):
        def plan(self, tree, chunking=None, ocdbt=None, *, zarr3=False):
            plan, leaves = super().plan(tree, chunking, ocdbt, zarr3=zarr3)
            lps = []
            for lp, leaf in zip(plan.leaves, leaves, strict=True):
                if lp.kind == "jax" and path == "transfer":
                    lp = dataclasses.replace(lp, host_view=False)
                elif lp.kind == "jax" and path == "pinned host":
                    lp = dataclasses.replace(
                        lp, pinned=leaf.sharding.with_memory_kind("pinned_host"))
                lps.append(lp)
            return _snapshot.Plan(tuple(lps), plan.metadata_files, plan.entries), leaves

    mesh = _mesh()
    x = jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8),
                       NamedSharding(mesh, P("a", "b")))
    z = jax.device_put(np.arange(24, dtype=np.int32).reshape(8, 3), NamedSharding(mesh, P("a")))
    tree = {"x": x, "n": np.arange(3), "s": 2.0, "z": z}
    snap = Forced(primary=True)
    from asyncckpt._engine.slots import Slot

    overwrite = jax.jit(lambda t: {k: v * 0 - 7 for k, v in t.items()}, donate_argnums=0,
                        out_shardings={"x": x.sharding, "z": z.sharding})
    for _ in range(2):  # the second save runs on the cached plan's steps
        slot = Slot(0)
        slot.begin()
        staged = snap.stage(tree, slot)
        plan, leaves = snap.plan(tree)
        assert (path == "transfer") == bool(plan.transfers)
        assert (path == "pinned host") == bool(plan.pinned) == bool(staged.keepalive)
        assert len(staged.chunks) == plan.chunk_count == 8 + 1 + 1 + 4
        want = {}
        for lp, leaf, names in zip(plan.leaves, leaves, plan.names(_snapshot.fmt.ITEM),
                                   strict=True):
            for c, name in zip(lp.chunks, names, strict=True):
                want[name] = (np.array(leaf.addressable_shards[c.shard].data)
                              if lp.kind == "jax" else np.array(leaf))
        # The staged bytes are the values at the call, whatever the arrays become.
        x, z = overwrite({"x": x, "z": z}).values()
        jax.block_until_ready((x, z))
        for name, value in staged.chunks:
            np.testing.assert_array_equal(value, want[name])
        tree = {"x": x, "n": np.arange(3), "s": 2.0, "z": z}


def _save_and_restore_each(mgr, variants) -> None:
    """Saves each tree as its own step, then restores each and compares."""
    for step, state in enumerate(variants):
        assert mgr.save(step, state)
    mgr.wait_until_finished()
    for step, state in enumerate(variants):
        _assert_tree_equal(state, mgr.restore(step, target=_abstract(state)))


def test_leaf_shape_dtype_and_sharding_changes_between_saves_restore_exactly(ckpt_dir):
    """The cached plan and slot views never outlive the structure they were made for."""
    mesh = _mesh()
    rng = np.random.default_rng(3)

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    base = {"w": put(rng.standard_normal((16, 8), dtype=np.float32), P("a", "b")),
            "n": np.arange(6, dtype=np.int32)}
    w8 = rng.standard_normal((8, 8))
    variants = [
        base,  # twice: the second save runs on the cached plan
        {**base, "w": put(rng.standard_normal((16, 8), dtype=np.float32), P("a", "b"))},
        {**base, "w": put(w8.astype(np.float32), P("a", "b"))},  # shape
        {**base, "w": put(w8.astype(jnp.bfloat16), P("a", "b"))},  # dtype
        {**base, "w": put(w8.astype(jnp.bfloat16), P("b", "a"))},  # sharding
        {**base, "w": put(w8.astype(jnp.bfloat16), P())},  # replicated
        {**base, "n": np.arange(7, dtype=np.int64)},  # a host leaf's shape and dtype
        {**base, "extra": jnp.ones(3)},  # a leaf added
        base,  # and back
    ]
    with aj.CheckpointManager(ckpt_dir, max_to_keep=None) as mgr:
        _save_and_restore_each(mgr, variants)


def test_one_device_trees_reuse_their_plan_only_while_every_leaf_matches(ckpt_dir):
    """Arrays each on one device take the fast paths (plan checked in C, no per-chunk
    loop); any change of a leaf's type, shape, dtype or device gets a new plan."""
    rng = np.random.default_rng(5)
    d0, d1 = jax.devices()[:2]

    def tree(dtype=np.float32, shape=(6, 4), device=d0, b=None):
        a = jax.device_put(rng.standard_normal(shape).astype(dtype), device)
        return {"a": a, "b": jnp.arange(5) if b is None else b}

    variants = [tree(), tree(), tree(shape=(3, 4)), tree(dtype=jnp.bfloat16),
                tree(device=d1), tree(b=np.arange(5)), tree(b=jnp.arange(5.0)), tree()]
    with aj.CheckpointManager(ckpt_dir, max_to_keep=None) as mgr:
        _save_and_restore_each(mgr, variants)


def test_trees_of_jax_arrays_only_are_staged_by_column_with_every_shard(ckpt_dir):
    """Sharded, replicated and one-device arrays together (staged without a loop
    per chunk); a NumPy leaf among them sends the tree back to the loop."""
    mesh = _mesh()
    rng = np.random.default_rng(7)

    def put(shape, spec):
        return jax.device_put(rng.standard_normal(shape).astype(np.float32),
                              NamedSharding(mesh, spec))

    def state():
        return {"w": put((16, 8), P("a", "b")), "r": put((5,), P()), "one": jnp.arange(3.0),
                "b": put((8,), P("b"))}

    variants = [state(), state(), {**state(), "n": np.arange(4)}, state()]
    with aj.CheckpointManager(ckpt_dir, max_to_keep=None) as mgr:
        _save_and_restore_each(mgr, variants)
        assert mgr._snapshotter.plan(variants[0])[0].columns("default") is not None
        assert mgr._snapshotter.plan(variants[2])[0].columns("default") is None


def test_a_file_named_as_the_step_blocks_its_save(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"x": jnp.ones(3)})
        mgr.wait_until_finished()
        (ckpt_dir / "2").write_text("not a checkpoint")
        with pytest.raises(aj.StepAlreadyExistsError):
            mgr.save(2, {"x": jnp.ones(3)})
        assert mgr.all_steps() == [1]
        assert mgr.save(3, {"x": jnp.ones(3)})


def test_should_save_interval_force_and_duplicate_steps(ckpt_dir):
    state = {"x": jnp.ones(3)}
    with aj.CheckpointManager(ckpt_dir, save_interval_steps=5) as mgr:
        # As orbax: the first save of an empty directory is always due.
        assert all(mgr.should_save(s) for s in range(12))
        assert mgr.save(3, state)
        assert [s for s in range(12) if mgr.should_save(s)] == [5, 10]
        assert not mgr.save(4, state)
        assert mgr.save(5, state)
        assert not mgr.should_save(5) and not mgr.save(5, state)
        assert mgr.save(7, state, force=True)
        with pytest.raises(ValueError, match="step 5 is already saved"):
            mgr.save(5, state, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 5, 7] and mgr.latest_step() == 7
    with pytest.raises(EngineClosedError):
        mgr.save(20, state)


def test_restoring_a_missing_step_names_the_steps_there(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="no checkpoints"):
            mgr.restore()
        mgr.save(1, {"x": jnp.ones(2)})
        with pytest.raises(CheckpointNotFoundError, match=r"step 9 .*steps there: 1"):
            mgr.restore(9)


def test_target_mismatches_are_clear_errors(ckpt_dir):
    state = {"a": jnp.ones((2, 3)), "b": [np.zeros(4), 1]}
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state)
        with pytest.raises(ValueError, match=r"not in the checkpoint: \['c'\]"):
            mgr.restore(1, {**state, "c": jnp.ones(1)})
        with pytest.raises(ValueError, match=r"but not in the target: \['b'\]\[1\]"):
            mgr.restore(1, {"a": state["a"], "b": [np.zeros(4)]})
        with pytest.raises(ValueError, match=r"\['a'\].*holds shape \(2, 3\).*asks for \(3, 2\)"):
            mgr.restore(1, {**state, "a": jax.ShapeDtypeStruct((3, 2), jnp.float32)})
        with pytest.raises(UnsupportedObjectError, match=r"leaf \['b'\]\[1\] is a builtins.str"):
            mgr.restore(1, {"a": state["a"], "b": [np.zeros(4), "1"]})


def test_unsupported_leaves_are_refused_on_the_calling_thread(ckpt_dir):
    Point = collections.namedtuple("Point", "x y")
    with aj.CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(UnsupportedObjectError, match=r"leaf \['name'\] is a builtins.str"):
            mgr.save(1, {"w": jnp.ones(2), "name": "adam"})
        with pytest.raises(UnsupportedObjectError, match=r"leaf \['x'\] has dtype object"):
            mgr.save(1, {"x": np.array([object()])})
        with pytest.raises(UnsupportedObjectError, match="does not fit in int64"):
            mgr.save(1, {"big": 2**70})
        with pytest.raises(UnsupportedObjectError, match=r"would both be stored as 'a\.b'"):
            mgr.save(1, {"a.b": 1, "a": {"b": 2}})
        deleted = jnp.ones(3)
        deleted.delete()
        with pytest.raises(UnsupportedObjectError, match="deleted"):
            mgr.save(1, {"d": deleted})
        # Nothing was written; a valid save still works, namedtuples included.
        assert mgr.save(1, {"p": Point(jnp.ones(2), 3)})
        got = mgr.restore(1, {"p": Point(jax.ShapeDtypeStruct((2,), jnp.float32), 0)})
    assert isinstance(got["p"], Point) and got["p"].y == 3
    assert os.listdir(ckpt_dir / "1" / "default") and mgr.all_steps() == [1]



def test_a_burst_deeper_than_the_slots_gets_a_spare_slot_and_saves_exact_values(ckpt_dir):
    from asyncckpt import AsyncOptions
    from asyncckpt.jax._job import JaxSaveJob

    gate, entered = threading.Event(), threading.Event()

    class GatedJob(JaxSaveJob):  # the real job, its write held until the gate opens
        def write(self):
            entered.set()
            assert gate.wait(60), "test never opened the gate"
            super().write()

    class Manager(aj.CheckpointManager):
        _job_class = GatedJob

    mesh = _mesh((8,), ("d",))
    state = {"w": jax.device_put(jnp.zeros((512, 64), jnp.float32), NamedSharding(mesh, P("d"))),
             "n": jnp.arange(5, dtype=jnp.int32)}
    step = jax.jit(lambda t: {k: v + 1 for k, v in t.items()}, donate_argnums=0)
    expected = {}
    opts = AsyncOptions(num_slots=1, max_slots=2)
    with Manager(ckpt_dir, async_options=opts) as mgr:
        try:
            mgr.save(0, state, force=True)
            expected[0] = {k: np.asarray(v).copy() for k, v in state.items()}
            assert entered.wait(30)  # the only slot stays in flight
            state = step(state)
            # Finds no free slot: it can only have the spare the pool builds meanwhile.
            mgr.save(1, state, force=True)
            expected[1] = {k: np.asarray(v).copy() for k, v in state.items()}
            assert mgr.engine._pool.num_slots == 2
        finally:
            gate.set()
        for i in range(2, 5):  # a second burst, written at once
            state = step(state)
            mgr.save(i, state, force=True)
            expected[i] = {k: np.asarray(v).copy() for k, v in state.items()}
        mgr.wait_until_finished()
        assert mgr.engine._pool.num_slots == 2
        for i, want in expected.items():
            got = mgr.restore(i, target=_abstract(state))
            for k, v in want.items():
                np.testing.assert_array_equal(np.asarray(got[k]), v)

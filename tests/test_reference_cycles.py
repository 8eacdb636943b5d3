"""Saves and restores leave no reference cycle of asyncckpt's objects behind.

An object in a cycle outlives its last use until the garbage collector next
runs. For a restore that was every buffer it read: the JAX chunk reader held
the OCDBT index, whose file check held the reader, so each restore of a
64 MiB checkpoint left 64 MiB more resident (and later restores slower,
faulting in fresh memory) until a collection, which a training loop's few
allocations may not trigger for a long time. Each test runs the operation
once to warm up, then again with the collector off, and asserts that
collecting afterwards finds nothing of asyncckpt's. The last test is about
the collector's other cost: objects kept alive across young collections
are promoted, and enough of them set off full ones.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import asyncckpt.jax as aj
from asyncckpt.jobrunner.store import ArrayStore


def _left_in_cycles(operation: Callable[[], object]) -> list[str]:
    """The asyncckpt types of the objects that only a collection frees after ``operation``."""
    operation()  # first use: caches, imports, thread pools
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keeps what a collection frees in gc.garbage
    try:
        operation()
        gc.collect()
        found = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                        if type(o).__module__.startswith("asyncckpt")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found


def _state() -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    return {f"a{i}": jax.device_put(np.arange(1 << 16, dtype=np.float32) + i, sharding)
            for i in range(3)}


@pytest.fixture(params=["ocdbt", "zarr"])
def manager(request, tmp_path) -> Iterator[aj.CheckpointManager]:
    options = aj.FormatOptions(use_ocdbt=request.param == "ocdbt")
    with aj.CheckpointManager(tmp_path / "ckpt", format_options=options) as mgr:
        yield mgr


def test_jax_manager_saves_leave_no_cycle(manager):
    state, steps = _state(), iter(range(1, 10))

    def save():
        manager.save(next(steps), state)
        manager.wait_until_finished()

    assert _left_in_cycles(save) == []


def test_jax_manager_restores_leave_no_cycle(manager):
    state = _state()
    manager.save(1, state)
    manager.wait_until_finished()
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    assert _left_in_cycles(lambda: jax.block_until_ready(manager.restore(1, target))) == []
    assert _left_in_cycles(lambda: manager.restore(1)) == []  # no target: as saved
    restored = manager.restore(1, target)
    for name, value in state.items():  # and with asyncckpt's reader, the values are right
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value))


def test_jax_checkpointer_save_and_restore_leave_no_cycle(tmp_path):
    state, paths = _state(), iter(range(10))
    with aj.StandardCheckpointer() as ckptr:
        def save():
            ckptr.save(tmp_path / f"c{next(paths)}", state)
            ckptr.wait_until_finished()

        assert _left_in_cycles(save) == []
        assert _left_in_cycles(lambda: jax.block_until_ready(ckptr.restore(tmp_path / "c0"))) == []


def test_array_store_save_and_restore_leave_no_cycle(tmp_path):
    arrays = {"w": np.arange(1 << 16, dtype=np.float32), "b": np.ones(7, np.int64)}
    steps = iter(range(1, 10))
    store = ArrayStore(tmp_path / "runs", max_to_keep=None)
    try:
        def save():
            store.save(next(steps), arrays)
            store.wait_until_finished()

        assert _left_in_cycles(save) == []
        assert _left_in_cycles(lambda: store.restore(1)) == []
        np.testing.assert_array_equal(store.restore(1).arrays["w"], arrays["w"])
    finally:
        store.close()


def test_tensorflow_saves_and_restores_leave_no_cycle(tmp_path):
    tf = pytest.importorskip("tensorflow")
    import asyncckpt.tf as at

    v = tf.Variable(tf.random.normal([1 << 16]))
    ckpt = at.Checkpoint(v=v)
    mgr = at.CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)

    def save():
        mgr.save()
        mgr.sync()

    assert _left_in_cycles(save) == []
    assert _left_in_cycles(lambda: ckpt.restore(mgr.latest_checkpoint)) == []
    assert _left_in_cycles(mgr.restore_or_initialize) == []
    saved = v.numpy()
    v.assign(tf.zeros_like(v))
    ckpt.restore(mgr.latest_checkpoint)
    np.testing.assert_array_equal(v.numpy(), saved)
    w = tf.Variable(tf.zeros_like(v))  # plain TensorFlow reads the same files
    tf.train.Checkpoint(v=w).restore(mgr.latest_checkpoint).expect_partial()
    np.testing.assert_array_equal(w.numpy(), saved)


def test_a_save_of_many_shards_gives_the_collector_no_views_to_promote(tmp_path):
    """The staging copy views each CPU shard only while it copies it.

    NumPy keeps a memoryview, and its managed buffer, both tracked by the
    collector, as the base of a view of a CPU ``jax.Array``. Views of every
    shard taken before the copy lived through all of it, so the young
    collections during the copy promoted them: 8,000 objects a save at
    4,000 shards, and every fifth save paid a full collection (70 ms with
    JAX loaded) inside the training thread's wait. Here a young collection
    runs every 50 allocations during the save's copy; at most a few views
    may ever be found in the oldest generation.
    """
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    state = {f"a{i:03d}": jax.device_put(np.arange(2048, dtype=np.float32) + i, sharding)
             for i in range(250)}  # 2,000 shards of 1 KiB
    found: list[int] = []

    def count_old_views(phase: str, info: dict) -> None:
        if phase == "stop":
            found.append(sum(1 for o in gc.get_objects(2) if type(o) is memoryview))

    with aj.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, state)  # first use: the plan, the slot
        mgr.wait_until_finished()
        gc.collect()
        gc.freeze()  # what is alive now is not the save's (and keeps each scan short)
        threshold = gc.get_threshold()
        gc.set_threshold(50, 1, 10**9)  # young collections often, never a full one
        gc.callbacks.append(count_old_views)
        try:
            mgr.save(2, state)  # returns once the copy is done
        finally:
            gc.callbacks.remove(count_old_views)
            gc.set_threshold(*threshold)
        mgr.wait_until_finished()
        restored = mgr.restore(2)
    assert len(found) > 20  # the copy ran under many collections
    assert max(found) <= 8, found
    orbax_restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt" / "2" / "default")
    for name, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value))
        np.testing.assert_array_equal(np.asarray(orbax_restored[name]), np.asarray(value))

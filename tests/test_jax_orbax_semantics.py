"""orbax's restore semantics, leaf by leaf, its legacy spellings, typed PRNG keys and types.

Every restore is done twice on the same files, with asyncckpt's reader and
with orbax's own (``ocp.StandardCheckpointer`` / ``ocp.PyTreeCheckpointer`` /
``ocp.CheckpointManager``), and the two results are compared leaf by leaf:
Python type, dtype, value and (for ``jax.Array``s) sharding.
"""

from __future__ import annotations

import abc
import functools
import os
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt import UnsupportedObjectError  # noqa: E402
from tests.helpers import run_python, subprocess_env, write_script  # noqa: E402

BIG = 2**40  # an int64 that an int32 cannot hold


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _is_key(x):
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _leaf(x):
    """What a restored leaf is: its kind, dtype, values, and a jax.Array's sharding."""
    if _is_key(x):
        return ("key", str(jax.random.key_impl(x)), x.shape,
                np.asarray(jax.random.key_data(x)).tolist(), x.sharding)
    if isinstance(x, jax.Array):
        return ("jax", str(x.dtype), np.asarray(x).tolist(), x.sharding)
    if isinstance(x, np.ndarray):
        return ("numpy", str(x.dtype), x.tolist())
    if isinstance(x, np.generic):
        return ("npscalar", str(x.dtype), x.item())
    return (type(x).__name__, x)


def _same(got, want):
    """``got`` and ``want`` alike: structure, and each leaf by ``_leaf``."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        assert _leaf(g) == _leaf(w), jax.tree_util.keystr(path)


def _numpy_state():
    return {
        "i64": np.arange(3, dtype=np.int64) + BIG + 7,
        "f64": np.array([1e300, 1.5]),
        "u8": np.arange(4, dtype=np.uint8),
        "w": jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(_mesh((4, 2), ("a", "b")),
                                                                          P("a", "b"))),
        "on5": jax.device_put(jnp.arange(3), jax.devices()[5]),
        "step": 3,
        "lr": 0.25,
    }


def test_numpy_leaves_come_back_as_numpy_with_their_dtype_and_jax_arrays_as_saved(tmp_path):
    """The x64 flag is off here: int64 2**40 + k and 1e300 come back exactly, as NumPy."""
    assert not jax.config.jax_enable_x64
    state = _numpy_state()
    with aj.StandardCheckpointer() as c:
        c.save(tmp_path / "s", state)
    # A ShapeDtypeStruct without a sharding: NumPy for a NumPy leaf, the saved sharding
    # for a jax.Array (orbax's to_shape_dtype_struct keeps a jax.Array's sharding: drop it).
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in
                state.items() if not isinstance(v, (int, float))}
    abstract.update(step=0, lr=0.0)
    with aj.StandardCheckpointer() as c:
        got = {name: c.restore(tmp_path / "s", target)
               for name, target in (("none", None), ("abstract", abstract))}
    with ocp.StandardCheckpointer() as c:
        want = {name: c.restore(tmp_path / "s", target)
                for name, target in (("none", None), ("abstract", abstract))}
    for name in got:
        _same(got[name], want[name])
        assert _leaf(got[name]["i64"]) == ("numpy", "int64", (np.arange(3) + BIG + 7).tolist())
        assert got[name]["f64"].dtype == np.float64 and got[name]["f64"][0] == 1e300
        assert got[name]["w"].sharding == state["w"].sharding
        assert got[name]["on5"].sharding == state["on5"].sharding  # device 5, as saved
    # A PyTree handler's item gives the structure only: leaves come back as saved.
    other = {**jax.tree.map(lambda x: np.zeros_like(x, dtype=np.float16), state), "step": 1.5}
    with aj.PyTreeCheckpointer() as c:
        got = c.restore(tmp_path / "s", item=other)
    _same(got, ocp.PyTreeCheckpointer().restore(tmp_path / "s", item=other))
    assert got["i64"].dtype == np.int64 and got["step"] == 3


def test_a_jax_array_x64_cannot_hold_is_narrowed_as_orbax_does_but_with_a_warning(tmp_path):
    with aj.StandardCheckpointer() as c:
        c.save(tmp_path / "s", {"i64": np.arange(3, dtype=np.int64) + BIG})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"i64": jax.ShapeDtypeStruct((3,), np.int64, sharding=device)}
    with aj.StandardCheckpointer() as c, pytest.warns(UserWarning, match=r"\['i64'\].*int32"):
        got = c.restore(tmp_path / "s", target)
    with ocp.StandardCheckpointer() as c, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = c.restore(tmp_path / "s", target)
    _same(got, want)  # the same int32 values as orbax's
    # Asked for explicitly, a narrowing cast is no surprise: no warning.
    target = {"i64": jax.ShapeDtypeStruct((3,), np.int32, sharding=device)}
    with aj.StandardCheckpointer() as c, warnings.catch_warnings():
        warnings.simplefilter("error")
        got = c.restore(tmp_path / "s", target)
    _same(got, ocp.StandardCheckpointer().restore(tmp_path / "s", target))


def test_none_target_leaves_are_skipped_unread_and_masked_nodes_restore_as_orbax(tmp_path):
    params = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    full = optax.adam(1e-3).init(params)
    masked = optax.masked(optax.adam(1e-3), {"w": True, "b": False}).init(params).inner_state
    with aj.StandardCheckpointer(use_ocdbt=False) as c:
        c.save(tmp_path / "full", {"opt": full, "extra": np.arange(4)})
        c.save(tmp_path / "masked", {"opt": masked})
    # A leaf saved as a MaskedNode comes back as orbax gives it onto a full target.
    for target in ({"opt": full},
                   {"opt": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                       sharding=x.sharding),
                                        full)}):
        with aj.StandardCheckpointer() as c:
            got = c.restore(tmp_path / "masked", target)
        _same(got, ocp.StandardCheckpointer().restore(tmp_path / "masked", target))
        assert got["opt"][0].mu["b"] is None
    # A MaskedNode in the target is kept, its saved array not read.
    with aj.PyTreeCheckpointer() as c:
        got = c.restore(tmp_path / "full", item={"opt": masked, "extra": 0})
    _same(got, ocp.PyTreeCheckpointer().restore(tmp_path / "full",
                                                item={"opt": masked, "extra": 0}))
    assert isinstance(got["opt"][0].mu["b"], optax.MaskedNode)
    # A None leaf of the target is skipped: its file is not even read (it is damaged here).
    with open(tmp_path / "full" / "extra" / "0", "r+b") as f:
        f.write(b"\xff" * 8)
    target = {"opt": full, "extra": None}
    with aj.StandardCheckpointer() as c:
        got = c.restore(tmp_path / "full", target)
    _same(got, ocp.StandardCheckpointer().restore(tmp_path / "full", target))
    assert got["extra"] is None


def test_restore_args_match_by_key_path_on_optax_and_flax_trees(tmp_path):
    train_state = pytest.importorskip("flax.training.train_state")
    tx = optax.chain(optax.add_decayed_weights(1e-4), optax.clip(1.0), optax.adam(1e-3))
    params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    tree = {"model": state, "config": {"dims": np.array([5, 3])}, "none": None, "empty": {}}
    with aj.PyTreeCheckpointer() as c:
        c.save(tmp_path / "ts", tree)
    # Made with jax.tree.map over the target: EmptyState() and None are no leaves on disk.
    restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
    with aj.PyTreeCheckpointer() as c:
        got = c.restore(tmp_path / "ts", item=tree, restore_args=restore_args)
        numpy_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        as_numpy = c.restore(tmp_path / "ts", item=tree, restore_args=numpy_args)
        # A partial item with the full tree's restore args.
        part = {"model": {"params": params}}
        partial = c.restore(tmp_path / "ts", args=ocp.args.PyTreeRestore(
            part, restore_args=restore_args, partial_restore=True))
    with ocp.PyTreeCheckpointer() as c:
        _same(got, c.restore(tmp_path / "ts", item=tree, restore_args=restore_args))
        _same(as_numpy, c.restore(tmp_path / "ts", item=tree, restore_args=numpy_args))
        _same(partial, c.restore(tmp_path / "ts", args=ocp.args.PyTreeRestore(
            part, restore_args=restore_args, partial_restore=True)))
    assert type(got["model"]) is train_state.TrainState
    assert isinstance(as_numpy["model"].params["dense"]["kernel"], np.ndarray)

    # ArrayRestoreArgs without a shape take the item's (a smaller one is refused), except
    # with transforms, where orbax reads the saved shape.
    with aj.PyTreeCheckpointer() as c:
        c.save(tmp_path / "w", {"w": jnp.arange(8.0)})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    small, args = {"w": jnp.zeros(4)}, {"w": ocp.ArrayRestoreArgs(sharding=device)}
    for checkpointer in (aj.PyTreeCheckpointer(), ocp.PyTreeCheckpointer()):
        with checkpointer as c:
            with pytest.raises(ValueError):
                c.restore(tmp_path / "w", item=small, restore_args=args)
            got = c.restore(tmp_path / "w", item=small, restore_args=args, transforms={})
            assert got["w"].shape == (8,) and got["w"].sharding == device


def test_save_refuses_with_the_exception_types_orbax_raises(tmp_path):
    bad = {"a str leaf": {"name": "adam"}, "an empty tree": {},
           "a bare array": jnp.ones(3), "an object": {"x": object()}}
    with aj.StandardCheckpointer() as c:
        for name, tree in bad.items():
            with pytest.raises(ValueError) as caught:
                c.save(tmp_path / name.replace(" ", "_"), tree)
            assert isinstance(caught.value, UnsupportedObjectError), name  # and TypeError
    with aj.CheckpointManager(tmp_path / "mgr") as mgr, pytest.raises(ValueError,
                                                                  match=r"builtins\.str"):
        mgr.save(0, {"name": "adam"})
    for name, tree in bad.items():  # orbax: ValueError too
        with ocp.StandardCheckpointer() as c, pytest.raises(ValueError):
            c.save(tmp_path / ("orbax_" + name.replace(" ", "_")), tree)


def test_transforms_are_applied_as_orbax_applies_them(tmp_path):
    tree = {"a": jnp.arange(3.0), "b": {"c": np.arange(2)}, "old": np.ones(2, np.float32)}
    with aj.PyTreeCheckpointer() as c:
        c.save(tmp_path / "t", tree)
    item = {"a": jnp.zeros(3), "b": {"c": np.zeros(2, np.int64)}, "new": np.ones(2, np.float32),
            "extra": np.full(2, 7.0)}
    cases = {
        "default": ({}, True),
        "rename and fallback": ({"new": ocp.Transform(original_key="old"),
                                 "b": {"c": ocp.Transform(use_fallback=True)}}, True),
        "from the item": ({"new": ocp.Transform(original_key="old")}, False),
    }
    for name, (transforms, default) in cases.items():
        args = ocp.args.PyTreeRestore(item, transforms=transforms,
                                      transforms_default_to_original=default,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(
                                          item))
        with aj.PyTreeCheckpointer() as c:
            got = c.restore(tmp_path / "t", args=args)
        _same(got, ocp.PyTreeCheckpointer().restore(tmp_path / "t", args=args))
        assert got["extra"].tolist() == [7.0, 7.0], name  # not in the checkpoint: the item's


def test_legacy_manager_spellings(tmp_path):
    tree = {"a": jnp.arange(3.0), "n": np.arange(2, dtype=np.int64) + BIG, "p": 3}
    extra = {"x": np.ones(2)}
    target = {"a": np.zeros(3, np.float32), "n": np.zeros(2, np.int32), "p": 0}
    args = ocp.checkpoint_utils.construct_restore_args(target)

    def managers(path, make):
        return make(aj, path), make(ocp, path)

    # One PyTreeCheckpointer, positionally: items= restores onto its structure.
    one = lambda lib, path: lib.CheckpointManager(path, lib.PyTreeCheckpointer())  # noqa: E731
    with one(aj, tmp_path / "one") as mgr:
        mgr.save(4, tree, save_kwargs={"save_args": jax.tree.map(lambda _: ocp.SaveArgs(), tree)})
    ours, theirs = managers(tmp_path / "one", one)
    with ours, theirs:
        _same(ours.restore(4, items=target), theirs.restore(4, items=target))
        _same(ours.restore(4, target), theirs.restore(4, target))
        _same(ours.restore(4, items=target, restore_kwargs={"restore_args": args}),
              theirs.restore(4, items=target, restore_kwargs={"restore_args": args}))
        assert ours.restore(4, items=target)["n"].tolist() == (np.arange(2) + BIG).tolist()
        assert jax.tree.map(lambda s: s.shape, ours.item_metadata(4)) == {
            "a": (3,), "n": (2,), "p": ()}
        assert ours.metrics(4) is None and ours.all_steps(read=True) == [4]

    # A dict of checkpointers: named items, saved and restored as dicts by name.
    named = lambda lib, path: lib.CheckpointManager(  # noqa: E731
        path, {"state": lib.PyTreeCheckpointer(), "extra": lib.PyTreeCheckpointer()})
    with named(aj, tmp_path / "named") as mgr:
        mgr.save(0, {"state": tree, "extra": extra})
    ours, theirs = managers(tmp_path / "named", named)
    with ours, theirs:
        got, want = ours.restore(0), theirs.restore(0)
        assert set(got) == set(want) == {"state", "extra"}
        for k in got:
            _same(got[k], want[k])
        got = ours.restore(0, items={"state": target},
                           restore_kwargs={"state": {"restore_args": args}})
        want = theirs.restore(0, items={"state": target},
                              restore_kwargs={"state": {"restore_args": args}})
        assert set(got) == set(want) == {"state"}
        _same(got["state"], want["state"])
        assert set(ours.item_metadata(0)) == {"state", "extra"}
    with aj.CheckpointManager(tmp_path / "named") as fresh:  # a new manager, no checkpointers
        assert set(fresh.item_metadata(0)) == {"state", "extra"}

    # A JSON item among them (orbax's own checkpointer of its JSON handler).
    json_too = lambda lib, path: lib.CheckpointManager(path, {  # noqa: E731
        "state": lib.PyTreeCheckpointer(), "meta": ocp.Checkpointer(ocp.JsonCheckpointHandler())})
    with json_too(aj, tmp_path / "json") as mgr:
        mgr.save(0, {"state": tree, "meta": {"epoch": 3}})
    ours, theirs = managers(tmp_path / "json", json_too)
    with ours, theirs:
        got = ours.restore(0, items={"state": target, "meta": None})
        want = theirs.restore(0, items={"state": target, "meta": None})
        assert got["meta"] == want["meta"] == {"epoch": 3}
        _same(got["state"], want["state"])


def test_typed_prng_keys_are_saved_and_restored_as_orbax_does(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    mesh = _mesh((4, 2), ("a", "b"))
    tree = {"k": jax.random.key(0), "rbg": jax.random.key(2, impl="rbg"), "w": jnp.ones(3),
            "ks": jax.device_put(jax.random.split(jax.random.key(1), 8),
                                 NamedSharding(mesh, P("a")))}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    for ocdbt in (True, False):
        ours, theirs = tmp_path / f"aj{ocdbt}", tmp_path / f"orbax{ocdbt}"
        with aj.StandardCheckpointer(use_ocdbt=ocdbt) as c:
            c.save(ours, tree)
        with ocp.StandardCheckpointer(use_ocdbt=ocdbt) as c:
            c.save(theirs, tree)
        for path in (ours, theirs):  # each library reads the other's
            for target in (None, abstract):
                with aj.StandardCheckpointer() as c:
                    got = c.restore(path, target)
                _same(got, tree)
                _same(got, ocp.StandardCheckpointer().restore(path, target))
        assert (ours / "array_metadatas" / "process_0").is_file()  # where orbax reads the impl

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 2, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

    model = Model(nnx.Rngs(0, dropout=1))
    model.dropout.rngs()  # the stream moves on: its count and key are the state
    state = nnx.state(model)
    with aj.StandardCheckpointer() as c:
        c.save(tmp_path / "nnx", state)
        abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0, dropout=1))))
        got = c.restore(tmp_path / "nnx", abstract)
    _same(got, state)
    _same(ocp.StandardCheckpointer().restore(tmp_path / "nnx", abstract), state)


def test_checkpointers_are_orbax_checkpointers_and_the_manager_an_abstract_manager(tmp_path):
    for name in ("Checkpointer", "AsyncCheckpointer", "StandardCheckpointer",
                 "PyTreeCheckpointer"):
        assert issubclass(getattr(aj, name), getattr(ocp, name)), name
    with aj.StandardCheckpointer() as c:
        assert isinstance(c, ocp.StandardCheckpointer) and isinstance(c, ocp.AsyncCheckpointer)
        with pytest.raises(NotImplementedError, match="wait_until_finished"):
            c.cancel()
    with aj.PyTreeCheckpointer() as c:
        assert isinstance(c, ocp.PyTreeCheckpointer) and not isinstance(c, ocp.AsyncCheckpointer)
    # orbax's AbstractCheckpointManager is a typing.Protocol that is not runtime
    # checkable: plain isinstance raises TypeError for any class, orbax's own manager
    # too. abc's checks and functools.singledispatch see the registration.
    kind = functools.singledispatch(lambda m: "other")
    kind.register(ocp.AbstractCheckpointManager, lambda m: "manager")
    with aj.CheckpointManager(tmp_path / "m") as mgr, ocp.CheckpointManager(tmp_path / "o") as om:
        for m in (mgr, om):
            assert abc.ABCMeta.__instancecheck__(ocp.AbstractCheckpointManager, m)
            assert kind(m) == "manager"


TOPOLOGY = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np
import asyncckpt.jax as aj
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
path = sys.argv[1]
for name, restore in (("asyncckpt", lambda t: aj.StandardCheckpointer().restore(path, t)),
                      ("orbax", lambda t: ocp.StandardCheckpointer().restore(path, t))):
    try:
        restore(None)
        print(name, "restored")
    except ValueError as e:
        print(name, "ValueError", type(e).__name__)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    target = {"w": jax.ShapeDtypeStruct((8, 2), np.float32, sharding=NamedSharding(mesh, P("x"))),
              "n": np.zeros(3, np.int64)}
    got = restore(target)
    print(name, "onto a target", got["w"].sharding.mesh.devices.shape, got["n"].tolist())
"""


def test_a_restore_without_a_target_raises_orbax_error_on_another_topology(tmp_path):
    state = {"w": jax.device_put(jnp.arange(16.0).reshape(8, 2),
                                 NamedSharding(_mesh((4, 2), ("a", "b")), P("a", "b"))),
             "n": np.arange(3, dtype=np.int64) + BIG}
    with aj.StandardCheckpointer() as c:
        c.save(tmp_path / "s", state)
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = run_python(write_script(tmp_path, "topology.py", TOPOLOGY), str(tmp_path / "s"),
                      env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = (np.arange(3) + BIG).tolist()
    for name, error in (("asyncckpt", "TopologyMismatchError"), ("orbax", "ValueError")):
        assert f"{name} ValueError {error}" in proc.stdout, proc.stdout
        assert f"{name} onto a target (2, 2) {n}" in proc.stdout, proc.stdout


@pytest.mark.parametrize("ocdbt", [True, False])
def test_a_damaged_array_metadatas_file_fails_the_restore_naming_it(tmp_path, ocdbt):
    with aj.StandardCheckpointer(use_ocdbt=ocdbt) as c:
        c.save(tmp_path / "k", {"k": jax.random.key(0)})
    path = tmp_path / "k" / "array_metadatas" / "process_0"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with aj.StandardCheckpointer() as c, pytest.raises(ValueError, match="process_0"):
        c.restore(tmp_path / "k")
    assert os.path.isdir(tmp_path / "k")


@pytest.mark.parametrize("ocdbt", [True, False])
def test_numpy_leaves_restored_are_the_callers_own_writable_arrays(tmp_path, ocdbt):
    """NumPy leaves are handed over in the buffers the restore read them into (no second
    copy): each restore's are its own, writable, and changing one changes nothing else."""
    state = {"w": np.arange(1 << 16, dtype=np.float32), "b": np.arange(8, dtype=np.int64)}
    with aj.CheckpointManager(tmp_path / "run",
                              format_options=aj.FormatOptions(use_ocdbt=ocdbt)) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        first, second = mgr.restore(1), mgr.restore(1)
    for name in state:
        assert isinstance(first[name], np.ndarray) and first[name].flags.writeable
        first[name][:] = 7
        np.testing.assert_array_equal(second[name], state[name])
    with aj.CheckpointManager(tmp_path / "run") as mgr:
        np.testing.assert_array_equal(mgr.restore(1)["w"], state["w"])

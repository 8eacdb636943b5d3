"""MaxText's checkpointing (``src/MaxText/checkpointing.py``) with asyncckpt's manager swapped in.

``create_manager`` builds what MaxText's ``create_orbax_checkpoint_manager``
builds (the emergency-checkpoint managers aside); ``save_state`` and
``load_state`` make the calls of its ``save_checkpoint``/
``maybe_save_checkpoint`` and ``load_state_if_possible``, as its train loop
makes them: a flax ``TrainState`` with an optax AdamW state, sharded over 8
devices, saved as zarr v3 (MaxText's default ``use_zarr3=True``), OCDBT or
not, with ``SaveArgs(chunk_byte_size=...)`` on every leaf and the same
``ocdbt_target_data_file_size``. The only change is the manager class:
``asyncckpt.jax.CheckpointManager`` for orbax's. The same function with
orbax's own class restores what asyncckpt wrote.

MaxText passes ``ocdbt_target_data_file_size`` whatever its ``use_ocdbt``:
without OCDBT there are no data files for it to size, as in orbax.

Written for asyncckpt, following MaxText's code; none of it is copied.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")
train_state = pytest.importorskip("flax.training.train_state")

import jax.numpy as jnp  # noqa: E402
from etils import epath  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402

# MaxText's globals.DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE (2 GiB); a small one makes
# several zarr chunks per array here.
CHUNK_BYTE_SIZE = 2 * 1024**3
SMALL_CHUNK_BYTE_SIZE = 4096


class RecordingLogger(ocp.logging.AbstractLogger):
    """An orbax logger (MaxText passes its cloud logger, or None)."""

    def __init__(self):
        self.entries: list[dict] = []

    def log_entry(self, entry: dict) -> None:
        self.entries.append(entry)


def create_manager(manager_class, checkpoint_dir, enable_checkpointing: bool, use_async: bool,
                   save_interval_steps: int, dataset_type: str = "tfds", orbax_logger=None,
                   use_ocdbt: bool = True, use_zarr3: bool = True):
    """What MaxText's ``create_orbax_checkpoint_manager`` builds, with ``manager_class``."""
    if not enable_checkpointing:
        return None
    names = ("items", "iter") if dataset_type == "grain" else ("items",)
    directory = epath.Path(checkpoint_dir)
    directory.mkdir(exist_ok=True, parents=True)
    return manager_class(
        directory,
        item_names=names,
        item_handlers={"items": ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt,
                                                            use_zarr3=use_zarr3)},
        options=ocp.CheckpointManagerOptions(create=True, save_interval_steps=save_interval_steps,
                                             enable_async_checkpointing=use_async),
        logger=orbax_logger,
    )


def save_state(manager, step: int, state, *, period: int, chunk_byte_size: int,
               final: bool = False) -> bool:
    """MaxText's ``maybe_save_checkpoint`` and ``save_checkpoint`` (no grain, no emergency)."""
    force = final and step % period != 0
    if force or step % period == 0:
        jax.block_until_ready(state)
    item = ocp.args.PyTreeSave(
        item=state,
        save_args=jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk_byte_size), state),
        ocdbt_target_data_file_size=chunk_byte_size,
    )
    saved = manager.save(step, args=ocp.args.Composite(items=item), force=force)
    if force or manager.reached_preemption(step):
        manager.wait_until_finished()
    return saved


def load_state(manager, abstract_state):
    """MaxText's ``load_state_if_possible`` for its own run directory (step -1: the latest)."""
    step = manager.latest_step()
    if step is None:
        return None
    restore_args = jax.tree_util.tree_map(
        lambda leaf: ocp.type_handlers.ArrayRestoreArgs(sharding=leaf.sharding), abstract_state)
    return manager.restore(step, args=ocp.args.Composite(
        items=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args)))


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def _model():
    """A two-layer model's params and shardings (rows over "data", columns over "model")."""
    mesh = _mesh()
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": rng.standard_normal((32, 16)).astype(np.float32),
                        "bias": np.zeros(16, np.float32)},
              "embed": rng.standard_normal((256, 64)).astype(jnp.bfloat16)}
    specs = {"dense": {"kernel": P("data", "model"), "bias": P("model")},
             "embed": P("data", None)}
    return params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


# One optimizer for every state: it is the TrainState's static part.
TX = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 100), weight_decay=1e-4)


def _initial_state(shardings):
    params, _ = _model()

    def init():
        return train_state.TrainState.create(apply_fn=None, params=params, tx=TX)

    abstract = jax.eval_shape(init)
    replicated = NamedSharding(_mesh(), P())
    state_shardings = jax.tree.map(lambda _: replicated, abstract)
    state_shardings = state_shardings.replace(
        params=shardings,
        opt_state=jax.tree.map(lambda _: replicated, abstract.opt_state))
    # mu and nu are sharded as the params are.
    adam = state_shardings.opt_state[0]
    state_shardings = state_shardings.replace(opt_state=(
        adam._replace(mu=shardings, nu=shardings), *state_shardings.opt_state[1:]))
    return jax.jit(init, out_shardings=state_shardings)(), state_shardings


def _train_step(state, batch):
    def loss(params):
        hidden = batch @ params["dense"]["kernel"] + params["dense"]["bias"]
        return jnp.mean(hidden ** 2) + jnp.mean(params["embed"].astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(state.params)
    return state.apply_gradients(grads=grads)


def _batch(step: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(step).standard_normal((4, 32)), jnp.float32)


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def _same(expected, got) -> None:
    assert jax.tree.structure(expected) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        if isinstance(a, jax.Array):
            assert b.sharding.is_equivalent_to(a.sharding, a.ndim)


def _run(manager, state, shardings, start: int, stop: int, *, period: int,
         chunk_byte_size: int, last: int):
    step_fn = jax.jit(_train_step, in_shardings=(shardings, None), out_shardings=shardings,
                      donate_argnums=0)
    for step in range(start, stop):
        state = step_fn(state, _batch(step))
        save_state(manager, step, state, period=period, chunk_byte_size=chunk_byte_size)
    if stop == last:  # MaxText's save on completion, then its final wait
        save_state(manager, stop - 1, state, period=period, chunk_byte_size=chunk_byte_size,
                   final=True)
    manager.wait_until_finished()
    return state


def _reference(steps: int):
    """The state after ``steps`` uninterrupted steps, no checkpoints."""
    _, shardings = _model()
    state, state_shardings = _initial_state(shardings)
    step_fn = jax.jit(_train_step, out_shardings=state_shardings)
    for step in range(steps):
        state = step_fn(state, _batch(step))
    return state


PERIOD, STEPS = 3, 8


@pytest.mark.parametrize("use_ocdbt,use_async,chunk_byte_size", [
    (True, True, SMALL_CHUNK_BYTE_SIZE),
    (True, False, CHUNK_BYTE_SIZE),
    (False, False, CHUNK_BYTE_SIZE),
])
def test_maxtext_checkpointing_saves_with_asyncckpts_manager_and_resumes(
        tmp_path, use_ocdbt, use_async, chunk_byte_size):
    """A run stopped after step 4 resumes from its latest checkpoint (step 3) and ends
    where an uninterrupted run does. MaxText's ``load_state_if_possible`` runs with
    orbax's manager, built by the same function: asyncckpt's own runs of it are the
    next test."""
    directory = tmp_path / "checkpoints"
    reference = _reference(STEPS)
    _, shardings = _model()
    state, state_shardings = _initial_state(shardings)
    abstract = _abstract(state)

    logger = RecordingLogger()
    manager = create_manager(aj.CheckpointManager, directory, True, use_async, PERIOD,
                             orbax_logger=logger, use_ocdbt=use_ocdbt)
    assert isinstance(manager, aj.CheckpointManager)
    assert load_state(manager, abstract) is None  # nothing saved yet
    _run(manager, state, state_shardings, 0, 5, period=PERIOD,
         chunk_byte_size=chunk_byte_size, last=STEPS)
    assert manager.all_steps() == [0, 3]
    manager.close()
    assert logger.entries and all(e["event_type"] == "save" for e in logger.entries)

    # The restart: MaxText's restore of its latest step, then the rest of the run.
    with create_manager(ocp.CheckpointManager, directory, True, False, PERIOD,
                        use_ocdbt=use_ocdbt) as theirs:
        state = load_state(theirs, abstract)["items"]
    assert int(state.step) == 4
    manager = create_manager(aj.CheckpointManager, directory, True, use_async, PERIOD,
                             use_ocdbt=use_ocdbt)
    state = _run(manager, state, state_shardings, 4, STEPS, period=PERIOD,
                 chunk_byte_size=chunk_byte_size, last=STEPS)
    assert manager.all_steps() == [0, 3, 6, 7]  # 7: the save on completion (forced)
    _same(reference, state)
    # asyncckpt's own reader restores the last step exactly, onto the same shardings.
    got = manager.restore(7, args=ocp.args.Composite(items=ocp.args.PyTreeRestore(abstract)))
    _same(reference, got["items"])
    manager.close()
    with create_manager(ocp.CheckpointManager, directory, True, False, PERIOD,
                        use_ocdbt=use_ocdbt) as theirs:
        assert theirs.latest_step() == 7
        _same(reference, load_state(theirs, abstract)["items"])

    # What is on disk: zarr v3 arrays, OCDBT or files, split into chunks as asked.
    item = directory / "7" / "items"
    meta = json.loads((item / "_METADATA").read_text())
    assert meta["use_zarr3"] is True and meta["use_ocdbt"] is use_ocdbt
    if not use_ocdbt:
        kernel = item / "params.dense.kernel"
        assert json.loads((kernel / "zarr.json").read_text())["zarr_format"] == 3
        assert sorted(p.relative_to(kernel).as_posix() for p in kernel.rglob("*")
                      if p.is_file() and p.name != "zarr.json") == [
            f"c/{i}/{j}" for i in range(4) for j in range(2)]
    else:
        assert (item / "manifest.ocdbt").is_file()
        import tensorstore as ts

        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
        keys = [k.decode() for k in kv.list().result()]
        assert "params.dense.kernel/zarr.json" in keys
        # 32 x 16 float32 (2 KiB) in 8 shards of 256 B: one chunk each.
        assert len([k for k in keys if k.startswith("params.dense.kernel/c/")]) == 8
        # 256 x 64 bfloat16 over 4 devices: shards of 8 KiB, in chunks of 4 KiB at most.
        split = chunk_byte_size < 8192
        assert sorted(k for k in keys if k.startswith("params.embed/c/")) == [
            f"params.embed/c/{i}/0" for i in range(8 if split else 4)]
        embed = json.loads(kv.read("params.embed/zarr.json").result().value)
        assert embed["chunk_grid"]["configuration"]["chunk_shape"] == [32 if split else 64, 64]


def test_maxtext_load_state_if_possible_with_asyncckpts_manager(tmp_path):
    """MaxText's ``load_state_if_possible`` (its ``ArrayRestoreArgs`` tree) run with
    asyncckpt's manager."""
    directory = tmp_path / "checkpoints"
    _, shardings = _model()
    state, state_shardings = _initial_state(shardings)
    abstract = _abstract(state)
    with create_manager(aj.CheckpointManager, directory, True, True, PERIOD) as manager:
        state = _run(manager, state, state_shardings, 0, 4, period=PERIOD,
                     chunk_byte_size=CHUNK_BYTE_SIZE, last=STEPS)
        _same(state, load_state(manager, abstract)["items"])

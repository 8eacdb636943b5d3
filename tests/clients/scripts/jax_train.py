"""A small JAX training run, checkpointed the way large JAX codebases do it with orbax 0.12.8.

Real client code for ``tests/clients/test_jax_training_script.py``: it is written
against ``orbax.checkpoint`` only, and the test runs it unchanged (with orbax)
and with one line changed, the import of ``CheckpointManager`` (marked below).
Its checkpointing module uses the ``CheckpointManager`` spellings real trainers
use: orbax's save-decision and preservation policy objects, a commit-file
temporary path, orbax's ``AsyncOptions`` (timeout, post-finalization callback,
directory creation), a structured ``logger``, ``item_names`` together with
``item_handlers``, one handler as ``item_handlers``, ``SaveArgs`` with default
fields and with ``chunk_byte_size``, the older positional form with an
``AsyncCheckpointer``, and ``manager.directory`` as a path.

Usage: ``python jax_train.py WORKDIR STEPS``. Prints one ``RESULT {json}`` line.
"""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import linen as nn
from flax.training import orbax_utils, train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint import CheckpointManager  # the line a user changes

policies = ocp.checkpoint_managers


# -- checkpointing.py ----------------------------------------------------------------


class JsonlLogger(ocp.logging.AbstractLogger):
    """Checkpoint events as JSON lines, for the run's dashboards."""

    def __init__(self, path):
        self._path = path

    def log_entry(self, entry):
        with open(self._path, "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")


@dataclasses.dataclass
class CheckpointConfig:
    directory: str
    save_interval_steps: int = 3
    max_to_keep: int = 2
    keep_period: int = 6
    enable_async: bool = True
    chunk_byte_size: int = 256


def create_checkpoint_manager(config, *, logger, on_committed):
    """The run's main manager: train state and a JSON item of run metadata."""
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(config.save_interval_steps),
            policies.PreemptionCheckpointingPolicy(),
            policies.InitialSavePolicy(),
        ]),
        preservation_policy=policies.AnyPreservationPolicy([
            policies.LatestN(n=config.max_to_keep),
            policies.EveryNSteps(interval_steps=config.keep_period),
        ]),
        # The bucket is mounted through gcsfuse in production: no atomic rename.
        temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath,
        async_options=ocp.AsyncOptions(
            timeout_secs=600,
            post_finalization_callback=on_committed,
            create_directories_asynchronously=True,
        ),
        cleanup_tmp_directories=True,
        enable_async_checkpointing=config.enable_async,
        enable_background_delete=True,
    )
    return CheckpointManager(
        config.directory,
        options=options,
        item_names=("state", "run_metadata"),
        item_handlers={"state": ocp.StandardCheckpointHandler(use_ocdbt=False)},
        logger=logger,
    )


def create_best_manager(directory):
    """Params of the best evaluation so far (one handler: the unnamed item)."""
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policies.BestN(
            get_metric_fn=lambda metrics: metrics["eval_loss"], reverse=True, n=1),
    )
    return CheckpointManager(directory, options=options,
                             item_handlers=ocp.PyTreeCheckpointHandler(use_ocdbt=False),
                             metadata={"purpose": "best eval params"})


def create_export_manager(directory):
    """The exported params, in the positional form of Flax's checkpointing guide."""
    checkpointer = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
    return CheckpointManager(directory, checkpointer, options)


def save_args_for(state, chunk_byte_size):
    """Large arrays are written in chunks of at most ``chunk_byte_size`` bytes."""
    return jax.tree.map(
        lambda x: ocp.SaveArgs(chunk_byte_size=chunk_byte_size)
        if getattr(x, "nbytes", 0) > chunk_byte_size else ocp.SaveArgs(), state)


def abstract_of(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


# -- train.py ------------------------------------------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(1)(x)


def make_state(mesh):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
    # Shard every matrix over the model axis (its last dimension), replicate the rest.
    params = jax.tree.map(lambda p: jax.device_put(p, NamedSharding(
        mesh, P(None, "model") if p.ndim == 2 and p.shape[-1] % 8 == 0 else P())), params)
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-2))


def batch(step):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(32, 16)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True) * 0.1


@jax.jit
def loss_fn(params, state, x, y):
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)


@jax.jit
def train_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state, x, y)
    return state.apply_gradients(grads=grads), loss


def main(workdir, steps):
    mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
    config = CheckpointConfig(directory=os.path.join(workdir, "checkpoints"))
    committed = []
    logger = JsonlLogger(os.path.join(workdir, "checkpoint_events.jsonl"))
    mngr = create_checkpoint_manager(config, logger=logger,
                                     on_committed=lambda: committed.append(1))
    best = create_best_manager(os.path.join(workdir, "best"))
    state = make_state(mesh)
    saved, best_saved = [], []
    half = steps // 2
    for step in range(steps):
        if step == half:  # a restart: a new manager resumes from the latest step
            mngr.close()
            mngr = create_checkpoint_manager(config, logger=logger,
                                             on_committed=lambda: committed.append(1))
            latest = mngr.latest_step()
            restored = mngr.restore(latest, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_of(state)),
                run_metadata=ocp.args.JsonRestore()))
            state = restored.state
            assert restored.run_metadata["step"] == latest
        state, loss = train_step(state, *batch(step))
        if mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state, save_args=save_args_for(
                    state, config.chunk_byte_size)),
                run_metadata=ocp.args.JsonSave({"step": step, "loss": float(loss)})),
                metrics={"loss": float(loss)}):
            saved.append(step)
        if step % 4 == 3:
            eval_loss = float(loss_fn(state.params, state, *batch(10_000)))
            if best.save(step, args=ocp.args.PyTreeSave(state.params),
                         metrics={"eval_loss": eval_loss}):
                best_saved.append(step)
    mngr.wait_until_finished()
    best.wait_until_finished()
    export = create_export_manager(os.path.join(workdir, "export"))
    export.save(steps, state.params,
                save_kwargs={"save_args": orbax_utils.save_args_from_target(state.params)})
    export.wait_until_finished()
    listed = sorted(p.name for p in mngr.directory.iterdir() if p.name.isdigit())
    params = {"/".join(str(k.key) for k in path): np.asarray(leaf)
              for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)}
    np.savez(os.path.join(workdir, "final_params.npz"), **params)
    result = {
        "saved": saved, "all_steps": list(mngr.all_steps()), "on_disk": listed,
        "best_saved": best_saved, "best_steps": list(best.all_steps()),
        "export_steps": list(export.all_steps()), "committed_callbacks": len(committed),
        "final_step": int(state.step),
    }
    for m in (mngr, best, export):
        m.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

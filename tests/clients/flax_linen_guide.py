"""Flax's Linen checkpointing guide, step by step, with asyncckpt's manager and checkpointers.

Written for asyncckpt's tests after Flax's guide "Save and load checkpoints"
(``docs/guides/training_techniques/use_checkpointing``, Linen). The guide
uses ``orbax.checkpoint.PyTreeCheckpointer``, ``CheckpointManager`` and
``AsyncCheckpointer``; here those three come from ``asyncckpt.jax`` (the
only change), or from orbax itself when the second argument is ``orbax``,
so the test can run the same steps with both and compare. Everything else
is the guide's API usage: a Flax ``TrainState`` with an optax optimizer,
``orbax_utils.save_args_from_target`` / ``restore_args_from_target``, the
legacy ``save(step, items, save_kwargs=...)`` and ``restore(step,
items=..., restore_kwargs=...)`` spellings, ``transforms``, and Flax's own
``checkpoints.save_checkpoint_multiprocess`` / ``restore_checkpoint`` given
the checkpointer.

Where orbax 0.12.8 itself no longer does what the guide shows, the step is
kept and its outcome recorded (the test checks asyncckpt's is the same):
restoring step 5 onto the smaller ``TrainState`` target (orbax raises
``ValueError``, the guide shows a partial restore); the first restore of
"scenario 2" (orbax raises ``ValueError``, the guide catches ``KeyError``);
the multi-process restore onto a smaller reference (orbax raises
``ValueError``: the reference's shape is asked for). The guide's
``jax.distributed.initialize`` comes after JAX has started, which JAX 0.10
refuses; it is left out (neither library needs it in one process).

Each step prints ``STEP <name> <json>``: what it returned, leaf by leaf
(type, dtype, values, sharding), or the exception type it raised.

Usage: python flax_linen_guide.py <empty directory> asyncckpt|orbax   (8 CPU devices)
"""

import json
import os
import re
import sys
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint
from flax import linen as nn
from flax.training import checkpoints, orbax_utils, train_state
from jax import numpy as jnp
from jax import random

if sys.argv[2] == "orbax":
    aj = orbax.checkpoint
else:
    import asyncckpt.jax as aj  # the guide: orbax.checkpoint's manager and checkpointers

base = sys.argv[1]


def describe(tree: Any) -> Any:
    """A JSON-able account of a restored tree: structure and every leaf."""
    def leaf(x):
        if isinstance(x, jax.Array):
            return ["jax", str(x.dtype), np.asarray(x).tolist(), repr(x.sharding)]
        if isinstance(x, np.ndarray):
            return ["numpy", str(x.dtype), x.tolist()]
        if isinstance(x, np.generic):
            return ["npscalar", str(x.dtype), x.item()]
        if x is None or isinstance(x, (bool, int, float, str)):
            return [type(x).__name__, x]
        return [type(x).__name__]
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    shown = re.sub(r" at 0x[0-9a-f]+", "", str(treedef))  # functions' addresses differ
    return {"tree": shown, "leaves": [leaf(x) for x in leaves]}


def step(name: str, fn) -> Any:
    try:
        out = fn()
    except Exception as e:  # recorded, compared with orbax's
        print(f"STEP {name} " + json.dumps({"raised": type(e).__name__,
                                            "value_error": isinstance(e, ValueError)}))
        return None
    print(f"STEP {name} " + json.dumps(describe(out)), flush=True)
    return out


# -- Save checkpoints ---------------------------------------------------------------------
key1, key2 = random.split(random.key(0))
x1 = random.normal(key1, (5,))
model = nn.Dense(features=3)
variables = model.init(key2, x1)
tx = optax.sgd(learning_rate=0.001)
state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)
state = state.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, state.params))
config = {"dimensions": np.array([5, 3])}
ckpt = {"model": state, "config": config, "data": [x1]}

orbax_checkpointer = aj.PyTreeCheckpointer()
save_args = orbax_utils.save_args_from_target(ckpt)
orbax_checkpointer.save(f"{base}/orbax/single_save", ckpt, save_args=save_args)

options = orbax.checkpoint.CheckpointManagerOptions(max_to_keep=2, create=True)
checkpoint_manager = aj.CheckpointManager(f"{base}/orbax/managed", orbax_checkpointer, options)
for i in range(5):
    checkpoint_manager.save(i, ckpt, save_kwargs={"save_args": save_args})
checkpoint_manager.wait_until_finished()
listed = sorted(n for n in os.listdir(f"{base}/orbax/managed") if not n.startswith("."))
print("STEP listdir " + json.dumps(listed))  # the guide: only steps 3 and 4 are retained

checkpoints.save_checkpoint(ckpt_dir=f"{base}/flax-checkpointing", target=ckpt, step=0,
                            overwrite=True, keep=2)

# -- Restore checkpoints --------------------------------------------------------------------
step("raw_restored", lambda: orbax_checkpointer.restore(f"{base}/orbax/single_save"))
latest = checkpoint_manager.latest_step()
print(f"STEP latest_step {latest}")
step("manager_raw", lambda: checkpoint_manager.restore(latest))
step("legacy_raw", lambda: checkpoints.restore_checkpoint(
    ckpt_dir=f"{base}/flax-checkpointing", target=None))

# -- Restore with custom dataclasses ---------------------------------------------------------
empty_state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=jax.tree_util.tree_map(np.zeros_like, variables["params"]),
    tx=tx,
)
empty_config = {"dimensions": np.array([0, 0])}
target = {"model": empty_state, "config": empty_config, "data": [jnp.zeros_like(x1)]}
restored = step("state_restored", lambda: orbax_checkpointer.restore(
    f"{base}/orbax/single_save", item=target))
assert type(restored["model"]) is train_state.TrainState
restored = step("manager_items", lambda: checkpoint_manager.restore(4, items=target))
assert type(restored["model"]) is train_state.TrainState
step("legacy_target", lambda: checkpoints.restore_checkpoint(
    ckpt_dir=f"{base}/flax-checkpointing", target=target))


# -- Restore when checkpoint structures differ ------------------------------------------------
class CustomTrainState(train_state.TrainState):
    batch_stats: Any = None


custom_state = CustomTrainState.create(apply_fn=state.apply_fn, params=state.params,
                                       tx=state.tx, batch_stats=np.arange(10))
custom_ckpt = {"model": custom_state, "config": config, "data": [x1]}
custom_target = {"model": custom_state, "config": None, "data": [jnp.zeros_like(x1)]}
custom_save_args = orbax_utils.save_args_from_target(custom_ckpt)
checkpoint_manager.save(5, custom_ckpt, save_kwargs={"save_args": custom_save_args})

# Scenario 1 (orbax 0.12.8 raises ValueError here: the target has fewer leaves).
restored = step("scenario1", lambda: checkpoint_manager.restore(5, items=target))
if restored is not None:
    assert not hasattr(restored, "batch_stats")
    assert type(restored["model"]) is train_state.TrainState

# Scenario 2: the guide catches KeyError; orbax 0.12.8 raises ValueError.
step("scenario2_plain", lambda: checkpoint_manager.restore(4, items=custom_target))
custom_restore_args = orbax_utils.restore_args_from_target(custom_target)
restored = step("scenario2_transforms", lambda: checkpoint_manager.restore(
    4, items=custom_target,
    restore_kwargs={"transforms": {}, "restore_args": custom_restore_args}))
assert type(restored["model"]) is CustomTrainState
np.testing.assert_equal(restored["model"].batch_stats, custom_target["model"].batch_stats)

# -- Asynchronous checkpointing ---------------------------------------------------------------
# (The guide's jax.distributed.initialize: left out, see the docstring.)
async_checkpointer = aj.AsyncCheckpointer(orbax.checkpoint.PyTreeCheckpointHandler(),
                                          timeout_secs=50)
async_checkpointer.save(f"{base}/orbax/single_save_async", ckpt, save_args=save_args)
async_checkpointer.wait_until_finished()
step("async_restore", lambda: async_checkpointer.restore(
    f"{base}/orbax/single_save_async", item=target))
async_checkpoint_manager = aj.CheckpointManager(f"{base}/orbax/managed_async",
                                                async_checkpointer, options)
async_checkpoint_manager.wait_until_finished()

# -- Multi-host/multi-process checkpointing ----------------------------------------------------
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

devices = np.asarray(jax.devices()).reshape(4, 2)
mesh = jax.sharding.Mesh(devices, ("x", "y"))
mp_array = jax.device_put(np.arange(8 * 2).reshape(8, 2),
                          NamedSharding(mesh, PartitionSpec("x", "y")))
mp_ckpt = {"model": mp_array}
async_checkpoint_manager.save(0, mp_ckpt)
async_checkpoint_manager.wait_until_finished()
mp_smaller = jax.device_put(np.arange(8).reshape(4, 2),
                            NamedSharding(mesh, PartitionSpec("x", "y")))
ref_ckpt = {"model": mp_smaller}
restore_args = orbax_utils.restore_args_from_target(ref_ckpt)
# orbax 0.12.8 raises ValueError: the reference's shape (4, 2) is asked for.
step("mp_restore", lambda: async_checkpoint_manager.restore(
    0, items=ref_ckpt, restore_kwargs={"restore_args": restore_args}))

async_checkpointer = aj.AsyncCheckpointer(orbax.checkpoint.PyTreeCheckpointHandler(),
                                          timeout_secs=50)
ckpt_dir = f"{base}/flax_ckpt"
checkpoints.save_checkpoint_multiprocess(ckpt_dir, mp_ckpt, step=3, overwrite=True, keep=4,
                                         orbax_checkpointer=async_checkpointer)
step("mp_restored", lambda: checkpoints.restore_checkpoint(
    ckpt_dir, target=ref_ckpt, step=3, orbax_checkpointer=async_checkpointer))

# -- The files again, restored by orbax's own checkpointer and manager ------------------------
reader = orbax.checkpoint.PyTreeCheckpointer()
step("orbax_reads_single_save", lambda: reader.restore(f"{base}/orbax/single_save",
                                                       item=target))
step("orbax_reads_async", lambda: reader.restore(f"{base}/orbax/single_save_async"))
with orbax.checkpoint.CheckpointManager(f"{base}/orbax/managed",
                                        orbax.checkpoint.PyTreeCheckpointer()) as reading:
    step("orbax_manager_reads", lambda: reading.restore(4, items=target))
for closing in (checkpoint_manager, async_checkpoint_manager, async_checkpointer,
                orbax_checkpointer):
    closing.close()
print("GUIDE OK", flush=True)
